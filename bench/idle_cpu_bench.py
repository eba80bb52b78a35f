"""The relay's fixed CPU: what it costs per second with almost nothing to scrape.

Not a test. A real mosquitto, Prometheus and cloud-ingest; the relay scrapes one exporter of 20 series
every 5 s, stream coding on, MQTT timers at the product defaults (keepalive 30 s, status every 30 s).
After a warm-up, the relay process's utime + stime over the measured span is printed in ms per second:
the cost that does not grow with the series (network-loop turns, the pump, status, HTTP, SQLite), which
at 2,000 series and 5 s is spread over 400 samples a second.

    python bench/idle_cpu_bench.py                   # this checkout, 90 s
    git archive <rev> | tar -x -C /tmp/old && python bench/idle_cpu_bench.py --tree /tmp/old

``--tree``: the source tree the relay and the ingester run from (PYTHONPATH), to compare revisions
in the same environment.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from testkit.exporters import ScriptedExporter
from testkit.readings import cpu_seconds
from testkit.services import Mosquitto, Prometheus, ServiceFactory
from testkit.stack import Program, ingest_config, relay_config

REPO = Path(__file__).resolve().parents[1]
SERIES = 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=90.0, help="measured span (default 90)")
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds before measuring (default 20)")
    ap.add_argument("--tree", default=str(REPO), help="source tree to run the relay from (default: this one)")
    args = ap.parse_args()
    tree = str(Path(args.tree).resolve())
    os.environ["PYTHONPATH"] = tree  # the children import the relay and the ingester from there

    body = "".join(f'# TYPE g{i} gauge\ng{i}{{a="x"}} {i}.5\n' for i in range(SERIES))
    with tempfile.TemporaryDirectory() as tmp, ScriptedExporter(bodies={"m": body}) as exporter:
        work = Path(tmp)
        services = ServiceFactory(work)
        try:
            broker, prometheus = services(Mosquitto), services(Prometheus)
            relay_cfg = relay_config(
                work,
                urls={"m": exporter.url_of("m")},
                mqtt_port=broker.port,
                interval=5,
                mqtt__keepalive_seconds=30,
                mqtt__ack_timeout_seconds=60,
                mqtt__status_interval_seconds=30,
                stream__enabled=True,
            )
            ingest_cfg = ingest_config(
                work, mqtt_port=broker.port, remote_write_url=prometheus.remote_write_url
            )
            run = [sys.executable, "-m"]
            ingest = Program(
                "ingest", [*run, "cloud_ingest.cli", "run", "--config", str(ingest_cfg)], work / "ingest.log"
            )
            relay = Program(
                "relay", [*run, "edge_relay.cli", "run", "--config", str(relay_cfg)], work / "relay.log"
            )
            ingest.start()
            relay.start()
            try:
                time.sleep(args.warmup)
                assert relay.alive(), relay.log_tail()
                pid = relay.proc.pid
                cpu0, t0 = cpu_seconds(pid), time.monotonic()
                time.sleep(args.seconds)
                cpu1, t1 = cpu_seconds(pid), time.monotonic()
                assert relay.alive(), relay.log_tail()
            finally:
                relay.stop()
                ingest.stop()
        finally:
            services.stop_all()
    per_second_ms = 1000 * (cpu1 - cpu0) / (t1 - t0)
    span = f"{SERIES} series every 5 s, {args.seconds:.0f} s measured"
    print(f"relay from {tree}: {per_second_ms:.2f} ms CPU per second ({span})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
