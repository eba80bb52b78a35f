"""The relay caps glibc's malloc arenas at start (``edge_relay.app.limit_malloc_arenas``): threads
that allocate at the same time then share one arena instead of keeping a peak each. Checked in a child
process, by what glibc's own ``malloc_stats`` reports."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt arenas are glibc's")

# Four threads alive at once, each allocating (1000-byte objects: malloc, not pymalloc), then glibc's
# per-arena report on stderr.
CHILD = """
import ctypes, sys, threading
from edge_relay.app import limit_malloc_arenas
print(limit_malloc_arenas(), flush=True)
barrier = threading.Barrier(4)
kept = []
def work():
    barrier.wait()
    kept.append([bytearray(1000) for _ in range(100)])
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL(None).malloc_stats()
"""


def arenas(env: dict[str, str]) -> tuple[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout.strip(), sum(line.startswith("Arena ") for line in done.stderr.splitlines())


def test_threads_of_the_relay_share_one_arena() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    assert arenas(env) == ("True", 1)


def test_an_operators_malloc_arena_max_wins() -> None:
    env = {**os.environ, "MALLOC_ARENA_MAX": "8"}
    said, count = arenas(env)
    assert said == "False"
    assert count > 1  # the four threads got arenas of their own, as glibc gives them up to 8
