"""Uplink: spooled batches to the broker, and the cloud's acks back to the spool.

- ``mqtt``: ``Uplink``, one thread that owns the paho client: connects (MQTT 5, 3.1.1 fallback, TLS),
  publishes rows in the send queue's order within the in-flight window, republishes what is not acked
  in time, hands commands to the recorder's inbox and publishes their results, publishes the retained
  status message; records why each connection failed (a reason from a fixed set) and when the cloud
  last acked, for ``edge-relay status``.
- ``netloop``: paho's external-loop calls in a ``select()`` another thread can wake, so a new row goes
  out at once while an idle relay sleeps.
- ``acks``: what one application ack does to the spool (delete, ledger a refusal, republish
  self-contained), apart from MQTT so it is tested without a broker.
- ``pacer``: the budget on the wire: a token bucket of the controller's rate and burst, charged with the
  bytes the kernel counted on the broker connection (both directions).
- ``stream``: v3 stream coding at publication: each row coded against the frame published before it,
  with ``need_state`` answered by the self-contained spooled batch.
- ``status``: the node's retained status message (spool depth, oldest unsent, losses, budget state).

A row leaves the spool only on the cloud's application ack for (node, seq); an MQTT PUBACK only means
the broker has it.
"""
