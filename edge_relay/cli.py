"""``edge-relay``: the edge sidecar's command line."""

from __future__ import annotations

import sys

from relay_common import cli

COMMANDS: cli.Commands = {
    "run": ("edge_relay.app", "scrape, spool and ship metrics as configured (the sidecar's main job)"),
    "simulate": (
        "simulator.server",
        "serve simulated exporters: Kepler, node-exporter and the GPU exporter of --vendor (default nvidia)",
    ),
    "ledger": ("edge_relay.commands.ledger", "print the loss ledger: samples dropped or merged, by reason"),
    "status": (
        "edge_relay.commands.status",
        "link, backlog, drain rate and ETA, budget, losses, targets: from the spool and the relay's /metrics",
    ),
    "check-config": (
        "edge_relay.commands.checkconfig",
        "validate a config file and print it with defaults filled in",
    ),
    "budget": (
        "edge_relay.commands.budget_plan",
        "bandwidth budget: `budget plan` estimates each class's bytes/s",
    ),
}


def main(argv: list[str] | None = None) -> int:
    return cli.main(
        COMMANDS,
        "edge-relay",
        "Edge metrics relay: scrape exporters, spool while offline, ship over MQTT.",
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
