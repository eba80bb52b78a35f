"""``edge-relay ledger``: what this node gave up on purpose or by force, and why."""

from __future__ import annotations

import argparse
import time

from edge_relay import settings
from edge_relay.store.spool import Spool


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="edge relay config file (YAML)")
    parser.add_argument("--limit", type=int, default=50, help="show at most this many entries (newest first)")


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) if ms else "-"


def run(args: argparse.Namespace) -> int:
    s = settings.load(args.config)
    with Spool(s.spool_path, synchronous=s.spool_synchronous) as spool:
        totals = spool.losses.totals()
        entries = spool.losses.entries(args.limit)
        stats = spool.stats()
    state = "data lost" if sum(totals.values()) else "no data lost"
    print(f"spool {s.spool_path}: {stats.rows} batches ({stats.samples} samples) waiting; {state}")
    if not entries:
        return 0
    print("totals: " + ", ".join(f"{reason}={n}" for reason, n in sorted(totals.items())))
    print(f"{'recorded (UTC)':19}  {'reason':18}  {'samples':>9}  {'data from (UTC)':19}  {'to':19}  series")
    for e in entries:
        print(
            f"{_when(e.ts_ms):19}  {e.reason:18}  {e.samples:>9}  {_when(e.first_ts_ms):19}  "
            f"{_when(e.last_ts_ms):19}  {e.series}"
        )
    return 0
