"""Generated sections of the docs: text between ``<!-- TAG:NAME -->`` and ``<!-- /TAG:NAME -->`` markers.

The references in ``docs/`` (config keys, self-metrics) are generated from declarations; each generator
names its sections and their bodies, and this module prints them, writes them into a Markdown file
between their markers, or reads one back for the tests that keep the docs current. Text outside the
markers is the writer's and is never touched.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path


def cell(text: str) -> str:
    """``text`` made safe for a Markdown table cell (no column break, no HTML)."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def section(tag: str, name: str, body: str) -> str:
    """``body`` between its markers, as it stands in a document."""
    return f"<!-- {tag}:{name} -->\n{body}\n<!-- /{tag}:{name} -->"


def replace(text: str, tag: str, bodies: Mapping[str, str]) -> str:
    """``text`` with each ``tag`` section named in ``bodies`` rewritten; a section it lacks is left out."""
    for name, body in bodies.items():
        key = f"{re.escape(tag)}:{re.escape(name)}"
        pattern = re.compile(rf"<!-- {key} -->.*?<!-- /{key} -->", re.S)
        text = pattern.sub(lambda _m, n=name, b=body: section(tag, n, b), text)
    return text


def extract(text: str, tag: str, name: str) -> str | None:
    """The body of section ``tag:name`` in ``text``, or None when its markers are missing."""
    start, end = f"<!-- {tag}:{name} -->", f"<!-- /{tag}:{name} -->"
    if start not in text or end not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def main(
    argv: Sequence[str],
    *,
    prog: str,
    description: str,
    tag: str,
    bodies: Callable[[], Mapping[str, str]],
) -> None:
    """The generators' command line: print every section, or ``--update FILE`` to rewrite them in place."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--update",
        metavar="FILE",
        type=Path,
        help="rewrite the sections between their markers in this Markdown file instead of printing them",
    )
    args = parser.parse_args(argv)
    generated = bodies()
    if args.update is None:
        for name, body in generated.items():
            print(section(tag, name, body) + "\n")
        return
    text = args.update.read_text(encoding="utf-8")
    missing = [name for name in generated if extract(text, tag, name) is None]
    if missing:
        sys.exit(f"{args.update}: no <!-- {tag}:NAME --> markers for {', '.join(missing)}")
    args.update.write_text(replace(text, tag, generated), encoding="utf-8")
