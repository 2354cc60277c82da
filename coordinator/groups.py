"""The TP groups of cluster.env's GROUPS: each a whole copy of the model on its own nodes, behind
the gateway on the head. A group is run exactly as a one-group cluster is (coordinator/runtime.py
over `group_config`): its head is its rank 0, its nodes are numbered within it; only the cluster's
head (HEAD_HOST, in the first group) exports the weights and runs the gateway.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

# config.py imports this module to check GROUPS: the types below are its ClusterConfig and Node.

# Ports on the head that the gateway's two listeners must not take.
_HEAD_PORTS = ("PORT", "DIST_PORT", "AGENT_PORT")


@dataclass(frozen=True)
class Group:
    name: str                      # g1, g2, ...: DSV41_GROUP in the journal, the label in metrics
    nodes: tuple["Node", ...]      # numbered within the group: its head is rank 0

    @property
    def head(self) -> "Node":
        return self.nodes[0]


def groups_of(cfg: "ClusterConfig") -> tuple[Group, ...]:
    """The groups, in GROUPS's order; one group of every node when GROUPS is empty."""
    written = cfg.settings.get("GROUPS") or (tuple(n.name for n in cfg.nodes),)
    by_name = {n.name: n for n in cfg.nodes}
    return tuple(Group(f"g{i}", tuple(replace(by_name[name], rank=rank) for rank, name in enumerate(names)))
                 for i, names in enumerate(written, start=1))


def is_grouped(cfg: "ClusterConfig") -> bool:
    return len(groups_of(cfg)) > 1


def group_config(cfg: "ClusterConfig", group: Group) -> "ClusterConfig":
    """The configuration one group's supervisor runs: the cluster's, with the group's nodes, its head
    as HEAD_HOST/HEAD_IP and its size as NNODES."""
    own = {"NNODES": len(group.nodes), "HEAD_HOST": group.head.name, "HEAD_IP": group.head.address, "GROUPS": None}
    raw = {"NNODES": str(len(group.nodes)), "HEAD_HOST": group.head.name, "HEAD_IP": group.head.address,
           "GROUPS": ""}
    return replace(cfg, nodes=group.nodes, settings={**cfg.settings, **own}, raw={**cfg.raw, **raw})


def config_of(cfg: "ClusterConfig", node: str) -> "ClusterConfig":
    """The configuration the node runs: its group's view with several groups, else the cluster's."""
    found = groups_of(cfg)
    if len(found) == 1:
        return cfg
    group = next((g for g in found if any(n.name == node for n in g.nodes)), None)
    if group is None:
        raise KeyError(f"no node {node!r} in {cfg.path}; nodes: {', '.join(n.name for n in cfg.nodes)}")
    return group_config(cfg, group)


def worker_url(cfg: "ClusterConfig", group: Group) -> str:
    """The group's rank 0 as the gateway reaches it."""
    return f"http://{group.head.address}:{cfg.integer('PORT')}"


def check(s: Mapping[str, object], raw: Mapping[str, str], nodes: Sequence["Node"],
          err: Callable[..., None]) -> None:
    """GROUPS against the nodes, TP_SIZE and the head's ports; each problem is one error on GROUPS."""
    written: tuple[tuple[str, ...], ...] = s["GROUPS"]  # type: ignore[assignment]
    text = raw["GROUPS"]
    known = [n.name for n in nodes]
    seen: dict[str, int] = {}
    for index, names in enumerate(written, start=1):
        for name in names:
            if name not in known:
                err("GROUPS", f"group {index} names {name}, which is no node (nodes: {', '.join(known)})", text)
            elif name in seen:
                err("GROUPS", f"{name} is in group {seen[name]} and group {index}: a node serves in one group", text)
            else:
                seen[name] = index
    for name in known:
        if name not in seen:
            err("GROUPS", f"{name} is in no group: every node (HEAD_HOST, WORKERk_HOST) is in exactly one", text)
    if nodes and written and written[0][0] != nodes[0].name:
        err("GROUPS", f"the first group's head must be HEAD_HOST ({nodes[0].name}): the coordinator, the weights' "
            f"export and the gateway run there", text)
    sizes = sorted({len(names) for names in written})
    if len(sizes) > 1:
        err("GROUPS", "groups must be of one size (one TP_SIZE, one plan per rank): "
            + ", ".join(f"group {i} has {len(names)}" for i, names in enumerate(written, start=1)), text)
    elif "TP_SIZE" in s and s["TP_SIZE"] % sizes[0]:  # type: ignore[operator]
        err("TP_SIZE", f"must be a multiple of a group's size, {sizes[0]} nodes (GROUPS)", raw["TP_SIZE"])
    if len(written) > 1:
        _check_gateway_ports(s, raw, err)


def _check_gateway_ports(s: Mapping[str, object], raw: Mapping[str, str], err: Callable[..., None]) -> None:
    taken = {k: s[k] for k in _HEAD_PORTS if k in s}
    for key in ("METRICS_LISTEN", "GATEWAY_METRICS_LISTEN"):
        if s.get(key):
            taken[key] = s[key].port  # type: ignore[union-attr]
    gateway = s.get("GATEWAY_PORT")
    clash = [k for k, port in taken.items() if port == gateway]
    if gateway is not None and clash:
        err("GATEWAY_PORT", f"port {gateway} is already {' and '.join(clash)} on the head; choose another",
            raw["GATEWAY_PORT"])
    metrics = s.get("GATEWAY_METRICS_LISTEN")
    clash = [k for k, port in taken.items() if k != "GATEWAY_METRICS_LISTEN" and metrics and port == metrics.port]
    if clash:
        err("GATEWAY_METRICS_LISTEN", f"port {metrics.port} is already {' and '.join(clash)} on the head; "
            "choose another", raw["GATEWAY_METRICS_LISTEN"])
