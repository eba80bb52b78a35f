"""The exporters the relay knows, one record each: what every part that names a vendor's series reads.

A GPU vendor's facts lived in five places (the budget presets, the detector's tables, the budget
schema's enums, the simulator, the Prometheus rules) and drifted apart. Here each exporter is one
module holding one ``record.Exporter``:

- ``kepler``: Kepler 0.7 / 0.10+ (power per node and workload; its GPU series are NVML's, dcgm's GPUs);
- ``dcgm``: NVIDIA dcgm-exporter; ``amd``: ROCm device-metrics-exporter; ``intel``: XPU Manager 2.x
  xpumd and the 1.x exporter; ``jetson``: jetson_stats_node_exporter;
- ``node``: node_exporter; ``scrape``: the series the relay's scraper adds (``up``, ...), which no
  exporter serves but a budget class names like one.

A record holds the exporter's budget presets (name matchers, the ``-critical`` subset, the counters it
serves without a counter suffix), and for a GPU exporter its ``GpuSignals``: which series are its GPUs',
the GPU label(s), how each series reads (``Gauge`` into a signal, ``Counter``, ``Code``, ``Bits``,
``Flag``, ``State`` events), the rule defaults and each GPU model's own limits (``ModelLimits``: power
limit, memory, temperatures where published, each citing its data sheet; found by ``GpuSignals.model``
from the name the exporter serves in its model label; a record whose exporter names no model has a
``default_model``); its ``gpu:*`` recording rules; its sample pages (the
simulator's fixtures) and the hwmon chip names of its GPUs. ``record`` is the shape, data only;
``registry`` lists the records in order and derives what the relay reads of them all (``PRESETS``,
``PRESET_COUNTERS``, ``GPUS``, ``PRESET_GPUS``, ``HWMON_GPU_CHIPS``).

Data flows one way, out of here: ``edge_relay.budget.model`` takes ``registry.PRESETS``;
``edge_relay.anomaly.signals`` compiles each ``GpuSignals`` into a reader (the detector asks the record,
it names no vendor); ``simulator`` reads its fixtures' names and its GPUs' limits; ``generate`` writes the
files that cannot import Python: the budget schema's preset and vendor enums
(``schemas/bandwidth-budget.schema.json``) and ``deploy/prometheus/rules/gpu-vendors.rules.yml``. Tests
check that both are current. This package imports nothing of the relay, the ingester or the simulator
(standard library only), so every one of them can import it.

Adding a vendor (an exporter), the files a contributor edits:

1. ``vendors/<exporter>.py``: its ``RECORD`` (copy the closest one), and its line in
   ``vendors/registry.py``'s ``RECORDS`` (the order is the schema's);
2. its sample page, ``simulator/data/<exporter>-sample.prom`` (a real scrape), named in the record's
   ``samples``; ``tests/common/test_vendor_registry.py`` checks its presets against it;
3. ``python -m vendors.generate --update``, then
   ``python -m relay_common.configdoc --update docs/configuration.md`` (the config reference shows the
   enum): generated, not edited by hand.

Serving it from ``edge-relay simulate`` as well (optional) is a model in ``simulator/gpus.py`` and its
entries in ``simulator/base.py``. A new kind of reading (other than the six above) is the one change
outside this folder: its compiler in ``edge_relay.anomaly.signals``.
"""
