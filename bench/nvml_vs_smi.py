#!/usr/bin/env python3
"""The agent's NVML reader against nvidia-smi, read in the same run: idle, then under a matrix-product
load (PyTorch, when the Python running this has it).

Each phase reads NVML (the agent's agent.gpu.telemetry), then `nvidia-smi --query-gpu` and
`nvidia-smi -q -d CLOCK,POWER,TEMPERATURE,PERFORMANCE,UTILIZATION`, then NVML again: the table
compares the first NVML read with the query, and the second read says how far power and
utilisation moved in between. Standard library only (the reader too), so a bare python3 runs it.

    python3 bench/nvml_vs_smi.py [--out DIR] [--load-s 20]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.gpu.telemetry import GpuTelemetry, reading_dict  # noqa: E402

QUERY = ("index,name,uuid,clocks.sm,clocks.max.sm,clocks.applications.graphics,clocks.gr,clocks.mem,"
         "clocks.max.mem,power.draw,power.limit,enforced.power.limit,temperature.gpu,utilization.gpu,"
         "utilization.memory,memory.total,memory.used")
REASONS_QUERY = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # new name, then the old
SMI_Q = ["nvidia-smi", "-q", "-d", "CLOCK,POWER,TEMPERATURE,PERFORMANCE,UTILIZATION"]
# nvidia-smi -q's names of the reasons -> the agent's
SMI_REASONS = {"Idle": "gpu_idle", "Applications Clocks Setting": "applications_clocks_setting",
               "SW Power Cap": "sw_power_cap", "HW Slowdown": "hw_slowdown", "Sync Boost": "sync_boost",
               "SW Thermal Slowdown": "sw_thermal_slowdown", "HW Thermal Slowdown": "hw_thermal_slowdown",
               "HW Power Brake Slowdown": "hw_power_brake_slowdown", "Display Clock Setting": "display_clock_setting"}
# figure: (NVML reading's field, nvidia-smi query field, what the difference is read as)
ROWS = (
    ("SM clock MHz", "sm_clock_mhz", "clocks.sm"),
    ("SM clock max MHz", "sm_clock_max_mhz", "clocks.max.sm"),
    ("SM applications clock MHz", "sm_clock_applications_mhz", "clocks.applications.graphics"),
    ("graphics clock MHz", "graphics_clock_mhz", "clocks.gr"),
    ("memory clock MHz", "memory_clock_mhz", "clocks.mem"),
    ("memory clock max MHz", "memory_clock_max_mhz", "clocks.max.mem"),
    ("power W", "power_w", "power.draw"),
    ("power limit W", "power_limit_w", "enforced.power.limit"),
    ("temperature C", "temperature_c", "temperature.gpu"),
    ("GPU utilisation %", "utilization_gpu_pct", "utilization.gpu"),
    ("memory utilisation %", "utilization_memory_pct", "utilization.memory"),
    ("memory total MiB", "memory_total_bytes", "memory.total"),
    ("memory used MiB", "memory_used_bytes", "memory.used"),
)
LOAD = r"""
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
"""


class PrintLog:
    def info(self, kind, message, **fields):
        print(f"log {kind}: {message}", file=sys.stderr)

    warning = info


def smi_query() -> list[dict]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    rows = [dict(zip(QUERY.split(","), (v.strip() for v in line.split(",")))) for line in out.strip().splitlines()]
    for field in REASONS_QUERY:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                              capture_output=True, text=True)
        if done.returncode == 0:
            for row, value in zip(rows, done.stdout.strip().splitlines()):
                row["reasons_mask"] = value.strip()
            break
    return rows


def smi_q_reasons(text: str) -> list[list[str]]:
    """Per GPU, the reasons `nvidia-smi -q` lists as Active (its Clocks Event Reasons section; the
    counters section below it gives times, never "Active")."""
    gpus: list[list[str]] = []
    for line in text.splitlines():
        if re.match(r"GPU [0-9A-Fa-f]+:", line):
            gpus.append([])
            continue
        name, _, value = (part.strip() for part in line.partition(":"))
        if name in SMI_REASONS and value == "Active" and gpus:
            gpus[-1].append(SMI_REASONS[name])
    return gpus


def as_number(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None  # "[N/A]", "[Not Supported]"


def nvml_value(reading: dict, field: str) -> float | None:
    value = reading.get(field)
    if value is None:
        return None
    return value / 2**20 if field.startswith("memory_") and field.endswith("_bytes") else float(value)


def table(first: dict, second: dict, smi: dict, q_reasons: list[str]) -> list[str]:
    lines = [f"{'figure':<27}{'NVML (agent)':>14}{'nvidia-smi':>14}{'diff':>10}{'NVML again':>12}  note"]
    for label, field, smi_field in ROWS:
        a, b, s = nvml_value(first, field), nvml_value(second, field), as_number(smi.get(smi_field))
        show = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
        diff = "-" if a is None or s is None else f"{a - s:+.1f}"
        note = ""
        if a is None:
            figure = {"utilization_gpu_pct": "utilization", "utilization_memory_pct": "utilization",
                      "memory_total_bytes": "memory", "memory_used_bytes": "memory"}.get(field, field)
            note = "NVML: not supported" if figure in first.get("unsupported", []) else "NVML: no value"
        lines.append(f"{label:<27}{show(a):>14}{smi.get(smi_field, '-'):>14}{diff:>10}{show(b):>12}  {note}")
    mask_smi = smi.get("reasons_mask", "-")
    mask = first.get("throttle_mask")
    lines.append(f"{'reasons mask':<27}{'-' if mask is None else hex(mask):>14}  nvidia-smi {mask_smi}")
    lines.append(f"reasons NVML (agent): {', '.join(first.get('throttle_reasons', [])) or '(none)'}")
    lines.append(f"reasons nvidia-smi -q: {', '.join(q_reasons) or '(none)'}")
    return lines


def phase(name: str, telemetry_read, out: Path | None) -> list[str]:
    first = [reading_dict(g) for g in telemetry_read().gpus]
    smi = smi_query()
    q_text = subprocess.run(SMI_Q, capture_output=True, text=True).stdout
    time.sleep(1.1)  # past the reader's cache, so the second read is a new one
    second = [reading_dict(g) for g in telemetry_read().gpus]
    if out is not None:
        (out / f"smi-q-{name}.txt").write_text(q_text)
        (out / f"nvml-{name}.json").write_text(json.dumps({"first": first, "second": second, "smi": smi}, indent=1))
    q_reasons = smi_q_reasons(q_text)
    lines = [f"== {name}"]
    for i, reading in enumerate(first):
        lines.append(f"GPU{reading['index']} {reading['name']} {reading['uuid']}; unsupported: "
                     f"{', '.join(reading['unsupported']) or 'none'}; errors: {', '.join(reading['errors']) or 'none'}; "
                     f"Xid events seen: {reading['xid_count']}")
        lines += table(reading, second[i], smi[i] if i < len(smi) else {}, q_reasons[i] if i < len(q_reasons) else [])
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for the raw readings and nvidia-smi -q texts")
    parser.add_argument("--load-s", type=float, default=20.0, help="length of the loaded phase (0: none)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else None
    telemetry = GpuTelemetry(log=PrintLog())
    report = telemetry.read()
    if not report.available:
        print(report.detail)
        return 1
    print(f"# NVML driver {report.driver_version}, {len(report.gpus)} GPU(s); {time.strftime('%Y-%m-%d %H:%M:%S')}")
    lines = phase("idle", telemetry.read, out)
    if args.load_s > 0:
        load = subprocess.Popen([sys.executable, "-c", LOAD, str(args.load_s)])
        time.sleep(min(8.0, args.load_s / 2))  # clocks up and the utilisation window full
        if load.poll() is None:
            lines += phase("loaded", telemetry.read, out)
        else:
            lines.append(f"== loaded: the load did not run (exit {load.returncode}; no PyTorch on this Python?)")
        load.wait()
    telemetry.close()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
