"""Builds cluster.env texts for tests from the recipe's example file."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# A verbatim copy of the recipe's example configuration (../shared/seed/cluster.env.example).
SEED_ENV = REPO / "tests" / "cluster.env.example"

SEED_TEXT = SEED_ENV.read_text()
HOME = {"HOME": "/home/op"}


def edited(text: str = SEED_TEXT, **changes: str | None) -> str:
    """The text with KEY=... lines replaced (value) or removed (None); new keys are appended."""
    for key, value in changes.items():
        pattern = re.compile(rf"^{key}=.*$", re.M)
        line = "" if value is None else f"{key}={value}"
        if pattern.search(text):
            text = pattern.sub(line, text, count=1)
        elif value is not None:
            text += f"\n{line}\n"
    return text


def line_of(text: str, key: str) -> int:
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith(f"{key}="):
            return number
    raise KeyError(key)


def nodes_text(n: int) -> str:
    """The example widened or narrowed to n nodes (TP = n)."""
    text = edited(NNODES=str(n), TP_SIZE=str(n), WORKER1_IP=None, WORKER2_IP=None, WORKER1_HOST=None,
                  WORKER2_HOST=None, NFS_SERVER_IP_1=None, NFS_SERVER_IP_2=None)
    for k in range(1, n):
        text += f"\nWORKER{k}_IP=10.0.0.{k + 1}\nWORKER{k}_HOST=spark{k + 1}\nNFS_SERVER_IP_{k}=10.0.{21 + k}.1\n"
    return text
