"""Budget lanes on the uplink: live batches every cycle and big windowed batches share one token bucket
and one send queue, and no row is starved (``SendQueue`` with ``Uplink._pump``; docs/stream-codec.md,
"Budget lanes").

No broker: the uplink's real ``_pump`` publishes to a fake client, the spool, the send queue and the
pacer run on one fake clock, and every published row is acked at once. Each cycle spools its batches,
then pumps (the relay kicks the uplink after a cycle), then pumps again when the acks come (an ack wakes
the uplink); so a pump always finds the bucket as the cycle's live batch left it, as on a real relay.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import paho.mqtt.client as mqtt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_relay.selfmetrics import RelayMetrics
from edge_relay.store.spool import InFlight, SendQueue, Spool
from edge_relay.uplink.mqtt import Uplink
from edge_relay.uplink.pacer import Pacer
from testkit.uplinks import mqtt_settings

T0 = 1_800_000_000.0
OVERHEAD = 96  # the pacer's estimate of one publication's framing


class PublishInfo(NamedTuple):
    rc: int
    mid: int


class FakeClient:
    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def publish(self, topic: str, payload: bytes, qos: int = 0) -> PublishInfo:
        self.payloads.append(payload)
        return PublishInfo(mqtt.MQTT_ERR_SUCCESS, len(self.payloads))


class NoStatus:
    def fields(self) -> dict[str, Any]:
        return {}


class Lanes:
    """One node's uplink under a budget, on a fake clock."""

    def __init__(self, workdir: Path, *, rate: float, depth: float, interval: float = 1.0) -> None:
        self.now = T0
        self.interval = interval
        self.spool = Spool(workdir / "spool.db", synchronous="OFF", clock_ms=lambda: int(self.now * 1000))
        self.queue = SendQueue(
            self.spool.batches,
            order="live_first",
            inflight_limit=16,
            live_window_s=interval,
            clock_s=lambda: self.now,
        )
        self.pacer = Pacer(RelayMetrics(), clock=lambda: self.now)
        self.pacer.bucket.configure(rate, depth)  # what the pacer's meter applies from configure()
        cfg = mqtt_settings(
            1883,
            client_id="lanes",
            inflight_batches=16,
            ack_timeout_seconds=3600.0,
            reconnect_max_seconds=1.0,
        )
        self.uplink = Uplink(
            cfg,
            cluster="c",
            node="n",
            queue=self.queue,
            inflight=InFlight(),
            metrics=RelayMetrics(),
            status=NoStatus(),
            pacer=self.pacer,
        )
        self.client = FakeClient()
        self.spooled_at: dict[int, float] = {}
        self.published_at: dict[int, float] = {}
        self.lane: dict[int, str] = {}

    def close(self) -> None:
        self.spool.close()

    def spool_row(self, size: int, lane: str, first_ts_s: float) -> int:
        ts = int(first_ts_s * 1000)
        seq = self.spool.batches.append(
            lambda _seq: b"x" * size, first_ts_ms=ts, last_ts_ms=int(self.now * 1000), sample_count=1
        )
        self.spooled_at[seq] = self.now
        self.lane[seq] = lane
        return seq

    def pump(self) -> None:
        before = len(self.client.payloads)
        inflight = self.uplink.inflight
        published = set(inflight.seqs)
        self.uplink._pump(self.client)  # type: ignore[arg-type]
        new = inflight.seqs - published
        assert len(self.client.payloads) - before == len(new)
        for seq in new:
            self.published_at[seq] = self.now
        # The cloud acks at once.
        inflight.discard(new)
        self.queue.acked(new)

    def cycle(self, rows: Sequence[tuple[int, str, float]] = ()) -> None:
        """Advance one interval, spool ``rows`` (size, lane, first_ts), pump, pump again on the acks."""
        self.now += self.interval
        for size, lane, first_ts in rows:
            self.spool_row(size, lane, first_ts)
        self.pump()
        self.pump()

    def waits(self) -> dict[int, float]:
        """How long each row waited in the spool (unpublished rows: until now)."""
        return {s: self.published_at.get(s, self.now) - t for s, t in self.spooled_at.items()}


def run_lanes(workdir: Path, check: Callable[[Lanes], None], **kw: Any) -> None:
    lanes = Lanes(workdir, **kw)
    try:
        check(lanes)
    finally:
        lanes.close()


def test_a_backlog_row_larger_than_the_bucket_is_not_starved_by_the_live_lane(tmp_path: Path) -> None:
    """A window left from before a restart, larger than the bucket, goes when the bucket is full. The live
    lane (400 B a cycle against a 1000 B/s rate) takes tokens first every cycle, so the bucket is never
    full when the window's turn comes, unless the window, after a fill time of waiting, goes first."""
    rate, depth = 1000.0, 10_000.0

    def check(lanes: Lanes) -> None:
        lanes.now -= 600
        big = lanes.spool_row(12_000, "window", lanes.now)  # older than two intervals: backlog
        lanes.now += 600
        lanes.spooled_at[big] = lanes.now  # the relay restarts: the row waits from now
        for _ in range(120):
            lanes.cycle([(400 - OVERHEAD, "live", lanes.now + lanes.interval)])
        waits = lanes.waits()
        # Held back at most the fill time (10 s) with the live lane ahead, then the fill time again.
        assert big in lanes.published_at, "the big window was never published"
        assert waits[big] <= 2 * depth / rate + 2 * lanes.interval, waits[big]
        # And the live lane paused only while the window waited for a full bucket.
        live = [w for s, w in waits.items() if lanes.lane[s] == "live"]
        assert max(live) <= depth / rate + 2 * lanes.interval, max(live)
        assert sum(w > lanes.interval for w in live) <= depth / rate + 2

    run_lanes(tmp_path, check, rate=rate, depth=depth)


def test_a_cycles_live_batch_is_not_held_back_behind_its_window(tmp_path: Path) -> None:
    """The window packed in the same cycle as a live batch is fresh too; the pacer holds it back (the
    bucket was spent), and the small live batch must still go in that cycle, not miss its freshness and
    land in the backlog behind older-data windows."""

    def check(lanes: Lanes) -> None:
        lanes.pacer.bucket.charge(int(lanes.pacer.bucket.depth) - 2000)  # 2000 B left
        lanes.now += lanes.interval
        live = lanes.spool_row(300, "live", lanes.now)
        window = lanes.spool_row(8000, "window", lanes.now - 10)
        lanes.pump()
        assert live in lanes.published_at, "the live batch waited behind the cycle's window"
        assert window not in lanes.published_at

    run_lanes(tmp_path, check, rate=1000.0, depth=20_000.0)


@st.composite
def workloads(draw: st.DrawFn) -> dict[str, Any]:
    rate = draw(st.sampled_from([500.0, 1500.0, 4000.0]))
    depth = rate * draw(st.integers(2, 30))
    live = draw(st.integers(1, int(rate * 0.5)))  # the live lane's bytes per cycle (with framing)
    every = draw(st.integers(2, 12))  # cycles per window
    # Windows up to twice the bucket; on average what is left of the rate after the live lane, or less.
    room = max(1.0, (rate - live) * every * 0.9)
    windows = draw(st.lists(st.integers(1, int(min(2 * depth, 3 * room))), min_size=1, max_size=12))
    backlog = draw(st.lists(st.integers(1, int(2 * depth)), max_size=4))  # rows from before a restart
    return {
        "rate": rate,
        "depth": depth,
        "live": live,
        "every": every,
        "windows": windows,
        "backlog": backlog,
    }


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads())
def test_no_row_waits_longer_than_the_bytes_ahead_of_it_need(w: dict[str, Any]) -> None:
    """Whatever the lanes' sizes, with the live lane within the rate: every row (live batches, windows
    up to twice the bucket, a backlog from before a restart) is published while the live lane goes on,
    within the time the rate left by the live lane needs for every window and backlog row, plus a hold
    and a fill (the bucket's fill time, at least two intervals) per row that needs a full bucket."""
    rate, depth, every, live = w["rate"], w["depth"], w["every"], w["live"]
    hold = max(depth / rate, 2.0)
    rows = [*w["backlog"], *w["windows"]]
    big = sum(1 for size in rows if size + OVERHEAD > depth - live)
    limit = sum(size + OVERHEAD for size in rows) / (rate - live) + (1 + big) * (2 * hold + 1) + 4

    def check(lanes: Lanes) -> None:
        for size in w["backlog"]:
            lanes.spool_row(size, "backlog", lanes.now - 3600)
        c = 0
        end = every * len(w["windows"]) + limit + 2 * hold
        while c < end:  # the windows, then the live lane alone, as long as any row may wait
            t = lanes.now + lanes.interval
            new = [(max(1, live - OVERHEAD), "live", t)]
            if (c + 1) % every == 0 and c // every < len(w["windows"]):
                new.append((w["windows"][c // every], "window", t - every * lanes.interval))
            lanes.cycle(new)
            c += 1
        waits = lanes.waits()
        worst = max(waits, key=lambda s: waits[s])
        assert waits[worst] <= limit, (
            f"seq {worst} ({lanes.lane[worst]}, {lanes.spool.batches.count()} row(s) left) "
            f"waited {waits[worst]:.0f} s, more than {limit:.0f} s"
        )

    with tempfile.TemporaryDirectory() as d:
        run_lanes(Path(d), check, rate=rate, depth=depth)
