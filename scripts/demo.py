"""``./dev demo``: the whole product on this machine, on free loopback ports.

simulated exporters -> edge-relay (SQLite spool) -> mosquitto -> cloud-ingest -> Prometheus (OOO window)

It prints where to look and what to try (PromQL queries, ``edge-relay status``, the relay's status
page), then shows every few seconds how many samples have arrived in Prometheus. ``--outage`` stops the
broker or the ingester for a while and brings it back, to watch the backlog build and drain. Ctrl-C stops
everything and removes nothing but the processes (the working directory is kept for inspection and
printed at the end), also when the output goes through a pipe whose reader Ctrl-C ended first
(``./dev demo | tee log``): output is then dropped, and the stack still stopped.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import requests

from simulator.incidents import parse_incident
from testkit.services import Mosquitto, Prometheus, ServiceError
from testkit.stack import Program, SimulatorProcess, ingest_config, metrics_url, program, relay_config

# A GPU query to try, per simulated vendor (the names its exporter uses).
GPU_QUERY = {
    "nvidia": "DCGM_FI_DEV_GPU_UTIL",
    "amd": "gpu_gfx_activity",
    "intel": "hw_gpu_utilization_ratio",
    "jetson": "gpu_utilization_percentage_Hz",
}


OUTAGE = re.compile(r"(broker|ingester):at=(\d+(?:\.\d+)?):for=(\d+(?:\.\d+)?)")


class Console:
    """The demo's output. Once its reader is gone (a pipe whose reader Ctrl-C ended too) output is
    dropped instead of raised, so that stopping the stack never fails on a print."""

    def __init__(self) -> None:
        self.gone = False

    def say(self, text: str, *, error: bool = False) -> None:
        if self.gone:
            return
        try:
            print(text, file=sys.stderr if error else sys.stdout, flush=True)
        except OSError:  # BrokenPipeError, and EIO from a closed terminal
            self.gone = True
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # the interpreter flushes stdout once more at exit
            os.dup2(devnull, sys.stderr.fileno())


def parse_outage(spec: str) -> tuple[str, float, float]:
    """``broker:at=30:for=60`` -> ("broker", 30.0, 60.0): seconds after the stack is up."""
    m = OUTAGE.fullmatch(spec)
    if m is None:
        raise ValueError(f"--outage {spec!r}: expected broker|ingester:at=SECONDS:for=SECONDS")
    return m[1], float(m[2]), float(m[3])


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
    ap.add_argument(
        "--outage",
        action="append",
        default=[],
        metavar="broker|ingester:at=SECONDS:for=SECONDS",
        help="stop the broker or the ingester SECONDS after the start, for SECONDS, then bring it back "
        "(repeatable), e.g. broker:at=30:for=60",
    )
    args = ap.parse_args()
    try:
        incidents = [parse_incident(spec) for spec in args.incident]
        outages = [parse_outage(spec) for spec in args.outage]
    except ValueError as e:
        ap.error(str(e))

    out = Console()
    workdir = Path(tempfile.mkdtemp(prefix="edge-relay-demo-"))
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stops: list[tuple[str, Callable[[], object]]] = []  # what to stop at the end, newest first

    try:
        mosquitto = Mosquitto(workdir / "mosquitto", persistence=True).start()
        stops.insert(0, ("mosquitto", mosquitto.stop))
        prom = Prometheus(workdir / "prometheus", ooo_window="2h").start()
        stops.insert(0, ("Prometheus", prom.stop))
        sim = SimulatorProcess(
            workdir, interval=args.interval, series=args.series, vendor=args.vendor, incidents=incidents
        ).start()
        stops.insert(0, ("simulator", sim.stop))
        urls = sim.urls
        relay_cfg = relay_config(
            workdir, urls=urls, mqtt_port=mosquitto.port, interval=args.interval, openmetrics=("kepler",)
        )
        ingest_cfg = ingest_config(workdir, mqtt_port=mosquitto.port, remote_write_url=prom.remote_write_url)
        ingest = program("cloud-ingest", "cloud_ingest.cli", ingest_cfg, workdir).start()
        stops.insert(0, ("cloud-ingest", lambda: ingest.stop() if ingest.alive() else None))
        relay = program("edge-relay", "edge_relay.cli", relay_cfg, workdir).start()
        stops.insert(0, ("edge-relay", relay.stop))
        status_page = metrics_url(relay_cfg).removesuffix("/metrics") + "/status"
        query = "sum by (job) (count_over_time(up[5m]))"
        out.say(
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
Try on the node's side:
  .venv/bin/edge-relay status --config {relay_cfg} --watch
  .venv/bin/edge-relay ledger --config {relay_cfg}
  the relay's status page: {status_page}
Press Ctrl-C to stop."""
        )
        return _watch(args, out, lambda: stopping, prom, mosquitto, relay, ingest, outages)
    finally:
        out.say("stopping...")
        for name, stop in stops:
            try:
                stop()
            except Exception as e:  # one component's failure must not leave the others running
                out.say(f"cannot stop {name}: {e}", error=True)
        out.say(f"stopped; logs and data kept in {workdir}")


def _watch(
    args: argparse.Namespace,
    out: Console,
    stopping: Callable[[], bool],
    prom: Prometheus,
    mosquitto: Mosquitto,
    relay: Program,
    ingest: Program,
    outages: list[tuple[str, float, float]],
) -> int:
    """Every few seconds what has arrived, and the outages on their schedule. Returns the exit code."""
    started = time.monotonic()
    down: set[str] = set()
    pending = sorted(outages, key=lambda o: o[1])
    while not stopping():
        time.sleep(min(5.0, max(args.interval, 1.0)))
        elapsed = time.monotonic() - started
        for outage in list(pending):
            kind, at, length = outage
            if kind not in down and at <= elapsed < at + length:
                if kind == "broker":
                    mosquitto.stop()
                else:
                    ingest.stop()
                down.add(kind)
                out.say(
                    f"[{time.strftime('%H:%M:%S')}] outage: the {kind} is down for {length:g}s; the relay "
                    "keeps scraping into its spool (watch `edge-relay status`)"
                )
            elif kind in down and elapsed >= at + length:
                if kind == "broker":
                    mosquitto.restart()
                else:
                    ingest.start()
                down.discard(kind)
                pending.remove(outage)
                out.say(f"[{time.strftime('%H:%M:%S')}] the {kind} is back: the backlog drains")
        if not relay.alive() or ("ingester" not in down and not ingest.alive()):
            failed = relay if not relay.alive() else ingest
            out.say("a component exited unexpectedly; see its log:", error=True)
            out.say(failed.log_tail(20), error=True)
            return 1
        try:
            status = arrived(prom)
        except (requests.RequestException, ServiceError) as e:
            out.say(f"cannot query Prometheus: {e}")
            continue
        out.say(f"[{time.strftime('%H:%M:%S')}] in Prometheus: {status}")
        if args.duration and elapsed >= args.duration:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
