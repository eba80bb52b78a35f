"""``./dev demo`` (scripts/demo.py) as a user runs it: an outage on schedule, and Ctrl-C through a pipe."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = [sys.executable, str(ROOT / "scripts" / "demo.py"), "--interval", "1"]


def processes_in(workdir: str) -> list[str]:
    """Command lines of the live processes that name ``workdir`` (what the demo started there)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(
                (line for line in (entry / "status").read_text().splitlines() if line.startswith("State:")),
                "",
            )
        except OSError:
            continue
        if workdir in cmdline and "zombie" not in state:
            found.append(cmdline.strip())
    return found


def read_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if marker in line:
            return lines
    raise AssertionError(f"no {marker!r} in the demo's output:\n{''.join(lines)}")


@pytest.mark.timeout(180)
def test_an_outage_on_schedule_and_the_stack_recovers() -> None:
    proc = subprocess.run(
        [*DEMO, "--outage", "broker:at=4:for=6", "--duration", "22"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "edge-relay status --config" in out and "/status" in out
    assert re.search(r"outage: the broker is down for 6s", out), out
    assert "the broker is back" in out, out
    after = out.split("the broker is back", 1)[1]
    assert re.search(r"in Prometheus: \d+ series", after), out
    workdir = re.search(r"working directory (\S+)\)", out)
    assert workdir is not None
    assert processes_in(workdir[1]) == []


@pytest.mark.timeout(120)
def test_ctrl_c_stops_everything_even_when_the_pipe_reader_is_gone() -> None:
    """``./dev demo | tee log`` and Ctrl-C: tee goes first, the demo's next print has no reader. Every
    process the demo started must still stop."""
    proc = subprocess.Popen(
        DEMO, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
    try:
        lines = read_until(proc, "Press Ctrl-C", 90)
        workdir = re.search(r"working directory (\S+)\)", "".join(lines))
        assert workdir is not None
        assert any("edge_relay.cli" in p for p in processes_in(workdir[1]))
        assert proc.stdout is not None
        proc.stdout.close()  # the reader is gone, as tee is after Ctrl-C
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: the demo's process group
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 10
        while processes_in(workdir[1]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_in(workdir[1]) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
