"""Differential test: the relay's relabeling against a real Prometheus' own, same configs, same input.

One static HTTP server serves the simulator's exporter fixtures (dcgm-exporter, Kepler 0.7 and current)
and a snapshot of a real ``prometheus-node-exporter`` (Debian's; a snapshot because its live values
change between two scrapers' scrapes, and the comparison is of values). Every config below becomes a
job scraping some of those expositions, in a Prometheus that scrapes them itself (``A``) and in one
relay whose samples go through mosquitto and cloud-ingest into a second Prometheus by remote write
(``B``). At the end both hold the same series with the same values, apart from the labels the relay
adds by design (``cluster``, ``node``) and the scrape-report series only Prometheus writes. All configs
run side by side in one pair of Prometheus servers and one relay, so the whole module takes seconds.
"""

from __future__ import annotations

import http.server
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import requests

from testkit.services import HttpService, Mosquitto, Prometheus, RawSamples, ServiceFactory, wait_until
from testkit.stack import ingest_config, relay_config, run_relay_and_ingester

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = {
    "dcgm": ROOT / "simulator/data/dcgm-exporter-sample.prom",
    "kepler": ROOT / "simulator/data/kepler-current-sample.prom",
    "kepler07": ROOT / "simulator/data/kepler-0.7-sample.prom",
}
RELAY_LABELS = {"cluster", "node"}  # what the relay adds to every series by design
PROMETHEUS_ONLY = {"scrape_samples_post_metric_relabeling", "scrape_series_added"}
RUN_SECONDS = 9

# Applied by the relay before every target's own rules (scrape.metric_relabel_configs); prepended to
# every job's list in Prometheus, which has no such key.
GLOBAL = [{"action": "drop", "source_labels": ["__name__"], "regex": "go_memstats_.*_total"}]

# name -> expositions, metric_relabel_configs, relabel_configs (target labels)
CONFIGS: dict[str, tuple[tuple[str, ...], list[dict[str, Any]], list[dict[str, Any]]]] = {
    "keep_allowlist": (
        ("dcgm",),
        [
            {
                "source_labels": ["__name__"],
                "action": "keep",
                "regex": "DCGM_FI_DEV_(GPU_UTIL|FB_USED|GPU_TEMP)",
            }
        ],
        [],
    ),
    "drop_runtime": (
        ("kepler", "node"),
        [{"source_labels": ["__name__"], "action": "drop", "regex": "go_.*|process_.*|promhttp_.*"}],
        [],
    ),
    "replace_default": (
        ("dcgm",),
        [{"source_labels": ["__name__", "instance"], "target_label": "combined"}],
        [],
    ),
    "replace_groups": (
        ("dcgm",),
        [
            {
                "source_labels": ["__name__"],
                "regex": r"DCGM_FI_(\w+?)_(.*)",
                "target_label": "family",
                "replacement": "${1}-$2",
            }
        ],
        [],
    ),
    "replace_templated_target": (
        ("dcgm",),
        [{"source_labels": ["gpu"], "regex": r"(\d)", "target_label": "gpu_$1", "replacement": "yes"}],
        [],
    ),
    "rename_metrics": (
        ("node",),
        [
            {
                "source_labels": ["__name__"],
                "regex": "node_(.*)",
                "target_label": "__name__",
                "replacement": "host_$1",
            }
        ],
        [],
    ),
    "replace_empty_deletes": (
        ("dcgm",),
        [
            {
                "source_labels": ["modelName"],
                "regex": ".*A100.*",
                "target_label": "modelName",
                "replacement": "",
            }
        ],
        [],
    ),
    "keepequal_missing": (
        ("node",),
        [{"action": "keepequal", "source_labels": ["nope"], "target_label": "cpu"}],
        [],
    ),
    "dropequal_copy": (
        ("dcgm",),
        [
            {"source_labels": ["gpu"], "regex": "0", "target_label": "g2"},
            {"action": "dropequal", "source_labels": ["gpu"], "target_label": "g2"},
        ],
        [],
    ),
    "hashmod_shard": (
        ("dcgm", "kepler"),
        [
            {
                "action": "hashmod",
                "source_labels": ["__name__", "gpu"],
                "modulus": 4,
                "target_label": "shard",
            },
            {"action": "keep", "source_labels": ["shard"], "regex": "1|2"},
        ],
        [],
    ),
    "hashmod_big": (
        ("node",),
        [
            {
                "action": "hashmod",
                "source_labels": ["__name__", "instance", "mode"],
                "separator": "\n",
                "modulus": 18446744073709551557,
                "target_label": "h",
            }
        ],
        [],
    ),
    "labelmap_k8s": (
        ("dcgm", "kepler"),
        [{"action": "labelmap", "regex": "(pod|namespace|container)", "replacement": "k8s_$1"}],
        [],
    ),
    "labeldrop_ids": (("dcgm",), [{"action": "labeldrop", "regex": "UUID|pci_bus_id|DCGM_.*|Hostname"}], []),
    "labelkeep_core": (("dcgm",), [{"action": "labelkeep", "regex": "__name__|job|instance|gpu"}], []),
    "lowercase_copy": (
        ("dcgm",),
        [{"action": "lowercase", "source_labels": ["__name__", "modelName"], "target_label": "lower"}],
        [],
    ),
    "uppercase_in_place": (
        ("node",),
        [{"action": "uppercase", "source_labels": ["mode"], "target_label": "mode"}],
        [],
    ),
    "lowercase_names": (
        ("dcgm",),
        [{"action": "lowercase", "source_labels": ["__name__"], "target_label": "__name__"}],
        [],
    ),
    "drop_case_insensitive": (
        ("dcgm",),
        [{"action": "drop", "source_labels": ["__name__"], "regex": "(?i)dcgm_fi_prof_.*"}],
        [],
    ),
    "keep_perl_posix": (
        ("node", "kepler07"),
        [
            {
                "action": "keep",
                "source_labels": ["__name__"],
                "regex": r"node_cpu_\w+|node_load\d+|[[:lower:]_]+_joules_total",
            }
        ],
        [],
    ),
    "drop_quoted_end": (
        ("node",),
        [{"action": "drop", "source_labels": ["__name__"], "regex": r"\Qnode_memory_\E.*_bytes\z"}],
        [],
    ),
    # Go's syntax that Python's re lacks: Unicode classes, a flag group mid-pattern, ungreedy, octal,
    # a repeated group name (the leftmost that took part expands).
    "re2_only_syntax": (
        ("dcgm",),
        [
            {
                "action": "keep",
                "source_labels": ["__name__"],
                "regex": r"DCGM_FI_(?i)dev_\p{Lu}+_[[:^digit:]]+",
            },
            {
                "source_labels": ["modelName"],
                "regex": r"(?U)(?P<vendor>\pL+)\040(\PZ+)(?P<vendor>x)?.*",
                "target_label": "short",
                "replacement": "${vendor}-$2",
            },
        ],
        [],
    ),
    "nameless_fails_scrape": (("dcgm",), [{"action": "labeldrop", "regex": "__name__"}], []),
    # Relabeling may write any value into __name__; one series whose name is then invalid fails the scrape.
    "invalid_name_fails_scrape": (
        ("dcgm",),
        [
            {
                "source_labels": ["__name__"],
                "regex": "DCGM_FI_DEV_GPU_TEMP",
                "target_label": "__name__",
                "replacement": "gpu-temp",
            }
        ],
        [],
    ),
    "tmp_labels": (
        ("dcgm",),
        [
            {"source_labels": ["gpu"], "target_label": "__tmp_gpu"},
            {"source_labels": ["__tmp_gpu", "device"], "separator": "@", "target_label": "gpu_at"},
        ],
        [],
    ),
    "separator_path": (
        ("dcgm", "kepler07"),
        [{"source_labels": ["namespace", "pod", "container"], "separator": "/", "target_label": "path"}],
        [],
    ),
    "target_drop": (
        ("dcgm", "kepler07"),
        [{"action": "keep", "source_labels": ["__name__"], "regex": ".*_(TEMP|joules_total)"}],
        [{"action": "drop", "source_labels": ["__metrics_path__"], "regex": "/kepler07"}],
    ),
    "target_labels": (
        ("dcgm", "node"),
        [
            {
                "action": "keep",
                "source_labels": ["__name__", "site"],
                "regex": "(DCGM_FI_DEV_GPU_TEMP|node_load1);.*:\\d+",
            }
        ],
        [
            {
                "source_labels": ["__address__"],
                "regex": "(.*):(\\d+)",
                "target_label": "site",
                "replacement": "$1:$2",
            },
            {"source_labels": ["__scheme__", "__metrics_path__"], "target_label": "origin"},
            {"source_labels": ["job"], "target_label": "job", "replacement": "${1}_renamed"},
            {"action": "hashmod", "source_labels": ["instance"], "modulus": 2, "target_label": "half"},
        ],
    ),
}


class NodeExporter(HttpService):
    """Debian's prometheus-node-exporter with a few collectors, on a free loopback port."""

    name: ClassVar[str] = "node-exporter"
    default_binary: ClassVar[str] = "/usr/bin/prometheus-node-exporter"
    package: ClassVar[str] = "prometheus-node-exporter"
    health_path: ClassVar[str] = "/metrics"

    def command(self) -> list[str]:
        collectors = ("cpu", "loadavg", "meminfo", "uname", "netdev", "time")
        return [
            self.binary,
            f"--web.listen-address={self.host}:{self.port}",
            "--collector.disable-defaults",
            *(f"--collector.{c}" for c in collectors),
        ]


@pytest.fixture
def expositions(make_service: ServiceFactory) -> Iterator[str]:
    """Base URL of a server answering /<name> with a fixed exposition; the node one is a real snapshot."""
    node = make_service(NodeExporter)
    bodies = {name: path.read_bytes() for name, path in FIXTURES.items()}
    bodies["node"] = requests.get(node.metrics_url, timeout=10).content
    assert b"node_cpu_seconds_total" in bodies["node"] and b"node_load1" in bodies["node"]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = bodies.get(self.path.lstrip("/"))
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        request_queue_size = 256  # two scrapers open dozens of connections at once; 5 drops SYNs

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def prometheus_jobs(address: str) -> list[dict[str, Any]]:
    return [
        {
            "job_name": f"rl_{name}",
            "scrape_interval": "1s",
            "scrape_timeout": "1s",
            "static_configs": [
                {"targets": [address], "labels": {"__metrics_path__": f"/{path}", "instance": path}}
                for path in paths
            ],
            "metric_relabel_configs": GLOBAL + metric_rules,
            **({"relabel_configs": target_rules} if target_rules else {}),
        }
        for name, (paths, metric_rules, target_rules) in CONFIGS.items()
    ]


def relay_targets(address: str) -> list[dict[str, Any]]:
    return [
        {
            "name": f"{name}.{path}",
            "url": f"http://{address}/{path}",
            "format": "text",
            "job": f"rl_{name}",
            "instance": path,
            "metric_relabel_configs": metric_rules,
            "relabel_configs": target_rules,
        }
        for name, (paths, metric_rules, target_rules) in CONFIGS.items()
        for path in paths
    ]


Key = frozenset[tuple[str, str]]

# Jobs whose every scrape metric relabeling fails (Prometheus and the relay: up 0, no series).
FAILING_JOBS = {"rl_nameless_fails_scrape", "rl_invalid_name_fails_scrape"}


def series(samples: RawSamples, drop_labels: set[str]) -> dict[Key, set[str]]:
    """Label set (minus ``drop_labels``) -> the distinct values it had (as text, so NaN == NaN)."""
    out: dict[Key, set[str]] = {}
    for key, points in samples.items():
        labels = dict(key)
        if labels["__name__"] in PROMETHEUS_ONLY:
            continue
        name = frozenset((k, v) for k, v in labels.items() if k not in drop_labels)
        values = {"NaN" if math.isnan(v) else repr(v) for _, v in points}
        if labels["__name__"] == "scrape_duration_seconds":
            values = {"(a duration)"}
        if labels["__name__"] == "scrape_samples_scraped" and labels["job"] in FAILING_JOBS:
            # Prometheus reports the samples it read before the nameless one failed the scrape, which
            # is an accident of sample order; the relay reports a failed scrape's 0.
            values = {"(failed)"}
        out.setdefault(name, set()).update(values)
    return out


@pytest.mark.timeout(120)
def test_relay_relabels_exactly_as_prometheus(
    tmp_path: Path, make_service: ServiceFactory, mosquitto: Mosquitto, expositions: str
) -> None:
    assert len(CONFIGS) >= 20
    actions = {r.get("action", "replace").lower() for _, m, t in CONFIGS.values() for r in m + t}
    assert actions >= {
        "replace", "keep", "drop", "keepequal", "dropequal", "hashmod", "labelmap", "labeldrop", "labelkeep",
        "lowercase", "uppercase",
    }  # fmt: skip
    scraper = make_service(Prometheus, scrape_configs=prometheus_jobs(expositions))
    receiver = make_service(Prometheus)
    relay_cfg = relay_config(
        tmp_path,
        urls={},
        mqtt_port=mosquitto.port,
        interval=1.0,
        targets=relay_targets(expositions),
        scrape={"interval_seconds": 1.0, "timeout_seconds": 0.9, "metric_relabel_configs": GLOBAL},
    )
    ingest_cfg = ingest_config(tmp_path, mqtt_port=mosquitto.port, remote_write_url=receiver.remote_write_url)
    relay = run_relay_and_ingester(tmp_path, relay_cfg, ingest_cfg, RUN_SECONDS)
    # Every target of A (one dropped by target relabeling) has been scraped a few times by now.
    n_targets = sum(len(paths) for paths, _, _ in CONFIGS.values()) - 1
    wait_until(
        lambda: len(scraper.query('count_over_time(up{job=~"rl_.*"}[1m]) >= 3')["result"]) == n_targets,
        timeout=30,
        message="Prometheus A scraping every target",
    )
    want = series(scraper.raw_samples('{job=~"rl_.*"}', lookback="5m"), set())
    got = wait_until(
        lambda: series(receiver.raw_samples('{job=~"rl_.*"}', lookback="5m"), RELAY_LABELS) or None,
        timeout=30,
        message="samples in Prometheus B",
    )
    assert "metric relabeling left a series without __name__" in relay.log_tail(400)
    assert "metric relabeling made an invalid metric or label name" in relay.log_tail(400)
    problems = [f"only in Prometheus: {sorted(k)} {want[k]}" for k in want.keys() - got.keys()]
    problems += [f"only via the relay: {sorted(k)} {got[k]}" for k in got.keys() - want.keys()]
    problems += [
        f"values differ: {sorted(k)} {want[k]} != {got[k]}"
        for k in want.keys() & got.keys()
        if want[k] != got[k]
    ]
    assert not problems, f"{len(problems)} differences:\n" + "\n".join(sorted(problems)[:40])
    jobs = {dict(k)["job"] for k in want}
    assert len(jobs) == len(CONFIGS), sorted(jobs)
    # The test proves something: many series, every config contributed real ones.
    real = {
        dict(k)["job"]
        for k in want
        if dict(k)["__name__"] not in ("up", "scrape_duration_seconds", "scrape_samples_scraped")
    }
    assert len(want) > 1500 and real == jobs - FAILING_JOBS, (len(want), jobs - real)
    # Facts the comparison rests on, asserted so a change in either is seen: Prometheus keeps `__`
    # labels made by metric relabeling, and a target dropped by relabel_configs is not scraped.
    assert any(dict(k).get("__tmp_gpu") == "0" for k in want)
    assert not any(dict(k)["job"] == "rl_target_drop" and dict(k)["instance"] == "kepler07" for k in want)
    ups = {dict(k)["job"]: v for k, v in want.items() if dict(k)["__name__"] == "up"}
    assert all(ups[job] == {"0.0"} for job in FAILING_JOBS)
