"""The pipeline: one batch message from its bytes to its ``Outcome``, with no transport in it.

Stages, in order (``flow.py`` runs them):

- ``decode.py``: the untrusted payload -> a validated batch, or a refusal with a reason: the codec's
  checks, the node's identity from the topic (``pin_identity``: no series may claim another node),
  samples too far in the future split off (``cloud_ingest.isolate.split_future``), and a batch
  refused whose request at the sink would be far larger than itself (the sink's ``request_bound``).
  v3 frames decode against ``stream_state.py``, the per-process stream state that the intake's follow
  path also advances.
- the sink (``sinks/``): writes the batch, and says what was written, what refused for good, or that
  it must be retried later.
- ``finish.py``: what becomes of it: the dead letter stored first (refused samples, invalid payloads),
  the fleet view and the counters, then the ``Outcome`` with the answer for the edge.

Invariants: ``Pipeline.handle`` returns, never settles: the intake does, by the outcome, so nothing is
answered before the dead letter is stored. Thread-safe: the intake's workers run it in parallel, one
batch of a node at a time. A batch that cannot be finished (receiver down, dead-letter store full,
stopping) yields an outcome that answers nothing, so the edge keeps it.
"""
