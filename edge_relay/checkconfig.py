"""``edge-relay check-config``: validate a config file and show it with every default filled in."""

from __future__ import annotations

import argparse

import yaml

from edge_relay import settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="edge relay config file (YAML)")


def run(args: argparse.Namespace) -> int:
    s = settings.load(args.config)
    print(yaml.safe_dump(s.raw, sort_keys=False), end="")
    print(f"# OK: {args.config} is valid ({len(s.targets)} target(s), node {s.node}, cluster {s.cluster})")
    return 0
