"""Wire bytes per sample on real GPU telemetry, beside an entropy estimate of the same values.

Not a test: it prints a markdown table (the one in ``docs/benchmarks.md``, "Bytes on real GPU
telemetry") and writes it to ``bench/results/<timestamp>-real-bytes.md``.

    python bench/real_bytes_bench.py [--minutes 30] [--intervals 1 5] [--gpus 4]

The workload: the real H200 trace (``testkit.gpu_replay``) served as dcgm-exporter 4.x pages, ``--gpus``
GPUs at different offsets of the trace; for the whole node, the simulator's kepler and node-exporter
pages beside it. Every page is parsed and shaped as the relay does (``TargetShaper``), then coded in
process with the relay's own encoders:

- live: one v3 stream frame per scrape cycle (``StreamEncoder``, coded against the previous frame,
  key frames at the relay's default cadence), whole envelopes;
- windowed: one v2 batch per 60 s window of cycles (``BatchEncoder.build_window``, as spooled), and the
  same window as the v3 multi-cycle frame the windowed chain publishes when stream coding is on.

The floor column is an entropy estimate of the values alone: per series, the empirical (plug-in)
entropy of the values as the exporter prints them, of their first differences and of their second
differences, whichever is smallest, times the series' sample count, summed over series and divided
by the samples. It is what an ideal coder would spend if each series' residuals were i.i.d. draws
from their own observed distribution, with that distribution known for free. It is not a bound: a
coder that uses context (the energy counter is the integral of the power; clocks follow the load) can
go below it, and the plug-in estimate itself is biased low on short runs and on a looped trace (a series
takes at most one loop's distinct values); it also leaves out timestamps, label sets and framing, which
a real frame must carry. The fitted floor column (``fitted_floor_bytes``) costs the near-continuous
residual sequences (mostly distinct values within one loop of the trace) by a Laplace distribution fitted
at the values' printed resolution instead, which the loop does not cap; same model, same caveats.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from edge_relay.collect.parse import SeriesCache, parse
from edge_relay.collect.shape import ShapedScrape, TargetShaper
from edge_relay.encode.batches import BatchEncoder, dedupe_window, to_batch
from schemas import codec
from schemas.model import Labels
from testkit.benchkit import table, write_results
from testkit.gpu_replay import T0_MS, RealTrace, real_page

NODE = "edge-h200-01"
CTYPE = "text/plain; version=0.0.4"
WINDOW_S = 60.0
OTHER_EXPORTERS = ("kepler", "node")  # the node's other exporters, from the simulator


def cycles(
    interval_s: float, seconds: float, gpus: int, others: Sequence[str], trace: RealTrace
) -> list[list[ShapedScrape]]:
    """Each scrape cycle's shaped scrapes: the real dcgm page first, then the simulator's ``others``."""
    from simulator import Simulator

    sim = Simulator(1, None, interval_s) if others else None
    targets = ("dcgm", *others)
    caches = {t: SeriesCache() for t in targets}
    shapers = {
        t: TargetShaper(t, {"job": t, "instance": f"{NODE}:{i}"}, {"node": NODE})
        for i, t in enumerate(targets)
    }
    out: list[list[ShapedScrape]] = []
    for tick in range(int(seconds / interval_s)):
        t = tick * interval_s
        ts = T0_MS + round(t * 1000)
        pages = [real_page(trace, t, gpus)]
        if sim is not None:
            pages += [sim.render(e, tick + 30) for e in others]
        cycle = []
        for i, (target, page) in enumerate(zip(targets, pages, strict=True)):
            shaped = shapers[target].shape(ts + 7 * i, parse(page.decode(), CTYPE, caches[target]), 0.01)
            if shaped is not None and len(shaped):
                cycle.append(shaped)
        out.append(cycle)
    return out


def _entropy_bits(symbols: Sequence[object]) -> float:
    """n times the empirical entropy (bits) of ``symbols``."""
    n = len(symbols)
    return -sum(c * math.log2(c / n) for c in Counter(symbols).values()) if n else 0.0


def floor_bytes(series: dict[Labels, list[float]]) -> float:
    """The entropy estimate (bytes) of every series' values: per series the smallest plug-in entropy
    of its values, their first differences and their second differences, times its sample count."""
    total = 0.0
    for values in series.values():
        # The exporter prints at most 6 decimals (power); differences of scaled integers are exact.
        ints = [round(v * 1e6) if math.isfinite(v) else v for v in values]
        deltas = [ints[0]] + [b - a for a, b in itertools.pairwise(ints)]
        second = deltas[:2] + [b - a for a, b in itertools.pairwise(deltas[1:])]
        total += min(_entropy_bits(ints), _entropy_bits(deltas), _entropy_bits(second)) / 8
    return total


def _decimals(values: Sequence[float]) -> int:
    """The fewest decimals (at most 6) that print every finite value of ``values`` exactly."""
    finite = [v for v in values if math.isfinite(v)]
    for k in range(7):
        if all(abs(v * 10**k - round(v * 10**k)) < 1e-6 for v in finite):
            return k
    return 6


def fitted_floor_bytes(series: dict[Labels, list[float]], loop_samples: int) -> float:
    """Like ``floor_bytes``, but a residual sequence whose first ``loop_samples`` (one loop of a looped
    trace) are mostly distinct is costed as a discretized Laplace distribution fitted to it (at the
    values' printed resolution): ``log2(2e b)`` bits a sample, ``b`` the mean absolute deviation from the
    median. The plug-in entropy of such a near-continuous sequence is capped by log2 of its distinct
    values, which a looped trace keeps small; the fit is not."""
    total = 0.0
    for values in series.values():
        if not all(math.isfinite(v) for v in values):
            total += floor_bytes({(): values})
            continue
        k = _decimals(values)
        ints = [round(v * 10**k) for v in values]
        deltas = [ints[0]] + [b - a for a, b in itertools.pairwise(ints)]
        second = deltas[:2] + [b - a for a, b in itertools.pairwise(deltas[1:])]
        costs = []
        for residuals in (ints, deltas[1:], second[2:]):
            if not residuals:
                continue
            head = residuals[:loop_samples]
            if len(set(head)) > len(head) / 2:
                median = sorted(residuals)[len(residuals) // 2]
                b = sum(abs(r - median) for r in residuals) / len(residuals)
                costs.append(len(values) * max(0.0, math.log2(2 * math.e * b)) if b > 0 else 0.0)
            else:
                costs.append(_entropy_bits(residuals) * len(values) / len(residuals))
        total += min(costs) / 8
    return total


@dataclass
class Result:
    samples: int
    live_bytes: int
    window_v2_bytes: int
    window_v3_bytes: int
    floor_bytes: float
    fitted_floor_bytes: float
    unchanged_frame_bytes: int  # a live delta frame of the last cycle again, only its timestamps moved


def measure(
    scrape_cycles: list[list[ShapedScrape]], interval_s: float, only: str | None = None, loop_s: float = 206.5
) -> Result:
    """Live, windowed and floor bytes of ``scrape_cycles`` (``only``: just that target's scrapes)."""
    picked = [[s for s in c if only is None or s.target == only] for c in scrape_cycles]
    live = codec.StreamEncoder("lab", NODE, keyframe_every=360)
    live_bytes = samples = 0
    series: dict[Labels, list[float]] = {}
    for n, cycle in enumerate(picked, 1):
        batch = to_batch("lab", NODE, cycle)
        batch.seq, batch.incarnation = n, 1  # the spool's numbering, which the header carries
        live_bytes += len(live.encode(batch))
        samples += batch.sample_count
        for scrape in cycle:
            for labels, value in zip(scrape.labels, scrape.values, strict=True):
                series.setdefault(labels, []).append(value)
    # What a live frame costs whatever its values: the last cycle again, one and two intervals later
    # (the smaller of the two: one of them may fall on the key frame cadence).
    step = round(interval_s * 1000)
    unchanged_sizes = []
    for k in (1, 2):
        again = to_batch(
            "lab",
            NODE,
            [ShapedScrape(s.target, s.timestamp_ms + k * step, s.labels, s.values) for s in cycle],
        )
        again.seq, again.incarnation = len(picked) + k, 1
        unchanged_sizes.append(len(live.encode(again)))
    unchanged = min(unchanged_sizes)
    per_window = max(1, round(WINDOW_S / interval_s))
    be = BatchEncoder("lab", NODE, max_bytes=1_000_000, zstd_level=3, version=2, incarnation=1)
    windowed = codec.StreamEncoder("lab", NODE, keyframe_every=360)
    v2 = v3 = seq = 0
    for start in range(0, len(picked), per_window):
        scrapes = [s for c in picked[start : start + per_window] for s in c]
        for batch in be.build_window(dedupe_window(scrapes)[0]):
            seq += 1
            v2 += len(be.encode(batch, seq))
            v3 += len(windowed.encode(batch))
    loop_samples = max(2, round(loop_s / interval_s))
    return Result(
        samples, live_bytes, v2, v3, floor_bytes(series), fitted_floor_bytes(series, loop_samples), unchanged
    )


def rows_for(interval_s: float, minutes: float, gpus: int, trace: RealTrace) -> list[list[str]]:
    scrape_cycles = cycles(interval_s, minutes * 60, gpus, OTHER_EXPORTERS, trace)
    rows = []
    for scope, only in ((f"{gpus} GPUs (real dcgm)", "dcgm"), ("whole node (+ sim kepler, node)", None)):
        r = measure(scrape_cycles, interval_s, only, trace.period)
        fl = r.floor_bytes / r.samples
        fit = r.fitted_floor_bytes / r.samples
        live, w2, w3 = (b / r.samples for b in (r.live_bytes, r.window_v2_bytes, r.window_v3_bytes))
        n_series = r.samples // len(scrape_cycles)
        rows.append(
            [
                f"{scope}, {interval_s:g} s",
                f"{n_series}",
                f"{r.samples}",
                f"{live:.2f}",
                f"{r.unchanged_frame_bytes} ({r.unchanged_frame_bytes / n_series:.2f})",
                f"{w2:.2f}",
                f"{w3:.2f}",
                f"{fl:.2f}",
                f"{fit:.2f}",
                f"{live / fl:.1f}x",
                f"{live / fit:.1f}x",
                f"{w2 / fl:.1f}x",
                f"{w3 / fl:.1f}x",
                f"{w3 / fit:.1f}x",
            ]
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="replayed time per interval")
    ap.add_argument("--intervals", type=float, nargs="+", default=[1.0, 5.0], help="scrape intervals (s)")
    ap.add_argument("--gpus", type=int, default=4)
    args = ap.parse_args()
    started = time.monotonic()
    trace = RealTrace()
    rows = [row for i in args.intervals for row in rows_for(i, args.minutes, args.gpus, trace)]
    headers = [
        "workload, scrape",
        "series",
        "samples",
        "live v3 B/sample",
        "live frame, values unchanged: B (B/sample)",
        "windowed v2 B/sample",
        "windowed v3 B/sample",
        "floor B/sample",
        "fitted floor B/sample",
        "live/floor",
        "live/fitted floor",
        "win v2/floor",
        "win v3/floor",
        "win v3/fitted floor",
    ]
    report = (
        f"## Bytes on real GPU telemetry\n\n{args.minutes:g} min of the real H200 trace per scrape interval,"
        f" {args.gpus} GPUs at offsets i/{args.gpus} of the trace; windows of {WINDOW_S:g} s.\n\n"
        + table(headers, rows)
        + "\n"
    )
    write_results("real-bytes", report, started)


if __name__ == "__main__":
    main()
