"""Fault tests of the link (issue 3) on real mosquitto + real Prometheus (out-of-order window on).

Each test runs the whole product like ``test_e2e.py`` (simulator -> ``edge-relay run`` -> mosquitto ->
``cloud-ingest run`` -> Prometheus, 1 s scrapes), breaks one thing for a while, heals it, lets the
relay drain its spool, stops it with SIGTERM and then compares what Prometheus holds with what the
simulator served, sample by sample: 0 lost, 0 changed values, 0 extra, no duplicate timestamps.

Faults: the broker stopped or killed and restarted (with and without persistence); a silent partition
between relay and broker (``LinkProxy``: nothing is closed, only the keepalive can tell); the
ingester stopped, and SIGKILLed after Prometheus took a write but before the ack (``RemoteWriteProxy``'s
``after_forward`` hook); Prometheus stopped and restarted, and answering 500, 503 and 429 for a while.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from testkit.faultrun import (
    FAULT_SECONDS,
    KEEPALIVE_SECONDS,
    FaultRun,
    sleep_until,
)
from testkit.netfaults import LinkProxy, RemoteWriteProxy
from testkit.services import (
    LOOPBACK,
    Mosquitto,
    Prometheus,
    ServiceFactory,
    VictoriaMetrics,
)

# -- 1. broker stopped / killed and restarted -----------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("persistence", "graceful"),
    [(True, True), (False, True), (True, False)],
    ids=["persistent-stop", "volatile-stop", "persistent-kill"],
)
def test_broker_down_and_restarted_loses_nothing(
    make_service: ServiceFactory,
    prometheus: Prometheus,
    fault_run: Callable[..., FaultRun],
    persistence: bool,
    graceful: bool,
) -> None:
    # mosquitto saves its db only on a clean shutdown and every autosave_interval (default 30 min).
    broker = make_service(
        Mosquitto, persistence=persistence, extra_conf="autosave_interval 1" if persistence else ""
    )
    run = fault_run(broker_port=broker.port, remote_write_url=prometheus.remote_write_url)
    time.sleep(1.5)  # at least one autosave with the sessions and subscriptions in it
    down_until = time.monotonic() + FAULT_SECONDS
    if graceful:
        broker.stop()
    else:
        broker.kill()
    run.wait_disconnected(timeout=5)
    sleep_until(down_until)
    run.assert_alive()
    assert run.spool_rows() >= 5, "the relay must keep scraping and spooling while the broker is down"
    broker.restart()
    run.finish(prometheus)


# -- 2. silent partition between relay and broker ---------------------------------------------------------


@pytest.mark.timeout(180)
def test_silent_partition_noticed_by_keepalive_and_buffered(
    mosquitto: Mosquitto, prometheus: Prometheus, fault_run: Callable[..., FaultRun]
) -> None:
    proxy = LinkProxy(mosquitto.port)
    try:
        run = fault_run(
            broker_port=mosquitto.port,
            relay_broker_port=proxy.port,
            remote_write_url=prometheus.remote_write_url,
        )
        partition_s = 15.0  # more than twice the keepalive
        assert partition_s > 2 * KEEPALIVE_SECONDS
        heal_at = time.monotonic() + partition_s
        proxy.blackhole()
        # PINGREQ after one keepalive of silence, give up after another one; 3x plus slack as deadline.
        run.wait_disconnected(timeout=3 * KEEPALIVE_SECONDS + 3)
        sleep_until(heal_at)
        run.assert_alive()
        assert run.metric("edge_relay_mqtt_connected") == 0, "no CONNACK can come through the blackhole"
        assert run.spool_rows() >= 8, "the relay must buffer while partitioned"
        proxy.heal()
        run.finish(prometheus)
        assert proxy.connections >= 2, "the relay must have reconnected through the healed link"
    finally:
        proxy.close()


# -- 3. ingester down; ingester killed between write and ack ---------------------------------------------


@pytest.mark.timeout(180)
def test_ingester_down_for_a_while(
    mosquitto: Mosquitto, prometheus: Prometheus, fault_run: Callable[..., FaultRun]
) -> None:
    run = fault_run(broker_port=mosquitto.port, remote_write_url=prometheus.remote_write_url)
    assert run.ingest is not None
    back_at = time.monotonic() + FAULT_SECONDS
    code = run.ingest.stop()
    assert code == 0, f"cloud-ingest exited with {code} on SIGTERM:\n{run.ingest.log_tail()}"
    sleep_until(back_at)
    run.assert_alive()
    assert run.spool_rows() >= 5, "nothing can be acknowledged while the ingester is down"
    run.ingest.start()
    run.finish(prometheus)


@pytest.mark.timeout(180)
def test_ingester_killed_after_write_before_ack_replays_without_corruption(
    mosquitto: Mosquitto, prometheus: Prometheus, fault_run: Callable[..., FaultRun]
) -> None:
    proxy = RemoteWriteProxy(prometheus.remote_write_url)
    try:
        # Self-contained batches, so the replayed write is the same request byte for byte; a stream-coded
        # frame's replay after an ingester kill (need_state, re-sent self-contained) is
        # tests/system/test_stream_e2e.py::test_ingester_restarted_mid_chain's, sample by sample.
        run = fault_run(
            broker_port=mosquitto.port, remote_write_url=proxy.url, relay_options={"stream__enabled": False}
        )
        ingest = run.ingest
        assert ingest is not None
        killed = threading.Event()
        killed_body: list[str] = []
        kill_at = proxy.forwarded_ok() + 2

        def kill_between_write_and_ack(n: int, body: bytes) -> None:
            # Prometheus holds the samples; the ingester dies before it hears so, so before any ack.
            if n == kill_at:
                ingest.kill()  # SIGKILL to the process group, and reaped: dead when this returns
                killed_body.append(hashlib.sha256(body).hexdigest())
                killed.set()

        proxy.after_forward = kill_between_write_and_ack
        assert killed.wait(20), "the ingester did not write again"
        assert not proxy.hook_errors, proxy.hook_errors
        assert ingest.proc is not None and ingest.proc.returncode == -9
        time.sleep(3.0)  # batches pile up at the broker meanwhile
        run.assert_alive()
        ingest.start()  # a new ingester with the same configuration (client id, persistent session)
        run.finish(prometheus)
        # The write whose ack was lost was replayed (redelivered or republished) and written again.
        rewrites = sum(1 for e in proxy.history() if e.status // 100 == 2 and e.body_sha256 == killed_body[0])
        assert rewrites >= 2, "the batch written just before the kill was never written again"
    finally:
        proxy.close()


# -- 4. Prometheus down; Prometheus answering 500 / 503 / 429 ---------------------------------------------


@pytest.mark.timeout(180)
def test_prometheus_down_and_restarted(
    mosquitto: Mosquitto, prometheus: Prometheus, fault_run: Callable[..., FaultRun]
) -> None:
    run = fault_run(broker_port=mosquitto.port, remote_write_url=prometheus.remote_write_url)
    back_at = time.monotonic() + FAULT_SECONDS
    prometheus.stop()
    sleep_until(back_at)
    run.assert_alive()
    assert run.spool_rows() >= 5, "nothing can be acknowledged while Prometheus is down"
    prometheus.restart()  # same port, same data directory
    run.finish(prometheus)


@pytest.mark.timeout(180)
def test_prometheus_answering_500_503_429(
    mosquitto: Mosquitto, prometheus: Prometheus, fault_run: Callable[..., FaultRun]
) -> None:
    proxy = RemoteWriteProxy(prometheus.remote_write_url)
    try:
        run = fault_run(broker_port=mosquitto.port, remote_write_url=proxy.url)
        for status, retry_after in ((500, None), (503, None), (429, "1")):
            until = time.monotonic() + FAULT_SECONDS
            proxy.refuse(status, retry_after)
            sleep_until(until)
            run.assert_alive()
            assert proxy.count(status, "refuse") >= 3, f"the ingester hardly tried while refused {status}"
        assert run.spool_rows() >= 10, "nothing can be acknowledged while Prometheus refuses writes"
        proxy.forward()
        run.finish(prometheus)
    finally:
        proxy.close()


# -- the fault injector itself --------------------------------------------------------------------------


class _Upstream:
    """A stand-in remote-write receiver: records bodies, answers 204."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                upstream.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://{LOOPBACK}:{self.server.server_address[1]}/api/v1/write"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_remote_write_proxy_modes() -> None:
    upstream = _Upstream()
    replied: list[int] = []
    hooked: list[tuple[int, bytes, int]] = []
    proxy = RemoteWriteProxy(
        upstream.url, after_forward=lambda n, body: hooked.append((n, body, len(replied)))
    )
    try:
        assert proxy.url.endswith("/api/v1/write")

        def post(body: bytes) -> requests.Response:
            resp = requests.post(proxy.url, data=body, timeout=10)
            replied.append(resp.status_code)
            return resp

        assert post(b"one").status_code == 204
        assert upstream.bodies == [b"one"]
        assert hooked == [(1, b"one", 0)]  # called before the client had its answer

        proxy.refuse(429, retry_after="1")
        resp = post(b"two")
        assert (resp.status_code, resp.headers.get("Retry-After")) == (429, "1")
        proxy.refuse(500)
        assert post(b"three").status_code == 500
        assert upstream.bodies == [b"one"]

        proxy.hold()
        held = threading.Thread(target=post, args=(b"four",))
        held.start()
        time.sleep(0.3)
        assert held.is_alive() and upstream.bodies == [b"one"]
        proxy.release()
        held.join(5)
        assert not held.is_alive() and upstream.bodies == [b"one", b"four"]
        assert [e.status for e in proxy.history()] == [204, 429, 500, 204]
        assert proxy.count(429, "refuse") == 1 and proxy.forwarded_ok() == 2
        assert [n for n, _, _ in hooked] == [1, 2]
    finally:
        proxy.close()
        upstream.close()


# -- the same faults with VictoriaMetrics as the receiver ----------------------------------------------


@pytest.mark.timeout(180)
def test_victoriametrics_broker_restart_and_receiver_down(
    make_service: ServiceFactory,
    victoria_metrics: VictoriaMetrics,
    fault_run: Callable[..., FaultRun],
) -> None:
    broker = make_service(Mosquitto, persistence=True, extra_conf="autosave_interval 1")
    run = fault_run(broker_port=broker.port, remote_write_url=victoria_metrics.remote_write_url)
    time.sleep(1.5)
    down_until = time.monotonic() + FAULT_SECONDS
    broker.stop()
    run.wait_disconnected(timeout=5)
    sleep_until(down_until)
    broker.restart()
    # Then the receiver goes away (stopped, so what it already has is kept) and comes back.
    time.sleep(3)
    victoria_metrics.stop()
    time.sleep(FAULT_SECONDS)
    run.assert_alive()
    victoria_metrics.restart()
    run.finish(victoria_metrics)
