"""``edge-relay budget plan``: what the configured targets would cost on the uplink, class by class.

It scrapes every target once, sorts the samples into the budget's classes and estimates each class's
bytes per second, first at full resolution, then degraded the way the relay's controller degrades:
lowest priority (last) class first, its resolution doubled step by step up to its
``max_resolution_seconds``, critical (non-degradable) classes never, until the estimate fits.

Cost model, per class: one scrape of the class encoded as a batch with the relay's wire format gives
the cost of a batch's label table (plus one value per series); each further sample of the batch window
costs ``VALUE_BYTES_PER_SAMPLE``, plus ``VALUE_BYTES_PER_DOUBLING`` for each doubling of the class's
resolution over the scrape interval (larger deltas). One batch per ``batch_window_seconds`` (or per
resolution step, when that is longer). A window's batch larger than the relay's cap
(``UplinkBudget.batch_cap``: the burst less the MQTT framing) is split by series into parts that each repeat
the label strings they share; the estimate then scales every label table by what splitting this
scrape into as many parts costs. MQTT framing, acks and status messages add a few bytes per second and
are left out.
``plan`` is pure (no I/O, no clock) so the controller's tests can reuse it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from array import array
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from edge_relay import settings as settings_mod
from edge_relay.budget import model as budget_mod
from edge_relay.budget.model import DAYS, Budget
from edge_relay.collect.shape import ShapedScrape
from edge_relay.collect.targets import TargetLoop
from edge_relay.encode.batches import series_parts
from edge_relay.selfmetrics import RelayMetrics
from relay_common.config import ConfigError
from schemas import codec
from schemas.model import Batch, Labels, ScrapeBlock

# Bytes a sample costs in a batch whose label table is already paid for: the v2 columnar codec's
# delta-encoded, zstd-compressed values, as measured by bench/codec_bench.py on the simulator's series
# (0.7-1.1 B by class at the 5 s scrape interval) ...
VALUE_BYTES_PER_SAMPLE = 1.0
# ... and what each doubling of the resolution adds (longer steps, larger deltas): Kepler's counters
# cost 0.96 B/sample at 5 s and 1.61 at 15 s in a 60 s window of the simulator's workload.
VALUE_BYTES_PER_DOUBLING = 0.4
# Any fixed time will do: the estimate must not depend on when it runs.
_PLAN_TIMESTAMP_MS = 1_700_000_000_000
# A seq as a relay has after years of batches (msgpack writes it in 5 bytes, not 1).
_PLAN_SEQ = 1 << 32
SECONDS_PER_DAY = 86_400
# What the estimate rests on, printed with it: the series are the relay's own (the same collect stage),
# the bytes a sample costs are a model.
TRUST = (
    "series and label tables are exact for this one scrape (the relay's own scrape, relabeling and "
    "shaping); value bytes are a model (1.0 B/sample, +0.4 per resolution doubling) measured on "
    "simulated values: real GPU telemetry, whose power, energy and clocks change every sample, can cost "
    "several times more; a target whose series come and go (pod churn) costs more than one scrape shows"
)

Sample = tuple[Labels, float]


@dataclass(frozen=True, slots=True)
class ClassPlan:
    """One class's estimate. Resolutions in seconds, costs in bytes per second."""

    name: str
    series: int
    samples_per_scrape: int
    table_bytes: int  # one scrape of the class encoded as a batch: label table + one value per series
    degradable: bool
    full_resolution_s: float  # the configured resolution, at least the scrape interval
    full_bytes_per_second: float
    max_resolution_s: float  # = full_resolution_s for a class that never degrades
    resolution_s: float  # what the class runs at under the budget
    bytes_per_second: float
    batch_parts: int = 1  # parts the largest window's batch is split into under the budget (all classes)

    @property
    def degraded(self) -> bool:
        return self.resolution_s > self.full_resolution_s


def encoded_scrape_bytes(
    samples: Sequence[Sample],
    *,
    cluster: str = "default",
    node: str = "node",
    version: int = codec.FORMAT_V2,
    parts: int = 1,
) -> int:
    """Size on the wire of one scrape of ``samples`` as a batch of its own, or as ``parts`` batches
    split by series the way the relay splits a window (split further if too large for a message)."""
    table: dict[Labels, float] = {}
    for labels, value in samples:
        table.setdefault(labels, value)  # a series appears once per scrape (the shaper drops repeats)
    if not table:
        return 0
    if parts > 1 and len(table) > 1:
        scrape = ShapedScrape("plan", _PLAN_TIMESTAMP_MS, list(table), array("d", table.values()))
        return sum(
            encoded_scrape_bytes(
                list(zip(part.labels, part.values, strict=True)), cluster=cluster, node=node, version=version
            )
            for [part] in series_parts([scrape], min(parts, len(table)))
        )
    block = ScrapeBlock(_PLAN_TIMESTAMP_MS, array("I", range(len(table))), array("d", table.values()))
    batch = Batch(cluster=cluster, node=node, seq=_PLAN_SEQ, labelsets=list(table), scrapes=[block])
    try:
        return len(codec.encode_batch(batch, version=version))
    except codec.EncodeError as e:
        if e.reason not in ("oversized", "decompression_limit") or len(table) < 2:
            raise
    # Like the relay's encoder: a scrape too large for one message goes out in parts.
    items = list(table.items())
    mid = len(items) // 2
    return encoded_scrape_bytes(items[:mid], cluster=cluster, node=node, version=version) + (
        encoded_scrape_bytes(items[mid:], cluster=cluster, node=node, version=version)
    )


def estimate_bytes_per_second(
    table_bytes: int, samples: int, resolution_s: float, window_s: float, interval_s: float | None = None
) -> float:
    """A class's cost: one label table per batch, ``VALUE_BYTES_PER_SAMPLE`` per further sample, plus
    ``VALUE_BYTES_PER_DOUBLING`` for each doubling of ``resolution_s`` over the scrape interval."""
    if samples == 0:
        return 0.0
    if resolution_s >= window_s:
        return table_bytes / resolution_s  # a batch carries the class only once per resolution step
    further = (window_s / resolution_s - 1) * samples
    doublings = math.log2(resolution_s / interval_s) if interval_s and resolution_s > interval_s else 0.0
    value_bytes = VALUE_BYTES_PER_SAMPLE + VALUE_BYTES_PER_DOUBLING * doublings
    return (table_bytes + further * value_bytes) / window_s


def steady_rate(budget: Budget, now: float | None = None) -> float:
    """The rate to plan for: the window rate at ``now`` (the sustained rate without ``now``), at most
    the daily quota spread evenly over a day, which is what can be kept up day after day."""
    up = budget.uplink
    rate = float(up.sustained_bytes_per_second if now is None else up.rate_at(up.local_time(now)))
    if up.daily_quota_bytes:
        rate = min(rate, up.daily_quota_bytes / SECONDS_PER_DAY)
    return rate


def plan(
    budget: Budget,
    samples_by_class: Mapping[str, Sequence[Sample]],
    interval_s: float,
    *,
    allowed_bytes_per_second: float | None = None,
    cluster: str = "default",
    node: str = "node",
    version: int = codec.FORMAT_V2,
    batch_max_bytes: int = 1_000_000,
) -> list[ClassPlan]:
    """Per class of ``budget`` (in its order): cost at full resolution and at the resolution that fits.

    ``samples_by_class`` holds one scrape's samples by class name (missing classes have none);
    ``allowed_bytes_per_second`` defaults to ``steady_rate(budget)``. When even the fully degraded
    plan does not fit, every degradable class is at its maximum and the sum stays above the rate.
    ``version`` and ``batch_max_bytes`` are the relay's ``batch.format_version`` and ``batch.max_bytes``.
    """
    if interval_s <= 0:
        raise ValueError("interval_s must be > 0")
    unknown = set(samples_by_class) - {c.name for c in budget.classes}
    if unknown:
        raise ValueError(f"no such class(es) in {budget.source}: {', '.join(sorted(unknown))}")
    allowed = steady_rate(budget) if allowed_bytes_per_second is None else allowed_bytes_per_second
    window = budget.uplink.batch_window_seconds
    cap = budget.uplink.batch_cap(batch_max_bytes)
    counts, series, tables, full, ceiling = [], [], [], [], []
    for cls in budget.classes:
        samples = samples_by_class.get(cls.name, ())
        counts.append(len(samples))
        series.append(len({labels for labels, _ in samples}))
        tables.append(encoded_scrape_bytes(samples, cluster=cluster, node=node, version=version))
        res = max(cls.resolution_s, interval_s)
        full.append(res)
        ceiling.append(max(res, cls.max_resolution_s) if cls.degradable else res)
    everything = [sample for samples in samples_by_class.values() for sample in samples]
    whole = encoded_scrape_bytes(everything, cluster=cluster, node=node, version=version)
    split_cost: dict[int, float] = {1: 1.0}

    def costs(resolution: Sequence[float], parts: int) -> list[float]:
        if parts not in split_cost:
            split = encoded_scrape_bytes(everything, cluster=cluster, node=node, version=version, parts=parts)
            split_cost[parts] = max(1.0, split / whole) if whole else 1.0
        scale = split_cost[parts]
        return [
            estimate_bytes_per_second(round(tables[i] * scale), counts[i], resolution[i], window, interval_s)
            for i in range(len(tables))
        ]

    def parts_for(resolution: Sequence[float], cost: Sequence[float]) -> int:
        # The largest window: the one where every class's batch falls at once.
        largest = sum(c * max(window, r) for c, r in zip(cost, resolution, strict=True))
        return max(1, math.ceil(largest / cap))

    def settle(parts: int) -> tuple[list[float], list[float], int]:
        """Resolutions that fit, their costs, and the parts they need (a fixed point in a few rounds)."""
        for _ in range(4):
            resolution = list(full)
            cost = costs(resolution, parts)
            for i in reversed(range(len(cost))):
                while sum(cost) > allowed and resolution[i] < ceiling[i]:
                    resolution[i] = min(resolution[i] * 2, ceiling[i])
                    cost = costs(resolution, parts)
            needed = parts_for(resolution, cost)
            if needed <= parts:
                break
            parts = needed
        return resolution, cost, parts

    full_cost = costs(full, 1)
    full_cost = costs(full, parts_for(full, full_cost))
    resolution, cost, parts = settle(1)
    return [
        ClassPlan(
            name=cls.name,
            series=series[i],
            samples_per_scrape=counts[i],
            table_bytes=tables[i],
            degradable=cls.degradable,
            full_resolution_s=full[i],
            full_bytes_per_second=full_cost[i],
            max_resolution_s=ceiling[i],
            resolution_s=resolution[i],
            bytes_per_second=cost[i],
            batch_parts=parts,
        )
        for i, cls in enumerate(budget.classes)
    ]


def classify_scrapes(budget: Budget, scrapes: Iterable[ShapedScrape]) -> dict[str, list[Sample]]:
    """Samples by class name, every class present (in the budget's order)."""
    out: dict[str, list[Sample]] = {c.name: [] for c in budget.classes}
    names = [c.name for c in budget.classes]
    for scrape in scrapes:
        for labels, value in zip(scrape.labels, scrape.values, strict=True):
            out[names[budget.classify(labels)]].append((labels, value))
    return out


# --------------------------------------------------------------------------------------------------
# The command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="budget_command", required=True, metavar="SUBCOMMAND")
    help_text = (
        "scrape every target once and estimate each class's bytes/s, at full resolution and under the budget"
    )
    p = sub.add_parser("plan", help=help_text, description=help_text)
    p.add_argument("--config", required=True, help="edge relay config file (YAML)")
    p.add_argument("--budget", help="bandwidth-budget file (default: the config's budget_file)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    if args.budget_command == "plan":
        return run_plan(args)
    raise AssertionError(args.budget_command)  # argparse allows only the sub-commands above


def scrape_target(target: settings_mod.Target, s: settings_mod.Settings) -> tuple[ShapedScrape, str]:
    """One scrape of ``target`` through the relay's own collect stage (scrape, parse, the target's
    ``metric_relabel_configs``, target labels, label limits), and the error ("" when it worked): the
    plan counts the series the relay would ship, not the ones the exporter exposes."""
    loop = TargetLoop(target, s, RelayMetrics())
    try:
        shaped = loop.run_once()
    finally:
        loop.scraper.close()
    return shaped, loop.last_error


def scrape_once(s: settings_mod.Settings) -> tuple[list[ShapedScrape], dict[str, str]]:
    """One scrape of every target (in parallel, as the relay does); also the errors of failed ones."""
    with ThreadPoolExecutor(max_workers=max(1, len(s.targets))) as pool:
        results = list(pool.map(lambda t: scrape_target(t, s), s.targets))
    failed = {t.name: error for t, (_, error) in zip(s.targets, results, strict=True) if error}
    return [shaped for shaped, _ in results], failed


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _window_text(w: budget_mod.RateWindow) -> str:
    def hhmm(minute: int) -> str:
        return f"{minute // 60:02d}:{minute % 60:02d}"

    days = "every day" if len(w.days) == 7 else ",".join(DAYS[d] for d in sorted(w.days))
    return f"{hhmm(w.start_minute)}-{hhmm(w.end_minute)} {days}"


def report(
    budget: Budget,
    plans: Sequence[ClassPlan],
    *,
    allowed: float,
    now: float,
    interval_s: float,
    targets: int,
    failed: Mapping[str, str],
    version: int = codec.FORMAT_V2,
    batch_max_bytes: int = 1_000_000,
    relabel_dropped: int = 0,
) -> dict[str, Any]:
    """Everything ``plan`` prints, as data (the --json output)."""
    up = budget.uplink
    local = up.local_time(now)
    window = next((w for w in up.windows if w.covers(local)), None)
    total = sum(p.bytes_per_second for p in plans)
    fits = total <= allowed
    warnings = [
        f"target {t}: scrape failed ({error}): its series are missing from the estimate"
        for t, error in failed.items()
    ]
    warnings += budget.warnings(batch_max_bytes)
    parts = max((p.batch_parts for p in plans), default=1)
    cap = up.batch_cap(batch_max_bytes)
    if parts > 1:
        warnings.append(
            f"the largest batch window is split into {parts} batches of at most {cap} B "
            f"(burst_bytes - 512, at most batch.max_bytes): each repeats the label strings it shares "
            "with the others, which the estimate includes"
        )
    if not fits:
        critical = sum(p.bytes_per_second for p in plans if not p.degradable)
        warnings.append(
            f"does not fit: with every degradable class at its max_resolution_seconds the estimate is "
            f"{total:.1f} B/s, above the allowed {allowed:.1f} B/s (the classes that never degrade "
            f"need {critical:.1f} B/s); raise the budget, or let more classes degrade further"
        )
    return {
        "budget": budget.source,
        "codec_version": version,
        "batch_cap_bytes": cap,
        "batch_parts": parts,
        "interval_seconds": interval_s,
        "batch_window_seconds": up.batch_window_seconds,
        "targets": targets,
        "failed_targets": dict(failed),
        "classes": [{**asdict(p), "degraded": p.degraded} for p in plans],
        "total": {
            "series": sum(p.series for p in plans),
            "samples_per_scrape": sum(p.samples_per_scrape for p in plans),
            "full_bytes_per_second": sum(p.full_bytes_per_second for p in plans),
            "bytes_per_second": total,
        },
        "allowed_bytes_per_second": allowed,
        "rate_now": {
            "local_time": local.isoformat(timespec="seconds"),
            "window": _window_text(window) if window else None,
            "bytes_per_second": up.rate_at(local),
        },
        "daily_quota_bytes": up.daily_quota_bytes,
        "estimated_bytes_per_day": total * SECONDS_PER_DAY,
        "fits": fits,
        "relabel_dropped_series": relabel_dropped,
        "trust": TRUST,
        "warnings": warnings,
    }


def render_table(rep: dict[str, Any]) -> str:
    header = ("class", "series", "samples/scrape", "full res", "full B/s", "budget res", "budget B/s", "")
    rows: list[tuple[str, ...]] = [header]
    for p in rep["classes"]:
        note = "critical" if not p["degradable"] else "degraded" if p["degraded"] else ""
        rows.append(
            (
                p["name"],
                str(p["series"]),
                str(p["samples_per_scrape"]),
                _seconds(p["full_resolution_s"]),
                f"{p['full_bytes_per_second']:.1f}",
                _seconds(p["resolution_s"]),
                f"{p['bytes_per_second']:.1f}",
                note,
            )
        )
    t = rep["total"]
    rows.append(
        (
            "total",
            str(t["series"]),
            str(t["samples_per_scrape"]),
            "",
            f"{t['full_bytes_per_second']:.1f}",
            "",
            f"{t['bytes_per_second']:.1f}",
            "",
        )
    )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        f"budget {rep['budget']}: {rep['targets']} target(s) scraped once, interval "
        f"{_seconds(rep['interval_seconds'])}, batch window {_seconds(rep['batch_window_seconds'])}, "
        f"codec v{rep['codec_version']}"
    ]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:-1], widths[1:-1], strict=True)]
        lines.append("  ".join([*cells, r[-1]]).rstrip())
    now = rep["rate_now"]
    where = f"window {now['window']}" if now["window"] else "sustained rate"
    lines.append(
        f"allowed: {rep['allowed_bytes_per_second']:.1f} B/s (now {now['local_time']}: {where}, "
        f"{now['bytes_per_second']} B/s"
        + (", capped by the daily quota spread over a day)" if rep["daily_quota_bytes"] else ")")
    )
    quota = f"quota {rep['daily_quota_bytes']} bytes" if rep["daily_quota_bytes"] else "no daily quota"
    per_day = rep["estimated_bytes_per_day"]
    lines.append(f"per day: {per_day:.0f} bytes ({per_day / 2**20:.1f} MiB) estimated; {quota}")
    if rep.get("relabel_dropped_series"):
        lines.append(
            f"relabeling: {rep['relabel_dropped_series']} exposed series dropped by metric_relabel_configs "
            "(not in the estimate, as the relay would not ship them)"
        )
    lines.append(f"trust: {rep['trust']}")
    lines.extend(f"WARNING: {w}" for w in rep["warnings"])
    if rep["fits"]:
        degraded = [f"{p['name']} to {_seconds(p['resolution_s'])}" for p in rep["classes"] if p["degraded"]]
        share = 100 * t["bytes_per_second"] / rep["allowed_bytes_per_second"]
        how = f" after degrading {', '.join(degraded)}" if degraded else " at full resolution"
        lines.append(f"OK: fits the budget{how} ({share:.0f}% of the allowed rate)")
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    s = settings_mod.load(args.config)
    path = args.budget or s.budget_file
    if not path:
        raise ConfigError(
            f"{args.config}: key `budget_file`: expected a bandwidth-budget file (set it, or pass --budget)"
        )
    b = budget_mod.load(path)
    scrapes, failed = scrape_once(s)
    now = time.time()
    allowed = steady_rate(b, now)
    plans = plan(
        b,
        classify_scrapes(b, scrapes),
        s.interval_seconds,
        allowed_bytes_per_second=allowed,
        cluster=s.cluster,
        node=s.node,
        version=s.format_version,
        batch_max_bytes=s.batch_max_bytes,
    )
    rep = report(
        b,
        plans,
        allowed=allowed,
        now=now,
        interval_s=s.interval_seconds,
        targets=len(scrapes),
        failed=failed,
        relabel_dropped=sum(x.relabel_dropped for x in scrapes),
        version=s.format_version,
        batch_max_bytes=s.batch_max_bytes,
    )
    if args.json:
        print(json.dumps(rep, indent=2, allow_nan=False))
        for warning in rep["warnings"]:
            print(f"WARNING: {warning}", file=sys.stderr)
    else:
        print(render_table(rep))
    return 0
