"""Shared test helpers. Test modules declare their tier with `pytestmark`."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# A verbatim copy of the recipe's example configuration (../shared/seed/cluster.env.example).
SEED_ENV = REPO / "tests" / "unit" / "cluster.env.example"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
