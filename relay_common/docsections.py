"""Generated sections of the docs: text between ``<!-- TAG:NAME -->`` and ``<!-- /TAG:NAME -->`` markers.

The references in ``docs/`` (config keys, self-metrics) are generated from declarations; each generator
is a ``Reference`` (its sections and how to draw one), which prints them, writes them into a Markdown file
between their markers, or reads one back for the tests that keep the docs current. Text outside the
markers is the writer's and is never touched.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def cell(text: str) -> str:
    """``text`` made safe for a Markdown table cell (no column break, no HTML)."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table; the cells are written as given (see ``cell``)."""
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return "\n".join(lines)


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


@dataclass(frozen=True)
class Reference:
    """One generated reference: its sections (by name) in one document, and its command line."""

    tag: str
    document: str
    names: tuple[str, ...]
    markdown: Callable[[str], str]
    description: str

    def section(self, name: str) -> str:
        return section(self.tag, name, self.markdown(name))

    def bodies(self) -> dict[str, str]:
        return {name: self.markdown(name) for name in self.names}

    def update(self, text: str) -> str:
        return replace(text, self.tag, self.bodies())

    def main(self, argv: Sequence[str], prog: str) -> None:
        """Print every section, or ``--update FILE`` to rewrite them in place."""
        parser = argparse.ArgumentParser(prog=prog, description=f"{self.description} ({self.document}).")
        parser.add_argument(
            "--update",
            metavar="FILE",
            type=Path,
            help="rewrite the sections between their markers in this Markdown file instead of printing them",
        )
        args = parser.parse_args(argv)
        if args.update is None:
            for name in self.names:
                print(self.section(name) + "\n")
            return
        text = args.update.read_text(encoding="utf-8")
        missing = [name for name in self.names if extract(text, self.tag, name) is None]
        if missing:
            sys.exit(f"{args.update}: no <!-- {self.tag}:NAME --> markers for {', '.join(missing)}")
        args.update.write_text(self.update(text), encoding="utf-8")
