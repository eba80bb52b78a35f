"""Shared helpers for the remote-write tests (``test_write.py``, ``test_write_headers.py``,
``test_rw_compliance.py``; the wire-format reader they use is ``testkit.rw_wire``):

- ``MockReceiver``, a scripted remote-write receiver on 127.0.0.1, and the fake clock and jitter source
  the retry tests drive the client with;
- the fixtures ``receiver`` and ``fake_time``.  A test module imports the functions, each as
  ``from testkit.rw_mock import receiver_fixture as receiver_fixture`` (the redundant alias marks an
  import meant to be there though unused by name, so ruff's F401 needs no noqa), and asks for the
  fixtures by their pytest names.  (No proxies and no environment overrides: ``tests/conftest.py``
  sees to that for every test.)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

# -- a scripted receiver -------------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int = 204
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    raw: bytes | None = None  # sent verbatim instead of an HTTP response, then the connection closes
    content_length: int | None = None  # lie about the length (truncated body), then close


@dataclass
class Received:
    path: str
    header_items: list[tuple[str, str]]  # as sent, in order, duplicates kept
    body: bytes
    client_port: int

    @property
    def headers(self) -> dict[str, str]:
        """By name as spelled on the wire (case-sensitive); a name sent twice: its last value."""
        return dict(self.header_items)


class MockReceiver:
    """Scripted remote-write receiver on 127.0.0.1: replies are taken from ``script`` in order, then
    ``default``; every request is kept in ``received``.

    ``with MockReceiver() as r`` (or ``start()`` / ``stop()``) serves on a free port.  Give ``port``
    (e.g. ``testkit.services.free_port()``) to know the URL before it starts: until then a client gets
    connection refused, and a stopped receiver started again listens on the same port."""

    def __init__(self, port: int = 0) -> None:
        self.script: deque[Reply] = deque()
        self.default = Reply()
        self.received: list[Received] = []
        self._port = port
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("MockReceiver: not started and no port given")
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v1/write"

    def _record(self, handler: BaseHTTPRequestHandler, body: bytes) -> Reply:
        with self._lock:
            self.received.append(
                Received(handler.path, list(handler.headers.items()), body, handler.client_address[1])
            )
            return self.script.popleft() if self.script else self.default

    def start(self) -> MockReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like a real receiver

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                reply = receiver._record(self, body)
                if reply.delay_s:
                    time.sleep(reply.delay_s)
                try:
                    if reply.raw is not None:
                        self.wfile.write(reply.raw)
                        self.close_connection = True
                        return
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    length = len(reply.body) if reply.content_length is None else reply.content_length
                    self.send_header("Content-Length", str(length))
                    self.end_headers()
                    self.wfile.write(reply.body)
                    self.wfile.flush()
                    if reply.content_length is not None:
                        self.close_connection = True
                except OSError:  # the client gave up (timeout) or stopped reading a huge body
                    self.close_connection = True

            def log_message(self, format: str, *args: object) -> None:
                pass

        # HTTPServer sets SO_REUSEADDR (a port picked and released earlier can be bound at once);
        # ThreadingHTTPServer's handler threads are daemons.
        self._server = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        self._port = int(self._server.server_address[1])
        # Short poll interval: shutdown() waits for it, once per test.
        threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> MockReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


class MaxRng:
    """r = 1.0: full jitter returns the ceiling, so delays are deterministic."""

    def random(self) -> float:
        return 1.0


# -- fixtures ------------------------------------------------------------------------------------------------


@pytest.fixture(name="receiver")
def receiver_fixture() -> Iterator[MockReceiver]:
    with MockReceiver() as r:
        yield r


@pytest.fixture(name="fake_time")
def fake_time_fixture() -> FakeTime:
    return FakeTime()
