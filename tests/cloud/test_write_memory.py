"""Memory of a legal big batch on its way out: the remote-write sink writes it in bounded requests.

A batch of ``max_samples`` (2,000,000) samples is written through the real sink and client into a mock
receiver, in a subprocess of its own so that its peak resident memory can be read (``ru_maxrss``): the
growth while writing must stay far below what one request of the whole batch costs (about 190 B a
sample, +374 MiB), and every sample must reach the receiver exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from array import array
from pathlib import Path

import pytest

from cloud_ingest.sinks.remote_write.sink import requests_of
from schemas.codec import DEFAULT_LIMITS
from schemas.model import Batch, ScrapeBlock
from testkit.ingest_harness import MockReceiver, decode_write_body

ROOT = Path(__file__).resolve().parents[2]

SERIES = 20_000
SCRAPES = DEFAULT_LIMITS.max_samples // SERIES  # a batch of exactly max_samples samples
# One request of the sink (100,000 samples) costs about 19 MiB while it is built; with its compressed
# body, the HTTP layer and the allocator's slack, 64 MiB is a generous ceiling, and a sixth of what the
# whole batch as one request costs.
MAX_GROWTH_MIB = 64

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from array import array
    from cloud_ingest.selfmetrics import IngestMetrics
    from cloud_ingest.sinks.remote_write.client import RemoteWriteClient
    from cloud_ingest.sinks.remote_write.sink import RemoteWriteSink
    from schemas.model import Batch, ScrapeBlock

    url, series, scrapes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    labelsets = [
        (("__name__", "dcgm_gpu_power_watts"), ("cluster", "c1"), ("gpu", str(i % 8)), ("node", "n1"),
         ("pod", f"pod-{i}"))
        for i in range(series)
    ]
    ids = array("I", range(series))
    t0 = 1_700_000_000_000
    blocks = [
        ScrapeBlock(t0 + 1000 * k, ids, array("d", [float(k)]) * series) for k in range(scrapes)
    ]
    batch = Batch("c1", "n1", 1, labelsets, blocks)
    client = RemoteWriteClient(url, timeout_s=60)
    sink = RemoteWriteSink(client, isolate_max_writes=8, metrics=IngestMetrics())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = sink.write(batch)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"status": result.status, "written": result.written,
                      "growth_kib": after - before, "samples": batch.sample_count}))
    """
)


@pytest.mark.integration
def test_a_batch_of_max_samples_is_written_whole_in_bounded_memory() -> None:
    receiver = MockReceiver()
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_PROXY": "*", "no_proxy": "*"}
        run = subprocess.run(
            [sys.executable, "-c", CHILD, receiver.url, str(SERIES), str(SCRAPES)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=ROOT,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        report = json.loads(run.stdout.strip().splitlines()[-1])
        assert report["samples"] == DEFAULT_LIMITS.max_samples
        assert report["status"] == "done" and report["written"] == report["samples"]
        received: dict[frozenset[tuple[str, str]], list[tuple[int, float]]] = {}
        for body in receiver.bodies():
            for key, samples in decode_write_body(body).items():
                received.setdefault(key, []).extend(samples)
        assert len(received) == SERIES
        assert sum(len(s) for s in received.values()) == DEFAULT_LIMITS.max_samples
        for samples in received.values():
            assert [ts for ts, _ in samples] == sorted({ts for ts, _ in samples})  # in order, once each
        growth_mib = report["growth_kib"] / 1024
        assert growth_mib < MAX_GROWTH_MIB, f"writing the batch grew the process by {growth_mib:.0f} MiB"
    finally:
        receiver.close()


def test_requests_of_cuts_a_batch_into_bounded_parts_in_time_order() -> None:
    """Blocks of uneven sizes, out of time order, cut at 7 samples a request: every sample once, each
    series' samples in time order across the parts, each part within the bound."""
    labelsets = [(("__name__", "m"), ("i", str(i))) for i in range(6)]
    sizes_and_times = [(6, 3000), (2, 1000), (5, 2000), (1, 4000)]
    blocks = [
        ScrapeBlock(ts, array("I", range(n)), array("d", [ts + i for i in range(n)]))
        for n, ts in sizes_and_times
    ]
    batch = Batch("c", "n", 4, labelsets, blocks, incarnation=9)
    parts = list(requests_of(batch, 7))
    assert [p.sample_count for p in parts] == [7, 7]
    assert all((p.seq, p.incarnation, p.labelsets) == (4, 9, labelsets) for p in parts)
    seen = [
        (b.timestamp_ms, s, v)
        for p in parts
        for b in p.scrapes
        for s, v in zip(b.series, b.values, strict=True)
    ]
    want = sorted((ts, i, float(ts + i)) for n, ts in sizes_and_times for i in range(n))
    assert seen == want
    assert list(requests_of(batch, 14)) == [batch]  # a batch that fits is not copied
