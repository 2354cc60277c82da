"""The DSpark tables reach every rank identically or not at all: ranks that disagree on the verify
schedule hang the TP collective. The head's copies (in the coordinator's table directory) are
sent to the other nodes through their agents and checked by digest before the plans name them."""

from __future__ import annotations

import hashlib
import os

from .. import plan as plan_mod
from .step import StepContext


def _head_copies(table_dir: str, names: list[str]) -> dict[str, bytes | None]:
    sources: dict[str, bytes | None] = {}
    for name in names:
        try:
            with open(os.path.join(table_dir, name), "rb") as f:
                sources[name] = f.read()
        except FileNotFoundError:
            sources[name] = None
    return sources


def render_plans(ctx: StepContext, sync: bool) -> tuple[plan_mod.NodePlan, ...]:
    """The plans; with the DSpark table flags only when every node holds the head's copy. With
    `sync` the copies are made (and stale ones removed) first; without it nothing is changed."""
    probe = plan_mod.render_cluster(ctx.cfg, dspark_tables=True)
    tables = probe[0].dspark_tables  # rank path -> node path
    if not tables:
        return plan_mod.render_cluster(ctx.cfg)
    sources = _head_copies(ctx.table_dir, [os.path.basename(node_path) for node_path in tables.values()])
    if sync:
        for node in ctx.clients:
            if node == ctx.head:
                continue
            for name, content in sources.items():
                if content is None:
                    ctx.ask(node, lambda c, name=name: c.remove_file(name), mutates=True)  # a stale copy would make ranks disagree
                elif ctx.ask(node, lambda c, name=name: c.file_digest(name)).sha256 != hashlib.sha256(content).hexdigest():
                    ctx.ask(node, lambda c, name=name, content=content: c.put_file(name, content), mutates=True)
    missing = [name for name, content in sources.items() if content is None]
    if missing:
        ctx.log.info("dspark_tables_absent", f"DSpark tables not on the head ({', '.join(missing)} in "
                     f"{ctx.table_dir}): no rank gets the table flags")
        return plan_mod.render_cluster(ctx.cfg)
    want = {name: hashlib.sha256(content).hexdigest() for name, content in sources.items() if content is not None}
    for node in ctx.clients:
        for name, sha in want.items():
            got = ctx.ask(node, lambda c, name=name: c.file_digest(name))
            if got.sha256 != sha:
                raise ctx.fail(node, f"DSpark table {name} differs from the head's ({got.sha256[:12] or 'absent'} != "
                                     f"{sha[:12]}): ranks would disagree on the verify schedule")
    return plan_mod.render_cluster(ctx.cfg, dspark_tables=True)
