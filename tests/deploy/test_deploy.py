"""What an operator applies must be valid: every shipped config passes the same checks as at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cloud_ingest import settings as ingest_settings
from edge_relay import budget as relay_budget
from edge_relay import settings as relay_settings

ROOT = Path(__file__).resolve().parents[2]
RELAY_CONFIGS = [ROOT / "deploy/examples/edge-relay.yaml", ROOT / "deploy/docker/edge-relay.yaml"]
INGEST_CONFIGS = [ROOT / "deploy/examples/cloud-ingest.yaml", ROOT / "deploy/docker/cloud-ingest.yaml"]


@pytest.mark.parametrize("path", RELAY_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relay_configs_load(path: Path) -> None:
    s = relay_settings.load(str(path))
    assert s.targets
    if s.budget_file:
        assert relay_budget.load(s.budget_file).classes


@pytest.mark.parametrize("path", INGEST_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_ingest_configs_load(path: Path) -> None:
    assert ingest_settings.load(str(path)).remote_write_url


def test_compose_mounts_exist_and_services_use_shipped_configs() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name}: {source} does not exist"
