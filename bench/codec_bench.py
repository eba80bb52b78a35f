"""Wire format v1 vs v2 on the simulator's workload (not a test; numbers for the README and wire-format.md).

    python bench/codec_bench.py [--series 2000 20000] [--windows 1 12 24] [--level 3] [--rounds 5]

One batch holds a window of W scrape cycles of the four simulated exporters (Kepler, kepler-0.7,
dcgm-exporter, node-exporter), parsed and shaped as the relay does (job/instance/node labels, synthetic
series, stale markers for vanished series); each target is scraped at its own offset in the 5 s
interval, so a batch has 4*W distinct timestamps.  For each window and size: encoded bytes per sample,
encode and decode CPU microseconds per sample (best of --rounds, this process), for v1 and v2.
"""

from __future__ import annotations

import argparse

from edge_relay.collect.parse import SeriesCache, parse
from edge_relay.collect.shape import ShapedScrape, TargetShaper
from edge_relay.encode.batches import to_batch
from schemas import codec
from schemas.model import Batch
from simulator import EXPORTERS, Simulator
from testkit.benchkit import best_of

T0 = 1_700_000_000_000
FIRST_TICK = 30  # past the simulator's first pod replacements, so series come and go


def window(series: int, scrapes: int) -> Batch:
    sim = Simulator(1, series, 5.0)
    ctype = "text/plain; version=0.0.4"
    caches = {e: SeriesCache() for e in EXPORTERS}
    shapers = {
        e: TargetShaper(e, {"job": e, "instance": f"edge-gpu-01:{i}"}, {"node": "edge-gpu-01"})
        for i, e in enumerate(EXPORTERS)
    }
    shaped: list[ShapedScrape] = []
    for tick in range(FIRST_TICK, FIRST_TICK + scrapes):
        for i, e in enumerate(EXPORTERS):
            parsed = parse(sim.render(e, tick).decode(), ctype, caches[e])
            # Targets are scraped at their own offset in the interval, with a little jitter.
            ts = T0 + 5000 * tick + 1250 * i + (tick * 7 + i) % 11
            shaped.append(shapers[e].shape(ts, parsed, 0.01))
    batch = to_batch("lab", "edge-gpu-01", shaped)
    batch.seq = 1
    return batch


def measure(batch: Batch, version: int, level: int, rounds: int) -> dict[str, float]:
    limits = codec.Limits(max_payload_bytes=64 << 20)  # a 20 000-series v1 window is over 1 MiB
    data = codec.encode_batch(batch, level, limits=limits, version=version)
    encode = best_of(rounds, lambda: codec.encode_batch(batch, level, limits=limits, version=version))
    decode = best_of(rounds, lambda: codec.decode_batch(data, limits))
    n = batch.sample_count
    return {
        "B/sample": len(data) / n,
        "encode us/sample": encode * 1e6 / n,
        "decode us/sample": decode * 1e6 / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--series", type=int, nargs="+", default=[2000, 20000])
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 12, 24])
    ap.add_argument("--level", type=int, default=codec.DEFAULT_ZSTD_LEVEL)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"zstd level {args.level}, best of {args.rounds} rounds, CPU time of this process\n")
    print(
        "| series | W | samples | v1 B/sample | v2 B/sample | v1 enc us | v2 enc us | v1 dec us | v2 dec us |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for series in args.series:
        for w in args.windows:
            batch = window(series, w)
            one = measure(batch, codec.FORMAT_V1, args.level, args.rounds)
            two = measure(batch, codec.FORMAT_V2, args.level, args.rounds)
            cells = [f"{series}", f"{w}", f"{batch.sample_count}"]
            for key in ("B/sample", "encode us/sample", "decode us/sample"):
                cells += [f"{one[key]:.2f}", f"{two[key]:.2f}"]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
