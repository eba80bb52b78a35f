"""Exporter simulator: realistic, deterministic Kepler / GPU exporter / node-exporter payloads over HTTP.

A test and demo tool, not part of the relay: ``edge-relay simulate`` loads it only for that subcommand.
Four exporters of the fixture node ``edge-gpu-01`` (``--vendor nvidia``, the default), each on its own
port, path ``/metrics``:

- ``kepler``: Kepler v0.11.x (client_golang text format; OpenMetrics 1.0 when the Accept header asks),
- ``kepler-0.7``: the old Kepler line (v0.7.12), text only,
- ``dcgm``: NVIDIA dcgm-exporter (fixed label order, ``%d`` / ``%f`` numbers), text only,
- ``node``: node_exporter, text only.

And the GPU exporters of three other fixture nodes (``gpus``; ``--vendor amd|intel|jetson`` serves one
with node_exporter and, on AMD and Intel, Kepler without its NVML-only GPU series), text only:

- ``amd``: ROCm device-metrics-exporter (port 5000), ``intel``: XPU Manager 2.x xpumd (port 8080),
- ``jetson``: jetson_stats_node_exporter (its default port 9100 is node_exporter's; served on 9110).

The Kepler and dcgm payloads are the fixtures in ``data/`` brought to life: HELP/TYPE text, metric
names, label names and order and number formatting are exactly the fixtures'; values move with time,
pods are replaced now and then (so series disappear and appear) and ``--series`` adds pods / processes.

``Simulator.render(exporter, tick)`` is a pure function of (seed, series, interval, churn period,
enabled exporters, exporter, tick): a test can recompute exactly what the server served at tick k.

Layout:

- ``base``: shared vocabulary (exporter names, ports, content types, number formatting, load shapes,
  series templates, fixture parsing) and ``data_path``, which locates the package data;
- ``topology``: the owners of series (pods, the job, clones, static owners), identities, lifecycle,
  and their load shapes (``LoadShapes``);
- ``kepler``, ``dcgm``, ``node``, ``gpus``: one model per exporter, what it exposes and how its values
  evolve (its fixture's name and its GPUs' limits are the exporter's record's, ``vendors``);
- ``incidents``: ``Incident`` (thermal runaway, XID burst, power cap, memory leak on one GPU from a
  tick on), passed as ``Simulator(..., incidents=[...])`` or ``simulate --incident``, and the
  ``Overlay`` that moves the incident GPU's series: it reads the owners, expositions and load shapes
  it is handed, never the ``Simulator``;
- ``model``: ``Simulator``, which puts the models and the incidents' overlay together and renders
  payloads;
- ``server``: ``SimulatorServer`` (HTTP) and the ``simulate`` command line;
- ``data/``: the exporter fixtures (``*.prom``, which tests read through ``data_path``),
  ``topology.json`` (the node's pods) and ``node-exporter.json`` (node_exporter's inventory).

Value model (why it looks the way it does):

- Every series hangs off an *owner* (a pod generation, a host process, a GPU, the node ...). An owner
  has a smooth load shape ``S(t) = 1 + f*(sin(w*t + p) - sin(p))`` (t in ticks, ``f < 0.5``), so
  ``S(0) = 1`` and the fixture value is exactly the value at tick 0.
- Gauges are ``a + b*S(t)`` (watts: ``b`` = fixture value), clamped to realistic bounds.
- Counters are ``v0 + interval*(lin*t + rate*integral(S))``; the integral has a closed form and its
  derivative ``rate*S`` is always positive, so counters never decrease (integer counters are rounded,
  which keeps them monotonic). A joules counter's rate is its sibling watts gauge, so
  ``rate(joules) == watts`` as in Kepler; all series of one owner share its shape, which keeps the
  fixtures' sums (pod = containers = processes, node = active + idle, DCGM power = Kepler GPU power).
- A replaced pod's new generation gets new UID / container IDs / PIDs / pod name and counters that
  start near zero; Kepler v0.11 reports the old generation once more with ``state="terminated"``.
"""

from simulator.base import (
    ALL_EXPORTERS,
    CONTENT_TYPE_OPENMETRICS,
    CONTENT_TYPE_OPENMETRICS_001,
    CONTENT_TYPE_SNIFFED,
    CONTENT_TYPE_TEXT,
    DEFAULT_PORTS,
    EXPORTERS,
    GPU_EXPORTERS,
    VENDORS,
    data_path,
    format_go_float,
    format_om_float,
)
from simulator.incidents import Incident, parse_incident
from simulator.model import Simulator
from simulator.server import (
    SimulatorServer,
    add_arguments,
    negotiate_openmetrics,
    run,
    start_in_thread,
    vendor_exporters,
)

__all__ = [
    "ALL_EXPORTERS",
    "CONTENT_TYPE_OPENMETRICS",
    "CONTENT_TYPE_OPENMETRICS_001",
    "CONTENT_TYPE_SNIFFED",
    "CONTENT_TYPE_TEXT",
    "DEFAULT_PORTS",
    "EXPORTERS",
    "GPU_EXPORTERS",
    "VENDORS",
    "Incident",
    "Simulator",
    "SimulatorServer",
    "add_arguments",
    "data_path",
    "format_go_float",
    "format_om_float",
    "negotiate_openmetrics",
    "parse_incident",
    "run",
    "start_in_thread",
    "vendor_exporters",
]
