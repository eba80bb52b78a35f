"""A rollout of the edge DaemonSet in the middle of an outage loses nothing.

The manifests keep the spool in a directory of the node (a ``hostPath``), so a rollout replaces the
relay's process, not its spool: the old pod's relay stops (SIGTERM, as the kubelet stops a container,
or SIGKILL, as an eviction past its grace period or a crashed node does) and the new pod's relay starts
on the same directory. This runs exactly that with the real programs while the broker is down: simulator
-> ``edge-relay run`` -> (mosquitto, stopped) ... replaced relay on the same spool ... mosquitto back ->
``cloud-ingest run`` -> Prometheus, then compares Prometheus with what the simulator served, sample by
sample (``FaultRun.finish``: 0 lost, 0 changed, 0 extra, no duplicate timestamps).
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.faultrun import DRAIN_SECONDS, FAULT_SECONDS, FaultRun, spool_file_rows
from testkit.oracle import read_served_log
from testkit.services import Mosquitto, Prometheus, ServiceFactory, wait_until


@pytest.fixture
def broker_and_run(
    tmp_path: Path, make_service: ServiceFactory, prometheus: Prometheus
) -> Iterator[tuple[Mosquitto, FaultRun]]:
    broker = make_service(Mosquitto, persistence=True, extra_conf="autosave_interval 1")
    run = FaultRun(tmp_path, broker_port=broker.port, remote_write_url=prometheus.remote_write_url)
    try:
        yield broker, run.start()
    finally:
        run.close()


def between_cycles(run: FaultRun) -> None:
    """Sleep until half way between two scrape cycles (1 s apart): a cycle's batch is in the spool then,
    so a process killed at that instant has nothing in its hands that the spool does not hold."""
    last = read_served_log(run.sim.served_log)[-1].t_ms
    phase_ms = (int(time.time() * 1000) - last) % 1000
    time.sleep(((500 - phase_ms) % 1000) / 1000)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_rollout_mid_outage_loses_nothing(
    prometheus: Prometheus, broker_and_run: tuple[Mosquitto, FaultRun], stop_signal: signal.Signals
) -> None:
    broker, run = broker_and_run
    time.sleep(1.5)  # one broker autosave with the sessions in it
    broker.stop()
    run.wait_disconnected(timeout=5)
    time.sleep(FAULT_SECONDS / 2)
    backlog = run.spool_rows()
    assert backlog >= 3, "the relay must keep spooling while the broker is down"

    # The rollout: the old pod's relay goes ...
    old = run.relay
    assert old is not None
    between_cycles(run)
    if stop_signal == signal.SIGTERM:
        code = old.stop(timeout=DRAIN_SECONDS + 30)
        assert code == 0, f"edge-relay exited with {code} on SIGTERM:\n{old.log_tail()}"
    else:
        old.kill()
    kept = spool_file_rows(run.spool_path)
    assert kept >= backlog, "the backlog must stay in the node's spool directory"

    # ... and the new pod's relay starts on the same directory, still in the outage.
    run.relay = dataclasses.replace(old, proc=None).start()
    wait_until(lambda: (run.metric("edge_relay_spool_rows") or 0) > kept, 30, 0.2, "the new relay spooling")
    time.sleep(FAULT_SECONDS / 2)
    run.assert_alive()

    # The broker comes back: the new relay ships both lives' backlog; every sample is in Prometheus.
    broker.restart()
    total = run.finish(prometheus)
    print(f"\nrollout ({stop_signal.name}) mid-outage: {kept} spool rows carried over, {total} samples")
