"""NVIDIA GPUs read through NVML (``nvidia-ml-py``, imported as ``pynvml``), served as dcgm-exporter does.

For nodes where dcgm-exporter does not fit: DCGM does not run on Jetson, its profiling fields do not run on
GeForce/RTX, and its host engine is heavy for a small node. A target with ``url: nvml://local`` reads the
node's GPUs itself, once a cycle, and yields the samples the HTTP path would parse from dcgm-exporter's
page: the same field names (``DCGM_FI_*``), types, units (MHz, C, W, mJ, MiB, %) and labels (``gpu``,
``UUID``, ``pci_bus_id``, ``device``, ``modelName``, ``Hostname``, ``DCGM_FI_DRIVER_VERSION``; ``err_code``
and ``err_msg`` on ``DCGM_FI_DEV_XID_ERRORS``), so presets, anomaly rules and dashboards work unchanged.

What differs from dcgm-exporter, on purpose or because NVML has no such reading:

- no ``container`` / ``namespace`` / ``pod``: the relay does not ask the kubelet who holds a GPU (as
  dcgm-exporter serves an idle GPU);
- no ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` / ``PIPE_TENSOR_ACTIVE`` / ``DRAM_ACTIVE`` (DCGM's profiling
  module), ``NVLINK_BANDWIDTH_TOTAL`` or ``VGPU_LICENSE_STATUS``;
- ``DCGM_FI_PROF_PCIE_TX_BYTES`` / ``RX_BYTES`` come from NVML's PCIe throughput counter (KB/s, the
  driver's last 20 ms), in bytes/s: the same unit, a shorter window than DCGM's profiling average;
- beside the default fields, the health fields a GPU node wants and NVML has: the clock throttle reasons,
  the power limit (the power rules divide by it), volatile ECC counts and retired pages;
- a reading the GPU does not support (memory temperature on GDDR parts, row remapping before Ampere,
  retired pages after it, ECC when disabled) is left out, as dcgm-exporter leaves blank fields out; any
  other NVML error fails the whole read (``up`` 0), and NVML is initialised again next cycle.

XID errors arrive as NVML events: the read drains the event set without waiting (timeout 0), and each
GPU's ``DCGM_FI_DEV_XID_ERRORS`` holds its last XID (0, ``No Error`` until one comes), as DCGM's field does.

The NVML calls run on one thread of the source's own, so the cycle waits for them at most until the
target's deadline: a read past it is a failed scrape (``timeout``), and while a stuck read is still
running the next cycles fail at once instead of piling up behind it.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Final

from edge_relay.collect.source import Reading
from schemas.model import Labels

MODULE: Final = "pynvml"
INSTALL_HINT: Final = "install the relay's `nvml` extra (pip install 'kepler-edge-relay[nvml]', nvidia-ml-py)"
MIB: Final = 1 << 20
# Events drained a read at most: a storm of XIDs must not hold the cycle (the rest come next cycle).
_MAX_EVENTS_PER_READ: Final = 256

# NVML return codes (nvml.h): stable across driver versions.
NOT_SUPPORTED: Final = 3
TIMEOUT: Final = 10
FUNCTION_NOT_FOUND: Final = 13
ARGUMENT_VERSION_MISMATCH: Final = 25
# NVML_FI_DEV_MEMORY_TEMP: the field id of the HBM / memory temperature.
FI_DEV_MEMORY_TEMP: Final = 82
# Volatile ECC counts, memory error types, retirement causes, PCIe counters, clocks (nvml.h enums).
_VOLATILE_ECC: Final = 0
_CORRECTED, _UNCORRECTED = 0, 1
_RETIRED_SBE_CAUSE, _RETIRED_DBE_CAUSE = 0, 1
_PCIE_TX, _PCIE_RX = 0, 1
_CLOCK_SM, _CLOCK_MEM = 1, 2
_TEMPERATURE_GPU: Final = 0
_EVENT_XID: Final = 0x0000000000000008  # nvmlEventTypeXidCriticalError


@dataclass(frozen=True, slots=True)
class Family:
    """One dcgm-exporter field: its name, type and HELP as dcgm-exporter serves them; ``integer``: printed
    with ``%d`` (else ``%f``)."""

    name: str
    type: str
    help: str
    integer: bool = True


# dcgm-exporter 4.x's default fields (etc/default-counters.csv, in its order) that NVML can read, then the
# health fields it comments out there. Names, types and HELP are dcgm-exporter's.
FAMILIES: Final = (
    Family("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    Family("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    Family("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    Family("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    Family("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", integer=False),
    Family("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ)."),
    Family("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
    Family("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    Family("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    Family("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %)."),
    Family("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %)."),
    Family("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    Family("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    Family("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    Family("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB)."),
    Family(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for uncorrectable errors",
    ),
    Family(
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for correctable errors"
    ),
    Family("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed"),
    Family(
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "gauge",
        "The rate of data transmitted over the PCIe bus - including both protocol headers and data "
        "payloads - in bytes per second.",
    ),
    Family(
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "gauge",
        "The rate of data received over the PCIe bus - including both protocol headers and data "
        "payloads - in bytes per second.",
    ),
    # Health fields (commented out in default-counters.csv).
    Family("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "gauge", "Current clock throttle reasons."),
    Family("DCGM_FI_DEV_POWER_MGMT_LIMIT", "gauge", "Power management limit (in W).", integer=False),
    Family("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "Total number of single-bit volatile ECC errors."),
    Family("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors."),
    Family("DCGM_FI_DEV_RETIRED_SBE", "counter", "Total number of retired pages due to single-bit errors."),
    Family("DCGM_FI_DEV_RETIRED_DBE", "counter", "Total number of retired pages due to double-bit errors."),
)
XID_FAMILY: Final = "DCGM_FI_DEV_XID_ERRORS"

# The names NVIDIA's XID catalogue gives the errors an edge node meets most; others are "Unknown Error".
XID_NAMES: Final = {
    0: "No Error",
    13: "Graphics Engine Exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    48: "Double Bit ECC Error",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    74: "NVLINK Error",
    79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate",
    94: "Contained ECC error",
    95: "Uncontained ECC error",
    119: "GSP RPC Timeout",
}

Values = Iterable[tuple[str, float]]
# One NVML query of one GPU: (pynvml, handle) -> (field name, value in dcgm-exporter's unit) pairs.
Reader = Callable[[Any, Any], Values]


def _text(value: str | bytes) -> str:
    # nvidia-ml-py returns str from 11.5 on; older bindings gave bytes.
    return value.decode() if isinstance(value, bytes) else value


def _field_value(nvml: Any, handle: Any, field_id: int) -> float:
    (fv,) = nvml.nvmlDeviceGetFieldValues(handle, [field_id])
    if fv.nvmlReturn != 0:
        raise nvml.NVMLError(fv.nvmlReturn)
    # nvmlValueType_t: 0 double, 1 unsigned int, 2 unsigned long, 3 unsigned long long,
    # 4 signed long long, 5 signed int.
    member = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal")[fv.valueType]
    return float(getattr(fv.value, member))


def _clocks(nvml: Any, h: Any) -> Values:
    yield "DCGM_FI_DEV_SM_CLOCK", nvml.nvmlDeviceGetClockInfo(h, _CLOCK_SM)
    yield "DCGM_FI_DEV_MEM_CLOCK", nvml.nvmlDeviceGetClockInfo(h, _CLOCK_MEM)


def _memory_temp(nvml: Any, h: Any) -> Values:
    yield "DCGM_FI_DEV_MEMORY_TEMP", _field_value(nvml, h, FI_DEV_MEMORY_TEMP)


def _gpu_temp(nvml: Any, h: Any) -> Values:
    yield "DCGM_FI_DEV_GPU_TEMP", nvml.nvmlDeviceGetTemperature(h, _TEMPERATURE_GPU)


def _power(nvml: Any, h: Any) -> Values:
    yield "DCGM_FI_DEV_POWER_USAGE", nvml.nvmlDeviceGetPowerUsage(h) / 1000.0  # mW


def _energy(nvml: Any, h: Any) -> Values:
    yield "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", nvml.nvmlDeviceGetTotalEnergyConsumption(h)  # mJ


def _pcie_replay(nvml: Any, h: Any) -> Values:
    yield "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", nvml.nvmlDeviceGetPcieReplayCounter(h)


def _utilization(nvml: Any, h: Any) -> Values:
    rates = nvml.nvmlDeviceGetUtilizationRates(h)
    yield "DCGM_FI_DEV_GPU_UTIL", rates.gpu
    yield "DCGM_FI_DEV_MEM_COPY_UTIL", rates.memory


def _encoder(nvml: Any, h: Any) -> Values:
    yield "DCGM_FI_DEV_ENC_UTIL", nvml.nvmlDeviceGetEncoderUtilization(h)[0]  # (%, sampling period)


def _decoder(nvml: Any, h: Any) -> Values:
    yield "DCGM_FI_DEV_DEC_UTIL", nvml.nvmlDeviceGetDecoderUtilization(h)[0]


def _framebuffer(nvml: Any, h: Any) -> Values:
    # Version 2 splits what the driver reserves from what is used, as DCGM reports them; bindings or
    # drivers without it give version 1, whose `used` includes the reserved part.
    info, reserved = None, None
    if hasattr(nvml, "nvmlMemory_v2"):
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(h, version=nvml.nvmlMemory_v2)
            reserved = info.reserved
        except nvml.NVMLError as e:
            if e.value not in (NOT_SUPPORTED, FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH):
                raise
    if info is None:
        info = nvml.nvmlDeviceGetMemoryInfo(h)
    yield "DCGM_FI_DEV_FB_FREE", info.free // MIB
    yield "DCGM_FI_DEV_FB_USED", info.used // MIB
    if reserved is not None:
        yield "DCGM_FI_DEV_FB_RESERVED", reserved // MIB


def _remapped_rows(nvml: Any, h: Any) -> Values:
    correctable, uncorrectable, _pending, failed = nvml.nvmlDeviceGetRemappedRows(h)
    yield "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", uncorrectable
    yield "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", correctable
    yield "DCGM_FI_DEV_ROW_REMAP_FAILURE", failed


def _pcie_throughput(nvml: Any, h: Any) -> Values:
    yield "DCGM_FI_PROF_PCIE_TX_BYTES", nvml.nvmlDeviceGetPcieThroughput(h, _PCIE_TX) * 1024  # KB/s
    yield "DCGM_FI_PROF_PCIE_RX_BYTES", nvml.nvmlDeviceGetPcieThroughput(h, _PCIE_RX) * 1024


def _throttle_reasons(nvml: Any, h: Any) -> Values:
    # Renamed "clocks event reasons" in NVML 12.2; the bitmask is the same.
    get = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    if get is None:
        get = nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    yield "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", get(h)


def _power_limit(nvml: Any, h: Any) -> Values:
    yield "DCGM_FI_DEV_POWER_MGMT_LIMIT", nvml.nvmlDeviceGetPowerManagementLimit(h) / 1000.0  # mW


def _ecc(nvml: Any, h: Any) -> Values:
    yield "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", nvml.nvmlDeviceGetTotalEccErrors(h, _CORRECTED, _VOLATILE_ECC)
    yield "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", nvml.nvmlDeviceGetTotalEccErrors(h, _UNCORRECTED, _VOLATILE_ECC)


def _retired_pages(nvml: Any, h: Any) -> Values:
    yield "DCGM_FI_DEV_RETIRED_SBE", len(nvml.nvmlDeviceGetRetiredPages(h, _RETIRED_SBE_CAUSE))
    yield "DCGM_FI_DEV_RETIRED_DBE", len(nvml.nvmlDeviceGetRetiredPages(h, _RETIRED_DBE_CAUSE))


READERS: Final[tuple[Reader, ...]] = (
    _clocks,
    _memory_temp,
    _gpu_temp,
    _power,
    _energy,
    _pcie_replay,
    _utilization,
    _encoder,
    _decoder,
    _framebuffer,
    _remapped_rows,
    _pcie_throughput,
    _throttle_reasons,
    _power_limit,
    _ecc,
    _retired_pages,
)
_ORDER: Final = {f.name: i for i, f in enumerate(FAMILIES)}


class NvmlUnavailable(Exception):
    """pynvml cannot be imported: the `nvml` extra is not installed."""


def load_module() -> Any:
    """The ``pynvml`` module, or :class:`NvmlUnavailable` saying how to get it."""
    try:
        return importlib.import_module(MODULE)
    except ImportError as e:
        raise NvmlUnavailable(f"an nvml:// target needs the `pynvml` module ({e}): {INSTALL_HINT}") from e


def check_usable() -> None:
    """Initialise NVML once and shut it down: raises :class:`NvmlUnavailable` or ``pynvml.NVMLError``
    (no driver, no GPU)."""
    nvml = load_module()
    nvml.nvmlInit()
    try:
        nvml.nvmlDeviceGetCount()
    finally:
        nvml.nvmlShutdown()


@dataclass(slots=True)
class _Gpu:
    index: int
    handle: Any
    uuid: str
    labels: dict[str, str]
    # Label tuples, built once: the shaper's fast path knows a series by its (identical) labels.
    series: dict[str, Labels] = field(default_factory=dict)
    unsupported: set[Reader] = field(default_factory=set)
    xid: int | None = None  # None: XID events cannot be registered on this GPU (no row)


def _series(name: str, labels: dict[str, str]) -> Labels:
    return tuple(sorted((k, v) for k, v in {**labels, "__name__": name}.items() if v))


class NvmlReader:
    """NVML's state (initialised, device handles, event set) and one read of every GPU; not thread-safe:
    :class:`NvmlSource` calls it from one thread."""

    def __init__(self, hostname: str) -> None:
        self.hostname = hostname
        self._nvml: Any = None
        self._gpus: list[_Gpu] = []
        self._events: Any = None

    def read(self) -> list[tuple[Labels, float, None]]:
        """Every GPU's fields, family by family as dcgm-exporter's page lists them; an NVML error other
        than "not supported" propagates (and NVML is set up again on the next read)."""
        try:
            if self._nvml is None:
                self._start()
            self._drain_xid_events()
            rows: list[tuple[int, int, Labels, float]] = []
            for gpu in self._gpus:
                for name, value in self._read_gpu(gpu):
                    labels = gpu.series.get(name)
                    if labels is None:
                        labels = gpu.series[name] = _series(name, gpu.labels)
                    rows.append((_ORDER[name], gpu.index, labels, float(value)))
                if gpu.xid is not None:
                    xid_labels = {**gpu.labels, "err_code": str(gpu.xid)}
                    xid_labels["err_msg"] = XID_NAMES.get(gpu.xid, "Unknown Error")
                    key = f"{XID_FAMILY}:{gpu.xid}"
                    if key not in gpu.series:
                        gpu.series[key] = _series(XID_FAMILY, xid_labels)
                    rows.append((_ORDER[XID_FAMILY], gpu.index, gpu.series[key], float(gpu.xid)))
        except BaseException:
            self.close()
            raise
        rows.sort(key=lambda r: (r[0], r[1]))
        return [(labels, value, None) for _, _, labels, value in rows]

    def _read_gpu(self, gpu: _Gpu) -> Iterable[tuple[str, float]]:
        nvml = self._nvml
        for reader in READERS:
            if reader in gpu.unsupported:
                continue
            try:
                values = list(reader(nvml, gpu.handle))
            except nvml.NVMLError as e:
                if e.value not in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
                    raise
                gpu.unsupported.add(reader)  # asked once: the answer does not change while it runs
                continue
            except AttributeError:
                gpu.unsupported.add(reader)  # bindings older than the call
                continue
            yield from values

    def _start(self) -> None:
        nvml = load_module()
        nvml.nvmlInit()
        self._nvml = nvml
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        try:
            self._events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as e:
            if e.value not in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
                raise
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            labels = {
                "gpu": str(index),
                "UUID": uuid,
                "pci_bus_id": _text(nvml.nvmlDeviceGetPciInfo(handle).busId),
                "device": f"nvidia{index}",
                "modelName": _text(nvml.nvmlDeviceGetName(handle)),
                "Hostname": self.hostname,
                "DCGM_FI_DRIVER_VERSION": driver,
            }
            gpu = _Gpu(index, handle, uuid, labels)
            if self._events is not None:
                try:
                    nvml.nvmlDeviceRegisterEvents(handle, _EVENT_XID, self._events)
                    gpu.xid = 0
                except nvml.NVMLError as e:
                    if e.value not in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
                        raise
            gpus.append(gpu)
        self._gpus = gpus

    def _drain_xid_events(self) -> None:
        if self._events is None:
            return
        nvml = self._nvml
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        by_uuid = {gpu.uuid: gpu for gpu in self._gpus}
        for _ in range(_MAX_EVENTS_PER_READ):
            try:
                event = wait(self._events, 0)  # never blocks: 0 ms
            except nvml.NVMLError as e:
                if e.value == TIMEOUT:  # no event pending
                    return
                raise
            if event.eventType & _EVENT_XID:
                gpu = by_uuid.get(_text(nvml.nvmlDeviceGetUUID(event.device)))
                if gpu is not None:
                    gpu.xid = int(event.eventData)

    def close(self) -> None:
        """Free the event set and shut NVML down; the next read starts again."""
        nvml, self._nvml = self._nvml, None
        events, self._events = self._events, None
        self._gpus = []
        if nvml is None:
            return
        # Whatever is already gone with the driver has nothing left to free.
        if events is not None:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlEventSetFree(events)
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


class NvmlSource:
    """The target's source: :class:`NvmlReader` on a thread of its own, bounded by the cycle's deadline."""

    def __init__(self, hostname: str, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.reader = NvmlReader(hostname)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvml")
        self._running: Future[list[tuple[Labels, float, None]]] | None = None

    def read(self, deadline: float, sample_limit: int = 0) -> Reading:
        """One read of every GPU, waited for until ``deadline`` (``time.monotonic()``)."""
        timestamp_ms = int(time.time() * 1000)
        if self._running is not None and not self._running.done():
            return Reading(timestamp_ms, None, "the previous NVML read has not returned yet", "timeout")
        self._running = self._pool.submit(self.reader.read)
        try:
            samples = self._running.result(timeout=max(deadline - time.monotonic(), 0.0))
        except FutureTimeout:
            return Reading(timestamp_ms, None, f"timeout after {self.timeout_s:g}s reading NVML", "timeout")
        except NvmlUnavailable as e:
            return Reading(timestamp_ms, None, str(e), "nvml_error")
        except Exception as e:  # pynvml.NVMLError and whatever a broken binding raises
            return Reading(timestamp_ms, None, f"NVML: {type(e).__name__}: {e}", "nvml_error")
        if sample_limit and len(samples) > sample_limit:
            error = f"{len(samples)} samples, more than sample_limit={sample_limit}"
            return Reading(timestamp_ms, None, error, "sample_limit")
        return Reading(timestamp_ms, samples)

    def close(self) -> None:
        self._pool.submit(self.reader.close)
        self._pool.shutdown(wait=False)


def exposition(samples: Iterable[tuple[Labels, float, Any]]) -> str:
    """``samples`` as dcgm-exporter's page: HELP and TYPE per family, labels in its fixed order, ``%d`` or
    ``%f`` values (for a look at what the source serves, and for comparing it with a real page)."""
    order = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION")
    families = {f.name: f for f in FAMILIES}
    lines: list[str] = []
    current = ""
    for labels, value, _ in samples:
        pairs = dict(labels)
        name = pairs.pop("__name__")
        family = families[name]
        if name != current:
            lines += [f"# HELP {name} {family.help}", f"# TYPE {name} {family.type}"]
            current = name
        ordered = [k for k in order if k in pairs] + sorted(k for k in pairs if k not in order)
        text = ",".join(f'{k}="{pairs[k]}"' for k in ordered)
        number = f"{int(value)}" if family.integer else f"{value:f}"
        lines.append(f"{name}{{{text}}} {number}")
    return "\n".join(lines) + "\n"
