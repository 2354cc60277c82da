"""RPCs for small files the coordinator keeps identical on every node (the DSpark tables).

Only plain file names inside the agent's state directory: the coordinator cannot write anywhere else.
"""

from __future__ import annotations

import hashlib
import os
import re

import grpc

from dsv41.atomicfile import replace_file
from dsv41.v1 import agent_pb2 as pb

MAX_FILE_BYTES = 64 << 20
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class FileRpcs:
    """PutFile, RemoveFile and GetFileDigest, on plain files in `state_dir`/state."""

    def __init__(self, state_dir: str, events):
        self._state_dir = state_dir
        self._events = events

    def _state_path(self, name: str, context) -> str:
        if not _NAME.fullmatch(name) or name in (".", ".."):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"path {name!r}: must be a plain file name (letters, digits, _ . -) in the state directory")
        return os.path.join(self._state_dir, "state", name)

    def _file_digest(self, name: str, path: str) -> pb.FileDigest:
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return pb.FileDigest(path=name, exists=False)
        return pb.FileDigest(path=name, exists=True, sha256=hashlib.sha256(data).hexdigest(), size=len(data))

    def PutFile(self, request, context):
        path = self._state_path(request.path, context)
        if len(request.content) > MAX_FILE_BYTES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"content: at most {MAX_FILE_BYTES} bytes")
        mode = request.mode or 0o644
        if mode & ~0o644:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "mode: at most 0644 (no execute or group/other write)")
        directory = os.path.dirname(path)
        os.makedirs(directory, mode=0o755, exist_ok=True)
        replace_file(path, request.content, mode)  # never a torn file under the real name
        digest = self._file_digest(request.path, path)
        if mode & 0o077:
            self._events.info("file_written", f"wrote {path} ({digest.size} bytes, sha256 {digest.sha256[:12]})",
                              path=path, sha256=digest.sha256)
        else:  # a secret (the API key): not even its hash goes to the journal
            self._events.info("file_written", f"wrote {path} ({digest.size} bytes, mode {mode:04o})", path=path)
        return digest

    def RemoveFile(self, request, context):
        path = self._state_path(request.path, context)
        try:
            os.unlink(path)
            self._events.info("file_removed", f"removed {path}", path=path)
        except FileNotFoundError:
            pass
        return pb.FileDigest(path=request.path, exists=False)

    def GetFileDigest(self, request, context):
        return self._file_digest(request.path, self._state_path(request.path, context))
