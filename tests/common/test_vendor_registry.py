"""The vendor registry (``vendors/``): the records agree with their sample pages and with each other, the
files generated from them are current, and the package stands alone.

- Each record's presets match every exporter-specific series of its sample pages and no other record's
  presets do; the GPU records own disjoint series, and every series a record reads is one it owns and
  one of its presets (or a preset implying it) keeps.
- The budget schema's enums and ``deploy/prometheus/rules/gpu-vendors.rules.yml`` are what
  ``python -m vendors.generate`` writes; the generator finds its spots in another layout, refuses a
  schema it cannot place them in, and its ``--check`` / ``--update`` work on a copy of the repository.
- ``vendors`` imports only the standard library and itself, and the anomaly package names no vendor.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from edge_relay.collect.parse import parse
from schemas.model import metric_name
from simulator import data_path
from vendors import generate, registry
from vendors.record import Gauge

ROOT = Path(__file__).resolve().parents[2]
# Client libraries' own series, which every exporter written with them serves.
GENERIC = re.compile(r"promhttp_.+|process_.+|python_.+|go_.+")
SAMPLED = [r for r in registry.RECORDS if r.samples]


def sample_names(record_name: str) -> set[str]:
    names: set[str] = set()
    for sample in registry.BY_NAME[record_name].samples:
        names |= {metric_name(labels) for labels, _, _ in parse(data_path(sample).read_text())}
    return names


def preset_matches(preset: str, name: str) -> bool:
    return any(re.fullmatch(p, name) for p in registry.PRESETS[preset].names)


# --- the records --------------------------------------------------------------------------------------


@pytest.mark.parametrize("record", [r.name for r in SAMPLED])
def test_presets_match_their_samples_series_and_no_others(record: str) -> None:
    own = {n for n in sample_names(record) if not GENERIC.fullmatch(n)}
    assert own
    presets = registry.BY_NAME[record].presets
    for name in own:
        assert any(preset_matches(p, name) for p in presets), f"{name} in no preset of {record}"
    for other in registry.RECORDS:
        if other.name == record:
            continue
        for preset in other.presets:
            wrong = {n for n in own if preset_matches(preset, n)}
            assert not wrong, f"{other.name}'s preset {preset} matches {record}'s {sorted(wrong)[:3]}"


def test_gpu_records_own_disjoint_series() -> None:
    names = set().union(*(sample_names(r.name) for r in SAMPLED))
    names |= {r.metric.replace("*", "x") for gpu in registry.GPUS.values() for r in gpu.readings}
    for name in names:
        owners = [key for key, gpu in registry.GPUS.items() if gpu.owns(name)]
        assert len(owners) <= 1, f"{name} is {owners}'s"


@pytest.mark.parametrize("gpu", list(registry.GPUS))
def test_every_series_a_gpu_record_reads_is_its_own_and_kept_by_its_presets(gpu: str) -> None:
    spec = registry.GPUS[gpu]
    implying = [p for p, g in registry.PRESET_GPUS.items() if g == gpu]
    for reading in spec.readings:
        name = reading.metric.replace("*", "x")
        for served in {name, f"{spec.strip_prefix}{name}"}:
            assert registry.gpu_exporter_of(served) == gpu, served
            assert any(preset_matches(p, served) for p in implying), f"{served}: in no preset implying {gpu}"
        if isinstance(reading, Gauge):
            # What the detector reads at every scrape must reach the cloud at full resolution too.
            critical = f"{gpu}-critical"
            if critical in registry.PRESETS and reading.signal in ("temp", "power", "fb"):
                assert preset_matches(critical, name), f"{name} not in {critical}"


def test_every_gpu_record_has_cited_models_its_own_label_and_rules() -> None:
    vendors = [r.vendor for r in registry.RECORDS if r.gpu is not None]
    assert len(set(vendors)) == len(vendors) and None not in vendors
    for record in registry.RECORDS:
        if record.gpu is None:
            continue
        gpu = record.gpu
        assert gpu.rules.gpu_temp_c > 0
        # A model is found by the name the exporter serves; one that names none has its default model.
        assert gpu.model_label is not None or gpu.default_limits is not None, record.name
        for name, limits in gpu.models.items():
            assert limits.source, f"{record.name}: {name} cites no source"
            for served in (name, *limits.served_as):
                found = gpu.model(served)
                assert found is not None and found[0] == name, (record.name, served)
        assert gpu.model("Some GPU nobody listed") is None
        assert record.rules, f"{record.name} records no gpu:* series"
        assert record.samples, f"{record.name} has no sample page"


# --- the generated files ------------------------------------------------------------------------------


def test_budget_schema_enums_are_current() -> None:
    text = (ROOT / generate.SCHEMA_PATH).read_text(encoding="utf-8")
    assert generate.budget_schema(text) == text, (
        f"{generate.SCHEMA_PATH} is stale: regenerate it with `python -m vendors.generate --update`"
    )
    schema = json.loads(text)
    anomaly = schema["properties"]["anomaly"]["properties"]["presets"]["items"]["enum"]
    assert anomaly == list(registry.GPUS)


def test_gpu_recording_rules_are_current() -> None:
    text = (ROOT / generate.RULES_PATH).read_text(encoding="utf-8")
    assert generate.rules_yaml() == text, (
        f"{generate.RULES_PATH} is stale: regenerate it with `python -m vendors.generate --update`"
    )
    rules = yaml.safe_load(text)["groups"][0]["rules"]
    assert rules == generate.recording_rules()


def test_schema_generation_restores_the_enums_in_either_layout() -> None:
    text = (ROOT / generate.SCHEMA_PATH).read_text(encoding="utf-8")
    stale = text.replace('"kepler-gpu", ', "", 1)
    assert stale != text and generate.budget_schema(stale) == text
    # One item a line (as json.dumps(indent=2) writes it) stays one item a line.
    doc = json.loads(text)
    doc["properties"]["classes"]["items"]["properties"]["preset"]["enum"] = ["kepler"]
    wide = json.dumps(doc, indent=2, ensure_ascii=False)
    updated = generate.budget_schema(wide)
    assert json.loads(updated) == json.loads(text)
    assert re.search(r'"enum": \[\n +"kepler",\n +"kepler-gpu",\n', updated)


def test_schema_generation_refuses_a_schema_without_its_spots() -> None:
    text = (ROOT / generate.SCHEMA_PATH).read_text(encoding="utf-8")
    with pytest.raises(ValueError, match="classes"):
        generate.budget_schema(text.replace('"preset": {', '"preset_name": {'))


def test_generate_check_and_update_on_a_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for rel in (generate.SCHEMA_PATH, generate.RULES_PATH):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    monkeypatch.chdir(tmp_path)
    assert generate.main(["--check"]) == 0
    rules = tmp_path / generate.RULES_PATH
    rules.write_text(rules.read_text().replace("+ 295", "+ 300"))
    assert generate.main(["--check"]) == 1
    assert generate.main(["--update"]) == 0
    assert rules.read_text() == (ROOT / generate.RULES_PATH).read_text()
    assert generate.main([]) == 2


# --- standing alone -----------------------------------------------------------------------------------


def test_vendors_imports_only_the_standard_library_and_itself() -> None:
    for path in sorted((ROOT / "vendors").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                tops = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = {node.module.split(".")[0]}
            else:
                continue
            foreign = {t for t in tops if t != "vendors" and t not in sys.stdlib_module_names}
            assert not foreign, f"{path.name} imports {foreign}"
    code = "import json, sys, vendors.registry, vendors.generate; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    loaded = {m.split(".")[0] for m in json.loads(out.stdout)}
    assert not loaded & {"edge_relay", "cloud_ingest", "simulator", "schemas", "relay_common", "testkit"}


def test_the_anomaly_detector_names_no_vendor() -> None:
    names = "|".join(map(re.escape, registry.GPUS))
    vendor_strings = re.compile(rf"""["'](?:{names})["']""")
    for path in sorted((ROOT / "edge_relay/anomaly").glob("*.py")):
        found = vendor_strings.findall(path.read_text(encoding="utf-8"))
        assert not found, f"{path.name} names {found}: ask the record (vendors) instead"
