"""Fixtures for tests of the coordinator against three booted nodes running the agent with the
stand-in engine. In a test module:

    from tests.integration.simfixtures import coordinator, nodes  # noqa: F401

``nodes`` (module): the booted spark1..3, each with the agent from this source tree.
``coordinator(**cluster_env_keys)``: a started coordinator (a host process); after the test it is
stopped, and every node is left with its agent running and no rank.
"""

from __future__ import annotations

import pytest

from tests.integration.simcluster import Coordinator, boot, cluster_env


@pytest.fixture(scope="module")
def nodes(rootfs):
    cluster = boot(rootfs)
    try:
        yield cluster.nodes
    finally:
        cluster.stop()


@pytest.fixture
def coordinator(nodes, tmp_path):
    made = []

    def start(**extra) -> Coordinator:
        c = Coordinator(tmp_path, cluster_env(nodes, **extra)).start()
        made.append(c)
        return c
    yield start
    for c in made:
        if c.proc.poll() is None:
            c.terminate()
    for node in nodes.values():  # whatever a test did, leave every agent up and no rank for the next
        node.run(["systemctl", "start", "dsv41-agent.service"], check=False)
        node.run(["systemctl", "stop", "dsv41-rank.service"], check=False)
        node.run(["systemctl", "reset-failed"], check=False)
