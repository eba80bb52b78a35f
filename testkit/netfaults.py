"""Network fault injectors for the integration tests and the benches, all on 127.0.0.1.

``LinkProxy``: a TCP proxy standing for the network link between a client and a server, counting the
bytes it forwards each way; the link can be blackholed (everything dropped, nothing closed), stalled
(nothing read or accepted, bytes wait in the kernel buffers) or cut (listener closed, connections reset)
and healed again.

``RemoteWriteProxy``: an HTTP reverse proxy in front of a remote-write receiver that forwards POSTs,
answers them itself with a chosen error status (optionally with ``Retry-After``), or holds them until
released; an ``after_forward`` hook runs after the receiver answered 2xx and before the proxy replies
(e.g. to SIGKILL the writer between "written" and "acknowledged").  ``transparent=True`` makes it a
proxy a client cannot tell from the receiver by the bytes it gets back (the benches count them).
``testkit.rw_tap.RemoteWriteTap`` builds on it to decode what the receiver accepted.
"""

from __future__ import annotations

import contextlib
import hashlib
import select
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal

import requests

from testkit.services import LOOPBACK

__all__ = ["Exchange", "LinkMode", "LinkProxy", "RemoteWriteProxy"]

# -- the link -----------------------------------------------------------------------------------------

LinkMode = Literal["forward", "blackhole", "stall", "cut"]


class LinkProxy:
    """TCP proxy on 127.0.0.1 in front of ``target_port`` whose link can fail in three ways.

    - ``blackhole()``: bytes read from either side are dropped, both ways, and neither a FIN nor a reset
      is passed on (a server timing the connection out must not tell the client); new connections are
      still accepted, into the void.  A dead link that only keepalives can tell; what was dropped is
      gone, so a connection that outlives the blackhole has a hole in its stream.
    - ``stall()``: nothing is read, forwarded or accepted; bytes wait in the kernel buffers (the stream
      is intact if the link comes back before either side gives up) and new connections wait in the
      listen backlog: a silent partition, as TCP would ride it out.
    - ``cut()``: the listening socket is closed (new connections are refused: ECONNREFUSED) and every
      open connection is reset (RST) on both sides, as when the uplink interface goes away.
    - ``heal()``: back to forwarding (after a cut, listening on the same port again).

    Counts the bytes forwarded client -> target (``bytes_up``) and back (``bytes_down``; both:
    ``bytes_total``), i.e. the TCP payload the client's link carried, and the connections made through
    it (``connections``).  ``forwarding`` is set while the link works.
    """

    def __init__(self, target_port: int, name: str = "proxy") -> None:
        self.target = (LOOPBACK, target_port)
        self.name = name
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections = 0
        self.forwarding = threading.Event()
        self.forwarding.set()
        self._mode: LinkMode = "forward"
        self._lock = threading.Lock()
        self._flowing = threading.Event()  # cleared while stalled: the pumps wait
        self._flowing.set()
        self._listener_closed = threading.Event()
        self._listening = threading.Event()
        self._listening.set()
        self._socks: set[socket.socket] = set()
        self._closing = False
        self._listener: socket.socket | None = socket.create_server((LOOPBACK, 0), backlog=128)
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name=f"{name}-accept", daemon=True)
        self._thread.start()

    @property
    def mode(self) -> LinkMode:
        with self._lock:
            return self._mode

    @property
    def bytes_total(self) -> int:
        with self._lock:
            return self.bytes_up + self.bytes_down

    def blackhole(self) -> None:
        self._switch("blackhole")

    def stall(self) -> None:
        self._switch("stall")

    def cut(self) -> None:
        with self._lock:
            self._mode = "cut"
            self._listener_closed.clear()
            socks, self._socks = self._socks, set()
        self.forwarding.clear()
        self._flowing.set()  # stalled pumps must wake up to see their sockets reset
        if not self._listener_closed.wait(5):
            raise RuntimeError(f"{self.name}: listener did not close")
        for s in socks:
            _reset(s)

    def heal(self) -> None:
        self._switch("forward")
        if not self._listening.wait(35):
            raise RuntimeError(f"{self.name}: could not listen on port {self.port} again")

    def close(self) -> None:
        self._closing = True
        self._flowing.set()
        self._thread.join(5)
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            self._close(s)

    # -- internals ------------------------------------------------------------------------------------

    def _switch(self, mode: LinkMode) -> None:
        with self._lock:
            self._mode = mode
            if mode == "stall":
                self._flowing.clear()
            else:
                self._flowing.set()
        if mode == "forward":
            self.forwarding.set()
        else:
            self.forwarding.clear()

    def _serve(self) -> None:
        while not self._closing:
            mode = self.mode
            if mode == "cut":
                if self._listener is not None:
                    self._listening.clear()
                    self._listener.close()
                    self._listener = None
                self._listener_closed.set()
                time.sleep(0.05)
                continue
            if self._listener is None:
                self._listener = self._rebind()
                self._listening.set()
            if mode == "stall":  # connections wait in the backlog, as SYNs on a dead link would
                time.sleep(0.05)
                continue
            ready, _, _ = select.select([self._listener], [], [], 0.1)
            if not ready:
                continue
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            threading.Thread(
                target=self._connect, args=(client,), name=f"{self.name}-conn", daemon=True
            ).start()
        if self._listener is not None:
            self._listener.close()

    def _rebind(self) -> socket.socket:
        deadline = time.monotonic() + 30
        while True:
            try:
                return socket.create_server((LOOPBACK, self.port), backlog=128)  # SO_REUSEADDR is set
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            _reset(client)
            client.close()
            return
        upstream.settimeout(None)
        client.settimeout(None)
        with self._lock:
            if self._mode == "cut":
                for s in (client, upstream):
                    _reset(s)
                    s.close()
                return
            self.connections += 1
            self._socks.update((client, upstream))
        for src, dst, up in ((client, upstream, True), (upstream, client, False)):
            threading.Thread(
                target=self._pump, args=(src, dst, up), name=f"{self.name}-pump", daemon=True
            ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while True:
                self._flowing.wait()
                data = src.recv(65536)
                if not data:
                    break
                self._flowing.wait()  # stalled while we read: hold the bytes until healed
                mode = self.mode
                if mode == "cut":
                    break
                if mode == "blackhole":
                    continue  # swallowed
                dst.sendall(data)
                with self._lock:
                    if up:
                        self.bytes_up += len(data)
                    else:
                        self.bytes_down += len(data)
        except OSError:
            pass
        mode = self.mode
        if mode == "cut":  # cut() set SO_LINGER 0 on both: close() alone sends the RST
            for s in (src, dst):
                with self._lock:
                    self._socks.discard(s)
                s.close()
        elif mode == "blackhole":  # only the side that went away; the other end notices by itself
            self._close(src)
        else:
            self._close(src)
            self._close(dst)

    def _close(self, s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)  # wakes the pump blocked in recv() on it
        s.close()
        with self._lock:
            self._socks.discard(s)


def _reset(s: socket.socket) -> None:
    """Abort a TCP connection: RST to the peer, and wake up a thread blocked in recv() on it."""
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RD)  # sends nothing; recv() returns b"" in the pump, which closes (RST)


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
# Headers a transparent proxy does not pass on: hop-by-hop ones (RFC 9110, 7.6.1), and the length,
# which it writes itself (the body it has is de-chunked).
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that vanished mid-request (SIGKILLed or reset on purpose) is not news


@dataclass(frozen=True)
class Exchange:
    """One POST the proxy answered: when (monotonic), in which mode, with what status, which body."""

    at: float
    mode: Mode
    status: int
    body_sha256: str


@dataclass
class _Answer:
    status: int
    body: bytes
    headers: list[tuple[str, str]]
    reason: str | None = None  # set: relay the upstream's status line and headers verbatim


class RemoteWriteProxy:
    """HTTP reverse proxy on 127.0.0.1 in front of a remote-write receiver (``upstream_url``).

    Modes (switch any time; a request takes the mode current when it is answered):

    - ``forward()``: POST the body to the upstream and relay its answer (502 if it is unreachable);
    - ``refuse(status, retry_after=None)``: answer ``status`` without contacting the upstream;
    - ``hold()``: keep requests waiting until ``release()`` (which returns to forwarding) or ``close()``.

    ``after_forward(n, body)`` is called for the n-th (1-based) upstream 2xx answer, in the request's
    thread, after the upstream answered and before the proxy replies: whatever it does (kill the
    client, say) happens between "written" and "the writer knows it was written".

    By default only the headers a receiver looks at are forwarded, and the reply is the proxy's own
    (Python's status line and ``Server`` header, the upstream's status, body, ``Content-Type`` and
    ``Retry-After``).  ``transparent=True``: every request header goes on (``Accept-Encoding`` too), the
    request goes to the upstream's origin with the client's path, GETs are forwarded as well (protocol
    probes), and the client gets the receiver's status line, headers and raw body, only re-framed with
    ``Content-Length`` if it came chunked: a byte-counting proxy in front sees what the receiver sent.
    """

    def __init__(
        self,
        upstream_url: str,
        *,
        after_forward: Callable[[int, bytes], None] | None = None,
        upstream_timeout_s: float = 30.0,
        transparent: bool = False,
        name: str = "proxy",
    ) -> None:
        self.upstream_url = upstream_url
        parts = urllib.parse.urlsplit(upstream_url)
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.after_forward = after_forward
        self.upstream_timeout_s = upstream_timeout_s
        self.transparent = transparent
        self.name = name
        self.exchanges: list[Exchange] = []
        self.hook_errors: list[BaseException] = []
        self._mode: Mode = "forward"
        self._status = 503
        self._retry_after: str | None = None
        self._forwarded_ok = 0
        self._lock = threading.Lock()
        self._local = threading.local()  # a requests.Session per handler thread: keep-alive upstream
        self._released = threading.Event()
        self._released.set()
        self._closing = False
        self._server = _QuietServer((LOOPBACK, 0), self._handler_class())
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)
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

    # -- hooks for subclasses -----------------------------------------------------------------------

    def _received(self, headers: Mapping[str, str], body: bytes) -> None:
        """Every POST, as it comes in (before the mode decides its fate)."""

    def _accepted(self, n: int, headers: Mapping[str, str], body: bytes) -> None:
        """The n-th upstream 2xx answer, before the proxy replies: runs ``after_forward``."""
        if self.after_forward is not None:
            try:
                self.after_forward(n, body)
            except Exception as exc:  # reported by the test, not lost in a thread
                self.hook_errors.append(exc)

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

    def _session(self) -> requests.Session:
        session: requests.Session | None = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.trust_env = False  # straight to the upstream, whatever *_proxy says
        return session

    def _forward(self, handler: BaseHTTPRequestHandler, body: bytes) -> _Answer:
        if self.transparent:
            headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP | {"host"}}
            headers.pop("Content-Length", None)
            headers.setdefault("Accept-Encoding", "identity")  # not requests' default: as to the client
            url = self.origin + handler.path
        else:
            headers = {k: v for k in _FORWARDED_HEADERS if (v := handler.headers.get(k)) is not None}
            url = self.upstream_url
        try:
            resp = self._session().request(
                handler.command,
                url,
                data=body if handler.command == "POST" else None,
                headers=headers,
                timeout=self.upstream_timeout_s,
                allow_redirects=False,
                stream=self.transparent,
            )
            if not self.transparent:
                kept = [(k, resp.headers[k]) for k in ("Content-Type", "Retry-After") if k in resp.headers]
                return _Answer(resp.status_code, resp.content, kept)
            raw = resp.raw.read(decode_content=False)
            resp.raw.release_conn()  # back to the pool (Response.close() would close the connection)
            kept = [(k, v) for k, v in resp.raw.headers.items() if k.lower() not in _HOP_BY_HOP]
            return _Answer(resp.status_code, raw, kept, resp.reason or "")
        except requests.RequestException as exc:
            text = f"{self.name}: upstream unreachable: {type(exc).__name__}\n".encode()
            return _Answer(
                502, text, [("Content-Type", "text/plain")], "Bad Gateway" if self.transparent else None
            )

    def _post(self, handler: BaseHTTPRequestHandler, body: bytes) -> _Answer:
        self._received(handler.headers, body)
        mode, status, retry_after = self._decide()
        if mode == "refuse":
            headers = [("Retry-After", retry_after)] if retry_after is not None else []
            answer = _Answer(status, f"{self.name}: injected fault, HTTP {status}\n".encode(), headers)
        else:
            answer = self._forward(handler, body)
            if 200 <= answer.status < 300:
                with self._lock:
                    self._forwarded_ok += 1
                    n = self._forwarded_ok
                self._record(mode, answer.status, body)
                self._accepted(n, handler.headers, body)
                return answer
        self._record(mode, answer.status, body)
        return answer

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like a real receiver

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length > 0 else b""
                self._reply(proxy._post(self, body))

            def do_GET(self) -> None:
                if not proxy.transparent:
                    self.send_error(501, f"Unsupported method ({self.command!r})")
                    return
                self._reply(proxy._forward(self, b""))

            def _reply(self, answer: _Answer) -> None:
                # The client may be gone (killed by the hook, reset by a LinkProxy): nobody to tell.
                with contextlib.suppress(OSError):
                    if answer.reason is not None:
                        self._reply_verbatim(answer)
                        return
                    headers = dict(answer.headers)
                    self.send_response(answer.status)
                    self.send_header("Content-Type", headers.pop("Content-Type", "text/plain"))
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(answer.body)))
                    self.end_headers()
                    self.wfile.write(answer.body)
                    self.wfile.flush()

            def _reply_verbatim(self, answer: _Answer) -> None:
                reply = [(k, v) for k, v in answer.headers if k.lower() != "content-length"]
                if answer.status >= 200 and answer.status not in (204, 304):
                    reply.append(("Content-Length", str(len(answer.body))))
                head = "".join(f"{k}: {v}\r\n" for k, v in reply)
                status_line = f"HTTP/1.1 {answer.status} {answer.reason}\r\n"
                self.wfile.write((status_line + head + "\r\n").encode("latin-1") + answer.body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler
