"""Anomaly detection on the raw scrapes, and the full-resolution windows a detection opens.

- ``detector``: ``Detector`` runs per GPU (and per node) on every cycle's raw scrapes: the vendor's
  rules or-ed with an EWMA score; a detection opens a window in which the GPU's series bypass the
  budget's degradation; ``status_fields`` for the status message. The rules read each GPU's own model
  (its limits from the vendor record, by the model name the exporter serves; the power limit
  configured > served > the model's > learned for a model no record lists, reported in the status),
  and know how a GPU works: a temperature rise its power explains is a job starting, the SW power cap
  at full load is ordinary, and the score keeps a baseline per load state that waits for the load to
  settle.
- ``signals``: what a scrape says about a GPU (temperature, power, memory, XID, ECC, throttle reasons)
  and the EWMA score, read through the vendor registry (``vendors``).
- ``node``: the node's own signals (node-exporter, Kepler) and their rules.
- ``pastparts``: the past part of each window: the recorder's raw samples of the GPU from before the
  event, spooled at the budget's reserved share of the rate.

The detector runs inside the budget in force (its config is the budget file's ``anomaly`` section and
reloads with it); the relay loop hands the detector's events to ``PastParts``.
"""
