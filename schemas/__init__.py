"""Contracts shared by the edge relay and the cloud ingester: data model, wire codec, topics, schemas.

Both programs import this package and nothing of each other, so what one sends the other reads by
the same code.  The parts, lowest first:

- ``model``: label sets, scrape blocks and batches, the stale marker; no I/O, no encoding.
- ``columnar`` and ``values``: byte-level column transforms (varints, shuffled integer columns, the
  timestamp table) and the value codec of one series, the building blocks of body version 2.
- ``topics``: the MQTT topic layout and the checks of cluster and node names.
- ``codec``: the wire format (envelope, bodies v1/v2/v3, stream state, acks, status, commands); its
  decoders treat every byte as hostile.  ``wire-format.md`` specifies it, ``golden`` holds the vectors
  any implementation must agree with, and the code that makes them.
- ``remote_write_pb``: Prometheus remote-write 1.0 messages, for the cloud's sink.
- The JSON Schemas of both config files and of the bandwidth budget.

Data files ship inside the package; ``schema_path`` finds them.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def schema_path(name: str) -> Path:
    """Path of a data file shipped in this package (e.g. ``"wire-format.md"``, ``"golden/x.bin"``)."""
    path = (_PACKAGE_DIR / name).resolve()
    if not path.is_relative_to(_PACKAGE_DIR):
        raise ValueError(f"{name!r} is outside the schemas package")
    return path
