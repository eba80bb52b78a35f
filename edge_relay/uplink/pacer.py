"""The budget on the wire: the pacer keeps the broker connection within the allowed rate and burst.

``Pacer`` holds the token bucket (``TokenBucket``) and the meter of the connection's bytes
(``WireMeter``). ``Relay`` builds one, before the uplink and the controller, and hands it to both:

- **The uplink** (its own thread; the only caller of these methods) calls ``new_connection()`` before
  each connect, ``allows(payload_bytes, now)`` before each batch it would publish (False: the batch
  waits; the time batches wait is added up in ``paced_seconds``), ``charge_publish(payload_bytes)`` after
  each batch it did publish, and ``meter(sock)`` after every network-loop turn. ``waiting`` says a batch
  is waiting for the budget; ``fill_seconds`` (the bucket's depth over its rate) is how long its send
  queue lets fresh batches go ahead of one the pacer holds back.
- **The controller** (the relay's main thread) reads ``wire_total`` (bytes the connection carried, both
  directions, over the relay's life) and ``published_payload_bytes`` (batch payloads published, for the
  wire/payload overhead), and calls ``configure(rate, burst)`` once per cycle.

Accounting: a publication is charged at once with an estimate (its payload plus
``_PUBLISH_OVERHEAD_BYTES`` for the MQTT framing and the PUBACK), so the next batch of the same turn sees
it. After the loop turn that wrote it, ``meter`` reads what the kernel counted on the connection
(``TCP_INFO``: batches, framing, acks, status messages, retransmissions, TLS, both directions), charges
that and gives the estimate back. Without ``TCP_INFO`` byte counters the estimates are the count (sent
bytes only). Over any period T the connection carries at most ``burst + rate x T`` plus one batch.

Without a budget (never configured, or a rate of None) everything goes through, but the bytes are still
metered: ``wire_total`` and ``edge_relay_wire_bytes_total{direction}`` are there either way.

Threads: ``configure`` is one assignment, safe from any thread; the uplink thread applies it at its next
``meter`` (it does not wake the uplink: the relay kicks it after every cycle). ``wire_total`` takes the
meter's lock; ``published_payload_bytes`` and ``paced_seconds`` are numbers only the uplink thread writes.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge_relay.selfmetrics import RelayMetrics

log = logging.getLogger("edge_relay.budget.pacer")

# struct tcp_info (linux/tcp.h): tcpi_bytes_acked at 120, tcpi_bytes_received at 128 (Linux 4.1),
# tcpi_bytes_sent at 200 (Linux 4.19; counts retransmissions, which a metered link bills too).
_TCPI_BYTES_ACKED = 120
_TCPI_BYTES_RECEIVED = 128
_TCPI_BYTES_SENT = 200
_TCP_INFO_LEN = 256
# Application-level estimate of an MQTT PUBLISH's framing (fixed header, topic, packet id, properties)
# and its PUBACK, for kernels without TCP_INFO byte counters.
_PUBLISH_OVERHEAD_BYTES = 96


def tcp_bytes(sock: socket.socket | Any) -> tuple[int, int] | None:
    """(bytes sent, bytes received) of a TCP connection's payload per the kernel, or None."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except (OSError, AttributeError, ValueError):
        return None
    if len(info) >= _TCPI_BYTES_SENT + 8:
        sent = struct.unpack_from("<Q", info, _TCPI_BYTES_SENT)[0]
    elif len(info) >= _TCPI_BYTES_RECEIVED + 8:
        sent = max(0, struct.unpack_from("<Q", info, _TCPI_BYTES_ACKED)[0] - 1)  # the SYN counts as one
    else:
        return None
    return sent, struct.unpack_from("<Q", info, _TCPI_BYTES_RECEIVED)[0]


class WireMeter:
    """Bytes on the relay's broker connections, both directions, over the relay's life.

    Read from the kernel (TCP_INFO) every loop turn, so a connection that drops loses at most one
    turn's worth (50 ms) from the count; without TCP_INFO, published payloads plus a framing estimate.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = 0
        self.received = 0
        self._last: tuple[int, int] = (0, 0)
        self.kernel = True

    def new_connection(self) -> None:
        self._last = (0, 0)

    def sample(self, sock: Any) -> tuple[int, int] | None:
        """Add what the connection carried since the last sample; return the (sent, received) added,
        or None when the kernel has no counters for it."""
        now = tcp_bytes(sock)
        if now is None:
            return None
        d_sent, d_recv = max(0, now[0] - self._last[0]), max(0, now[1] - self._last[1])
        self._last = now
        with self._lock:
            self.sent += d_sent
            self.received += d_recv
        return d_sent, d_recv

    def estimate(self, sent: int, received: int) -> None:
        """Fallback accounting when the kernel gives no counters."""
        with self._lock:
            self.sent += sent
            self.received += received

    @property
    def total(self) -> int:
        with self._lock:
            return self.sent + self.received


class TokenBucket:
    """Paces publications to ``rate`` bytes/s with ``depth`` bytes of burst, charged with real wire bytes.

    A batch goes out when the bucket holds its size (or is full, so a batch larger than the depth still
    goes, once); the bytes the connection really carried are then taken out, so acks, status messages,
    retransmissions and TLS records all count against the budget. ``rate`` None means unlimited; a rate
    of 0 (a used-up daily quota) lets nothing through.
    """

    def __init__(
        self, rate: float | None = None, depth: float = 0.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self.rate = rate
        self.depth = float(depth)
        self.tokens = float(depth)
        self._at = clock()

    def configure(self, rate: float | None, depth: float) -> None:
        self._refill()
        was_unlimited = self.rate is None
        self.rate, self.depth = rate, float(depth)
        # A budget that starts (or returns) starts with a full bucket: the burst is there to be used.
        self.tokens = self.depth if was_unlimited else min(self.tokens, self.depth)

    def _refill(self) -> None:
        now = self._clock()
        if self.rate is not None:
            self.tokens = min(self.depth, self.tokens + (now - self._at) * self.rate)
        self._at = now

    def charge(self, nbytes: int) -> None:
        """Take ``nbytes`` out (negative: give back an over-estimate, never above the depth)."""
        if self.rate is not None and nbytes:
            self._refill()
            self.tokens = min(self.depth, self.tokens - nbytes)

    def allows(self, nbytes: int) -> bool:
        if self.rate is None:
            return True
        self._refill()
        return self.tokens > 0 and self.tokens >= min(nbytes, self.depth)

    @property
    def fill_seconds(self) -> float:
        """How long an empty bucket takes to fill (0 unlimited, infinite with a rate of 0)."""
        if self.rate is None:
            return 0.0
        return self.depth / self.rate if self.rate > 0 else float("inf")


class Pacer:
    """The token bucket and the wire meter of the broker connection, shared by uplink and controller
    (the contract is in the module docstring)."""

    def __init__(self, metrics: RelayMetrics, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.wire = WireMeter()
        self.bucket = TokenBucket(clock=clock)
        self._wire_sent = metrics.wire_bytes.labels("sent")
        self._wire_received = metrics.wire_bytes.labels("received")
        self._limits: tuple[float | None, float] = (None, 0.0)  # set by configure, applied by meter
        self._estimated = 0  # bytes charged by estimate, not yet matched by the kernel's count
        self._paced_since: float | None = None
        self.paced_seconds = 0.0  # time batches waited for the budget (for self-metrics)
        self.published_payload_bytes = 0

    # --- the controller's side (any thread) ------------------------------------------------------

    def configure(self, bytes_per_second: float | None, burst_bytes: float) -> None:
        """Pace to this rate (None: unlimited; 0: nothing) and burst; safe from any thread."""
        self._limits = (bytes_per_second, float(burst_bytes))

    @property
    def wire_total(self) -> int:
        """Bytes on the broker connections so far, both directions."""
        return self.wire.total

    # --- the uplink's side (the uplink thread only) ----------------------------------------------

    def new_connection(self) -> None:
        """A new connection is about to be made: its kernel counters start from zero."""
        self.wire.new_connection()

    @property
    def fill_seconds(self) -> float:
        """How long the empty bucket takes to fill: how long the send queue lets fresh rows go ahead of
        a row the pacer holds back (``SendQueue.next_rows``'s ``hold_s``)."""
        return self.bucket.fill_seconds

    @property
    def waiting(self) -> bool:
        """A batch is waiting for the budget."""
        return self._paced_since is not None

    def allows(self, payload_bytes: int, now: float) -> bool:
        """May a batch of ``payload_bytes`` be published now (``now``: monotonic seconds)? The time from
        the first refusal to the next yes is added to ``paced_seconds``."""
        if not self.bucket.allows(payload_bytes + _PUBLISH_OVERHEAD_BYTES):
            if self._paced_since is None:
                self._paced_since = now
            return False
        if self._paced_since is not None:
            self.paced_seconds += now - self._paced_since
            self._paced_since = None
        return True

    def charge_publish(self, payload_bytes: int) -> None:
        """A batch of ``payload_bytes`` was handed to the client: charged now with an estimate so the
        next batch sees it; ``meter`` replaces it with the real bytes."""
        self.published_payload_bytes += payload_bytes
        estimate = payload_bytes + _PUBLISH_OVERHEAD_BYTES
        self.bucket.charge(estimate)
        self._estimated += estimate

    def meter(self, sock: socket.socket | Any | None) -> None:
        """After a network-loop turn: apply a new configuration, then charge what the connection
        (``sock``, None when there is none) carried in the turn."""
        rate, depth = self._limits
        if (rate, depth) != (self.bucket.rate, self.bucket.depth):
            self.bucket.configure(rate, depth)
        estimated, self._estimated = self._estimated, 0
        counted = self.wire.sample(sock) if self.wire.kernel and sock is not None else (0, 0)
        if counted is None:
            log.warning("no TCP_INFO byte counters on this kernel: wire bytes are estimated")
            self.wire.kernel = False
        if not self.wire.kernel:
            self.wire.estimate(estimated, 0)
            self._wire_sent.inc(estimated)
            return
        # The client wrote this turn's publications during its loop, so the kernel's count now includes
        # them: the real bytes replace the estimate charged at publish time (a partial write is refunded
        # now and charged when the rest goes out).
        sent, received = counted or (0, 0)
        if sent or received or estimated:
            self.bucket.charge(sent + received - estimated)
            self._wire_sent.inc(sent)
            self._wire_received.inc(received)
