"""Prometheus remote-write 1.0 output: batch -> protobuf -> snappy (``request.py`` beside this module)
-> HTTP POST, with retries.

Works against Prometheus (``--web.enable-remote-write-receiver``), VictoriaMetrics and Mimir.
The outcome decides what the edge is told: only ``written`` and ``rejected`` are answered (``sink.py``
narrows a rejection down to samples first); ``retry_later`` is not, so the edge keeps the batch in its
spool and re-publishes it.

Re-sending a batch that was already written changes nothing stored, but the answer depends on the
receiver: VictoriaMetrics accepts it; Prometheus 2.x (no out-of-order window) answers 400 "out of order
sample" for every series with more than one sample in the batch, and this client reports that as
``rejected``, like every 400 that names samples (a 400 that does not is a configuration error, retried).
"""

from __future__ import annotations

import http.client
import importlib.metadata
import logging
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import requests
import urllib3.exceptions

from cloud_ingest.sinks.remote_write.answers import (
    PERMANENT_5XX_MARKERS,
    RETRY_4XX,
    RETRY_AFTER_STATUSES,
    refuses_samples,
)
from cloud_ingest.sinks.remote_write.connection import (
    Connection,
    Credentials,
    CredentialsError,
    session_for,
)
from cloud_ingest.sinks.remote_write.request import LABEL_CACHE_BYTES, LabelBytes, encode_body
from relay_common.backoff import Backoff, parse_retry_after
from relay_common.ratelimit import RateLimitedLog
from schemas.model import Batch

# A stable name in the log lines, wherever the module lives.
log = logging.getLogger("cloud_ingest.write")


def _package_version() -> str:
    try:
        return importlib.metadata.version("kepler-edge-relay")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


DEFAULT_USER_AGENT = f"kepler-edge-relay-cloud-ingest/{_package_version()}"

# ---------------------------------------------------------------------------------------------------
# HTTP client
# ---------------------------------------------------------------------------------------------------

WriteStatus = Literal["written", "retry_later", "rejected"]


@dataclass(frozen=True, slots=True)
class WriteOutcome:
    """Result of :meth:`RemoteWriteClient.write`.

    ``written``: 2xx, ack the batch.  ``rejected``: a definitive, sample-level refusal (a 400/409/422
    whose body names out-of-order, out-of-bounds, duplicate, too-old or too-far-in-the-future samples, or
    ``permanent_after`` identical 5xx naming such a cause); retrying the same bytes cannot help; ack and
    dead-letter, ``reason`` says why.  ``retry_later``: still failing after ``max_retry_s`` (or
    stopping); do not ack, the edge re-publishes.  Configuration errors (any other 3xx/4xx but 408/429:
    a redirect, 401, 403, 404, 405, 413, a 400 that names no sample ...) end as ``retry_later`` too:
    they say the receiver or our configuration is wrong, not the data, so the data must stay at the edge.
    """

    status: WriteStatus
    http_status: int | None = None
    attempts: int = 0
    reason: str = ""
    elapsed_s: float = 0.0


REASON_BODY_BYTES = 512
# Error bodies are drained up to this size so the keep-alive connection can be reused; anything
# bigger is abandoned (the connection is closed) rather than downloaded.
_MAX_DRAIN_BYTES = 64 * 1024
# Set by this client on every request; a configured header of the same name (any case) is refused.
PROTOCOL_HEADERS = (
    "Content-Type",
    "Content-Encoding",
    "Content-Length",
    "X-Prometheus-Remote-Write-Version",
    "User-Agent",
)
_PROTOCOL_HEADERS = frozenset(h.lower() for h in PROTOCOL_HEADERS)
# RFC 9110 field-name (a token).
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_NETWORK_ERRORS = (
    requests.RequestException,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
    OSError,
)


def check_headers(headers: Mapping[str, str]) -> None:
    """Refuse extra headers this client cannot send: ValueError naming the first bad header.

    Protocol headers (``PROTOCOL_HEADERS``, any case) are the client's own; names must be HTTP tokens,
    values ASCII without control characters or leading/trailing blanks. requests and http.client
    would otherwise fail at send time, on every retry, or send something else than configured.
    """
    seen: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ValueError(f"header {name!r}: name and value must be strings")
        if name.lower() in _PROTOCOL_HEADERS:
            raise ValueError(
                f"header {name!r} is set by the remote-write client itself and cannot be configured "
                f"(reserved: {', '.join(PROTOCOL_HEADERS)})"
            )
        if not _HEADER_NAME_RE.fullmatch(name):
            raise ValueError(f"header {name!r}: not a valid HTTP header name (letters, digits, -, _ ...)")
        if not value.isascii() or any(not c.isprintable() for c in value) or value != value.strip():
            raise ValueError(
                f"header {name!r}: the value must be printable ASCII without line breaks or "
                "leading/trailing blanks"
            )
        if name.lower() in seen:
            raise ValueError(f"header {name!r} is given twice (also as {seen[name.lower()]!r})")
        seen[name.lower()] = name


@dataclass(frozen=True, slots=True)
class _Attempt:
    kind: WriteStatus  # "retry_later" here means "retryable"
    http_status: int | None
    reason: str
    retry_after_s: float | None = None
    config_error: bool = False  # a 3xx/4xx that says the receiver or our configuration is wrong


def _printable(data: bytes) -> str:
    text = data.decode("utf-8", errors="replace")
    # Bodies end up in logs and in quarantine reasons: no raw control characters or newlines.
    return "".join(c if c.isprintable() else " " for c in text).strip()


def _shorten(text: str, limit: int = REASON_BODY_BYTES) -> str:
    text = _printable(text.encode("utf-8", errors="replace"))
    return text if len(text) <= limit else text[:limit] + "..."


class RemoteWriteClient:
    """POSTs remote-write bodies over one keep-alive ``requests.Session``.

    Never raises for HTTP or network failures; every call returns a :class:`WriteOutcome`.
    Retries 5xx, 408, 429, configuration errors (3xx/4xx that are not a sample-level rejection, a
    credentials or TLS file that cannot be read, a TLS handshake that fails: status 0; each
    one is passed to ``on_config_error`` with its status and logged at ERROR, at most once per
    ``warn_interval_s``), connection errors, timeouts and unparseable responses with capped,
    jittered exponential backoff (a fresh clone of ``backoff`` per call) until ``max_retry_s`` has
    elapsed or ``stop_event`` is set (the first attempt is always made; a set event ends retries).
    For 429 and 503 a ``Retry-After`` header sets a floor on the delay, but the delay never exceeds
    ``backoff.max_s``: a server asking for an hour must not stall the ingester beyond our own retry
    ceiling (the edge keeps the data anyway).  The next attempt is not made if it would start after
    ``max_retry_s``.

    ``timeout_s`` applies to connecting and to each socket read (requests semantics), not to the whole
    exchange.  Thread-safe: worker threads may share one client (and its connection pool).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        headers: Mapping[str, str] | None = None,
        user_agent: str = DEFAULT_USER_AGENT,
        backoff: Backoff | None = None,
        max_retry_s: float = 300.0,
        session: requests.Session | None = None,
        sleep: Callable[[float], object] = time.sleep,
        stop_event: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
        warn_interval_s: float = 30.0,
        permanent_after: int = 3,
        on_config_error: Callable[[int], object] | None = None,
        label_cache_bytes: int = LABEL_CACHE_BYTES,
        connection: Connection | None = None,
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"remote-write URL must be http(s)://host[:port]/path, got {url!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not max_retry_s >= 0:
            raise ValueError(f"max_retry_s must be >= 0, got {max_retry_s!r}")
        self.url = url
        self.timeout_s = float(timeout_s)
        self.max_retry_s = float(max_retry_s)
        self.permanent_after = permanent_after
        self._headers = {
            "Content-Encoding": "snappy",
            "Content-Type": "application/x-protobuf",
            "X-Prometheus-Remote-Write-Version": "0.1.0",
            "User-Agent": user_agent,
        }
        headers = headers or {}
        check_headers(headers)
        self._headers.update(headers)
        self._backoff = backoff if backoff is not None else Backoff(0.5, 30.0)
        self._owns_session = session is None
        if session is None:
            session = session_for(connection)
        self._session = session
        self._credentials = Credentials(connection) if connection is not None else None
        self._stop_event = stop_event
        if stop_event is not None and sleep is time.sleep:
            # Sleep on the event so shutdown does not wait out a 30 s backoff.
            self._sleep: Callable[[float], object] = stop_event.wait
        else:
            self._sleep = sleep
        self._clock = clock
        self._warn = RateLimitedLog(log, warn_interval_s, clock)
        self._config_error = RateLimitedLog(log, warn_interval_s, clock, logging.ERROR)
        self._on_config_error = on_config_error
        # Public: each batch's request is measured with it before the write (cloud_ingest.pipeline.decode).
        self.labels_cache = LabelBytes(label_cache_bytes) if label_cache_bytes else None

    @property
    def headers(self) -> dict[str, str]:
        """Headers sent with every request (a copy)."""
        return dict(self._headers)

    def close(self) -> None:
        if self._owns_session:
            self._session.close()

    def __enter__(self) -> RemoteWriteClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, batch: Batch, *, permanent_after: int | None = None) -> WriteOutcome:
        body = encode_body(batch, self.labels_cache)
        return self.write_body(body, batch.sample_count, permanent_after=permanent_after)

    def write_body(
        self, body: bytes, samples: int = 0, *, permanent_after: int | None = None
    ) -> WriteOutcome:
        """POST an already snappy-compressed WriteRequest; ``samples`` is only used in log lines.
        ``permanent_after`` overrides the client's count of identical "never" 5xx answers (1 for the
        parts of a batch whose whole already got that answer)."""
        permanent_after = self.permanent_after if permanent_after is None else permanent_after
        backoff = self._backoff.clone()
        start = self._clock()
        attempts = 0
        permanent = 0
        while True:
            attempts += 1
            result = self._attempt(body)
            elapsed = self._clock() - start
            if result.kind == "written":
                if attempts > 1:
                    log.info("remote write to %s succeeded after %d attempts", self.url, attempts)
                return WriteOutcome("written", result.http_status, attempts, "", elapsed)
            if result.kind == "rejected":
                log.error(
                    "remote write of %d samples to %s rejected, not retrying: %s",
                    samples,
                    self.url,
                    result.reason,
                )
                return WriteOutcome("rejected", result.http_status, attempts, result.reason, elapsed)

            status = result.http_status or 0
            if result.config_error and self._on_config_error is not None:
                self._on_config_error(status)
            if status >= 500 and any(m in result.reason.lower() for m in PERMANENT_5XX_MARKERS):
                permanent += 1
                if permanent >= permanent_after:
                    reason = f"{result.reason} (answered {permanent} times: the receiver will not take it)"
                    log.error(
                        "remote write of %d samples to %s refused for good: %s", samples, self.url, reason
                    )
                    return WriteOutcome("rejected", result.http_status, attempts, reason, elapsed)
            delay = backoff.next_delay()
            if result.retry_after_s is not None:
                delay = max(delay, result.retry_after_s)
            delay = min(delay, backoff.max_s)
            if self._stopping():
                return self._give_up(result, attempts, elapsed, "stopping")
            if elapsed + delay > self.max_retry_s:
                return self._give_up(result, attempts, elapsed, f"gave up after {elapsed:.1f}s")
            if result.config_error:
                self._config_error(
                    "remote write of %d samples to %s failed (attempt %d): %s; the receiver's URL, "
                    "credentials or size limit is wrong, not the data: keeping the batch, retrying in %.2fs",
                    samples,
                    self.url,
                    attempts,
                    result.reason,
                    delay,
                )
            else:
                self._warn(
                    "remote write of %d samples to %s failed (attempt %d): %s; retrying in %.2fs",
                    samples,
                    self.url,
                    attempts,
                    result.reason,
                    delay,
                )
            self._sleep(delay)
            if self._stopping():
                return self._give_up(result, attempts, self._clock() - start, "stopping")

    def _stopping(self) -> bool:
        return self._stop_event is not None and self._stop_event.is_set()

    def _give_up(self, result: _Attempt, attempts: int, elapsed: float, why: str) -> WriteOutcome:
        reason = f"{result.reason} ({why}, {attempts} attempts)"
        log.warning("remote write to %s deferred: %s", self.url, reason)
        return WriteOutcome("retry_later", result.http_status, attempts, reason, elapsed)

    def _attempt(self, body: bytes) -> _Attempt:
        headers = self._headers
        try:
            if self._credentials is not None:
                authorization = self._credentials.header()
                if authorization is not None:
                    headers = {**headers, "Authorization": authorization}
            resp = self._session.post(
                self.url,
                data=body,
                headers=headers,
                timeout=(self.timeout_s, self.timeout_s),
                stream=True,  # read error bodies ourselves, bounded
                allow_redirects=False,  # a redirected POST silently becomes a GET
            )
        except CredentialsError as exc:
            # A credentials or TLS file that cannot be read: our configuration, like a 401.
            return _Attempt("retry_later", None, str(exc), config_error=True)
        except requests.exceptions.SSLError as exc:
            # A certificate the CA does not sign, a wrong server name, a client certificate refused:
            # the configuration (or the receiver's), not the data, and not passing.
            return _Attempt("retry_later", None, f"TLS: {_shorten(str(exc))}", config_error=True)
        except requests.Timeout as exc:
            return _Attempt("retry_later", None, f"timeout: {_shorten(str(exc))}")
        except _NETWORK_ERRORS as exc:
            # The message can quote whatever garbage the peer sent: keep it short.
            return _Attempt("retry_later", None, f"{type(exc).__name__}: {_shorten(str(exc))}")
        try:
            code = resp.status_code
            head = self._drain(resp, self.timeout_s)
            retry_after = resp.headers.get("Retry-After")
        finally:
            resp.close()
        reason = f"HTTP {code}: {_printable(head[:REASON_BODY_BYTES])}"
        if 200 <= code < 300:
            return _Attempt("written", code, "")
        if 500 <= code < 600 or code in RETRY_4XX:
            after = parse_retry_after(retry_after) if code in RETRY_AFTER_STATUSES else None
            return _Attempt("retry_later", code, reason, after)
        if 300 <= code < 500:
            if refuses_samples(code, head):
                return _Attempt("rejected", code, reason)
            # The same answer for every batch of every node (answers.py): rejecting would empty the
            # fleet's spools. Retried like a 5xx, counted, alerted; the edge keeps the data.
            return _Attempt("retry_later", code, reason, config_error=True)
        # 1xx as a final status or >= 600: not a remote-write receiver speaking HTTP properly (a
        # proxy or load balancer in a bad state); treat like a network error.
        return _Attempt("retry_later", code, f"unexpected {reason}")

    @staticmethod
    def _drain(resp: requests.Response, timeout_s: float) -> bytes:
        """Up to ``_MAX_DRAIN_BYTES`` of the body, read within ``timeout_s``.  Reading to EOF lets requests
        put the connection back in the pool; stopping early makes ``close()`` drop it instead.

        ``read1`` returns whatever has arrived, so a peer trickling a body a byte at a time (each read
        succeeding within the socket timeout) cannot hold the writer beyond the deadline.
        """
        buf = bytearray()
        deadline = time.monotonic() + timeout_s
        raw = resp.raw
        try:
            while len(buf) <= _MAX_DRAIN_BYTES and time.monotonic() < deadline:
                chunk = raw.read1(16 * 1024, decode_content=True)
                if not chunk:
                    break
                buf += chunk
        except _NETWORK_ERRORS:
            # A truncated or undecodable body does not change the status we already have.
            pass
        return bytes(buf)
