"""A stand-in for the NVML API (the ``pynvml`` module) that replays a real GPU trace, for tests without a GPU.

``ReplayNvml(rows, gpus)`` builds a module object with the pynvml calls the relay's NVML source makes;
put it where ``import pynvml`` finds it (``monkeypatch.setitem(sys.modules, "pynvml", fake.module)``).
Each GPU replays the trace from its own row offset (a fleet's GPUs are at different points of a job);
``step()`` moves every GPU one row on. Values come back in NVML's own units (mW, mJ, bytes, KB/s),
as the driver gives them, so the source's unit conversions are what a test checks.

The trace is ``simulator/data/h200-nvml-training-trace.csv`` (``load_trace``): an NVIDIA H200 read through
NVML every 0.5 s while a training job ran (see the note beside it). What it did not record is fixed
here: encoder/decoder utilisation 0, no remapped rows, retired pages unsupported (Hopper remaps rows).
Its ``fb_used_mib`` is NVML's version-1 "used", which counts what the driver reserves (615 MiB on that
H200 and driver: at idle, version 2 reads 0 used and 615 reserved, as nvidia-smi does); the stand-in
serves the columns as version 2's used and free with ``RESERVED_MIB`` (0) reserved.

Faults: ``fail_with(code)`` makes every device call raise ``NVMLError(code)`` until ``fail_with(None)``;
``delay_s`` makes each device call sleep (a driver that hangs); ``xid(gpu, code)`` queues an XID event.
"""

from __future__ import annotations

import csv
import time
import types
from collections import deque
from pathlib import Path
from typing import Any, Final

from simulator.base import DATA_DIR

TRACE: Final = DATA_DIR / "h200-nvml-training-trace.csv"
MODEL: Final = "NVIDIA H200"
DRIVER: Final = "580.159.04"
RESERVED_MIB: Final = 0
MIB: Final = 1 << 20
NOT_SUPPORTED, TIMEOUT, GPU_IS_LOST = 3, 10, 15


def load_trace(path: Path = TRACE) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {NOT_SUPPORTED: "Not Supported", TIMEOUT: "Timeout", GPU_IS_LOST: "GPU is lost"}.get(
            self.value, f"NVML error {self.value}"
        )


class ReplayNvml:
    def __init__(self, rows: list[dict[str, str]], gpus: int = 1, offset: int = 0) -> None:
        self.rows = rows
        # GPU i starts `offset` * i rows into the trace.
        self.starts = [(offset * i) % len(rows) for i in range(gpus)]
        self.position = 0
        self.failing: int | None = None
        self.delay_s = 0.0
        self.inits = 0
        self.shutdowns = 0
        self.events: deque[types.SimpleNamespace] = deque()
        self.registered: set[int] = set()
        self.module = self._module()

    # --- what a test drives -------------------------------------------------------------------------

    def row(self, gpu: int) -> dict[str, str]:
        """The trace row GPU ``gpu`` serves now."""
        return self.rows[(self.starts[gpu] + self.position) % len(self.rows)]

    def step(self) -> None:
        self.position += 1

    def fail_with(self, code: int | None) -> None:
        self.failing = code

    def xid(self, gpu: int, code: int) -> None:
        self.events.append(types.SimpleNamespace(device=gpu, eventType=0x8, eventData=code, gpuInstanceId=0))

    # --- the module ---------------------------------------------------------------------------------

    def _value(self, handle: int, column: str) -> str:
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.failing is not None:
            raise NVMLError(self.failing)
        return self.row(handle)[column]

    def _module(self) -> types.ModuleType:
        m = types.ModuleType("pynvml")
        m.__dict__.update(self._calls())
        return m

    def _calls(self) -> dict[str, Any]:
        fake = self

        def integer(handle: int, column: str) -> int:
            return int(float(fake._value(handle, column)))

        def init() -> None:
            fake.inits += 1

        def shutdown() -> None:
            fake.shutdowns += 1

        def count() -> int:
            if fake.failing is not None:
                raise NVMLError(fake.failing)
            return len(fake.starts)

        def clock(h: int, kind: int) -> int:
            return integer(h, {1: "sm_clock", 2: "mem_clock"}[kind])

        def field_values(h: int, ids: list[int]) -> list[types.SimpleNamespace]:
            assert ids == [82], ids  # NVML_FI_DEV_MEMORY_TEMP only
            value = types.SimpleNamespace(uiVal=integer(h, "mem_temp"))
            return [types.SimpleNamespace(fieldId=82, nvmlReturn=0, valueType=1, value=value)]

        def memory(h: int, version: int | None = None) -> types.SimpleNamespace:
            used, free = integer(h, "fb_used_mib") * MIB, integer(h, "fb_free_mib") * MIB
            reserved = RESERVED_MIB * MIB
            return types.SimpleNamespace(
                version=version, total=used + free + reserved, reserved=reserved, free=free, used=used
            )

        def ecc(h: int, error_type: int, counter: int) -> int:
            assert counter == 0  # volatile
            return integer(h, "ecc_sbe_vol" if error_type == 0 else "ecc_dbe_vol")

        def not_supported(h: int, *_: Any) -> Any:
            fake._value(h, "t")
            raise NVMLError(NOT_SUPPORTED)

        def event_wait(_set: object, timeout_ms: int) -> types.SimpleNamespace:
            assert timeout_ms == 0, "the source must never wait for events"
            while fake.events:
                event = fake.events.popleft()
                if event.device in fake.registered:
                    return event
            raise NVMLError(TIMEOUT)

        def register(h: int, types_: int, _set: object) -> None:
            assert types_ & 0x8
            fake.registered.add(h)

        return {
            "NVMLError": NVMLError,
            "NVML_ERROR_NOT_SUPPORTED": NOT_SUPPORTED,
            "NVML_ERROR_TIMEOUT": TIMEOUT,
            "nvmlMemory_v2": 0x02000028,
            "nvmlInit": init,
            "nvmlShutdown": shutdown,
            "nvmlSystemGetDriverVersion": lambda: DRIVER,
            "nvmlDeviceGetCount": count,
            "nvmlDeviceGetHandleByIndex": lambda i: i,
            "nvmlDeviceGetUUID": lambda h: f"GPU-5e1d3c7a-9b2f-4e8d-a6c1-{h:012x}",
            "nvmlDeviceGetName": lambda h: MODEL,
            "nvmlDeviceGetPciInfo": lambda h: types.SimpleNamespace(
                busId=f"00000000:{0x18 + h:02X}:00.0".encode()
            ),
            "nvmlDeviceGetClockInfo": clock,
            "nvmlDeviceGetFieldValues": field_values,
            "nvmlDeviceGetTemperature": lambda h, sensor: integer(h, "gpu_temp"),
            "nvmlDeviceGetPowerUsage": lambda h: round(float(fake._value(h, "power_w")) * 1000),
            "nvmlDeviceGetTotalEnergyConsumption": lambda h: integer(h, "energy_mj"),
            "nvmlDeviceGetPcieReplayCounter": lambda h: integer(h, "pcie_replay"),
            "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(
                gpu=integer(h, "gpu_util"), memory=integer(h, "mem_copy_util")
            ),
            "nvmlDeviceGetEncoderUtilization": lambda h: [0 * integer(h, "t"), 167000],
            "nvmlDeviceGetDecoderUtilization": lambda h: [0 * integer(h, "t"), 167000],
            "nvmlDeviceGetMemoryInfo": memory,
            "nvmlDeviceGetRemappedRows": lambda h: (0 * integer(h, "t"), 0, 0, 0),
            "nvmlDeviceGetPcieThroughput": lambda h, c: integer(
                h, "pcie_tx_kbs" if c == 0 else "pcie_rx_kbs"
            ),
            "nvmlDeviceGetCurrentClocksEventReasons": lambda h: integer(h, "throttle_reasons"),
            "nvmlDeviceGetPowerManagementLimit": lambda h: round(
                float(fake._value(h, "power_limit_w")) * 1000
            ),
            "nvmlDeviceGetTotalEccErrors": ecc,
            "nvmlDeviceGetRetiredPages": not_supported,
            "nvmlEventSetCreate": lambda: object(),
            "nvmlEventSetFree": lambda _set: None,
            "nvmlDeviceRegisterEvents": register,
            "nvmlEventSetWait_v2": event_wait,
        }
