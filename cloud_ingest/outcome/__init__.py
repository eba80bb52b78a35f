"""What becomes of batches, kept and told: the last things a batch passes.

- ``answer.py``: the ``Outcome`` of one batch message and the ``Answer`` the edge is told (its
  application ack): what the intake settles the message by.
- ``deadletters.py``: the dead-letter store: batches that can never be written, with the reason, for
  an operator to inspect and replay (``cloud-ingest dead-letters``); capped in bytes.
- ``fleet.py``: the fleet view: every node's last status, the outcomes of its batches, the acks of
  every replica, and a verdict per node (exported by ``selfmetrics.py``, printed by ``cloud-ingest
  fleet``).

These are records and stores; the policy of what goes where (``pipeline/finish.py``) and the feeding of
the fleet view from the broker (``intake/mqtt/fleet_feed.py``) live with the stages that know the facts.
Nothing here imports another stage.
"""
