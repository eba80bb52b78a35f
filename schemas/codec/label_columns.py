"""The label sections: label sets as dictionary columns, the layout v2 bodies and v3 frames and states share.

Five sections (``schemas/wire-format.md``, "Body, version 2"): LMETA (the label names, the schemas, i.e.
the distinct tuples of label names, and the size of each name's value dictionary), LSTRLEN and LSTR
(every name and dictionary value, once), LSCHEMA (each series' schema) and LIDS (per schema and name,
the column of value ids).  A v2 body carries the batch's label sets in them, a v3 frame the series it
adds to the stream's dictionary, a v3 state message the whole dictionary.

:func:`read_labels` treats its input as hostile: every count is checked against its cap before
anything of that size is built, and the decoded label sets pass the rules of ``labels``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import accumulate, chain

from schemas import columnar
from schemas.codec.errors import refuse
from schemas.codec.labels import check_label_names, check_metric_names, check_schema
from schemas.codec.limits import Limits
from schemas.model import Labels


def encode_labels(labelsets: Sequence[Labels]) -> tuple[bytes, bytes, bytes, bytes, bytes]:
    """LMETA, LSTRLEN, LSTR, LSCHEMA, LIDS: label sets as columns of ids per (schema, label name)."""
    schemas: dict[tuple[str, ...], int] = {}
    rows: list[list[tuple[str, ...]]] = []
    schema_col: list[int] = []
    for labels in labelsets:
        names, values = tuple(zip(*labels, strict=True)) or ((), ())
        sid = schemas.get(names)
        if sid is None:
            sid = schemas[names] = len(schemas)
            rows.append([])
        schema_col.append(sid)
        rows[sid].append(values)
    name_ids = {name: i for i, name in enumerate(sorted({n for names in schemas for n in names}))}
    dicts: dict[str, dict[str, int]] = {name: {} for name in name_ids}
    columns: list[tuple[str, list[int]]] = []
    for names, sid in schemas.items():
        for name, column in zip(names, zip(*rows[sid], strict=True), strict=True):
            ids = dicts[name]
            for value in dict.fromkeys(column):  # new values get the next ids, in first-use order
                if value not in ids:
                    ids[value] = len(ids)
            columns.append((name, list(map(ids.__getitem__, column))))
    meta = bytearray()
    columnar.put_uvarint(meta, len(name_ids))
    columnar.put_uvarint(meta, len(schemas))
    for names in schemas:
        columnar.put_uvarint(meta, len(names))
        for name in names:
            columnar.put_uvarint(meta, name_ids[name])
    for name in name_ids:
        columnar.put_uvarint(meta, len(dicts[name]))
    strings = [s.encode("utf-8") for s in chain(name_ids, *(dicts[name] for name in name_ids))]
    lengths = columnar.uvarints(map(len, strings))
    schema_bytes = columnar.pack_ints(schema_col, columnar.unsigned_width(len(schemas)), signed=False)
    ids_bytes = b"".join(
        columnar.pack_ints(ids, columnar.unsigned_width(len(dicts[name])), signed=False)
        for name, ids in columns
    )
    return bytes(meta), bytes(lengths), b"".join(strings), schema_bytes, ids_bytes


_NameDict = list[tuple[str, str]]


def _read_strings(lengths_buf: bytes, data: bytes, n_names: int, n_values: int, limits: Limits) -> list[str]:
    reader = columnar.Reader(lengths_buf, "LSTRLEN")
    lengths = reader.uvarints(n_names + n_values)
    reader.done()
    if n_names and max(lengths[:n_names]) > limits.max_label_name_bytes:
        refuse("label_too_long", f"a label name longer than {limits.max_label_name_bytes} bytes")
    if n_values and max(lengths[n_names:]) > limits.max_label_value_bytes:
        refuse("label_too_long", f"a label value longer than {limits.max_label_value_bytes} bytes")
    if sum(lengths) != len(data):
        refuse("length_mismatch", f"LSTR: {len(data)} bytes for strings of {sum(lengths)} bytes")
    ends = list(accumulate(lengths))
    try:
        if data.isascii():
            text = data.decode("ascii")  # byte offsets are character offsets: one decode, then slices
            return list(map(text.__getitem__, map(slice, [0, *ends[:-1]], ends)))
        return [data[a:b].decode("utf-8") for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    except UnicodeDecodeError as exc:
        refuse("malformed", f"LSTR: invalid UTF-8 ({exc.reason})")


def read_labels(streams: Sequence[bytes], n_series: int, limits: Limits) -> list[Labels]:
    meta_buf, lengths_buf, data, schema_buf, ids_buf = streams
    meta = columnar.Reader(meta_buf, "LMETA")
    pair_cap = limits.max_label_pairs
    n_names = meta.count(pair_cap, "too_many_label_pairs", "label names")
    # Every schema is some series' label names: there are never more schemas than series.
    n_schemas = meta.count(n_series, "malformed", "label name sets for fewer series")
    schemas: list[list[int]] = []
    listed = 0
    for _ in range(n_schemas):
        size = meta.count(limits.max_labels_per_series, "too_many_labels", "labels in one series")
        listed += size
        if listed > pair_cap:
            refuse("too_many_label_pairs", f"more than {pair_cap} labels in the batch")
        ids = meta.uvarints(size)
        if ids and max(ids) >= n_names:
            refuse("bad_index", f"LMETA: label name {max(ids)} >= {n_names} names")
        schemas.append(ids)
    dict_sizes = meta.uvarints(n_names)
    meta.done()
    n_values = sum(dict_sizes)
    if n_names + n_values > pair_cap:
        refuse("too_many_label_pairs", f"more than {pair_cap} distinct label names and values")
    strings = _read_strings(lengths_buf, data, n_names, n_values, limits)
    names = strings[:n_names]
    check_label_names(names)
    pairs: list[_NameDict] = []
    pos = n_names
    for name, size in zip(names, dict_sizes, strict=True):
        values = strings[pos : pos + size]
        pos += size
        if "" in values:
            refuse("empty_label_value", f"label {name!r} has an empty value")
        if name == "__name__":
            check_metric_names(values)
        pairs.append([(name, value) for value in values])
    for ids in schemas:
        check_schema([names[i] for i in ids])
    schema_col = columnar.unpack_ints(
        schema_buf, columnar.unsigned_width(n_schemas), signed=False, name="LSCHEMA"
    )
    if len(schema_col) != n_series:
        refuse("length_mismatch", f"LSCHEMA: {len(schema_col)} schema ids for {n_series} series")
    if n_series and max(schema_col) >= n_schemas:
        refuse("bad_index", f"LSCHEMA: schema {max(schema_col)} >= {n_schemas} schemas")
    counts = Counter(schema_col)
    if sum(counts[s] * len(ids) for s, ids in enumerate(schemas)) > pair_cap:
        refuse("too_many_label_pairs", f"more than {pair_cap} labels in the batch")
    reader = columnar.Reader(ids_buf, "LIDS")
    per_schema = []
    for s, ids in enumerate(schemas):
        rows = counts.get(s, 0)
        columns = []
        for name_id in ids:
            table = pairs[name_id]
            width = columnar.unsigned_width(len(table))
            col = columnar.unpack_ints(reader.take(rows * width), width, signed=False, name="LIDS")
            if rows and max(col) >= len(table):
                refuse("bad_index", f"LIDS: value {max(col)} >= {len(table)} values of {names[name_id]!r}")
            columns.append(map(table.__getitem__, col))
        per_schema.append(iter(list(zip(*columns, strict=True))))
    reader.done()
    # Put each schema's label sets back in series order: one C-level next() per series.  (Each
    # iterator holds exactly as many sets as schema_col names it, so no next() runs dry.)
    labelsets: list[Labels] = list(map(next, map(per_schema.__getitem__, schema_col)))
    if len(set(labelsets)) != len(labelsets):
        refuse("duplicate_series", "the same label set appears twice")
    return labelsets
