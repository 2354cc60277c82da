"""Which of the allowed container images this node holds, by local image ID.

Ranks of one TP group must run the same image: the coordinator compares these IDs across nodes
before a launch. The docker CLI is asked with a deadline; a node without docker reports "".
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import Callable, Sequence

DOCKER = "/usr/bin/docker"


class ImageIds:
    def __init__(self, images: Sequence[str], docker: str = DOCKER, ttl_s: float = 30.0,
                 monotonic: Callable[[], float] = time.monotonic):
        self._images = tuple(images)
        self._docker = docker
        self._ttl = ttl_s
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._cached: tuple[float, dict[str, str]] | None = None

    def get(self) -> dict[str, str]:
        with self._lock:
            if self._cached and self._monotonic() - self._cached[0] < self._ttl:
                return self._cached[1]
            ids = {image: self._inspect(image) for image in self._images}
            self._cached = (self._monotonic(), ids)
            return ids

    def _inspect(self, image: str) -> str:
        if not os.access(self._docker, os.X_OK):
            return ""
        try:
            proc = subprocess.run([self._docker, "image", "inspect", "--format", "{{.Id}}", image],
                                  capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return proc.stdout.strip() if proc.returncode == 0 else ""
