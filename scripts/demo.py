"""``./dev demo``: the whole product on this machine, on free loopback ports.

simulated exporters -> edge-relay (SQLite spool) -> mosquitto -> cloud-ingest -> Prometheus (OOO window)

It prints where to look and a PromQL query, then shows every few seconds how many samples have
arrived in Prometheus. Ctrl-C stops everything and removes nothing but the processes (the working
directory is kept for inspection and printed at the end).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

import requests

from simulator.incidents import parse_incident
from testkit.services import Mosquitto, Prometheus, ServiceError
from testkit.stack import SimulatorProcess, ingest_config, program, relay_config

# A GPU query to try, per simulated vendor (the names its exporter uses).
GPU_QUERY = {
    "nvidia": "DCGM_FI_DEV_GPU_UTIL",
    "amd": "gpu_gfx_activity",
    "intel": "hw_gpu_utilization_ratio",
    "jetson": "gpu_utilization_percentage_Hz",
}


def arrived(prom: Prometheus) -> str:
    def scalar(promql: str) -> float:
        result = prom.query(promql)["result"]
        return float(result[0]["value"][1]) if result else 0.0

    series = scalar('count({job=~".+"})')
    scrapes = scalar("sum(count_over_time(up[1h]))")
    age = scalar("time() - max(timestamp(up))") if scrapes else float("nan")
    return f"{series:.0f} series, {scrapes:.0f} target scrapes; newest sample {age:.1f}s old"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=5.0, help="scrape interval in seconds (default 5)")
    ap.add_argument("--series", type=int, default=None, help="simulated series (default: the fixtures' size)")
    ap.add_argument(
        "--duration", type=float, default=0, help="stop after this many seconds (default: Ctrl-C)"
    )
    ap.add_argument(
        "--vendor", choices=tuple(GPU_QUERY), default="nvidia", help="simulated GPU node (default nvidia)"
    )
    ap.add_argument(
        "--incident",
        action="append",
        default=[],
        metavar="KIND:gpu=N:at=TICK:for=TICKS",
        help="inject a GPU incident (thermal, xid, powercap, memleak; repeatable), "
        "e.g. thermal:gpu=1:at=24:for=12",
    )
    args = ap.parse_args()
    try:
        incidents = [parse_incident(spec) for spec in args.incident]
    except ValueError as e:
        ap.error(str(e))

    workdir = Path(tempfile.mkdtemp(prefix="edge-relay-demo-"))
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    mosquitto = Mosquitto(workdir / "mosquitto", persistence=True).start()
    prom = Prometheus(workdir / "prometheus", ooo_window="2h").start()
    sim = SimulatorProcess(
        workdir, interval=args.interval, series=args.series, vendor=args.vendor, incidents=incidents
    ).start()
    urls = sim.urls
    relay_cfg = relay_config(
        workdir, urls=urls, mqtt_port=mosquitto.port, interval=args.interval, openmetrics=("kepler",)
    )
    ingest_cfg = ingest_config(workdir, mqtt_port=mosquitto.port, remote_write_url=prom.remote_write_url)
    ingest = program("cloud-ingest", "cloud_ingest.cli", ingest_cfg, workdir).start()
    relay = program("edge-relay", "edge_relay.cli", relay_cfg, workdir).start()
    query = "sum by (job) (count_over_time(up[5m]))"
    print(
        f"""
Local stack is up (working directory {workdir}):
  simulated exporters  {", ".join(f"{k}={v}" for k, v in urls.items())}
  mosquitto            127.0.0.1:{mosquitto.port}
  edge-relay           config {relay_cfg}, log {relay.log_path}
  cloud-ingest         config {ingest_cfg}, log {ingest.log_path}
  Prometheus           {prom.url}  (remote-write receiver on, out-of-order window 2h)

Try in Prometheus ({prom.url}/graph):
  {query}
  sum by (pod_name) (rate(kepler_container_joules_total[1m]))
  {GPU_QUERY[args.vendor]}
Press Ctrl-C to stop.
""",
        flush=True,
    )
    started = time.monotonic()
    rc = 0
    try:
        while not stopping:
            time.sleep(min(5.0, max(args.interval, 1.0)))
            if not relay.alive() or not ingest.alive():
                print("a component exited unexpectedly; see its log:", file=sys.stderr)
                print(relay.log_tail(20) if not relay.alive() else ingest.log_tail(20), file=sys.stderr)
                rc = 1
                break
            try:
                status = arrived(prom)
            except (requests.RequestException, ServiceError) as e:
                print(f"cannot query Prometheus: {e}")
                continue
            print(f"[{time.strftime('%H:%M:%S')}] in Prometheus: {status}", flush=True)
            if args.duration and time.monotonic() - started >= args.duration:
                break
    finally:
        print("stopping...", flush=True)
        relay.stop()
        ingest.stop()
        sim.stop()
        prom.stop()
        mosquitto.stop()
        print(f"stopped; logs and data kept in {workdir}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
