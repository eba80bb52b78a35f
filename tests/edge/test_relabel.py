"""Tests of relay_common/relabel.py and where the relay applies it (settings, shape, TargetLoop).

The comparison with a real Prometheus is tests/edge/test_relabel_prometheus.py; these pin the semantics
rule by rule, the RE2 translation construct by construct, and the config errors.
"""

from __future__ import annotations

import dataclasses
import http.server
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_relay import settings as settings_mod
from edge_relay.collect.parse import SeriesCache, parse
from edge_relay.collect.shape import TargetShaper
from edge_relay.collect.targets import TargetLoop
from edge_relay.selfmetrics import RelayMetrics
from relay_common.config import ConfigError
from relay_common.relabel import (
    Rule,
    apply,
    compile_rules,
    relabel,
)
from schemas.codec import Limits
from schemas.model import Labels

ROOT = Path(__file__).resolve().parents[2]
DCGM = ROOT / "simulator/data/dcgm-exporter-sample.prom"
ALLOWLIST = ROOT / "deploy/examples/edge-relay-allowlist.yaml"


def rules(*raw: dict[str, Any]) -> tuple[Rule, ...]:
    return compile_rules(list(raw), "metric_relabel_configs")


def run(labels: dict[str, str], *raw: dict[str, Any]) -> dict[str, str] | None:
    return relabel(rules(*raw), labels)


# --- actions ---------------------------------------------------------------------------------------

BASE = {"__name__": "m", "a": "foo", "b": "bar", "c": "baz"}


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        # replace: defaults regex (.*), replacement $1, separator ;
        ({"source_labels": ["a", "b"], "target_label": "d"}, {**BASE, "d": "foo;bar"}),
        (
            {"source_labels": ["a"], "regex": "f(o+)", "target_label": "d", "replacement": "x${1}y"},
            {**BASE, "d": "xooy"},
        ),
        ({"source_labels": ["a"], "regex": "nomatch", "target_label": "d"}, BASE),
        # an empty replacement deletes the target label
        ({"source_labels": ["missing"], "target_label": "a"}, {k: v for k, v in BASE.items() if k != "a"}),
        # the target label may use groups; an invalid expanded name does nothing
        (
            {"source_labels": ["a"], "regex": "(f)oo", "target_label": "t_$1", "replacement": "v"},
            {**BASE, "t_f": "v"},
        ),
        (
            {"source_labels": ["a"], "regex": "(.*)", "target_label": "${1}", "replacement": "v"},
            {**BASE, "foo": "v"},
        ),
        ({"source_labels": ["b"], "regex": "(.*)", "target_label": "$1x", "replacement": "v"}, BASE),
        (
            {
                "source_labels": ["a"],
                "separator": "",
                "regex": "(?P<w>fo)o",
                "replacement": "$w",
                "target_label": "n",
            },
            {**BASE, "n": "fo"},
        ),
        (
            {"action": "lowercase", "source_labels": ["__name__"], "target_label": "up_name"},
            {**BASE, "up_name": "m"},
        ),
        ({"action": "uppercase", "source_labels": ["a", "b"], "target_label": "u"}, {**BASE, "u": "FOO;BAR"}),
        # lowercase of nothing sets "", which deletes
        (
            {"action": "lowercase", "source_labels": ["missing"], "target_label": "a"},
            {k: v for k, v in BASE.items() if k != "a"},
        ),
        # Prometheus' own vectors (model/relabel/relabel_test.go)
        (
            {"action": "hashmod", "source_labels": ["c"], "target_label": "d", "modulus": 1000},
            {**BASE, "d": "976"},
        ),
        (
            {"action": "labelmap", "regex": "(a|b)", "replacement": "copy_$1"},
            {**BASE, "copy_a": "foo", "copy_b": "bar"},
        ),
        ({"action": "labeldrop", "regex": "a|b"}, {"__name__": "m", "c": "baz"}),
        ({"action": "labelkeep", "regex": "__name__|c"}, {"__name__": "m", "c": "baz"}),
        ({"action": "keep", "source_labels": ["a"], "regex": "fo+"}, BASE),
        ({"action": "keep", "source_labels": ["a"], "regex": "fo"}, None),  # anchored: "fo" != "foo"
        ({"action": "drop", "source_labels": ["a"], "regex": "f.*"}, None),
        ({"action": "drop", "source_labels": ["a"], "regex": "oo"}, BASE),
        ({"action": "keepequal", "source_labels": ["a"], "target_label": "b"}, None),
        ({"action": "keepequal", "source_labels": ["missing"], "target_label": "other_missing"}, BASE),
        ({"action": "dropequal", "source_labels": ["a"], "target_label": "a"}, None),
        ({"action": "DROPEQUAL", "source_labels": ["a"], "target_label": "b"}, BASE),  # action: any case
    ],
)
def test_actions(rule: dict[str, Any], expected: dict[str, str] | None) -> None:
    assert run(BASE, rule) == expected


def test_hashmod_matches_prometheus_on_a_newline_value() -> None:
    out = run(
        {"a": "foo\nbar"}, {"action": "hashmod", "source_labels": ["a"], "target_label": "b", "modulus": 1000}
    )
    assert out == {"a": "foo\nbar", "b": "734"}


def test_rules_apply_in_order_and_see_each_others_output() -> None:
    out = run(
        BASE,
        {"source_labels": ["a"], "target_label": "__tmp"},
        {"source_labels": ["__tmp", "c"], "separator": "-", "target_label": "joined"},
        {"action": "labeldrop", "regex": "__tmp"},
    )
    assert out == {**BASE, "joined": "foo-baz"}


def test_labelmap_iterates_the_labels_before_the_rule() -> None:
    # a -> b and b -> c in one rule: c gets b's old value, b gets a's.
    out = run({"a": "1", "b": "2"}, {"action": "labelmap", "regex": "(a|b)", "replacement": "${1}_x"})
    assert out == {"a": "1", "b": "2", "a_x": "1", "b_x": "2"}


# --- Go's regexp.Expand ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replacement", "expected"),
    [
        ("$1", "ab"),
        ("${1}", "ab"),
        ("${1}x", "abx"),
        ("$1x", ""),  # the group named "1x": unknown, so empty
        ("$2-$1", "c-ab"),
        ("$name", "c"),
        ("${name}_", "c_"),
        ("$$1", "$1"),
        ("$", "$"),  # malformed: literal
        ("${1", "${1"),
        ("a$9b", "a"),  # the group named "9b"
        ("a${9}b", "ab"),  # no such group: empty
        ("$01", ""),  # a leading zero is a name, not a number
        ("$0", "abc"),
    ],
)
def test_replacement_expands_like_go(replacement: str, expected: str) -> None:
    out = run(
        {"v": "abc"},
        {"source_labels": ["v"], "regex": "(ab)(?P<name>c)", "target_label": "r", "replacement": replacement},
    )
    assert out is not None
    assert out.get("r", "") == expected


# --- properties --------------------------------------------------------------------------------------

label_names = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)
label_sets = st.dictionaries(label_names, st.text(min_size=1, max_size=8), max_size=6)
regexes = st.sampled_from(["a.*", ".*_x", "(a|b)", "__.*", "[a-c]+", "(?i)A.*", ".+\n.*"])


@settings(max_examples=300, deadline=None)
@given(label_sets, regexes)
def test_labelkeep_and_labeldrop_partition_the_labels(labels: dict[str, str], regex: str) -> None:
    kept = run(labels, {"action": "labelkeep", "regex": regex})
    dropped = run(labels, {"action": "labeldrop", "regex": regex})
    assert kept is not None and dropped is not None
    assert kept.keys() | dropped.keys() == labels.keys()
    assert not kept.keys() & dropped.keys()


@settings(max_examples=300, deadline=None)
@given(label_sets, regexes, st.lists(label_names, min_size=1, max_size=3))
def test_keep_and_drop_are_complements(labels: dict[str, str], regex: str, sources: list[str]) -> None:
    keep = run(labels, {"action": "keep", "source_labels": sources, "regex": regex})
    drop = run(labels, {"action": "drop", "source_labels": sources, "regex": regex})
    assert (keep is None) != (drop is None)


@settings(max_examples=200, deadline=None)
@given(st.lists(label_sets, min_size=1, max_size=30))
def test_the_shapers_cache_gives_what_relabeling_gives(sets: list[dict[str, str]]) -> None:
    rs = rules(
        {"action": "drop", "source_labels": ["a"], "regex": "x.*"},
        {"source_labels": ["b", "job"], "target_label": "c"},
        {"action": "hashmod", "source_labels": ["c"], "target_label": "shard", "modulus": 3},
    )
    sh = TargetShaper("t", {"job": "j"}, {"node": "n"}, metric_relabel=rs)
    for _ in range(2):  # the second pass comes from the cache
        for s in sets:
            exposed: Labels = tuple(sorted({**s, "__name__": "m"}.items()))
            want = relabel(rs, {**dict(exposed), "job": "j"})
            got = sh.decorate(exposed)
            if want is None:
                assert got == ()
            else:
                assert got == tuple(sorted({"node": "n", **want}.items()))


# --- where it applies: the shaper ---------------------------------------------------------------------


def L(name: str, **labels: str) -> Labels:
    return tuple(sorted({"__name__": name, **labels}.items()))


def test_relabeling_sees_target_labels_but_not_fill_labels_and_spares_up() -> None:
    rs = rules(
        {"source_labels": ["job", "instance", "node", "exported_job"], "target_label": "seen"},
        {"action": "drop", "source_labels": ["__name__"], "regex": "up|gone"},
        {"action": "labeldrop", "regex": "cluster"},
    )
    sh = TargetShaper(
        "t", {"job": "dcgm", "instance": "n1:9400"}, {"cluster": "c", "node": "n1"}, metric_relabel=rs
    )
    out = sh.shape(
        1000, [(L("m", job="exposed"), 1.0, None), (L("gone"), 2.0, None), (L("up"), 3.0, None)], 0.1
    )
    got = {dict(lab)["__name__"]: dict(lab) for lab in out.labels}
    # the exposed job moved to exported_job before the rules ran; node was not there yet
    assert got["m"]["seen"] == "dcgm;n1:9400;;exposed"
    assert got["m"]["cluster"] == "c"  # filled in after the rules, so labeldrop cannot remove it
    assert out.relabel_dropped == 2  # "gone" and the *exposed* `up`
    assert got["up"] == {"__name__": "up", "cluster": "c", "node": "n1", "job": "dcgm", "instance": "n1:9400"}
    assert dict(zip(out.labels, out.values, strict=True))[sh._up] == 1.0


def test_double_underscore_labels_stay_as_in_prometheus() -> None:
    """Prometheus removes `__` labels after *target* relabeling only; metric relabeling keeps them."""
    sh = TargetShaper(
        "t", {"job": "j"}, {}, metric_relabel=rules({"target_label": "__tmp", "replacement": "x"})
    )
    (first, *_) = sh.shape(1000, [(L("m"), 1.0, None)], 0.1).labels
    assert dict(first)["__tmp"] == "x"


def test_a_series_left_without_a_name_fails_the_scrape_as_in_prometheus() -> None:
    rs = rules({"action": "labeldrop", "regex": "__name__"})
    sh = TargetShaper("t", {"job": "j"}, {}, metric_relabel=rs)
    ok = TargetShaper("t", {"job": "j"}, {})
    ok.shape(1000, [(L("m"), 1.0, None)], 0.1)
    sh._previous = set(ok._previous)  # as if the previous scrape (before a reload) had this series
    out = sh.shape(2000, [(L("m"), 1.0, None)], 0.1)
    assert "without __name__" in out.relabel_error
    values = dict(zip(out.labels, out.values, strict=True))
    assert values[sh._up] == 0.0
    assert out.stale_markers == 1


def test_relabeling_every_label_away_drops_the_series() -> None:
    sh = TargetShaper(
        "t", {"job": "j"}, {"node": "n"}, metric_relabel=rules({"action": "labelkeep", "regex": "x"})
    )
    out = sh.shape(1000, [(L("m"), 1.0, None)], 0.1)
    assert out.relabel_dropped == 1 and not out.relabel_error


def test_collapsed_series_keep_the_first_and_count_the_rest_as_duplicates() -> None:
    sh = TargetShaper("t", {"job": "j"}, {}, metric_relabel=rules({"action": "labeldrop", "regex": "gpu"}))
    out = sh.shape(1000, [(L("m", gpu="0"), 1.0, None), (L("m", gpu="1"), 2.0, None)], 0.1)
    assert [v for lab, v in zip(out.labels, out.values, strict=True) if dict(lab)["__name__"] == "m"] == [1.0]
    assert out.duplicates == 1 and out.relabel_dropped == 0


# --- config: validation through the loader -----------------------------------------------------------


def config(tmp_path: Path, **extra: Any) -> Path:
    cfg: dict[str, Any] = {
        "node": "n1",
        "targets": [
            {"name": "a", "url": "http://127.0.0.1:9100/metrics"},
            {"name": "b", "url": "http://127.0.0.1:9400/m"},
        ],
        "metrics": {"listen": ""},
    }
    for key, value in extra.items():
        if key == "global_rules":
            cfg["scrape"] = {"metric_relabel_configs": value}
        else:
            cfg["targets"][1][key] = value
    path = tmp_path / "relay.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize(
    ("rule", "key", "why"),
    [
        ({"action": "hashmod", "target_label": "x"}, "[0].modulus", "non-zero modulus"),
        ({"source_labels": ["a"]}, "[0].target_label", "requires a target_label"),
        ({"target_label": "1abc"}, "[0].target_label", "not a valid target_label"),
        ({"target_label": "a-b"}, "[0].target_label", "not a valid target_label"),
        ({"action": "lowercase", "target_label": "$1"}, "[0].target_label", "not a label name"),
        (
            {"action": "uppercase", "target_label": "x", "replacement": "y"},
            "[0].replacement",
            "cannot be set",
        ),
        ({"action": "keepequal", "target_label": "x", "regex": "(.*)"}, "[0].regex", "only source_labels"),
        (
            {"action": "dropequal", "target_label": "x", "separator": ","},
            "[0].separator",
            "only source_labels",
        ),
        ({"action": "dropequal"}, "[0].target_label", "requires a target_label"),
        ({"action": "labeldrop", "regex": "x", "source_labels": ["a"]}, "[0].source_labels", "only a regex"),
        ({"action": "labelkeep", "target_label": "x"}, "[0].target_label", "only a regex"),
        ({"action": "labelmap", "replacement": "bad-name"}, "[0].replacement", "not a valid replacement"),
        ({"action": "explode"}, "[0].action", "unknown relabel action"),
        (
            {"source_labels": ["bad-name"], "target_label": "x"},
            "[0].source_labels[0]",
            "not a valid label name",
        ),
        ({"target_label": "x", "regex": r"a\Z"}, "[0].regex", "RE2 has no \\Z"),
        ({"target_label": "x", "regex": "(?=a)"}, "[0].regex", "lookahead"),
    ],
)
def test_invalid_rules_name_file_key_and_reason(
    tmp_path: Path, rule: dict[str, Any], key: str, why: str
) -> None:
    path = config(tmp_path, metric_relabel_configs=[{"action": "keep", "regex": ".*"}, rule])
    with pytest.raises(ConfigError) as e:
        settings_mod.load(str(path))
    msg = str(e.value)
    assert str(path) in msg and f"`targets[1].metric_relabel_configs[1{key[2:]}`" in msg and why in msg, msg


@pytest.mark.parametrize(
    "rule",
    [
        # YAML scalars Prometheus reads as text: a hashmod shard's keep, a numeric replacement.
        {"source_labels": ["a"], "action": "keep", "regex": 0},
        {"source_labels": ["a"], "target_label": "b", "replacement": 7},
        # Explicit defaults: Prometheus compares with them, so these pass `promtool check config`.
        {"action": "lowercase", "source_labels": ["a"], "target_label": "b", "replacement": "$1"},
        {"action": "keepequal", "source_labels": ["a"], "target_label": "b", "replacement": "$1"},
    ],
)
def test_rules_prometheus_takes_are_taken(tmp_path: Path, rule: dict[str, Any]) -> None:
    settings_mod.load(str(config(tmp_path, metric_relabel_configs=[rule])))


def test_an_unquoted_number_is_the_regex_of_its_digits() -> None:
    rs = rules({"source_labels": ["shard"], "action": "keep", "regex": 0})
    assert relabel(rs, {"__name__": "m", "shard": "0"}) is not None
    assert relabel(rs, {"__name__": "m", "shard": "10"}) is None


def test_a_bad_global_rule_names_its_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("`scrape.metric_relabel_configs[0].regex`")):
        settings_mod.load(str(config(tmp_path, global_rules=[{"action": "drop", "regex": "a++"}])))


def test_schema_refuses_unknown_rule_fields(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key `regexp`"):
        settings_mod.load(str(config(tmp_path, metric_relabel_configs=[{"action": "drop", "regexp": "x"}])))


def test_global_rules_run_before_the_targets_own(tmp_path: Path) -> None:
    path = config(
        tmp_path,
        global_rules=[{"target_label": "stage", "replacement": "global"}],
        metric_relabel_configs=[
            {"source_labels": ["stage"], "target_label": "stage", "replacement": "${1}+own"}
        ],
    )
    a, b = settings_mod.load(str(path)).targets
    assert relabel(a.metric_relabel, {"__name__": "m"}) == {"__name__": "m", "stage": "global"}
    assert relabel(b.metric_relabel, {"__name__": "m"}) == {"__name__": "m", "stage": "global+own"}


# --- target relabel_configs -------------------------------------------------------------------------


def test_target_relabeling_sees_meta_labels_and_removes_them(tmp_path: Path) -> None:
    path = config(
        tmp_path,
        labels={"team": "ml"},
        relabel_configs=[
            {"source_labels": ["__address__", "__metrics_path__", "__scheme__"], "target_label": "from"},
            {
                "source_labels": ["__meta_edge_relay_target_name", "__meta_edge_relay_node"],
                "target_label": "who",
            },
            {"source_labels": ["team"], "target_label": "job", "replacement": "gpu-$1"},
            {"action": "labeldrop", "regex": "instance"},
            {"target_label": "__hidden", "replacement": "x"},
        ],
    )
    _, b = settings_mod.load(str(path)).targets
    assert b.job == "gpu-ml"
    assert b.instance == "n1:9400"  # removed by a rule: back to its default, as Prometheus does
    assert b.labels == {"team": "ml", "from": "127.0.0.1:9400;/m;http", "who": "b;n1"}


def test_a_target_dropped_by_relabeling_is_not_scraped(tmp_path: Path) -> None:
    path = config(
        tmp_path, relabel_configs=[{"action": "drop", "source_labels": ["__address__"], "regex": ".*:9400"}]
    )
    assert [t.name for t in settings_mod.load(str(path)).targets] == ["a"]


def test_target_relabeling_that_makes_a_bad_label_name_is_refused(tmp_path: Path) -> None:
    path = config(
        tmp_path,
        labels={"x": "1"},
        relabel_configs=[{"action": "labelmap", "regex": "x", "replacement": "a${0}b"}],
    )
    assert settings_mod.load(str(path)).targets[1].labels["axb"] == "1"
    with pytest.raises(ConfigError, match=re.escape("`targets[1].relabel_configs[0].replacement`")):
        settings_mod.load(
            str(config(tmp_path, relabel_configs=[{"action": "labelmap", "replacement": "a.b"}]))
        )


# --- the allow-list example, through the real loader and TargetLoop ------------------------------------


@pytest.fixture
def dcgm_server() -> Iterator[str]:
    body = DCGM.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_allowlist_example_keeps_exactly_three_gpu_metrics_and_up(dcgm_server: str) -> None:
    s = settings_mod.load(str(ALLOWLIST))
    (target,) = s.targets
    metrics = RelayMetrics()
    loop = TargetLoop(dataclasses.replace(target, url=dcgm_server), s, metrics)
    try:
        out = loop.run_once()
    finally:
        loop.scraper.close()
    names = {dict(lab)["__name__"] for lab in out.labels}
    wanted = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP"}
    assert names == wanted | {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
    exposed = parse(DCGM.read_bytes(), "text/plain; version=0.0.4", SeriesCache(), 0)
    kept = [lab for lab, _, _ in exposed if dict(lab)["__name__"] in wanted]
    assert len(kept) == 6  # two GPUs each
    assert sum(1 for lab in out.labels if dict(lab)["__name__"] in wanted) == len(kept)
    assert out.relabel_dropped == len(exposed) - len(kept) > 0
    dropped = metrics.registry.get_sample_value(
        "edge_relay_samples_relabel_dropped_total", {"target": "dcgm"}
    )
    assert dropped == out.relabel_dropped
    values = dict(zip(out.labels, out.values, strict=True))
    assert values[loop.shaper._up] == 1.0


def test_apply_is_in_place_and_reports_drops() -> None:
    labels = {"a": "1"}
    assert apply(rules({"target_label": "b", "replacement": "2"}), labels) and labels == {"a": "1", "b": "2"}
    assert not apply(rules({"action": "drop", "source_labels": ["a"], "regex": "1"}), labels)


@pytest.mark.parametrize(
    "rule",
    [
        {"action": "labelmap", "regex": "x_(.*)", "replacement": "$1"},  # makes the label name "1"
        {"source_labels": ["__name__"], "target_label": "__name__", "replacement": "m-x"},
    ],
)
def test_a_relabeled_name_that_is_not_valid_fails_the_scrape_as_in_prometheus(
    rule: dict[str, object],
) -> None:
    """Prometheus' scrape loop fails the whole scrape for a series whose label set relabeling made
    invalid (``lset.IsValid()``), as for one left without a name; it does not drop that series alone."""
    sh = TargetShaper("t", {"job": "j"}, {}, metric_relabel=rules(rule))
    out = sh.shape(1000, [(L("m", x_1="v"), 1.0, None), (L("other"), 2.0, None)], 0.1)
    assert "metric relabeling made an invalid" in out.relabel_error
    values = dict(zip(out.labels, out.values, strict=True))
    assert values[sh._up] == 0.0
    assert out.over_label_limits == 0 and len(out) == 3  # only the synthetic series


def test_a_series_over_the_label_limits_after_relabeling_still_costs_only_itself() -> None:
    sh = TargetShaper(
        "t",
        {"job": "j"},
        {},
        limits=Limits(max_label_value_bytes=8),
        metric_relabel=rules({"source_labels": ["a"], "target_label": "b", "replacement": "${1}${1}${1}"}),
    )
    out = sh.shape(1000, [(L("m", a="12345"), 1.0, None), (L("n", a="1"), 2.0, None)], 0.1)
    assert not out.relabel_error and out.over_label_limits == 1
