"""The oracle: what the simulator served, recomputed independently, matched against a receiver.

- ``read_served_log`` / ``Served``: the simulator's log of the requests it answered (exporter, tick,
  time, format); ``expected_samples`` re-renders each payload and parses it with ``prometheus_client``
  (not with the relay's own parser), labelled as a scraper labels it.
- ``compare`` (the tests): every expected sample must be in the receiver with its exact value at its
  scrape's time, and nothing else; ``same_value`` compares bit for bit (NaN equals NaN).
- ``score`` / ``Score`` (the benches): the same matching, counted instead of asserted, for systems
  that may lose samples; ``SampleCounts`` counts the samples of a served payload; ``SYNTHETIC``: the
  series every scraper adds, left out of cross-system counts.

What arrived is read from a receiver here; what a ``testkit.rw_tap.RemoteWriteTap`` saw pass (which
served scrapes have arrived whole, and when) is read there, beside the tap.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from testkit.services import RawSamples

# Series every scraper adds per target and scrape (the union of ours, Prometheus' and vmagent's); the
# benches leave them out of every count so that the systems are compared on the exporters' samples only.
SYNTHETIC = frozenset(
    {
        "up",
        "scrape_duration_seconds",
        "scrape_samples_scraped",
        "scrape_samples_post_metric_relabeling",
        "scrape_series_added",
        "scrape_timeout_seconds",
    }
)


def _parse_independently(body: bytes, openmetrics: bool) -> list[tuple[str, dict[str, str], float]]:
    """Samples of one payload, parsed by prometheus_client (not by the relay's own parser)."""
    text = body.decode()
    if openmetrics:
        assert text.endswith("# EOF\n")
    # Comment lines go: prometheus_client renames typed counters lacking `_total`, and its strict
    # OpenMetrics parser refuses client_golang's family-name clashes (go_memstats_alloc_bytes gauge vs.
    # go_memstats_alloc_bytes_total counter). Without timestamps or exemplars the sample lines of both
    # formats are plain text-format lines.
    text = "\n".join(line for line in text.splitlines() if not line.startswith("#")) + "\n"
    assert " # {" not in text, "exemplars are not expected from the simulator"
    families = text_string_to_metric_families(text)
    return [(s.name, dict(s.labels), float(s.value)) for fam in families for s in fam.samples]


@dataclass(frozen=True)
class Served:
    exporter: str
    tick: int
    t_ms: int
    openmetrics: bool


def read_served_log(path: Path) -> list[Served]:
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("status", 200) == 200:
            out.append(Served(rec["exporter"], rec["tick"], rec["t_ms"], bool(rec.get("openmetrics"))))
    return out


def expected_samples(
    sim: Any,
    served: list[Served],
    *,
    jobs: dict[str, str],
    instances: dict[str, str],
    extra: dict[str, str],
) -> dict[frozenset[tuple[str, str]], list[tuple[int, float]]]:
    """labelset -> [(served time ms, value)] for every sample the simulator served."""
    out: dict[frozenset[tuple[str, str]], list[tuple[int, float]]] = defaultdict(list)
    for rec in served:
        body = sim.render(rec.exporter, rec.tick, openmetrics=rec.openmetrics)
        for name, labels, value in _parse_independently(body, rec.openmetrics):
            full = {k: v for k, v in labels.items() if v != ""}
            for k in ("job", "instance"):
                if k in full:
                    full[f"exported_{k}"] = full[k]
            full.update({"__name__": name, "job": jobs[rec.exporter], "instance": instances[rec.exporter]})
            for k, v in extra.items():
                full.setdefault(k, v)
            out[frozenset(full.items())].append((rec.t_ms, value))
    return out


def same_value(a: float, b: float, rel_tol: float = 0.0) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or (rel_tol > 0 and math.isclose(a, b, rel_tol=rel_tol))


def compare(
    expected: dict[frozenset[tuple[str, str]], list[tuple[int, float]]],
    actual: RawSamples,
    *,
    max_skew_ms: int = 1000,
    rel_tol: float = 0.0,
) -> list[str]:
    """Every expected sample must be in ``actual`` with its exact value, at the relay's scrape time
    (at most ``max_skew_ms`` before the simulator served it), and nothing else may be there."""
    problems: list[str] = []
    for key in sorted(set(expected) | set(actual), key=sorted):
        want, got = expected.get(key, []), actual.get(key, [])
        name = dict(key).get("__name__")
        if len(want) != len(got):
            problems.append(f"{name} {dict(key)}: expected {len(want)} samples, got {len(got)}")
            continue
        for (t_served, v_want), (t_got, v_got) in zip(want, got, strict=True):
            if not same_value(v_want, v_got, rel_tol):
                problems.append(f"{name} at {t_got}: expected value {v_want!r}, got {v_got!r}")
            if not (t_served - max_skew_ms <= t_got <= t_served):
                problems.append(
                    f"{name}: sample at {t_got} ms does not belong to the scrape served at {t_served} ms"
                )
        if len(problems) > 20:
            break
    return problems


# --- the benches' score ----------------------------------------------------------------------------


class SampleCounts:
    """Samples in what the simulator served at (exporter, tick, format): every non-comment line."""

    def __init__(self, simulator: Any) -> None:
        self.simulator = simulator
        self._cache: dict[tuple[str, int, bool], int] = {}

    def __call__(self, rec: Served) -> int:
        key = (rec.exporter, rec.tick, rec.openmetrics)
        n = self._cache.get(key)
        if n is None:
            body = self.simulator.render(rec.exporter, rec.tick, openmetrics=rec.openmetrics).decode()
            n = sum(1 for line in body.splitlines() if line and not line.startswith("#"))
            self._cache[key] = n
        return n


@dataclass
class Score:
    """Expected samples matched against what the receiver holds."""

    expected: int = 0
    delivered: int = 0
    value_mismatches: int = 0
    max_rel_error: float = 0.0  # of the mismatched values
    extra: int = 0
    missing_by_scrape: Counter[tuple[str, int]] = field(default_factory=Counter)  # (job, served t_ms)

    @property
    def missing(self) -> int:
        return self.expected - self.delivered


def score(
    expected: Mapping[frozenset[tuple[str, str]], list[tuple[int, float]]],
    actual: RawSamples,
    *,
    skew_before_ms: int,
    skew_after_ms: int,
    until_ms: int,
    same_value: Callable[[float, float], bool],
) -> Score:
    """Match every expected (served time, value) to the latest receiver sample of the same series
    stamped in ``[served - skew_before, served + skew_after]`` and not matched yet.

    Unmatched receiver samples up to ``until_ms - skew_before`` count as extra (later ones may belong
    to scrapes served after ``until_ms``).
    """
    out = Score()
    limit = until_ms - skew_before_ms
    for key, want in expected.items():
        got = actual.get(key, [])
        stamps = [t for t, _ in got]
        used: set[int] = set()
        job = dict(key).get("job", "")
        for t_served, value in want:
            out.expected += 1
            # The latest sample not yet taken that was stamped before the request was served.
            i = bisect.bisect_right(stamps, t_served + skew_after_ms) - 1
            while i >= 0 and i in used:
                i -= 1
            if i >= 0 and stamps[i] >= t_served - skew_before_ms:
                used.add(i)
                out.delivered += 1
                if not same_value(value, got[i][1]):
                    out.value_mismatches += 1
                    with contextlib.suppress(ArithmeticError):
                        rel = abs(got[i][1] - value) / max(abs(value), abs(got[i][1]))
                        out.max_rel_error = max(out.max_rel_error, rel)
            else:
                out.missing_by_scrape[(job, t_served)] += 1
        out.extra += sum(1 for i, t in enumerate(stamps) if i not in used and t <= limit)
    for key, got in actual.items():
        if key not in expected:
            out.extra += sum(1 for t, _ in got if t <= limit)
    return out
