"""Shared pytest fixtures: real mosquitto / Prometheus / VictoriaMetrics on free loopback ports.

A missing binary is a test *failure*, not a skip, so CI can't go green without the Debian packages.
Tests using these fixtures get the ``integration`` marker automatically (``-m "not integration"``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.services import Mosquitto, Prometheus, ServiceFactory, VictoriaMetrics

SERVICE_FIXTURES = frozenset({"mosquitto", "prometheus", "victoria_metrics", "make_service"})


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
