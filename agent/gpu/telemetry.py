"""What each GPU of this node does now: clocks, power, temperature, utilisation, why its clocks are
held down, and the Xid errors the driver reported, read through agent.gpu.nvml.

Every figure is read on its own: one the device does not support (NVML_ERROR_NOT_SUPPORTED: a GB10
has no memory info, and may lack application clocks or a power limit) is left out and named in
`unsupported`, the others still come. A host without NVML (no driver: CI, the demo's nodes) gives
an empty report that says why, logged once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

from dsv41.gpu import decode_throttle_reasons

from .nvml import CLOCK_GRAPHICS, CLOCK_MEM, CLOCK_SM, Nvml, NvmlError, NvmlUnavailable

READ_MAX_AGE_S = 1.0    # status and the metrics poll may ask often; NVML is read at most this often
OPEN_RETRY_S = 300.0    # a driver loaded after the agent started is found within this
XID_WAIT_MS = 1000      # how long one wait for an Xid event blocks (the watcher stops within it)


@dataclass(frozen=True)
class GpuReading:
    """One GPU's figures; None where the device did not give that figure."""
    index: int
    name: str = ""
    uuid: str = ""
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    sm_clock_applications_mhz: int | None = None
    graphics_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    memory_clock_max_mhz: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: int | None = None
    utilization_gpu_pct: int | None = None
    utilization_memory_pct: int | None = None
    throttle_mask: int | None = None
    throttle_reasons: tuple[str, ...] = ()
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    xid_count: int = 0
    last_xid: int | None = None
    last_xid_unix_s: float | None = None
    unsupported: tuple[str, ...] = ()  # figures the device answered NOT_SUPPORTED for
    errors: tuple[str, ...] = ()       # "figure: what NVML said" for any other failure


@dataclass(frozen=True)
class GpuReport:
    available: bool            # NVML answered
    detail: str = ""           # why not, when not
    driver_version: str = ""
    gpus: tuple[GpuReading, ...] = ()


class _Figures:
    """Collects one GPU's figures, each read on its own; a failure leaves only that figure out."""

    def __init__(self):
        self.values: dict[str, object] = {}
        self.unsupported: list[str] = []
        self.errors: list[str] = []

    def take(self, name: str, read: Callable[[], object]) -> object | None:
        try:
            value = read()
        except NvmlError as exc:
            if exc.not_supported:
                self.unsupported.append(name)
            else:
                self.errors.append(f"{name}: {exc}")
            return None
        return value

    def put(self, name: str, read: Callable[[], object]) -> None:
        self.values[name] = self.take(name, read)


def read_gpu(nvml: Nvml, index: int) -> GpuReading:
    """All figures of GPU `index`; a GPU whose handle cannot be had (lost) reports only that error."""
    try:
        handle = nvml.handle(index)
    except NvmlError as exc:
        return GpuReading(index=index, errors=(f"handle: {exc}",))
    f = _Figures()
    f.put("name", lambda: nvml.name(handle))
    f.put("uuid", lambda: nvml.uuid(handle))
    f.put("sm_clock_mhz", lambda: nvml.clock_mhz(handle, CLOCK_SM))
    f.put("sm_clock_max_mhz", lambda: nvml.max_clock_mhz(handle, CLOCK_SM))
    f.put("sm_clock_applications_mhz", lambda: nvml.applications_clock_mhz(handle, CLOCK_SM))
    f.put("graphics_clock_mhz", lambda: nvml.clock_mhz(handle, CLOCK_GRAPHICS))
    f.put("memory_clock_mhz", lambda: nvml.clock_mhz(handle, CLOCK_MEM))
    f.put("memory_clock_max_mhz", lambda: nvml.max_clock_mhz(handle, CLOCK_MEM))
    power = f.take("power_w", lambda: nvml.power_usage_mw(handle))
    limit = f.take("power_limit_w", lambda: nvml.power_limit_mw(handle))
    f.put("temperature_c", lambda: nvml.temperature_c(handle))
    utilization = f.take("utilization", lambda: nvml.utilization_pct(handle))
    mask = f.take("throttle_reasons", lambda: nvml.clock_reasons(handle))
    memory = f.take("memory", lambda: nvml.memory_bytes(handle))
    v = f.values
    return GpuReading(
        index=index, name=v["name"] or "", uuid=v["uuid"] or "",
        sm_clock_mhz=v["sm_clock_mhz"], sm_clock_max_mhz=v["sm_clock_max_mhz"],
        sm_clock_applications_mhz=v["sm_clock_applications_mhz"], graphics_clock_mhz=v["graphics_clock_mhz"],
        memory_clock_mhz=v["memory_clock_mhz"], memory_clock_max_mhz=v["memory_clock_max_mhz"],
        power_w=None if power is None else power / 1000.0, power_limit_w=None if limit is None else limit / 1000.0,
        temperature_c=v["temperature_c"],
        utilization_gpu_pct=None if utilization is None else utilization[0],
        utilization_memory_pct=None if utilization is None else utilization[1],
        throttle_mask=mask, throttle_reasons=() if mask is None else decode_throttle_reasons(mask),
        memory_total_bytes=None if memory is None else memory[0], memory_used_bytes=None if memory is None else memory[1],
        unsupported=tuple(f.unsupported), errors=tuple(f.errors))


@dataclass(frozen=True)
class XidSeen:
    count: int
    last: int
    last_unix_s: float


class XidWatcher:
    """Waits for Xid critical-error events of the registered GPUs on a thread of its own (a wait
    with a timeout, so stop() returns within XID_WAIT_MS), counting them per GPU."""

    def __init__(self, nvml: Nvml, handles: dict[int, object], log=None, wall: Callable[[], float] = time.time,
                 wait_ms: int = XID_WAIT_MS):
        """handles: GPU index -> its NVML handle."""
        self._nvml = nvml
        self._log = log
        self._wall = wall
        self._wait_ms = wait_ms
        self._lock = threading.Lock()
        self._seen: dict[int, XidSeen] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._set = nvml.event_set()
        self._index_of: dict[int, int] = {}
        for index, handle in handles.items():
            try:
                nvml.register_xid(handle, self._set)
            except NvmlError:
                continue  # this GPU's Xids are not reported to us (unsupported); the others still are
            self._index_of[handle.value] = index

    @property
    def watched(self) -> tuple[int, ...]:
        return tuple(sorted(self._index_of.values()))

    def start(self) -> "XidWatcher":
        if self._index_of:
            self._thread = threading.Thread(target=self._run, name="gpu-xid", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._wait_ms / 1000.0 + 2.0)
        self._nvml.free_event_set(self._set)

    def seen(self) -> dict[int, XidSeen]:
        with self._lock:
            return dict(self._seen)

    def poll_once(self) -> bool:
        """Waits for one event; True when one came."""
        event = self._nvml.wait_event(self._set, self._wait_ms)
        if event is None:
            return False
        index = self._index_of.get(event.device)
        if index is None:
            return True
        with self._lock:
            before = self._seen.get(index)
            self._seen[index] = XidSeen((before.count if before else 0) + 1, int(event.eventData), self._wall())
        if self._log is not None:
            self._log.warning("gpu_xid", f"GPU{index}: Xid {event.eventData} (a critical error the driver reported)",
                              gpu=index, xid=int(event.eventData))
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except NvmlError as exc:
                if self._log is not None:
                    self._log.warning("gpu_xid_watch_failed", f"GPU Xid events are no longer watched: {exc}")
                return


class GpuTelemetry:
    """The node's GPU report for GetStatus: NVML opened on first use (again after OPEN_RETRY_S when it
    was not there), read at most every max_age_s, Xid events watched from the first open."""

    def __init__(self, nvml_factory: Callable[[], Nvml] = Nvml, log=None,
                 monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 max_age_s: float = READ_MAX_AGE_S, retry_s: float = OPEN_RETRY_S, watch_xid: bool = True):
        self._factory = nvml_factory
        self._log = log
        self._monotonic = monotonic
        self._wall = wall
        self._max_age_s = max_age_s
        self._retry_s = retry_s
        self._watch_xid = watch_xid
        self._lock = threading.Lock()
        self._nvml: Nvml | None = None
        self._driver = ""
        self._unavailable: tuple[float, str] | None = None  # (when, why) the last open failed
        self._told_unavailable = False
        self._xid: XidWatcher | None = None
        self._last: tuple[float, GpuReport] | None = None

    def read(self) -> GpuReport:
        with self._lock:
            now = self._monotonic()
            if self._last is not None and now - self._last[0] < self._max_age_s:
                return self._last[1]
            report = self._read(now)
            self._last = (now, report)
            return report

    def close(self) -> None:
        """Stops the Xid watch and shuts NVML down; an NVML error here is of no use to anyone stopping."""
        with self._lock:
            xid, nvml, self._xid, self._nvml = self._xid, self._nvml, None, None
            for step in ((xid.stop if xid else None), (nvml.close if nvml else None)):
                if step is None:
                    continue
                try:
                    step()
                except NvmlError as exc:
                    if self._log is not None:
                        self._log.info("gpu_telemetry_close_failed", f"GPU telemetry: closing NVML: {exc}")

    def _read(self, now: float) -> GpuReport:
        if self._nvml is None and not self._open(now):
            return GpuReport(available=False, detail=self._unavailable[1] if self._unavailable else "")
        try:
            count = self._nvml.device_count()
        except NvmlError as exc:
            return GpuReport(available=False, detail=f"NVML answered no device count: {exc}",
                             driver_version=self._driver)
        seen = self._xid.seen() if self._xid is not None else {}
        gpus = tuple(_with_xid(read_gpu(self._nvml, index), seen.get(index)) for index in range(count))
        return GpuReport(available=True, driver_version=self._driver, gpus=gpus)

    def _open(self, now: float) -> bool:
        if self._unavailable is not None and now - self._unavailable[0] < self._retry_s:
            return False
        nvml = self._factory()
        try:
            nvml.open()
        except NvmlUnavailable as exc:
            self._unavailable = (now, str(exc))
            if not self._told_unavailable and self._log is not None:
                self._log.info("gpu_telemetry_unavailable", f"GPU telemetry off: {exc}", reason=str(exc))
            self._told_unavailable = True
            return False
        self._nvml, self._unavailable = nvml, None
        self._driver = _or_empty(nvml.driver_version)
        count = _or_empty(nvml.device_count) or 0
        if self._watch_xid and count:
            self._xid = _start_xid(nvml, count, self._log, self._wall)
        if self._log is not None:
            self._log.info("gpu_telemetry", f"GPU telemetry from NVML: {count} GPU(s), driver {self._driver or '?'}; "
                           f"Xid events {'watched' if self._xid and self._xid.watched else 'not watched'}",
                           gpus=count, driver=self._driver)
        return True


def _or_empty(read: Callable[[], object]) -> object:
    try:
        return read()
    except NvmlError:
        return ""


def _start_xid(nvml: Nvml, count: int, log, wall: Callable[[], float]) -> XidWatcher | None:
    try:
        handles = {index: nvml.handle(index) for index in range(count)}
        return XidWatcher(nvml, handles, log, wall).start()
    except NvmlError as exc:
        if log is not None:
            log.info("gpu_xid_unavailable", f"GPU Xid events not watched: {exc}", reason=str(exc))
        return None


def _with_xid(reading: GpuReading, seen: XidSeen | None) -> GpuReading:
    if seen is None:
        return reading
    return replace(reading, xid_count=seen.count, last_xid=seen.last, last_xid_unix_s=seen.last_unix_s)


def reading_dict(reading: GpuReading) -> dict:
    """The reading as plain JSON-able data (the bench script's output)."""
    out = asdict(reading)
    out["throttle_reasons"] = list(reading.throttle_reasons)
    out["unsupported"] = list(reading.unsupported)
    out["errors"] = list(reading.errors)
    return out

