"""``cloud-ingest backfill``: ask one edge relay to send the raw samples of a time range again.

It connects to the broker with the ingester's identity and connection settings (``--config``: only the
ingester may publish commands, the broker's ACL sees to that), under a client id of its own so the
running ingester's session is left alone; subscribes to the node's ``cmd_result`` topic, publishes a
``BackfillRequest`` on its ``cmd`` topic (QoS 1, not retained) and prints the relay's result: what it
supplied (samples, series, batches, time range: now in its spool, on its way like an outage backlog)
and what it could not (older than the recorder holds, not recorded, ...). Exit status 0 when the relay
supplied the range (even in part: see ``missing``), 3 when it refused or failed, 1 without an answer
within ``--wait`` seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import secrets
import sys
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt

from cloud_ingest import settings as settings_mod
from cloud_ingest.commands.broker import tool_client, tool_connect
from schemas import topics
from schemas.codec import DecodeError, EncodeError
from schemas.codec.command import BackfillRequest, CommandResult, decode_result, encode_request


def parse_time(text: str) -> int:
    """Unix seconds (``1764590400``, ``1764590400.5``) or RFC 3339 with an offset, as milliseconds."""
    try:
        return round(float(text) * 1000)
    except ValueError:
        pass
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither unix seconds nor RFC 3339") from None
    if when.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r}: RFC 3339 needs an offset (Z or +hh:mm)")
    return round(when.timestamp() * 1000)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="cloud ingester config file (YAML)")
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--from", dest="start", required=True, type=parse_time, help="RFC 3339 or unix s")
    parser.add_argument("--to", dest="end", required=True, type=parse_time, help="RFC 3339 or unix s")
    parser.add_argument("--match", help='series selector, e.g. {__name__=~"DCGM_.*",gpu="3"}')
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the result")
    parser.add_argument("--json", action="store_true", help="print the result message as JSON")


def _iso(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).isoformat(timespec="milliseconds")


def describe(res: CommandResult) -> str:
    lines = [f"backfill {res.id} on {res.cluster}/{res.node}: {res.result}"]
    if res.reason:
        lines.append(f"  reason: {res.reason}")
    if res.result == "done":
        lines.append(
            f"  supplied: {res.samples} samples of {res.series} series in {res.batches} batches, "
            f"{_iso(res.first_ms)} .. {_iso(res.last_ms)} (spooled on the node, shipped like a backlog)"
        )
        if not res.missing:
            lines.append("  missing: nothing")
        for gap in res.missing:
            lines.append(f"  missing: {_iso(gap.start_ms)} .. {_iso(gap.end_ms)}: {gap.reason}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    s = settings_mod.load(args.config)
    if args.match is not None:
        # Checked here too, so a typo fails at once rather than in the relay's answer.
        from relay_common.selector import SelectorError, parse_selector

        try:
            parse_selector(args.match)
        except SelectorError as e:
            print(f"cloud-ingest backfill: {e}", file=sys.stderr)
            return 2
    req = BackfillRequest(
        id=secrets.token_hex(8),
        cluster=args.cluster,
        node=args.node,
        from_ms=args.start,
        to_ms=args.end,
        ts_ms=int(time.time() * 1000),
        match=args.match,
    )
    try:
        payload = encode_request(req)
        cmd, result_topic = (
            topics.cmd_topic(s.topic_prefix, args.cluster, args.node),
            topics.cmd_result_topic(s.topic_prefix, args.cluster, args.node),
        )
    except (EncodeError, ValueError) as e:
        print(f"cloud-ingest backfill: {e}", file=sys.stderr)
        return 2
    got: list[CommandResult] = []
    answered, subscribed = threading.Event(), threading.Event()

    def on_message(client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        try:
            res = decode_result(bytes(message.payload))
        except DecodeError as e:
            print(f"cloud-ingest backfill: ignoring a malformed result: {e}", file=sys.stderr)
            return
        if res.id == req.id:
            got.append(res)
            answered.set()

    client = tool_client(s, f"{s.client_id}-backfill-{req.id}")
    client.on_message = on_message
    client.on_subscribe = lambda *a: subscribed.set()
    puback: dict[int, int] = {}
    client.on_publish = lambda c, u, mid, reason, p: puback.__setitem__(mid, getattr(reason, "value", 0))
    try:
        tool_connect(client, s)
    except (OSError, ValueError) as e:
        print(f"cloud-ingest backfill: cannot connect to {s.mqtt_host}:{s.mqtt_port}: {e}", file=sys.stderr)
        return 1
    client.loop_start()
    try:
        # Subscribed before publishing: a fast relay must not answer into the void.
        client.subscribe(result_topic, qos=1)
        if not subscribed.wait(10):
            print("cloud-ingest backfill: no SUBACK from the broker", file=sys.stderr)
            return 1
        info = client.publish(cmd, payload, qos=1, retain=False)
        info.wait_for_publish(10)
        if puback.get(info.mid, 0) >= 0x80:
            # MQTT 5: the broker refused it (135: not authorised, i.e. not the ingester's identity).
            print(
                f"cloud-ingest backfill: the broker refused the command (reason {puback[info.mid]})",
                file=sys.stderr,
            )
            return 3
        if not answered.wait(args.wait):
            print(
                f"cloud-ingest backfill: no result from {args.cluster}/{args.node} within {args.wait:g}s "
                "(offline? a relay back within 10 minutes still answers it)",
                file=sys.stderr,
            )
            return 1
    finally:
        client.disconnect()
        client.loop_stop()
    res = got[0]
    if args.json:
        print(json.dumps(_as_json(res), separators=(",", ":")))
    else:
        print(describe(res))
    return 0 if res.result == "done" else 3


def _as_json(res: CommandResult) -> dict[str, Any]:
    from schemas.codec.command import encode_result

    out: dict[str, Any] = json.loads(encode_result(res))
    return out
