"""``cloud-ingest dead-letters``: list dead-lettered batches."""

from __future__ import annotations

import argparse
import time

from cloud_ingest import settings
from cloud_ingest.deadletter import DeadLetterStore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="cloud ingester config file (YAML)")
    parser.add_argument("--limit", type=int, default=100, help="show at most this many (oldest first)")


def run(args: argparse.Namespace) -> int:
    s = settings.load(args.config)
    store = DeadLetterStore(s.dead_letter_path)
    try:
        letters = store.list(args.limit)
    finally:
        store.close()
    if not letters:
        print(f"no dead letters in {s.dead_letter_path}")
        return 0
    print(f"{'id':>6}  {'received (UTC)':19}  {'node':20}  {'seq':>8}  {'bytes':>8}  reason")
    for d in letters:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d.received_ms / 1000))
        seq = "-" if d.seq is None else str(d.seq)
        node = f"{d.cluster or '?'}/{d.node or '?'}"
        print(f"{d.id:>6}  {when:19}  {node:20}  {seq:>8}  {d.payload_bytes:>8}  {d.reason}")
    return 0
