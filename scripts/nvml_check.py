#!/usr/bin/env python3
"""Check the relay's NVML source against ``nvidia-smi`` on a machine with NVIDIA GPUs.

Reads every GPU through the source (``edge_relay.collect.nvml``, what an ``nvml://local`` target serves),
then asks ``nvidia-smi --query-gpu`` for each value it can also give, then reads the source again. A
value that moves (power, clocks, temperatures, utilisation, memory) passes when nvidia-smi's lies within
its tolerance of the span of the two reads; a steady one (limits, error counts, reserved memory) must
match within its tolerance; the labels (UUID, PCI bus id, model, driver) must match exactly. The energy
counter, which nvidia-smi does not serve, is checked against the power draw: its rise between the two
reads over their interval.

Prints one table row per GPU and value, and exits 0 when all match, 1 on a mismatch, 2 when pynvml or
nvidia-smi is missing or NVML cannot start. ``--page`` also prints the page the source serves.

    python scripts/nvml_check.py [--page]      # where the relay is installed (pip install .[nvml])
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from edge_relay.collect import nvml


@dataclass(frozen=True, slots=True)
class Check:
    field: str  # the source's series
    smi: tuple[str, ...]  # nvidia-smi query names, the first that this nvidia-smi knows
    absolute: float = 0.0  # tolerance in the field's unit
    relative: float = 0.0  # tolerance as a fraction of nvidia-smi's value
    moving: bool = False  # compared with the span of the reads before and after nvidia-smi's


CHECKS = (
    Check("DCGM_FI_DEV_SM_CLOCK", ("clocks.sm",), relative=0.05, moving=True),
    Check("DCGM_FI_DEV_MEM_CLOCK", ("clocks.mem",), relative=0.01, moving=True),
    Check("DCGM_FI_DEV_GPU_TEMP", ("temperature.gpu",), absolute=2, moving=True),
    Check("DCGM_FI_DEV_MEMORY_TEMP", ("temperature.memory",), absolute=2, moving=True),
    Check(
        "DCGM_FI_DEV_POWER_USAGE",
        ("power.draw", "power.draw.average"),
        absolute=10,
        relative=0.1,
        moving=True,
    ),
    Check("DCGM_FI_DEV_POWER_MGMT_LIMIT", ("power.limit",), absolute=0.5),
    Check("DCGM_FI_DEV_GPU_UTIL", ("utilization.gpu",), absolute=15, moving=True),
    Check("DCGM_FI_DEV_MEM_COPY_UTIL", ("utilization.memory",), absolute=15, moving=True),
    Check("DCGM_FI_DEV_ENC_UTIL", ("utilization.encoder",), absolute=15, moving=True),
    Check("DCGM_FI_DEV_DEC_UTIL", ("utilization.decoder",), absolute=15, moving=True),
    Check("DCGM_FI_DEV_FB_USED", ("memory.used",), absolute=64, moving=True),
    Check("DCGM_FI_DEV_FB_FREE", ("memory.free",), absolute=64, moving=True),
    Check("DCGM_FI_DEV_FB_RESERVED", ("memory.reserved",), absolute=1),
    Check(
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
        ("clocks_event_reasons.active", "clocks_throttle_reasons.active"),
        moving=True,
    ),
    Check("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", ("ecc.errors.corrected.volatile.total",)),
    Check("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", ("ecc.errors.uncorrected.volatile.total",)),
    Check("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", ("remapped_rows.correctable",)),
    Check("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", ("remapped_rows.uncorrectable",)),
    Check("DCGM_FI_DEV_ROW_REMAP_FAILURE", ("remapped_rows.failure",)),
    Check("DCGM_FI_DEV_RETIRED_SBE", ("retired_pages.single_bit_ecc.count", "retired_pages.sbe")),
    Check("DCGM_FI_DEV_RETIRED_DBE", ("retired_pages.double_bit.count", "retired_pages.dbe")),
)
LABELS = (
    ("UUID", "uuid"),
    ("pci_bus_id", "pci.bus_id"),
    ("modelName", "name"),
    ("DCGM_FI_DRIVER_VERSION", "driver_version"),
)
# Not served by nvidia-smi --query-gpu: checked otherwise (energy) or only shown.
UNCOMPARED = (
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
    "DCGM_FI_PROF_PCIE_TX_BYTES",
    "DCGM_FI_PROF_PCIE_RX_BYTES",
    "DCGM_FI_DEV_XID_ERRORS",
)
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
POWER = "DCGM_FI_DEV_POWER_USAGE"


def smi(field: str) -> dict[str, str] | None:
    """GPU index -> nvidia-smi's text for ``field``; None when this nvidia-smi does not know the field."""
    done = subprocess.run(
        ["nvidia-smi", f"--query-gpu=index,{field}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        if "not a valid field" in (done.stdout + done.stderr):
            return None
        raise RuntimeError(f"nvidia-smi --query-gpu={field}: {(done.stderr or done.stdout).strip()}")
    out = {}
    for line in done.stdout.splitlines():
        index, _, value = line.partition(",")
        out[index.strip()] = value.strip()
    return out


def number(text: str) -> float | None:
    """nvidia-smi's value as a number; None for [N/A], [Not Supported] and the like."""
    text = text.strip()
    if text.lower() in ("yes", "no"):
        return float(text.lower() == "yes")
    try:
        return float(int(text, 16)) if text.lower().startswith("0x") else float(text)
    except ValueError:
        return None


def series(samples: list) -> dict[tuple[str, str], tuple[dict[str, str], float]]:
    out = {}
    for labels, value, _ in samples:
        pairs = dict(labels)
        out[(pairs["__name__"], pairs["gpu"])] = (pairs, value)
    return out


def compare(check: Check, before: float | None, after: float | None, theirs: float) -> tuple[bool, str]:
    ours = [v for v in (before, after) if v is not None]
    if not ours:
        return False, "not read through NVML"
    low, high = (min(ours), max(ours)) if check.moving else (ours[-1], ours[-1])
    tolerance = max(check.absolute, check.relative * abs(theirs))
    return low - tolerance <= theirs <= high + tolerance, f"±{tolerance:g}" + (
        " (moving)" if check.moving else ""
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", action="store_true", help="also print the page the NVML source serves")
    args = parser.parse_args()
    try:
        nvml.load_module()
    except nvml.NvmlUnavailable as e:
        print(f"nvml_check: {e}", file=sys.stderr)
        return 2
    if shutil.which("nvidia-smi") is None:
        print("nvml_check: nvidia-smi is not on PATH: it comes with the NVIDIA driver", file=sys.stderr)
        return 2
    reader = nvml.NvmlReader(socket.gethostname())
    try:
        t0 = time.monotonic()
        first = series(reader.read())
        answers = {}
        for check in CHECKS:
            for name in check.smi:
                got = smi(name)
                if got is not None:
                    answers[check.field] = (name, got)
                    break
        labels = {key: smi(field) or {} for key, field in LABELS}
        second_samples = reader.read()
        t1 = time.monotonic()
        second = series(second_samples)
    except Exception as e:  # NVML or nvidia-smi failing: nothing to compare
        print(f"nvml_check: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finally:
        reader.close()
    if args.page:
        print(nvml.exposition(second_samples))
    gpus = sorted({gpu for _, gpu in second}, key=int)
    rows: list[tuple[str, ...]] = []
    failed = 0
    for gpu in gpus:
        ours_labels = (
            second[(POWER, gpu)][0]
            if (POWER, gpu) in second
            else next(pairs for (_, g), (pairs, _) in second.items() if g == gpu)
        )
        for key, _ in LABELS:
            theirs = labels[key].get(gpu, "")
            ok = theirs == ours_labels.get(key, "")
            failed += not ok
            rows.append(
                (gpu, key, ours_labels.get(key, ""), theirs or "-", "exact", "ok" if ok else "MISMATCH")
            )
        for check in CHECKS:
            before = first.get((check.field, gpu), (None, None))[1]
            after = second.get((check.field, gpu), (None, None))[1]
            shown = "-" if after is None else f"{after:g}"
            if check.field not in answers:
                rows.append((gpu, check.field, shown, "-", "", "n/a (no nvidia-smi field)"))
                continue
            name, got = answers[check.field]
            theirs = number(got.get(gpu, ""))
            if theirs is None:
                status = "n/a" if after is None else f"n/a (nvidia-smi: {got.get(gpu, '')})"
                rows.append((gpu, check.field, shown, got.get(gpu, "-"), name, status))
                continue
            ok, tolerance = compare(check, before, after, theirs)
            failed += not ok
            rows.append(
                (gpu, check.field, shown, f"{theirs:g}", f"{name} {tolerance}", "ok" if ok else "MISMATCH")
            )
        # Energy: its rise over the interval against the power draw (mJ / s = mW).
        e0, e1 = first.get((ENERGY, gpu), (None, None))[1], second.get((ENERGY, gpu), (None, None))[1]
        p0, p1 = first.get((POWER, gpu), (None, None))[1], second.get((POWER, gpu), (None, None))[1]
        if None not in (e0, e1, p0, p1) and t1 > t0:
            watts = (e1 - e0) / (t1 - t0) / 1000  # type: ignore[operator]
            low, high = min(p0, p1) * 0.7 - 5, max(p0, p1) * 1.3 + 5  # type: ignore[type-var, operator]
            ok = low <= watts <= high
            failed += not ok
            rows.append(
                (
                    gpu,
                    ENERGY,
                    f"{e1:g}",
                    f"{watts:.1f} W",
                    "rise / s vs power ±30%",
                    "ok" if ok else "MISMATCH",
                )
            )
        for name in UNCOMPARED:
            value = second.get((name, gpu), (None, None))[1]
            rows.append((gpu, name, "-" if value is None else f"{value:g}", "-", "", "shown only"))
    header = ("gpu", "field", "nvml source", "nvidia-smi", "compared with", "result")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    print(f"\n{len(gpus)} GPU(s), {failed} mismatch(es)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
