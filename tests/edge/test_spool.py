"""Tests of edge_relay/store/spool.py: seq allocation, integrity, recovery, caps, threads, kill -9."""

from __future__ import annotations

import itertools
import logging
import os
import random
import signal
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from edge_relay.ledger import LossReason, LossRecord
from edge_relay.store.spool import (
    SCHEMA_VERSION,
    InFlight,
    Replacement,
    Spool,
    SpoolClosedError,
    SpoolError,
    SpoolFullError,
    SpoolRow,
)
from schemas.model import STALE_NAN

ROOT = Path(__file__).resolve().parents[2]


def enc(body: bytes = b"") -> Callable[[int], bytes]:
    """An encoder that, like the real one, puts the seq inside the payload."""
    return lambda seq: seq.to_bytes(8, "big") + body


def put(spool: Spool, body: bytes = b"", *, ts: int = 1000, priority: int = 0, samples: int = 1) -> int:
    return spool.batches.append(
        enc(body), first_ts_ms=ts, last_ts_ms=ts + 1, sample_count=samples, priority=priority
    )


def raw_conn(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


@pytest.fixture
def spool_path(tmp_path: Path) -> Path:
    return tmp_path / "spool.db"


# ------------------------------------------------------------------------------------------ basics


def test_schema_and_pragmas(spool_path: Path) -> None:
    with Spool(spool_path) as spool:
        conn = raw_conn(spool_path)
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental
        conn.close()
        assert spool.store._conn is not None
        assert spool.store._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert spool.store._conn.execute("PRAGMA busy_timeout").fetchone()[0] == 5000


def test_seq_monotonic_across_reopen_and_after_deleting_everything(spool_path: Path) -> None:
    with Spool(spool_path) as spool:
        assert [put(spool) for _ in range(3)] == [1, 2, 3]
        assert spool.batches.ack([1, 2, 3]) == 3
        assert spool.stats().rows == 0
        assert put(spool) == 4
        assert spool.batches.ack([4]) == 1
    with Spool(spool_path) as spool:
        assert spool.stats().rows == 0
        assert spool.stats().last_seq == 4
        assert put(spool) == 5


def test_append_returns_seq_and_passes_it_to_encode(spool_path: Path) -> None:
    seen: list[int] = []

    def encode(seq: int) -> bytes:
        seen.append(seq)
        return b"batch-%d" % seq

    with Spool(spool_path) as spool:
        seq = spool.batches.append(encode, first_ts_ms=10, last_ts_ms=20, sample_count=7, priority=2)
        (row,) = spool.batches.pending(10)
    assert seen == [seq]
    assert row.payload == b"batch-%d" % seq
    assert (row.first_ts_ms, row.last_ts_ms, row.sample_count, row.priority) == (10, 20, 7, 2)
    assert row.byte_size == len(row.payload)
    assert row.checksum == zlib.crc32(row.payload)
    assert (row.attempts, row.last_sent_ms) == (0, None)


def test_nan_payload_bytes_round_trip_exactly(spool_path: Path) -> None:
    nan_bits = [0x7FF0000000000002, 0x7FF8000000000000, 0xFFF8000000000001, 0x7FF4000000000123]
    body = struct.pack("<4Q", *nan_bits) + struct.pack("<3d", STALE_NAN, float("inf"), -0.0) + b"\x00\xff"
    with Spool(spool_path) as spool:
        seq = put(spool, body)
    with Spool(spool_path) as spool:
        (row,) = spool.batches.pending(1)
    assert row.seq == seq
    assert row.payload == seq.to_bytes(8, "big") + body
    assert struct.unpack("<4Q", row.payload[8:40]) == tuple(nan_bits)
    assert struct.unpack("<Q", row.payload[40:48])[0] == 0x7FF0000000000002
    conn = raw_conn(spool_path)
    assert conn.execute("SELECT typeof(payload) FROM batches").fetchone()[0] == "blob"
    conn.close()


def test_encode_failure_stores_nothing(spool_path: Path) -> None:
    def boom(seq: int) -> bytes:
        raise RuntimeError("encoder broke")

    with Spool(spool_path) as spool:
        with pytest.raises(RuntimeError, match="encoder broke"):
            spool.batches.append(boom, first_ts_ms=1, last_ts_ms=1, sample_count=1)
        with pytest.raises(TypeError):
            spool.batches.append(lambda seq: "text", first_ts_ms=1, last_ts_ms=1, sample_count=1)  # type: ignore[arg-type,return-value]
        assert spool.stats().rows == 0
        # The seq never left the node, so handing it out again is fine.
        assert put(spool) == 1


def test_ack_deletes_only_named_rows(spool_path: Path) -> None:
    with Spool(spool_path) as spool:
        seqs = [put(spool) for _ in range(6)]
        assert spool.batches.ack([seqs[1], seqs[3], seqs[3], 999]) == 2
        assert [r.seq for r in spool.batches.pending(10)] == [seqs[0], seqs[2], seqs[4], seqs[5]]
        assert spool.batches.ack([seqs[1], 12345]) == 0  # duplicate ack after a replay: harmless
        assert spool.batches.ack([]) == 0
        assert spool.stats().rows == 4


def test_ack_many_seqs_in_chunks(spool_path: Path) -> None:
    with Spool(spool_path, synchronous="OFF") as spool:
        seqs = [put(spool) for _ in range(1200)]
        assert spool.batches.mark_sent(seqs, 5) == 1200
        assert spool.batches.ack(range(1, 3000)) == 1200
        assert spool.stats().rows == 0


def test_pending_order_limit_and_exclude(spool_path: Path) -> None:
    with Spool(spool_path) as spool:
        a = put(spool, priority=0)
        b = put(spool, priority=5)
        c = put(spool, priority=1)
        d = put(spool, priority=5)
        e = put(spool, priority=0)
        assert [r.seq for r in spool.batches.pending(10)] == [a, b, c, d, e]
        assert [r.seq for r in spool.batches.pending(2)] == [a, b]
        assert [r.seq for r in spool.batches.pending(10, order="newest")] == [e, d, c, b, a]
        assert [r.seq for r in spool.batches.pending(10, order="priority")] == [b, d, c, a, e]
        assert [r.seq for r in spool.batches.pending(2, exclude={a, b})] == [c, d]
        assert [r.seq for r in spool.batches.pending(3, exclude=[a, c, 77], order="newest")] == [e, d, b]
        inflight = {b: 1.0, e: 2.0}
        assert [r.seq for r in spool.batches.pending(10, exclude=inflight.keys())] == [a, c, d]
        assert spool.batches.pending(0) == []
        with pytest.raises(ValueError):
            spool.batches.pending(1, order="random")


def test_mark_sent_and_stats(spool_path: Path) -> None:
    with Spool(spool_path) as spool:
        s1 = put(spool, b"x" * 10, ts=5000, samples=3)
        s2 = put(spool, b"y" * 20, ts=4000, samples=4)
        assert spool.batches.mark_sent([s1, 42], 123) == 1
        assert spool.batches.mark_sent([s1], 456) == 1
        rows = {r.seq: r for r in spool.batches.pending(10)}
        assert (rows[s1].attempts, rows[s1].last_sent_ms) == (2, 456)
        assert (rows[s2].attempts, rows[s2].last_sent_ms) == (0, None)
        st = spool.stats()
        assert (st.rows, st.bytes, st.samples, st.oldest_first_ts_ms) == (2, 18 + 28, 7, 4000)
        assert st.quarantined_rows == 0
        assert st.last_seq == s2
        assert st.file_bytes > 0
        spool.batches.ack([s1, s2])
        assert spool.stats().oldest_first_ts_ms is None


def test_closed_spool_refuses(spool_path: Path) -> None:
    spool = Spool(spool_path)
    spool.close()
    spool.close()  # idempotent
    with pytest.raises(SpoolClosedError):
        put(spool)


def test_invalid_arguments(spool_path: Path) -> None:
    with pytest.raises(ValueError):
        Spool(spool_path, synchronous="SOMETIMES")
    with pytest.raises(ValueError):
        Spool(spool_path, max_bytes=1000)


# --------------------------------------------------------------------------------------- quarantine


def test_checksum_mismatch_is_quarantined(spool_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with Spool(spool_path) as spool:
        seqs = [put(spool, b"payload-%d" % i) for i in range(4)]
        conn = raw_conn(spool_path)
        # Same length, one flipped byte: only the CRC can notice.
        (payload,) = conn.execute("SELECT payload FROM batches WHERE seq = ?", (seqs[1],)).fetchone()
        conn.execute(
            "UPDATE batches SET payload = ? WHERE seq = ?", (payload[:-1] + bytes([payload[-1] ^ 1]), seqs[1])
        )
        conn.close()
        with caplog.at_level(logging.ERROR, logger="edge_relay.spool"):
            rows = spool.batches.pending(3)
        assert [r.seq for r in rows] == [seqs[0], seqs[2], seqs[3]]  # the gap is filled
        assert "checksum" in caplog.text
        (q,) = spool.batches.quarantined()
        assert q.seq == seqs[1]
        assert "checksum" in q.reason
        assert q.payload is not None and q.quarantined_ms > 0
        st = spool.stats()
        assert (st.rows, st.quarantined_rows) == (3, 1)
        assert spool.batches.quarantined_total == 1
        assert spool.batches.ack([seqs[1]]) == 0  # gone from circulation
    with Spool(spool_path) as spool:
        assert spool.stats().quarantined_rows == 1
        assert spool.batches.clear_quarantine() == 1
        assert spool.batches.quarantined() == []


@pytest.mark.parametrize(
    ("sql", "reason"),
    [
        ("UPDATE batches SET payload = NULL WHERE seq = ?", "NULL"),
        ("UPDATE batches SET payload = 'some text' WHERE seq = ?", "not BLOB"),
        ("UPDATE batches SET payload = 3.5 WHERE seq = ?", "not BLOB"),
        ("UPDATE batches SET byte_size = byte_size + 1 WHERE seq = ?", "byte_size"),
        ("UPDATE batches SET first_ts_ms = 'x' WHERE seq = ?", "not an integer"),
    ],
)
def test_bad_rows_are_quarantined(spool_path: Path, sql: str, reason: str) -> None:
    with Spool(spool_path) as spool:
        good = put(spool, b"good")
        bad = put(spool, b"bad")
        conn = raw_conn(spool_path)
        conn.execute(sql, (bad,))
        conn.close()
        assert [r.seq for r in spool.batches.pending(10)] == [good]
        (q,) = spool.batches.quarantined()
        assert q.seq == bad and reason in q.reason
        assert put(spool) == bad + 1


def test_explicit_quarantine(spool_path: Path) -> None:
    with Spool(spool_path) as spool:
        s1, s2 = put(spool), put(spool)
        spool.batches.quarantine(s1, "cloud could not decode it")
        spool.batches.quarantine(999, "unknown seq: no-op")
        assert [r.seq for r in spool.batches.pending(10)] == [s2]
        (q,) = spool.batches.quarantined()
        assert (q.seq, q.reason) == (s1, "cloud could not decode it")
        assert q.payload == s1.to_bytes(8, "big")
        assert spool.batches.clear_quarantine([s1, 5]) == 1


# ------------------------------------------------------------------------------------- corrupt file


def test_garbage_file_is_moved_aside(spool_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with Spool(spool_path) as spool:
        old = [put(spool) for _ in range(5)]
    garbage = b"this is not an SQLite database\n" * 500
    spool_path.write_bytes(garbage)
    Path(f"{spool_path}-wal").write_bytes(b"nor is this a WAL")
    with caplog.at_level(logging.ERROR, logger="edge_relay.spool"), Spool(spool_path) as spool:
        assert spool.recovered_from is not None
        assert spool.recovered_from.name.startswith("spool.db.corrupt-")
        assert spool.recovered_from.read_bytes() == garbage
        assert Path(f"{spool.recovered_from}-wal").read_bytes() == b"nor is this a WAL"
        assert str(spool_path) in caplog.text
        assert spool.recovery is not None and spool.recovery.salvaged_rows == 0
        assert spool.stats().rows == 0
        seq = put(spool)
        assert seq > max(old)
        assert seq >= spool.recovery.at_ms * 1000  # nothing readable: time-derived base
        assert [r.seq for r in spool.batches.pending(10)] == [seq]
    with Spool(spool_path) as spool:  # the fresh spool is a normal spool from now on
        assert spool.recovery is None
        assert put(spool) == seq + 1


def test_partially_corrupt_file_salvages_valid_rows(spool_path: Path) -> None:
    rng = random.Random(7)
    with Spool(spool_path, synchronous="OFF") as spool:
        originals = {}
        for _ in range(200):
            body = rng.randbytes(rng.choice((50, 3000, 9000)))
            seq = put(spool, body)
            originals[seq] = seq.to_bytes(8, "big") + body
    size = spool_path.stat().st_size
    with spool_path.open("r+b") as f:
        f.seek(size // 2 // 4096 * 4096)
        f.write(b"\xa5" * 4096 * 8)
    with Spool(spool_path) as spool:
        assert spool.recovery is not None
        assert "quick_check" in spool.recovery.reason
        rows = spool.batches.pending(1000)
        assert len(rows) == spool.recovery.salvaged_rows == spool.stats().rows
        for row in rows:
            assert row.payload == originals[row.seq]
        assert spool.stats().quarantined_rows == 0
        assert put(spool) > max(originals)


def test_incarnation_is_stable_per_file_and_new_for_a_new_file(tmp_path: Path) -> None:
    with Spool(tmp_path / "a.db") as a:
        first = a.incarnation
        assert 0 < first < 2**63
    with Spool(tmp_path / "a.db") as a:
        assert a.incarnation == first  # reopened: the same file, the same identity
    with Spool(tmp_path / "b.db") as b:
        assert b.incarnation not in (0, first)  # a new file: seqs start again, so a new identity


def test_a_salvaged_spool_keeps_its_incarnation(spool_path: Path) -> None:
    """Salvaged rows carry the incarnation in their payloads: their acks must still delete them."""
    rng = random.Random(5)
    with Spool(spool_path, synchronous="OFF") as spool:
        incarnation = spool.incarnation
        for _ in range(200):
            put(spool, rng.randbytes(rng.choice((50, 3000, 9000))))
    size = spool_path.stat().st_size
    with spool_path.open("r+b") as f:
        f.seek(size // 2 // 4096 * 4096)
        f.write(b"\xa5" * 4096 * 8)
    with Spool(spool_path) as spool:
        assert spool.recovery is not None and spool.recovery.salvaged_rows > 0
        assert spool.incarnation == incarnation


def test_recovery_keeps_the_loss_ledger_and_the_kept_integers_and_records_itself(spool_path: Path) -> None:
    """A recovered spool must not read "data safe" after a loss, nor forget today's quota use."""
    rng = random.Random(11)
    with Spool(spool_path, synchronous="OFF") as spool:
        assert spool.losses.record(LossRecord(LossReason.MAX_AGE, '{job="kepler"}', 1, 2, 345))
        spool.meta.set({"budget_used_bytes": 6789, "budget_day": 739000})
        for _ in range(200):
            put(spool, rng.randbytes(rng.choice((50, 3000, 9000))))
    size = spool_path.stat().st_size
    with spool_path.open("r+b") as f:  # the batches' pages, not the small tables created first
        f.seek(size // 2 // 4096 * 4096)
        f.write(b"\xa5" * 4096 * 8)
    with Spool(spool_path) as spool:
        assert spool.recovery is not None
        totals = spool.losses.totals()
        assert totals["max_age"] == 345
        assert "spool_file_corrupt" in totals
        (entry,) = [e for e in spool.losses.entries() if e.reason == "spool_file_corrupt"]
        assert f"{spool.recovery.salvaged_rows} rows salvaged" in entry.series
        assert spool.meta.get("budget_used_bytes", 0) == 6789
        assert spool.meta.get("budget_day", 0) == 739000


def test_corruption_found_at_run_time_recovers(spool_path: Path) -> None:
    with Spool(spool_path) as spool:
        old = [put(spool, b"z" * 5000) for _ in range(30)]
    with spool_path.open("r+b") as f:  # every page but the header page: all b-tree roots are gone
        f.seek(4096)
        f.write(b"\xa5" * (spool_path.stat().st_size - 4096))
    with Spool(spool_path, check_on_open=False) as spool:
        assert spool.recovered_from is None
        assert spool.batches.pending(10) == []  # hits SQLITE_CORRUPT, recovers, retries on the fresh spool
        recovery = spool.recovery
        assert recovery is not None and "pending" in recovery.reason
        assert put(spool) > max(old)
        # Recorded in the fresh file's ledger at once, not only when the relay next starts.
        assert "spool_file_corrupt" in spool.losses.totals()


def test_a_run_time_recovery_keeps_the_incarnation_the_relay_stamps_its_batches_with(
    spool_path: Path,
) -> None:
    """The relay reads the incarnation once, at its start, and stamps every batch with it. When the
    whole file turns unreadable under it (nothing salvaged, the old identity unreadable on disk), the
    fresh file keeps that incarnation: with a new one the relay would ignore every ack from then on,
    and its spool would never drain."""
    with Spool(spool_path) as spool:
        stamped = spool.incarnation
        noise = random.Random(7)
        for _ in range(800):  # more than SQLite's page cache holds, so that the spool reads the file again
            put(spool, noise.randbytes(5000))
        spool.store.run("checkpoint", lambda c: c.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall())
        spool_path.write_bytes(random.Random(7).randbytes(spool_path.stat().st_size))
        spool.stats()
        spool.batches.pending(100)
        seq = put(spool)  # by now the corruption was met: recovered on a fresh file
        assert spool.recovery is not None and spool.recovery.salvaged_rows == 0
        assert spool.incarnation == stamped
    with Spool(spool_path) as again:  # and the fresh file holds it: the next start reads the same
        assert again.incarnation == stamped
        assert [r.seq for r in again.batches.pending(10)] == [seq]


def test_newer_schema_is_refused_not_moved(spool_path: Path) -> None:
    with Spool(spool_path):
        pass
    conn = raw_conn(spool_path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(SpoolError, match="schema 99"):
        Spool(spool_path)
    assert spool_path.exists()
    assert not list(spool_path.parent.glob("*.corrupt-*"))


def test_old_corrupt_files_are_pruned(spool_path: Path) -> None:
    for _ in range(4):
        spool_path.write_bytes(b"garbage" * 1000)
        with Spool(spool_path, keep_corrupt=2) as spool:
            assert spool.recovered_from is not None
    kept = [p for p in spool_path.parent.iterdir() if ".corrupt-" in p.name and not p.name.endswith("-shm")]
    assert len([p for p in kept if not p.name.endswith("-wal")]) == 2


def test_recovery_continues_above_readable_seq_when_the_clock_says_1970(spool_path: Path) -> None:
    clock = lambda: 0  # noqa: E731 - a node without RTC that booted at the epoch: no time-derived floor
    with Spool(spool_path, clock_ms=clock) as spool:
        seqs = [put(spool, b"x" * 100) for _ in range(4)]
        spool.batches.ack(seqs)
    conn = raw_conn(spool_path)
    (page_size,) = conn.execute("PRAGMA page_size").fetchone()
    (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'batches'").fetchone()
    conn.close()
    with spool_path.open("r+b") as f:  # destroy the batches table; meta stays readable
        f.seek((root - 1) * page_size)
        f.write(b"\xa5" * page_size)
    with Spool(spool_path, clock_ms=clock) as spool:
        assert spool.recovery is not None
        assert spool.recovery.next_seq == seqs[-1] + 1
        assert put(spool) == seqs[-1] + 1


# ------------------------------------------------------------------------------------------ disk full


def test_max_bytes_cap_raises_spool_full_and_recovers_after_acks(spool_path: Path) -> None:
    cap = 256 * 1024
    rng = random.Random(1)
    with Spool(spool_path, max_bytes=cap, synchronous="OFF") as spool:
        seqs: list[int] = []
        with pytest.raises(SpoolFullError):
            for _ in range(1000):
                seqs.append(put(spool, rng.randbytes(16 * 1024)))
        assert 5 < len(seqs) < 20
        assert spool_path.stat().st_size <= cap
        # Still fully usable while full.
        with pytest.raises(SpoolFullError):
            put(spool, rng.randbytes(16 * 1024))
        assert spool.stats().rows == len(seqs)
        assert len(spool.batches.pending(100)) == len(seqs)
        assert spool.batches.mark_sent(seqs[:2], 1) == 2
        spool.batches.quarantine(seqs[-1], "make room")
        assert spool.batches.clear_quarantine() == 1
        # Acks make room; the failed appends consumed no seq.
        half = seqs[: len(seqs) // 2]
        assert spool.batches.ack(half) == len(half)
        more = [put(spool, rng.randbytes(16 * 1024)) for _ in range(len(half) - 1)]
        assert more[0] == seqs[-1] + 1
        assert more == sorted(more) and len(set(more)) == len(more)
        assert spool_path.stat().st_size <= cap
    with Spool(spool_path, max_bytes=cap) as spool:
        assert spool.stats().rows == len(seqs) - len(half) - 1 + len(more)


def test_reopening_a_spool_above_a_new_cap(spool_path: Path) -> None:
    with Spool(spool_path, synchronous="OFF") as spool:
        seqs = [put(spool, b"q" * 8000) for _ in range(100)]
    with Spool(spool_path, max_bytes=256 * 1024, synchronous="OFF") as spool:
        with pytest.raises(SpoolFullError):
            put(spool, b"q" * 8000)
        assert spool.batches.ack(seqs[:10]) == 10
        assert put(spool, b"q" * 8000) == seqs[-1] + 1  # freed pages are reused
        spool.batches.ack(seqs[10:])
        assert spool.compact() > 0
        # Back under the cap, the cap holds again.
        with pytest.raises(SpoolFullError):
            for _ in range(100):
                put(spool, b"q" * 8000)
        assert spool_path.stat().st_size <= 256 * 1024


def test_compact_gives_space_back(spool_path: Path) -> None:
    with Spool(spool_path, synchronous="OFF") as spool:
        seqs = [put(spool, b"q" * 8000) for _ in range(100)]
        spool.batches.ack(seqs)
        assert spool.compact() > 0
        assert spool.compact() == 0
        assert put(spool) == seqs[-1] + 1
    assert spool_path.stat().st_size < 100 * 8000 // 2


# ------------------------------------------------------------------------------------------ threads


def test_concurrent_append_and_ack_loses_and_duplicates_nothing(spool_path: Path) -> None:
    n = 3000
    spool = Spool(spool_path, synchronous="OFF")  # durability is not under test here; speed is welcome
    appended: list[int] = []
    acked: list[list[int]] = [[], []]
    ack_counts = [0, 0]
    errors: list[BaseException] = []
    producer_done = threading.Event()

    def producer() -> None:
        try:
            for i in range(n):
                appended.append(put(spool, b"%d" % i, ts=i))
        except BaseException as exc:
            errors.append(exc)
        finally:
            producer_done.set()

    def consumer(k: int) -> None:
        # Two consumers race for the same rows, as a replayed ack would: each row is deleted exactly once.
        try:
            for _ in range(100_000):
                finished = producer_done.is_set()
                rows = spool.batches.pending(64, order="oldest" if k == 0 else "newest")
                if not rows and finished:
                    return
                seqs = [r.seq for r in rows]
                for r in rows:
                    assert r.payload[:8] == r.seq.to_bytes(8, "big")
                spool.batches.mark_sent(seqs, 1)
                ack_counts[k] += spool.batches.ack(seqs)
                acked[k].extend(seqs)
            raise AssertionError("consumer never finished")
        except BaseException as exc:
            errors.append(exc)

    def watcher() -> None:
        try:
            while not producer_done.is_set():
                st = spool.stats()
                assert st.rows >= 0 and st.quarantined_rows == 0
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=producer),
        threading.Thread(target=consumer, args=(0,)),
        threading.Thread(target=consumer, args=(1,)),
        threading.Thread(target=watcher),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        assert len(appended) == n
        assert all(a < b for a, b in itertools.pairwise(appended))
        assert sum(ack_counts) == n
        assert set(acked[0]) | set(acked[1]) == set(appended)
        st = spool.stats()
        assert (st.rows, st.quarantined_rows, st.last_seq) == (0, 0, appended[-1])
    finally:
        spool.close()


# -------------------------------------------------------------------------------------------- kill -9

_CHILD = r"""
import os, random, sys
from edge_relay.store.spool import Spool

path, seed, log_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = random.Random(seed)
log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

def note(line):
    os.write(log, (line + "\n").encode())

with Spool(path) as spool:
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        body = rng.randbytes(rng.choice((16, 900, 5000, 70000)))
        seq = spool.batches.append(
            lambda s: s.to_bytes(8, "big") + body, first_ts_ms=1, last_ts_ms=2, sample_count=1
        )
        note(f"A {seq}")
        if rng.random() < 0.4:
            rows = spool.batches.pending(8, order=rng.choice(("oldest", "newest")))
            victims = [r.seq for r in rows if rng.random() < 0.6]
            if victims:
                ids = " ".join(map(str, victims))
                note(f"T {ids}")
                spool.batches.ack(victims)
                note(f"D {ids}")
            spool.batches.mark_sent([r.seq for r in rows], 7)
"""


def _parse_log(path: Path) -> tuple[list[int], set[int], set[int]]:
    appended: list[int] = []
    tried: set[int] = set()
    done: set[int] = set()
    if not path.exists():
        return appended, tried, done
    for line in path.read_text().splitlines():
        kind, _, rest = line.partition(" ")
        ids = [int(x) for x in rest.split()]
        if kind == "A":
            appended.extend(ids)
        elif kind == "T":
            tried.update(ids)
        elif kind == "D":
            done.update(ids)
    return appended, tried, done


def test_kill_9_at_random_moments_leaves_a_consistent_spool(tmp_path: Path) -> None:
    spool_path = tmp_path / "spool.db"
    rng = random.Random(20240611)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    committed: set[int] = set()  # confirmed appends, over all runs
    ack_tried: set[int] = set()
    ack_done: set[int] = set()
    high_water = 0  # meta.last_seq seen after the previous kill
    for run in range(20):
        log_path = tmp_path / f"child-{run}.log"
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(spool_path), str(run), str(log_path)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            if run % 4 == 0:
                # Sometimes kill early: during start-up, schema creation or the first appends.
                time.sleep(rng.uniform(0.0, 0.3))
            else:
                assert proc.stdout is not None
                line = proc.stdout.readline()
                assert line == b"ready\n", proc.stderr.read() if proc.stderr else line
                time.sleep(rng.uniform(0.0, 0.15))
            if proc.poll() is not None:
                raise AssertionError(f"child died on its own: {proc.communicate()[1].decode()}")
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.communicate()
        assert proc.returncode == -signal.SIGKILL

        appended, tried, done = _parse_log(log_path)
        assert all(s > high_water for s in appended), "a seq was handed out twice"
        assert appended == sorted(set(appended))
        committed.update(appended)
        ack_tried |= tried
        ack_done |= done

        if spool_path.exists():
            conn = raw_conn(spool_path)
            assert conn.execute("PRAGMA quick_check").fetchall() == [("ok",)]
            conn.close()
        with Spool(spool_path) as spool:
            assert spool.recovery is None
            rows: list[SpoolRow] = spool.batches.pending(1_000_000)
            st = spool.stats()
            assert spool.batches.quarantined_total == 0 and st.quarantined_rows == 0
            present = [r.seq for r in rows]
            assert present == sorted(set(present))
            for r in rows:
                assert r.payload[:8] == r.seq.to_bytes(8, "big")
                assert r.checksum == zlib.crc32(r.payload) and r.byte_size == len(r.payload)
            assert committed - ack_tried <= set(present), "a committed row is missing"
            assert not (ack_done & set(present)), "an acked row came back"
            assert st.rows == len(present)
            assert st.last_seq >= max(committed | set(present), default=0)
            high_water = st.last_seq
    assert len(committed) > 20  # the children did real work between kills


# ------------------------------------------------------------------------------- the open batch window


def test_staged_cycles_survive_reopen_and_promote_atomically(spool_path: Path) -> None:
    with Spool(spool_path) as spool:
        put(spool)  # seq 1
        a = spool.staging.stage(b"cycle-a", first_ts_ms=1000, last_ts_ms=1000, sample_count=10)
        b = spool.staging.stage(b"cycle-b", first_ts_ms=6000, last_ts_ms=6000, sample_count=12)
        st = spool.stats()
        assert (st.rows, st.staged_rows, st.staged_samples, st.staged_bytes) == (1, 2, 22, 14)
    with Spool(spool_path) as spool:  # a restart inside the window keeps it
        staged = spool.staging.staged()
        assert [(r.id, r.payload, r.sample_count) for r in staged] == [
            (a, b"cycle-a", 10),
            (b, b"cycle-b", 12),
        ]
        item = Replacement(enc(b"packed"), 1000, 6000, 22)
        assert spool.staging.promote([a, b], [item]) == [2]
        assert spool.staging.staged() == []
        rows = spool.batches.pending(10)
        assert [(r.seq, r.payload, r.sample_count) for r in rows] == [
            (1, enc()(1), 1),
            (2, enc(b"packed")(2), 22),
        ]
        assert spool.stats().staged_rows == 0


def test_promote_that_fails_keeps_the_staged_cycles(spool_path: Path) -> None:
    with Spool(spool_path) as spool:
        a = spool.staging.stage(b"cycle", first_ts_ms=1000, last_ts_ms=1000, sample_count=3)

        def boom(seq: int) -> bytes:
            raise ValueError("encoder bug")

        with pytest.raises(ValueError):
            spool.staging.promote([a], [Replacement(boom, 1000, 1000, 3)])
        assert [r.id for r in spool.staging.staged()] == [a]
        assert spool.stats().rows == 0
        assert spool.stats().last_seq == 0


def test_corrupt_staged_cycle_is_dropped_into_the_ledger(spool_path: Path) -> None:
    with Spool(spool_path) as spool:
        a = spool.staging.stage(b"good", first_ts_ms=1000, last_ts_ms=1000, sample_count=3)
        bad = spool.staging.stage(b"flipped", first_ts_ms=2000, last_ts_ms=2000, sample_count=5)
    conn = raw_conn(spool_path)
    conn.execute("UPDATE staging SET payload = ? WHERE id = ?", (b"flopped", bad))
    conn.close()
    with Spool(spool_path) as spool:
        assert [r.id for r in spool.staging.staged()] == [a]
        assert spool.losses.totals() == {"corrupt_row": 5}
        assert spool.stats().staged_rows == 1


def test_stats_oldest_includes_staged_data(spool_path: Path) -> None:
    with Spool(spool_path) as spool:
        put(spool, ts=5000)
        spool.staging.stage(b"x", first_ts_ms=3000, last_ts_ms=3000, sample_count=1)
        assert spool.stats().oldest_first_ts_ms == 3000


def test_meta_values_persist(spool_path: Path) -> None:
    with Spool(spool_path) as spool:
        assert spool.meta.get("budget_used_bytes", 7) == 7
        spool.meta.set({"budget_used_bytes": 123, "budget_day": 739000})
        spool.meta.set({"budget_used_bytes": 456})
    with Spool(spool_path) as spool:
        assert spool.meta.get("budget_used_bytes", 0) == 456
        assert spool.meta.get("budget_day", 0) == 739000
        # the seq allocator's own meta key cannot be reached through these
        spool.meta.set({"last_seq": 10**9})
        assert put(spool) == 1


def test_schema_v2_file_migrates_to_staging(spool_path: Path) -> None:
    with Spool(spool_path) as spool:
        put(spool)
    conn = raw_conn(spool_path)
    conn.execute("DROP TABLE staging")
    conn.execute("PRAGMA user_version = 2")
    conn.close()
    with Spool(spool_path) as spool:
        assert spool.staging.stage(b"x", first_ts_ms=1, last_ts_ms=1, sample_count=1) >= 1
        assert spool.stats().rows == 1


def test_a_v4_file_gets_metadata_checksums_and_reads_back(spool_path: Path) -> None:
    """A spool written before the metadata checksum (schema 4) opens: its rows get theirs from their
    columns as they are, read back intact, and a column altered afterwards is caught."""
    with Spool(spool_path) as spool:
        seqs = [put(spool, b"old-%d" % i, ts=1000 + i) for i in range(3)]
        spool.staging.stage(b"cycle", first_ts_ms=5, last_ts_ms=6, sample_count=2)
    conn = raw_conn(spool_path)
    for table in ("batches", "quarantine", "staging"):
        conn.execute(f"ALTER TABLE {table} DROP COLUMN meta_checksum")
    conn.execute("PRAGMA user_version = 4")
    conn.close()
    with Spool(spool_path) as spool:
        assert [r.seq for r in spool.batches.pending(10)] == seqs
        assert [s.sample_count for s in spool.staging.staged()] == [2]
    conn = raw_conn(spool_path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.execute("UPDATE batches SET sample_count = 99 WHERE seq = ?", (seqs[1],))
    conn.execute("UPDATE staging SET last_ts_ms = 0")
    conn.close()
    with Spool(spool_path) as spool:
        assert [r.seq for r in spool.batches.pending(10)] == [seqs[0], seqs[2]]
        assert spool.staging.staged() == []
        assert spool.losses.totals()["corrupt_row"] > 0


def test_inflight_hasten_brings_expiry_forward_never_back() -> None:
    inflight = InFlight()
    inflight.add(1, 100.0)  # would expire at 160 with a 60 s timeout
    inflight.add(2, 95.0)  # at 155
    inflight.hasten(60.0, 140.0, 10.0)  # a reconnect at 140: everything goes by 150
    assert inflight.expire(60.0, 149.0) == []
    assert sorted(inflight.expire(60.0, 150.5)) == [1, 2]
    inflight.add(3, 100.0)
    inflight.hasten(60.0, 140.0, 30.0)  # 170 is later than its own expiry (160): unchanged
    assert inflight.expire(60.0, 160.5) == [3]
