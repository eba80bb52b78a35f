"""Stateful property test of the delivery protocol: spool + send queue + acks, against a model cloud.

Any interleaving of scrapes, publications, the cloud writing or refusing batches, acks delivered late,
twice, lost or forged, ack timeouts, restarts, spool recreation and clock steps keeps the promise: every
scraped sample is in the spool, in the receiver, or in the loss ledger (refused by the cloud, so in a
dead letter too), and none is in both the receiver and the ledger. The cloud may refuse a batch
whole or only some of its samples (a ``partial`` ack with counts). The uplink's own ack logic
(``edge_relay.uplink.acks.apply_ack``) is what runs here; only MQTT is replaced by lists.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from array import array
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from edge_relay.store.spool import InFlight, SendQueue, Spool
from edge_relay.uplink.acks import apply_ack
from schemas import codec
from schemas.codec import Ack, AckResult
from schemas.model import Batch, ScrapeBlock

NODE = "n"


class Clock:
    def __init__(self) -> None:
        self.ms = 1_800_000_000_000

    def now_ms(self) -> int:
        return self.ms

    def now_s(self) -> float:
        return self.ms / 1000


class Delivery(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="delivery-"))
        self.clock = Clock()
        self.files = itertools.count()
        self.ids = itertools.count(1)
        self.scraped: set[int] = set()
        self.rows: dict[tuple[int, int], frozenset[int]] = {}  # (incarnation, seq) -> sample ids
        # The cloud's verdict on a batch, once made: the samples it refused (none: "ok").
        self.outcome: dict[tuple[int, int], frozenset[int]] = {}
        self.written: set[int] = set()  # in the receiver
        self.dead: set[int] = set()  # in the cloud's dead letters
        self.refused: set[int] = set()  # deleted at the edge by a "rejected" ack, so in the ledger
        self.ledgered_before = 0  # ledger totals of spool files recreated since
        self.transit: list[tuple[int, int, frozenset[int]]] = []  # published, not yet processed
        self.acks: list[Ack] = []  # sent by the cloud, not yet delivered
        self._open(new_file=True)

    def _open(self, *, new_file: bool) -> None:
        if new_file:
            self.path = self.dir / f"spool-{next(self.files)}.db"
        self.spool = Spool(self.path, synchronous="OFF", clock_ms=self.clock.now_ms)
        self.queue = SendQueue(
            self.spool.batches,
            order="live_first",
            inflight_limit=3,
            live_window_s=5.0,
            clock_s=self.clock.now_s,
        )
        self.inflight = InFlight()

    def teardown(self) -> None:
        self.spool.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _spooled(self) -> set[int]:
        out: set[int] = set()
        for row in self.spool.batches.pending(10_000):
            batch = codec.decode_batch(row.payload)
            out |= {int(v) for block in batch.scrapes for v in block.values}
        return out

    # --- the edge ------------------------------------------------------------------------------

    @rule(samples=st.integers(1, 4))
    def scrape(self, samples: int) -> None:
        ids = [next(self.ids) for _ in range(samples)]
        self.scraped |= set(ids)
        inc = self.spool.incarnation
        labelsets = [(("__name__", "m"), ("i", str(i))) for i in ids]
        ts = self.clock.ms

        def encode(seq: int) -> bytes:
            block = ScrapeBlock(ts, array("I", range(len(ids))), array("d", [float(i) for i in ids]))
            return codec.encode_batch(Batch("c", NODE, seq, labelsets, [block], incarnation=inc))

        seq = self.spool.batches.append(encode, first_ts_ms=ts, last_ts_ms=ts, sample_count=samples)
        self.rows[(inc, seq)] = frozenset(ids)

    @rule()
    def publish(self) -> None:
        now = self.clock.now_s()
        for row in self.queue.next_rows(self.inflight):
            self.inflight.add(row.seq, now)
            self.queue.sent([row.seq], self.clock.ms)
            header = codec.peek_header(row.payload)
            self.transit.append((header.incarnation, row.seq, self.rows[(header.incarnation, row.seq)]))

    @rule()
    def ack_timeout(self) -> None:
        self.inflight.expire(0.0, self.clock.now_s() + 3600)  # everything in flight goes out again

    @rule()
    def restart(self) -> None:
        self.spool.close()
        self._open(new_file=False)

    @precondition(lambda self: self.spool.stats().rows == 0)
    @rule()
    def recreate_spool(self) -> None:
        """An emptyDir after a rollout: a new file, seqs from 1 again; acks of the old one may linger."""
        self.ledgered_before += sum(self.spool.losses.totals().values())
        self.spool.close()
        self.path.unlink()
        self._open(new_file=True)

    @rule(step_ms=st.integers(-3_600_000, 120_000))
    def clock_step(self, step_ms: int) -> None:
        self.clock.ms += step_ms

    # --- the cloud -----------------------------------------------------------------------------

    @precondition(lambda self: self.transit)
    @rule(data=st.data())
    def cloud_processes(self, data: st.DataObject) -> None:
        inc, seq, ids = self.transit.pop(data.draw(st.integers(0, len(self.transit) - 1)))
        # A batch's verdict does not change when it comes again (the same bytes, the same receiver).
        bad = self.outcome.get((inc, seq))
        if bad is None:
            bad = self.outcome[(inc, seq)] = frozenset(data.draw(st.sets(st.sampled_from(sorted(ids)))))
        self.written |= ids - bad
        self.dead |= bad
        if not bad:
            result = AckResult(seq, "ok")
        elif bad == ids:
            result = AckResult(seq, "rejected", "out_of_bounds")
        else:
            result = AckResult(seq, "partial", "out_of_bounds", len(ids - bad), len(bad))
        self.acks.append(Ack(NODE, [result], incarnation=inc))

    @precondition(lambda self: self.acks)
    @rule(data=st.data(), again=st.booleans())
    def ack_arrives(self, data: st.DataObject, again: bool) -> None:
        i = data.draw(st.integers(0, len(self.acks) - 1))
        ack = self.acks[i] if again else self.acks.pop(i)  # "again": the broker redelivers it later
        applied = apply_ack(self.queue, self.inflight, ack, self.clock.now_s())
        for result, _loss in applied.refused:
            self.refused |= self.outcome[(ack.incarnation, result.seq)]

    @precondition(lambda self: self.acks)
    @rule(data=st.data())
    def ack_lost(self, data: st.DataObject) -> None:
        self.acks.pop(data.draw(st.integers(0, len(self.acks) - 1)))

    @rule(seq=st.integers(1, 40), ok=st.booleans(), data=st.data())
    def forged_ack(self, seq: int, ok: bool, data: st.DataObject) -> None:
        """An ack for a spool that is not this one (another incarnation) must change nothing."""
        inc = data.draw(st.integers(1, 2**62).filter(lambda v: v != self.spool.incarnation))
        before = self._spooled()
        result = AckResult(seq, "ok") if ok else AckResult(seq, "rejected", "forged")
        applied = apply_ack(self.queue, self.inflight, Ack(NODE, [result], incarnation=inc), 0.0)
        assert applied.ignored
        assert self._spooled() == before

    # --- the promise ---------------------------------------------------------------------------

    @invariant()
    def every_sample_is_somewhere_and_none_counted_twice(self) -> None:
        spooled = self._spooled()
        assert self.scraped <= spooled | self.written | self.refused, "samples lost without a trace"
        assert not self.written & self.refused, "a sample in the receiver and in the ledger"
        assert self.refused <= self.dead, "a refused sample must be in a dead letter too"
        ledgered = self.ledgered_before + sum(self.spool.losses.totals().values())
        assert ledgered == len(self.refused), "the ledger counts each refused sample once"


Delivery.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestDelivery = Delivery.TestCase
