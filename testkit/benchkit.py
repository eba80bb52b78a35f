"""What every bench in ``bench/`` does the same way: progress lines, a scratch directory, markdown
tables, the report written to ``bench/results/``, and the best of several timed rounds.

The benches are scripts (``python bench/<name>.py``), not a package: they share these through the
installed ``testkit`` rather than by importing one another.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

# The checkout the benches run from (testkit is installed in editable mode, never from a wheel).
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def log(msg: str) -> None:
    """A timestamped progress line on stderr (stdout carries the report)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table, columns padded; the first left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        out = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "| " + " | ".join(out) + " |"

    sep = "| " + " | ".join(["-" * widths[0]] + ["-" * (w - 1) + ":" for w in widths[1:]]) + " |"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def write_results(mode: str, report: str, started: float) -> Path:
    """Print ``report`` with the bench's wall time (since monotonic ``started``) and command line, and
    write it to ``bench/results/<timestamp>-<mode>.md``."""
    report += f"\nBench wall time {(time.monotonic() - started) / 60:.1f} min; `{shlex.join(sys.argv)}`.\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-{mode}.md"
    path.write_text(report)
    print(report)
    log(f"written to {path.relative_to(ROOT)}")
    return path


@contextlib.contextmanager
def workspace(arg: str | None, keep: bool, prefix: str) -> Iterator[Path]:
    """The bench's working directory: ``arg`` if given (always kept), else a fresh temporary one,
    removed after a clean run unless ``keep`` (kept after a failure, to read the logs)."""
    path = Path(arg) if arg else Path(tempfile.mkdtemp(prefix=prefix))
    path.mkdir(parents=True, exist_ok=True)
    ok = False
    try:
        yield path
        ok = True
    finally:
        if ok and not keep and not arg:
            shutil.rmtree(path, ignore_errors=True)
        else:
            log(f"working directory kept: {path}")


def best_of(rounds: int, fn: Callable[[], object]) -> float:
    """The least CPU time (seconds, this process) ``fn`` took in ``rounds`` calls."""
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best
