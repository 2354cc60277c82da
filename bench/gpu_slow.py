#!/usr/bin/env python3
"""The gpu_slow decision on a real GPU's figures: the agent's NVML reader (agent.gpu.telemetry) and
the coordinator's decision (coordinator.gpuslow.decide_slow; the NodeStatus encoding between them is
the unit tests'), polled every second through an idle phase and a matrix-product
load, under two expected clocks: one the loaded GPU runs below (the slow state must be decided
after GPU_SLOW_S of load, once, and clear when the load ends) and one it runs above (never slow).

    python3 bench/gpu_slow.py [--out DIR] [--load-s 30] [--slow-s 10]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.gpu.telemetry import GpuTelemetry  # noqa: E402
from bench.nvml_vs_smi import LOAD  # noqa: E402 - the same matrix-product load
from coordinator.gpuslow import GpuFigures, GpuSlowRules, decide_slow  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--load-s", type=float, default=30.0)
    parser.add_argument("--slow-s", type=float, default=10.0)
    args = parser.parse_args()
    telemetry = GpuTelemetry()
    first = telemetry.read()
    if not first.gpus:
        print(f"no GPU figures: {first.detail}")
        return 1
    max_mhz = first.gpus[0].sm_clock_max_mhz or 1980
    # Below: a clock the loaded GPU cannot reach (its maximum + 1); above: a tenth of its maximum.
    rules = {"expected above the loaded clock": GpuSlowRules(args.slow_s, 0.5, float(max_mhz + 1)),
             "expected below the loaded clock": GpuSlowRules(args.slow_s, 0.5, float(max_mhz) / 10)}
    tracks: dict = {name: {} for name in rules}
    slow_now: dict = {name: () for name in rules}
    lines = [f"GPU0 {first.gpus[0].name}, SM clock max {max_mhz} MHz; GPU_SLOW_S={args.slow_s:g}, GPU_BUSY_RATIO=0.5"]
    load = None
    start = time.monotonic()
    phases = ((5.0, "idle"), (args.load_s, "loaded"), (8.0, "after"))
    for seconds, phase in phases:
        if phase == "loaded":
            load = subprocess.Popen([sys.executable, "-c", LOAD, str(seconds)])
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            gpu = telemetry.read().gpus[0]
            figures = GpuFigures("h100", gpu.index, gpu.uuid, gpu.name, gpu.sm_clock_mhz,
                                 None if gpu.utilization_gpu_pct is None else gpu.utilization_gpu_pct / 100,
                                 gpu.temperature_c, gpu.power_w, tuple(gpu.throttle_reasons))
            for name, r in rules.items():
                decision = decide_slow(tracks[name], [figures], r, time.monotonic())
                tracks[name], slow_now[name] = decision.tracks, decision.slow
                for slow in decision.newly_slow:
                    lines.append(f"t={time.monotonic() - start:5.1f} s [{phase}] {name}: gpu_slow: {slow.message}")
            was = {name: bool(s) for name, s in slow_now.items()}
            lines.append(f"t={time.monotonic() - start:5.1f} s [{phase}] SM {gpu.sm_clock_mhz} MHz, "
                         f"{gpu.utilization_gpu_pct} % busy, {gpu.power_w} W, reasons {','.join(gpu.throttle_reasons) or '-'}; "
                         + "; ".join(f"{n}: {'SLOW' if s else 'ok'}" for n, s in was.items()))
            time.sleep(1.0)
        if load is not None and phase == "loaded":
            load.wait()
    telemetry.close()
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_slow.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
