"""GPU telemetry from NVIDIA's management library (NVML), read through a thin ctypes binding.

Standard library only (no protobuf, no grpc): bench/nvml_vs_smi.py runs the same reader with a
bare python3 on a GPU machine and compares it with nvidia-smi.
"""
