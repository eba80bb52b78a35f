"""Fixtures of the cloud tests: the test edge, scripted receivers and ingesters (testkit.ingest_harness)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.ingest_harness import Edge, Ingesters, Programs, Receivers
from testkit.services import Mosquitto


@pytest.fixture
def edge(mosquitto: Mosquitto) -> Iterator[Edge]:
    e = Edge(mosquitto)
    yield e
    e.close()


@pytest.fixture
def receivers() -> Iterator[Receivers]:
    r = Receivers()
    yield r
    r.close_all()


@pytest.fixture
def ingesters(tmp_path: Path, mosquitto: Mosquitto, edge: Edge, receivers: Receivers) -> Iterator[Ingesters]:
    group = Ingesters(tmp_path, mosquitto, receivers)
    yield group
    group.stop_all()


@pytest.fixture
def programs(tmp_path: Path, mosquitto: Mosquitto, edge: Edge, receivers: Receivers) -> Iterator[Programs]:
    group = Programs(tmp_path, mosquitto)
    yield group
    group.kill_all()
