"""Dead letters can be listed and replayed from the CLI once the receiver can take them."""

from __future__ import annotations

import subprocess
import sys
import time
from array import array
from pathlib import Path

import yaml

from cloud_ingest.outcome.deadletters import DeadLetterStore
from schemas import codec, topics
from schemas.model import Batch, ScrapeBlock
from testkit.services import Prometheus


def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cloud_ingest.cli", "dead-letters", "--config", str(config), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_replay_writes_and_removes_dead_letters(tmp_path: Path, prometheus: Prometheus) -> None:
    now_ms = int(time.time() * 1000)
    labels = (("__name__", "replayed_metric"), ("job", "kepler"), ("node", "edge-1"))
    batch = Batch("c1", "edge-1", 7, [labels], [ScrapeBlock(now_ms, array("I", [0]), array("d", [42.5]))])
    store_path = tmp_path / "dl.db"
    store = DeadLetterStore(store_path)
    good = store.put(
        topics.batch_topic("edgemetrics", "c1", "edge-1"),
        codec.encode_batch(batch),
        "HTTP 500: too old sample",
        cluster="c1",
        node="edge-1",
        seq=7,
    )
    bad = store.put(
        "edgemetrics/v1/c1/edge-1/batch", b"garbage", "bad_magic", cluster="c1", node="edge-1", seq=None
    )
    store.close()
    config = tmp_path / "ingest.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "remote_write": {"url": prometheus.remote_write_url},
                "dead_letter": {"path": str(store_path)},
                "metrics": {"listen": ""},
            }
        )
    )
    listed = cli(config, "list")
    assert listed.returncode == 0
    assert "too old sample" in listed.stdout and "bad_magic" in listed.stdout

    replay = cli(config, "replay", "--all")
    assert replay.returncode == 1, replay.stdout + replay.stderr  # the garbage one cannot be replayed
    assert f"{good}: replayed 1 samples of edge-1 seq 7" in replay.stdout
    assert f"{bad}: still invalid (bad_magic" in replay.stdout
    # Replayed like a live batch (decode.pin_identity): its node label is the topic's, and a missing
    # cluster label stays missing (add_node_labels: false).
    written = frozenset(labels)
    assert prometheus.raw_samples('replayed_metric{job="kepler"}') == {written: [(now_ms, 42.5)]}

    after = cli(config, "list")
    assert "too old sample" not in after.stdout and "bad_magic" in after.stdout
    assert cli(config, "replay").returncode == 2  # nothing chosen
