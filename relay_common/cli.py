"""Sub-command plumbing shared by ``edge-relay`` and ``cloud-ingest``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from relay_common.config import ConfigError

# name -> (module providing add_arguments(parser) and run(args) -> int, one-line help)
Commands = dict[str, tuple[str, str]]


def build_parser(
    commands: Commands, prog: str, description: str, argv: list[str] | None = None
) -> argparse.ArgumentParser:
    """The parser for ``argv`` (default ``sys.argv[1:]``).

    Only the module of the command ``argv`` names is imported (to add its arguments), so a command's
    dependencies load when it is used: ``edge-relay run`` never imports the simulator.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = _command_in(sys.argv[1:] if argv is None else argv)
    for name, (module_name, help_text) in commands.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(p)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The command argparse will dispatch to: the first argument that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(commands: Commands, prog: str, description: str, argv: list[str] | None) -> int:
    parser = build_parser(commands, prog, description, argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(commands[args.command][0])
    try:
        return int(module.run(args))
    except ConfigError as e:
        print(f"{prog}: configuration error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
