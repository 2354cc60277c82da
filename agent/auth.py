"""Who may call this agent: TLS proves the caller holds a certificate of the cluster CA; this module
checks that the certificate is the coordinator's (a node's certificate must not drive another node),
and serves the agent's own certificate so that a rotated one is picked up without a restart.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import re
import ssl
import threading
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import grpc

Refused = Callable[[str, str], None]  # (method, why): where refusals are reported
_PIN = re.compile(r"(sha256:)?([0-9a-f]{64})")


def caller_names(auth_context: Mapping[str, Sequence[bytes]]) -> tuple[str, ...]:
    """The names the peer's certificate proves: its DNS subject alternative names, or its CN when it
    has none. Empty without a verified TLS peer."""
    if [b"ssl"] != list(auth_context.get("transport_security_type", [])):
        return ()
    sans = auth_context.get("x509_subject_alternative_name") or []
    names = sans or auth_context.get("x509_common_name") or []
    return tuple(bytes(n).decode(errors="replace") for n in names)


def certificate_fingerprint(auth_context: Mapping[str, Sequence[bytes]]) -> str:
    """sha256 of the verified peer certificate (DER), lowercase hex; "" without one."""
    pems = auth_context.get("x509_pem_cert") or []
    if not pems:
        return ""
    try:
        der = ssl.PEM_cert_to_DER_cert(bytes(pems[0]).decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return ""
    return hashlib.sha256(der).hexdigest()


def caller_problem(auth_context: Mapping[str, Sequence[bytes]], allowed: str,
                   pins: frozenset[str] | None = None) -> str | None:
    """None when the caller is `allowed` (and, with pins, presents a pinned certificate);
    otherwise why it is refused."""
    names = caller_names(auth_context)
    if not names:
        return "no verified client certificate (mutual TLS is required)"
    if allowed not in names:
        return f"the client certificate is for {', '.join(names)}, and only {allowed} may call this agent"
    if pins is None:
        return None
    fingerprint = certificate_fingerprint(auth_context)
    if fingerprint in pins:
        return None
    return (f"the {allowed} certificate presented (sha256 {fingerprint[:16]}...) is not the one this node's bundle "
            "pins: it was rotated away (`dsv41ctl pki rotate`); restart the coordinator with its current "
            "certificate, or install this node's current bundle (`dsv41ctl pki bundle NODE`)")


def parse_pins(text: str) -> frozenset[str]:
    """The fingerprints in a pin file: one `sha256:<64 hex>` per line, `#` comments; ValueError
    when a line is neither or when there is none."""
    pins = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip().lower()
        if not line:
            continue
        match = _PIN.fullmatch(line)
        if not match:
            raise ValueError(f"line {number}: not a sha256:<64 hex> certificate fingerprint")
        pins.add(match.group(2))
    if not pins:
        raise ValueError("no certificate fingerprint in it")
    return frozenset(pins)


class PinFile:
    """The coordinator certificates this node accepts (TLS_PIN, from its bundle). A new file
    applies from the next call on; one that does not parse leaves the previous pins in place."""

    def __init__(self, path: str, problem: Callable[[str], None] = lambda _: None):
        self.path = path
        self._problem = problem
        self._lock = threading.Lock()
        self._stamp, self._pins = self._read()
        if self._pins is None:
            raise ValueError(self._stamp)

    def _read(self):
        try:
            st = os.stat(self.path)
            with open(self.path, encoding="ascii", errors="replace") as f:
                return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size), parse_pins(f.read())
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            return f"{self.path}: {why} (install this node's bundle from `dsv41ctl pki bundle NODE`; it pins the "                    "coordinator's certificate)", None

    def pins(self) -> frozenset[str]:
        with self._lock:
            try:
                st = os.stat(self.path)
                stamp = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
            except OSError:
                stamp = None
            if stamp != self._stamp:
                new_stamp, pins = self._read()
                if pins is None:
                    self._problem(f"{new_stamp}; still accepting the previous pins")
                    self._stamp = stamp  # report once per change
                else:
                    self._stamp, self._pins = new_stamp, pins
            return self._pins


class CallerCheck(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call whose client certificate does not name `allowed`, before
    the handler sees the request."""

    def __init__(self, allowed: str, refused: Refused, pins: Callable[[], frozenset[str]] | None = None):
        self._allowed = allowed
        self._refused = refused
        self._pins = pins

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def guard(behaviour):
            def checked(request_or_iterator, context):
                pins = self._pins() if self._pins is not None else None
                problem = caller_problem(context.auth_context(), self._allowed, pins)
                if problem is not None:
                    self._refused(method, problem)
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)
                return behaviour(request_or_iterator, context)
            return checked

        kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler),
                 ("unary_stream", grpc.unary_stream_rpc_method_handler),
                 ("stream_unary", grpc.stream_unary_rpc_method_handler),
                 ("stream_stream", grpc.stream_stream_rpc_method_handler))
        for attribute, make in kinds:
            behaviour = getattr(handler, attribute)
            if behaviour is not None:
                return make(guard(behaviour), request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
        return handler


# ------------------------------------------------------------------ the agent's own certificate

@dataclass(frozen=True)
class _Loaded:
    stamp: tuple
    ca: bytes
    cert: bytes
    key: bytes


class CredentialFiles:
    """TLS_CA/TLS_CERT/TLS_KEY served with client authentication required. New files (a rotated
    bundle) are used from the next connection on, once the key matches the certificate and the
    certificate is signed by the CA; until then the previous set stays in use."""

    def __init__(self, ca: str, cert: str, key: str, problem: Callable[[str], None] = lambda _: None):
        self.paths = (ca, cert, key)
        self._problem = problem
        self._last_problem = ""
        self._lock = threading.Lock()
        self._loaded = self._load()
        if isinstance(self._loaded, str):
            raise ValueError(self._loaded)

    def _stamp(self) -> tuple:
        out = []
        for path in self.paths:
            st = os.stat(path)
            # ctime too: tar restores mtime, and a bundle made in the same second keeps it equal
            out.append((st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size))
        return tuple(out)

    def _load(self) -> _Loaded | str:
        """The files if they form a usable set, else why not."""
        try:
            stamp = self._stamp()
            ca, cert, key = (_read(p) for p in self.paths)
        except OSError as exc:
            return f"cannot read the TLS files: {exc}"
        problem = pair_problem(ca, cert, key)
        if problem:
            return f"{self.paths[1]}: {problem}"
        return _Loaded(stamp, ca, cert, key)

    def _config(self, loaded: _Loaded):
        return grpc.ssl_server_certificate_configuration([(loaded.key, loaded.cert)], root_certificates=loaded.ca)

    def _fetch(self):
        # Called by gRPC before each handshake: a stat of three files, a reload only when they changed.
        try:
            with self._lock:
                current = self._loaded
                if self._stamp() == current.stamp:
                    return None
                loaded = self._load()
                if isinstance(loaded, str):
                    self._report(f"{loaded}; still serving the previous certificate")
                    return None
                self._loaded = loaded
                self._last_problem = ""
                return self._config(loaded)
        except Exception as exc:  # never fail a handshake over a reload
            self._report(f"cannot reload the TLS files: {exc}")
            return None

    def _report(self, why: str) -> None:
        # Every handshake retries a half-copied bundle: say so once per distinct problem.
        if why != self._last_problem:
            self._last_problem = why
            self._problem(why)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._config(self._loaded), self._fetch,
                                                   require_client_authentication=True)

    def cert_pem(self) -> bytes:
        with self._lock:
            return self._loaded.cert


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def pair_problem(ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> str | None:
    """Why the key and certificate cannot be served under this CA, or None."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as exc:
        return f"not a PEM certificate and key: {exc}"
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        return "the key does not belong to the certificate"
    try:
        ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes,  # type: ignore[call-arg]
                               ec.ECDSA(cert.signature_hash_algorithm))  # type: ignore[arg-type]
    except Exception:
        return f"the certificate is not signed by the CA in the TLS_CA file ({ca.subject.rfc4514_string()})"
    return None


def cert_not_after(path: str | None) -> int:
    """notAfter of the certificate in `path` as Unix seconds; 0 when there is none or it cannot be read."""
    if not path:
        return 0
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(_read(path))
    except (OSError, ValueError):
        return 0
    value = getattr(cert, "not_valid_after_utc", None)
    if value is None:  # cryptography < 42
        value = cert.not_valid_after.replace(tzinfo=dt.timezone.utc)
    return int(value.timestamp())
