"""Contracts shared by the edge relay and the cloud ingester: data model, wire codec, topics, schemas."""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def schema_path(name: str) -> Path:
    """Path of a data file shipped in this package (e.g. ``"wire-format.md"``, ``"golden/x.bin"``)."""
    path = (_PACKAGE_DIR / name).resolve()
    if not path.is_relative_to(_PACKAGE_DIR):
        raise ValueError(f"{name!r} is outside the schemas package")
    return path
