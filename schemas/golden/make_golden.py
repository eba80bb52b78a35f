"""Write the golden vectors of the wire format into ``schemas/golden/`` (version 3 into ``v3/``).

Run by hand after a deliberate format change, from the project root, and commit the result::

    python -m schemas.golden.make_golden             # every vector
    python -m schemas.golden.make_golden --v3-only   # only v3/, the others untouched

Each vector is a pair: ``<name>.bin`` (exact wire bytes) and ``<name>.json`` (what a decoder must
make of it, or the DecodeError reason it must raise).  The vectors are made, and checked against the
decoders, by ``vectors`` (v1, v2, acks, status) and ``vectors_v3``; this module only writes them.
See ``schemas/wire-format.md`` ("Golden vectors").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from schemas.golden.vectors import vectors
from schemas.golden.vectors_v3 import v3_vectors

GOLDEN_DIR = Path(__file__).resolve().parent
V3_DIR = GOLDEN_DIR / "v3"


def _dumps(view: dict[str, Any], indent: str = " ") -> str:
    """JSON with one line per field and one line per list item: diffable, still compact."""

    def one(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False)

    inner = indent + " "
    lines = []
    for key, value in view.items():
        if isinstance(value, dict) and any(isinstance(v, list) for v in value.values()):
            lines.append(f"{one(key)}: {_dumps(value, inner)}")
        elif isinstance(value, list) and value:
            items = ",\n".join(f"{inner}{one(item)}" for item in value)
            lines.append(f"{one(key)}: [\n{items}\n{indent}]")
        else:
            lines.append(f"{one(key)}: {one(value)}")
    return "{\n" + indent + f",\n{indent}".join(lines) + "\n" + indent[:-1] + "}"


def _write(name: str, data: bytes, view: dict[str, Any]) -> None:
    (GOLDEN_DIR / f"{name}.bin").write_bytes(data)
    (GOLDEN_DIR / f"{name}.json").write_text(_dumps(view) + "\n", encoding="utf-8")


def main() -> int:
    v3_made = v3_vectors()
    if "--v3-only" not in sys.argv[1:]:
        made = vectors()  # all of them first: a failure leaves the old set in place
        for old in list(GOLDEN_DIR.glob("*.bin")) + list(GOLDEN_DIR.glob("*.json")):
            old.unlink()
        for name, (data, view) in made.items():
            _write(name, data, view)
        print(f"wrote {len(made)} vectors to {GOLDEN_DIR}")
    V3_DIR.mkdir(exist_ok=True)
    for old in list(V3_DIR.glob("*.bin")) + list(V3_DIR.glob("*.json")):
        old.unlink()
    for name, (data, view) in v3_made.items():
        _write(f"v3/{name}", data, view)
    print(f"wrote {len(v3_made)} vectors to {V3_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
