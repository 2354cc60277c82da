"""A fresh importable package for one test, with a `target.py` of given source; the import
finders and modules it brought are removed afterwards. Used by the adapter tests that patch it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def fake_package(tmp_path: Path, prefix: str, test_name: str, source: str) -> Iterator[str]:
    name = prefix + test_name.replace("[", "_").replace("]", "_").replace("-", "_")
    root = tmp_path / "src"
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    (root / name / "target.py").write_text(source)
    sys.path.insert(0, str(root))
    before = list(sys.meta_path)
    try:
        yield name
    finally:
        sys.meta_path[:] = before
        sys.path.remove(str(root))
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[mod]
