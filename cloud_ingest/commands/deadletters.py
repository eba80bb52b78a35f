"""``cloud-ingest dead-letters``: list dead-lettered batches, and replay them once the cause is fixed.

Replay decodes each stored batch again (with the same checks as live traffic) and writes it to the
configured remote-write URL, or to ``--to URL`` (e.g. a VictoriaMetrics that accepts data older than
Prometheus' out-of-order window). A replayed batch is removed from the store; one that fails stays.
"""

from __future__ import annotations

import argparse
import time

from cloud_ingest import settings
from cloud_ingest.outcome.deadletters import DeadLetterStore
from cloud_ingest.pipeline.decode import Refused, decode
from cloud_ingest.sinks.remote_write.client import RemoteWriteClient
from relay_common.backoff import Backoff


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="cloud ingester config file (YAML)")
    parser.add_argument("action", nargs="?", choices=("list", "replay"), default="list", help="default: list")
    parser.add_argument("--limit", type=int, default=100, help="list: show at most this many (oldest first)")
    parser.add_argument(
        "--id", type=int, action="append", dest="ids", help="replay: this dead letter (repeatable)"
    )
    parser.add_argument("--all", action="store_true", help="replay: every dead letter")
    parser.add_argument("--to", help="replay: remote-write URL to use instead of the configured one")


def _list(store: DeadLetterStore, limit: int, path: str) -> int:
    letters = store.list(limit)
    if not letters:
        print(f"no dead letters in {path}")
        return 0
    print(f"{'id':>6}  {'received (UTC)':19}  {'node':20}  {'seq':>8}  {'bytes':>8}  reason")
    for d in letters:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d.received_ms / 1000))
        seq = "-" if d.seq is None else str(d.seq)
        node = f"{d.cluster or '?'}/{d.node or '?'}"
        print(f"{d.id:>6}  {when:19}  {node:20}  {seq:>8}  {d.payload_bytes:>8}  {d.reason}")
    return 0


def _replay(store: DeadLetterStore, s: settings.Settings, ids: list[int], url: str) -> int:
    client = RemoteWriteClient(
        url,
        timeout_s=s.remote_write_timeout_seconds,
        headers=s.remote_write_headers,
        connection=s.remote_write_connection,
        backoff=Backoff(s.retry_min_seconds, s.retry_max_seconds),
        max_retry_s=min(s.max_retry_seconds, 60.0),
    )
    failed = 0
    for letter_id in ids:
        stored = store.payload(letter_id)
        if stored is None:
            print(f"{letter_id}: no such dead letter")
            failed += 1
            continue
        topic, payload = stored
        try:
            decoded = decode(
                topic,
                payload,
                prefix=s.topic_prefix,
                limits=s.limits,
                max_future_seconds=s.max_future_seconds,
            )
        except Refused as r:
            print(f"{letter_id}: still invalid ({r.reason}: {r}); kept")
            failed += 1
            continue
        if decoded.refused is not None:
            # Part of it is still too far in the future: kept whole, to be replayed when its time comes.
            print(f"{letter_id}: still not writable ({decoded.refused_reason}); kept")
            failed += 1
            continue
        outcome = client.write(decoded.batch)
        if outcome.status == "written":
            store.delete(letter_id)
            print(
                f"{letter_id}: replayed {decoded.batch.sample_count} samples "
                f"of {decoded.node} seq {decoded.batch.seq}"
            )
        else:
            print(f"{letter_id}: {outcome.status}: {outcome.reason}; kept")
            failed += 1
    client.close()
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    s = settings.load(args.config)
    store = DeadLetterStore(s.dead_letter_path)
    try:
        if args.action == "list":
            return _list(store, args.limit, s.dead_letter_path)
        ids = [d.id for d in store.list(1_000_000)] if args.all else (args.ids or [])
        if not ids:
            print("nothing to replay: give --id N (repeatable) or --all")
            return 2
        return _replay(store, s, ids, args.to or s.remote_write_url)
    finally:
        store.close()
