"""The proofs of concept of the security audit (issue 18), each a test that failed on the code it
found and passes since. Each module declares its tier with `pytestmark` (unit, integration against
a real systemd and journald, sglang on the real SGLang package), like every other test directory."""

from tests.harness.fixtures import bridge, cluster, node, rootfs  # noqa: F401
from tests.sglang.conftest import sglang  # noqa: F401
