"""The fleet view: what this ingester knows about every edge node, and one verdict per node.

Sources, per ``(cluster, node)``:

- the node's retained **status** (``<prefix>/v1/<cluster>/<node>/status``): ``online`` with its spool
  depth (``spool_rows``, ``spool_bytes``, ``spool_samples``, ``oldest_unsent_ms``), its loss ledger
  totals (``lost_samples``, ``lost_<reason>``), ``inflight``, ``quarantined_rows`` and, where the relay
  sends them, its budget state (``budget_state``, ``budget_bytes_per_s``, ``wire_bytes_per_s``,
  ``degrade_level``); ``offline`` as the last will or on a clean stop. The will carries no numbers, so a
  field a status does not carry keeps the value of the last status that did ("offline, and this is
  what it last said it held");
- the **outcomes** of the node's batches in this process: written (samples, batches, newest sample
  timestamp, highest seq), dead-lettered (refused as invalid, or rejected by the receiver);
- the **acks** every replica publishes (``<prefix>/v1/<cluster>/<node>/ack``, when the intake
  subscribes to them): which seqs were finished by *any* replica, and which of them were rejected.

When a node was last *heard*: the latest of the times this process received a live status, a batch or
an ack for it. A retained status delivered on subscribing is not news: it counts as heard at the
node's own ``ts_ms`` (capped at now). Note that the relay stamps its last will when it connects, so
an ``offline`` will says when the lost connection was made, not when it broke.

Verdicts (``Fleet.snapshot`` computes them at the time asked, so silence ages into a verdict):

- ``losing_data``: within the last ``loss_hold`` seconds (1 h) the node's ``lost_samples`` grew between
  two statuses seen here, or one of its batches was dead-lettered (here, or by another replica, as
  seen in a rejected ack). The first status seen from a node is a baseline, not growth: ledger totals
  are cumulative for the life of the spool file, and an ingester restart must not call every node that
  once lost something "losing data" again. A total that goes *down* (a new spool file) is a new
  baseline.
- ``ok``: not losing data, the last status says ``online`` (or there is no status but batches come), and
  the node was heard within ``silent_after`` seconds (180 s; the relay sends a status every 30 s).
- ``offline_buffering``: not losing data, offline (last will) or silent (behind a mosquitto bridge whose
  link died, the cloud keeps the node's last retained ``online``), and the last status that carried
  spool numbers reported a backlog (``spool_rows`` or ``spool_bytes`` > 0): the data waits on the node.
- ``offline_unknown``: offline or silent without a reported backlog: the relay may be stopped (then
  nothing is being collected) or the link broke right after a drained spool; this process cannot tell.

Seq gaps. Seqs are per node and strictly increasing on the edge, but the cloud sees them out of order
(live-first after an outage, re-publishes after an ack timeout, redeliveries) and some never: a row the
edge re-downsampled is replaced by a new row with a new seq, an evicted row is never sent, and with a
shared subscription every replica gets only a part of each node's batches. So the estimate is: seqs
below the highest seq seen that were not seen (written or dead-lettered here, or acked by any replica)
for more than ``gap_grace`` seconds (120 s), minus the node's last reported ``spool_rows`` (any missing
seq may still be waiting there), floored at 0. That is a lower bound of the batches that left the node's
spool without reaching the receiver: the ones the node dropped on purpose (which its loss ledger also
counts, so a gap alone is no verdict) plus any that vanished on the way (which would be a bug). It is
only defined when this process sees every seq of a node (``complete_view``): when it receives every
batch itself (no share group) or sees every replica's acks. A replica that reconnects to the broker may
have missed acks meanwhile, so the intake calls ``reset_seq_tracking`` then and counting starts again.

Memory is bounded: the missing seqs of a node are kept as at most ``MAX_GAP_RANGES`` ranges (the lowest
are dropped first: the estimate can only undercount), ranges older than ``GAP_HORIZON_SECONDS`` (24 h)
are dropped, a forward jump of more than ``GAP_RESET_JUMP`` seqs (the relay continues from
``unix_ms * 1000`` after a corrupt spool file) restarts the node's tracking instead of counting billions
of gaps, at most ``MAX_LOST_REASONS`` loss reasons are kept per node, and nodes not heard from for
``FORGET_AFTER_SECONDS`` (7 days; a constant, not a config key) are forgotten, at most ``MAX_NODES`` are
kept (the least recently heard go first). Forgotten nodes disappear from the exported metrics.

All methods are thread-safe (one lock; nothing blocks while holding it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

Verdict = Literal["ok", "offline_buffering", "losing_data", "offline_unknown"]
VERDICTS: Final[tuple[Verdict, ...]] = ("ok", "offline_buffering", "losing_data", "offline_unknown")
NodeKey = tuple[str, str]

FORGET_AFTER_SECONDS: Final = 7 * 24 * 3600.0
SILENT_AFTER_SECONDS: Final = 180.0
LOSS_HOLD_SECONDS: Final = 3600.0
GAP_GRACE_SECONDS: Final = 120.0
GAP_HORIZON_SECONDS: Final = 24 * 3600.0
GAP_RESET_JUMP: Final = 1 << 22
MAX_GAP_RANGES: Final = 256
MAX_LOST_REASONS: Final = 32
MAX_NODES: Final = 100_000
PRUNE_EVERY_SECONDS: Final = 60.0

# Numeric status fields kept per node (null = "none"/"unknown" is kept as None).
STATUS_NUMBERS: Final = (
    "spool_rows",
    "spool_bytes",
    "spool_samples",
    "oldest_unsent_ms",
    "quarantined_rows",
    "inflight",
    "budget_bytes_per_s",
    "wire_bytes_per_s",
    "degrade_level",
    "anomaly_events",
    "anomaly_windows",
    "anomaly_last_ms",
)
_LOST_PREFIX: Final = "lost_"
_LOST_TOTAL: Final = "lost_samples"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


@dataclass(slots=True)
class _Range:
    lo: int
    hi: int
    since: float  # when these seqs were first known to be missing


# Spool incarnations of a node whose seqs are no longer tracked (its spool was recreated since).
_PAST_INCARNATIONS = 4


class SeqTracker:
    """Seqs of one node not seen below the highest seen, as ranges; bounded. Not thread-safe.

    Seqs count per spool file: a recreated spool (a new incarnation) starts again at 1, so seqs of one
    incarnation are compared only with each other. The first seq of a new incarnation restarts the
    tracking (the old spool is gone: its missing seqs can no longer arrive from it); late seqs of the
    few incarnations before it are ignored. Incarnation 0 (a relay that sends none) is one like any.
    """

    __slots__ = ("high", "incarnation", "missing", "past")

    def __init__(self) -> None:
        self.high: int | None = None
        self.missing: list[_Range] = []
        self.incarnation: int | None = None
        self.past: list[int] = []

    def see(self, first: int, last: int, now: float, incarnation: int = 0) -> None:
        """Seqs ``first..last`` (inclusive) of spool ``incarnation`` were seen at ``now``."""
        if first > last:
            first, last = last, first
        if incarnation != self.incarnation:
            if incarnation in self.past:
                return
            if self.incarnation is not None:
                self.past = [*self.past, self.incarnation][-_PAST_INCARNATIONS:]
            self.incarnation = incarnation
            self.high = None
        high = self.high
        if high is None or first > high + GAP_RESET_JUMP:
            self.high = last
            self.missing.clear()
            return
        if last < high - GAP_RESET_JUMP:
            return  # from before a seq jump (salvaged rows of a corrupt spool): not ours to count
        if first > high + 1:
            self.missing.append(_Range(high + 1, first - 1, now))
        elif first <= high:
            self._remove(first, min(last, high))
        self.high = max(high, last)
        if len(self.missing) > MAX_GAP_RANGES:
            del self.missing[: len(self.missing) - MAX_GAP_RANGES]

    def _remove(self, a: int, b: int) -> None:
        if not self.missing or self.missing[-1].hi < a or self.missing[0].lo > b:
            return
        kept: list[_Range] = []
        for r in self.missing:
            if r.hi < a or r.lo > b:
                kept.append(r)
                continue
            if r.lo < a:
                kept.append(_Range(r.lo, a - 1, r.since))
            if r.hi > b:
                kept.append(_Range(b + 1, r.hi, r.since))
        self.missing = kept

    def expire(self, before: float) -> None:
        if self.missing and self.missing[0].since < before:
            self.missing = [r for r in self.missing if r.since >= before]

    def pending(self, missing_before: float) -> int:
        """Seqs missing since before ``missing_before``."""
        return sum(r.hi - r.lo + 1 for r in self.missing if r.since <= missing_before)

    def reset(self) -> None:
        self.high = None
        self.missing.clear()
        self.incarnation = None


@dataclass(slots=True)
class _Node:
    cluster: str
    node: str
    state: str | None = None
    status_ts: float | None = None
    status_heard: float | None = None
    numbers: dict[str, float | None] = field(default_factory=dict)
    numbers_ts: float | None = None
    budget_state: str | None = None
    anomaly_last: str | None = None
    lost_samples: float | None = None
    lost_reasons: dict[str, float] = field(default_factory=dict)
    loss_grew_at: float | None = None
    last_batch_ts: float | None = None
    last_batch_received: float | None = None
    highest_written: int | None = None
    samples_written: int = 0
    batches_written: int = 0
    dead_letters: int = 0
    refused: int = 0
    last_dead_letter_at: float | None = None
    last_ack_seen: float | None = None
    seqs: SeqTracker = field(default_factory=SeqTracker)

    def heard(self) -> float:
        times = (self.status_heard, self.last_batch_received, self.last_ack_seen, self.last_dead_letter_at)
        return max((t for t in times if t is not None), default=0.0)


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node as of ``Fleet.snapshot``; times are Unix seconds, None = never / not reported."""

    cluster: str
    node: str
    verdict: Verdict
    state: str | None  # last status: "online" / "offline"
    silent: bool  # not heard from for silent_after seconds
    last_heard: float
    status_ts: float | None  # ts_ms of the last status / 1000 (the node's clock)
    status_heard: float | None
    numbers_ts: float | None  # ts of the last status that carried spool numbers
    spool_rows: float | None
    spool_bytes: float | None
    spool_samples: float | None
    oldest_unsent: float | None  # Unix seconds of the oldest unsent sample; None = none or unknown
    quarantined_rows: float | None
    inflight: float | None
    budget_state: str | None
    budget_bytes_per_s: float | None
    wire_bytes_per_s: float | None
    degrade_level: float | None
    lost_samples: float | None
    lost_reasons: dict[str, float]
    loss_grew_at: float | None
    last_batch_ts: float | None  # newest sample written
    last_batch_received: float | None
    highest_written: int | None
    samples_written: int
    batches_written: int
    dead_letters: int
    refused: int
    last_dead_letter_at: float | None
    seq_gaps: int | None  # None when this process does not see every seq
    # Anomaly detection (edge_relay.anomaly.detector), as reported; None: the node runs none (or is older).
    anomaly_events: float | None = None  # events (window onsets) since the relay started
    anomaly_windows: float | None = None  # anomaly windows open now
    anomaly_last_event: float | None = None  # Unix seconds of the last event
    anomaly_last: str | None = None  # e.g. "gpu=dcgm:1 kind=thermal rule=temp_slope at_ms=..."


def verdict_of(
    *,
    now: float,
    state: str | None,
    last_heard: float,
    backlog: bool,
    loss_grew_at: float | None,
    last_dead_letter_at: float | None,
    silent_after: float,
    loss_hold: float,
) -> tuple[Verdict, bool]:
    """(verdict, silent) from the facts; see the module docstring."""
    silent = now - last_heard > silent_after
    losing = any(t is not None and now - t <= loss_hold for t in (loss_grew_at, last_dead_letter_at))
    if losing:
        return "losing_data", silent
    if state in ("online", None) and not silent:
        return "ok", silent
    return ("offline_buffering" if backlog else "offline_unknown"), silent


ForgetCallback = Callable[[list[NodeKey]], None]


class Fleet:
    def __init__(
        self,
        *,
        forget_after: float = FORGET_AFTER_SECONDS,
        silent_after: float = SILENT_AFTER_SECONDS,
        loss_hold: float = LOSS_HOLD_SECONDS,
        gap_grace: float = GAP_GRACE_SECONDS,
        max_nodes: int = MAX_NODES,
        complete_view: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.forget_after = forget_after
        self.silent_after = silent_after
        self.loss_hold = loss_hold
        self.gap_grace = gap_grace
        self.max_nodes = max_nodes
        self.clock = clock
        self._complete_view = complete_view
        self._lock = threading.Lock()
        self._nodes: dict[NodeKey, _Node] = {}
        self._on_forget: list[ForgetCallback] = []
        self._last_prune = 0.0

    # --- configuration ----------------------------------------------------------------------

    @property
    def complete_view(self) -> bool:
        """True when this process sees every seq of every node (so seq gaps are defined)."""
        return self._complete_view

    def set_complete_view(self, complete: bool) -> None:
        with self._lock:
            self._complete_view = complete

    def on_forget(self, callback: ForgetCallback) -> None:
        """``callback(keys)`` after nodes were forgotten (called without the lock held)."""
        with self._lock:
            self._on_forget.append(callback)

    # --- observations -----------------------------------------------------------------------

    def observe_status(
        self, cluster: str, node: str, status: Mapping[str, Any], *, retained: bool = False
    ) -> None:
        """A decoded status message (``schemas.codec.decode_status``) from the node's status topic.

        ``retained``: delivered because this process subscribed (old news), not published just now.
        """
        now = self.clock()
        ts_ms = _number(status.get("ts_ms"))
        ts = None if ts_ms is None else ts_ms / 1000
        heard = min(now, ts) if retained and ts is not None else now
        forgotten: list[NodeKey] = []
        with self._lock:
            if now - heard > self.forget_after:
                return  # a retained status of a node long gone: stay forgotten
            n = self._get(cluster, node, forgotten)
            state = status.get("state")
            n.state = state if isinstance(state, str) else None
            n.status_ts = ts
            n.status_heard = max(heard, n.status_heard or 0.0)
            carried = False
            for key in STATUS_NUMBERS:
                if key in status:
                    n.numbers[key] = _number(status[key])
                    carried = True
            if carried:
                n.numbers_ts = ts
            budget_state = status.get("budget_state")
            if isinstance(budget_state, str):
                n.budget_state = budget_state
            anomaly_last = status.get("anomaly_last")
            if isinstance(anomaly_last, str):
                n.anomaly_last = anomaly_last
            self._observe_losses(n, status, now)
        self._forgotten(forgotten)

    def _observe_losses(self, n: _Node, status: Mapping[str, Any], now: float) -> None:
        total = _number(status.get(_LOST_TOTAL))
        if total is None:
            return  # e.g. the last will: the last reported totals stand
        reasons = {
            key[len(_LOST_PREFIX) :]: value
            for key, raw in status.items()
            if key.startswith(_LOST_PREFIX) and key != _LOST_TOTAL and (value := _number(raw)) is not None
        }
        n.lost_reasons = dict(sorted(reasons.items())[:MAX_LOST_REASONS])
        if n.lost_samples is not None and total > n.lost_samples:
            n.loss_grew_at = now
        n.lost_samples = total

    def observe_written(
        self, cluster: str, node: str, *, seq: int, samples: int, newest_ms: int, incarnation: int = 0
    ) -> None:
        """A batch was accepted by the remote-write receiver."""
        now = self.clock()
        forgotten: list[NodeKey] = []
        with self._lock:
            n = self._get(cluster, node, forgotten)
            n.samples_written += samples
            n.batches_written += 1
            n.last_batch_received = now
            if newest_ms > 0:
                n.last_batch_ts = max(n.last_batch_ts or 0.0, newest_ms / 1000)
            n.highest_written = seq if n.highest_written is None else max(n.highest_written, seq)
            n.seqs.see(seq, seq, now, incarnation)
        self._forgotten(forgotten)

    def observe_dead_letter(
        self, cluster: str, node: str, *, seq: int | None, refused: bool, incarnation: int = 0
    ) -> None:
        """A batch of the node went to the dead-letter store (``refused``: invalid, else receiver 4xx)."""
        now = self.clock()
        forgotten: list[NodeKey] = []
        with self._lock:
            n = self._get(cluster, node, forgotten)
            n.dead_letters += 1
            n.refused += 1 if refused else 0
            n.last_dead_letter_at = now
            if seq is not None:
                n.seqs.see(seq, seq, now, incarnation)
        self._forgotten(forgotten)

    def observe_acks(
        self,
        cluster: str,
        node: str,
        *,
        ok: Iterable[int],
        rejected: Iterable[int],
        incarnation: int = 0,
    ) -> None:
        """An application ack seen on the broker (from any replica, this one included)."""
        now = self.clock()
        ok_seqs, rejected_seqs = set(ok), set(rejected)
        if not ok_seqs and not rejected_seqs:
            return
        forgotten: list[NodeKey] = []
        with self._lock:
            n = self._get(cluster, node, forgotten)
            n.last_ack_seen = now
            if rejected_seqs:
                n.last_dead_letter_at = now
            for first, last in _runs(sorted(ok_seqs | rejected_seqs)):
                n.seqs.see(first, last, now, incarnation)
        self._forgotten(forgotten)

    def reset_seq_tracking(self) -> None:
        """Forget which seqs were seen (e.g. after a reconnect, when acks may have been missed)."""
        with self._lock:
            for n in self._nodes.values():
                n.seqs.reset()

    # --- views ------------------------------------------------------------------------------

    def snapshot(self) -> list[NodeView]:
        """Every node (after forgetting stale ones), sorted by (cluster, node)."""
        now = self.clock()
        forgotten: list[NodeKey] = []
        with self._lock:
            self._prune(now, forgotten)
            views = [self._view(n, now) for _, n in sorted(self._nodes.items())]
        self._forgotten(forgotten)
        return views

    def get(self, cluster: str, node: str) -> NodeView | None:
        now = self.clock()
        with self._lock:
            n = self._nodes.get((cluster, node))
            return None if n is None else self._view(n, now)

    def forget_stale(self) -> list[NodeKey]:
        """Forget nodes not heard from for ``forget_after`` seconds; returns their keys."""
        forgotten: list[NodeKey] = []
        with self._lock:
            self._prune(self.clock(), forgotten)
        self._forgotten(forgotten)
        return forgotten

    def node_keys(self) -> list[NodeKey]:
        with self._lock:
            return list(self._nodes)

    def __len__(self) -> int:
        with self._lock:
            return len(self._nodes)

    # --- internals (lock held) ----------------------------------------------------------------

    def _get(self, cluster: str, node: str, forgotten: list[NodeKey]) -> _Node:
        key = (cluster, node)
        n = self._nodes.get(key)
        if n is not None:
            return n
        now = self.clock()
        if now - self._last_prune > PRUNE_EVERY_SECONDS:
            self._prune(now, forgotten)
        while len(self._nodes) >= self.max_nodes:
            oldest = min(self._nodes, key=lambda k: self._nodes[k].heard())
            del self._nodes[oldest]
            forgotten.append(oldest)
        n = self._nodes[key] = _Node(cluster, node)
        return n

    def _prune(self, now: float, forgotten: list[NodeKey]) -> None:
        self._last_prune = now
        horizon = now - self.forget_after
        for key in [k for k, n in self._nodes.items() if n.heard() < horizon]:
            del self._nodes[key]
            forgotten.append(key)
        gap_horizon = now - GAP_HORIZON_SECONDS
        for n in self._nodes.values():
            n.seqs.expire(gap_horizon)

    def _view(self, n: _Node, now: float) -> NodeView:
        num = n.numbers
        rows, nbytes = num.get("spool_rows"), num.get("spool_bytes")
        last_heard = n.heard()
        verdict, silent = verdict_of(
            now=now,
            state=n.state,
            last_heard=last_heard,
            backlog=bool(rows) or bool(nbytes),
            loss_grew_at=n.loss_grew_at,
            last_dead_letter_at=n.last_dead_letter_at,
            silent_after=self.silent_after,
            loss_hold=self.loss_hold,
        )
        gaps: int | None = None
        if self._complete_view:
            n.seqs.expire(now - GAP_HORIZON_SECONDS)
            gaps = max(0, n.seqs.pending(now - self.gap_grace) - int(rows or 0))
        oldest_ms = num.get("oldest_unsent_ms")
        last_anomaly_ms = num.get("anomaly_last_ms")
        return NodeView(
            cluster=n.cluster,
            node=n.node,
            verdict=verdict,
            state=n.state,
            silent=silent,
            last_heard=last_heard,
            status_ts=n.status_ts,
            status_heard=n.status_heard,
            numbers_ts=n.numbers_ts,
            spool_rows=rows,
            spool_bytes=nbytes,
            spool_samples=num.get("spool_samples"),
            oldest_unsent=None if oldest_ms is None else oldest_ms / 1000,
            quarantined_rows=num.get("quarantined_rows"),
            inflight=num.get("inflight"),
            budget_state=n.budget_state,
            budget_bytes_per_s=num.get("budget_bytes_per_s"),
            wire_bytes_per_s=num.get("wire_bytes_per_s"),
            degrade_level=num.get("degrade_level"),
            lost_samples=n.lost_samples,
            lost_reasons=dict(n.lost_reasons),
            loss_grew_at=n.loss_grew_at,
            last_batch_ts=n.last_batch_ts,
            last_batch_received=n.last_batch_received,
            highest_written=n.highest_written,
            samples_written=n.samples_written,
            batches_written=n.batches_written,
            dead_letters=n.dead_letters,
            refused=n.refused,
            last_dead_letter_at=n.last_dead_letter_at,
            seq_gaps=gaps,
            anomaly_events=num.get("anomaly_events"),
            anomaly_windows=num.get("anomaly_windows"),
            anomaly_last_event=None if last_anomaly_ms is None else last_anomaly_ms / 1000,
            anomaly_last=n.anomaly_last,
        )

    def _forgotten(self, keys: list[NodeKey]) -> None:
        if not keys:
            return
        with self._lock:
            callbacks = list(self._on_forget)
        for callback in callbacks:
            callback(keys)


def _runs(seqs: list[int]) -> Iterable[tuple[int, int]]:
    """Sorted distinct seqs as (first, last) runs of consecutive values."""
    start = prev = None
    for s in seqs:
        if prev is not None and s == prev + 1:
            prev = s
            continue
        if start is not None and prev is not None:
            yield start, prev
        start = prev = s
    if start is not None and prev is not None:
        yield start, prev
