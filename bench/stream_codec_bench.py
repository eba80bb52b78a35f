"""Stream codec variants for live mode (issue 13), measured offline on recorded scrape streams.

Not a test: it prints markdown tables (the ones in ``docs/stream-codec.md``).

    python bench/stream_codec_bench.py record --out /tmp/sim.rec --series 2000 --hours 3
    python bench/stream_codec_bench.py record-node --out /tmp/node.rec --scrapes 300
    python bench/stream_codec_bench.py compare /tmp/sim.rec [/tmp/node.rec] [--frames N]
    python bench/stream_codec_bench.py windowed /tmp/sim.rec [--window 12] [--levels 3 19] [--mc-levels 3 19]

A recording is a list of *frames*: one scrape cycle of every target (live mode sends one frame per
cycle), each target parsed and shaped as the relay does (``TargetShaper``: job/instance/node labels,
synthetic series, stale markers for vanished series), stored as a zstd-compressed pickle.

``compare`` encodes every frame with each variant and prints bytes/sample (zstd level 3 on the whole
frame, with and without a zstd dictionary primed with the last keyframe's raw bytes) and encode/decode
CPU us/sample.  Variants share a frame layout (series dictionary by id with additions as deltas,
per-target block membership against the reference, timestamps against the reference) and differ in
the value reference:

- ``v2``: today's live cost, one self-contained v2 batch per frame;
- ``xor``: the 64-bit XOR with the series' previous value;
- ``delta``: decimal-scaled (or raw-bit) integer minus the previous frame's;
- ``dod``: delta of that delta;
- ``key``: integer minus the last keyframe's (any holder of the keyframe decodes any frame).

``windowed`` measures the frames the relay publishes in windowed mode (a budget's batch window):
``--window`` consecutive recorded cycles per window, through the relay's own path (``dedupe_window``,
``BatchEncoder.build_window`` with the default ``batch.max_bytes``, then ``StreamEncoder``), whole
envelopes; then where the delta frames' bytes go (per section and per metric family, before and
after zstd) and what other zstd levels would make of the same content (no wire-format change).
"""

from __future__ import annotations

import argparse
import math
import pickle
import struct
import subprocess
import time
import urllib.request
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

from edge_relay.collect.parse import SeriesCache, parse
from edge_relay.collect.shape import TargetShaper
from schemas import codec, columnar
from schemas.codec.label_columns import encode_labels
from schemas.model import STALE_NAN_BITS, Batch, Labels, ScrapeBlock
from schemas.values import decimals

T0 = 1_700_000_000_000
FIRST_TICK = 30
NODE = "edge-gpu-01"
CTYPE = "text/plain; version=0.0.4"

# One target's scrape in a frame: (target index, timestamp, label sets, values).
Block = tuple[int, int, list[Labels], array]
Frame = list[Block]


def save(path: Path, frames: list[Frame], meta: dict[str, object]) -> None:
    raw = pickle.dumps({"meta": meta, "frames": frames}, protocol=5)
    path.write_bytes(zstandard.ZstdCompressor(level=3).compress(raw))


def load(path: Path) -> tuple[list[Frame], dict[str, object]]:
    data = pickle.loads(zstandard.ZstdDecompressor().decompress(path.read_bytes(), max_output_size=1 << 33))
    return data["frames"], data["meta"]


def record_simulator(out: Path, series: int, hours: float, interval_s: float) -> None:
    from simulator import EXPORTERS, Simulator

    sim = Simulator(1, series, interval_s)
    caches = {e: SeriesCache() for e in EXPORTERS}
    shapers = {
        e: TargetShaper(e, {"job": e, "instance": f"{NODE}:{i}"}, {"node": NODE})
        for i, e in enumerate(EXPORTERS)
    }
    ms = int(interval_s * 1000)
    frames: list[Frame] = []
    for tick in range(FIRST_TICK, FIRST_TICK + int(hours * 3600 / interval_s)):
        frame: Frame = []
        for i, e in enumerate(EXPORTERS):
            parsed = parse(sim.render(e, tick).decode(), CTYPE, caches[e])
            ts = T0 + ms * tick + 1250 * i + (tick * 7 + i) % 11  # own offset per target, some jitter
            s = shapers[e].shape(ts, parsed, 0.01)
            frame.append((i, ts, list(s.labels), array("d", s.values)))
        frames.append(frame)
    save(out, frames, {"source": "simulator", "series": series, "interval_s": interval_s})
    print(f"{len(frames)} frames, {sum(len(b[3]) for f in frames for b in f)} samples -> {out}")


def record_node_exporter(out: Path, scrapes: int, interval_s: float, port: int) -> None:
    collectors = ["cpu", "meminfo", "diskstats", "netdev", "filesystem", "loadavg", "vmstat", "stat"]
    argv = [
        "/usr/bin/prometheus-node-exporter",
        f"--web.listen-address=127.0.0.1:{port}",
        "--collector.disable-defaults",
        *(f"--collector.{c}" for c in collectors),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        for _ in range(50):
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                time.sleep(0.1)
        cache = SeriesCache()
        shaper = TargetShaper("node", {"job": "node", "instance": f"{NODE}:9100"}, {"node": NODE})
        frames: list[Frame] = []
        start = time.time()
        for k in range(scrapes):
            time.sleep(max(0.0, start + k * interval_s - time.time()))
            ts = int(time.time() * 1000)
            body = urllib.request.urlopen(url, timeout=5).read()
            s = shaper.shape(ts, parse(body.decode(), CTYPE, cache), 0.01)
            frames.append([(0, ts, list(s.labels), array("d", s.values))])
    finally:
        proc.terminate()
        proc.wait(10)
    save(out, frames, {"source": "node-exporter", "collectors": collectors, "interval_s": interval_s})
    print(f"{len(frames)} frames, {sum(len(b[3]) for f in frames for b in f)} samples -> {out}")


# ------------------------------------------------------------------------------------------ variants

RAW = 0x1F  # kind of a series coded as the int64 reading of its bit patterns
STALE = 0x40  # exception: the sample is the stale marker, state unchanged
POW10 = columnar.POW10
MODES = ("xor", "delta", "dod", "adapt", "key")


def _signed(b: int) -> int:
    return b - (1 << 64) if b >> 63 else b


def _as_decimal(v: float, k: int) -> int | None:
    """m with m / 10**k bit-identical to v, or None."""
    try:
        m = round(v * POW10[k])
    except (ValueError, OverflowError):
        return None
    ok = -columnar.MAX_MANTISSA < m < columnar.MAX_MANTISSA and m / POW10[k] == v
    return m if ok and (v or math.copysign(1.0, v) > 0) else None  # -0.0 == 0.0 but has other bits


def _pick_kind(v: float, old_k: int | None) -> tuple[int, int]:
    """(kind, m) of a series restarting its state: a decimal exponent no smaller than the old one."""
    need = decimals(v)
    if need is not None and need <= columnar.MAX_EXPONENT:
        for k in dict.fromkeys((max(need, old_k if old_k is not None and old_k != RAW else 0), need)):
            if k <= columnar.MAX_EXPONENT:
                m = _as_decimal(v, k)
                if m is not None:
                    return k, m
    return RAW, _signed(columnar.f64_bits([v])[0])


@dataclass
class _State:
    """Everything a frame is coded against (the reference): dictionary, blocks, value history."""

    ids: dict[Labels, int] = field(default_factory=dict)
    labels: list[Labels] = field(default_factory=list)
    blocks: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    kind: dict[int, int] = field(default_factory=dict)
    m: dict[int, int] = field(default_factory=dict)
    d: dict[int, int] = field(default_factory=dict)
    bits: dict[int, int] = field(default_factory=dict)
    use_dod: dict[int, bool] = field(default_factory=dict)  # adapt: predictor of each series' next value


def _streams(parts: Sequence[bytes]) -> bytes:
    out = bytearray()
    for part in parts:
        columnar.put_uvarint(out, len(part))
        out += part
    return bytes(out)


def _unstreams(raw: bytes, n: int) -> list[bytes]:
    r = columnar.Reader(raw, "frame")
    return [r.take(r.uvarint()) for _ in range(n)]


class Variant:
    """Encoder and decoder of one variant; both keep their own _State, as edge and cloud would."""

    def __init__(self, mode: str, every: int) -> None:
        self.mode = mode
        self.every = every
        self.enc = _State()
        self.dec = _State()
        self.n = 0
        self.cctx = zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=True)
        self.dctx = zstandard.ZstdDecompressor()
        self.dict_cctx: zstandard.ZstdCompressor | None = None
        self.dict_dctx: zstandard.ZstdDecompressor | None = None

    # -- encoder
    def encode(self, frame: Frame) -> tuple[bool, bytes, bytes]:
        """(keyframe?, raw frame, zstd frame)."""
        key = self.n % self.every == 0
        self.n += 1
        if key:
            self.enc = _State()
        st = self.enc
        frozen = self.mode == "key" and not key  # key mode codes against the keyframe, never updated
        added: list[Labels] = []
        extra: dict[Labels, int] = {}
        blocks = bytearray()
        columnar.put_uvarint(blocks, len(frame))
        order: list[tuple[int, int]] = []  # (id, bits) in coded order
        new_blocks: dict[int, tuple[int, list[int]]] = {}
        for target, ts, labelsets, values in frame:
            ids = []
            for labels in labelsets:
                i = st.ids.get(labels)
                if i is None:
                    i = extra.get(labels)
                    if i is None:
                        i = extra[labels] = len(st.labels) + len(added)
                        added.append(labels)
                ids.append(i)
            bits = dict(zip(ids, columnar.f64_bits(values).tolist(), strict=True))
            ref_ts, ref_ids = st.blocks.get(target, (0, []))
            columnar.put_uvarint(blocks, target)
            columnar.put_uvarint(blocks, columnar.zigzag(ts - ref_ts))
            if ids == ref_ids:
                columnar.put_uvarint(blocks, 0)
                coded = ids
            else:
                now = set(ids)
                gone = [p for p, i in enumerate(ref_ids) if i not in now]
                before = set(ref_ids)
                fresh = [i for i in ids if i not in before]
                columnar.put_uvarint(blocks, 1 + len(gone))
                prev = -1
                for p in gone:
                    columnar.put_uvarint(blocks, p - prev - 1)
                    prev = p
                columnar.put_uvarint(blocks, len(fresh))
                for i in fresh:
                    columnar.put_uvarint(blocks, i)
                coded = [i for i in ref_ids if i in now] + fresh
            order += [(i, bits[i]) for i in coded]
            new_blocks[target] = (ts, coded)
        if not frozen:
            st.blocks = new_blocks
            for labels in added:
                st.ids[labels] = len(st.labels)
                st.labels.append(labels)
        dict_streams = encode_labels(added) if added else (b"",) * 5
        head = bytearray()
        columnar.put_uvarint(head, len(added))
        values = self._values(order, st, frozen)
        raw = _streams((bytes(head), *dict_streams, bytes(blocks), *values))
        return key, raw, self.cctx.compress(raw)

    def _values(self, order: list[tuple[int, int]], st: _State, frozen: bool) -> tuple[bytes, bytes]:
        if self.mode == "xor":
            prev = st.bits
            words = array("Q", [b ^ prev.get(i, 0) for i, b in order])
            if not frozen:
                prev.update(order)
            return b"", columnar.shuffle(words.tobytes(), 8)
        exc = bytearray()
        deltas = bytearray()
        n_exc = 0
        last = -1
        kinds, ms, ds = st.kind, st.m, st.d
        dod = self.mode == "dod"
        adapt = self.mode == "adapt"
        ad = st.use_dod
        from_bits = struct_unpack_d
        for pos, (i, b) in enumerate(order):
            if b == STALE_NAN_BITS:
                columnar.put_uvarint(exc, pos - last - 1)
                exc.append(STALE)
                last = pos
                n_exc += 1
                continue
            k = kinds.get(i)
            m: int | None = None
            if k == RAW:
                m = _signed(b)
            elif k is not None:
                m = _as_decimal(from_bits(b), k)
            if m is not None:
                pred = ms[i] + ds[i] if dod or (adapt and ad.get(i, True)) else ms[i]
                columnar.put_uvarint(deltas, columnar.zigzag(m - pred))
                if not frozen:
                    if adapt:  # next time, the predictor that would have done better now
                        ad[i] = abs(m - ms[i] - ds[i]) <= abs(m - ms[i])
                    ds[i] = m - ms[i]
                    ms[i] = m
                continue
            k, m = _pick_kind(from_bits(b), k)
            columnar.put_uvarint(exc, pos - last - 1)
            exc.append(k)
            columnar.put_uvarint(exc, columnar.zigzag(m))
            last = pos
            n_exc += 1
            if not frozen:
                kinds[i], ms[i], ds[i] = k, m, 0
                ad.pop(i, None)
        head = bytearray()
        columnar.put_uvarint(head, n_exc)
        return bytes(head + exc), bytes(deltas)

    # -- decoder
    def decode(self, key: bool, data: bytes, dctx: zstandard.ZstdDecompressor | None = None) -> list[Block]:
        raw = (dctx or self.dctx).decompress(data)
        if key:
            self.dec = _State()
        st = self.dec
        frozen = self.mode == "key" and not key
        parts = _unstreams(raw, 9)
        n_added = columnar.Reader(parts[0], "head").uvarint()
        added: list[Labels] = []
        if n_added:
            from schemas.codec.label_columns import read_labels

            added = read_labels(parts[1:6], n_added, codec.DEFAULT_LIMITS)
        labels = st.labels + added
        r = columnar.Reader(parts[6], "blocks")
        out_blocks: list[tuple[int, int, list[int]]] = []
        new_blocks: dict[int, tuple[int, list[int]]] = {}
        for _ in range(r.uvarint()):
            target = r.uvarint()
            ref_ts, ref_ids = st.blocks.get(target, (0, []))
            ts = ref_ts + columnar.unzigzag(r.uvarint())
            flag = r.uvarint()
            if not flag:
                coded = ref_ids
            else:
                gone = set()
                p = -1
                for _ in range(flag - 1):
                    p += r.uvarint() + 1
                    gone.add(p)
                fresh = [r.uvarint() for _ in range(r.uvarint())]
                coded = [i for p, i in enumerate(ref_ids) if p not in gone] + fresh
            out_blocks.append((target, ts, coded))
            new_blocks[target] = (ts, coded)
        ids = [i for _, _, coded in out_blocks for i in coded]
        bits = self._unvalues(ids, parts[7], parts[8], st, frozen)
        if not frozen:
            st.blocks = new_blocks
            st.labels = labels
        result: list[Block] = []
        pos = 0
        for target, ts, coded in out_blocks:
            col = array("Q", bits[pos : pos + len(coded)])
            pos += len(coded)
            vals = array("d")
            vals.frombytes(col.tobytes())
            result.append((target, ts, [labels[i] for i in coded], vals))
        return result

    def _unvalues(self, ids: list[int], exc_buf: bytes, body: bytes, st: _State, frozen: bool) -> list[int]:
        if self.mode == "xor":
            words = columnar.unpack_ints(body, 8, signed=False)
            prev = st.bits
            out = [w ^ prev.get(i, 0) for i, w in zip(ids, words, strict=True)]
            if not frozen:
                prev.update(zip(ids, out, strict=True))
            return out
        er = columnar.Reader(exc_buf, "exc")
        exc: dict[int, tuple[int, int]] = {}
        pos = -1
        for _ in range(er.uvarint()):
            pos += er.uvarint() + 1
            kind = er.buf[er.pos]
            er.pos += 1
            exc[pos] = (kind, 0 if kind == STALE else columnar.unzigzag(er.uvarint()))
        dr = columnar.Reader(body, "deltas")
        kinds, ms, ds = st.kind, st.m, st.d
        dod = self.mode == "dod"
        adapt = self.mode == "adapt"
        ad = st.use_dod
        out = []
        for pos, i in enumerate(ids):
            e = exc.get(pos)
            if e is not None:
                k, m = e
                if k == STALE:
                    out.append(STALE_NAN_BITS)
                    continue
                if not frozen:
                    kinds[i], ms[i], ds[i] = k, m, 0
                    ad.pop(i, None)
            else:
                k = kinds[i]
                pred = ms[i] + ds[i] if dod or (adapt and ad.get(i, True)) else ms[i]
                m = pred + columnar.unzigzag(dr.uvarint())
                if not frozen:
                    if adapt:
                        ad[i] = abs(m - ms[i] - ds[i]) <= abs(m - ms[i])
                    ds[i] = m - ms[i]
                    ms[i] = m
            out.append(m & ((1 << 64) - 1) if k == RAW else columnar.f64_bits([m / POW10[k]])[0])
        return out


def struct_unpack_d(b: int) -> float:
    return _D.unpack(_Q.pack(b))[0]


_Q = __import__("struct").Struct("<Q")
_D = __import__("struct").Struct("<d")


# ------------------------------------------------------------------------------------------ compare


def _same(a: Block, b: Block) -> bool:
    pa = sorted(zip(a[2], columnar.f64_bits(a[3]).tolist(), strict=True))
    pb = sorted(zip(b[2], columnar.f64_bits(b[3]).tolist(), strict=True))
    return a[:2] == b[:2] and pa == pb


def _v2_bytes(frames: list[Frame], every: int) -> tuple[float, float, float]:
    """(B/sample, encode us/sample, decode us/sample) of one self-contained v2 batch per frame."""
    size = samples = 0
    enc = dec = 0.0
    for frame in frames[::every]:
        batch = _batch(frame, 1)
        t = time.process_time()
        data = codec.encode_batch(batch)
        enc += time.process_time() - t
        t = time.process_time()
        codec.decode_batch(data)
        dec += time.process_time() - t
        size += len(data)
        samples += batch.sample_count
    return size / samples, enc * 1e6 / samples, dec * 1e6 / samples


def run_variant(frames: list[Frame], mode: str, every: int) -> dict[str, float]:
    v = Variant(mode, every)
    plain = primed = samples = key_bytes = keys = delta_bytes = delta_samples = 0
    enc = dec = 0.0
    churn_frames = churn_bytes = 0
    for frame in frames:
        n = sum(len(b[3]) for b in frame)
        t = time.process_time()
        key, raw, data = v.encode(frame)
        enc += time.process_time() - t
        t = time.process_time()
        got = v.decode(key, data)
        dec += time.process_time() - t
        if not all(map(_same, got, frame)):
            raise AssertionError(f"{mode}: frame {v.n - 1} does not round-trip")
        samples += n
        plain += len(data)
        if key:
            keys += 1
            key_bytes += len(data)
            primed += len(data)
            kdict = zstandard.ZstdCompressionDict(raw, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
            v.dict_cctx = zstandard.ZstdCompressor(level=3, dict_data=kdict, write_checksum=True)
            v.dict_dctx = zstandard.ZstdDecompressor(dict_data=kdict)
        else:
            assert v.dict_cctx is not None and v.dict_dctx is not None
            primed += len(v.dict_cctx.compress(raw))
            delta_bytes += len(data)
            delta_samples += n
            if columnar.Reader(raw, "x").uvarint() and raw[1]:  # frames adding series
                churn_frames += 1
                churn_bytes += len(data)
    return {
        "B/sample": plain / samples,
        "primed B/sample": primed / samples,
        "keyframe B": key_bytes / max(keys, 1),
        "delta B/sample": delta_bytes / max(delta_samples, 1),
        "enc us": enc * 1e6 / samples,
        "dec us": dec * 1e6 / samples,
        "churn frames": churn_frames,
    }


def _batch(frame: Frame, seq: int) -> Batch:
    table: dict[Labels, int] = {}
    blocks = []
    for _target, ts, labelsets, values in frame:
        ids = array("I", [table.setdefault(lab, len(table)) for lab in labelsets])
        blocks.append(ScrapeBlock(ts, ids, values))
    return Batch("lab", NODE, seq, list(table), blocks)


def run_v3(frames: list[Frame], every: int) -> dict[str, float]:
    """The implementation (schemas/codec/stream.py): whole envelopes, validation included."""
    enc = codec.StreamEncoder("lab", NODE, keyframe_every=every)
    dec = codec.StreamDecoder()
    size = samples = keys = key_bytes = 0
    added = churn_frames = churn_bytes = churn_samples = calm_bytes = calm_samples = 0
    te = td = 0.0
    seen: set[Labels] = set()
    for seq, frame in enumerate(frames, 1):
        batch = _batch(frame, seq)
        new = [lab for lab in batch.labelsets if lab not in seen]
        seen.update(new)
        t = time.process_time()
        data = enc.encode(batch)
        te += time.process_time() - t
        t = time.process_time()
        dec.decode(data)
        td += time.process_time() - t
        n = batch.sample_count
        size += len(data)
        samples += n
        if codec.frame_base(data) is None:
            keys += 1
            key_bytes += len(data)
        elif new:
            added += len(new)
            churn_frames += 1
            churn_bytes += len(data)
            churn_samples += n
        else:
            calm_bytes += len(data)
            calm_samples += n
    return {
        "B/sample": size / samples,
        "keyframes": keys,
        "keyframe B": key_bytes / max(keys, 1),
        "enc us": te * 1e6 / samples,
        "dec us": td * 1e6 / samples,
        "state B": len(enc.state()),
        "added/frame": added / max(churn_frames, 1),
        "churn frames": churn_frames,
        "churn B/sample": churn_bytes / max(churn_samples, 1),
        "calm B/sample": calm_bytes / max(calm_samples, 1),
    }


def compare(path: Path, limit: int, keyframes: list[int], v2_every: int, modes: Sequence[str]) -> None:
    frames, meta = load(path)
    if limit:
        frames = frames[:limit]
    samples = sum(len(b[3]) for f in frames for b in f)
    series = {lab for f in frames for b in f for lab in b[2]}
    print(f"\n### {path.name}: {meta}\n")
    print(
        f"{len(frames)} frames, {samples} samples ({samples / len(frames):.0f} per frame), "
        f"{len(series)} series seen"
    )
    b2, e2, d2 = _v2_bytes(frames, v2_every)
    print(
        "\n| variant | keyframe every | B/sample | primed zstd | delta frames B/sample | keyframe bytes |"
        " enc us/sample | dec us/sample |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| v2 self-contained | 1 | {b2:.2f} | - | - | - | {e2:.2f} | {d2:.2f} |", flush=True)
    for mode in modes:
        for every in keyframes:
            r = run_variant(frames, mode, every)
            print(
                f"| {mode} | {every} | {r['B/sample']:.3f} | {r['primed B/sample']:.3f} | "
                f"{r['delta B/sample']:.3f} | {r['keyframe B']:.0f} | {r['enc us']:.2f} | "
                f"{r['dec us']:.2f} |",
                flush=True,
            )
    print(
        "\nThe implementation (v3, dod; whole envelopes incl. header, validation included; a key frame"
        " also when the dictionary passes 2x the live series + 1024):\n"
    )
    print(
        "| keyframe every | B/sample | key frames | key frame bytes | enc us/sample | dec us/sample |"
        " state message bytes | frames adding series | series added per such frame |"
        " their B/sample | other delta frames B/sample |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for every in keyframes:
        r = run_v3(frames, every)
        print(
            f"| {every} | {r['B/sample']:.3f} | {r['keyframes']} | {r['keyframe B']:.0f} | "
            f"{r['enc us']:.2f} | {r['dec us']:.2f} | {r['state B']} | {r['churn frames']} | "
            f"{r['added/frame']:.1f} | "
            f"{r['churn B/sample']:.3f} | {r['calm B/sample']:.3f} |",
            flush=True,
        )


# ------------------------------------------------------------------------------------------ windowed


def _window_batches(frames: list[Frame], window: int, source: object) -> list[Batch]:
    """The relay's windowed batches: ``window`` cycles each, cut by ``build_window`` as the relay does."""
    from edge_relay.collect.shape import ShapedScrape
    from edge_relay.encode.batches import BatchEncoder, dedupe_window

    names: Sequence[str] = ()
    if source == "simulator":
        from simulator import EXPORTERS

        names = EXPORTERS
    be = BatchEncoder("lab", NODE, max_bytes=1_000_000, zstd_level=3, version=2, incarnation=1)
    batches: list[Batch] = []
    for start in range(0, len(frames) - window + 1, window):
        scrapes = [
            ShapedScrape(names[t] if t < len(names) else f"target{t}", ts, labels, values)
            for frame in frames[start : start + window]
            for t, ts, labels, values in frame
        ]
        for batch in be.build_window(dedupe_window(scrapes)[0]):
            be.encode(batch, len(batches) + 1)  # the spool's row: sets seq and incarnation
            batches.append(batch)
    return batches


def _frame_content(data: bytes) -> tuple[int, bytes]:
    """(envelope bytes around the zstd frame, decompressed content) of a v3 frame."""
    from schemas.codec import v3
    from schemas.codec.envelope import open_envelope

    _, body, _ = open_envelope(data, codec.DEFAULT_LIMITS)
    compressed = v3.split_body(body)[1]
    return len(data) - len(compressed), v3.content_of(compressed, codec.DEFAULT_LIMITS)


class _Timing:
    """Process seconds spent encoding and decoding, summed over the frames of ``_coded``."""

    def __init__(self) -> None:
        self.enc_s = self.dec_s = 0.0


def _coded(
    enc: codec.StreamEncoder, batches: Sequence[Batch], timing: _Timing
) -> Iterator[tuple[bytes, Batch, Batch]]:
    """(frame, batch, decoded frame) of each batch in turn, through ``enc`` and one fresh decoder;
    ``enc`` is left at the frame just yielded."""
    dec = codec.StreamDecoder()
    for batch in batches:
        t = time.process_time()
        data = enc.encode(batch)
        timing.enc_s += time.process_time() - t
        t = time.process_time()
        got = dec.decode(data)
        timing.dec_s += time.process_time() - t
        yield data, batch, got


def windowed(path: Path, window: int, levels: Sequence[int], top: int, every: int) -> None:
    from schemas.codec import v3

    frames, meta = load(path)
    batches = _window_batches(frames, window, meta.get("source"))
    enc = codec.StreamEncoder("lab", NODE, keyframe_every=every, multicycle=False)
    timing = _Timing()
    out: list[tuple[bytes, Batch, bool, list[Labels], list[int]]] = []
    for data, batch, got in _coded(enc, batches, timing):
        if got.sample_count != batch.sample_count:
            raise AssertionError(f"frame {batch.seq} does not decode to its batch")
        st = enc._state  # the dictionary and the blocks' coded order (ids) the frame was coded in
        assert st is not None
        ids = [i for _, coded in st.blocks for i in coded]
        out.append((data, batch, codec.frame_base(data) is None, st.labels, ids))
    samples = sum(b.sample_count for b in batches)
    delta = [o for o in out if not o[2]]
    key_bytes = sum(len(o[0]) for o in out if o[2])
    key_samples = sum(o[1].sample_count for o in out if o[2])
    delta_samples = max(sum(o[1].sample_count for o in delta), 1)
    print(f"\n### {path.name}: {meta}, windows of {window} cycles\n")
    print(
        "| frames | key frames | samples/frame | B/sample | key frames B/sample | delta frames B/sample |"
        " enc us/sample | dec us/sample |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(
        f"| {len(out)} | {len(out) - len(delta)} | {samples / len(out):.0f} | "
        f"{sum(len(o[0]) for o in out) / samples:.3f} | {key_bytes / max(key_samples, 1):.3f} | "
        f"{sum(len(o[0]) for o in delta) / delta_samples:.3f} | {timing.enc_s * 1e6 / samples:.2f} | "
        f"{timing.dec_s * 1e6 / samples:.2f} |",
        flush=True,
    )
    # Where the delta frames' bytes go: sections, then the values (EXC + DELTAS) by metric family.
    cctx = zstandard.ZstdCompressor(level=3)
    groups = {
        "ADDED": "new label sets",
        "BLOCKS": "blocks (membership, timestamps)",
        "TS": "TS",
        "EXC": "exceptions",
        "DELTAS": "deltas",
    }
    raw: dict[str, int] = {}
    alone: dict[str, int] = {}
    fam_n: dict[str, int] = {}
    fam_raw: dict[str, int] = {}
    fam_bytes: dict[str, bytearray] = {}
    envelope = whole = 0
    contents = []
    for data, _batch, key, labels, ids in out:
        env, content = _frame_content(data)
        contents.append((key, env, content))
        if key:
            continue
        envelope += env
        whole += len(cctx.compress(content))
        sections = _unstreams(content, len(v3.V3_SECTIONS))
        for name, part in zip(v3.V3_SECTIONS, sections, strict=True):
            g = groups.get(name, groups["ADDED"])
            raw[g] = raw.get(g, 0) + len(part)
            alone[g] = alone.get(g, 0) + (len(cctx.compress(part)) if part else 0)
        # the samples' bytes: an exception's gap, kind and integer, else its delta varint
        er = columnar.Reader(sections[8], "EXC")
        exc: dict[int, int] = {}
        pos = -1
        for _ in range(er.uvarint()):
            start = er.pos
            pos += er.uvarint() + 1
            kind = er.take(1)[0]
            if kind != v3.KIND_STALE:
                er.uvarint()
            exc[pos] = er.pos - start
        dr = columnar.Reader(sections[9], "DELTAS")
        for pos, i in enumerate(ids):
            fam = dict(labels[i])["__name__"]
            fam_n[fam] = fam_n.get(fam, 0) + 1
            if pos in exc:
                fam_raw[fam] = fam_raw.get(fam, 0) + exc[pos]
                continue
            start = dr.pos
            dr.uvarint()
            fam_raw[fam] = fam_raw.get(fam, 0) + dr.pos - start
            fam_bytes.setdefault(fam, bytearray()).extend(sections[9][start : dr.pos])
    print("\nDelta frames by section (each section zstd-3 alone, and the frame as sent):\n")
    print("| section | raw B/sample | zstd B/sample |\n| --- | --- | --- |")
    for g, n in raw.items():
        print(f"| {g} | {n / delta_samples:.3f} | {alone[g] / delta_samples:.3f} |")
    print(f"| whole content, one zstd frame | {sum(raw.values()) / delta_samples:.3f} | ", end="")
    print(f"{whole / delta_samples:.3f} |")
    print(f"| envelope (header, frame kind, base sid) | - | {envelope / delta_samples:.3f} |")
    fam_z = {f: len(cctx.compress(bytes(b))) for f, b in fam_bytes.items()}
    print(f"\nValue bytes of the delta frames by metric family (top {top}; deltas zstd-3 per family):\n")
    print(
        "| family | share of samples | exceptions + deltas raw B/sample | deltas zstd B/sample |"
        " share of zstd value bytes |"
    )
    print("| --- | --- | --- | --- | --- |")
    total_z = max(sum(fam_z.values()), 1)
    for fam in sorted(fam_n, key=lambda f: -fam_z.get(f, 0))[:top]:
        n = fam_n[fam]
        print(
            f"| {fam} | {n / delta_samples:.1%} | {fam_raw[fam] / n:.2f} | {fam_z.get(fam, 0) / n:.2f} | "
            f"{fam_z.get(fam, 0) / total_z:.1%} |"
        )
    print("\nThe same contents with other zstd parameters (no wire-format change; envelope included):\n")
    print("| zstd | B/sample | delta frames B/sample | compress us/sample | decompress us/sample |")
    print("| --- | --- | --- | --- | --- |")
    dctx = zstandard.ZstdDecompressor()
    for level in levels:
        cc = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
        size = dsize = 0
        tc = tdz = 0.0
        for key, env, content in contents:
            t = time.process_time()
            z = cc.compress(content)
            tc += time.process_time() - t
            t = time.process_time()
            if dctx.decompress(z) != content:
                raise AssertionError("zstd round trip")
            tdz += time.process_time() - t
            size += len(z) + env
            dsize += 0 if key else len(z) + env
        print(
            f"| level {level} | {size / samples:.3f} | {dsize / delta_samples:.3f} | "
            f"{tc * 1e6 / samples:.3f} | {tdz * 1e6 / samples:.3f} |",
            flush=True,
        )


def _samples(batch: Batch) -> list[tuple[Labels, int, int]]:
    return sorted(
        (batch.labelsets[s], block.sample_timestamp(p), struct.unpack("<Q", struct.pack("<d", v))[0])
        for block in batch.scrapes
        for p, (s, v) in enumerate(zip(block.series, block.values, strict=True))
    )


def multicycle(path: Path, window: int, levels: Sequence[int], every: int) -> None:
    """The same windows as frames of the multi-cycle layout (kinds 0x02/0x03) beside the single-cycle
    ones: whole envelopes, encode (layout + zstd) and decode CPU, checked bit for bit."""
    frames, meta = load(path)
    batches = _window_batches(frames, window, meta.get("source"))
    samples = sum(b.sample_count for b in batches)
    print(f"\n### {path.name}: multi-cycle layout, windows of {window} cycles, {samples} samples\n")
    print(
        "| layout | predictor orders | zstd | B/sample | delta frames B/sample | key frames B/sample |"
        " enc us/sample | dec us/sample | round trip |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    variants: list[tuple[str, str, int, dict[str, Any]]] = [
        ("single-cycle (0x00/0x01)", "2", 3, {"multicycle": False})
    ]
    for orders in ((1, 2), (1, 2, 3, 4)):
        for level in levels:
            kw: dict[str, Any] = {"orders": orders, "multicycle_level": level}
            variants.append(
                ("multi-cycle (0x02/0x03)", "-".join(map(str, (orders[0], orders[-1]))), level, kw)
            )
    for layout, orders_name, level, kw in variants:
        enc = codec.StreamEncoder("lab", NODE, keyframe_every=every, **kw)
        timing = _Timing()
        size = [0, 0]
        n_key = 0
        ok = True
        for data, batch, got in _coded(enc, batches, timing):
            ok = ok and _samples(got) == _samples(batch)
            key = codec.frame_base(data) is None
            size[key] += len(data)
            n_key += batch.sample_count if key else 0
        print(
            f"| {layout} | {orders_name} | {level} | {sum(size) / samples:.3f} | "
            f"{size[0] / max(samples - n_key, 1):.3f} | {size[1] / max(n_key, 1):.3f} | "
            f"{timing.enc_s * 1e6 / samples:.2f} | {timing.dec_s * 1e6 / samples:.2f} | "
            f"{'bit-exact' if ok else 'FAIL'} |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="record the simulator's four exporters")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--series", type=int, default=2000)
    rec.add_argument("--hours", type=float, default=3.0)
    rec.add_argument("--interval", type=float, default=5.0)
    node = sub.add_parser("record-node", help="record a real prometheus-node-exporter")
    node.add_argument("--out", type=Path, required=True)
    node.add_argument("--scrapes", type=int, default=300)
    node.add_argument("--interval", type=float, default=1.0)
    node.add_argument("--port", type=int, default=19177)
    cmp_ = sub.add_parser("compare", help="compare the variants on recordings")
    cmp_.add_argument("recordings", type=Path, nargs="+")
    cmp_.add_argument("--frames", type=int, default=0, help="use the first N frames (0: all)")
    cmp_.add_argument("--keyframes", type=int, nargs="+", default=[60, 360, 720])
    cmp_.add_argument("--v2-every", type=int, default=10, help="encode every Nth frame as v2")
    cmp_.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES, help="none: v2 and v3 only")
    win = sub.add_parser("windowed", help="windowed-mode frames (a batch window of cycles per frame)")
    win.add_argument("recordings", type=Path, nargs="+")
    win.add_argument("--window", type=int, default=12, help="cycles per window (60 s at 5 s: 12)")
    win.add_argument("--levels", type=int, nargs="+", default=[3, 6, 9, 12, 19])
    win.add_argument("--top", type=int, default=12, help="families listed")
    win.add_argument("--keyframes", type=int, default=360, help="keyframe_every")
    win.add_argument("--mc-levels", type=int, nargs="+", default=[3, 19], help="multi-cycle zstd levels")
    win.add_argument("--only-multicycle", action="store_true", help="just the multi-cycle layout table")
    args = ap.parse_args()
    if args.cmd == "record":
        record_simulator(args.out, args.series, args.hours, args.interval)
    elif args.cmd == "record-node":
        record_node_exporter(args.out, args.scrapes, args.interval, args.port)
    elif args.cmd == "windowed":
        for path in args.recordings:
            if not args.only_multicycle:
                windowed(path, args.window, args.levels, args.top, args.keyframes)
            multicycle(path, args.window, args.mc_levels, args.keyframes)
    else:
        for path in args.recordings:
            compare(path, args.frames, args.keyframes, args.v2_every, args.modes)


if __name__ == "__main__":
    main()
