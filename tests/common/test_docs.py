"""The docs stay true to the code: generated references current, links that resolve, a short README.

The config reference's own checks are in test_config.py; these cover the self-metrics reference and the
documents as a whole.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from relay_common import docsections
from testkit import metricsdoc

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("program", list(metricsdoc.PROGRAMS))
def test_docs_metrics_reference_is_up_to_date(program: str) -> None:
    text = (ROOT / metricsdoc.DOCUMENT).read_text(encoding="utf-8")
    section = docsections.extract(text, metricsdoc.TAG, program)
    assert section is not None, f"{metricsdoc.DOCUMENT} lacks the <!-- metrics:{program} --> section"
    assert section == metricsdoc.markdown(program), (
        f"{metricsdoc.DOCUMENT} self-metrics reference for {program} is stale: regenerate it with "
        f"`python -m testkit.metricsdoc --update {metricsdoc.DOCUMENT}`"
    )


def test_metrics_reference_lists_names_types_and_labels_as_exposed() -> None:
    relay = {m.name: m for m in metricsdoc.declared("edge-relay")}
    assert relay["edge_relay_scrapes_total"].labels == ("target", "result")
    assert relay["edge_relay_scrapes_total"].type == "counter"
    assert relay["edge_relay_scrape_duration_seconds"].type == "histogram"
    assert relay["edge_relay_scrape_duration_seconds"].labels == ("target",)
    # read from the loss ledger by a collector of its own
    assert relay["edge_relay_samples_dropped_total"].labels == ("reason",)
    ingest = {m.name: m for m in metricsdoc.declared("cloud-ingest")}
    # the fleet view's families, declared by a collector that is empty until a node reports
    assert ingest["cloud_ingest_node_state"].labels == ("cluster", "node", "state")
    assert ingest["cloud_ingest_node_samples_written_total"].type == "counter"
    assert ingest["cloud_ingest_fleet_seq_view_complete"].labels == ()
    for metric in [*relay.values(), *ingest.values()]:
        assert metric.help, f"{metric.name} has no help text"
        prefix = "edge_relay_" if metric.name in relay else "cloud_ingest_"
        assert metric.name.startswith(prefix), metric.name


def test_metricsdoc_update_rewrites_only_its_sections(tmp_path: Path) -> None:
    doc = tmp_path / "ops.md"
    doc.write_text(
        "# Ops\n\nprose\n\n<!-- metrics:edge-relay -->\nold\n<!-- /metrics:edge-relay -->\n\n"
        "<!-- metrics:cloud-ingest -->\n<!-- /metrics:cloud-ingest -->\n\nend\n",
        encoding="utf-8",
    )
    metricsdoc.main(["--update", str(doc)])
    text = doc.read_text(encoding="utf-8")
    assert text.startswith("# Ops\n\nprose\n\n") and text.endswith("\n\nend\n")
    for program in metricsdoc.PROGRAMS:
        assert metricsdoc.section(program) in text


def test_generators_refuse_a_file_without_their_markers(tmp_path: Path) -> None:
    doc = tmp_path / "none.md"
    doc.write_text("# nothing generated here\n", encoding="utf-8")
    for module in ("testkit.metricsdoc", "relay_common.configdoc"):
        run = subprocess.run(
            [sys.executable, "-m", module, "--update", str(doc)], capture_output=True, text=True, check=False
        )
        assert run.returncode != 0 and "markers" in run.stderr, (module, run.stderr)
    assert doc.read_text(encoding="utf-8") == "# nothing generated here\n"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -."""
    anchors = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_links_resolve(doc: Path) -> None:
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        assert resolved.exists(), f"{doc.name}: link to {target}: no such file"
        assert resolved.is_relative_to(ROOT), f"{doc.name}: link to {target} leaves the repository"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{doc.name}: link to {target}: no such heading"


def test_readme_is_the_front_door() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    # how to run it comes first, exactly as CI and users type it
    assert text.index("./dev demo") < text.index("./dev test") < text.index("## A five-minute tour")
    assert not re.search(r"\b[Ii]ssues? \d", text), "issue numbers mean nothing to a reader of the README"
    assert "../" not in text, "the README refers only to files of this repository"
