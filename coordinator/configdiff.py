"""What applying a new cluster.env changes: each key that differs from the running configuration,
and what it takes for it to take effect.

Whether a key restarts the ranks is not a list kept by hand: it is read off the plans. A key whose
new value alone changes a node's plan fingerprint needs the group restarted; one that changes a plan
outside the fingerprint (the node's memory floor) applies when the ranks next start; anything else
is the coordinator's own and applies at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from . import plan as plan_mod
from .config import ClusterConfig


NODE_KEYS = frozenset({"HEAD_HOST", "HEAD_IP"})


class Effect(enum.StrEnum):
    LIVE = "applies at once"
    RANKS = "restarts the ranks"
    NEXT_START = "applies when the ranks next start"


@dataclass(frozen=True)
class KeyChange:
    key: str
    before: str | None  # None: not set (for keys outside the schema, which have no default)
    after: str | None
    effect: Effect


@dataclass(frozen=True)
class ConfigDiff:
    changes: tuple[KeyChange, ...]
    restarts_ranks: bool  # the plans' fingerprints differ, whichever keys did it

    @property
    def rank_keys(self) -> tuple[str, ...]:
        return tuple(c.key for c in self.changes if c.effect is Effect.RANKS)

    @property
    def restart_keys(self) -> tuple[str, ...]:
        """What a restart for this change is logged as: its rank-side keys (empty: it needs none)."""
        if not self.restarts_ranks:
            return ()
        return self.rank_keys or ("configuration",)

    def describe(self) -> list[str]:
        return [f"{c.key}: {_shown(c.before)} -> {_shown(c.after)} ({c.effect})" for c in self.changes]


def _shown(value: str | None) -> str:
    return "(not set)" if value is None else repr(value)


def _plans(cfg: ClusterConfig) -> tuple[tuple[plan_mod.NodePlan, ...], ...]:
    # Both ways a plan is rendered: the DSpark table flags go in only once the tables are verified.
    return (plan_mod.render_cluster(cfg), plan_mod.render_cluster(cfg, dspark_tables=True))


def _fingerprints(plans) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(p.fingerprint for p in group) for group in plans)


def _values(cfg: ClusterConfig) -> dict[str, str]:
    """Every key as the file gives it or its default: the schema's, the workers', the passed-through ones."""
    out = dict(cfg.raw)
    for node in cfg.nodes:
        if not node.is_head:
            out[f"WORKER{node.rank}_HOST"] = node.name
            out[f"WORKER{node.rank}_IP"] = node.address
            if node.nfs_server:
                out[f"NFS_SERVER_IP_{node.rank}"] = node.nfs_server
    out.update(cfg.passthrough)
    return out


def _with_key(old: ClusterConfig, new: ClusterConfig, key: str) -> ClusterConfig:
    """The running configuration with one key as the new file has it."""
    if key.startswith(("WORKER", "NFS_SERVER_IP_")):
        return replace(old, nodes=new.nodes)
    if key in new.settings or key in old.settings:
        settings, raw = dict(old.settings), dict(old.raw)
        settings[key], raw[key] = new.settings[key], new.raw[key]
        nodes = new.nodes if key in NODE_KEYS else old.nodes  # the nodes are derived from these keys too
        return replace(old, settings=settings, raw=raw, nodes=nodes)
    passthrough = {k: v for k, v in old.passthrough.items() if k != key}
    if key in new.passthrough:
        passthrough[key] = new.passthrough[key]
    return replace(old, passthrough=passthrough)


def _effect(old: ClusterConfig, new: ClusterConfig, key: str, before) -> Effect:
    try:
        variant = _plans(_with_key(old, new, key))
    except (KeyError, ValueError, TypeError):
        return Effect.RANKS  # not renderable alone (it goes with another change): the safe answer
    if _fingerprints(variant) != _fingerprints(before):
        return Effect.RANKS
    return Effect.LIVE if variant == before else Effect.NEXT_START


def diff(old: ClusterConfig, new: ClusterConfig) -> ConfigDiff:
    """The keys that differ between the running configuration and a new one, in the new file's key order."""
    was, now = _values(old), _values(new)
    keys = [k for k in now if was.get(k) != now[k]] + [k for k in was if k not in now]
    before = _plans(old)
    changes = tuple(KeyChange(k, was.get(k), now.get(k), _effect(old, new, k, before)) for k in keys)
    restarts = _fingerprints(before) != _fingerprints(_plans(new))
    if restarts and not any(c.effect is Effect.RANKS for c in changes):
        # Keys that restart the ranks only together: name them all as doing it.
        changes = tuple(replace(c, effect=Effect.RANKS) if c.effect is not Effect.LIVE else c for c in changes)
    return ConfigDiff(changes, restarts)
