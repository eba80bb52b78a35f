"""The MQTT intake: batches and the fleet's news from an MQTT 5 broker (mosquitto), answers back to the edge.

Parts, and how a delivery passes them:

- ``session.py``: the one MQTT 5 connection (stable client id, persistent session, manual PUBACK,
  Receive Maximum), shared by what comes in and what goes out.
- ``subscriber.py``: the subscriptions (shared batches and statuses, the follow twin, every replica's
  acks) and the router: each delivery goes forward to exactly one of the parts below.
- ``batches.py``: batch messages: QoS 0 refused, a place in ``admission.py`` (at most the Receive
  Maximum at work, a broker's surplus queued in arrival order; paho's thread never waits, so the
  connection lives through batches slower than the keepalive), a job on the node's worker that runs
  the pipeline and settles the message by its outcome through ``acker.py`` (the answer on the node's
  ack topic, then the PUBACK).
- ``follow.py``: the follow copies of v3 frames, decoded on threads of their own only to advance the
  stream state; it also tells the stream state whether follow copies come at all.
- ``fleet_feed.py``: retained statuses and every replica's acks into the fleet view.

Invariants: a batch message is PUBACKed only once its outcome is final (after the answer, which comes
after its dead letter is stored); one that is not (stopping mid-write, an unexpected error) is left
in the session, and the broker delivers it again. Memory is bounded by the Receive Maximum (batches;
plus what a broker that ignores it sends beyond, see ``admission.py``), the follow queues' bytes
(follow copies) and nothing else: statuses and acks are handled on arrival.

Why it is cut this way: the old single ``Subscriber`` was handed five callbacks into the ingester, and
the ingester replaced paho's ``on_subscribe`` to learn of its own subscription. Now the subscriber owns
every subscription and every paho callback, and hands each delivery forward to a part that was built
before it; the parts that answer (acker) get the session, the ones that observe (feeds, follower) get
what they feed (the fleet view, the stream state).
"""
