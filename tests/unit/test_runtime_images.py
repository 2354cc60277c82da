import pytest

from agent.images import ImageIds
from coordinator import config, plan
from coordinator.bringup.images import image_of, image_problems
from tests.configtext import HOME, SEED_TEXT, edited

pytestmark = pytest.mark.unit
IMAGE = "dsv41-3x-spark:local"


def specs(text=SEED_TEXT):
    cfg = config.parse(text, "cluster.env", HOME)
    return {p.node: p.rank_spec for p in plan.render_cluster(cfg)}


def test_the_image_a_container_rank_runs():
    s = specs()
    assert {image_of(spec) for spec in s.values()} == {IMAGE}
    assert image_of(specs(edited(RANK_RUNTIME="host"))["spark1"]) is None


def test_same_image_id_everywhere_passes():
    ids = {n: {IMAGE: "sha256:" + "a" * 64} for n in ("spark1", "spark2", "spark3")}
    assert image_problems(ids, specs()) == []


def test_a_missing_image_names_the_node_and_the_fix():
    ids = {"spark1": {IMAGE: "sha256:" + "a" * 64}, "spark2": {IMAGE: ""}, "spark3": {}}
    problems = image_problems(ids, specs())
    assert [node for node, _ in problems] == ["spark2", "spark3"]
    assert "docker pull" in problems[0][1]


def test_a_different_build_on_one_node_is_refused():
    ids = {"spark1": {IMAGE: "sha256:" + "a" * 64}, "spark2": {IMAGE: "sha256:" + "a" * 64},
           "spark3": {IMAGE: "sha256:" + "b" * 64}}
    (problem,) = image_problems(ids, specs())
    assert problem[0] == "spark3" and "same build" in problem[1] and "on spark1" in problem[1]


def test_host_runtime_has_no_image_to_compare():
    assert image_problems({}, specs(edited(RANK_RUNTIME="host"))) == []


def test_image_ids_without_docker_are_empty_and_cached(tmp_path):
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\necho sha256:abc\necho called >> " + str(tmp_path / "calls") + "\n")
    fake.chmod(0o755)
    clock = [0.0]
    ids = ImageIds([IMAGE], docker=str(fake), ttl_s=30, monotonic=lambda: clock[0])
    assert ids.get() == {IMAGE: "sha256:abc"}
    assert ids.get() == {IMAGE: "sha256:abc"}
    assert (tmp_path / "calls").read_text().count("called") == 1
    assert ImageIds([IMAGE], docker=str(tmp_path / "missing")).get() == {IMAGE: ""}
