from tests.harness.fixtures import bridge, cluster, node, rootfs  # noqa: F401
