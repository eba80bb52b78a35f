"""The simulator's HTTP face and command line (``edge-relay simulate``).

``SimulatorServer`` serves a ``Simulator``'s exporters, each on its own port at ``/metrics``, the way
the real ones answer: promhttp's content negotiation (OpenMetrics for Kepler when asked) and gzip,
dcgm-exporter's sniffed Content-Type, Go's keep-alive and headers. ``add_arguments`` / ``run`` are the
``simulate`` subcommand: it prints one JSON line when ready and serves until SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import logging
import math
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import IO, Any
from urllib.parse import urlsplit

from simulator.base import ALL_EXPORTERS, CONTENT_TYPE_OPENMETRICS_001, DEFAULT_PORTS, EXPORTERS, VENDORS
from simulator.incidents import Incident, parse_incident
from simulator.model import Simulator

log = logging.getLogger(__name__)


# --- HTTP ---------------------------------------------------------------------------------------


def negotiate_openmetrics(accept: str) -> str | None:
    """The OpenMetrics version client_golang's promhttp picks for this Accept header, or None (text).

    Like ``expfmt.NegotiateIncludingOpenMetrics``: entries by descending q, the first usable one
    wins; protobuf is skipped (not served here); nothing usable means text.
    """
    entries: list[tuple[float, bool, bool, int, str, dict[str, str]]] = []
    for i, part in enumerate(accept.split(",")):
        fields = [f.strip() for f in part.split(";")]
        media = fields[0].lower()
        if not media:
            continue
        params: dict[str, str] = {}
        q = 1.0
        for f in fields[1:]:
            k, _, v = f.partition("=")
            k, v = k.strip().lower(), v.strip().strip('"')
            if k == "q":
                try:
                    q = float(v)
                except ValueError:
                    q = 0.0
            else:
                params[k] = v
        entries.append((-q, media.startswith("*/"), media.endswith("/*"), i, media, params))
    entries.sort(key=lambda e: e[:4])
    for *_, media, params in entries:
        version = params.get("version", "")
        if media == "text/plain" and version in ("", "0.0.4"):
            return None
        if media == "application/openmetrics-text" and version in ("", "0.0.1", "1.0.0"):
            return "1.0.0" if version == "1.0.0" else "0.0.1"
    return None


def _accepts_gzip(accept_encoding: str) -> bool:
    for part in accept_encoding.split(","):
        coding, _, params = part.strip().partition(";")
        if coding.strip().lower() in ("gzip", "*"):
            q = params.strip()
            return not (q.startswith("q=") and _float(q[2:]) <= 0)
    return False


def _float(s: str) -> float:
    try:
        return float(s)
    except ValueError:
        return 0.0


class _ExporterHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], exporter: str, owner: SimulatorServer) -> None:
        self.exporter = exporter
        self.owner = owner
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """Wake keep-alive handler threads so they end with the server."""
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _ExporterHTTPServer6(_ExporterHTTPServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as Go exporters do
    timeout = 120  # an idle keep-alive connection is dropped after this many seconds

    def do_GET(self) -> None:
        server = self.server
        assert isinstance(server, _ExporterHTTPServer)
        server.owner._handle(self, server.exporter)

    def send_response(self, code: int, message: str | None = None) -> None:
        # Like Go's net/http: a Date header but no Server header.
        self.send_response_only(code, message)
        self.send_header("Date", self.date_time_string())

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the served log (--served-log) records requests; stderr stays quiet


class SimulatorServer:
    """Serves a Simulator's exporters over HTTP, each on its own port, in background threads.

    ``ports`` maps exporter -> port (0: a free port); exporters left out are not served. The tick of
    a request is ``floor((clock() - start) / interval)``; payloads are rendered once per
    (exporter, tick, format) and shared by every scraper.
    """

    def __init__(
        self,
        simulator: Simulator,
        *,
        host: str = "127.0.0.1",
        ports: Mapping[str, int] | None = None,
        served_log: str | Path | None = None,
        fail_every: int = 0,
        clock: Callable[[], float] = time.monotonic,
        prerender: bool = False,
    ) -> None:
        if fail_every < 0:
            raise ValueError("fail_every must be >= 0")
        self.simulator = simulator
        self.host = host
        self.ports: dict[str, int] = (
            dict(ports) if ports is not None else dict.fromkeys(simulator.exporters, 0)
        )
        for exporter in self.ports:
            if exporter not in ALL_EXPORTERS:
                raise ValueError(f"unknown exporter {exporter!r}")
        self.served_log = Path(served_log) if served_log is not None else None
        self.fail_every = fail_every
        self._clock = clock
        self._start = 0.0
        self.start_ms = 0
        self._servers: dict[str, _ExporterHTTPServer] = {}
        self._threads: list[threading.Thread] = []
        # Per exporter, each under its exporter's lock: scrapes of different exporters run concurrently.
        self._cache: dict[str, dict[tuple[int, bool, bool], bytes]] = {e: {} for e in ALL_EXPORTERS}
        self._locks = {e: threading.Lock() for e in ALL_EXPORTERS}
        self._log_lock = threading.Lock()
        self._log_file: IO[str] | None = None
        # prerender: half a tick ahead, the next tick's payloads of every (exporter, format) asked for
        # so far are rendered, so that no scraper waits for this Python renderer (a 20,000-series
        # Kepler body: about 0.1 s, plus 0.05 s of gzip, on a slow core). Without it the first
        # scraper of a tick pays that and the others get the cached bytes: a bench's relay, which
        # scrapes every target at the start of its cycle, paid it for the agents too.
        self.prerender = prerender
        self._asked: set[tuple[str, bool, bool]] = set()
        self._stopping = threading.Event()

    @property
    def urls(self) -> dict[str, str]:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return {e: f"http://{host}:{self.ports[e]}/metrics" for e in self._servers}

    def tick(self) -> int:
        return max(0, math.floor((self._clock() - self._start) / self.simulator.interval_s))

    def start(self) -> SimulatorServer:
        cls = _ExporterHTTPServer6 if ":" in self.host else _ExporterHTTPServer
        try:
            for exporter, port in self.ports.items():
                server = cls((self.host, port), exporter, self)
                self._servers[exporter] = server
                self.ports[exporter] = server.server_address[1]
        except OSError:
            self._close_servers()
            raise
        if self.served_log is not None:
            self._log_file = self.served_log.open("a", encoding="utf-8")
        self._start = self._clock()
        self.start_ms = int(time.time() * 1000)
        for exporter, server in self._servers.items():
            thread = threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.1},
                name=f"sim-{exporter}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        self._stopping.clear()
        if self.prerender:
            threading.Thread(target=self._prerender, name="sim-prerender", daemon=True).start()
        return self

    def _prerender(self) -> None:
        interval = self.simulator.interval_s
        ahead = -1  # the last tick rendered ahead
        # Polled, not slept until the middle of the tick: a test's clock jumps.
        while not self._stopping.wait(min(0.5, interval / 10)):
            tick = self.tick()
            if tick + 1 > ahead and self._clock() >= self._start + (tick + 0.5) * interval:
                for exporter, openmetrics, gzipped in sorted(self._asked):
                    self.payload(exporter, tick + 1, openmetrics, gzipped)
                ahead = tick + 1

    def stop(self) -> None:
        self._stopping.set()
        if self._threads:  # shutdown() would wait forever for a server that never served
            for server in self._servers.values():
                server.shutdown()
            for thread in self._threads:
                thread.join(5)
            self._threads.clear()
            self._close_servers()
        with self._log_lock:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def _close_servers(self) -> None:
        for server in self._servers.values():
            server.close_connections()
            server.server_close()

    def __enter__(self) -> SimulatorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def payload(self, exporter: str, tick: int, openmetrics: bool = False, gzipped: bool = False) -> bytes:
        """The body served at ``tick``, rendered once and shared by concurrent scrapers."""
        key = (tick, openmetrics, gzipped)
        self._asked.add((exporter, openmetrics, gzipped))
        with self._locks[exporter]:
            cache = self._cache[exporter]
            body = cache.get(key)
            if body is None:
                plain = cache.get((tick, openmetrics, False))
                if plain is None:
                    plain = self.simulator.render(exporter, tick, openmetrics)
                    cache[(tick, openmetrics, False)] = plain
                body = gzip.compress(plain, compresslevel=6, mtime=0) if gzipped else plain  # Go default
                cache[key] = body
                for old in [k for k in cache if k[0] < tick - 1]:
                    del cache[old]
        return body

    def _handle(self, h: BaseHTTPRequestHandler, exporter: str) -> None:
        if urlsplit(h.path).path != "/metrics":
            self._send(h, 404, "text/plain; charset=utf-8", b"404 page not found\n")
            return
        tick = self.tick()
        sim = self.simulator
        om_version = (
            negotiate_openmetrics(h.headers.get("Accept", "")) if sim.supports_openmetrics(exporter) else None
        )
        om = om_version is not None
        headers: dict[str, str] = {}
        if self.fail_every and (tick + 1) % self.fail_every == 0:
            status, ctype, body = 500, "text/plain; charset=utf-8", b"simulated scrape failure\n"
        else:
            # promhttp gzips when asked; dcgm-exporter's hand-written handler never does.
            gz = exporter != "dcgm" and _accepts_gzip(h.headers.get("Accept-Encoding", ""))
            status, body = 200, self.payload(exporter, tick, om, gz)
            ctype = CONTENT_TYPE_OPENMETRICS_001 if om_version == "0.0.1" else sim.content_type(exporter, om)
            if gz:
                headers["Content-Encoding"] = "gzip"
            if exporter == "dcgm":
                headers["X-Content-Type-Options"] = "nosniff"
        # Logged before the body goes out: once a client has the response, its log line exists.
        self._log(exporter, tick, om, status)
        self._send(h, status, ctype, body, headers)

    @staticmethod
    def _send(
        h: BaseHTTPRequestHandler,
        status: int,
        ctype: str,
        body: bytes,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        try:
            h.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True

    def _log(self, exporter: str, tick: int, om: bool, status: int) -> None:
        if self._log_file is None:
            return
        rec = {
            "exporter": exporter,
            "tick": tick,
            "t_ms": int(time.time() * 1000),
            "openmetrics": om,
            "status": status,
        }
        with self._log_lock:
            if self._log_file is not None:
                self._log_file.write(json.dumps(rec) + "\n")
                self._log_file.flush()


def start_in_thread(
    seed: int = 1,
    series: int | None = None,
    interval_s: float = 5.0,
    *,
    churn_ticks: int = 30,
    exporters: Iterable[str] = EXPORTERS,
    host: str = "127.0.0.1",
    served_log: str | Path | None = None,
    fail_every: int = 0,
    vendor: str | None = None,
    incidents: Iterable[Incident] = (),
    dcgm_health_fields: bool = False,
) -> SimulatorServer:
    """A started SimulatorServer on free loopback ports (``.urls``, ``.stop()``); ``vendor`` (one of
    ``VENDORS``) serves that vendor's node instead of ``exporters``."""
    if vendor is not None:
        exporters = vendor_exporters(vendor)
    sim = Simulator(
        seed,
        series,
        interval_s,
        churn_ticks=churn_ticks,
        exporters=exporters,
        kepler_gpu=vendor in (None, "nvidia"),
        incidents=incidents,
        dcgm_health_fields=dcgm_health_fields,
    )
    return SimulatorServer(sim, host=host, served_log=served_log, fail_every=fail_every).start()


def vendor_exporters(vendor: str) -> tuple[str, ...]:
    """The exporters ``simulate --vendor`` serves for ``vendor``."""
    try:
        return VENDORS[vendor]
    except KeyError:
        raise ValueError(f"unknown vendor {vendor!r} (one of {', '.join(VENDORS)})") from None


# --- command line -------------------------------------------------------------------------------

# (option stem, exporter) of the --<stem>-port options.
# (command-line option stem, exporter): ``--<stem>-port``.
PORT_OPTIONS = (
    ("kepler", "kepler"),
    ("kepler07", "kepler-0.7"),
    ("dcgm", "dcgm"),
    ("node", "node"),
    ("amd", "amd"),
    ("intel", "intel"),
    ("jetson", "jetson"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--vendor",
        choices=tuple(VENDORS),
        default="nvidia",
        help="which GPU node to simulate (default nvidia): nvidia = Kepler, Kepler 0.7, dcgm-exporter, "
        "node_exporter; amd = Kepler (no GPU series), ROCm device-metrics-exporter, node_exporter; intel = "
        "Kepler (no GPU series), xpumd, node_exporter; jetson = jetson_stats_node_exporter, node_exporter",
    )
    for name, exporter in PORT_OPTIONS:
        vendors = [v for v, exporters in VENDORS.items() if exporter in exporters]
        parser.add_argument(
            f"--{name}-port",
            type=int,
            default=None,
            metavar="PORT",
            help=f"{exporter} port (default {DEFAULT_PORTS[exporter]} with --vendor {'|'.join(vendors)}, "
            "else disabled; 0: any free port; -1: disabled)",
        )
    parser.add_argument(
        "--series",
        type=int,
        default=None,
        metavar="N",
        help="total series across the enabled exporters (default: the fixtures' natural size); "
        "grows Kepler pods and processes",
    )
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    parser.add_argument(
        "--interval", type=float, default=5.0, metavar="SECONDS", help="seconds per tick (default 5)"
    )
    parser.add_argument(
        "--churn-ticks",
        type=int,
        default=30,
        metavar="TICKS",
        help="base period of pod replacement in ticks (default 30; 0: no churn)",
    )
    parser.add_argument(
        "--served-log", default=None, metavar="FILE", help="append one JSON line per served request"
    )
    parser.add_argument(
        "--fail-every",
        type=int,
        default=0,
        metavar="K",
        help="answer HTTP 500 on every K-th tick (default off)",
    )
    parser.add_argument(
        "--incident",
        action="append",
        type=_incident_arg,
        default=[],
        metavar="KIND:gpu=N:at=TICK:for=TICKS",
        help="make GPU N misbehave from tick TICK for TICKS ticks (repeatable); KIND: thermal (runaway, "
        "then throttling), xid (XID burst, ECC / row remap counters, the app dies), powercap (power at "
        "the limit, clocks down), memleak (frame buffer used grows to the total)",
    )
    parser.add_argument(
        "--prerender",
        action="store_true",
        help="render each tick's payloads half a tick ahead, so that no scraper waits for the renderer "
        "(benches: the first scraper of a tick would pay for all of them)",
    )
    parser.add_argument(
        "--dcgm-health-fields",
        action="store_true",
        help="dcgm-exporter also serves DCGM_FI_DEV_CLOCK_THROTTLE_REASONS and the volatile ECC counters "
        "(as with a counters CSV that enables them)",
    )


def _incident_arg(spec: str) -> Incident:
    try:
        return parse_incident(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    # An explicit port serves that exporter whatever the vendor; the vendor's own get their defaults.
    served = VENDORS[args.vendor]
    ports: dict[str, int] = {}
    for name, exporter in PORT_OPTIONS:
        port = getattr(args, f"{name}_port")
        if port is None:
            port = DEFAULT_PORTS[exporter] if exporter in served else -1
        ports[exporter] = port
    enabled = {e: p for e, p in ports.items() if p != -1}
    problems = []
    if not enabled:
        problems.append("all exporters are disabled")
    if any(not 0 <= p <= 65535 for p in enabled.values()):
        problems.append("ports must be -1 (disabled), 0 (any free port) or 1-65535")
    if args.interval <= 0:
        problems.append("--interval must be > 0")
    if args.churn_ticks < 0:
        problems.append("--churn-ticks must be >= 0")
    if args.fail_every < 0:
        problems.append("--fail-every must be >= 0")
    if args.series is not None and args.series <= 0:
        problems.append("--series must be > 0")
    if problems:
        for p in problems:
            print(f"simulate: {p}", file=sys.stderr)
        return 2
    try:
        sim = Simulator(
            args.seed,
            args.series,
            args.interval,
            churn_ticks=args.churn_ticks,
            exporters=enabled,
            kepler_gpu=args.vendor == "nvidia",
            incidents=args.incident,
            dcgm_health_fields=args.dcgm_health_fields,
        )
    except ValueError as e:  # an incident on a GPU the node does not have, or two that overlap
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    server = SimulatorServer(
        sim,
        host=args.host,
        ports=enabled,
        served_log=args.served_log,
        fail_every=args.fail_every,
        prerender=args.prerender,
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        try:
            server.start()
        except OSError as e:
            print(f"simulate: cannot listen: {e}", file=sys.stderr)
            return 1
        log.info("simulating %d series (%s)", sim.planned_total, sim.planned_series)
        if args.series is not None and abs(sim.planned_total - args.series) > 0.05 * args.series:
            # Only Kepler grows; dcgm / node keep their natural size, and pods stop at max-pods.
            log.warning("--series %d: serving %d series with these exporters", args.series, sim.planned_total)
        ready = {
            "ready": True,
            "exporters": server.urls,
            "series": {e: sim.planned_series[e] for e in sim.exporters},
            "start_ms": server.start_ms,
            "interval_s": sim.interval_s,
            "vendor": args.vendor,
        }
        if sim.incidents:  # what an oracle needs to recompute the payloads (absent by default)
            ready["incidents"] = [
                {"kind": i.kind, "gpu": i.gpu, "start_tick": i.start_tick, "duration_ticks": i.duration_ticks}
                for i in sim.incidents
            ]
        if args.dcgm_health_fields:
            ready["dcgm_health_fields"] = True
        print(json.dumps(ready), flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
