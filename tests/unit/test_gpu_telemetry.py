"""The agent's GPU telemetry over a stand-in NVML library (tests/nvmlstandin.py): every figure, each
one answered NOT_SUPPORTED alone, a host without the library, the throttle mask's names, Xid events,
and what GetStatus carries. The real library is compared with nvidia-smi by bench/nvml_vs_smi.py."""

from __future__ import annotations

import time

import pytest

from agent.gpu import nvml
from agent.gpu.nvml import Nvml
from agent.gpu.telemetry import GpuTelemetry, XidWatcher, read_gpu
from agent.service import gpu_state_pb
from dsv41.gpu import REASON_NAMES, decode_throttle_reasons
from tests.fakeclock import FakeClock
from tests.nvmlstandin import GB10, H100, StandInNvml

pytestmark = pytest.mark.unit


class Log:
    def __init__(self):
        self.events: list[tuple[str, str, dict]] = []

    def info(self, kind, message, **fields):
        self.events.append((kind, message, fields))

    warning = info


def opened(lib: StandInNvml) -> Nvml:
    session = Nvml(lambda: lib)
    session.open()
    return session


def test_every_figure_of_an_idle_h100_in_the_units_it_is_reported_in():
    gpu = read_gpu(opened(StandInNvml([H100])), 0)
    assert (gpu.name, gpu.uuid) == ("NVIDIA H100 80GB HBM3", H100["uuid"])
    assert (gpu.sm_clock_mhz, gpu.sm_clock_max_mhz, gpu.sm_clock_applications_mhz) == (345, 1980, 1980)
    assert (gpu.graphics_clock_mhz, gpu.memory_clock_mhz, gpu.memory_clock_max_mhz) == (345, 2619, 2619)
    assert gpu.power_w == pytest.approx(71.234) and gpu.power_limit_w == 700.0  # NVML gives milliwatts
    assert (gpu.temperature_c, gpu.utilization_gpu_pct, gpu.utilization_memory_pct) == (31, 0, 0)
    assert gpu.throttle_mask == 1 and gpu.throttle_reasons == ("gpu_idle",)
    assert (gpu.memory_total_bytes, gpu.memory_used_bytes) == (85_520_809_984, 0)  # as nvidia-smi: reserved apart
    assert gpu.unsupported == () and gpu.errors == ()


def test_a_gb10_leaves_out_what_it_does_not_support_and_says_which():
    gpu = read_gpu(opened(StandInNvml([GB10])), 0)
    assert (gpu.name, gpu.sm_clock_mhz, gpu.temperature_c, gpu.utilization_gpu_pct) == ("NVIDIA GB10", 2418, 71, 97)
    assert gpu.power_w == pytest.approx(38.2) and gpu.throttle_reasons == ()
    assert gpu.memory_total_bytes is None and gpu.memory_clock_mhz is None and gpu.power_limit_w is None
    assert set(gpu.unsupported) == {"sm_clock_applications_mhz", "memory_clock_mhz", "memory_clock_max_mhz",
                                    "power_limit_w", "memory"}
    assert gpu.errors == ()


# C function -> the reading's figures it gives (and what each is without it)
FIGURES_BY_FUNCTION = {
    "nvmlDeviceGetName": {"name": ""},
    "nvmlDeviceGetUUID": {"uuid": ""},
    "nvmlDeviceGetClockInfo": {"sm_clock_mhz": None, "graphics_clock_mhz": None, "memory_clock_mhz": None},
    "nvmlDeviceGetMaxClockInfo": {"sm_clock_max_mhz": None, "memory_clock_max_mhz": None},
    "nvmlDeviceGetApplicationsClock": {"sm_clock_applications_mhz": None},
    "nvmlDeviceGetPowerUsage": {"power_w": None},
    "nvmlDeviceGetEnforcedPowerLimit": {"power_limit_w": None},
    "nvmlDeviceGetTemperature": {"temperature_c": None},
    "nvmlDeviceGetUtilizationRates": {"utilization_gpu_pct": None, "utilization_memory_pct": None},
    "nvmlDeviceGetCurrentClocksEventReasons": {"throttle_mask": None, "throttle_reasons": ()},
    "nvmlDeviceGetMemoryInfo_v2": {"memory_total_bytes": None, "memory_used_bytes": None},
}


@pytest.mark.parametrize("function", sorted(FIGURES_BY_FUNCTION))
def test_each_call_answering_not_supported_leaves_only_its_figures_out(function):
    whole = read_gpu(opened(StandInNvml([H100])), 0)
    gpu = read_gpu(opened(StandInNvml([H100], errors={(0, function): nvml.ERROR_NOT_SUPPORTED})), 0)
    left_out = FIGURES_BY_FUNCTION[function]
    assert {figure: getattr(gpu, figure) for figure in left_out} == left_out
    others = {figure for figures in FIGURES_BY_FUNCTION.values() for figure in figures} - set(left_out)
    assert {f: getattr(gpu, f) for f in others} == {f: getattr(whole, f) for f in others}
    assert gpu.errors == () and gpu.unsupported and whole.unsupported == ()


def test_another_error_is_kept_with_nvml_s_text_and_the_other_figures_still_come():
    lib = StandInNvml([H100], errors={(0, "nvmlDeviceGetTemperature"): nvml.ERROR_GPU_IS_LOST})
    gpu = read_gpu(opened(lib), 0)
    assert gpu.temperature_c is None and gpu.unsupported == ()
    assert gpu.errors == ("temperature_c: nvmlDeviceGetTemperature: GPU is lost (15)",)
    assert gpu.sm_clock_mhz == 345


def test_a_gpu_without_a_handle_reports_that_alone():
    lib = StandInNvml([H100, GB10], errors={(1, "nvmlDeviceGetHandleByIndex_v2"): nvml.ERROR_GPU_IS_LOST})
    gpu = read_gpu(opened(lib), 1)
    assert gpu.index == 1 and gpu.name == "" and gpu.errors[0].startswith("handle: ")


def test_an_older_driver_gives_the_reasons_and_memory_through_the_old_calls():
    lib = StandInNvml([dict(H100, reasons=0x44)], old_driver=True)
    gpu = read_gpu(opened(lib), 0)
    assert gpu.throttle_reasons == ("sw_power_cap", "hw_thermal_slowdown")
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" in lib.calls
    assert gpu.memory_used_bytes == 480 << 20  # v1 counts the driver's reserved memory as used


def test_memory_v2_answering_a_version_mismatch_falls_back_to_v1():
    lib = StandInNvml([H100], errors={(0, "nvmlDeviceGetMemoryInfo_v2"): nvml.ERROR_ARGUMENT_VERSION_MISMATCH})
    gpu = read_gpu(opened(lib), 0)
    assert gpu.memory_used_bytes == 480 << 20 and gpu.errors == ()
    assert nvml.MEMORY_V2_VERSION == 40 | (2 << 24)  # sizeof(nvmlMemory_v2_t) | 2 << 24, as nvml.h builds it


@pytest.mark.parametrize("mask, names", [
    (0, ()),
    (0x1, ("gpu_idle",)),
    (0x1FF, REASON_NAMES),
    (0x8 | 0x40 | 0x80, ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")),
    (0x4 | 0x1000 | (1 << 40), ("sw_power_cap", "unknown_0x1000", f"unknown_{1 << 40:#x}")),
])
def test_the_mask_decodes_to_named_reasons_in_bit_order(mask, names):
    assert decode_throttle_reasons(mask) == names


def test_every_reason_has_its_bit():
    assert [decode_throttle_reasons(1 << bit) for bit in range(9)] == [(name,) for name in REASON_NAMES]
    assert REASON_NAMES == ("gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
                            "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown",
                            "display_clock_setting")


def _no_library():
    raise OSError("libnvidia-ml.so.1: cannot open shared object file: No such file or directory")


def test_no_library_is_no_nvml_logged_once_and_looked_for_again_later():
    clock, log = FakeClock(), Log()
    factories = []

    def factory():
        factories.append(1)
        return Nvml(_no_library)
    telemetry = GpuTelemetry(factory, log, clock.monotonic, max_age_s=1.0, retry_s=300.0)
    report = telemetry.read()
    assert not report.available and report.gpus == ()
    assert report.detail.startswith("no NVML: libnvidia-ml.so.1 cannot be loaded")
    clock.advance(10)
    assert telemetry.read().detail == report.detail and len(factories) == 1  # not tried again yet
    clock.advance(300)
    telemetry.read()
    assert len(factories) == 2
    assert [kind for kind, _, _ in log.events] == ["gpu_telemetry_unavailable"]


def test_a_library_whose_init_fails_is_no_nvml_with_nvml_s_reason():
    report = GpuTelemetry(lambda: Nvml(lambda: StandInNvml([], init_code=nvml.ERROR_DRIVER_NOT_LOADED)),
                          watch_xid=False).read()
    assert not report.available and report.detail.startswith("no NVML: nvmlInit_v2:") and "(9)" in report.detail


def test_the_report_is_read_at_most_every_max_age_and_close_shuts_nvml_down():
    clock, log = FakeClock(), Log()
    lib = StandInNvml([H100, GB10])
    telemetry = GpuTelemetry(lambda: Nvml(lambda: lib), log, clock.monotonic, watch_xid=False)
    first = telemetry.read()
    assert first.available and first.driver_version == "580.159.04" and [g.index for g in first.gpus] == [0, 1]
    calls = len(lib.calls)
    clock.advance(0.5)
    assert telemetry.read() is first and len(lib.calls) == calls
    clock.advance(0.6)
    assert telemetry.read() is not first and len(lib.calls) > calls
    assert log.events[0][0] == "gpu_telemetry" and log.events[0][2] == {"gpus": 2, "driver": "580.159.04"}
    telemetry.close()
    assert lib.shut


def test_xid_events_are_counted_per_gpu():
    lib = StandInNvml([H100, GB10], errors={(0, "nvmlDeviceRegisterEvents"): nvml.ERROR_NOT_SUPPORTED})
    session = opened(lib)
    log = Log()
    watcher = XidWatcher(session, {0: session.handle(0), 1: session.handle(1)}, log, wall=lambda: 1234.0, wait_ms=1)
    assert watcher.watched == (1,)  # GPU0 cannot report them: the other is still watched
    assert watcher.poll_once() is False  # none within the wait
    lib.deliver_xid(1, 79)
    lib.deliver_xid(1, 48)
    assert watcher.poll_once() and watcher.poll_once()
    seen = watcher.seen()[1]
    assert (seen.count, seen.last, seen.last_unix_s) == (2, 48, 1234.0)
    assert [(k, f) for k, _, f in log.events] == [("gpu_xid", {"gpu": 1, "xid": 79}), ("gpu_xid", {"gpu": 1, "xid": 48})]
    watcher.stop()


def test_the_report_carries_the_xid_count_the_watcher_thread_saw():
    clock = FakeClock()
    lib = StandInNvml([GB10])
    telemetry = GpuTelemetry(lambda: Nvml(lambda: lib), Log(), clock.monotonic)
    assert telemetry.read().gpus[0].xid_count == 0
    lib.deliver_xid(0, 79)
    deadline = time.monotonic() + 5.0
    while lib.events and time.monotonic() < deadline:  # the watcher's thread takes it
        time.sleep(0.01)
    for _ in range(100):
        clock.advance(2.0)
        if telemetry.read().gpus[0].xid_count:
            break
        time.sleep(0.01)
    gpu = telemetry.read().gpus[0]
    assert (gpu.xid_count, gpu.last_xid) == (1, 79)
    telemetry.close()


def test_get_status_s_gpu_state_leaves_an_unsupported_figure_unset_not_zero():
    state = gpu_state_pb(read_gpu(opened(StandInNvml([GB10])), 0))
    assert state.name == "NVIDIA GB10" and state.sm_clock_mhz == 2418 and state.HasField("utilization_memory_pct")
    assert not state.HasField("memory_total_bytes") and not state.HasField("power_limit_w")
    assert state.HasField("throttle_mask") and state.throttle_mask == 0 and list(state.throttle_reasons) == []
    assert "memory" in state.unsupported and state.power_w == pytest.approx(38.2)
    idle = gpu_state_pb(read_gpu(opened(StandInNvml([H100])), 0))
    assert idle.utilization_gpu_pct == 0 and idle.HasField("utilization_gpu_pct")  # 0 % busy is a figure
