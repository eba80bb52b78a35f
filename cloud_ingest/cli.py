"""``cloud-ingest``: the cloud ingester's command line."""

from __future__ import annotations

import sys

from relay_common import cli

COMMANDS: cli.Commands = {
    "run": ("cloud_ingest.app", "receive batches over MQTT and write them with Prometheus remote-write"),
    "dead-letters": (
        "cloud_ingest.commands.deadletters",
        "list the batches that could not be written, with reasons",
    ),
    "fleet": (
        "cloud_ingest.commands.fleet",
        "one line per edge node: online/offline, verdict, backlog, losses, samples written",
    ),
    "backfill": (
        "cloud_ingest.commands.backfill",
        "ask an edge relay to send a time range again at full resolution from its flight recorder",
    ),
    "check-config": (
        "cloud_ingest.commands.checkconfig",
        "validate a config file and print it with defaults filled in",
    ),
}


def main(argv: list[str] | None = None) -> int:
    return cli.main(
        COMMANDS,
        "cloud-ingest",
        "Cloud ingester: MQTT batches from edge relays -> Prometheus remote-write.",
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
