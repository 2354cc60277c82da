"""dsv41ctl bundle: one tar of what someone debugging a failed bring-up or a hang needs, from every
node (through the agents' CollectDiagnostics) and from the coordinator (status, events, plans,
fingerprints, cluster.env).

Never a secret: the agents send no key file and redact what they hold; every file is redacted here
again with the API key and PEM private key blocks removed, before it enters the tar.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable

from google.protobuf import json_format

from dsv41.redact import Redactor

from . import plan as plan_mod
from .agents import AgentUnavailable

CONTENTS = """dsv41 diagnostics bundle, made {when} by {made_by}.

cluster/status.json        dsv41ctl status --json (the collective gate's last figures under "collective")
cluster/events.txt, .json  the incidents the coordinator recorded, earlier coordinators' included (its history)
cluster/plans/NODE.json    the plan rendered from cluster.env for each node (dsv41ctl config show)
cluster/fingerprints.json  plan fingerprints: rendered, launched by the coordinator, running on each node
cluster/cluster.env        the configuration file
nodes/NODE/                from each node's agent:
  journal/UNIT.log         the dsv41 units' journals since the last boot (newest lines, at most {journal} per unit)
  rank-last-lines.log      the rank's last lines
  kernel.log               kernel messages about NVRM, Xid, out of memory / OOM kills and mlx5
  proc/                    meminfo, buddyinfo, pressure/cpu, pressure/memory, pressure/io
  agent-status.json        the agent's status
  UNREACHABLE.txt          instead, when the node's agent could not be asked

Secrets (the API key, private keys) are removed from every file.
{notes}"""


@dataclass(frozen=True)
class Sources:
    """What the coordinator knows, as plain values (the running coordinator's, or read from the agents
    by dsv41ctl when the coordinator is not running)."""
    status: object                 # control_pb2.ClusterStatus
    incidents: list                # runtime.Incident (at_unix_s, node, kind, message)
    launched: dict                 # node -> fingerprint the coordinator launched ({} when unknown)
    config_text: bytes
    made_by: str


class BundleWriter:
    def __init__(self, cfg, clients: dict, secrets: Iterable[bytes | str] = (), clock: Callable[[], float] = time.time,
                 agent_timeout_s: float = 300.0):
        self._cfg = cfg
        self._clients = clients
        self._redact = Redactor(secrets)
        self._clock = clock
        self._timeout = agent_timeout_s

    def write(self, out: BinaryIO, sources: Sources, journal_bytes: int = 0) -> list[str]:
        """Writes the tar to `out`; returns notes on what could not be collected."""
        now = self._clock()
        top = "dsv41-bundle-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        notes: list[str] = []
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            def add(path: str, data: bytes) -> None:
                data = self._redact(data)
                info = tarfile.TarInfo(f"{top}/{path}")
                info.size, info.mtime, info.mode, info.uname, info.gname = len(data), int(now), 0o640, "root", "root"
                tar.addfile(info, io.BytesIO(data))

            for path, data in self._cluster_files(sources):
                add(path, data)
            for node in self._cfg.nodes:
                note = self._node_files(node.name, journal_bytes, add)
                if note:
                    notes.append(note)
            readme = CONTENTS.format(when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now)),
                                     made_by=sources.made_by, journal=_size(journal_bytes or 8 << 20),
                                     notes="".join(f"\nnot collected: {n}" for n in notes))
            add("README.txt", readme.encode())
        return notes

    def _cluster_files(self, s: Sources):
        body = json_format.MessageToDict(s.status, preserving_proto_field_name=True,
                                         including_default_value_fields=True)
        yield "cluster/status.json", _json(body)
        events = [{"at_unix_s": i.at_unix_s, "node": i.node, "kind": i.kind, "message": i.message}
                  for i in s.incidents]
        yield "cluster/events.json", _json(events)
        yield "cluster/events.txt", "".join(
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(e['at_unix_s']))} UTC {e['node']} {e['kind']}: "
            f"{e['message']}\n" for e in events).encode()
        plans = plan_mod.render_cluster(self._cfg)
        for p in plans:
            yield f"cluster/plans/{p.node}.json", _json(p.to_json())
        running = {v.name: v.status.rank.fingerprint for v in s.status.nodes if v.agent_reachable}
        yield "cluster/fingerprints.json", _json({
            "generation": s.status.generation,
            "rendered": {p.node: p.fingerprint for p in plans},
            "rendered_note": "without DSpark table flags; with them the fingerprints differ (the coordinator "
                             "passes the flags only when every node holds the same tables)",
            "launched": dict(s.launched), "running": running})
        yield "cluster/cluster.env", s.config_text

    def _node_files(self, node: str, journal_bytes: int, add: Callable[[str, bytes], None]) -> str | None:
        prefix = f"nodes/{node}"
        pieces: list[bytes] = []
        count = 0
        try:
            for chunk in self._clients[node].collect_diagnostics(journal_bytes, self._timeout):
                pieces.append(chunk.data)
                if chunk.last:
                    add(f"{prefix}/{_relative(chunk.path)}", b"".join(pieces))
                    pieces, count = [], count + 1
        except AgentUnavailable as exc:
            reason = f"{node}: {exc.code}: {exc.details}"
            add(f"{prefix}/UNREACHABLE.txt", f"the agent could not be asked after {count} file(s): {reason}\n".encode())
            return reason
        return None


def _relative(path: str) -> str:
    """An agent's path, kept inside its node's directory."""
    parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".", "..")]
    return "/".join(parts) or "unnamed"


def _json(body) -> bytes:
    return (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()


def _size(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"
