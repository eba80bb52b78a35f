"""What the uplink sends next, given what is in flight: the one place that knows ``mqtt.order``.

The uplink sees the spool only through ``SendQueue``: ``next_rows`` (ordering policy), ``sent``,
``acked``, ``refused`` (ack ``rejected``: deleted *and* recorded in the loss ledger) and ``set_aside``.
``InFlight`` is the set of batches published and not yet acknowledged; the
uplink thread writes it, and retention reads its snapshot (``seqs``) from the scrape loop so that it never
degrades or evicts a batch whose ack may be on its way. Both are built before the uplink and retention,
and handed to each: no part reaches into another that does not exist yet.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from edge_relay.ledger import LossReason, LossRecord
from edge_relay.store.spool.batches import BatchTable, Order
from edge_relay.store.spool.schema import SpoolRow


class InFlight:
    """Seqs published and not yet acked, with the (monotonic) time of their last publication."""

    def __init__(self) -> None:
        self._sent_at: dict[int, float] = {}
        self._snapshot: frozenset[int] = frozenset()
        self._lock = threading.Lock()

    def _changed(self) -> None:
        self._snapshot = frozenset(self._sent_at)

    def add(self, seq: int, at: float) -> None:
        with self._lock:
            self._sent_at[seq] = at
            self._changed()

    def pop(self, seq: int) -> float | None:
        """Forget ``seq``; returns when it was published, or None if it was not in flight."""
        with self._lock:
            at = self._sent_at.pop(seq, None)
            if at is not None:
                self._changed()
            return at

    def discard(self, seqs: Iterable[int]) -> None:
        with self._lock:
            for seq in seqs:
                self._sent_at.pop(seq, None)
            self._changed()

    def clear(self) -> None:
        with self._lock:
            self._sent_at.clear()
            self._changed()

    def expire(self, timeout_s: float, now: float) -> list[int]:
        """Forget (and return) the seqs published more than ``timeout_s`` ago: they go out again."""
        with self._lock:
            old = [s for s, t in self._sent_at.items() if now - t > timeout_s]
            for seq in old:
                del self._sent_at[seq]
            if old:
                self._changed()
            return old

    def hasten(self, timeout_s: float, now: float, within_s: float) -> None:
        """Make every seq in flight expire ``within_s`` from ``now`` at the latest (``timeout_s`` being
        the expiry ``expire`` is called with)."""
        latest = now + within_s - timeout_s
        with self._lock:
            for seq, t in self._sent_at.items():
                self._sent_at[seq] = min(t, latest)

    @property
    def seqs(self) -> frozenset[int]:
        """A snapshot, safe to read from any thread."""
        return self._snapshot

    def __len__(self) -> int:
        return len(self._snapshot)

    def __bool__(self) -> bool:
        return bool(self._snapshot)


class SendQueue:
    """The spool as the uplink sees it.

    ``order="strict"``: one batch at a time, oldest data first, so even a receiver without an
    out-of-order window sees every series in time order (at the price of one round trip per batch).
    ``order="live_first"``: the newest batches (two at most), when they are fresh (created within two
    intervals and never sent), go first, oldest of them first, so dashboards are current as soon as the
    link is back; the backlog drains oldest data first in the rest of the window (a live batch that
    finds the window full goes first once an ack frees a slot).

    Under a budget the uplink asks the pacer before each row, in this order, and reports a refusal with
    ``held``. The rule that keeps every row moving (docs/stream-codec.md, "Budget lanes"):

    - a refused *fresh* row is skipped: the next row may still fit (a big window just packed must not
      hold back the small live batch of the same cycle, which would miss its freshness and land in the
      backlog behind older-data windows);
    - a refused *backlog* row stops the pump: nothing behind it in data order overtakes it;
    - the backlog's head (the oldest-data row not in flight) that the pacer has held back for longer than
      ``hold_s`` (the bucket's fill time, at least two intervals) goes first: fresh rows no longer go
      ahead of it until it is published, so the bucket fills for it (a row larger than the bucket goes
      when the bucket is full). Fresh rows taking the tokens first every cycle can thus delay the head
      by about ``hold_s`` plus one fill time, never forever; and as only finitely many rows are older
      than any given row, every row is published in the end while the bucket refills.
    """

    def __init__(
        self,
        batches: BatchTable,
        *,
        order: str,
        inflight_limit: int,
        live_window_s: float,
        clock_s: Callable[[], float] = time.time,
    ) -> None:
        if order not in ("strict", "live_first"):
            raise ValueError(f"order must be 'strict' or 'live_first', not {order!r}")
        self._batches = batches
        self.order = order
        self.inflight_limit = inflight_limit
        self.live_window_s = live_window_s
        self._clock_s = clock_s
        self._fresh: frozenset[int] = frozenset()  # the fresh rows of the last answer (skipped if held)
        self._head: int | None = None  # the backlog's head of the last answer
        self._head_held_at: float | None = None  # when the pacer first held it back (clock_s)

    def next_rows(self, inflight: InFlight, *, hold_s: float = 0.0) -> list[SpoolRow]:
        """The rows to publish now, in the order to publish them. ``hold_s``: how long the pacer may
        hold back the backlog's head while fresh rows go first (at least two intervals)."""
        busy = inflight.seqs
        self._fresh = frozenset()
        if self.order == "strict":
            return [] if busy else self._batches.pending(1, order=Order.OLDEST_DATA)
        room = self.inflight_limit - len(busy)
        if room <= 0:
            return []
        now = self._clock_s()
        fresh_after_ms = int(now * 1000) - int(2 * self.live_window_s * 1000)
        live = [
            r
            for r in self._batches.pending(min(room, 2), exclude=busy, order=Order.NEWEST)
            if r.attempts == 0 and r.created_ms >= fresh_after_ms
        ]
        live.reverse()  # the older of the two first: a cycle's batches go in the order they were made
        taken = busy.union(r.seq for r in live)
        # The backlog's head is looked up even when the fresh rows fill the room: it may be due.
        backlog = self._batches.pending(max(room - len(live), 1), exclude=taken, order=Order.OLDEST_DATA)
        head = backlog[0].seq if backlog else None
        if head != self._head:
            self._head, self._head_held_at = head, None
        held_at = self._head_held_at
        if held_at is not None and now - held_at >= max(hold_s, 2 * self.live_window_s):
            return (backlog + live)[:room]  # the head is due: nothing goes ahead of it
        self._fresh = frozenset(r.seq for r in live)
        return (live + backlog)[:room]

    def held(self, row: SpoolRow) -> bool:
        """The pacer held ``row`` (from the last ``next_rows``) back. True: go on with the next row (a
        fresh row, skipped); False: stop here (nothing overtakes a backlog row)."""
        if row.seq in self._fresh:
            return True
        if row.seq == self._head and self._head_held_at is None:
            self._head_held_at = self._clock_s()
        return False

    @property
    def incarnation(self) -> int:
        return self._batches.incarnation

    def applies(self, incarnation: int) -> bool:
        """Whether an ack for spool ``incarnation`` may act on this spool: acks of another incarnation
        (queued at the broker for a spool that was since recreated, whose seqs start at 1 again) must
        never delete anything. 0 on either side (an ingester or a row that predates incarnations, or
        a salvaged spool whose identity was unreadable) means unknown, and the ack applies."""
        own = self._batches.incarnation
        return not incarnation or not own or incarnation == own

    def sent(self, seqs: Iterable[int], now_ms: int) -> None:
        self._batches.mark_sent(seqs, now_ms)

    def acked(self, seqs: Iterable[int]) -> int:
        """The cloud has written the batches: delete them."""
        return self._batches.ack(seqs)

    def refused(
        self,
        seq: int,
        describe: Callable[[SpoolRow], str],
        reason: LossReason = LossReason.REJECTED_BY_CLOUD,
        samples: int | None = None,
    ) -> LossRecord | None:
        """The cloud refused the batch for good (ack ``rejected``), or ``samples`` of it (ack ``partial``:
        it wrote the others): delete its row and record the refused samples in the loss ledger, in one
        transaction, so a refusal is never a silent deletion. ``describe`` names the row's series
        (``{job=...}``). None for a seq no longer in the spool."""
        return self._batches.refuse(seq, reason, describe, samples)

    def set_aside(self, seq: int, reason: str, ledger_reason: LossReason) -> None:
        """A batch that can never be sent (e.g. above the broker's packet size) leaves the queue."""
        self._batches.quarantine(seq, reason, ledger_reason=ledger_reason)

    def empty(self) -> bool:
        return self._batches.count() == 0
