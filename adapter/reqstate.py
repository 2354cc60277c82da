"""Rank 0's scheduler's view of its requests, shared with rank 0's HTTP process through a small
file in /dev/shm (the approach of dsv41/progress.py).

SGLang's scheduler runs in its own process (`sglang::scheduler_TP0`); the HTTP/tokenizer process,
where GET /dsv41/inflight is served, knows a request's prompt but not whether it waits, is being
chunk-prefilled or decodes. The scheduler's hooks write a snapshot here after each step: one
store of the whole snapshot into a shared mapping between two bumps of a sequence word, no lock
and no system call on the scheduler's hot path. The route reads it when asked; a read that
overlaps a write is retried. Python has no memory barriers: on a weakly ordered CPU (GB10 is
aarch64) the reader may see the sequence word's new value before all of the records' stores, so
the header carries a CRC-32 of what it describes and of the records, and a read whose CRC does
not match is retried like one that overlapped a write.

Layout (little-endian, one mapping of SIZE bytes): a header of magic "DSV41RQ4", the sequence
word (odd while a write is under way), the snapshot's CLOCK_MONOTONIC ns, when the step it lists
was launched (CLOCK_MONOTONIC ns once `Scheduler.run_batch` returned, its allocations made; 0
before), the writer's pid, the number of records, the requests not listed (more than
MAX_RECORDS), the CRC-32 of those four numbers, the next one and the records, the KV pool's
high-water mark (the most token slots its requests held at once in the scheduler's iterations
before this one, whose steps have run: the slots whose memory the pool has touched; the batch
this snapshot lists has its slots already and may not have written them yet; 0: not known),
then the records: state
(0 waiting, 1 prefilling, 2 decoding), the rid's full length in bytes, prompt, prefilled, cached,
chunk and output tokens, the rid's first RID_BYTES bytes (UTF-8), and for a rid longer than that
an 8-byte BLAKE2b digest of the whole rid (zeros otherwise): two long rids that share their first
bytes are still told apart.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import stat
import struct
import time
import zlib
from dataclasses import dataclass
from typing import Callable

from dsv41.progress import create_shared

DIRECTORY = "/dev/shm"
PREFIX = "dsv41-requests-tp"
MAGIC = int.from_bytes(b"DSV41RQ4", "little")
STATES = ("waiting", "prefilling", "decoding")
RID_BYTES = 160
MAX_RECORDS = 1024
_HEADER = struct.Struct("<QQQQQIIII")  # magic, seq, written_ns, launched_ns, pid, count, unlisted, crc, kv high water
_CHECKED = struct.Struct("<QQIII")  # written_ns, launched_ns, count, unlisted, kv high water: covered by the CRC
_RECORD = struct.Struct(f"<BxH5I{RID_BYTES}s8s")  # state, rid length, 5 counts, rid, digest: 192 bytes
DIGEST_BYTES = 8
_NO_DIGEST = bytes(DIGEST_BYTES)
_SEQ = struct.Struct("<Q")
_SEQ_OFFSET = 8
SIZE = _HEADER.size + MAX_RECORDS * _RECORD.size
_U32 = (1 << 32) - 1


def _crc(written_ns: int, launched_ns: int, count: int, unlisted: int, kv_high_water: int, records_crc: int) -> int:
    return zlib.crc32(_CHECKED.pack(written_ns, launched_ns, count, unlisted, kv_high_water), records_crc)


def path_for(tp_rank: int, directory: str = DIRECTORY) -> str:
    return os.path.join(directory, f"{PREFIX}{tp_rank}")


@dataclass(frozen=True)
class Record:
    rid: str            # the rid, or its first RID_BYTES bytes when `complete` is False
    state: str          # waiting | prefilling | decoding
    prompt_tokens: int
    prefilled_tokens: int
    cached_tokens: int  # of the prompt, served from the prefix cache
    chunk_tokens: int   # in prefill steps launched and not yet processed
    output_tokens: int
    complete: bool = True  # the whole rid fits the record
    digest: bytes = b""  # rid_digest() of the whole rid when it does not ("" when it does)


def rid_digest(rid: str) -> bytes:
    """What a record keeps of a rid longer than RID_BYTES beside its first bytes."""
    return hashlib.blake2b(rid.encode("utf-8", "replace"), digest_size=DIGEST_BYTES).digest()


def is_long(rid: str) -> bool:
    return len(rid.encode("utf-8", "replace")) > RID_BYTES


@dataclass(frozen=True)
class Snapshot:
    records: tuple[Record, ...]
    written_ns: int
    pid: int
    unlisted: int = 0  # requests beyond MAX_RECORDS, not in `records`
    launched_ns: int = 0  # when the step listed was launched (0: not yet)
    kv_high_water: int = 0  # the most KV pool slots (tokens) held at once so far (0: not known)


def _encode(r: Record, digest_of: Callable[[str], bytes] = rid_digest) -> bytes:
    rid = r.rid.encode("utf-8", "replace")
    digest = digest_of(r.rid) if len(rid) > RID_BYTES else _NO_DIGEST
    return _RECORD.pack(STATES.index(r.state), min(len(rid), 0xFFFF),
                        *(min(max(0, n), _U32) for n in (r.prompt_tokens, r.prefilled_tokens, r.cached_tokens,
                                                         r.chunk_tokens, r.output_tokens)),
                        rid[:RID_BYTES], digest)


def _decode(data: bytes) -> Record:
    state, rid_len, prompt, prefilled, cached, chunk, output, rid, digest = _RECORD.unpack(data)
    kept = rid[:min(rid_len, RID_BYTES)]
    complete = rid_len <= RID_BYTES
    # A cut rid may end inside a character: drop the partial one, so what is kept is still a prefix
    # of the rid (a replacement character would match no request).
    # (an incremental decoder that is not told the input is final holds back a partial last character)
    text = kept.decode("utf-8", "replace") if complete else \
        codecs.getincrementaldecoder("utf-8")("replace").decode(kept, final=False)
    return Record(text, STATES[state] if state < len(STATES) else "waiting",
                  prompt, prefilled, cached, chunk, output, complete=complete, digest=b"" if complete else digest)


class RequestsWriter:
    """The scheduler's side: creates the file for its TP rank (replacing a previous run's)."""

    def __init__(self, tp_rank: int, directory: str = DIRECTORY, clock_ns=time.monotonic_ns):
        self.path = path_for(tp_rank, directory)
        self.pid = os.getpid()
        self._clock_ns = clock_ns
        self._seq = 0
        self._header = (0, 0, 0, 0)  # written_ns, launched_ns, count, unlisted of the last write
        self._kv_high_water = 0  # over every snapshot so far
        self._kv_published = 0   # over the snapshots before the last one
        self._records_crc = 0  # CRC-32 of the last write's records
        self._digests: dict[str, bytes] = {}  # rid -> rid_digest of the last write's long rids
        created = clock_ns()
        self._map = create_shared(self.path, SIZE, lambda m: _HEADER.pack_into(
            m, 0, MAGIC, 0, created, 0, self.pid, 0, 0, _crc(created, 0, 0, 0, 0, 0), 0))

    def write(self, records: list[Record], kv_in_use: int | None = None) -> None:
        """The snapshot; `kv_in_use`: the KV pool's slots held now (tokens), the batch it lists
        included, which raises the high-water mark the next snapshots publish."""
        self._kv_published = self._kv_high_water
        if kv_in_use is not None:
            self._kv_high_water = max(self._kv_high_water, min(max(0, kv_in_use), _U32))
        listed = records[:MAX_RECORDS]
        previous, self._digests = self._digests, {}

        def digest_of(rid: str) -> bytes:  # a rid is listed step after step: digested once
            found = self._digests[rid] = previous.get(rid) or rid_digest(rid)
            return found
        body = b"".join(_encode(r, digest_of) for r in listed)  # built before the sequence opens: one copy
        odd = self._open()
        self._map[_HEADER.size:_HEADER.size + len(body)] = body
        self._header = (self._clock_ns(), 0, len(listed), len(records) - len(listed))
        self._records_crc = zlib.crc32(body)
        self._close(odd)

    def mark_launched(self) -> None:
        """The step the last snapshot lists is launched: its buffers are allocated from now on."""
        written, _, count, unlisted = self._header
        odd = self._open()
        self._header = (written, self._clock_ns(), count, unlisted)
        self._close(odd)

    def _open(self) -> int:
        """Marks a write under way (an odd sequence word); returns that word."""
        self._seq += 1
        _SEQ.pack_into(self._map, _SEQ_OFFSET, self._seq * 2 - 1)
        return self._seq * 2 - 1

    def _close(self, odd: int) -> None:
        written, launched, count, unlisted = self._header
        high = self._kv_published
        _HEADER.pack_into(self._map, 0, MAGIC, odd, written, launched, self.pid, count, unlisted,
                          _crc(written, launched, count, unlisted, high, self._records_crc), high)
        _SEQ.pack_into(self._map, _SEQ_OFFSET, odd + 1)

    def close(self) -> None:
        self._map.close()


class Unreadable(Exception):
    """The file exists but cannot be trusted or read; the message says why."""


def read(path: str, allowed_uids: tuple[int, ...] | None = None, attempts: int = 100) -> Snapshot | None:
    """The snapshot in `path`; None when there is none. `allowed_uids` (default: this process's
    user and root) may have written it; a file writable by group or other is not trusted."""
    allowed = (os.getuid(), 0) if allowed_uids is None else allowed_uids
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Unreadable(f"{path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < SIZE:
            raise Unreadable(f"{path}: not a request-state file")
        if st.st_uid not in allowed or st.st_mode & 0o022:
            raise Unreadable(f"{path}: owned by uid {st.st_uid} with mode {st.st_mode & 0o777:04o}; only the "
                             "rank's own user may write it")
        torn = 0
        for _ in range(attempts):
            header = os.pread(fd, _HEADER.size, 0)
            magic, seq, written_ns, launched_ns, pid, count, unlisted, crc, high = _HEADER.unpack(header)
            if magic != MAGIC:
                raise Unreadable(f"{path}: not a request-state file")
            if seq % 2:
                time.sleep(0)  # a write under way: it is one copy, let it finish
                continue
            body = os.pread(fd, min(count, MAX_RECORDS) * _RECORD.size, _HEADER.size)
            if _SEQ.unpack(os.pread(fd, _SEQ.size, _SEQ_OFFSET))[0] != seq:
                continue
            if _crc(written_ns, launched_ns, count, unlisted, high, zlib.crc32(body)) != crc:
                torn += 1  # stores seen out of order (or a corrupt file): read again
                time.sleep(0)
                continue
            records = tuple(_decode(body[i:i + _RECORD.size]) for i in range(0, len(body), _RECORD.size))
            return Snapshot(records, written_ns, pid, unlisted, launched_ns, high)
        if torn == attempts:
            raise Unreadable(f"{path}: its checksum never matched in {attempts} reads (a corrupt file)")
        raise Unreadable(f"{path}: always being written")
    finally:
        os.close(fd)
