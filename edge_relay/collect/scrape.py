"""Fetch one exposition from one target.

A scrape either yields the whole body or fails: a timeout, a non-2xx answer, a body over the size
limit or a broken connection is a failed scrape (``up`` = 0), never a partial one.

The timeout is a wall-clock deadline on the whole scrape (connect, request, headers, body), not a
per-read timeout: an exporter that trickles one byte every half second would otherwise hold its scrape,
and with it the relay's whole cycle (``Relay.cycle`` waits for every target), far past the timeout.
A timer shuts the socket down at the deadline, which wakes a ``connect``/``recv`` blocked in any layer
(http.client's header parsing, chunked decoding, TLS); the scrape then fails with ``timeout``. Only the
name lookup (``getaddrinfo``) cannot be interrupted this way; exporters are addressed by loopback IP or
a cluster-local name.

The client is the standard library's ``http.client`` rather than ``requests``: the deadline needs the
socket itself, which ``requests`` hides until the headers have arrived. What ``requests`` did for us and
a scrape needs is kept: one keep-alive connection per target (re-opened once if the exporter closed
it while idle), gzip, redirects (up to 10, as Prometheus), basic auth from the URL's userinfo, no proxy.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import socket
import ssl
import threading
import time
import urllib.parse
import zlib
from dataclasses import dataclass

ACCEPT = {
    # Text 0.0.4 is preferred: it is what Kepler/dcgm/node-exporter serve by default and parses fastest.
    "auto": "text/plain;version=0.0.4;q=1,application/openmetrics-text;version=1.0.0;q=0.5,*/*;q=0.1",
    "text": "text/plain;version=0.0.4;q=1,*/*;q=0.1",
    "openmetrics": "application/openmetrics-text;version=1.0.0;q=1,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
}
USER_AGENT = "kepler-edge-relay/0.1"
_CHUNK = 256 * 1024
_MAX_REDIRECTS = 10
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# Errors of a keep-alive connection the exporter closed while it was idle: the request is sent again
# once on a fresh connection, as urllib3 does.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


@dataclass(frozen=True, slots=True)
class Fetched:
    timestamp_ms: int  # when the scrape started, as Prometheus stamps samples
    ok: bool
    # The raw (uncompressed) body: ``parse`` decodes it as UTF-8 block by block, so a body is held in
    # memory once, not once as bytes and again as str.
    body: bytes | bytearray
    content_type: str
    duration_s: float
    error: str = ""
    body_bytes: int = 0


class _Failed(Exception):
    """A scrape that failed for a reason of its own (status, size, encoding); the text is the error."""


class _Deadline:
    """Shuts the scrape's sockets down when the deadline passes, whatever call is blocked on them.

    Each watched socket is a ``dup`` of the connection's: ``shutdown`` acts on the socket, not the
    descriptor, so the dup wakes the original, and it stays usable when TLS wraps (and detaches) the
    original object mid-handshake.
    """

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        self.expired = False
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return self.at - time.monotonic()

    def watch(self, sock: socket.socket) -> None:
        dup = socket.fromfd(sock.fileno(), sock.family, sock.type)
        with self._lock:
            if not self.expired:
                self._socks.append(dup)
                return
        _shutdown(dup)
        dup.close()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            socks, self._socks = self._socks, []
        for sock in socks:
            _shutdown(sock)
            sock.close()

    def cancel(self) -> None:
        self._timer.cancel()
        with self._lock:
            socks, self._socks = self._socks, []
        for sock in socks:
            sock.close()


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed by the peer or by us
        sock.shutdown(socket.SHUT_RDWR)


class _HTTPConnection(http.client.HTTPConnection):
    deadline: _Deadline | None = None
    origin: tuple[str, str, int | None] = ("", "", None)

    def connect(self) -> None:
        super().connect()
        if self.deadline is not None:
            self.deadline.watch(self.sock)


class _HTTPSConnection(http.client.HTTPSConnection):
    deadline: _Deadline | None = None
    origin: tuple[str, str, int | None] = ("", "", None)

    def __init__(self, host: str, port: int | None, *, timeout: float) -> None:
        self._tls = ssl.create_default_context()
        super().__init__(host, port, timeout=timeout, context=self._tls)

    def connect(self) -> None:
        # TCP first, watched before the handshake so a stalled handshake ends at the deadline too.
        http.client.HTTPConnection.connect(self)
        if self.deadline is not None:
            self.deadline.watch(self.sock)
        self.sock = self._tls.wrap_socket(self.sock, server_hostname=self.host)


_Conn = _HTTPConnection | _HTTPSConnection


class Scraper:
    """Fetches one target; keeps one keep-alive connection to it."""

    def __init__(self, url: str, *, fmt: str, timeout_s: float, body_limit_bytes: int) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.body_limit_bytes = body_limit_bytes
        # Exporters are local: no HTTP(S)_PROXY / .netrc from the environment (Prometheus ignores them
        # for scrapes too).
        self.headers = {
            "Accept": ACCEPT[fmt],
            "Accept-Encoding": "gzip",
            "User-Agent": USER_AGENT,
            "X-Prometheus-Scrape-Timeout-Seconds": f"{timeout_s:g}",
        }
        self._conn: _Conn | None = None
        self._origin = _origin(urllib.parse.urlsplit(url))

    def fetch(self) -> Fetched:
        started = time.time()
        timestamp_ms = int(started * 1000)
        deadline = _Deadline(self.timeout_s)
        phase = ["connecting"]
        try:
            body, content_type = self._get(deadline, phase)
        except _Failed as e:
            error = str(e)
        except (OSError, http.client.HTTPException, ValueError) as e:
            # ValueError: a URL or Location http.client refuses (control characters, bad port).
            # A socket timeout set to the time left can fire a moment before the timer thread marks
            # the deadline expired: both mean the deadline passed.
            if deadline.expired or deadline.left() <= 0.05:
                error = f"timeout after {self.timeout_s:g}s while {phase[0]}"
            else:
                error = f"{type(e).__name__}: {_short(e)}"
        else:
            return Fetched(timestamp_ms, True, body, content_type, time.time() - started, "", len(body))
        finally:
            deadline.cancel()
        self._drop()
        return Fetched(timestamp_ms, False, b"", "", time.time() - started, error)

    def close(self) -> None:
        self._drop()

    # --- one GET, redirects followed ----------------------------------------------------------------

    def _get(self, deadline: _Deadline, phase: list[str]) -> tuple[bytearray, str]:
        url = self.url
        for _ in range(_MAX_REDIRECTS + 1):
            parts = urllib.parse.urlsplit(url)
            resp, conn = self._request(parts, deadline, phase)
            if resp.status in _REDIRECTS and resp.getheader("Location"):
                url = urllib.parse.urljoin(url, resp.getheader("Location", ""))
                self._release(conn, reusable=False)
                continue
            if not 200 <= resp.status < 300:
                self._release(conn, reusable=False)
                raise _Failed(f"HTTP {resp.status}")
            phase[0] = "reading the body"
            try:
                body = self._read_body(resp, deadline)
            except BaseException:
                self._release(conn, reusable=False)
                raise
            self._release(conn, reusable=not resp.will_close)
            return body, resp.getheader("Content-Type", "")
        raise _Failed(f"more than {_MAX_REDIRECTS} redirects")

    def _request(
        self, parts: urllib.parse.SplitResult, deadline: _Deadline, phase: list[str]
    ) -> tuple[http.client.HTTPResponse, _Conn]:
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise _Failed(f"cannot scrape {urllib.parse.urlunsplit(parts)!r}: not an http(s) URL")
        headers = dict(self.headers)
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
            headers["Authorization"] = f"Basic {token}"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        for attempt in (1, 2):
            conn, reused = self._connection(parts, deadline)
            conn.deadline = deadline
            try:
                phase[0] = "connecting" if conn.sock is None else "sending the request"
                if conn.sock is None:
                    conn.timeout = max(deadline.left(), 0.001)
                    conn.connect()
                phase[0] = "sending the request"
                conn.request("GET", target, headers=headers)
                phase[0] = "waiting for the response"
                return conn.getresponse(), conn
            except _STALE:
                self._release(conn, reusable=False)
                if not reused or attempt == 2 or deadline.expired:
                    raise
            except BaseException:
                self._release(conn, reusable=False)
                raise
        raise AssertionError("unreachable")

    def _connection(self, parts: urllib.parse.SplitResult, deadline: _Deadline) -> tuple[_Conn, bool]:
        """The kept connection when ``parts`` is the target's own origin, else a new one."""
        if _origin(parts) == self._origin and self._conn is not None:
            conn, self._conn = self._conn, None
            if conn.sock is not None:
                deadline.watch(conn.sock)
            return conn, True
        timeout = max(deadline.left(), 0.001)
        port = parts.port  # raises ValueError for a bad port
        conn: _Conn
        if parts.scheme == "https":
            conn = _HTTPSConnection(parts.hostname or "", port, timeout=timeout)
        else:
            conn = _HTTPConnection(parts.hostname or "", port, timeout=timeout)
        conn.origin = _origin(parts)
        return conn, False

    def _release(self, conn: _Conn, *, reusable: bool) -> None:
        conn.deadline = None
        if reusable and conn.sock is not None and conn.origin == self._origin and self._conn is None:
            self._conn = conn
        else:
            conn.close()

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # --- the body -----------------------------------------------------------------------------------

    def _read_body(self, resp: http.client.HTTPResponse, deadline: _Deadline) -> bytearray:
        limit = self.body_limit_bytes
        coding = resp.getheader("Content-Encoding", "identity").strip().lower()
        if coding in ("gzip", "x-gzip"):
            inflate: zlib._Decompress | None = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif coding in ("identity", ""):
            inflate = None
        else:
            raise _Failed(f"unsupported Content-Encoding {coding!r}")
        too_large = f"body larger than body_limit_bytes={limit}"
        length = resp.getheader("Content-Length")
        if inflate is None and length is not None and length.isdigit() and int(length) > limit:
            raise _Failed(too_large)  # refused before reading a byte of it
        body = bytearray()
        received = 0
        while True:
            chunk = resp.read(_CHUNK)
            if deadline.expired:
                raise TimeoutError  # the socket was shut down under the read: a timeout, not an EOF
            if not chunk:
                break
            received += len(chunk)
            if inflate is None:
                body += chunk
            else:
                # The limit applies to the uncompressed body (bomb guard): never inflate past it.
                while chunk:
                    try:
                        body += inflate.decompress(chunk, limit + 1 - len(body))
                    except zlib.error as e:
                        raise _Failed(f"bad gzip body: {e}") from None
                    if len(body) > limit:
                        raise _Failed(too_large)
                    chunk = inflate.unconsumed_tail
                    if inflate.eof and inflate.unused_data:  # a multi-member gzip stream
                        chunk = inflate.unused_data
                        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
            if len(body) > limit:
                raise _Failed(too_large)
        if resp.length:  # http.client counts down Content-Length; what is left never came
            raise _Failed(f"connection closed {resp.length} bytes before the end of the body")
        if inflate is not None and received and not inflate.eof:
            raise _Failed("gzip body truncated")
        return body


def _origin(parts: urllib.parse.SplitResult) -> tuple[str, str, int | None]:
    try:
        port = parts.port
    except ValueError:
        port = -1
    return parts.scheme, parts.hostname or "", port


def _short(e: BaseException) -> str:
    text = str(e)
    return text if len(text) <= 300 else text[:300] + "..."
