"""How ``edge-relay status`` shows a snapshot (``edge_relay.commands.status.snapshot``): text and HTML.

One function, ``rows``, turns a snapshot into labelled lines with a severity; plain text joins them, and
with ``rich`` installed (the ``status`` extra: ``pip install kepler-edge-relay[status]``) ``--watch``
draws the same lines in colour with a progress bar of the backlog draining, redrawn in place. Without
rich (the sidecar image leaves it out: it and pygments are about 13 MB) ``--watch`` redraws plain text.

``render_html`` is the relay's ``/status`` page: the same lines (the targets as a table, one column per
field, as Prometheus' and vmagent's target pages show them), one self-contained document without
scripts or external assets, every value escaped (target errors come from exporters, hostile by rule).
"""

from __future__ import annotations

import html
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Snapshot = dict[str, Any]
BAR_WIDTH = 30


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    text: str
    severity: str = "info"  # info | good | warn | bad


class Peak:
    """The largest backlog since the spool was last empty: the 100% of the drain progress bar."""

    def __init__(self) -> None:
        self.rows = 0

    def fraction(self, rows: int | None) -> float | None:
        """Share of that backlog drained so far (1.0 with an empty spool); None when unknown."""
        if rows is None:
            return None
        if rows == 0:
            self.rows = 0
            return 1.0
        self.rows = max(self.rows, rows)
        return (self.rows - rows) / self.rows


# --- formatting -------------------------------------------------------------------------------------------


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_time(ts: float | None, *, date: bool = False) -> str:
    if ts is None:
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC" if date else "%H:%M:%S UTC", time.gmtime(ts))


def _n(x: float | None) -> str:
    return "?" if x is None else f"{int(x):,}"


def _rate(x: float | None, unit: str) -> str:
    return "?" if x is None else f"{x:.1f} {unit}/s"


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    done = round(max(0.0, min(1.0, fraction)) * width)
    return "[" + "#" * done + "-" * (width - done) + f"] {fraction * 100:3.0f}%"


# --- the lines --------------------------------------------------------------------------------------------


def _link(snap: Snapshot) -> Row:
    relay, now = snap["relay"], snap["timestamp_seconds"]
    if not relay["relay_reachable"]:
        return Row("link", relay["error"] or "relay not running / metrics unreachable", "bad")
    since = relay["since"]
    when = "" if since is None else f" since {fmt_time(since)} ({fmt_duration(now - since)})"
    if relay["connected"]:
        inflight = relay["inflight_batches"]
        extra = "" if inflight is None else f", {_n(inflight)} batch(es) in flight"
        return Row("link", f"connected to {relay['broker']}{when}{extra}", "good")
    return Row("link", f"disconnected from {relay['broker']}{when}", "bad")


def _link_why(snap: Snapshot) -> list[Row]:
    """Below the link: why it is down (the last connection error), or that the cloud stopped acking."""
    relay, now = snap["relay"], snap["timestamp_seconds"]
    err = relay.get("last_error")
    if relay["connected"] is False and err is not None:
        ts = err["timestamp_seconds"]
        when = "" if ts is None else f" {fmt_time(ts)} ({fmt_duration(now - ts)} ago)"
        return [Row("", f"last error{when}: {err['reason']}: {err['message']}", "bad")]
    stalled = relay.get("acked_nothing_since")
    if relay["connected"] and stalled is not None:
        never = "" if relay.get("last_ack_timestamp_seconds") else " (no ack since the relay connected)"
        return [
            Row(
                "",
                f"cloud has acked nothing since {fmt_time(stalled)} ({fmt_duration(now - stalled)})"
                f"{never}; ack timeout {relay['ack_timeout_seconds']:g}s",
                "bad",
            )
        ]
    return []


def _backlog(snap: Snapshot) -> list[Row]:
    sp = snap["spool"]
    if "rows" not in sp:
        return [Row("backlog", sp["error"] or f"spool {sp['path']} cannot be read", "warn")]
    text = f"{_n(sp['rows'])} batches, {fmt_bytes(sp['bytes'])}, {_n(sp['samples'])} samples"
    if sp["oldest_unsent_timestamp_seconds"] is not None:
        text += (
            f"; oldest unsent {fmt_time(sp['oldest_unsent_timestamp_seconds'], date=True)}"
            f" ({fmt_duration(sp['oldest_unsent_age_seconds'])} ago)"
        )
    rows = [Row("backlog", text, "info" if sp["rows"] < 10 else "warn")]
    if sp["staged_rows"]:
        rows.append(
            Row(
                "",
                f"+ {_n(sp['staged_rows'])} cycle(s), {_n(sp['staged_samples'])} samples, "
                "staged for the batch window",
            )
        )
    if sp["quarantined_rows"]:
        rows.append(Row("", f"{_n(sp['quarantined_rows'])} corrupt row(s) in quarantine", "warn"))
    oldest, newest = sp.get("recorder_oldest_timestamp_seconds"), sp.get("recorder_newest_timestamp_seconds")
    if oldest is not None and newest is not None:
        rows.append(
            Row(
                "recorder",
                f"{fmt_bytes(sp['recorder_bytes'])} at full resolution, {fmt_time(oldest, date=True)} to "
                f"{fmt_time(newest, date=True)} ({fmt_duration(newest - oldest)})",
            )
        )
    return rows


def _drain(snap: Snapshot) -> Row:
    d = snap["drain"]
    state = d["state"]
    parts = [state]
    if d["acked_batches_per_second"] is not None:
        parts.append(f"{d['acked_batches_per_second']:.1f} batches/s acked")
    if d["sent_payload_bytes_per_second"] is not None:
        parts.append(f"{fmt_bytes(d['sent_payload_bytes_per_second'])}/s sent")
    if d["backlog_rows_per_second"] is not None and state != "empty":
        parts.append(f"backlog {d['backlog_rows_per_second']:+.1f} batches/s")
    if state == "draining":
        parts.append(f"empty in ~{fmt_duration(d['eta_seconds'])}")
    text = parts[0] + (": " + ", ".join(parts[1:]) if parts[1:] else "")
    if d["interval_seconds"]:
        text += f" (over {d['interval_seconds']:.0f}s)"
    severity = {"empty": "good", "draining": "info", "growing": "warn"}.get(state, "info")
    return Row("drain", text, severity)


def _budget(snap: Snapshot) -> Row:
    b = snap["budget"]
    if b is None:
        return Row("budget", "none (no budget_file)")
    if b["state"] is None and b["degrade_level"] is None:
        return Row("budget", f"{b['file']} (state unknown: relay not reachable)", "info")
    classes = ", ".join(
        f"{name} {'?' if c['resolution_seconds'] is None else format(c['resolution_seconds'], 'g')}s"
        for name, c in sorted(b["classes"].items())
        if c["degrade_level"]
    )
    text = (
        f"{b['state'] or '?'}, degrade level {b['degrade_level'] if b['degrade_level'] is not None else '?'}"
    )
    if classes:
        text += f" ({classes})"
    text += f"; allowed {fmt_bytes(b['allowed_bytes_per_second'])}/s"
    wire = snap["drain"]["wire_bytes_per_second"]
    if wire is not None:
        text += f", wire {fmt_bytes(wire)}/s"
    if b["quota_used_bytes"]:
        text += f", quota used today {fmt_bytes(b['quota_used_bytes'])}"
    return Row("budget", text, "good" if b["state"] == "ok" else "warn")


def _losses(snap: Snapshot) -> Row:
    lo = snap["losses"]
    if lo["total"] is None:
        return Row("losses", "unknown (neither the spool nor the relay could be read)", "warn")
    if not lo["total"]:
        return Row("losses", "none: no sample dropped", "good")
    by = ", ".join(f"{reason}={n:,}" for reason, n in sorted(lo["by_reason"].items()))
    return Row("losses", f"{lo['total']:,} samples: {by}", "warn")


def _targets(snap: Snapshot) -> list[Row]:
    now = snap["timestamp_seconds"]
    rows = []
    for i, (name, t) in enumerate(sorted(snap["targets"].items())):
        text = f"{name}: {t['health']}"
        if t["scrapes_ok"] is not None:
            text += f" ({_n(t['scrapes_ok'])} ok, {_n(t['scrapes_failed'])} failed)"
        if t["last_error"]:
            when = t["last_error_timestamp_seconds"]
            text += f"; last error {fmt_time(when)} ({fmt_duration(now - when)} ago): {t['last_error']}"
        severity = {"ok": "good", "failing": "bad"}.get(t["health"], "info")
        rows.append(Row("targets" if i == 0 else "", text, severity))
    return rows


def rows(snap: Snapshot, progress: float | None = None, *, targets: bool = True) -> list[Row]:
    """The status as labelled lines; ``progress`` (watch only): the share of the backlog drained;
    without ``targets`` the lines above the targets (the page shows those as a table)."""
    out = [
        Row(
            "status",
            f"node {snap['node']}, cluster {snap['cluster']}, "
            f"at {fmt_time(snap['timestamp_seconds'], date=True)}",
        )
    ]
    out.append(_link(snap))
    out += _link_why(snap)
    out += _backlog(snap)
    out.append(_drain(snap))
    if progress is not None:
        out.append(Row("progress", f"{bar(progress)} of the backlog drained"))
    out.append(_budget(snap))
    out.append(_losses(snap))
    if targets:
        out += _targets(snap)
    return out


def render_plain(snap: Snapshot, progress: float | None = None) -> str:
    return "\n".join(f"{r.label:<9}{r.text}".rstrip() for r in rows(snap, progress))


# --- the web page ------------------------------------------------------------------------------------------

_PAGE_REFRESH_S = 10
_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; background: #fff; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.5em; }
table { border-collapse: collapse; } td, th { padding: 0.25em 0.8em; text-align: left; vertical-align: top; }
th { background: #eee; } tr + tr td { border-top: 1px solid #ddd; }
.label { font-weight: bold; color: #256; white-space: nowrap; }
.good { color: #17621b; } .warn { color: #8a5a00; } .bad { color: #b00020; font-weight: bold; }
.num { text-align: right; } .error { font-family: monospace; overflow-wrap: anywhere; }
"""


def _cell(value: object, css: str = "") -> str:
    text = "" if value is None else str(value)
    return f'<td class="{css}">{html.escape(text)}</td>' if css else f"<td>{html.escape(text)}</td>"


def _targets_table(snap: Snapshot) -> str:
    now = snap["timestamp_seconds"]
    head = (
        "<tr><th>target</th><th>health</th><th>scrapes ok</th><th>failed</th><th>samples</th>"
        "<th>samples/scrape</th><th>mean duration</th><th>last error</th><th>error</th></tr>"
    )
    lines = [head]
    for name, t in sorted(snap["targets"].items()):
        when = t["last_error_timestamp_seconds"]
        duration = t.get("mean_scrape_seconds")
        lines.append(
            '<tr class="target">'
            + _cell(name, "label")
            + _cell(t["health"], {"ok": "good", "failing": "bad"}.get(t["health"], ""))
            + _cell(_n(t["scrapes_ok"]), "num")
            + _cell(_n(t["scrapes_failed"]), "num")
            + _cell(_n(t.get("samples_scraped")), "num")
            + _cell(t.get("samples_per_scrape") if t.get("samples_per_scrape") is not None else "?", "num")
            + _cell("?" if duration is None else f"{duration * 1000:.1f} ms", "num")
            + _cell("" if when is None else f"{fmt_time(when)} ({fmt_duration(now - when)} ago)")
            + _cell(t["last_error"] or "", "error")
            + "</tr>"
        )
    return '<table id="targets">' + "\n".join(lines) + "</table>"


def render_html(snap: Snapshot) -> str:
    """The snapshot as one HTML document: the status lines, then the targets as a table."""
    summary = "\n".join(
        f'<tr class="{r.severity}"><td class="label">{html.escape(r.label)}</td>'
        f'<td class="{r.severity}">{html.escape(r.text)}</td></tr>'
        for r in rows(snap, targets=False)
    )
    title = f"edge-relay {snap['cluster']}/{snap['node']}"
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{_PAGE_REFRESH_S}">'
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>\n"
        f"<h1>{html.escape(title)}</h1>\n"
        f'<table id="status">\n{summary}\n</table>\n'
        f"<h2>Targets</h2>\n{_targets_table(snap)}\n"
        f"<p>Refreshed every {_PAGE_REFRESH_S}s; the same data as <code>edge-relay status --json</code>. "
        '<a href="/metrics">/metrics</a></p>\n'
        "</body></html>\n"
    )


# --- --watch --------------------------------------------------------------------------------------------


def _rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def render_rich(snap: Snapshot, progress: float | None) -> Any:
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    styles = {"info": "", "good": "green", "warn": "yellow", "bad": "bold red"}
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column()
    for r in rows(snap):
        grid.add_row(r.label, Text(r.text, style=styles[r.severity]))
        if r.label == "drain" and progress is not None:
            line = Table.grid(padding=(0, 1))
            line.add_row(
                ProgressBar(total=1.0, completed=progress, width=BAR_WIDTH),
                Text(f"{progress * 100:3.0f}% of the backlog drained"),
            )
            grid.add_row("progress", line)
    return grid


def watch(next_snapshot: Callable[[], Snapshot], interval: float, peak: Peak, *, plain: bool) -> None:
    """Redraw until interrupted (Ctrl-C raises KeyboardInterrupt to the caller)."""
    if not plain and _rich_available():
        from rich.live import Live

        snap = next_snapshot()
        with Live(render_rich(snap, peak.fraction(snap["spool"].get("rows"))), auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                snap = next_snapshot()
                live.update(render_rich(snap, peak.fraction(snap["spool"].get("rows"))), refresh=True)
    clear = sys.stdout.isatty()
    while True:
        snap = next_snapshot()
        text = render_plain(snap, peak.fraction(snap["spool"].get("rows")))
        # Home and clear on a terminal; appended readings, a blank line apart, into a pipe or file.
        sys.stdout.write(("\x1b[H\x1b[2J" if clear else "\n") + text + "\n")
        sys.stdout.flush()
        time.sleep(interval)
