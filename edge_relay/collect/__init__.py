"""Collect: each target's exposition, every cycle, into one ``ShapedScrape`` per target.

- ``source``: what a target is read from, and the ``Reading`` one read gives (the samples as ``parse``
  gives them, or None and why): ``HttpSource`` is an exporter's page, ``scrape`` then ``parse``.
- ``nvml``: ``NvmlSource``, the source of an ``nvml://local`` target: the node's NVIDIA GPUs read through
  NVML (the optional ``pynvml``), served as dcgm-exporter serves its default fields (names, types, units,
  labels), so everything after the source is the same for both kinds.
- ``scrape``: one HTTP GET per target (gzip, a body size limit, one wall-clock deadline for the whole
  fetch); a failed or truncated scrape is a failed scrape, never a partial one.
- ``parse``: text exposition 0.0.4 and OpenMetrics, chosen by Content-Type; a series cache makes a known
  line cost a dictionary lookup; any malformed line fails the whole body.
- ``shape``: what a Prometheus server does at scrape time: target labels, ``metric_relabel_configs``
  (the rules live in ``relay_common.relabel``, shared with the cloud), the synthetic ``up`` and
  ``scrape_*`` series, stale markers, and the per-sample checks the wire would refuse a whole batch for.
- ``targets``: ``TargetLoop`` (one target's read -> shape and its state across cycles) and
  ``Collector`` (every target in parallel, one thread each, so a slow target costs only its own scrape;
  what shaping dropped goes into the loss ledger).

Output: a list of ``ShapedScrape`` a cycle, in target order, handed to the budget (if any) and the
encode stage, and kept raw by the flight recorder.
"""
