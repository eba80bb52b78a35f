"""Backfill on request: the command messages, the selector, the relay's backfiller, and end to end on
real mosquitto and Prometheus (``cloud-ingest backfill`` against a relay whose budget keeps GPU detail
at 300 s)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from array import array
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge_relay.collect.shape import ShapedScrape
from edge_relay.encode.batches import BatchEncoder
from edge_relay.recorder.backfill import Backfiller, CommandInbox
from edge_relay.recorder.flight import FlightRecorder
from edge_relay.selfmetrics import RelayMetrics
from relay_common.selector import SelectorError, parse_selector
from schemas.codec import DecodeError, EncodeError
from schemas.codec.command import (
    MAX_RANGE_MS,
    MAX_REQUEST_BYTES,
    BackfillRequest,
    CommandResult,
    MissingRange,
    decode_request,
    decode_result,
    encode_request,
    encode_result,
    peek_request_id,
)
from testkit.exporters import ScriptedExporter
from testkit.services import Mosquitto, Prometheus, ServiceFactory, wait_until
from testkit.stack import ingest_config, program, relay_config, write_budget
from testkit.uplinks import mqtt_settings, spool_uplink

NOW = 1_764_590_400_000
NODE = "edge-gpu-01"


def _req(**kw: object) -> BackfillRequest:
    base: dict[str, object] = dict(
        id="r1", cluster="test", node=NODE, from_ms=NOW - 60_000, to_ms=NOW - 1000, ts_ms=NOW
    )
    base.update(kw)
    return BackfillRequest(**base)  # type: ignore[arg-type]


def _wire(**kw: object) -> bytes:
    obj: dict[str, object] = {
        "v": 1,
        "id": "r1",
        "kind": "backfill",
        "cluster": "test",
        "node": NODE,
        "from_ms": NOW - 60_000,
        "to_ms": NOW - 1000,
        "ts_ms": NOW,
    }
    obj.update(kw)
    return json.dumps({k: v for k, v in obj.items() if v is not ...}).encode()


# --- the codec -------------------------------------------------------------------------------------

names = st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True)


@given(
    req_id=st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True),
    cluster=names,
    node=names,
    start=st.integers(0, NOW),
    length=st.integers(1, MAX_RANGE_MS),
    match=st.none() | st.text(min_size=1, max_size=300),
)
def test_request_round_trip(
    req_id: str, cluster: str, node: str, start: int, length: int, match: str | None
) -> None:
    req = BackfillRequest(req_id, cluster, node, start, start + length, NOW, match)
    assume_ok = start + length <= NOW + 60_000
    if not assume_ok:
        with pytest.raises(EncodeError):
            encode_request(req, clock_ms=NOW)
        return
    assert decode_request(encode_request(req, clock_ms=NOW), clock_ms=NOW) == req


gaps = st.lists(
    st.tuples(
        st.integers(0, 2**40), st.integers(0, 2**20), st.sampled_from(["older_than_recorder", "sample_cap"])
    ),
    max_size=10,
)


@given(
    outcome=st.sampled_from(["done", "refused", "failed"]),
    counts=st.tuples(st.integers(0, 2**40), st.integers(0, 10**6), st.integers(0, 10**6)),
    missing=gaps,
    req_id=st.none() | st.just("abc"),
)
def test_result_round_trip(
    outcome: str, counts: tuple[int, int, int], missing: list[tuple[int, int, str]], req_id: str | None
) -> None:
    res = CommandResult(
        req_id,
        "test",
        NODE,
        outcome,  # type: ignore[arg-type]
        NOW,
        reason=None if outcome == "done" else "why",
        from_ms=NOW - 5000,
        to_ms=NOW,
        samples=counts[0],
        series=counts[1],
        batches=counts[2],
        first_ms=NOW - 4000 if counts[0] else None,
        last_ms=NOW - 1000 if counts[0] else None,
        missing=tuple(MissingRange(a, a + n, r) for a, n, r in missing),
    )
    assert decode_result(encode_result(res)) == res


def test_many_gaps_are_summed_up() -> None:
    res = CommandResult(
        "a",
        "test",
        NODE,
        "done",
        NOW,
        missing=tuple(MissingRange(i * 10, i * 10 + 5, "not_recorded") for i in range(200)),
    )
    back = decode_result(encode_result(res))
    assert len(back.missing) == 64 and back.missing[-1] == MissingRange(630, 1995, "not_recorded")


@pytest.mark.parametrize(
    ("payload", "reason", "words"),
    [
        (b"x" * (MAX_REQUEST_BYTES + 1), "oversized", "bytes"),
        (b"[1]", "malformed", "not a JSON object"),
        (b"{", "malformed", "not valid JSON"),
        (b'{"v":1,"v":1}', "malformed", "duplicate"),
        (_wire(v=2), "unknown_version", "version 2"),
        (_wire(extra=1), "malformed", "unknown command keys"),
        (_wire(id=...), "malformed", "lacks id"),
        (_wire(id="a/b"), "malformed", "id must be"),
        (_wire(id="x" * 65), "malformed", "id must be"),
        (_wire(kind="shell"), "malformed", "kind must be"),
        (_wire(node="a/+"), "bad_header", "node"),
        (_wire(from_ms=NOW, to_ms=NOW), "bad_timestamp", "before"),
        (_wire(from_ms=NOW - 1000, to_ms=NOW - 2000), "bad_timestamp", "before"),
        (_wire(from_ms=NOW - MAX_RANGE_MS - 2000), "bad_timestamp", "longer than"),
        (_wire(to_ms=NOW + 3_600_000), "bad_timestamp", "future"),
        (_wire(ts_ms=NOW + 3_600_000), "bad_timestamp", "future"),
        (_wire(from_ms=-5), "bad_timestamp", "outside"),
        (_wire(from_ms=True), "malformed", "integer"),
        (_wire(from_ms=1.5), "malformed", "integer"),
        (_wire(match="x" * 1025), "oversized", "1..1024"),
        (_wire(match=""), "malformed", "1..1024"),
        (_wire(match=["a"]), "malformed", "1..1024"),
        (b'{"v":1,"id":"a","kind":"backfill","cluster":"t","node":"n","from_ms":NaN}', "malformed", "NaN"),
    ],
)
def test_hostile_requests_are_refused_with_a_reason(payload: bytes, reason: str, words: str) -> None:
    with pytest.raises(DecodeError) as err:
        decode_request(payload, clock_ms=NOW)
    assert err.value.reason == reason and words in str(err.value), str(err.value)


def test_the_id_of_a_refused_request_is_echoed_when_readable() -> None:
    assert peek_request_id(_wire(id="abc", kind="shell")) == "abc"
    assert peek_request_id(b"{") is None and peek_request_id(_wire(id="a/b")) is None


def test_hostile_results_are_refused() -> None:
    good = json.loads(encode_result(CommandResult("a", "test", NODE, "refused", NOW, reason="busy")))
    for bad in (
        {**good, "result": "maybe"},
        {**good, "reason": None},
        {**good, "result": "done"},  # a done result with a reason
        {**good, "missing": [[5, 1, "not_recorded"]]},
        {**good, "missing": [[1, 5, "whatever"]]},
        {**good, "samples": -1},
        {**good, "zzz": 1},
    ):
        with pytest.raises(DecodeError):
            decode_result(json.dumps(bad).encode())


# --- the selector ----------------------------------------------------------------------------------


def _ls(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def test_selector_matches_as_promql() -> None:
    sel = parse_selector('{__name__=~"DCGM_.*",gpu="3"}')
    assert sel(_ls(__name__="DCGM_FI_DEV_GPU_TEMP", gpu="3"))
    assert not sel(_ls(__name__="DCGM_FI_DEV_GPU_TEMP", gpu="2"))
    assert not sel(_ls(__name__="xDCGM_", gpu="3"))  # anchored
    sel = parse_selector("up{job!='kepler', instance!~\"a.*\" , }")
    assert sel(_ls(__name__="up", job="dcgm", instance="b:1"))
    assert not sel(_ls(__name__="up", job="kepler", instance="b:1"))
    assert not sel(_ls(__name__="up", job="dcgm", instance="a:1"))
    assert parse_selector('{a="x\\"y\\u00e9\\n"}').matchers[0].value == 'x"y\u00e9\n'
    # An absent label is "": gpu="" selects series without one.
    assert parse_selector('up{gpu=""}')(_ls(__name__="up"))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{}",
        '{gpu=""}',
        '{gpu=~".*"}',
        '{gpu="3"',
        '{gpu="3"}}',
        '{gpu=="3"}',
        '{gpu~"3"}',
        "{gpu=3}",
        '{1gpu="3"}',
        '{gpu="3\\q"}',
        '{gpu="3}',
        '{gpu=~"(?=x)"}',  # lookahead: RE2 refuses it
        '{gpu=~"a{2000}"}',
        '3up{a="b"}',
        'up{a="b"} or vector(1)',
        "{" + ",".join(f'l{i}="x"' for i in range(33)) + "}",
        '{a="' + "x" * 1100 + '"}',
    ],
)
def test_selector_parsing_is_strict(text: str) -> None:
    with pytest.raises(SelectorError):
        parse_selector(text)


# --- the backfiller, in process --------------------------------------------------------------------


def _scrape(ts: int, n: int) -> ShapedScrape:
    labels = [_ls(__name__="DCGM_FI_DEV_GPU_TEMP", gpu=str(g), job="dcgm") for g in range(4)]
    return ShapedScrape("dcgm", ts, labels, array("d", [n + g / 3 for g in range(4)]))


class _Sink:
    def __init__(self) -> None:
        self.batches: list[object] = []

    def append(self, batch: object) -> bytes:
        self.batches.append(batch)
        return b"x"  # the payload spooled


def _backfiller(
    tmp_path: Path, max_samples: int = 10_000, spool_max_age_ms: int = 0, scrapes: int = 20
) -> tuple[Backfiller, CommandInbox, _Sink, int]:
    from edge_relay.store.spool import Spool

    spool = Spool(str(tmp_path / "spool.db"))
    clock = [NOW]
    rec = FlightRecorder(
        spool.recorder,
        cluster="test",
        node=NODE,
        max_bytes=1 << 24,
        max_age_ms=0,
        interval_ms=1000,
        block_ms=4000,
        clock_ms=lambda: clock[0],
    )
    for i in range(scrapes):
        rec.record([_scrape(NOW + i * 1000, i)])
    metrics = RelayMetrics()
    inbox = CommandInbox("test", NODE, metrics)
    sink = _Sink()
    enc = BatchEncoder("test", NODE, max_bytes=400)  # tiny: a block is split into several batches
    bf = Backfiller(
        inbox,
        rec,
        sink,
        enc,
        metrics,
        step_seconds=0.05,
        max_samples=max_samples,
        spool_max_age_ms=spool_max_age_ms,
        clock_ms=lambda: NOW + max(20, scrapes) * 1000,
    )  # type: ignore[arg-type]
    return bf, inbox, sink, NOW


def test_backfiller_supplies_the_matched_range_and_reports_the_rest(tmp_path: Path) -> None:
    bf, inbox, sink, t0 = _backfiller(tmp_path)
    inbox.submit(_req(from_ms=t0 - 10_000, to_ms=t0 + 5500, ts_ms=t0 + 19_000, match='{gpu="3"}'))
    # A second request while one is waiting is refused at once.
    inbox.submit(_req(id="r2", ts_ms=t0 + 19_000))
    while bf.step() or bf.busy:
        pass
    results = [decode_result(p) for p in inbox.outgoing()]
    assert [(r.id, r.result) for r in results] == [("r2", "refused"), ("r1", "done")]
    assert "busy" in (results[0].reason or "")
    done = results[1]
    got = sorted(
        (ts, v)
        for b in sink.batches
        for blk in b.scrapes
        for ts, v in zip([blk.timestamp_ms] * len(blk.values), blk.values, strict=True)
    )  # type: ignore[attr-defined]
    assert got == [(t0 + i * 1000, i + 1.0) for i in range(6)]
    assert done.samples == 6 and done.series == 1 and done.batches == len(sink.batches) > 1
    assert (done.first_ms, done.last_ms) == (t0, t0 + 5000)
    assert done.missing == (MissingRange(t0 - 10_000, t0 - 1, "older_than_recorder"),)
    # A duplicate delivery of the answered request is not done twice.
    inbox.submit(_req(from_ms=t0 - 10_000, to_ms=t0 + 5500, ts_ms=t0 + 19_000, match='{gpu="3"}'))
    assert inbox.take() is None and not inbox.outgoing()
    # The slot is free again.
    inbox.submit(_req(id="r3", from_ms=t0, to_ms=t0 + 1000, ts_ms=t0 + 19_000, match="{gpu=~'[01]'}"))
    while bf.step() or bf.busy:
        pass
    (r3,) = [decode_result(p) for p in inbox.outgoing()]
    assert r3.result == "done" and r3.samples == 4 and r3.series == 2


def test_samples_the_spool_would_evict_at_once_are_reported_not_spooled(tmp_path: Path) -> None:
    """Backfilled rows carry their old timestamps: older than spool.max_age_seconds, retention would
    evict them in the same cycle and ledger them as lost. The part of the range within a tenth of that
    age of it is reported as out of reach instead, and the rest supplied."""
    bf, inbox, sink, t0 = _backfiller(tmp_path, spool_max_age_ms=10_000)  # "now" is t0 + 20 s
    horizon = t0 + 20_000 - 9_000
    inbox.submit(_req(from_ms=t0, to_ms=t0 + 19_000, ts_ms=t0 + 19_000, match='{gpu="0"}'))
    inbox.submit(_req(id="r2", from_ms=t0, to_ms=t0 + 5_000, ts_ms=t0 + 19_000))
    while bf.step() or bf.busy:
        pass
    done = decode_result(inbox.outgoing()[-1])
    assert done.result == "done" and done.missing == (MissingRange(t0, horizon - 1, "older_than_recorder"),)
    stamps = sorted(blk.timestamp_ms for b in sink.batches for blk in b.scrapes)  # type: ignore[attr-defined]
    assert stamps == list(range(horizon, t0 + 20_000, 1000))
    sink.batches.clear()
    inbox.submit(_req(id="r3", from_ms=t0, to_ms=t0 + 5_000, ts_ms=t0 + 19_000))
    while bf.step() or bf.busy:
        pass
    (all_old,) = [decode_result(p) for p in inbox.outgoing()]
    assert all_old.result == "done" and all_old.samples == 0 and not sink.batches
    assert all_old.missing == (MissingRange(t0, t0 + 5_000, "older_than_recorder"),)


@pytest.mark.parametrize("fault", ["bad_checksum", "evicted"])
def test_blocks_that_go_while_a_request_is_read_are_reported(tmp_path: Path, fault: str) -> None:
    """What was recorded when the request came but is gone when the reader reaches it (a block whose
    checksum fails is deleted; the backlog takes a block's room while a paced request runs) is in the
    result's missing ranges, not silently left out of a request reported complete."""
    import sqlite3

    bf, inbox, sink, t0 = _backfiller(tmp_path, scrapes=60)  # 15 blocks: two chunks of the reader
    db = sqlite3.connect(tmp_path / "spool.db", isolation_level=None)
    blocks = db.execute("SELECT id, first_ts_ms, last_ts_ms FROM recorder ORDER BY id").fetchall()
    assert len(blocks) > 8
    victim, first, last = blocks[-1]
    inbox.submit(_req(from_ms=t0, to_ms=t0 + 59_000, ts_ms=t0 + 59_000))
    bf.max_samples = 10_000
    bf.step_seconds = 0.0  # one batch a step: the request is read while the spool changes
    bf.step()
    if fault == "bad_checksum":
        db.execute("UPDATE recorder SET checksum = checksum + 1 WHERE id = ?", (victim,))
    else:
        db.execute("DELETE FROM recorder WHERE id = ?", (victim,))
    db.close()
    while bf.step() or bf.busy:
        pass
    (done,) = [decode_result(p) for p in inbox.outgoing()]
    got = sorted(blk.timestamp_ms for b in sink.batches for blk in b.scrapes)  # type: ignore[attr-defined]
    assert not any(first <= ts <= last for ts in got)
    assert MissingRange(first, min(last, t0 + 59_000), "not_recorded") in done.missing
    assert done.samples == 4 * len(got)


def test_backfiller_caps_samples_and_refuses_bad_requests(tmp_path: Path) -> None:
    bf, inbox, _, t0 = _backfiller(tmp_path, max_samples=30)
    inbox.submit(_req(from_ms=t0, to_ms=t0 + 19_000, ts_ms=t0 + 19_000))
    while bf.step() or bf.busy:
        pass
    (res,) = [decode_result(p) for p in inbox.outgoing()]
    assert res.result == "done" and res.samples <= 30
    assert res.missing[-1].reason == "sample_cap" and res.missing[-1].end_ms == t0 + 19_000
    assert res.missing[-1].start_ms == res.last_ms + 1000  # type: ignore[operator]
    for req, words in (
        (_req(id="a", ts_ms=t0 + 19_000, match="{gpu=}"), "expected a quoted value"),
        (_req(id="b", ts_ms=t0 - 700_000), "expired"),
        (_req(id="c", ts_ms=t0 + 19_000, node="other"), "not test/other"),
    ):
        inbox.submit(req)
        bf.step()
        (r,) = [decode_result(p) for p in inbox.outgoing()]
        assert r.result == "refused" and words in (r.reason or ""), r
    inbox.refuse(None, "malformed: not JSON")
    (r,) = [decode_result(p) for p in inbox.outgoing()]
    assert r.id is None and r.result == "refused"


def test_a_selector_that_matches_nothing_keeps_the_per_cycle_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step reads as many recorder blocks as its deadline allows, also when none of them holds a
    series the selector takes: the whole range was decoded in one step before, a scrape missed."""
    bf, inbox, sink, t0 = _backfiller(tmp_path, scrapes=400)  # 100 blocks of 4 cycles
    decoded: list[int] = []
    real_decode = FlightRecorder._decode

    def counting(self: FlightRecorder, block: object) -> object:
        decoded.append(1)
        return real_decode(self, block)  # type: ignore[arg-type]

    monkeypatch.setattr(FlightRecorder, "_decode", counting)
    ticks = iter(range(1_000_000))
    bf._monotonic = lambda: next(ticks) * 0.01  # each look at the clock: 10 ms of work
    bf.step_seconds = 0.05
    bf._clock_ms = lambda: t0 + 399_000
    inbox.submit(_req(from_ms=t0, to_ms=t0 + 399_000, ts_ms=t0 + 399_000, match='{__name__=~".*_none"}'))
    steps = []
    while bf.step() or bf.busy:
        steps.append(len(decoded))
        decoded.clear()
    assert len(steps) >= 15 and max(steps) <= 6, steps
    (done,) = [decode_result(p) for p in inbox.outgoing()]
    assert done.result == "done" and done.samples == 0 and not sink.batches


def test_an_answered_request_delivered_again_later_is_not_run_again(tmp_path: Path) -> None:
    """QoS 1 may deliver a request again after later ones were answered (a reconnect): it runs once."""
    bf, inbox, sink, t0 = _backfiller(tmp_path)
    for req_id in ("r1", "r2", "r3"):
        inbox.submit(_req(id=req_id, from_ms=t0, to_ms=t0 + 1000, ts_ms=t0 + 19_000))
        while bf.step() or bf.busy:
            pass
    assert [decode_result(p).id for p in inbox.outgoing()] == ["r1", "r2", "r3"]
    answered = len(sink.batches)
    inbox.submit(_req(id="r1", from_ms=t0, to_ms=t0 + 1000, ts_ms=t0 + 19_000))
    assert inbox.take() is None and not bf.step() and not inbox.outgoing()
    assert len(sink.batches) == answered


# --- the uplink's part, on a real broker ------------------------------------------------------------


def test_the_uplink_hands_requests_to_the_inbox_and_publishes_results(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    import paho.mqtt.client as mqtt

    from edge_relay.store.spool import Spool

    cfg = mqtt_settings(mosquitto.port, client_id="relay-bf", keepalive_seconds=3, inflight_batches=4)
    spool = Spool(str(tmp_path / "spool.db"))
    metrics = RelayMetrics()
    inbox = CommandInbox("test", NODE, metrics)
    uplink = spool_uplink(
        cfg, spool, cluster="test", node=NODE, live_window_s=1.0, metrics=metrics, commands=inbox
    )
    results: list[bytes] = []
    cloud = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="cloud-bf", protocol=mqtt.MQTTv5)
    cloud.on_message = lambda c, u, m: results.append(bytes(m.payload))
    cloud.connect("127.0.0.1", mosquitto.port)
    cloud.loop_start()
    cloud.subscribe(f"edgemetrics/v1/test/{NODE}/cmd_result", qos=1)
    uplink.start()
    try:
        assert uplink.connected_event.wait(10)
        time.sleep(0.3)  # the uplink's SUBSCRIBE is on its way with the CONNACK's turn
        cmd = f"edgemetrics/v1/test/{NODE}/cmd"
        cloud.publish(cmd, _wire(id="bad", from_ms=5, to_ms=1), qos=1)
        now = int(time.time() * 1000)
        cloud.publish(cmd, _wire(id="good", from_ms=now - 5000, to_ms=now - 1000, ts_ms=now), qos=1)
        wait_until(lambda: results, timeout=10, message="the refusal")
        (refusal,) = [decode_result(p) for p in results]
        assert (
            refusal.id == "bad" and refusal.result == "refused" and "bad_timestamp" in (refusal.reason or "")
        )
        wait_until(lambda: inbox.take() is not None, timeout=10, message="the good request in the inbox")
        inbox.answer(
            CommandResult("good", "test", NODE, "done", now, from_ms=now - 5000, to_ms=now - 1000), "done"
        )
        uplink.kick()
        wait_until(lambda: len(results) == 2, timeout=10, message="the result")
        assert decode_result(results[1]).id == "good"
        text = metrics.registry.get_sample_value
        assert text("edge_relay_commands_total", {"kind": "unknown", "result": "malformed"}) == 1
        assert text("edge_relay_commands_total", {"kind": "backfill", "result": "done"}) == 1
    finally:
        uplink.stop(0)
        cloud.disconnect()
        cloud.loop_stop()
        spool.close()


# --- end to end --------------------------------------------------------------------------------------

GPUS = 4
METRICS = ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE")


def _value(n: int, metric: int, gpu: int) -> float:
    # Distinct per request and series, with all 52 mantissa bits in use.
    return n * 1.1 + metric * 1000 + gpu / 3 + math.pi / 7


class _Served:
    def __init__(self) -> None:
        self.at: dict[int, float] = {}
        self.lock = threading.Lock()

    def body(self, n: int) -> str:
        with self.lock:
            self.at[n] = time.time()
        lines = []
        for m, name in enumerate(METRICS):
            lines.append(f"# TYPE {name} gauge")
            lines += [f'{name}{{gpu="{g}"}} {_value(n, m, g)!r}' for g in range(GPUS)]
        lines += ["# TYPE node_load1 gauge", f"node_load1 {n / 7!r}", ""]
        return "\n".join(lines)


@pytest.mark.timeout(90)
def test_backfill_returns_the_raw_samples_of_a_range_into_prometheus(
    tmp_path: Path, make_service: ServiceFactory
) -> None:
    broker = make_service(Mosquitto)
    prom = make_service(Prometheus)
    served = _Served()
    exporter = ScriptedExporter(served.body)
    budget = write_budget(
        tmp_path / "budget.yaml",
        bytes_per_second=4000,
        burst_bytes=None,
        batch_window_seconds=1,
        classes=[{"name": "health", "preset": "scrape-health"}, {"name": "rest", "resolution_seconds": 300}],
    )
    relay_cfg = relay_config(
        tmp_path,
        urls={"dcgm": exporter.url},
        mqtt_port=broker.port,
        budget_file=str(budget),
        recorder={"block_seconds": 3},
    )
    ingest_cfg = ingest_config(tmp_path, mqtt_port=broker.port, remote_write_url=prom.remote_write_url)
    ingest = program("cloud-ingest", "cloud_ingest.cli", ingest_cfg, tmp_path).start()
    relay = program("edge-relay", "edge_relay.cli", relay_cfg, tmp_path).start()
    try:
        wait_until(lambda: len(served.at) >= 14, timeout=40, message="14 scrapes")
        assert relay.alive(), relay.log_tail()
        with served.lock:
            at = dict(served.at)
        ns = sorted(at)
        # Boundaries half-way between scrapes: no sample sits near one.
        first_n, last_n = ns[2], ns[-4]
        t_from = int(min(at.values()) * 1000) - 60_000  # before the relay (and its recorder) ran
        t_mid = int((at[first_n - 1] + at[first_n]) / 2 * 1000)
        t_to = int((at[last_n] + at[last_n + 1]) / 2 * 1000)
        proc = subprocess.run(
            [sys.executable, "-m", "cloud_ingest.cli", "backfill", "--config", str(ingest_cfg),
             "--cluster", "test", "--node", NODE, "--from", str(t_from / 1000), "--to", str(t_to / 1000),
             "--match", '{__name__=~"DCGM_.*",gpu="3"}', "--wait", "30", "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr + relay.log_tail()
        res = decode_result(proc.stdout.strip().splitlines()[-1].encode())
        assert res.result == "done" and res.series == 2, res
        # What is older than the recorder is reported, up to the first recorded scrape.
        assert len(res.missing) == 1 and res.missing[0].reason == "older_than_recorder", res.missing
        assert res.missing[0].start_ms == t_from
        assert res.first_ms is not None and res.missing[0].end_ms == res.first_ms - 1
        # Expected: every scrape served in [first recorded, t_to], for gpu 3 of both metrics.
        want = {
            m: sorted(_value(n, m, 3) for n, t in at.items() if res.first_ms - 500 <= t * 1000 <= t_to)
            for m in range(len(METRICS))
        }
        assert res.samples == sum(len(v) for v in want.values())
        assert t_mid > res.first_ms  # the asked range begins before the recorded one

        def in_prometheus() -> dict[str, list[tuple[int, float]]]:
            raw = prom.raw_samples(f'{{__name__=~"DCGM_.*",node="{NODE}"}}', "10m", at=t_to / 1000)
            return {f"{dict(k)['__name__']}/{dict(k)['gpu']}": v for k, v in raw.items()}

        def arrived() -> bool:
            assert relay.alive(), relay.log_tail()
            got = in_prometheus()
            return all(len(got.get(f"{name}/3", [])) >= len(want[m]) for m, name in enumerate(METRICS))

        wait_until(arrived, timeout=30, interval=0.5, message="the backfilled samples in Prometheus")
        got = in_prometheus()
        for m, name in enumerate(METRICS):
            values = [v for ts, v in got[f"{name}/3"] if ts >= t_from]
            # Bit-exact, every raw sample of the range, nothing else (the coarse ones are raw samples too).
            assert sorted(values) == want[m], (name, values, want[m])
            for g in range(GPUS - 1):  # unmatched series: only the budget's coarse samples
                assert len(got.get(f"{name}/{g}", [])) <= 2, (name, g, got.get(f"{name}/{g}"))
    finally:
        relay.stop()
        ingest.stop()
        exporter.close()


def test_the_command_line_reads_times_and_prints_the_result() -> None:
    import argparse

    from cloud_ingest.commands.backfill import describe, parse_time

    assert parse_time("1764590400") == NOW
    assert parse_time("1764590400.25") == NOW + 250
    assert parse_time("2025-12-01T12:00:00Z") == NOW
    assert parse_time("2025-12-01T13:00:00+01:00") == NOW
    for bad in ("2025-12-01T12:00:00", "yesterday", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_time(bad)
    res = CommandResult(
        "a1", "test", NODE, "done", NOW, samples=3, series=1, batches=1, first_ms=NOW, last_ms=NOW + 2000,
        missing=(MissingRange(NOW - 5000, NOW - 1, "older_than_recorder"),),
    )  # fmt: skip
    text = describe(res)
    assert "3 samples of 1 series in 1 batches" in text
    assert (
        "missing: 2025-12-01T11:59:55.000+00:00 .. 2025-12-01T11:59:59.999+00:00: older_than_recorder" in text
    )
    refused = describe(
        CommandResult("a2", "test", NODE, "refused", NOW, reason="busy: request a1 is still running")
    )
    assert "refused" in refused and "busy" in refused
