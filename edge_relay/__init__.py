"""The edge relay: a sidecar on each GPU edge node that scrapes the node's exporters and ships their
samples to the cloud, complete, inside the bytes the link can afford.

The folders are the pipeline; data flows one way, and ``app`` wires it:

    collect -> budget -> encode -> store -> uplink
    (scrape,   (classes,  (live    (spool,   (MQTT, acks,
     parse,     detector)  batches, sink,     pacing, v3
     shape)                windows) retention) stream, status)

- ``collect``: every target's exposition, scraped, parsed, relabeled and shaped into one
  ``ShapedScrape`` per target per cycle (``up``, stale markers, label limits).
- ``budget``: with a bandwidth-budget file, its classes (resolution, aggregation, precision,
  suppression), the controller that degrades them to fit the link, and the anomaly detector it runs.
- ``encode``: a cycle into wire batches by one of two lanes (live, or staged in a batch window).
- ``store``: the SQLite spool where every batch waits for the cloud's ack, the sink (the one place that
  handles a full spool), retention (caps: degrade before evict) and the held-window bookkeeping.
- ``uplink``: the MQTT client thread, the pacer that keeps it to the budget on the wire, the v3 stream
  coder, the retained status message, what an ack does to the spool.
- Beside the path: ``recorder`` (every raw scrape kept for a bounded span; backfill requests answered
  from it) and ``anomaly`` (the detector and the past part of each window it opens).
- ``commands``: the operator's commands other than ``run`` (``status``, ``ledger``, ``check-config``,
  ``budget plan``); ``cli`` dispatches every command (``simulate`` lives in the ``simulator`` package).

Cross-cutting, once each: ``settings`` (the config file), ``ledger`` (the loss ledger and its reasons),
``selfmetrics`` (every ``edge_relay_*`` metric). Shared with the cloud in ``relay_common`` (the config
loader, the regex engine, relabel rules, the backfill selector) and ``schemas`` (the wire contracts);
the GPU vendors' facts live in ``vendors``.
"""
