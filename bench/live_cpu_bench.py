"""Where the relay's CPU goes in live mode: process time per sample of each stage of the live path.

Not a test. The relay runs in this process without a broker: every cycle is scraped from a simulator
(in a process of its own, so its CPU is not counted), spooled, recorded, and each spooled row is
stream-coded and acked as the uplink would. The uplink is marked connected so that the live lane
spools what it spools when a broker is there. Each stage is timed with the thread's CPU clock:

    python bench/live_cpu_bench.py                      # 2,000 series, 60 cycles
    python bench/live_cpu_bench.py --series 20000 --cycles 20
    python bench/live_cpu_bench.py --recorder off
    python bench/live_cpu_bench.py --series 20000 --cycles 600 --memory-every 50   # RSS under churn

The simulator's clock runs 100 times faster than real time (cycles 60 ms apart stand for 5 s), so at
20,000 series, whose cycle takes longer than that, series churn per cycle is higher than on a node.
The end-to-end numbers, beside vmagent and Prometheus agent, are ``bench/bandwidth_bench.py``'s.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_relay import settings as relay_settings
from edge_relay.app import Relay
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.uplink.mqtt import Uplink
from testkit.readings import proc_stats
from testkit.stack import relay_config

CYCLE_GAP_S = 0.06


def serve(series: int, urls: Any) -> None:
    from simulator.model import Simulator
    from simulator.server import SimulatorServer

    server = SimulatorServer(Simulator(seed=7, series=series, interval_s=CYCLE_GAP_S)).start()
    urls.put(server.urls)
    time.sleep(10**6)


class Stages:
    """CPU seconds of the calling thread per stage."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.thread_time() - start

        return timed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--series", type=int, default=2000)
    ap.add_argument("--cycles", type=int, default=60)
    ap.add_argument("--recorder", choices=["on", "off"], default="on")
    ap.add_argument(
        "--memory-every", type=int, default=0, help="print the current and peak RSS every N cycles (0: never)"
    )
    args = ap.parse_args()

    urls: Any = multiprocessing.Queue()
    sim = multiprocessing.Process(target=serve, args=(args.series, urls), daemon=True)
    sim.start()
    Uplink.connected = property(lambda self: True)  # type: ignore[method-assign,assignment]
    with tempfile.TemporaryDirectory() as work:
        extra = {} if args.recorder == "on" else {"recorder__max_bytes": 0}
        config = relay_config(Path(work), urls=urls.get(timeout=60), mqtt_port=9, interval=5, **extra)
        relay = Relay(relay_settings.load(str(config)), RelayMetrics())
        stages = Stages()
        relay.encoder.build = stages.wrap("encode the spooled batch", relay.encoder.build)  # type: ignore[method-assign]
        relay.sink.append = stages.wrap("append it to the spool", relay.sink.append)  # type: ignore[method-assign]
        relay.recorder.record = stages.wrap("flight recorder", relay.recorder.record)  # type: ignore[method-assign]
        live_chain = relay.stream.encoders[0]
        live_chain.prepare = stages.wrap("stream-code the row (v3)", live_chain.prepare)  # type: ignore[method-assign]

        def step() -> None:
            relay.cycle()
            rows = relay.uplink.queue.next_rows(relay.inflight)
            for row in rows:
                relay.stream.published(relay.stream.prepare(row))
            relay.spool.batches.ack([r.seq for r in rows])
            time.sleep(CYCLE_GAP_S)

        for _ in range(3):  # caches and the stream's first key frame
            step()
        stages.seconds.clear()
        scraped0 = scraped(relay)
        process0, main0 = time.process_time(), time.thread_time()
        for cycle in range(1, args.cycles + 1):
            step()
            if args.memory_every and (cycle % args.memory_every == 0 or cycle == args.cycles):
                mem = proc_stats(os.getpid())
                rss, peak = mem.rss_bytes / 2**20, mem.peak_rss_bytes / 2**20
                print(f"cycle {cycle}: RSS {rss:.0f} MiB, peak {peak:.0f} MiB", flush=True)
        process, main_thread = time.process_time() - process0, time.thread_time() - main0
        samples = scraped(relay) - scraped0
        relay.spool.close()

    def us(seconds: float) -> str:
        return f"{seconds / samples * 1e6:.2f}"

    print(f"{args.series} series, {args.cycles} cycles, {samples:.0f} samples, recorder {args.recorder}")
    print("| stage | CPU us/sample |\n| --- | ---: |")
    print(f"| the whole process | {us(process)} |")
    print(f"| scrape and parse (other threads) | {us(process - main_thread)} |")
    for name, seconds in stages.seconds.items():
        print(f"| {name} | {us(seconds)} |")
    return 0


def scraped(relay: Relay) -> float:
    return sum(
        s.value
        for m in relay.metrics.registry.collect()
        if m.name == "edge_relay_samples_scraped"
        for s in m.samples
        if s.name.endswith("_total")
    )


if __name__ == "__main__":
    sys.exit(main())
