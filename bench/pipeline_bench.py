"""Per-stage costs of the relay's hot path on the simulator's workload (not a test; numbers for the README).

    python bench/pipeline_bench.py [--series 2000 20000] [--scrapes 12]

For each size: parse (cached and cold), shape, v1 encode, and on the cloud side v1 decode and the
remote-write request build, in microseconds per sample (best of several rounds, CPU time of this
process), plus encoded bytes per sample for one batch per scrape cycle (what the relay sends today)
and the size of the same samples as a snappy-compressed remote-write 1.0 request.
The side-by-side comparison with vmagent and Prometheus agent on the wire is issue 4's bench.
"""

from __future__ import annotations

import argparse

from cloud_ingest.sinks.remote_write.request import encode_body
from edge_relay.collect.parse import SeriesCache, parse
from edge_relay.collect.shape import TargetShaper
from edge_relay.encode.batches import BatchEncoder
from schemas import codec
from simulator import EXPORTERS, Simulator
from testkit.benchkit import best_of


def run(series: int, scrapes: int) -> dict[str, float]:
    sim = Simulator(1, series, 5.0)
    # Raw bytes, as the relay's scraper hands them to the parser (which decodes them block by block).
    bodies = {e: [sim.render(e, tick) for tick in range(scrapes)] for e in EXPORTERS}
    ctype = "text/plain; version=0.0.4"
    samples_per_cycle = sum(len(parse(bodies[e][0], ctype)) for e in EXPORTERS)

    caches = {e: SeriesCache() for e in EXPORTERS}
    for e in EXPORTERS:
        parse(bodies[e][0], ctype, caches[e])
    warm = best_of(3, lambda: [parse(bodies[e][1], ctype, caches[e]) for e in EXPORTERS])
    cold = best_of(3, lambda: [parse(bodies[e][1], ctype, SeriesCache()) for e in EXPORTERS])

    shapers = {
        e: TargetShaper(e, {"job": e, "instance": f"edge-gpu-01:{i}"}, {"node": "edge-gpu-01"})
        for i, e in enumerate(EXPORTERS)
    }
    cycles = []
    for tick in range(scrapes):
        parsed = {e: parse(bodies[e][tick], ctype, caches[e]) for e in EXPORTERS}
        cycles.append([shapers[e].shape(1_700_000_000_000 + tick * 5000, parsed[e], 0.01) for e in EXPORTERS])
    # Steady state: the shapers' label caches are warm from the cycles above.
    last = {e: parse(bodies[e][-1], ctype, caches[e]) for e in EXPORTERS}
    shape_time = best_of(3, lambda: [shapers[e].shape(0, last[e], 0.0) for e in EXPORTERS])

    encoder = BatchEncoder("c", "edge-gpu-01", max_bytes=1 << 20)
    batches = [b for cycle in cycles for b in encoder.build(cycle)]
    payloads = [encoder.encode(b, i + 1) for i, b in enumerate(batches)]
    total_samples = sum(b.sample_count for b in batches)
    encode_time = best_of(3, lambda: [encoder.encode(b, i + 1) for i, b in enumerate(batches)])
    decode_time = best_of(3, lambda: [codec.decode_batch(p) for p in payloads])
    decoded = [codec.decode_batch(p) for p in payloads]
    rw_time = best_of(3, lambda: [encode_body(b) for b in decoded])
    rw_bytes = sum(len(encode_body(b)) for b in decoded)
    per = 1e6 / samples_per_cycle
    per_all = 1e6 / total_samples
    return {
        "samples/cycle": samples_per_cycle,
        "parse cached us/sample": warm * per,
        "parse cold us/sample": cold * per,
        "shape us/sample": shape_time * per,
        "encode v1 us/sample": encode_time * per_all,
        "decode v1 us/sample": decode_time * per_all,
        "remote-write build+snappy us/sample": rw_time * per_all,
        "v1 bytes/sample (1 batch per cycle)": sum(map(len, payloads)) / total_samples,
        "remote-write 1.0 snappy bytes/sample": rw_bytes / total_samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--series", type=int, nargs="+", default=[2000, 20000])
    ap.add_argument("--scrapes", type=int, default=12)
    args = ap.parse_args()
    results = {n: run(n, args.scrapes) for n in args.series}
    keys = list(next(iter(results.values())))
    width = max(map(len, keys))
    print(f"| {'metric':{width}} | " + " | ".join(f"{n:>8} series" for n in results) + " |")
    print(f"| {'-' * width} | " + " | ".join("-" * 15 for _ in results) + " |")
    for k in keys:
        print(f"| {k:{width}} | " + " | ".join(f"{results[n][k]:>15.2f}" for n in results) + " |")


if __name__ == "__main__":
    main()
