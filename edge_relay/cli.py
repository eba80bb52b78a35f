"""``edge-relay``: the edge sidecar's command line."""

from __future__ import annotations

import sys

from relay_common import cli

COMMANDS: cli.Commands = {
    "run": ("edge_relay.relay", "scrape, spool and ship metrics as configured (the sidecar's main job)"),
    "simulate": ("simulator.server", "serve simulated Kepler / dcgm-exporter / node-exporter metrics"),
    "ledger": ("edge_relay.ledger_cmd", "print the loss ledger: samples dropped or merged, by reason"),
    "check-config": ("edge_relay.checkconfig", "validate a config file and print it with defaults filled in"),
    "budget": ("edge_relay.budget.plan", "bandwidth budget: `budget plan` estimates each class's bytes/s"),
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
