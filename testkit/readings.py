"""Readings of running processes: CPU and memory from ``/proc``, sizes on disk, a ``/metrics`` page."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

# One sample of a /metrics page: (name, labels, value).
MetricSample = tuple[str, dict[str, str], float]

_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStats:
    peak_rss_bytes: int  # VmHWM
    rss_bytes: int  # VmRSS
    cpu_seconds: float  # utime + stime


def _stat_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    after = stat[stat.rindex(")") + 2 :].split()  # fields from 3 (state) on; comm may contain spaces
    return (int(after[11]) + int(after[12])) / _CLK_TCK  # fields 14 and 15 of stat(5): utime, stime


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of ``pid`` from ``/proc/<pid>/stat`` (0.0 if there is no such process)."""
    if pid is None:
        return 0.0
    try:
        return _stat_cpu_seconds(pid)
    except OSError:
        return 0.0


def proc_stats(pid: int) -> ProcStats:
    """VmHWM / VmRSS from /proc/<pid>/status, utime + stime from /proc/<pid>/stat (OSError if gone)."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                fields[key] = int(rest.split()[0]) * 1024  # reported in kB
    return ProcStats(fields.get("VmHWM", 0), fields.get("VmRSS", 0), _stat_cpu_seconds(pid))


def path_bytes(*paths: Path) -> int:
    """Apparent size of files and directory trees (missing ones count 0)."""
    total = 0
    for p in paths:
        if p.is_file():
            with contextlib.suppress(OSError):
                total += p.stat().st_size
        elif p.is_dir():
            for root, _, files in os.walk(p):
                for name in files:
                    with contextlib.suppress(OSError):
                        total += (Path(root) / name).stat().st_size
    return total


def read_metrics(url: str, timeout: float = 5) -> list[MetricSample]:
    """Every sample of the text-format page at ``url``."""
    resp = requests.get(url, timeout=timeout)
    resp.raise_for_status()
    return [
        (s.name, dict(s.labels), float(s.value))
        for fam in text_string_to_metric_families(resp.text)
        for s in fam.samples
    ]


def _includes(lab: dict[str, str], labels: dict[str, str]) -> bool:
    return all(lab.get(k) == x for k, x in labels.items())


def metric_sum(samples: Iterable[MetricSample], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0 if there are none)."""
    return sum(v for n, lab, v in samples if n == name and _includes(lab, labels))


def histogram_buckets(samples: Iterable[MetricSample], name: str, **labels: str) -> dict[float, float]:
    """The cumulative bucket counts of histogram ``name`` (the label sets that include ``labels``,
    summed), by upper bound."""
    buckets: dict[float, float] = {}
    for n, lab, v in samples:
        if n == f"{name}_bucket" and _includes(lab, labels):
            le = float(lab["le"])
            buckets[le] = buckets.get(le, 0.0) + v
    return buckets


def bucket_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """``histogram_quantile`` as Prometheus computes it (linear inside the bucket; the highest finite
    bound if the quantile falls in +Inf); None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = le, count
    return lower


def fmt_bytes(n: int | None) -> str:
    """``123 KiB`` below a MiB, else ``4.5 MiB``; ``n/a`` for None."""
    if n is None:
        return "n/a"
    if n < 1024 * 1024:
        return f"{n / 1024:.0f} KiB"
    return f"{n / (1024 * 1024):.1f} MiB"
