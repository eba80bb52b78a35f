"""Network fault injectors for integration tests, all on 127.0.0.1.

``BlackholeProxy``: a TCP proxy that can silently stop forwarding (both ways) without closing anything,
as on a dead link: only keepalives can tell.

``RemoteWriteProxy``: an HTTP reverse proxy in front of a remote-write receiver that forwards POSTs,
answers them itself with a chosen error status (optionally with ``Retry-After``), or holds them until
released; an ``after_forward`` hook runs after the receiver answered 2xx and before the proxy replies
(e.g. to SIGKILL the writer between "written" and "acknowledged").
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal

import requests
from services import LOOPBACK

__all__ = ["BlackholeProxy", "Exchange", "RemoteWriteProxy"]


class BlackholeProxy:
    """TCP proxy on 127.0.0.1 that can be switched to swallow everything, both ways, closing nothing.

    While blackholed, bytes read from either side are dropped and neither a FIN nor a reset is passed
    on (the broker timing the connection out must not tell the client), as on a dead link.
    """

    def __init__(self, target_port: int) -> None:
        self.target = (LOOPBACK, target_port)
        self.forwarding = threading.Event()
        self.forwarding.set()
        self.connections = 0
        # Bytes forwarded client -> server and back: what the client's link carried (TCP payload).
        self.bytes_up = 0
        self.bytes_down = 0
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closing = False
        self._listener = socket.create_server((LOOPBACK, 0))
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._thread.start()

    def blackhole(self) -> None:
        self.forwarding.clear()

    def heal(self) -> None:
        self.forwarding.set()

    def _accept(self) -> None:
        while not self._closing:
            try:
                downstream, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                downstream.close()
                continue
            for s in (downstream, upstream):
                s.settimeout(None)
            with self._lock:
                self.connections += 1
                self._socks.update((downstream, upstream))
            for src, dst, up in ((downstream, upstream, True), (upstream, downstream, False)):
                threading.Thread(
                    target=self._pump, args=(src, dst, up), name="proxy-pump", daemon=True
                ).start()

    @property
    def bytes_total(self) -> int:
        with self._lock:
            return self.bytes_up + self.bytes_down

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if self.forwarding.is_set():
                    dst.sendall(data)
                    with self._lock:
                        if up:
                            self.bytes_up += len(data)
                        else:
                            self.bytes_down += len(data)
        except OSError:
            pass
        # While blackholed, only the side that went away is closed; the other end notices by itself.
        self._close(src)
        if self.forwarding.is_set():
            self._close(dst)

    def _close(self, s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)  # wakes the pump blocked in recv() on it
        s.close()
        with self._lock:
            self._socks.discard(s)

    def close(self) -> None:
        self._closing = True
        self._thread.join(5)
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            self._close(s)


# -- remote-write reverse proxy -----------------------------------------------------------------------

Mode = Literal["forward", "refuse", "hold"]

# Request headers a remote-write receiver looks at; everything else stays with the proxy.
_FORWARDED_HEADERS = (
    "Content-Encoding",
    "Content-Type",
    "X-Prometheus-Remote-Write-Version",
    "User-Agent",
    "X-Scope-OrgID",
    "Authorization",
)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that vanished mid-request (SIGKILLed on purpose) is not news


@dataclass(frozen=True)
class Exchange:
    """One POST the proxy answered: when (monotonic), in which mode, with what status, which body."""

    at: float
    mode: Mode
    status: int
    body_sha256: str


class RemoteWriteProxy:
    """HTTP reverse proxy on 127.0.0.1 in front of a remote-write receiver (``upstream_url``).

    Modes (switch any time; a request takes the mode current when it is answered):

    - ``forward()``: POST the body to the upstream and relay its answer (502 if it is unreachable);
    - ``refuse(status, retry_after=None)``: answer ``status`` without contacting the upstream;
    - ``hold()``: keep requests waiting until ``release()`` (which returns to forwarding) or ``close()``.

    ``after_forward(n, body)`` is called for the n-th (1-based) upstream 2xx answer, in the request's
    thread, after the upstream answered and before the proxy replies: whatever it does (kill the
    client, say) happens between "written" and "the writer knows it was written".
    """

    def __init__(
        self,
        upstream_url: str,
        *,
        after_forward: Callable[[int, bytes], None] | None = None,
        upstream_timeout_s: float = 30.0,
    ) -> None:
        self.upstream_url = upstream_url
        self.after_forward = after_forward
        self.upstream_timeout_s = upstream_timeout_s
        self.exchanges: list[Exchange] = []
        self.hook_errors: list[BaseException] = []
        self._mode: Mode = "forward"
        self._status = 503
        self._retry_after: str | None = None
        self._forwarded_ok = 0
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._released.set()
        self._closing = False
        self._server = _QuietServer((LOOPBACK, 0), self._handler_class())
        self._thread = threading.Thread(target=self._server.serve_forever, name="rw-proxy", daemon=True)
        self._thread.start()

    # -- control ------------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """Remote-write URL of the proxy (same path as the upstream's)."""
        path = urllib.parse.urlsplit(self.upstream_url).path or "/"
        return f"http://{LOOPBACK}:{self.port}{path}"

    @property
    def mode(self) -> Mode:
        with self._lock:
            return self._mode

    def forward(self) -> None:
        with self._lock:
            self._mode = "forward"
        self._released.set()

    def refuse(self, status: int, retry_after: str | None = None) -> None:
        with self._lock:
            self._mode, self._status, self._retry_after = "refuse", status, retry_after
        self._released.set()

    def hold(self) -> None:
        with self._lock:
            self._mode = "hold"
            self._released.clear()

    def release(self) -> None:
        """End ``hold``: waiting requests (and later ones) are forwarded."""
        self.forward()

    def close(self) -> None:
        self._closing = True
        self._released.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    # -- what happened --------------------------------------------------------------------------------

    def history(self) -> list[Exchange]:
        with self._lock:
            return list(self.exchanges)

    def count(self, status: int | None = None, mode: Mode | None = None) -> int:
        return sum(
            1
            for e in self.history()
            if (status is None or e.status == status) and (mode is None or e.mode == mode)
        )

    def forwarded_ok(self) -> int:
        """Upstream 2xx answers so far."""
        with self._lock:
            return self._forwarded_ok

    # -- serving ------------------------------------------------------------------------------------

    def _record(self, mode: Mode, status: int, body: bytes) -> None:
        exchange = Exchange(time.monotonic(), mode, status, hashlib.sha256(body).hexdigest())
        with self._lock:
            self.exchanges.append(exchange)

    def _decide(self) -> tuple[Mode, int, str | None]:
        """Wait while holding; then the mode (and refusal) that answers the request."""
        while True:
            with self._lock:
                mode, status, retry_after = self._mode, self._status, self._retry_after
            if mode != "hold" or self._closing:
                return ("refuse", 503, None) if mode == "hold" else (mode, status, retry_after)
            self._released.wait(0.1)

    def _forward(self, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
        try:
            resp = requests.post(
                self.upstream_url,
                data=body,
                headers=headers,
                timeout=self.upstream_timeout_s,
                allow_redirects=False,
            )
        except requests.RequestException as exc:
            return 502, f"proxy: upstream unreachable: {type(exc).__name__}\n".encode(), {}
        out_headers = {k: resp.headers[k] for k in ("Content-Type", "Retry-After") if k in resp.headers}
        return resp.status_code, resp.content, out_headers

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like a real receiver

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length > 0 else b""
                mode, status, retry_after = proxy._decide()
                reply_headers: dict[str, str] = {}
                if mode == "refuse":
                    reply = f"proxy: injected fault, HTTP {status}\n".encode()
                    if retry_after is not None:
                        reply_headers["Retry-After"] = retry_after
                else:
                    headers = {k: v for k in _FORWARDED_HEADERS if (v := self.headers.get(k)) is not None}
                    status, reply, reply_headers = proxy._forward(body, headers)
                    if 200 <= status < 300:
                        with proxy._lock:
                            proxy._forwarded_ok += 1
                            n = proxy._forwarded_ok
                        proxy._record(mode, status, body)
                        if proxy.after_forward is not None:
                            try:
                                proxy.after_forward(n, body)
                            except Exception as exc:  # reported by the test, not lost in a thread
                                proxy.hook_errors.append(exc)
                        self._reply(status, reply, reply_headers)
                        return
                proxy._record(mode, status, body)
                self._reply(status, reply, reply_headers)

            def _reply(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                # The client may be gone (killed by the hook): nobody to tell.
                with contextlib.suppress(OSError):
                    self.send_response(status)
                    self.send_header("Content-Type", headers.pop("Content-Type", "text/plain"))
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    self.wfile.flush()

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler
