"""Intakes: where batch messages come in, and where they are settled once their outcome is final.

The contract between an intake and the pipeline is small, and the same for every transport:

1. For each batch message, the intake builds a ``Delivery`` (``pipeline/flow.py``): the payload and the
   topic the edge published it on, in the topic grammar of ``schemas.topics`` (the node's identity is
   taken from it; an intake on a transport that names things otherwise, NATS subjects for example,
   writes its address in that grammar).
2. It runs ``Pipeline.handle(delivery)`` on the node's worker (``workers.py``: a node's batches one at a
   time, in arrival order; nodes in parallel), bounding how many it holds (its own flow control).
3. It settles its message by the returned ``Outcome`` (``outcome/answer.py``): the ``answer`` to the edge
   first, then release; release alone; or, when ``hold``, nothing (the transport delivers it again).

The pipeline never settles and never sees the transport's message: it cannot answer early or twice,
and a second intake (a JetStream durable consumer beside MQTT) plugs in without touching it. The
edge's answers and the fleet's statuses travel on the edge's MQTT topics whatever the intake.

Why the settle stays with the intake rather than travelling with the delivery: settling is the one
step whose order matters (the answer before the release, and only after the dead letter is stored),
and the outcome says all that is needed to do it; a handle inside the delivery would let the pipeline
do it at any point.
"""
