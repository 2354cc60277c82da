"""Ranks of one TP group must run one image: the same local image ID on every node."""

from __future__ import annotations

from ..plan import RankSpec


def image_of(spec: RankSpec) -> str | None:
    """The image a container-runtime rank runs, else None."""
    return spec.image or None if spec.runtime == "container" else None


def image_problems(images_by_node: dict[str, dict[str, str]], specs: dict[str, RankSpec]) -> list[tuple[str, str]]:
    """(node, reason) for every node whose image is missing or differs from the head's."""
    wanted = {node: image_of(spec) for node, spec in specs.items()}
    ids = {node: images_by_node.get(node, {}).get(image, "") for node, image in wanted.items() if image}
    problems = [(node, f"image {wanted[node]} is not on this node (or not in its ALLOWED_IMAGES): "
                       f"docker pull it, or load the same build") for node, image_id in ids.items() if not image_id]
    if not problems and len(set(ids.values())) > 1:
        reference = next(iter(ids))
        problems = [(node, f"image {wanted[node]} is {image_id[:19]} here but {ids[reference][:19]} on "
                           f"{reference}: every rank must run the same build")
                    for node, image_id in ids.items() if image_id != ids[reference]]
    return problems
