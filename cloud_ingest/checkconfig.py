"""``cloud-ingest check-config``: validate a config file and show it with every default filled in."""

from __future__ import annotations

import argparse

import yaml

from cloud_ingest import settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="cloud ingester config file (YAML)")


def run(args: argparse.Namespace) -> int:
    s = settings.load(args.config)
    print(yaml.safe_dump(s.raw, sort_keys=False), end="")
    print(f"# OK: {args.config} is valid (remote write to {s.remote_write_url})")
    return 0
