"""A stand-in for libnvidia-ml.so.1, for tests of agent.gpu: its functions take the ctypes arguments
the binding passes (pointers from ctypes.pointer, string buffers, c_uint lengths) and write their
outputs through them, returning nvmlReturn_t codes as the C library does. A figure a GPU's dict
lacks answers NVML_ERROR_NOT_SUPPORTED, as a GB10 does for memory info."""

from __future__ import annotations

import ctypes
import threading

from agent.gpu import nvml

HANDLE_BASE = 0x1000
EVENT_SET = 0x77

# What an idle H100 and a busy GB10 answer (figures as the C calls give them: MHz, mW, °C, %).
H100 = {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-11111111-2222-3333-4444-555555555555",
        "clock": {nvml.CLOCK_SM: 345, nvml.CLOCK_GRAPHICS: 345, nvml.CLOCK_MEM: 2619},
        "max_clock": {nvml.CLOCK_SM: 1980, nvml.CLOCK_GRAPHICS: 1980, nvml.CLOCK_MEM: 2619},
        "app_clock": {nvml.CLOCK_SM: 1980}, "power_mw": 71_234, "limit_mw": 700_000, "temperature": 31,
        "utilization": (0, 0), "reasons": 0x1, "memory": (85_520_809_984, 0), "reserved": 503_316_480}
GB10 = {"name": "NVIDIA GB10", "uuid": "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
        "clock": {nvml.CLOCK_SM: 2418, nvml.CLOCK_GRAPHICS: 2418},
        "max_clock": {nvml.CLOCK_SM: 2418}, "power_mw": 38_200, "temperature": 71,
        "utilization": (97, 0), "reasons": 0x0}  # no memory info, memory clock, app clock or limit


class StandInNvml:
    def __init__(self, gpus: list[dict], init_code: int = nvml.SUCCESS, old_driver: bool = False,
                 errors: dict[tuple[int, str], int] | None = None):
        """errors: (GPU index, C function name) -> the code that call answers instead."""
        self.gpus = gpus
        self.init_code = init_code
        self.errors = errors or {}
        self.events: list[tuple[int, int]] = []  # (GPU index, Xid) waiting to be delivered (deliver_xid)
        self.registered: list[int] = []
        self.calls: list[str] = []
        self.shut = False
        self._arrived = threading.Condition()
        if not old_driver:  # newer drivers have these names; the old ones stay
            self.nvmlDeviceGetCurrentClocksEventReasons = self._reasons
            self.nvmlDeviceGetMemoryInfo_v2 = self._memory_v2

    # the library
    def nvmlInit_v2(self):
        return self.init_code

    def nvmlShutdown(self):
        self.shut = True
        return nvml.SUCCESS

    def nvmlErrorString(self, code):
        return {nvml.ERROR_NOT_SUPPORTED: b"Not Supported", nvml.ERROR_GPU_IS_LOST: b"GPU is lost"}.get(
            code.value, b"Unknown Error")

    def nvmlSystemGetDriverVersion(self, buffer, length):
        buffer.value = b"580.159.04"
        return nvml.SUCCESS

    def nvmlDeviceGetCount_v2(self, count):
        count.contents.value = len(self.gpus)
        return nvml.SUCCESS

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        if index.value >= len(self.gpus):
            return nvml.ERROR_INVALID_ARGUMENT
        handle.contents.value = HANDLE_BASE + index.value
        return self._code(index.value, "nvmlDeviceGetHandleByIndex_v2")

    # one device's figures
    def _gpu(self, handle: ctypes.c_void_p, function: str) -> tuple[dict, int]:
        index = handle.value - HANDLE_BASE
        self.calls.append(function)
        return self.gpus[index], self._code(index, function)

    def _code(self, index: int, function: str) -> int:
        return self.errors.get((index, function), nvml.SUCCESS)

    def _put(self, handle, function: str, key: str, out, sub=None) -> int:
        gpu, code = self._gpu(handle, function)
        if code != nvml.SUCCESS:
            return code
        value = gpu.get(key)
        if value is not None and sub is not None:
            value = value.get(sub)
        if value is None:
            return nvml.ERROR_NOT_SUPPORTED
        out.contents.value = value
        return nvml.SUCCESS

    def _text(self, handle, function: str, key: str, buffer, length) -> int:
        gpu, code = self._gpu(handle, function)
        if code == nvml.SUCCESS:
            buffer.value = gpu[key].encode()[: length.value - 1]
        return code

    def nvmlDeviceGetName(self, handle, buffer, length):
        return self._text(handle, "nvmlDeviceGetName", "name", buffer, length)

    def nvmlDeviceGetUUID(self, handle, buffer, length):
        return self._text(handle, "nvmlDeviceGetUUID", "uuid", buffer, length)

    def nvmlDeviceGetClockInfo(self, handle, clock, out):
        return self._put(handle, "nvmlDeviceGetClockInfo", "clock", out, clock.value)

    def nvmlDeviceGetMaxClockInfo(self, handle, clock, out):
        return self._put(handle, "nvmlDeviceGetMaxClockInfo", "max_clock", out, clock.value)

    def nvmlDeviceGetApplicationsClock(self, handle, clock, out):
        return self._put(handle, "nvmlDeviceGetApplicationsClock", "app_clock", out, clock.value)

    def nvmlDeviceGetPowerUsage(self, handle, out):
        return self._put(handle, "nvmlDeviceGetPowerUsage", "power_mw", out)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle, out):
        return self._put(handle, "nvmlDeviceGetEnforcedPowerLimit", "limit_mw", out)

    def nvmlDeviceGetTemperature(self, handle, sensor, out):
        assert sensor.value == nvml.TEMPERATURE_GPU
        return self._put(handle, "nvmlDeviceGetTemperature", "temperature", out)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle, out):
        return self._put(handle, "nvmlDeviceGetCurrentClocksThrottleReasons", "reasons", out)

    def _reasons(self, handle, out):
        return self._put(handle, "nvmlDeviceGetCurrentClocksEventReasons", "reasons", out)

    def nvmlDeviceGetUtilizationRates(self, handle, out):
        gpu, code = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        if code == nvml.SUCCESS and "utilization" not in gpu:
            code = nvml.ERROR_NOT_SUPPORTED
        if code == nvml.SUCCESS:
            out.contents.gpu, out.contents.memory = gpu["utilization"]
        return code

    def nvmlDeviceGetMemoryInfo(self, handle, out):
        """v1: `used` counts what the driver reserves."""
        gpu, code = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        if code == nvml.SUCCESS and "memory" not in gpu:
            code = nvml.ERROR_NOT_SUPPORTED
        if code == nvml.SUCCESS:
            total, used = gpu["memory"]
            used += gpu.get("reserved", 0)
            out.contents.total, out.contents.used, out.contents.free = total, used, total - used
        return code

    def _memory_v2(self, handle, out):
        gpu, code = self._gpu(handle, "nvmlDeviceGetMemoryInfo_v2")
        if code == nvml.SUCCESS and out.contents.version != nvml.MEMORY_V2_VERSION:
            code = nvml.ERROR_ARGUMENT_VERSION_MISMATCH
        if code == nvml.SUCCESS and "memory" not in gpu:
            code = nvml.ERROR_NOT_SUPPORTED
        if code == nvml.SUCCESS:
            (total, used), reserved = gpu["memory"], gpu.get("reserved", 0)
            c = out.contents
            c.total, c.used, c.reserved, c.free = total, used, reserved, total - used - reserved
        return code

    # Xid events
    def nvmlEventSetCreate(self, out):
        out.contents.value = EVENT_SET
        return nvml.SUCCESS

    def nvmlDeviceRegisterEvents(self, handle, types, event_set):
        assert types.value == nvml.EVENT_XID_CRITICAL_ERROR and event_set.value == EVENT_SET
        gpu, code = self._gpu(handle, "nvmlDeviceRegisterEvents")
        if code == nvml.SUCCESS:
            self.registered.append(handle.value - HANDLE_BASE)
        return code

    def deliver_xid(self, index: int, xid: int) -> None:
        with self._arrived:
            self.events.append((index, xid))
            self._arrived.notify_all()

    def nvmlEventSetWait_v2(self, event_set, out, timeout_ms):
        with self._arrived:  # blocks as the C call does, but never past 50 ms of a test's time
            self._arrived.wait_for(lambda: self.events, min(timeout_ms.value / 1000.0, 0.05))
            if not self.events:
                return nvml.ERROR_TIMEOUT
            index, xid = self.events.pop(0)
        out.contents.device = HANDLE_BASE + index
        out.contents.eventType = nvml.EVENT_XID_CRITICAL_ERROR
        out.contents.eventData = xid
        return nvml.SUCCESS

    def nvmlEventSetFree(self, event_set):
        return nvml.SUCCESS
