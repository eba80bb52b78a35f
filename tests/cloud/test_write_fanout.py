"""Several remote-write targets (``remote_write`` as a list): every sample in each, a batch acked only
when every required target has it, an optional target never holding the acknowledgement.

Two real receivers at once: a Prometheus behind TLS, client certificates and basic auth, and a plain one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_write_auth import batch_now, stored, target, write_config

# Fixtures, asked for by their pytest names: pki, guarded.
from test_write_auth import guarded as guarded
from test_write_auth import pki as pki

from cloud_ingest import settings as settings_mod
from cloud_ingest.app import Ingester
from cloud_ingest.commands import checkconfig
from cloud_ingest.sinks.fanout import FanOutSink
from relay_common.config import ConfigError
from testkit.pki import Pki
from testkit.services import Prometheus, free_port


def load(tmp_path: Path, targets: list[dict[str, Any]]) -> Ingester:
    path = write_config(tmp_path, {"url": "http://unused"})
    config = yaml.safe_load(path.read_text())
    retry = {"max_retry_seconds": 1, "retry_min_seconds": 0.05, "retry_max_seconds": 0.2}
    config["remote_write"] = [retry | t for t in targets]
    path.write_text(yaml.safe_dump(config))
    return Ingester(settings_mod.load(str(path)))


@pytest.mark.integration
def test_two_receivers_get_every_sample_and_one_down_holds_the_ack_until_it_is_back(
    tmp_path: Path, guarded: Prometheus, prometheus: Prometheus, pki: Pki
) -> None:
    password = tmp_path / "password"
    password.write_text("right-password")
    ingester = load(
        tmp_path, [target(guarded, pki, password) | {"name": "guarded"}, {"url": prometheus.remote_write_url}]
    )
    try:
        assert isinstance(ingester.sink, FanOutSink)
        for seq in (1, 2, 3):
            result = ingester.sink.write(batch_now(seq, f"rw_fanout_{seq}"))
            assert (result.status, result.written) == ("done", 6)
        for prom in (guarded, prometheus):
            assert [stored(prom, f"rw_fanout_{seq}") for seq in (1, 2, 3)] == [6, 6, 6]

        prometheus.stop()
        down = ingester.sink.write(batch_now(4, "rw_fanout_4"))
        assert down.status == "retry_later" and "127.0.0.1" in down.retry_reason
        assert stored(guarded, "rw_fanout_4") == 6  # the other target still got it

        prometheus.restart()
        again = ingester.sink.write(batch_now(4, "rw_fanout_4"))  # the edge publishes it again
        assert (again.status, again.written) == ("done", 6)
        assert stored(prometheus, "rw_fanout_4") == 6
        assert stored(guarded, "rw_fanout_4") == 6
    finally:
        ingester.sink.close()
        ingester.dead_letters.close()


@pytest.mark.integration
def test_an_optional_target_down_never_holds_the_ack(tmp_path: Path, prometheus: Prometheus) -> None:
    dead = f"http://127.0.0.1:{free_port()}/api/v1/write"
    ingester = load(
        tmp_path,
        [
            {"url": prometheus.remote_write_url},
            {"url": dead, "required": False, "max_retry_seconds": 30, "queue_batches": 1},
        ],
    )
    try:
        started = time.monotonic()
        for seq in (1, 2):
            result = ingester.sink.write(batch_now(seq, "rw_fanout_optional"))
            assert result.status == "done"
        assert time.monotonic() - started < 5  # not waiting out the optional target's 30 s of retries
        assert stored(prometheus, "rw_fanout_optional") == 6
        # Its queue holds one batch (the first, being retried): the second is dropped for it, counted.
        dropped = ingester.metrics.registry.get_sample_value(
            "cloud_ingest_remote_write_target_dropped_batches_total", {"target": dead.split("/")[2]}
        )
        assert dropped == 1
    finally:
        ingester.stopping.set()
        ingester.sink.close()
        ingester.dead_letters.close()


def test_the_single_mapping_form_keeps_working_and_is_the_first_target(tmp_path: Path) -> None:
    s = settings_mod.load(str(write_config(tmp_path, {"url": "http://a:9090/api/v1/write"})))
    assert [(t.name, t.url, t.required) for t in s.remote_write_targets] == [
        ("a:9090", "http://a:9090/api/v1/write", True)
    ]
    assert s.remote_write_url == "http://a:9090/api/v1/write"


def test_list_errors_name_the_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = "http://a:9090/api/v1/write", "http://b:9090/api/v1/write"
    with pytest.raises(ConfigError, match=r"remote_write\[1\]\.basic_auth"):
        load(
            tmp_path,
            [{"url": a}, {"url": b, "basic_auth": {"username": "u", "password": "p", "password_file": "/f"}}],
        )
    with pytest.raises(ConfigError, match=r"remote_write\[1\]\.tls_config\.ca_file`: .*/nonexistent"):
        path = write_config(tmp_path, {"url": a})
        config = yaml.safe_load(path.read_text())
        config["remote_write"] = [{"url": a}, {"url": b, "tls_config": {"ca_file": "/nonexistent"}}]
        path.write_text(yaml.safe_dump(config))
        checkconfig.validate(settings_mod.load(str(path)))
    with pytest.raises(ConfigError, match="no target is required"):
        load(tmp_path, [{"url": a, "required": False}])
    with pytest.raises(ConfigError, match=r"remote_write\[1\]\.name"):
        load(tmp_path, [{"url": a, "name": "x"}, {"url": b, "name": "x"}])
    with pytest.raises(ConfigError, match=r"remote_write\[0\]"):
        load(tmp_path, [{"url": a, "nonsense": 1}])
    monkeypatch.setenv("CLOUD_INGEST_REMOTE_WRITE_URL", "http://c:9090/api/v1/write")
    ingester = load(tmp_path, [{"url": a}, {"url": a}])
    try:
        targets = ingester.settings.remote_write_targets
        assert [(t.name, t.url) for t in targets] == [("c:9090", "http://c:9090/api/v1/write"), ("a:9090", a)]
    finally:
        ingester.sink.close()
        ingester.dead_letters.close()
