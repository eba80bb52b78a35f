"""Sinks: where the pipeline writes a decoded batch, behind the ``Sink`` protocol (``sink.py``).

A sink answers one question per batch, "write this; what was written, what refused for good, or must
it be retried later?" (``SinkResult``), and bounds what a batch becomes on the way out
(``request_bound``), so the decode stage can refuse a small batch that would become a huge request.
How it retries, batches requests or narrows a refusal down to samples is its own business: the
pipeline only sees the result.

``remote_write/`` is Prometheus remote-write 1.0, the first sink. ``fanout.py`` is a sink over several
sinks (one per configured target), each with its own queue and threads: a batch is final when every
required target has it. ``relabeled.py`` wraps a target's sink with its ``write_relabel_configs``
(its own copy of each batch relabeled). A new sink is one subpackage here with a class that has ``write``,
``request_bound`` and ``close``, built in ``app.py``.
"""
