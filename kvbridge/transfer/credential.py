"""Role credentials: which instances may issue capabilities, certified by the deployment.

The operator holds the deployment's root key (`RootKey`, Ed25519), made once where
instances are launched from; it never goes to an instance. It enrolls each instance for
its roles (`ConnectorRole`: a prefill instance is a PRODUCER, a decode instance a
CONSUMER; a vLLM `kv_both` instance both) by signing a `Certificate`: the roles, the
instance id (``NAME@FINGERPRINT`` of the instance's CURVE key, `identity.py`) and the
instance's own Ed25519 public key. The instance gets a `Credential`: that certificate, its secret keys and the root's public key.

A prefill instance signs each capability, and each Welcome its workers answer a
handshake with, with its own key and sends its certificate along (`capability.issue`,
`producer.py`); a decode instance accepts one only if the certificate is signed by its
root, certifies the prefill role, and certifies the key that signed it for the instance
it speaks for (`signed_by_prefill`): the producer a capability names, the instance a
Welcome names. So a party that holds everything a decode host or the proxy holds
(their credentials, the shared token) cannot sign a capability any decode instance
accepts, nor point one at an endpoint of its own: only the root's holder can enroll a
prefill instance, and only that instance holds its key. Nor can it answer a decode
worker's handshake in a prefill instance's place (at an address it took over): the
Welcome, which carries the NIXL metadata the decode worker reads from, is signed too.

`kvbridge credential` makes the root and one credential per host; `kvbridge serve`
(all in one) and `kvbridge.vllm.launch` make them for the instances they start. Without
a shared token (loopback only, nothing authenticated) an instance may run without a
credential: a prefill instance then signs with a throwaway one (`Credential.ephemeral`)
and a decode instance without a root trusts any certificate.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
from pathlib import Path
from typing import Annotated

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvbridge.errors import ConfigError
from kvbridge.transfer.connector import ConnectorRole
from kvbridge.transfer.errors import AuthError
from kvbridge.transfer.identity import Identity, read_private, write_private

_VERSION = 1
Key32 = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
ROLE_NAMES = {ConnectorRole.PRODUCER: "prefill", ConnectorRole.CONSUMER: "decode"}


@functools.lru_cache(maxsize=8)
def _private_key(secret: bytes) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(secret)


def role_names(roles: tuple[ConnectorRole, ...]) -> str:
    """'a prefill instance', 'a decode instance' or 'a prefill and decode instance'."""
    return "a " + " and ".join(ROLE_NAMES[r] for r in roles) + " instance"


def key_fingerprint(public_key: bytes) -> str:
    """16 hex digits naming an Ed25519 public key (a root's, in messages)."""
    return hashlib.blake2b(public_key, digest_size=8, person=b"kvbridge-root").hexdigest()


class Certificate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the root certifies of one instance."""

    roles: Annotated[tuple[ConnectorRole, ...], msgspec.Meta(min_length=1, max_length=2)]
    instance_id: Annotated[str, msgspec.Meta(max_length=256)]
    signing_key: Key32  # the instance's Ed25519 public key
    root: Key32  # the root's public key that signed this


class _Signed(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    v: int
    body: bytes
    sig: Annotated[bytes, msgspec.Meta(max_length=64)]


_msgpack = msgspec.msgpack.Encoder()
_signed = msgspec.msgpack.Decoder(_Signed)
_certificate = msgspec.msgpack.Decoder(Certificate)


def ed25519_verify(public_key: bytes, sig: bytes, body: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(sig, body)
    except (InvalidSignature, ValueError):
        return False
    return True


@functools.lru_cache(maxsize=256)  # a decode instance meets the same few prefills
def check_certificate(data: bytes, root: bytes | None) -> Certificate:
    """The certificate in `data` if the root with public key `root` signed it (None: any
    root, open mode); AuthError naming what is wrong otherwise."""
    try:
        env = _signed.decode(data)
        cert = _certificate.decode(env.body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AuthError(f"malformed certificate: {exc}") from None
    if env.v != _VERSION:
        raise AuthError(f"certificate version={env.v}; this side reads version {_VERSION}")
    if not ed25519_verify(cert.root, env.sig, env.body):
        raise AuthError(f"certificate of {cert.instance_id!r} is not signed by the root it names")
    if root is not None and cert.root != root:
        raise AuthError(
            f"certificate of {cert.instance_id!r} was made by root {key_fingerprint(cert.root)}, "
            f"not by this deployment's root {key_fingerprint(root)}: enroll the instance with "
            "the deployment's root key (kvbridge credential --root ...)"
        )
    return cert


def signed_by_prefill(
    certificate: bytes, sig: bytes, body: bytes, root: bytes | None, what: str
) -> Certificate:
    """The certificate of the prefill instance that signed `body` (a `what`: capability,
    Welcome), if `root` certified it (None: any root, open mode) for the prefill role and
    its key made `sig`; AuthError naming what is wrong otherwise. The caller checks the
    certificate's instance id is the one `body` speaks for."""
    cert = check_certificate(certificate, root)
    if ConnectorRole.PRODUCER not in cert.roles:
        raise AuthError(
            f"{what} signed by {cert.instance_id!r}, which is enrolled as "
            f"{role_names(cert.roles)}: only a prefill instance of the deployment signs one"
        )
    if not ed25519_verify(cert.signing_key, sig, body):
        raise AuthError(
            f"{what} signature is wrong: not signed by the key certified for {cert.instance_id!r}"
        )
    return cert


class Credential(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One instance's credential (a file of mode 600: `save`, `load`)."""

    v: int = _VERSION
    certificate: bytes  # signed by the root (`check_certificate`)
    curve_secret: bytes  # the instance's CURVE secret key (Z85; its `Identity`)
    signing_secret: Key32  # its Ed25519 secret key
    root: Key32  # the deployment root's public key: the certificates it trusts

    def __post_init__(self) -> None:
        if self.v != _VERSION:
            raise ConfigError(f"credential version={self.v}; this kvbridge reads {_VERSION}")

    @property
    def certified(self) -> Certificate:
        return check_certificate(self.certificate, self.root)

    @property
    def roles(self) -> tuple[ConnectorRole, ...]:
        return self.certified.roles

    @property
    def instance_id(self) -> str:
        return self.certified.instance_id

    @property
    def identity(self) -> Identity:
        return Identity(self.curve_secret)

    def sign(self, body: bytes) -> bytes:
        return _private_key(self.signing_secret).sign(body)

    def check_role(self, role: ConnectorRole, setting: str) -> None:
        """Refuse a credential not made for `role` (a misconfiguration)."""
        if role not in self.roles:
            raise ConfigError(
                f"{setting}: the credential of {self.instance_id!r} is for "
                f"{role_names(self.roles)}, not for a {ROLE_NAMES[role]} instance; make one "
                f"with kvbridge credential --role {ROLE_NAMES[role]}"
            )

    @classmethod
    def ephemeral(cls, role: ConnectorRole, instance_id: str) -> Credential:
        """A throwaway credential under a throwaway root (open mode: proves nothing)."""
        return RootKey.generate().certify((role,), instance_id, Identity.generate())

    @classmethod
    def load(cls, path: str | Path, setting: str = "credential_file") -> Credential:
        data = read_private(path, setting)
        try:
            cred = msgspec.json.decode(data, type=cls)
            cred.identity.check_id(cred.instance_id)  # (`instance_id` checks the certificate)
        except (msgspec.DecodeError, msgspec.ValidationError, AuthError, ConfigError) as exc:
            raise ConfigError(
                f"{setting}={str(path)!r} is not a kvbridge credential ({exc}); make one "
                "with kvbridge credential"
            ) from None
        return cred

    def save(self, path: str | Path) -> None:
        write_private(path, msgspec.json.encode(self) + b"\n")

    def packed(self) -> bytes:
        """As `ConnectorSpec.credential` carries it to the workers (`unpacked`)."""
        return _msgpack.encode(self)

    @classmethod
    def unpacked(cls, data: bytes) -> Credential | None:
        """The credential `packed` made (None for b"": none)."""
        return msgspec.msgpack.decode(data, type=cls) if data else None


class RootKey:
    """The deployment's root key: it enrolls instances. Only the operator holds it."""

    def __init__(self, secret: bytes) -> None:
        self._key = Ed25519PrivateKey.from_private_bytes(secret)

    @classmethod
    def generate(cls) -> RootKey:
        return cls(os.urandom(32))

    @classmethod
    def load(cls, path: str | Path, setting: str = "--root") -> RootKey:
        text = read_private(path, setting).strip()
        try:
            return cls(base64.b64decode(text, validate=True))
        except ValueError:
            raise ConfigError(
                f"{setting}={str(path)!r} is not a kvbridge root key (base64 of 32 bytes)"
            ) from None

    def save(self, path: str | Path) -> None:
        raw = self._key.private_bytes_raw()
        write_private(path, base64.b64encode(raw) + b"\n")

    @property
    def public(self) -> bytes:
        return self._key.public_key().public_bytes_raw()

    def enroll(self, roles: tuple[ConnectorRole, ...], name: str) -> Credential:
        """A new credential for instance `name` in `roles` (its id: ``name@FINGERPRINT``)."""
        identity = Identity.generate()
        return self.certify(roles, identity.bind(name), identity)

    def certify(
        self, roles: tuple[ConnectorRole, ...], instance_id: str, identity: Identity
    ) -> Credential:
        """A credential for `instance_id` in `roles`, holding `identity` and a new
        signing key."""
        signing = Ed25519PrivateKey.generate()
        public = signing.public_key().public_bytes_raw()
        cert = Certificate(tuple(roles), instance_id, public, self.public)
        body = _msgpack.encode(cert)
        return Credential(
            certificate=_msgpack.encode(_Signed(_VERSION, body, self._key.sign(body))),
            curve_secret=identity.secret,
            signing_secret=signing.private_bytes_raw(),
            root=self.public,
        )
