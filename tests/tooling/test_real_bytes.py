"""The real-telemetry bytes bench's core on a few cycles: sizes are positive and the entropy estimate
of the values lies below every coded size."""

from __future__ import annotations

import importlib.util
import sys

from testkit.benchkit import ROOT
from testkit.gpu_replay import RealTrace


def _bench():  # bench/ is scripts, not a package: load the module from its file
    spec = importlib.util.spec_from_file_location("real_bytes_bench", ROOT / "bench" / "real_bytes_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_real_bytes_core_on_a_few_cycles() -> None:
    bench = _bench()
    cycles = bench.cycles(5.0, 120.0, 2, ("node",), RealTrace())
    assert len(cycles) == 24
    for only in ("dcgm", None):
        r = bench.measure(cycles, 5.0, only)
        assert r.samples > 0 and r.floor_bytes > 0 and r.fitted_floor_bytes > 0
        for coded in (r.live_bytes, r.window_v2_bytes, r.window_v3_bytes):
            assert coded > r.floor_bytes
