"""Issue 13's proof on real services: live mode's stream coding (wire format v3) loses no sample when
decoder state is lost.

Without a budget file the relay publishes every scrape cycle at once as a v3 frame coded against the
frame it published before (``docs/stream-codec.md``, ``edge_relay/uplink/stream.py``): a delta frame decodes
only on an ingester that holds its base state. An ingester lacking it acks ``need_state`` and the relay
publishes that batch again self-contained, its next frame being a key frame: losing state costs bytes,
never samples. Each scenario runs the product as operators do (simulator -> ``edge-relay run`` ->
mosquitto -> ``cloud-ingest run`` -> Prometheus) with the defaults of live mode (no budget file,
``stream.enabled`` left at its default; the ingesters' default share group, following on), scrapes
every 0.5 s, breaks state in one way, heals, stops the relay drained (SIGTERM, empty spool) and checks:

- Prometheus, scrape by scrape and sample by sample, bit-exact against what the simulator served
  (``testkit.oracle`` re-renders it): every served scrape is there whole at the timestamp the relay gave
  it, nothing extra, no timestamp twice; only where the relay was SIGKILLed may the scrape it had in
  hand be missing (it was never spooled);
- the relay's loss ledger is empty, no ingester dead-lettered or refused anything;
- the stream was really used (delta frames published) and ``need_state`` happened where the scenario
  forces it (relay ``edge_relay_stream_need_state_total``, ingester ``cloud_ingest_need_state_total``;
  the relay published self-contained again, and a key frame followed), and did not happen where no
  state was lost (churn). Where it may or may not happen (a broker restart, an outage: frames the broker
  dropped) it is only counted and printed.

Scenarios: (1) the ingester SIGKILLed and restarted mid-chain; (2) a second replica joining the share
group mid-chain (it never saw the key frame); (3) the broker SIGKILLed and restarted without
persistence; (4) the relay restarted (SIGTERM, SIGKILL) mid-chain with a backlog in its spool while
the ingester was down too; (5) churn: containers coming and going every few scrapes, short chains, two
replicas; (6) a short outage (persistent broker down for some scrapes), the backlog drained after.

One Prometheus serves the whole module (each scenario has its own node name, so its own series); the
broker, simulator and product processes are each scenario's own.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from testkit.oracle import Served, compare, expected_samples, read_served_log
from testkit.readings import MetricSample, read_metrics
from testkit.readings import metric_sum as metric
from testkit.services import Mosquitto, Prometheus, RawSamples, ServiceFactory, now_ms, wait_until
from testkit.stack import (
    EXPORTERS,
    Program,
    SimulatorProcess,
    ingest_config,
    ledger_totals,
    metrics_url,
    relay_config,
    spool_rows,
)
from testkit.stack import publish_probe_status as probe_status

pytestmark = pytest.mark.integration

CLUSTER = "test"  # relay_config's
PREFIX = "edgemetrics"  # both sides' default topic prefix
PROBE_NODE = "probe"
INTERVAL = 0.5  # scrape interval and simulator tick
SYNTHETIC = ("up", "scrape_duration_seconds", "scrape_samples_scraped")
# A served request belongs to the scrape the relay stamped when it sent it: at most this much earlier.
MAX_SKEW_MS = 450
# A SIGKILLed relay loses the cycle it had in hand (scraped, not yet spooled): served at most this long
# before the kill.
KILL_WINDOW_MS = 1500
# Chains longer than any scenario: a key frame the relay sends on its own schedule cannot hide a
# need_state. The churn scenario sets short chains instead.
LONG_CHAIN = 1000
ACK_TIMEOUT_SECONDS = 3.0
DRAIN_SECONDS = 20
MIN_SAMPLES = 3_000  # per scenario: a few seconds of the four exporters (~1 400 samples a cycle)

RELAY_NEED_STATE = "edge_relay_stream_need_state_total"
RELAY_FRAMES = "edge_relay_stream_frames_total"
INGEST_NEED_STATE = "cloud_ingest_need_state_total"


# ------------------------------------------------------------------------------------------ services


@pytest.fixture(scope="module")
def module_services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceFactory]:
    factory = ServiceFactory(tmp_path_factory.mktemp("stream-services"))
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.fixture(scope="module")
def prom(module_services: ServiceFactory) -> Prometheus:
    """One Prometheus for the module (out-of-order window on): scenarios differ by node name."""
    return module_services(Prometheus)


def publish_probe_status(broker: Mosquitto) -> None:
    probe_status(
        broker.host,
        broker.port,
        prefix=PREFIX,
        cluster=CLUSTER,
        node=PROBE_NODE,
        client_id="stream-e2e-probe",
    )


# ----------------------------------------------------------------------------------------- the stack


@dataclass
class Ingester:
    name: str
    program: Program
    metrics_url: str
    ended: list[list[MetricSample]] = field(default_factory=list)  # last reading of each ended process


class Stack:
    """Simulator, edge-relay and cloud-ingest replicas of one scenario around its broker and the
    module's Prometheus. Self-metrics are summed over every process of a program (a restarted process
    starts its counters at 0: the last reading of each ended one is kept)."""

    def __init__(
        self,
        tmp: Path,
        broker: Mosquitto,
        prometheus: Prometheus,
        *,
        node: str,
        seed: int,
        churn_ticks: int = 10,
        keyframe_every: int = LONG_CHAIN,
    ) -> None:
        self.tmp = tmp
        self.broker = broker
        self.prometheus = prometheus
        self.node = node
        self.started = time.monotonic()
        sim_dir = tmp / "sim"
        sim_dir.mkdir()
        self.sim = SimulatorProcess(sim_dir, seed=seed, interval=INTERVAL, churn_ticks=churn_ticks).start()
        self.relay_dir = tmp / "relay"
        self.relay_dir.mkdir()
        self.relay_cfg = relay_config(
            self.relay_dir,
            urls=self.sim.urls,
            mqtt_port=broker.port,
            interval=INTERVAL,
            node=node,
            mqtt__keepalive_seconds=3,
            mqtt__ack_timeout_seconds=ACK_TIMEOUT_SECONDS,
            mqtt__reconnect_min_seconds=0.2,
            mqtt__reconnect_max_seconds=1,
            stream__keyframe_every=keyframe_every,
        )
        self.spool_path = self.relay_dir / "spool.db"
        self.relay_url = metrics_url(self.relay_cfg)
        self.relay: Program | None = None
        self.relay_ended: list[list[MetricSample]] = []
        self.ingesters: dict[str, Ingester] = {}
        publish_probe_status(broker)

    # -- processes ------------------------------------------------------------------------------------

    def start_ingester(self, name: str) -> Ingester:
        """Start (or restart) replica ``name`` (client id ``name``, the default share group) and wait
        until it has subscribed."""
        ing = self.ingesters.get(name)
        if ing is None:
            workdir = self.tmp / name
            workdir.mkdir()
            cfg = ingest_config(
                workdir,
                mqtt_port=self.broker.port,
                remote_write_url=self.prometheus.remote_write_url,
                mqtt__client_id=name,
                mqtt__keepalive_seconds=3,
                mqtt__reconnect_min_seconds=0.2,
                mqtt__reconnect_max_seconds=1,
                remote_write__retry_min_seconds=0.1,
                remote_write__retry_max_seconds=1,
            )
            ing = self.ingesters[name] = Ingester(
                name,
                Program(
                    name,
                    [sys.executable, "-m", "cloud_ingest.cli", "run", "--config", str(cfg)],
                    workdir / f"{name}.log",
                ),
                metrics_url(cfg),
            )
        ing.program.start()
        self.wait_subscribed(ing)
        return ing

    def wait_subscribed(self, ing: Ingester, timeout: float = 20) -> None:
        def ready() -> bool:
            assert ing.program.alive(), f"{ing.name} exited:\n{ing.program.log_tail()}"
            return metric(self._read(ing.metrics_url), "cloud_ingest_node_online", node=PROBE_NODE) == 1

        wait_until(ready, timeout, 0.05, f"{ing.name} subscribed")

    def stop_ingester(self, name: str, *, kill: bool = False) -> None:
        ing = self.ingesters[name]
        ing.ended.append(self._read(ing.metrics_url))
        if kill:
            ing.program.kill()
            assert ing.program.proc is not None and ing.program.proc.returncode == -9
        else:
            code = ing.program.stop()
            assert code == 0, f"{name} exited with {code}:\n{ing.program.log_tail()}"

    def start_relay(self, drain_seconds: float = DRAIN_SECONDS) -> Program:
        self.relay = Program(
            "edge-relay",
            [
                sys.executable,
                "-m",
                "edge_relay.cli",
                "run",
                "--config",
                str(self.relay_cfg),
                "--drain-seconds",
                str(drain_seconds),
            ],
            self.relay_dir / "edge-relay.log",
        ).start()
        return self.relay

    def stop_relay(self, *, kill: bool = False) -> int:
        """SIGTERM (the relay drains for its --drain-seconds) or SIGKILL; returns the time of the
        signal (ms)."""
        relay = self.relay
        assert relay is not None and relay.alive(), self.relay_log()
        self.relay_ended.append(self._read(self.relay_url))
        at = now_ms()
        if kill:
            relay.kill()
            assert relay.proc is not None and relay.proc.returncode == -9
        else:
            code = relay.stop(timeout=DRAIN_SECONDS + 30)
            assert code == 0, f"edge-relay exited with {code}:\n{self.relay_log()}"
        return at

    def close(self) -> None:
        if self.relay is not None:
            self.relay.kill()
        for ing in self.ingesters.values():
            ing.program.kill()
        self.sim.stop()

    # -- readings -------------------------------------------------------------------------------------

    @staticmethod
    def _read(url: str) -> list[MetricSample]:
        try:
            return read_metrics(url, timeout=3)
        except requests.RequestException:
            return []

    def relay_metric(self, name: str, **labels: str) -> float:
        """Over every relay process of the scenario (the live one read now)."""
        readings = list(self.relay_ended)
        if self.relay is not None and self.relay.alive():
            readings.append(self._read(self.relay_url))
        return sum(metric(r, name, **labels) for r in readings)

    def live_relay_metric(self, name: str, **labels: str) -> float:
        assert self.relay is not None and self.relay.alive(), self.relay_log()
        return metric(self._read(self.relay_url), name, **labels)

    def ingest_metric(self, name: str, replica: str | None = None, **labels: str) -> float:
        total = 0.0
        for ing in self.ingesters.values():
            if replica is not None and ing.name != replica:
                continue
            readings = list(ing.ended)
            if ing.program.alive():
                readings.append(self._read(ing.metrics_url))
            total += sum(metric(r, name, **labels) for r in readings)
        return total

    def exported(self, name: str) -> bool:
        """Whether any process of the scenario exports a metric family called ``name``."""
        readings = list(self.relay_ended)
        if self.relay is not None and self.relay.alive():
            readings.append(self._read(self.relay_url))
        for ing in self.ingesters.values():
            readings += ing.ended
            if ing.program.alive():
                readings.append(self._read(ing.metrics_url))
        return any(n == name for r in readings for n, _, _ in r)

    def relay_log(self) -> str:
        return self.relay.log_tail(80) if self.relay is not None else "(relay never started)"

    def logs(self) -> str:
        parts = [f"--- edge-relay\n{self.relay_log()}"]
        parts += [f"--- {i.name}\n{i.program.log_tail(60)}" for i in self.ingesters.values()]
        return "\n".join(parts)

    # -- waits ----------------------------------------------------------------------------------------

    def wait_acked(self, more: int, timeout: float = 30) -> None:
        """Until the live relay has ``more`` batches acked ``ok`` beyond what it had."""
        base = self.live_relay_metric("edge_relay_batches_acked_total", result="ok")

        def acked() -> bool:
            return self.live_relay_metric("edge_relay_batches_acked_total", result="ok") >= base + more

        wait_until(acked, timeout, 0.1, f"{more} more batches acked ok\n{self.logs()}")

    def newest_scrape_ms(self, job: str) -> int:
        data = self.prometheus.raw_samples(f'up{{job="{job}",node="{self.node}"}}', lookback="10m")
        return max((t for samples in data.values() for t, _ in samples), default=0)

    def wait_caught_up(self, after_ms: int, timeout: float = 30) -> None:
        """Until the spool holds at most the live edge and Prometheus has, for every exporter, a scrape
        stamped after ``after_ms``."""

        def caught_up() -> bool:
            assert self.relay is not None and self.relay.alive(), self.relay_log()
            if self.live_relay_metric("edge_relay_spool_rows") > 2:
                return False
            return all(self.newest_scrape_ms(job) > after_ms for job in EXPORTERS)

        wait_until(caught_up, timeout, 0.2, f"caught up past {after_ms}\n{self.logs()}")

    def wait_chain_restarted(self, timeout: float = 20) -> None:
        """Until the relay has had a need_state and published a key frame besides its first one: a
        need_state restarts the chain at the next frame, which may come a cycle after catching up
        (the rows behind the need_state go again self-contained, not as frames)."""

        def restarted() -> bool:
            return (
                self.relay_metric(RELAY_NEED_STATE) >= 1 and self.relay_metric(RELAY_FRAMES, kind="key") >= 2
            )

        wait_until(restarted, timeout, 0.2, f"a key frame after need_state\n{self.relay_log()}")

    def run_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert self.relay is not None and self.relay.alive(), self.relay_log()
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    # -- the end --------------------------------------------------------------------------------------

    def finish(self, *, killed_at_ms: Sequence[int] = ()) -> Result:
        """Stop the relay drained (empty spool), then the replicas; check every end of the pipeline."""
        self.stop_relay()
        rows = spool_rows(self.spool_path)
        assert rows == 0, f"spool not drained: {rows} rows\n{self.relay_log()}"
        for name, ing in self.ingesters.items():
            if ing.program.alive():
                self.stop_ingester(name)
        result = self.check_prometheus(killed_at_ms)
        ledger = ledger_totals(self.relay_cfg)
        assert not any(ledger.values()), f"the loss ledger is not empty: {ledger}"
        for what, value in (
            ("relay acks rejected", self.relay_metric("edge_relay_batches_acked_total", result="rejected")),
            ("relay acks partial", self.relay_metric("edge_relay_batches_acked_total", result="partial")),
            ("dead letters", self.ingest_metric("cloud_ingest_dead_letters_total")),
            ("batches refused", self.ingest_metric("cloud_ingest_batches_refused_total")),
            ("messages refused", self.ingest_metric("cloud_ingest_messages_total", outcome="refused")),
            ("messages rejected", self.ingest_metric("cloud_ingest_messages_total", outcome="rejected")),
        ):
            assert value == 0, f"{what}: {value}\n{self.logs()}"
        # Really stream-coded: delta frames went out (v2 mode would prove nothing about state).
        assert self.exported(RELAY_FRAMES), f"the relay exports no {RELAY_FRAMES}"
        result.delta_frames = self.relay_metric(RELAY_FRAMES, kind="delta")
        result.key_frames = self.relay_metric(RELAY_FRAMES, kind="key")
        result.self_contained = self.relay_metric(RELAY_FRAMES, kind="batch")
        assert result.delta_frames > 0, f"no delta frame was published:\n{self.relay_log()}"
        result.relay_need_state = self.relay_metric(RELAY_NEED_STATE)
        assert self.exported(INGEST_NEED_STATE), f"no ingester exports {INGEST_NEED_STATE}"
        result.ingest_need_state = self.ingest_metric(INGEST_NEED_STATE)
        result.seconds = time.monotonic() - self.started
        return result

    def check_prometheus(self, killed_at_ms: Sequence[int]) -> Result:
        served = read_served_log(self.sim.served_log)
        assert {s.exporter for s in served} == set(EXPORTERS)
        actual = self.prometheus.raw_samples(f'{{instance=~"{self.node}:.+"}}', lookback="10m")
        repeated = [
            f"{dict(k).get('__name__')} {dict(k)}"
            for k, v in actual.items()
            if any(a >= b for (a, _), (b, _) in itertools.pairwise(v))
        ]
        assert not repeated, "repeated or unordered timestamps:\n" + "\n".join(repeated[:10])

        # Each served request <-> the scrape the relay stamped it with: that scrape's `up` sample.
        ups: dict[str, list[tuple[int, float]]] = {}
        for key, samples in actual.items():
            labels = dict(key)
            if labels["__name__"] == "up":
                ups[labels["job"]] = samples
        problems: list[str] = []
        matched: list[tuple[Served, int]] = []
        lost: list[Served] = []
        for job in EXPORTERS:
            failed = [t for t, v in ups.get(job, []) if v != 1.0]
            if failed:
                problems.append(f"{job}: failed scrapes (up != 1) at {failed[:5]}")
            stamps = [t for t, v in ups.get(job, []) if v == 1.0]
            used: set[int] = set()
            last = -1
            for rec in sorted((r for r in served if r.exporter == job), key=lambda r: r.t_ms):
                fits = [t for t in stamps if last < t <= rec.t_ms and rec.t_ms - t <= MAX_SKEW_MS]
                if fits:
                    last = fits[-1]
                    used.add(last)
                    matched.append((rec, last))
                else:
                    lost.append(rec)
            extra = sorted(set(stamps) - used)
            if extra:
                problems.append(f"{job}: scrapes in Prometheus the simulator did not serve: {extra[:5]}")
        unexplained = [
            r for r in lost if not any(k - KILL_WINDOW_MS <= r.t_ms <= k + 100 for k in killed_at_ms)
        ]
        if unexplained:
            problems.append(
                f"{len(unexplained)} served scrapes missing from Prometheus: "
                + ", ".join(f"{r.exporter}@{r.t_ms} (tick {r.tick})" for r in unexplained[:12])
            )
        stamp = {(r.exporter, r.t_ms): t for r, t in matched}
        instances = {e: f"{self.node}:{url.split(':')[2].split('/')[0]}" for e, url in self.sim.urls.items()}
        expected: RawSamples = {}
        for key, samples in expected_samples(
            self.sim.simulator,
            [r for r, _ in matched],
            jobs={e: e for e in EXPORTERS},
            instances=instances,
            extra={"cluster": CLUSTER, "node": self.node},
        ).items():
            job = dict(key)["job"]
            expected[key] = sorted((stamp[(job, t)], v) for t, v in samples)
        real = {k: v for k, v in actual.items() if dict(k)["__name__"] not in SYNTHETIC}
        problems += compare(expected, real, max_skew_ms=0)
        for name in SYNTHETIC:  # every scrape whole: its synthetic series at its timestamp too
            for job in EXPORTERS:
                got = {
                    t
                    for k, v in actual.items()
                    if dict(k)["__name__"] == name and dict(k)["job"] == job
                    for t, _ in v
                }
                want = {t for r, t in matched if r.exporter == job}
                if got != want:
                    problems.append(f"{job}: {name} at {len(got)} timestamps, {len(want)} scrapes matched")
        assert not problems, "\n".join(problems[:30]) + f"\n{self.logs()}"
        n = sum(len(v) for v in expected.values())
        assert n >= MIN_SAMPLES, f"only {n} samples compared: the scenario would prove little"
        return Result(samples=n, scrapes=len(matched), lost_to_kill=len(lost))


@dataclass
class Result:
    samples: int
    scrapes: int
    lost_to_kill: int
    delta_frames: float = 0
    key_frames: float = 0
    self_contained: float = 0  # publications of the spooled batch as it is (after need_state)
    relay_need_state: float = 0
    ingest_need_state: float = 0
    seconds: float = 0

    def __str__(self) -> str:
        return (
            f"{self.samples} samples in {self.scrapes} scrapes bit-exact ({self.lost_to_kill} lost to "
            f"SIGKILL); frames delta {self.delta_frames:.0f} key {self.key_frames:.0f}, self-contained "
            f"{self.self_contained:.0f}; need_state relay "
            f"{self.relay_need_state:.0f} ingesters {self.ingest_need_state:.0f}; {self.seconds:.1f}s"
        )


@pytest.fixture
def stack(
    request: pytest.FixtureRequest, tmp_path: Path, make_service: ServiceFactory, prom: Prometheus
) -> Iterator[Any]:
    """``stack(node=..., seed=..., broker=...)``: a scenario's stack, reaped (with its logs printed if
    the test failed) before the services."""
    made: list[Stack] = []
    failed_before = request.session.testsfailed

    def make(*, broker: Mosquitto | None = None, **kwargs: Any) -> Stack:
        st = Stack(tmp_path, broker or make_service(Mosquitto), prom, **kwargs)
        made.append(st)
        return st

    yield make
    for st in made:
        st.close()
        if request.session.testsfailed > failed_before:
            print(st.logs())


def _assert_need_state(st: Stack, result: Result, *, replica: str | None = None) -> None:
    """The scenario forced it: some replica acked need_state, and the relay re-sent self-contained."""
    forced = st.ingest_metric(INGEST_NEED_STATE, replica)
    assert forced >= 1, f"no need_state from {replica or 'any replica'} ({result})\n{st.logs()}"
    assert result.relay_need_state >= 1, f"the relay counted no need_state ack ({result})\n{st.relay_log()}"
    assert result.self_contained >= 1, f"nothing was published again self-contained ({result})"
    # After a need_state the chain restarts: a key frame besides the first one.
    assert result.key_frames >= 2, f"no key frame after need_state ({result})"


# ---------------------------------------------------------------------------------------- scenarios


@pytest.mark.timeout(90)
def test_ingester_restarted_mid_chain(stack: Any) -> None:
    st: Stack = stack(node="stream-ingest-restart", seed=21)
    st.start_ingester("ingest-0")
    st.start_relay()
    st.wait_acked(4)  # mid-chain: every frame after the first is a delta frame
    st.stop_ingester("ingest-0", kill=True)  # its decoder state is gone; its session keeps deliveries
    time.sleep(1.0)
    st.start_ingester("ingest-0")
    restarted_ms = now_ms()
    st.wait_caught_up(restarted_ms + 1000)
    st.wait_chain_restarted()
    result = st.finish()
    print(f"\ningester restarted mid-chain: {result}")
    _assert_need_state(st, result)


@pytest.mark.timeout(90)
def test_second_replica_joins_share_group_mid_chain(stack: Any) -> None:
    st: Stack = stack(node="stream-second-replica", seed=22)
    st.start_ingester("ingest-0")
    st.start_relay()
    st.wait_acked(4)  # the key frame and the dictionary are long gone when the second one joins
    joined_ms = now_ms()
    st.start_ingester("ingest-1")

    def second_wrote() -> bool:
        return st.ingest_metric("cloud_ingest_batches_written_total", "ingest-1", node=st.node) >= 3

    wait_until(second_wrote, 20, 0.2, f"the second replica writing batches\n{st.logs()}")
    st.wait_caught_up(joined_ms + 1000)
    st.wait_chain_restarted()
    result = st.finish()
    per_replica = {
        name: st.ingest_metric("cloud_ingest_batches_written_total", name, node=st.node)
        for name in st.ingesters
    }
    print(f"\nsecond replica joined mid-chain: {result}; batches written per replica {per_replica}")
    assert all(n > 0 for n in per_replica.values()), per_replica
    _assert_need_state(st, result, replica="ingest-1")


@pytest.mark.timeout(90)
def test_broker_restarted_without_persistence(stack: Any, make_service: ServiceFactory) -> None:
    broker = make_service(Mosquitto, persistence=False)
    st: Stack = stack(node="stream-broker-volatile", seed=23, broker=broker)
    st.start_ingester("ingest-0")
    st.start_relay()
    st.wait_acked(4)
    keys_before = st.live_relay_metric(RELAY_FRAMES, kind="key")
    broker.kill()  # sessions, queued deliveries, retained messages: all gone
    time.sleep(1.5)
    broker.restart()
    healed_ms = now_ms()
    publish_probe_status(broker)
    st.wait_subscribed(st.ingesters["ingest-0"])
    st.wait_caught_up(healed_ms + 1000)
    keys_after = st.live_relay_metric(RELAY_FRAMES, kind="key")
    result = st.finish()
    print(f"\nbroker restarted without persistence: {result}")
    # A new MQTT session starts a new chain.
    assert keys_after > keys_before, f"no key frame after the new session ({result})\n{st.relay_log()}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("signal", ["sigterm", "sigkill"])
def test_relay_restarted_mid_chain_replays_backlog(stack: Any, signal: str) -> None:
    kill = signal == "sigkill"
    st: Stack = stack(node=f"stream-relay-{signal}", seed=24)
    st.start_ingester("ingest-0")
    st.start_relay(drain_seconds=1)  # SIGTERM: the drain gives up at once, the backlog stays spooled
    st.wait_acked(4)
    st.stop_ingester("ingest-0")  # nothing is acked any more: a backlog of the relay's chain builds
    wait_until(lambda: spool_rows(st.spool_path) >= 4, 15, 0.1, "a backlog in the spool")
    stopped_ms = st.stop_relay(kill=kill)
    backlog = spool_rows(st.spool_path)
    assert backlog >= 4, backlog
    # The ingester comes back first, without state: the old chain's frames the broker kept for its
    # session can only be answered need_state, which waits in the relay's session meanwhile.
    st.start_ingester("ingest-0")
    time.sleep(0.5)
    st.start_relay()
    restarted_ms = now_ms()
    st.wait_caught_up(restarted_ms + 1000)
    keys_new_process = st.live_relay_metric(RELAY_FRAMES, kind="key")
    result = st.finish(killed_at_ms=[stopped_ms] if kill else ())
    print(f"\nrelay {signal} with {backlog} spooled batches: {result}")
    assert keys_new_process >= 1, "the restarted relay did not start its chain with a key frame"
    if not kill:
        assert result.lost_to_kill == 0
    _assert_need_state(st, result)


@pytest.mark.timeout(90)
def test_churn_every_few_scrapes_two_replicas(stack: Any) -> None:
    st: Stack = stack(node="stream-churn", seed=25, churn_ticks=2, keyframe_every=5)
    st.start_ingester("ingest-0")
    st.start_ingester("ingest-1")
    st.start_relay()
    st.wait_acked(16)  # ~8 s: three chains and more, a dictionary that changes in most frames
    result = st.finish()
    stale = st.relay_metric("edge_relay_stale_markers_total")
    per_replica = {
        name: st.ingest_metric("cloud_ingest_batches_written_total", name, node=st.node)
        for name in st.ingesters
    }
    print(f"\nchurn: {result}; {stale:.0f} stale markers; batches written per replica {per_replica}")
    assert stale > 0, "no series went away: the scenario has no churn"
    assert all(n > 0 for n in per_replica.values()), per_replica
    assert result.key_frames >= 3, f"short chains expected ({result})"
    # Both replicas saw every frame from the first key frame on (following): nothing to ask for.
    assert result.ingest_need_state == 0 and result.relay_need_state == 0, f"{result}\n{st.logs()}"


@pytest.mark.timeout(90)
def test_short_outage_backlog_drained(stack: Any, make_service: ServiceFactory) -> None:
    broker = make_service(Mosquitto, persistence=True, extra_conf="autosave_interval 1")
    st: Stack = stack(node="stream-outage", seed=26, broker=broker)
    st.start_ingester("ingest-0")
    st.start_relay()
    st.wait_acked(4)
    time.sleep(1.2)  # an autosave with the sessions in it
    broker.stop()
    down_ms = now_ms()
    wait_until(lambda: spool_rows(st.spool_path) >= 6, 15, 0.1, "a backlog while the broker is down")
    broker.restart()
    st.wait_caught_up(now_ms() + 1000)
    result = st.finish()
    print(f"\nshort outage (broker down from {down_ms}): {result}")
