"""The CollectDiagnostics RPC (dsv41ctl bundle): this node's files, streamed in chunks."""

from __future__ import annotations

import os
import stat
from typing import Callable

import grpc
from google.protobuf import json_format

from dsv41.v1 import agent_pb2 as pb

from dsv41.redact import Redactor

from .diagnostics import (DEFAULT_JOURNAL_BYTES, DEFAULT_RANK_LINES, MAX_JOURNAL_BYTES, MAX_RANK_LINES,
                          NodeDiagnostics, SystemdJournal)

CHUNK_BYTES = 1 << 20
SECRET_MAX_BYTES = 64 << 10


def held_secrets(state_dir: str, key_paths: tuple[str | None, ...]) -> list[bytes]:
    """What this agent holds that must never leave it: files in its state directory that nobody but
    root may read (the API key on the head), and its TLS key."""
    out = []
    directory = os.path.join(state_dir, "state")
    try:
        names = os.listdir(directory)
    except OSError:
        names = []
    paths = [os.path.join(directory, n) for n in names] + [p for p in key_paths if p]
    for path in paths:
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size > SECRET_MAX_BYTES:
                continue
            if path.startswith(directory) and st.st_mode & 0o077:
                continue  # readable by others: a DSpark table, not a secret
            with open(path, "rb") as f:
                data = f.read().strip()
        except OSError:
            continue
        out.append(data)
    return out


class DiagnosticsRpcs:
    """CollectDiagnostics: this node's files (its status among them), redacted, in chunks."""

    def __init__(self, settings, events, status: Callable[[pb.GetStatusRequest, object], pb.NodeStatus],
                 mount_unit: Callable[[], str]):
        """status: the GetStatus RPC; mount_unit: the unit of the mount last asked for ("" if none)."""
        self._settings = settings
        self._events = events
        self._status = status
        self._mount_unit = mount_unit

    def CollectDiagnostics(self, request, context):
        journal_bytes = request.journal_max_bytes or DEFAULT_JOURNAL_BYTES
        rank_lines = request.rank_lines or DEFAULT_RANK_LINES
        if journal_bytes > MAX_JOURNAL_BYTES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"journal_max_bytes: at most {MAX_JOURNAL_BYTES}")
        if rank_lines > MAX_RANK_LINES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rank_lines: at most {MAX_RANK_LINES}")
        s = self._settings
        redactor = Redactor(held_secrets(s.state_dir, (s.tls_key,)))

        def status_json() -> str:
            status = self._status(pb.GetStatusRequest(), context)
            return json_format.MessageToJson(status, preserving_proto_field_name=True, sort_keys=True)

        def extra_units() -> list[str]:
            unit = self._mount_unit()
            return [unit] if unit else []
        diagnostics = NodeDiagnostics(SystemdJournal(), status_json, redactor, extra_units=extra_units)
        for path, data in diagnostics.files(journal_bytes, rank_lines):
            if not context.is_active():
                return
            for offset in range(0, max(len(data), 1), CHUNK_BYTES):
                piece = data[offset:offset + CHUNK_BYTES]
                yield pb.DiagnosticChunk(path=path, data=piece, last=offset + CHUNK_BYTES >= len(data))
        self._events.info("diagnostics_collected", "sent this node's diagnostics for dsv41ctl bundle",
                          journal_max_bytes=journal_bytes)
