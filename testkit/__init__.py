"""Test, bench and demo tooling: real services on loopback ports, the product's programs as processes,
network faults, remote-write mocks and taps, and the oracle.  Not part of the product: nothing in
``edge_relay``, ``cloud_ingest``, ``schemas`` or ``relay_common`` imports it, and the product's wheel
leaves it out (it is a distribution of its own, ``testkit/pyproject.toml``, which ``./dev`` installs
in editable mode beside the product; pytest finds it in the checkout anyway).  Used by ``tests/``,
``bench/`` and ``scripts/demo.py``; only ``rw_mock`` needs pytest.

- ``services``: mosquitto, Prometheus and VictoriaMetrics as managed processes on free 127.0.0.1 ports
  (``ManagedProcess``, ``ServiceFactory`` behind the fixtures of ``tests/conftest.py``), ``free_port``,
  ``now_ms``, ``wait_until``, ``die_with_parent``, ``RawSamples``.
- ``stack``: ``edge-relay run`` / ``cloud-ingest run`` as subprocesses (``Program``, ``program``), their
  configs (``relay_config``, ``ingest_config``, ``write_budget``), ``SimulatorProcess``; the relay's
  ``check-config``, schema defaults and loss ledger.
- ``oracle``: what the simulator served, recomputed and parsed independently (``expected_samples``),
  matched against a receiver: ``compare`` for the tests, ``score`` for the benches.
- ``netfaults``: ``LinkProxy`` (a TCP link that can be blackholed, stalled or cut, counting bytes) and
  ``RemoteWriteProxy`` (remote-write reverse proxy that forwards, refuses, holds, or hooks a kill in).
- ``rw_wire``: a reader of the protobuf wire format and of snappy blocks, written from the specs.
- ``rw_mock``: ``MockReceiver`` (a scripted remote-write receiver), a fake clock, the remote-write
  tests' fixtures.
- ``rw_tap``: ``RemoteWriteTap``, a ``RemoteWriteProxy`` that decodes what the receiver accepted
  (duplicates, per-scrape arrival), and its readers: ``DrainWatch`` (which served scrapes arrived whole,
  and when) and ``samples_stamped``.
- ``agents``: Prometheus agent and vmagent as managed processes, the benches' reference systems.
- ``readings``: ``/proc`` CPU and RSS, sizes on disk, a ``/metrics`` page.
- ``edge_systems``: the benches' three edge systems (ours, Prometheus agent, vmagent), each with its
  simulator, link proxy, tap and receiver.
- ``exporters``: ``ScriptedExporter``, an exposition computed per request (or a body per path).
- ``nvml_replay``: ``ReplayNvml``, a stand-in of the NVML API (the ``pynvml`` module) replaying a real
  H200 trace, for the NVML source's tests without a GPU.
- ``hostile``: hostile inputs for the fault tests and bench: a trickling exporter, a QoS 0 flooder,
  well-formed batches of another node, and readers of the ledger, dead letters and spool by series.
- ``batches``: made-up batches of a node, as its relay would publish them (the cloud side's tests).
- ``uplinks``: the relay's uplink in process: MQTT settings for a loopback broker, an ``Uplink`` on a
  spool.
- ``benchkit``: what every bench does alike: progress lines, a scratch directory, markdown tables,
  the report under ``bench/results/``, the best of timed rounds.
"""
