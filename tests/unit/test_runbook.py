"""docs/runbook.md has an entry for every incident kind the coordinator records: a new kind
without one fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coordinator.state import IncidentKind

pytestmark = pytest.mark.unit

RUNBOOK = Path(__file__).resolve().parents[2] / "docs" / "runbook.md"


def entries(text: str) -> dict[str, str]:
    """Each `### heading` with its text up to the next heading."""
    parts = re.split(r"^### (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1].lstrip("\n") for i in range(1, len(parts) - 1, 2)}


def test_every_incident_kind_has_a_runbook_entry() -> None:
    found = entries(RUNBOOK.read_text())
    missing = []
    for kind in IncidentKind:
        if kind.endswith("_failed"):
            # the bring-up's failures share one entry, each named in it
            if f"`{kind}`" not in found.get("STEP_failed", ""):
                missing.append(kind.value)
        elif kind.value not in found:
            missing.append(kind.value)
    assert missing == [], f"docs/runbook.md has no entry for {missing}"


def test_the_entry_finder_reads_headings_and_their_text() -> None:
    assert entries("# t\n### a\none\n### b\ntwo\n## other\n") == {"a": "one\n", "b": "two\n## other\n"}
