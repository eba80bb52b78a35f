"""Fixtures of the system tests: whole product runs broken on purpose."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.faultrun import FaultRun
from testkit.services import ServiceFactory


@pytest.fixture
def fault_run(tmp_path: Path, make_service: ServiceFactory) -> Iterator[Callable[..., FaultRun]]:
    """``fault_run(broker_port=..., remote_write_url=...)``: a started run, reaped at teardown (before
    the services: this fixture depends on ``make_service``, so it is torn down first)."""
    runs: list[FaultRun] = []

    def make(**kwargs: Any) -> FaultRun:
        run = FaultRun(tmp_path, **kwargs)
        runs.append(run)
        return run.start()

    yield make
    for run in runs:
        run.close()
