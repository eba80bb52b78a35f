"""The operator's commands besides ``run`` (``cli.py`` lists them): each module has ``add_arguments`` and
``run``, and is imported only when its command is used.

- ``checkconfig.py``: ``check-config``; its ``validate`` is what ``run`` checks at start-up too.
- ``deadletters.py``: ``dead-letters``: list the dead letters, replay them through the remote-write
  client after decoding them again.
- ``fleet.py``: ``fleet``: one line per edge node, from the retained statuses and an ingester's metrics.
- ``backfill.py``: ``backfill``: ask one relay for a time range again from its flight recorder.
- ``broker.py``: the one-shot broker connection ``fleet`` and ``backfill`` use (the ingester's
  identity, a clean session of their own).

Commands read the stages' parts (the dead-letter store, the decode stage, the fleet view); no stage
imports a command, except ``app.py`` for ``validate``.
"""
