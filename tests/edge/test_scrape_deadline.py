"""The scrape deadline and the scraper's HTTP client (edge_relay/collect/scrape.py), against real HTTP
servers.

Issue 12 item 12: the deadline was checked only between body chunks, so an exporter trickling one byte
every 0.5 s behind a large Content-Length held its scrape, and the relay's whole cycle, far past the
timeout. Now the whole scrape (connect, headers, body) ends at the deadline, and one target never
delays another by more than its timeout. The servers here are real sockets on 127.0.0.1: one that
trickles (the body, or the status line itself), one that never answers, and a well-behaved one.

The rest checks what the scraper's own client (http.client, replacing requests) must keep doing: gzip,
the body limit before and after inflating, truncated bodies, redirects, basic auth, keep-alive.
"""

from __future__ import annotations

import base64
import gzip
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from edge_relay import settings as relay_settings
from edge_relay.collect.scrape import Scraper
from edge_relay.collect.shape import ShapedScrape
from edge_relay.selfmetrics import RelayMetrics
from schemas.model import metric_name

TIMEOUT_S = 1.0
# Thread start, the socket shutdown waking the reader, Python overhead on a loaded 2-core CI box.
MARGIN_S = 0.5
BODY = b'a 1\nb{x="y"} 2\n'


class RawServer:
    """Accepts connections on 127.0.0.1 and hands each socket to ``serve`` on a thread of its own."""

    def __init__(self, serve: Callable[[socket.socket, threading.Event], None]) -> None:
        self.stop = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.connections = 0
        self._serve = serve
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/metrics"

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        with conn:
            try:
                _read_request(conn)
                self._serve(conn, self.stop)
            except OSError:
                pass  # the scraper hung up: what these servers are for

    def close(self) -> None:
        self.stop.set()
        self._thread.join(5)
        self.sock.close()


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            raise ConnectionError("client closed before sending a request")
        data += chunk
    return data


def trickle_body(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1000000\r\n\r\n")
    while not stop.wait(0.5):
        conn.sendall(b"#")  # a comment line that never ends: valid bytes, one every 0.5 s


def trickle_status_line(conn: socket.socket, stop: threading.Event) -> None:
    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 10_000:
        if stop.wait(0.2):
            return
        conn.sendall(bytes((byte,)))


def never_answer(conn: socket.socket, stop: threading.Event) -> None:
    stop.wait(30)


@pytest.fixture
def raw_server() -> Iterator[Callable[[Callable[[socket.socket, threading.Event], None]], RawServer]]:
    servers: list[RawServer] = []

    def start(serve: Callable[[socket.socket, threading.Event], None]) -> RawServer:
        servers.append(RawServer(serve))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


class Exporter:
    """A well-behaved exporter (http.server, HTTP/1.1 keep-alive) with a few switchable quirks."""

    def __init__(self) -> None:
        self.body = BODY
        self.gzip = False
        self.content_length: int | None = None  # announce this instead of the real length
        self.redirect_to: str | None = None
        self.require_auth: str | None = None  # "user:password"
        self.connections: set[int] = set()
        self.requests = 0
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                exporter.requests += 1
                exporter.connections.add(id(self.connection))
                if exporter.redirect_to and self.path == "/metrics":
                    self.send_response(302)
                    self.send_header("Location", exporter.redirect_to)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if exporter.require_auth:
                    token = base64.b64encode(exporter.require_auth.encode()).decode()
                    if self.headers.get("Authorization") != f"Basic {token}":
                        self.send_response(401)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                body = exporter.body
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                if exporter.gzip:
                    assert "gzip" in self.headers.get("Accept-Encoding", "")
                    body = gzip.compress(body)
                    self.send_header("Content-Encoding", "gzip")
                length = len(body) if exporter.content_length is None else exporter.content_length
                self.send_header("Content-Length", str(length))
                self.end_headers()
                self.wfile.write(body)
                if exporter.content_length is not None and exporter.content_length > len(body):
                    self.close_connection = True

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        # A scraper hanging up mid-answer is what some tests do; no traceback on stderr for it.
        self.server.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def url(self) -> str:
        return self.base + "/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    e = Exporter()
    yield e
    e.close()


def scraper(url: str, *, timeout_s: float = TIMEOUT_S, body_limit_bytes: int = 1 << 20) -> Scraper:
    return Scraper(url, fmt="auto", timeout_s=timeout_s, body_limit_bytes=body_limit_bytes)


# -- the deadline --------------------------------------------------------------------------------------


@pytest.mark.parametrize("serve", [trickle_body, trickle_status_line, never_answer])
def test_a_scrape_ends_at_its_deadline_whatever_the_exporter_does(
    raw_server: Callable[..., RawServer], serve: Callable[[socket.socket, threading.Event], None]
) -> None:
    server = raw_server(serve)
    s = scraper(server.url)
    try:
        started = time.monotonic()
        fetched = s.fetch()
        elapsed = time.monotonic() - started
    finally:
        s.close()
    assert not fetched.ok
    assert fetched.error.startswith(f"timeout after {TIMEOUT_S:g}s"), fetched.error
    assert elapsed <= TIMEOUT_S + MARGIN_S, f"{serve.__name__}: the scrape took {elapsed:.2f}s"


def _up(shaped: ShapedScrape) -> float:
    ups = [v for labels, v in zip(shaped.labels, shaped.values, strict=True) if metric_name(labels) == "up"]
    assert len(ups) == 1, shaped
    return ups[0]


@pytest.mark.timeout(60)
def test_a_trickling_target_does_not_hold_up_the_others(
    tmp_path: Path, raw_server: Callable[..., RawServer], exporter: Exporter
) -> None:
    """The relay's cycle, two targets: the trickling one fails with up 0 at its deadline, the good one's
    samples are in the same cycle, and the cycle ends within the timeout plus a margin."""
    from edge_relay.app import Relay

    slow = raw_server(trickle_body)
    config = tmp_path / "relay.yaml"
    config.write_text(
        f"node: n1\nscrape: {{interval_seconds: 5, timeout_seconds: {TIMEOUT_S}}}\n"
        f"targets: [{{name: slow, url: '{slow.url}'}}, {{name: good, url: '{exporter.url}'}}]\n"
        f"spool: {{path: {tmp_path / 'spool.db'}}}\nmqtt: {{port: 9}}\nmetrics: {{listen: ''}}\n"
    )
    relay = Relay(relay_settings.load(str(config)), RelayMetrics())
    cycles: list[list[ShapedScrape]] = []

    def spool(shaped: list[ShapedScrape], *, at_once: bool = False) -> tuple[int, list[bytes]]:
        cycles.append(shaped)
        return sum(len(s) for s in shaped), []

    # The cycle's output, not the spool, is under test.
    relay.lanes.spool = spool  # type: ignore[method-assign]
    try:
        for _ in range(2):  # the second cycle finds the slow target's connection gone, not stuck
            started = time.monotonic()
            relay.cycle()
            elapsed = time.monotonic() - started
            assert elapsed <= TIMEOUT_S + MARGIN_S, f"the cycle took {elapsed:.2f}s"
    finally:
        # Not waiting: with a scrape still stuck (the bug), the servers' teardown is what ends it.
        relay.collector.pool.shutdown(wait=False, cancel_futures=True)
        for loop in relay.collector.loops:
            loop.scraper.close()
        relay.spool.close()
    for shaped in cycles:
        by_target = {s.target: s for s in shaped}
        assert _up(by_target["slow"]) == 0.0
        assert _up(by_target["good"]) == 1.0
        names = {metric_name(labels) for labels in by_target["good"].labels}
        assert {"a", "b"} <= names
        assert not {"a", "b"} & {metric_name(labels) for labels in by_target["slow"].labels}


# -- what the client must keep doing ---------------------------------------------------------------------


def test_plain_and_gzip_bodies_over_one_keep_alive_connection(exporter: Exporter) -> None:
    s = scraper(exporter.url)
    try:
        first = s.fetch()
        exporter.gzip = True
        second = s.fetch()
        third = s.fetch()
    finally:
        s.close()
    for fetched in (first, second, third):
        assert fetched.ok, fetched.error
        assert bytes(fetched.body) == BODY
        assert fetched.body_bytes == len(BODY)
        assert fetched.content_type.startswith("text/plain")
    assert exporter.requests == 3
    assert len(exporter.connections) == 1, "keep-alive connection not reused"


def test_an_idle_connection_the_exporter_closed_is_reopened(exporter: Exporter) -> None:
    s = scraper(exporter.url)
    try:
        assert s.fetch().ok
        assert s._conn is not None and s._conn.sock is not None
        s._conn.sock.shutdown(socket.SHUT_RDWR)  # as if the exporter had closed it while idle
        again = s.fetch()
    finally:
        s.close()
    assert again.ok, again.error
    assert bytes(again.body) == BODY


@pytest.mark.parametrize("gzipped", [False, True])
def test_the_body_limit_applies_to_the_uncompressed_body(exporter: Exporter, gzipped: bool) -> None:
    exporter.body = b"a 1\n" * 100_000  # 400 kB, ~1 kB gzipped
    exporter.gzip = gzipped
    s = scraper(exporter.url, body_limit_bytes=100_000)
    try:
        fetched = s.fetch()
    finally:
        s.close()
    assert not fetched.ok
    assert fetched.error == "body larger than body_limit_bytes=100000"


def test_a_body_shorter_than_its_content_length_is_a_failed_scrape(exporter: Exporter) -> None:
    exporter.content_length = len(BODY) + 100
    s = scraper(exporter.url)
    try:
        fetched = s.fetch()
    finally:
        s.close()
    assert not fetched.ok
    assert fetched.error == "connection closed 100 bytes before the end of the body", fetched.error


def test_redirects_are_followed_and_userinfo_is_basic_auth(exporter: Exporter) -> None:
    exporter.redirect_to = "/real-metrics"
    exporter.require_auth = "relay:s3cret"
    url = exporter.url.replace("http://", "http://relay:s3cret@")
    s = scraper(url)
    try:
        fetched = s.fetch()
        exporter.require_auth = "relay:other"
        refused = s.fetch()
    finally:
        s.close()
    assert fetched.ok, fetched.error
    assert bytes(fetched.body) == BODY
    assert not refused.ok and refused.error == "HTTP 401"


def test_a_refused_connection_fails_at_once() -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    s = scraper(f"http://127.0.0.1:{port}/metrics")
    try:
        started = time.monotonic()
        fetched = s.fetch()
    finally:
        s.close()
    assert not fetched.ok and fetched.error.startswith("ConnectionRefusedError"), fetched.error
    assert time.monotonic() - started < TIMEOUT_S
