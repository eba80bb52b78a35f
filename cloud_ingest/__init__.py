"""The cloud ingester: batches from edge relays -> Prometheus remote-write, an answer back to each relay.

Floor plan, in the order a batch passes it (each package's docstring is its design):

- ``intake/``: receives batch messages and settles them. ``intake/mqtt/`` is the MQTT intake (shared
  subscriptions, flow control, manual PUBACK after the outcome is final, following v3 stream state, the
  fleet's statuses and every replica's acks); ``intake/workers.py`` the node-ordered worker threads any
  intake runs its batches on.
- ``pipeline/``: one batch, with no transport in it: decode -> sink -> finish, to an ``Outcome``.
- ``sinks/``: where batches are written, behind the ``Sink`` protocol; ``sinks/remote_write/`` is
  Prometheus remote-write 1.0 (one target: credentials, TLS, proxy), ``sinks/relabeled.py`` a target's
  ``write_relabel_configs``, ``sinks/fanout.py`` several targets, each with its own queue.
- ``outcome/``: what becomes of batches: the answer the edge is told, the dead-letter store, the fleet
  view.
- ``commands/``: the operator's commands besides ``run`` (``dead-letters``, ``fleet``, ``backfill``,
  ``check-config``).
- ``app.py`` builds the parts in dependency order and runs them (``cloud-ingest run``); ``cli.py`` is
  the command table. Cross-cutting: ``settings.py`` (the typed config), ``selfmetrics.py`` (every
  ``cloud_ingest_*`` metric), ``isolate.py`` (cutting a batch by sample: used by the decode stage for
  samples too far in the future and by the remote-write sink for the samples a receiver refuses),
  ``once.py`` (log lines once per node and reason).

Invariants: data flows one way (intake -> pipeline -> sink -> outcome), results come back as return
values; no part calls back into the one that feeds it, and none imports ``edge_relay`` (what both sides
share is in ``schemas`` and ``relay_common``). Nothing is acked before its outcome is final and what is
kept of it is stored; a batch that cannot be finished is left to the edge, which keeps it and sends it
again.

Adding a sink: a subpackage of ``sinks/`` with a class that has ``write``, ``request_bound`` and
``close`` (``sinks/sink.py``), built in ``app.py``. Adding an intake: a subpackage of ``intake/`` that
hands ``Pipeline.handle`` a ``Delivery`` on the node's worker and settles its message by the ``Outcome``
(``intake/__init__.py``); the pipeline does not change.
"""
