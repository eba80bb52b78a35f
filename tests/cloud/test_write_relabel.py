"""``write_relabel_configs`` per remote-write target (Prometheus semantics): each target's copy of a batch
is relabeled on its own, a series the rules drop counts as written, another target gets the batch as it
came. Against two real Prometheus receivers at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from test_write_auth import batch_now, write_config

from cloud_ingest import settings as settings_mod
from cloud_ingest.app import Ingester
from relay_common.config import ConfigError
from testkit.rw_mock import MockReceiver

# Fixture, asked for by its pytest name: receiver.
from testkit.rw_mock import receiver_fixture as receiver_fixture
from testkit.services import Prometheus, ServiceFactory

RULES = [
    {"source_labels": ["idx"], "regex": "0", "action": "drop"},
    {"target_label": "written_to", "replacement": "relabeled"},
    {"action": "labeldrop", "regex": "node"},
]


def load(tmp_path: Path, targets: list[dict[str, Any]]) -> Ingester:
    path = write_config(tmp_path, {"url": "http://unused"})
    config = yaml.safe_load(path.read_text())
    config["remote_write"] = targets if len(targets) > 1 else targets[0]
    path.write_text(yaml.safe_dump(config))
    return Ingester(settings_mod.load(str(path)))


@pytest.mark.integration
def test_each_target_gets_its_own_relabeled_copy_and_dropped_series_count_as_written(
    tmp_path: Path, prometheus: Prometheus, make_service: ServiceFactory
) -> None:
    other = make_service(Prometheus)
    ingester = load(
        tmp_path,
        [
            {"url": prometheus.remote_write_url, "write_relabel_configs": RULES},
            {"url": other.remote_write_url},
        ],
    )
    try:
        result = ingester.sink.write(batch_now(1, "rw_relabel"))
        assert (result.status, result.written) == ("done", 6)  # 2 samples dropped by the rules, counted
    finally:
        ingester.sink.close()
        ingester.dead_letters.close()
    relabeled = prometheus.raw_samples("rw_relabel")
    assert sorted(dict(k)["idx"] for k in relabeled) == ["1", "2"]
    for key, samples in relabeled.items():
        labels = dict(key)
        assert labels["written_to"] == "relabeled" and "node" not in labels
        assert len(samples) == 2
    untouched = other.raw_samples("rw_relabel")
    assert sorted(dict(k)["idx"] for k in untouched) == ["0", "1", "2"]
    assert all("written_to" not in dict(k) and dict(k)["node"] == "n1" for k in untouched)


def test_a_batch_the_rules_drop_entirely_is_done_without_a_request(
    tmp_path: Path, receiver: MockReceiver
) -> None:
    drop_all = [{"source_labels": ["__name__"], "regex": "rw_.*", "action": "drop"}]
    ingester = load(tmp_path, [{"url": receiver.url, "write_relabel_configs": drop_all}])
    try:
        result = ingester.sink.write(batch_now(1))
        assert (result.status, result.written, result.refused) == ("done", 6, None)
        assert receiver.received == []
    finally:
        ingester.sink.close()
        ingester.dead_letters.close()


def test_a_rule_prometheus_refuses_is_refused_at_load_naming_the_key(tmp_path: Path) -> None:
    bad = [{"action": "hashmod", "target_label": "shard"}]  # no modulus
    with pytest.raises(ConfigError, match=r"remote_write\[1\]\.write_relabel_configs\[0\]"):
        load(tmp_path, [{"url": "http://a:1/w"}, {"url": "http://b:1/w", "write_relabel_configs": bad}])
