"""Where SGLang keeps each rank's FlashInfer autotune cache, and forcing a retune by removing it.

Each rank's tactic cache is `$SGLANG_CACHE_DIR/flashinfer/autotune/<flashinfer version>/<sm
arch>/<model key>/rank_*.json` (SGLANG_CACHE_DIR defaults to ~/.cache/sglang); the rank's
autotune_keep adapter writes `rank_*.launch` beside it. `dsv41ctl autotune reset` has every agent
call `clear_autotune_caches(root)` while the rank is stopped: it removes both kinds of file and
returns their paths.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CACHE_GLOB = ("flashinfer", "autotune", "*", "*", "*")


def default_cache_root(env: Mapping[str, str] | None = None, home: str | None = None) -> Path:
    """SGLang's cache root: $SGLANG_CACHE_DIR, else ~/.cache/sglang."""
    e = os.environ if env is None else env
    raw = e.get("SGLANG_CACHE_DIR", "").strip()
    if raw:
        return Path(os.path.expanduser(raw))
    return Path(home if home is not None else os.path.expanduser("~")) / ".cache" / "sglang"


def clear_autotune_caches(root: Path) -> list[Path]:
    """Remove every rank's FlashInfer tactic cache and launch record under `root`; their paths."""
    removed: list[Path] = []
    base = Path(root).joinpath(*CACHE_GLOB[:2])
    pattern = "/".join(CACHE_GLOB[2:])
    for directory in sorted(base.glob(pattern)):
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("rank_*")):
            if path.suffix in (".json", ".launch") and path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed
