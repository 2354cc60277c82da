"""pytest fixtures for tiers that boot systemd nodes. In a conftest.py:

    from tests.harness.fixtures import bridge, cluster, node, rootfs  # noqa: F401

``rootfs`` (session): the cached base tree from tools/rootfs.sh. Skips the test when not
running as root; as root, a failing build or a missing host tool is a test failure, because CI
runs these tiers as root and must not pass by skipping them.
``node(name, **options)``: a booted Node (options as for Node; the base tree is filled in).
``bridge(**options)``: a created Bridge. ``cluster(nodes, **options)``: a booted Cluster.
Everything a factory made is stopped/deleted after the test, also when the test fails; a
teardown that leaves something behind fails the test.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import pytest

from testbed.nspawn import Bridge, Cluster, HarnessError, Node, build_rootfs, host_problems


@pytest.fixture(scope="session")
def rootfs() -> Path:
    if os.geteuid() != 0:
        pytest.skip("cannot boot systemd-nspawn nodes: " + "; ".join(host_problems()))
    try:
        root = build_rootfs()  # also installs mmdebstrap and systemd-container when missing
    except HarnessError as e:
        pytest.fail(f"cannot build the node root file system: {e}", pytrace=False)
    problems = host_problems()
    if problems:
        pytest.fail("this host cannot boot systemd-nspawn nodes: " + "; ".join(problems),
                    pytrace=False)
    return root


class _Teardown:
    """Stops what a factory made, in reverse order, and reports every failure at once."""

    def __init__(self) -> None:
        self.items: list[Node | Cluster | Bridge] = []

    def close(self) -> None:
        errors = []
        for item in reversed(self.items):
            try:
                item.delete() if isinstance(item, Bridge) else item.stop()
            except HarnessError as e:
                errors.append(str(e))
        if errors:
            pytest.fail("teardown left state behind:\n" + "\n".join(errors), pytrace=False)


# node and cluster depend on bridge so that pytest stops their nodes before it deletes a
# bridge made with the bridge factory in the same test.
@pytest.fixture
def node(rootfs: Path, bridge: Callable[..., Bridge]) -> Iterator[Callable[..., Node]]:
    made = _Teardown()

    def factory(name: str, **options: object) -> Node:
        n = Node(name, rootfs, **options)  # type: ignore[arg-type]
        made.items.append(n)
        n.boot()
        return n

    yield factory
    made.close()


@pytest.fixture
def bridge(rootfs: Path) -> Iterator[Callable[..., Bridge]]:
    made = _Teardown()

    def factory(**options: object) -> Bridge:
        b = Bridge(**options)  # type: ignore[arg-type]
        made.items.append(b)
        return b.create()

    yield factory
    made.close()


@pytest.fixture
def cluster(rootfs: Path, bridge: Callable[..., Bridge]) -> Iterator[Callable[..., Cluster]]:
    made = _Teardown()

    def factory(nodes: dict[str, str] | list[str], **options: object) -> Cluster:
        c = Cluster(rootfs, nodes, **options)  # type: ignore[arg-type]
        made.items.append(c)
        c.boot()
        return c

    yield factory
    made.close()
