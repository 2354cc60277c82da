"""Value parsers for cluster.env keys.

Each parser takes the raw string and returns a typed value or raises `Invalid` with a message
that says what is allowed. They are pure and small so the schema reads like a table.
"""

from __future__ import annotations

import enum
import ipaddress
import re
import shlex
from dataclasses import dataclass
from typing import Callable


class Invalid(ValueError):
    """The value is not allowed; the message says what is."""


class Kind(enum.Enum):
    """What a parser returns: ClusterConfig's accessors check a key's kind before they read it, so
    reading a key as another type fails at its first use instead of computing with the wrong value."""
    INTEGER = "integer"  # int
    NUMBER = "number"  # float
    FLAG = "flag"  # bool
    TEXT = "text"  # str: names, addresses, paths, choices
    WORDS = "words"  # tuple[str, ...]: lists and shell words
    LISTEN = "listen"  # Listen
    ALLOC_CONF = "alloc_conf"  # AllocConf
    EFFORT = "effort"  # int (1-100) or str (a tier)


@dataclass(frozen=True)
class Parser:
    """A value parser and the kind of value it returns; `optional` ones return None for ""."""
    parse: Callable[[str], object]
    kind: Kind
    optional: bool = False

    def __call__(self, raw: str) -> object:
        return self.parse(raw)

_IFNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,14}")
_HCA = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]{0,63}")
_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_DIGEST_REF = re.compile(r"[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}")
_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}")
_LOCAL_REF = re.compile(r"[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?")
_EXPORT_OPTION = re.compile(r"[a-z_]+(=[A-Za-z0-9_.:-]+)?")


def integer(lo: int, hi: int) -> Parser:
    def parse(raw: str) -> int:
        try:
            value = int(raw, 10)
        except ValueError:
            raise Invalid(f"must be an integer from {lo} to {hi}") from None
        if not lo <= value <= hi:
            raise Invalid(f"must be an integer from {lo} to {hi}")
        return value
    return Parser(parse, Kind.INTEGER)


def real(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Parser:
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    allowed = f"must be a number in {left}{lo:g}, {hi:g}{right}"

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise Invalid(allowed) from None
        if value != value or (value <= lo if lo_open else value < lo) or (value >= hi if hi_open else value > hi):
            raise Invalid(allowed)
        return value
    return Parser(parse, Kind.NUMBER)


def _flag(raw: str) -> bool:
    if raw in ("1", "0"):
        return raw == "1"
    raise Invalid("must be 1 or 0")


flag = Parser(_flag, Kind.FLAG)


def choice(*allowed: str) -> Parser:
    def parse(raw: str) -> str:
        if raw not in allowed:
            raise Invalid("must be one of " + ", ".join(allowed))
        return raw
    return Parser(parse, Kind.TEXT)


def _ipv4(raw: str) -> str:
    try:
        return str(ipaddress.IPv4Address(raw))
    except ValueError:
        raise Invalid("must be an IPv4 address like 10.0.0.2") from None


ipv4 = Parser(_ipv4, Kind.TEXT)


def _ipv4_or_network(raw: str) -> str:
    try:
        if "/" in raw:
            return str(ipaddress.IPv4Network(raw, strict=True))
        return str(ipaddress.IPv4Address(raw))
    except ValueError:
        raise Invalid("must be an IPv4 address or network like 10.0.22.0/24 (host bits zero)") from None


ipv4_or_network = Parser(_ipv4_or_network, Kind.TEXT)


@dataclass(frozen=True)
class Listen:
    host: str  # an IP address literal, without brackets
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _listen(raw: str) -> Listen:
    """ADDRESS:PORT with an IPv4 address, or [IPv6]:PORT."""
    allowed = "must be ADDRESS:PORT with an IP address and a port 1-65535, e.g. 0.0.0.0:9441 or [::]:9441"
    host, sep, port = raw.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise Invalid(allowed)
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        address = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise Invalid(allowed) from None
    if address.version == 6 and not bracketed:
        raise Invalid(allowed)
    return Listen(str(address), int(port))


listen = Parser(_listen, Kind.LISTEN)


def _ifname(raw: str) -> str:
    if not _IFNAME.fullmatch(raw):
        raise Invalid("must be a network interface name (1-15 characters: letters, digits, _ . : @ -)")
    return raw


ifname = Parser(_ifname, Kind.TEXT)


def _hostname(raw: str) -> str:
    if not _HOSTNAME.fullmatch(raw):
        raise Invalid("must be a host name (letters, digits and -, dot-separated)")
    return raw


hostname = Parser(_hostname, Kind.TEXT)


def _name(raw: str) -> str:
    if not _NAME.fullmatch(raw):
        raise Invalid("must be a name of letters, digits, _ . - (at most 64)")
    return raw


name = Parser(_name, Kind.TEXT)


def _abspath(raw: str) -> str:
    if not raw.startswith("/") or "\0" in raw or "\n" in raw:
        raise Invalid("must be an absolute path")
    parts = raw.split("/")
    if ".." in parts:
        raise Invalid("must be an absolute path without '..'")
    return "/" + "/".join(p for p in parts if p not in ("", "."))


abspath = Parser(_abspath, Kind.TEXT)


def optional(parser: Parser) -> Parser:
    def parse(raw: str) -> object:
        return None if raw == "" else parser(raw)
    return Parser(parse, parser.kind, optional=True)


def listing(item: Parser, *, what: str) -> Parser:
    def parse(raw: str) -> tuple:
        items = [part.strip() for part in raw.split(",")]
        if not raw or any(part == "" for part in items):
            raise Invalid(f"must be a comma-separated list of {what}")
        values = []
        for part in items:
            try:
                values.append(item(part))
            except Invalid as exc:
                raise Invalid(f"{part!r}: {exc}") from None
        if len(set(values)) != len(values):
            raise Invalid(f"lists an entry twice; each of the {what} once")
        return tuple(values)
    if item.kind is not Kind.TEXT:
        raise TypeError(f"a listing holds text, not {item.kind.value}")
    return Parser(parse, Kind.WORDS)


def _groups(raw: str) -> tuple:
    groups = []
    for word in raw.split():
        names = [part.strip() for part in word.split(",")]
        for name in names:
            if not _HOSTNAME.fullmatch(name):
                raise Invalid(f"{word!r}: each group is a comma-separated list of node names (HEAD_HOST, "
                              "WORKERk_HOST), groups separated by spaces: spark1,spark2,spark3 spark4,spark5,spark6")
        groups.append(tuple(names))
    return tuple(groups)


groups = Parser(_groups, Kind.WORDS)


def _hca(raw: str) -> str:
    device, _, port = raw.partition(":")
    if not _HCA.fullmatch(device) or (port and not port.isdigit()):
        raise Invalid("must be an RDMA device name, optionally with :PORT (e.g. rocep1s0f0 or mlx5_0:1)")
    return raw


hca = Parser(_hca, Kind.TEXT)


def nccl_set(*known: str) -> Parser:
    """NCCL's list syntax: comma-separated names, optionally negated as a whole with a leading ^."""
    upper = {k.upper(): k for k in known}

    def parse(raw: str) -> str:
        body = raw[1:] if raw.startswith("^") else raw
        parts = body.split(",")
        if not body or any(p.upper() not in upper for p in parts):
            raise Invalid("must be a comma-separated list of " + ", ".join(known) + " (optionally starting with ^ to exclude)")
        return raw
    return Parser(parse, Kind.TEXT)


def _image_by_digest(raw: str) -> str:
    if not _DIGEST_REF.fullmatch(raw):
        raise Invalid("must be pinned by digest: NAME[:TAG]@sha256:<64 hex> (a tag moves, a digest does not)")
    return raw


image_by_digest = Parser(_image_by_digest, Kind.TEXT)


def _image_ref(raw: str) -> str:
    if not (_DIGEST_REF.fullmatch(raw) or _IMAGE_ID.fullmatch(raw) or _LOCAL_REF.fullmatch(raw)):
        raise Invalid("must be an image reference NAME[:TAG]@sha256:<64 hex>, a local build's ID sha256:<64 hex>, "
                      "or NAME[:TAG]")
    return raw


image_ref = Parser(_image_ref, Kind.TEXT)


def is_pinned_image(ref: str) -> bool:
    """By digest or by image ID: the content cannot change under the name."""
    return bool(_DIGEST_REF.fullmatch(ref) or _IMAGE_ID.fullmatch(ref))


def _export_options(raw: str) -> str:
    """exports(5) options for the weights: read-only; the agent checks each against its list."""
    options = raw.split(",")
    if not all(_EXPORT_OPTION.fullmatch(o) for o in options):
        raise Invalid("must be comma-separated exports(5) options like ro,sync,no_subtree_check,root_squash,secure")
    names = [o.split("=")[0] for o in options]
    if "ro" not in names or "rw" in names:
        raise Invalid("must include ro and not rw: the weights are shared read-only")
    if len(set(names)) != len(names):
        raise Invalid("lists an option twice")
    return raw


export_options = Parser(_export_options, Kind.TEXT)


REASONING_TIERS = ("low", "high", "xhigh", "max")


def _reasoning_effort(raw: str) -> int | str:
    if raw in REASONING_TIERS:
        return raw
    try:
        value = int(raw, 10)
    except ValueError:
        value = 0
    if not 1 <= value <= 100:
        raise Invalid("must be an integer from 1 to 100 or one of " + ", ".join(REASONING_TIERS))
    return value


reasoning_effort = Parser(_reasoning_effort, Kind.EFFORT)


def _verify_cap(raw: str) -> float:
    """`0` disables the cap; `conf:<x>` caps verification at confidence x in (0, 1]."""
    if raw == "0":
        return 0.0
    if raw.startswith("conf:"):
        try:
            value = float(raw[5:])
        except ValueError:
            value = -1.0
        if 0.0 < value <= 1.0:
            return value
    raise Invalid("must be 0 (off) or conf:<x> with 0 < x <= 1, e.g. conf:0.1")


verify_cap = Parser(_verify_cap, Kind.NUMBER)


def chunk_size(page: int) -> Parser:
    def parse(raw: str) -> int:
        value = integer(page, 1 << 20)(raw)
        if value % page:
            raise Invalid(f"must be a multiple of the {page}-token KV page (e.g. {page * 3})")
        return value
    return Parser(parse, Kind.INTEGER)


@dataclass(frozen=True)
class AllocConf:
    text: str
    options: tuple[tuple[str, str], ...]


def _alloc_conf(raw: str) -> AllocConf:
    options = []
    for part in raw.split(","):
        key, sep, value = part.partition(":")
        if not sep or not key.strip() or not value.strip():
            raise Invalid("must be PyTorch's KEY:VALUE[,KEY:VALUE] allocator options")
        options.append((key.strip(), value.strip()))
    for key, value in options:
        if key == "expandable_segments" and value.lower() == "true":
            raise Invalid(
                "expandable_segments:True is refused: on this stack every prefill of more than 64 query tokens "
                "returns NaN logits (garbage text at temperature 0, then a scheduler crash 'probability tensor "
                "contains inf/nan'); use expandable_segments:False")
    return AllocConf(raw, tuple(options))


alloc_conf = Parser(_alloc_conf, Kind.ALLOC_CONF)


def _shell_words(raw: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(raw, comments=False, posix=True))
    except ValueError as exc:
        raise Invalid(f"cannot be split like a shell would: {exc}") from None


shell_words = Parser(_shell_words, Kind.WORDS)


def _plain_text(raw: str) -> str:
    if any(ord(ch) < 32 for ch in raw):
        raise Invalid("must not contain control characters")
    return raw


plain_text = Parser(_plain_text, Kind.TEXT)
