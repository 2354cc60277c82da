"""A thin ctypes binding of libnvidia-ml.so.1: the NVML calls GPU telemetry needs, nothing more.

No NVML binding is a Debian main package (python3-pynvml is not in Debian 12/13 main nor Ubuntu
24.04 main), and the driver ships libnvidia-ml.so.1 on every GPU node, so a few ctypes calls keep
the agent's packages free of another dependency.

The library comes from an injected loader, so tests drive this binding with a stand-in object whose
functions take the same ctypes arguments (pointers made with ctypes.pointer, string buffers) and
write their outputs through them, returning an nvmlReturn_t code as the C functions do.
"""

from __future__ import annotations

import ctypes
from typing import Callable

LIBRARY = "libnvidia-ml.so.1"

# nvmlReturn_t
SUCCESS = 0
ERROR_UNINITIALIZED = 1
ERROR_INVALID_ARGUMENT = 2
ERROR_NOT_SUPPORTED = 3
ERROR_NO_PERMISSION = 4
ERROR_NOT_FOUND = 6
ERROR_DRIVER_NOT_LOADED = 9
ERROR_TIMEOUT = 10
ERROR_LIBRARY_NOT_FOUND = 12
ERROR_FUNCTION_NOT_FOUND = 13
ERROR_GPU_IS_LOST = 15
ERROR_ARGUMENT_VERSION_MISMATCH = 25
ERROR_UNKNOWN = 999

# nvmlClockType_t
CLOCK_GRAPHICS = 0
CLOCK_SM = 1
CLOCK_MEM = 2

TEMPERATURE_GPU = 0  # nvmlTemperatureSensors_t
EVENT_XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError

_NAME_LENGTH = 96  # NVML_DEVICE_NAME_V2_BUFFER_SIZE
_UUID_LENGTH = 96  # NVML_DEVICE_UUID_V2_BUFFER_SIZE
_VERSION_LENGTH = 80  # NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE


class Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class MemoryV2(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("total", ctypes.c_ulonglong), ("reserved", ctypes.c_ulonglong),
                ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


MEMORY_V2_VERSION = ctypes.sizeof(MemoryV2) | (2 << 24)  # NVML_STRUCT_VERSION(Memory, 2)


class EventData(ctypes.Structure):
    _fields_ = [("device", ctypes.c_void_p), ("eventType", ctypes.c_ulonglong), ("eventData", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class NvmlError(Exception):
    """A call answered something other than NVML_SUCCESS."""

    def __init__(self, function: str, code: int, text: str = ""):
        super().__init__(f"{function}: {text or 'NVML error'} ({code})")
        self.function = function
        self.code = code

    @property
    def not_supported(self) -> bool:
        return self.code in (ERROR_NOT_SUPPORTED, ERROR_FUNCTION_NOT_FOUND)


class NvmlUnavailable(Exception):
    """No NVML on this host: the library is not there, or it did not initialise (no driver)."""


def load_library() -> object:
    return ctypes.CDLL(LIBRARY)


class Nvml:
    """One initialised NVML session: open() before the reads, close() after."""

    def __init__(self, load: Callable[[], object] = load_library):
        self._load = load
        self._lib: object | None = None

    def open(self) -> None:
        try:
            lib = self._load()
        except OSError as exc:
            raise NvmlUnavailable(f"no NVML: {LIBRARY} cannot be loaded ({exc})") from None
        try:
            self._lib = lib
            self._call("nvmlInit_v2")
        except NvmlError as exc:
            self._lib = None
            raise NvmlUnavailable(f"no NVML: {exc}") from None

    def close(self) -> None:
        if self._lib is not None:
            try:
                self._call("nvmlShutdown")
            finally:
                self._lib = None

    def _function(self, name: str):
        try:
            return getattr(self._lib, name)
        except AttributeError:
            raise NvmlError(name, ERROR_FUNCTION_NOT_FOUND, "not in this driver's library") from None

    def _call(self, name: str, *args) -> None:
        if self._lib is None:
            raise NvmlError(name, ERROR_UNINITIALIZED, "NVML is not open")
        code = self._function(name)(*args)
        if code != SUCCESS:
            raise NvmlError(name, code, self._error_text(code))

    def _error_text(self, code: int) -> str:
        try:
            function = self._function("nvmlErrorString")
        except NvmlError:
            return ""
        try:
            function.restype = ctypes.c_char_p  # const char*; a stand-in's method has no restype to set
        except AttributeError:
            pass
        text = function(ctypes.c_int(code))
        return text.decode(errors="replace") if isinstance(text, bytes) else str(text or "")

    def _uint(self, name: str, *args) -> int:
        out = ctypes.c_uint()
        self._call(name, *args, ctypes.pointer(out))
        return out.value

    def _text(self, name: str, length: int, *args) -> str:
        buffer = ctypes.create_string_buffer(length)
        self._call(name, *args, buffer, ctypes.c_uint(length))
        return buffer.value.decode(errors="replace")

    def driver_version(self) -> str:
        return self._text("nvmlSystemGetDriverVersion", _VERSION_LENGTH)

    def device_count(self) -> int:
        return self._uint("nvmlDeviceGetCount_v2")

    def handle(self, index: int) -> ctypes.c_void_p:
        out = ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.pointer(out))
        return out

    def name(self, handle) -> str:
        return self._text("nvmlDeviceGetName", _NAME_LENGTH, handle)

    def uuid(self, handle) -> str:
        return self._text("nvmlDeviceGetUUID", _UUID_LENGTH, handle)

    def clock_mhz(self, handle, clock: int) -> int:
        return self._uint("nvmlDeviceGetClockInfo", handle, ctypes.c_int(clock))

    def max_clock_mhz(self, handle, clock: int) -> int:
        return self._uint("nvmlDeviceGetMaxClockInfo", handle, ctypes.c_int(clock))

    def applications_clock_mhz(self, handle, clock: int) -> int:
        return self._uint("nvmlDeviceGetApplicationsClock", handle, ctypes.c_int(clock))

    def power_usage_mw(self, handle) -> int:
        return self._uint("nvmlDeviceGetPowerUsage", handle)

    def power_limit_mw(self, handle) -> int:
        return self._uint("nvmlDeviceGetEnforcedPowerLimit", handle)

    def temperature_c(self, handle) -> int:
        return self._uint("nvmlDeviceGetTemperature", handle, ctypes.c_int(TEMPERATURE_GPU))

    def utilization_pct(self, handle) -> tuple[int, int]:
        """(GPU, memory): percent of the last sample period a kernel ran / device memory was read or written."""
        out = Utilization()
        self._call("nvmlDeviceGetUtilizationRates", handle, ctypes.pointer(out))
        return out.gpu, out.memory

    def clock_reasons(self, handle) -> int:
        """The bit mask of why the clocks are below their maximum (ClocksEventReasons since driver 535;
        the older ClocksThrottleReasons where the library lacks it: the same bits)."""
        out = ctypes.c_ulonglong()
        try:
            self._call("nvmlDeviceGetCurrentClocksEventReasons", handle, ctypes.pointer(out))
        except NvmlError as exc:
            if exc.code != ERROR_FUNCTION_NOT_FOUND:
                raise
            self._call("nvmlDeviceGetCurrentClocksThrottleReasons", handle, ctypes.pointer(out))
        return out.value

    def memory_bytes(self, handle) -> tuple[int, int]:
        """(total, used) device memory; a unified-memory device (GB10) answers NOT_SUPPORTED. The v2
        call, as nvidia-smi reads it: its `used` leaves out what the driver reserves, which the v1
        call counts as used (480 MiB on an idle H100 with driver 580); v1 where the library lacks v2."""
        v2 = MemoryV2(version=MEMORY_V2_VERSION)
        try:
            self._call("nvmlDeviceGetMemoryInfo_v2", handle, ctypes.pointer(v2))
            return v2.total, v2.used
        except NvmlError as exc:
            if exc.code not in (ERROR_FUNCTION_NOT_FOUND, ERROR_ARGUMENT_VERSION_MISMATCH):
                raise
        out = Memory()
        self._call("nvmlDeviceGetMemoryInfo", handle, ctypes.pointer(out))
        return out.total, out.used

    # Xid events: a set, the devices registered on it, then waits with a timeout.
    def event_set(self) -> ctypes.c_void_p:
        out = ctypes.c_void_p()
        self._call("nvmlEventSetCreate", ctypes.pointer(out))
        return out

    def register_xid(self, handle, event_set) -> None:
        self._call("nvmlDeviceRegisterEvents", handle, ctypes.c_ulonglong(EVENT_XID_CRITICAL_ERROR), event_set)

    def wait_event(self, event_set, timeout_ms: int) -> EventData | None:
        """The next event, or None when none came within timeout_ms."""
        out = EventData()
        try:
            self._call("nvmlEventSetWait_v2", event_set, ctypes.pointer(out), ctypes.c_uint(timeout_ms))
        except NvmlError as exc:
            if exc.code == ERROR_TIMEOUT:
                return None
            raise
        return out

    def free_event_set(self, event_set) -> None:
        self._call("nvmlEventSetFree", event_set)
