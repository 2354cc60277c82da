"""The cluster's credentials: a CA, one certificate per node agent and one for the coordinator.

Pure parts (what to issue, for how long) are plain functions over dataclasses; the files live behind
PkiStore, whose root, clock and group are constructor arguments. The layout:

    PKI_DIR/               0750 root:dsv41
      ca.crt  ca.key       0640 / 0600
      coordinator.crt/.key 0640 / 0600   CN and SAN "dsv41-coordinator", clientAuth only
      nodes/NAME.crt/.key  0640 / 0600   CN NAME, SAN DNS:NAME and IP:address, serverAuth only

Each node gets a bundle (bundle_tar) with exactly what its agent needs under /etc/dsv41/tls.
Also here: naming the node whose certificate an agent presents (for the coordinator's error messages)
and reading the SGLang API key file, the cluster's other secret.
"""

from __future__ import annotations

import datetime as dt
import grp
import io
import ipaddress
import os
import re
import socket
import ssl
import stat
import tarfile
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dsv41.atomicfile import replace_file

COORDINATOR_NAME = "dsv41-coordinator"
PKI_GROUP = "dsv41"
PIN_FILE = "coordinator.pin"
CA_DAYS = 3650
# A leaf that leaks stays usable until it expires or is rotated away (the coordinator's is pinned,
# so rotation ends it at once); half a year, and `dsv41ctl status` warns six weeks before.
DEFAULT_LEAF_DAYS = 180
MAX_LEAF_DAYS = 397
# Where a bundle puts the agent's files on the node (the paths its agent.env snippet names).
NODE_TLS_DIR = "/etc/dsv41/tls"
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_API_KEY = re.compile(r"[\x21-\x7e]{8,4096}")  # printable ASCII without spaces: it travels in a header


class PkiError(Exception):
    """What is wrong with the PKI directory or a request, and what to do about it."""


# ------------------------------------------------------------------ what to issue (pure)

@dataclass(frozen=True)
class LeafSpec:
    name: str  # CN and DNS SAN; the file name under nodes/ (or "coordinator")
    addresses: tuple[str, ...]  # IP SANs
    client: bool  # clientAuth (the coordinator) or serverAuth (an agent)

    @property
    def stem(self) -> str:
        return "coordinator" if self.client else f"nodes/{self.name}"


def leaf_specs(nodes: Iterable[tuple[str, str]]) -> list[LeafSpec]:
    """One server certificate per (name, address) node and the coordinator's client certificate."""
    specs = [LeafSpec(COORDINATOR_NAME, (), True)]
    seen = {COORDINATOR_NAME}
    for name, address in nodes:
        if not _NAME.fullmatch(name):
            raise PkiError(f"node name {name!r}: must be a host name of letters, digits and -")
        if name in seen:
            what = "is the coordinator's identity" if name == COORDINATOR_NAME else "appears twice"
            raise PkiError(f"node name {name}: {what}; every certificate name must be unique")
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise PkiError(f"node {name}: address {address!r} is not an IP address") from None
        seen.add(name)
        specs.append(LeafSpec(name, (address,), False))
    return specs


def leaf_validity(now: dt.datetime, days: int, ca_not_after: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    """(not before, not after): a minute of slack for clocks behind ours, never past the CA."""
    if not 1 <= days <= MAX_LEAF_DAYS:
        raise PkiError(f"--days {days}: must be 1..{MAX_LEAF_DAYS}")
    return now - dt.timedelta(minutes=1), min(now + dt.timedelta(days=days), ca_not_after)


def not_after_of(cert: x509.Certificate) -> dt.datetime:
    """notAfter as an aware UTC datetime (cryptography 38 has only the naive attribute)."""
    value = getattr(cert, "not_valid_after_utc", None)
    return value if value is not None else cert.not_valid_after.replace(tzinfo=dt.timezone.utc)


def names_of(cert: x509.Certificate) -> list[str]:
    """DNS and IP subject alternative names (the CN when there is no SAN extension)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return [*san.get_values_for_type(x509.DNSName), *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))]


# ------------------------------------------------------------------ building certificates

def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_ca(key: ec.EllipticCurvePrivateKey, now: dt.datetime, days: int = CA_DAYS) -> x509.Certificate:
    # A random suffix keeps two clusters' CAs apart in error messages and trust stores.
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "dsv41"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"dsv41 cluster CA {os.urandom(4).hex()}")])
    public = key.public_key()
    return (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256()))


def make_leaf(spec: LeafSpec, key: ec.EllipticCurvePrivateKey, ca: x509.Certificate,
              ca_key: ec.EllipticCurvePrivateKey, not_before: dt.datetime, not_after: dt.datetime) -> x509.Certificate:
    public = key.public_key()
    sans: list[x509.GeneralName] = [x509.DNSName(spec.name)]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in spec.addresses]
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if spec.client else ExtendedKeyUsageOID.SERVER_AUTH
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "dsv41"),
                                     x509.NameAttribute(NameOID.COMMON_NAME, spec.name)]))
            .issuer_name(ca.subject).public_key(public).serial_number(x509.random_serial_number())
            .not_valid_before(not_before).not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))


def agent_env_snippet(node: str, directory: str = NODE_TLS_DIR) -> str:
    return (f"# TLS for the dsv41-agent on {node}: put these lines into /etc/dsv41/agent.env\n"
            f"NODE_NAME={node}\n"
            f"TLS_CA={directory}/ca.crt\nTLS_CERT={directory}/node.crt\nTLS_KEY={directory}/node.key\n"
            f"TLS_PIN={directory}/{PIN_FILE}\n"
            f"COORDINATOR_NAME={COORDINATOR_NAME}\nINSECURE_NO_TLS=0\n")


def fingerprint(cert: x509.Certificate) -> str:
    """sha256 over the certificate's DER, lowercase hex: what an agent pins."""
    return cert.fingerprint(hashes.SHA256()).hex()


def pin_text(cert: x509.Certificate) -> str:
    """The bundle's coordinator.pin: the one coordinator certificate the node's agent accepts. A
    rotated coordinator certificate is refused by every agent that has the new bundle."""
    return (f"# The dsv41-coordinator certificate this node's agent accepts (serial {cert.serial_number:x}, "
            f"until {not_after_of(cert):%Y-%m-%d}).\n# `dsv41ctl pki rotate` issues a new one; install the "
            f"new bundle to pin it.\nsha256:{fingerprint(cert)}\n")


# ------------------------------------------------------------------ the directory

@dataclass(frozen=True)
class CertInfo:
    name: str  # "ca", "dsv41-coordinator" or a node name
    path: str
    subject_cn: str
    names: tuple[str, ...]
    not_after_unix_s: float
    serial: int


class PkiStore:
    """PKI_DIR on the head. Keys are born 0600 (no window in which others could read them), certificates
    0640 and directories 0750, group `group` when that group exists."""

    def __init__(self, root: str, group: str | None = PKI_GROUP,
                 now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.timezone.utc)):
        self.root = root
        self._group = group
        self._now = now

    # paths
    def path(self, stem: str, suffix: str) -> str:
        return os.path.join(self.root, f"{stem}.{suffix}")

    def node_stem(self, name: str) -> str:
        return "coordinator" if name == COORDINATOR_NAME else f"nodes/{name}"

    # writing
    def _gid(self) -> int:
        if self._group:
            try:
                return grp.getgrnam(self._group).gr_gid
            except KeyError:
                pass
        return os.getegid()

    def _mkdir(self, path: str) -> None:
        os.makedirs(path, mode=0o750, exist_ok=True)
        os.chown(path, os.geteuid(), self._gid())
        os.chmod(path, 0o750)

    def _write(self, path: str, data: bytes, private: bool) -> None:
        self._mkdir(os.path.dirname(path))
        replace_file(path, data, 0o600 if private else 0o640,  # a reader never sees half a key
                     owner=(os.geteuid(), os.getegid() if private else self._gid()))

    # reading
    def _read(self, stem: str, suffix: str) -> bytes:
        path = self.path(stem, suffix)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise PkiError(f"{path} does not exist: run `dsv41ctl pki init`" if stem == "ca" else
                           f"{path} does not exist: run `dsv41ctl pki rotate --node {stem.split('/')[-1]}`") from None

    def load_cert(self, stem: str) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self._read(stem, "crt"))

    def load_ca(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = serialization.load_pem_private_key(self._read("ca", "key"), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise PkiError(f"{self.path('ca', 'key')}: not an EC key made by `dsv41ctl pki init`")
        return self.load_cert("ca"), key

    def has_ca(self) -> bool:
        return os.path.exists(self.path("ca", "crt")) or os.path.exists(self.path("ca", "key"))

    # operations
    def init(self, nodes: Sequence[tuple[str, str]], days: int = DEFAULT_LEAF_DAYS, force: bool = False) -> list[str]:
        """A new CA and every leaf; refuses to replace an existing CA unless force. Returns the paths written."""
        specs = leaf_specs(nodes)
        if self.has_ca() and not force:
            raise PkiError(f"{self.path('ca', 'crt')} already exists: a new CA invalidates every bundle already "
                           "installed on the nodes. Use `dsv41ctl pki rotate` to re-issue certificates under it, "
                           "or `pki init --force` to replace it")
        now = self._now()
        ca_key = new_key()
        ca = make_ca(ca_key, now)
        leaf_validity(now, days, not_after_of(ca))  # check --days before anything is written
        self._mkdir(self.root)
        self._write(self.path("ca", "key"), key_pem(ca_key), private=True)
        self._write(self.path("ca", "crt"), cert_pem(ca), private=False)
        written = [self.path("ca", "key"), self.path("ca", "crt")]
        return written + self._issue(specs, ca, ca_key, days)

    def rotate(self, nodes: Sequence[tuple[str, str]], only: str | None = None,
               days: int = DEFAULT_LEAF_DAYS) -> list[str]:
        """New keys and certificates under the existing CA, for every leaf or only the named one."""
        specs = leaf_specs(nodes)
        if only is not None:
            specs = [s for s in specs if s.name == only]
            if not specs:
                known = ", ".join([COORDINATOR_NAME, *(n for n, _ in nodes)])
                raise PkiError(f"--node {only}: not in the cluster config; known: {known}")
        ca, ca_key = self.load_ca()
        return self._issue(specs, ca, ca_key, days)

    def _issue(self, specs: Iterable[LeafSpec], ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
               days: int) -> list[str]:
        not_before, not_after = leaf_validity(self._now(), days, not_after_of(ca))
        written = []
        for spec in specs:
            key = new_key()
            cert = make_leaf(spec, key, ca, ca_key, not_before, not_after)
            # key first: a crash between the two leaves a key that matches no certificate, which
            # `rotate` repairs; the reverse would publish a certificate whose key is lost.
            self._write(self.path(spec.stem, "key"), key_pem(key), private=True)
            self._write(self.path(spec.stem, "crt"), cert_pem(cert), private=False)
            written += [self.path(spec.stem, "key"), self.path(spec.stem, "crt")]
        return written

    def certificates(self) -> list[CertInfo]:
        """Every certificate in the directory: the CA, the coordinator's, the nodes' (sorted)."""
        stems = ["ca", "coordinator"]
        nodes_dir = os.path.join(self.root, "nodes")
        if os.path.isdir(nodes_dir):
            stems += sorted(f"nodes/{f[:-4]}" for f in os.listdir(nodes_dir) if f.endswith(".crt"))
        out = []
        for stem in stems:
            if not os.path.exists(self.path(stem, "crt")):
                continue
            cert = self.load_cert(stem)
            cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
            name = COORDINATOR_NAME if stem == "coordinator" else stem.split("/")[-1]
            out.append(CertInfo(name, self.path(stem, "crt"), str(cns[0].value) if cns else "",
                                tuple(names_of(cert)), not_after_of(cert).timestamp(), cert.serial_number))
        return out

    def bundle_tar(self, node: str) -> bytes:
        """What one node's agent needs, as a tar of etc/dsv41/tls/{ca.crt,node.crt,node.key,agent.env,
        coordinator.pin} (owner root, keys 0600): `tar -xpf BUNDLE -C /` on the node as root."""
        if node == COORDINATOR_NAME:
            raise PkiError(f"{COORDINATOR_NAME} is the coordinator's identity, not a node")
        stem = self.node_stem(node)
        files = [("ca.crt", self._read("ca", "crt"), 0o640), ("node.crt", self._read(stem, "crt"), 0o640),
                 ("node.key", self._read(stem, "key"), 0o600),
                 ("agent.env", agent_env_snippet(node).encode(), 0o640),
                 (PIN_FILE, pin_text(self.load_cert("coordinator")).encode(), 0o640)]
        check_leaf(files[0][1], files[1][1], files[2][1], node)
        mtime = int(self._now().timestamp())
        buffer = io.BytesIO()
        base = NODE_TLS_DIR.lstrip("/")
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
            directory = tarfile.TarInfo(base)
            directory.type, directory.mode, directory.mtime = tarfile.DIRTYPE, 0o750, mtime
            tar.addfile(directory)
            for name, data, mode in files:
                info = tarfile.TarInfo(f"{base}/{name}")
                info.size, info.mode, info.mtime = len(data), mode, mtime
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                tar.addfile(info, io.BytesIO(data))
        return buffer.getvalue()


def check_leaf(ca_pem: bytes, cert_pem_bytes: bytes, key_pem_bytes: bytes, name: str,
               now: dt.datetime | None = None) -> x509.Certificate:
    """The certificate is signed by the CA, names `name`, is in its validity period, and the key is its key."""
    ca = x509.load_pem_x509_certificate(ca_pem)
    cert = x509.load_pem_x509_certificate(cert_pem_bytes)
    key = serialization.load_pem_private_key(key_pem_bytes, password=None)
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, public) != \
            cert.public_key().public_bytes(serialization.Encoding.DER, public):
        raise PkiError(f"the key of {name} does not belong to its certificate")
    try:
        ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes,
                               ec.ECDSA(cert.signature_hash_algorithm))  # type: ignore[arg-type]
    except Exception:  # InvalidSignature, or a CA key of another type
        raise PkiError(f"the certificate of {name} is not signed by the cluster CA ({ca.subject.rfc4514_string()})"
                       ) from None
    if name not in names_of(cert):
        raise PkiError(f"the certificate names {', '.join(names_of(cert))}, not {name}")
    now = now or dt.datetime.now(dt.timezone.utc)
    if not_after_of(cert) <= now:
        raise PkiError(f"the certificate of {name} expired on {not_after_of(cert):%Y-%m-%d}: "
                       f"run `dsv41ctl pki rotate --node {name}`")
    return cert


# ------------------------------------------------------------------ diagnosing an agent's certificate

def peer_certificate_problem(host: str, port: int, ca_pem: bytes, cert_pem_bytes: bytes, key_pem_bytes: bytes,
                             expected: str, timeout_s: float = 3.0) -> str | None:
    """Why the agent at host:port is not the expected node, by looking at the certificate it presents
    (chain checked against the cluster CA, the name not): None when it names `expected` or when no
    TLS handshake could be made at all (nothing to add to the connection error)."""
    import tempfile

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    context.load_verify_locations(cadata=ca_pem.decode())
    # ssl loads a client key only from files: a private temporary directory, removed at once.
    with tempfile.TemporaryDirectory(prefix="dsv41-probe-") as tmp:
        cert_path, key_path = os.path.join(tmp, "c.crt"), os.path.join(tmp, "c.key")
        for path, data in ((cert_path, cert_pem_bytes), (key_path, key_pem_bytes)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        context.load_cert_chain(cert_path, key_path)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            with context.wrap_socket(raw) as tls:
                der = tls.getpeercert(binary_form=True)
    except ssl.SSLCertVerificationError as exc:
        return (f"the agent at {host}:{port} presents a certificate not signed by this cluster's CA "
                f"({exc.verify_message}): install the bundle from `dsv41ctl pki bundle {expected}` on {expected}")
    except (OSError, ssl.SSLError):
        return None
    if not der:
        return None
    names = names_of(x509.load_der_x509_certificate(der))
    if expected in names:
        return None
    return (f"the agent at {host}:{port} presents a certificate for {', '.join(names) or 'no name'}, not for "
            f"{expected}: wrong bundle installed there, or the address belongs to another node "
            f"(install `dsv41ctl pki bundle {expected}` on {expected})")


# ------------------------------------------------------------------ the SGLang API key

def read_api_key(path: str, owner_uid: int | None = None) -> str:
    """The key in API_KEY_FILE: a regular file of this user (root), not readable by group or other,
    holding one line of printable ASCII."""
    owner_uid = os.geteuid() if owner_uid is None else owner_uid
    try:
        # O_NONBLOCK: a FIFO planted at the path must not hang the coordinator (it is refused below).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise PkiError(f"API_KEY_FILE={path}: cannot open: {exc.strerror}") from None
    try:
        st = os.fstat(fd)  # of the file opened, not of whatever the name points at later
        if not stat.S_ISREG(st.st_mode):
            raise PkiError(f"API_KEY_FILE={path}: must be a regular file")
        if st.st_mode & 0o077:
            raise PkiError(f"API_KEY_FILE={path}: mode {st.st_mode & 0o777:04o} lets group or other read the key; "
                           f"run `chmod 600 {path}`")
        if st.st_uid != owner_uid:
            raise PkiError(f"API_KEY_FILE={path}: owned by uid {st.st_uid}, must be owned by uid {owner_uid} "
                           f"(`chown {owner_uid} {path}`): another user could replace the key")
        data = os.read(fd, 8192)
    finally:
        os.close(fd)
    text = data.decode("ascii", errors="replace").strip("\r\n")
    if not _API_KEY.fullmatch(text):
        raise PkiError(f"API_KEY_FILE={path}: must hold one line of 8 to 4096 printable ASCII characters "
                       "without spaces (the key)")
    return text
