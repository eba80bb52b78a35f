"""Shared pytest fixtures: real mosquitto / Prometheus / VictoriaMetrics on free loopback ports, a
spool, and a clean environment for every test.

A missing binary is a test *failure*, not a skip, so CI can't go green without the Debian packages.
Tests using these fixtures get the ``integration`` marker automatically (``-m "not integration"``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge_relay.store.spool import Spool
from testkit.services import Mosquitto, Prometheus, ServiceFactory, VictoriaMetrics
from testkit.stack import clean_environment

SERVICE_FIXTURES = frozenset({"mosquitto", "prometheus", "victoria_metrics", "make_service"})


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No proxies (test traffic goes straight to 127.0.0.1) and no configuration overrides from the
    shell running the tests: a config means what the test wrote, in the test and in its subprocesses."""
    clean_environment(monkeypatch)


@pytest.fixture
def spool(tmp_path: Path) -> Iterator[Spool]:
    """An empty spool in the test's directory, closed at teardown."""
    s = Spool(tmp_path / "spool.db")
    yield s
    s.close()


@pytest.fixture
def make_service(tmp_path: Path) -> Iterator[ServiceFactory]:
    """``make_service(Prometheus, ooo_window=None)``: a started service with non-default options."""
    factory = ServiceFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.fixture
def mosquitto(make_service: ServiceFactory) -> Mosquitto:
    return make_service(Mosquitto)


@pytest.fixture
def prometheus(make_service: ServiceFactory) -> Prometheus:
    return make_service(Prometheus)


@pytest.fixture
def victoria_metrics(make_service: ServiceFactory) -> VictoriaMetrics:
    return make_service(VictoriaMetrics)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    # A failing integration test is usually explained by a service log: show their tails.
    factory = getattr(item, "funcargs", {}).get("make_service")
    if report.failed and isinstance(factory, ServiceFactory):
        for service in factory.started:
            report.sections.append((f"{service.name} log {service.log_path}", service.log_tail(50)))
    return report
