"""Order after an outage, against real Prometheus: live-first (with an out-of-order window) and strict
(a Prometheus without one). The writes reaching Prometheus are recorded by a proxy to check the order;
at the end Prometheus is compared with the simulator sample by sample, as in the fault tests."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import cramjam
import pytest

from schemas.remote_write_pb import WriteRequest
from testkit.faultrun import FAULT_SECONDS, FaultRun, sleep_until
from testkit.netfaults import RemoteWriteProxy
from testkit.services import Mosquitto, Prometheus, ServiceFactory


class Recorder:
    """Sample timestamps (min, max) of every write Prometheus accepted, in the order they arrived."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def __call__(self, n: int, body: bytes) -> None:
        request = WriteRequest.FromString(bytes(cramjam.snappy.decompress_raw(body)))
        stamps = [s.timestamp for ts in request.timeseries for s in ts.samples]
        with self._lock:
            self.writes.append((min(stamps), max(stamps)))

    def since(self, index: int) -> list[tuple[int, int]]:
        with self._lock:
            return list(self.writes[index:])


def outage(make_service: ServiceFactory, run: FaultRun, broker: Mosquitto) -> None:
    down_until = time.monotonic() + FAULT_SECONDS
    broker.stop()
    run.wait_disconnected(timeout=5)
    sleep_until(down_until)
    assert run.spool_rows() >= 5, "the relay must keep spooling while the broker is down"


@pytest.mark.timeout(180)
def test_live_first_sends_fresh_data_before_the_backlog(
    make_service: ServiceFactory, prometheus: Prometheus, fault_run: Callable[..., FaultRun]
) -> None:
    recorder = Recorder()
    proxy = RemoteWriteProxy(prometheus.remote_write_url, after_forward=recorder)
    broker = make_service(Mosquitto)
    run = fault_run(broker_port=broker.port, remote_write_url=proxy.url)
    outage(make_service, run, broker)
    before = len(recorder.since(0))
    broker.restart()
    run.finish(prometheus)  # nothing lost, nothing changed (Prometheus has a 2 h out-of-order window)
    after = recorder.since(before)
    # The first write after the link came back carries the freshest data: newer than backlog written
    # after it (live first), and the backlog itself went oldest-first.
    first_min, _ = after[0]
    later_backlog = [mx for mn, mx in after[1:] if mx < first_min]
    assert later_backlog, f"no backlog arrived after the first (fresh) write: {after[:6]}"
    starts = [mn for mn, mx in after[1:] if mx < first_min]
    assert starts == sorted(starts), "the backlog must drain oldest-first"
    proxy.close()


@pytest.mark.timeout(180)
def test_strict_order_fills_a_prometheus_without_out_of_order_window(
    make_service: ServiceFactory, fault_run: Callable[..., FaultRun]
) -> None:
    strict_prom = make_service(Prometheus, ooo_window=None)
    recorder = Recorder()
    proxy = RemoteWriteProxy(strict_prom.remote_write_url, after_forward=recorder)
    broker = make_service(Mosquitto)
    run = fault_run(
        broker_port=broker.port, remote_write_url=proxy.url, relay_options={"mqtt__order": "strict"}
    )
    outage(make_service, run, broker)
    before = len(recorder.since(0))
    broker.restart()
    run.finish(strict_prom)  # every sample, although this Prometheus refuses out-of-order data
    after = recorder.since(before)
    assert len(after) >= 5
    # Every write after the outage is newer than the one before it.
    for (_, prev_max), (next_min, _) in itertools.pairwise(after):
        assert next_min > prev_max, f"out of order: {after}"
    proxy.close()
