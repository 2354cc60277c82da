#!/usr/bin/python3
"""A stand-in for a rank process in agent tests (no GPU here): behaviour chosen by flags.

--exit-after S --code N   exit with status N after S seconds
--ignore-term             ignore SIGTERM (the agent must kill it at the stop deadline)
--children N              start N child processes that also run until killed
--allocate-mb M           touch M MiB of memory and hold it
"""
import argparse
import os
import signal
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--exit-after", type=float, default=None)
parser.add_argument("--code", type=int, default=0)
parser.add_argument("--ignore-term", action="store_true")
parser.add_argument("--children", type=int, default=0)
parser.add_argument("--allocate-mb", type=int, default=0)
parser.add_argument("rest", nargs="*")
args = parser.parse_args()
if args.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
for _ in range(args.children):
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like SGLang's scheduler children
        while True:
            time.sleep(1)
hold = bytearray(args.allocate_mb << 20)
for i in range(0, len(hold), 4096):
    hold[i] = 1
print(f"stand-in rank up: pid {os.getpid()} env GID={os.environ.get('NCCL_IB_GID_INDEX', '-')}", flush=True)
started = time.monotonic()
while args.exit_after is None or time.monotonic() - started < args.exit_after:
    time.sleep(0.05)
sys.exit(args.code)
