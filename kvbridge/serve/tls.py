"""TLS of the internal HTTP between the proxy and the instances.

Internal calls carry prompts, token ids and completions. An instance whose HTTP server
binds an address other hosts can reach serves it over HTTPS; on loopback it stays plain
HTTP (nothing leaves the host). Its certificate is either

- the one the operator gives (`--tls-cert`, `--tls-key`), which the proxy checks against
  `--tls-ca` with the usual host-name check; or, by default,
- one the instance makes at start-up for a fresh key (Ed25519), signed by the
  deployment's certificate authority: a key derived from the shared token, so every
  host holding the token derives the same CA certificate (Ed25519 signatures are
  deterministic) and nobody without the token can sign for it. The proxy trusts that CA
  and checks the chain, not the host name (any token holder may sign; the name adds
  nothing then): a sniffer on the path sees no prompt, and someone in the path without
  the token cannot pose as an instance.

The instance's key is written, 0600, to a private directory only while uvicorn loads it,
and removed before the server answers its first call.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Iterator, Sequence
from functools import lru_cache

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvbridge.connector.security import derive
from kvbridge.errors import ConfigError

#: The deployment CA's validity: fixed, so that every host derives the same certificate.
_CA_FROM = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
_CA_UNTIL = datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC)
#: An instance certificate's validity around its start (clocks of other hosts differ).
_SKEW = datetime.timedelta(days=1)
_LIFETIME = datetime.timedelta(days=3650)


@lru_cache(maxsize=8)
def _deployment_ca(token: bytes) -> tuple[Ed25519PrivateKey, x509.Certificate]:
    key = Ed25519PrivateKey.from_private_bytes(derive(token, "kvbridge tls ca v1"))
    label = derive(token, "kvbridge tls ca name v1").hex()[:16]
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvbridge deployment {label}")])
    serial = int.from_bytes(derive(token, "kvbridge tls ca serial v1")[:16], "big") >> 1
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(serial or 1)
        .not_valid_before(_CA_FROM)
        .not_valid_after(_CA_UNTIL)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, None)
    )
    return key, cert


def deployment_ca_pem(token: bytes) -> bytes:
    """The deployment CA's certificate (PEM): the same bytes from the same token."""
    return _deployment_ca(token)[1].public_bytes(serialization.Encoding.PEM)


def _subject_names(names: Sequence[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for name in dict.fromkeys(n for n in names if n and n not in ("0.0.0.0", "::")):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def issue(token: bytes, names: Sequence[str]) -> tuple[bytes, bytes]:
    """(certificate, private key), PEM: a fresh key certified by the deployment CA for
    `names` (addresses or host names; wildcard addresses are left out)."""
    ca_key, ca_cert = _deployment_ca(token)
    key = Ed25519PrivateKey.generate()
    now = datetime.datetime.now(datetime.UTC)
    sans = _subject_names(names)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvbridge instance")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(now + _LIFETIME)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, None)
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


@contextlib.contextmanager
def server_files(
    token: bytes | None, cert: str | None, key: str | None, names: Sequence[str]
) -> Iterator[tuple[str, str]]:
    """(certificate file, key file) for an HTTPS server: the operator's, or a pair
    `issue` made, in a private directory removed when the block ends (load them inside)."""
    if cert is not None and key is not None:
        yield cert, key
        return
    if token is None:
        raise ConfigError(
            "HTTPS needs --tls-cert and --tls-key, or a shared token (--kv-token-file) to "
            "certify the instance with the deployment's CA"
        )
    cert_pem, key_pem = issue(token, names)
    with tempfile.TemporaryDirectory(prefix="kvbridge-tls-") as tmp:
        paths = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        for path, data in zip(paths, (cert_pem, key_pem), strict=True):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(data)
        yield paths


def check_server_files(cert: str | None, key: str | None) -> None:
    """Refuse at start-up a certificate without its key (or the reverse), or a pair
    that does not load."""
    if (cert is None) != (key is None):
        given, missing = ("--tls-cert", "--tls-key") if key is None else ("--tls-key", "--tls-cert")
        raise ConfigError(f"{given} needs {missing} too (the certificate and its private key)")
    if cert is None or key is None:
        return
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"--tls-cert {cert} --tls-key {key}: {exc}; give a PEM certificate and the "
            "private key it certifies"
        ) from None


def client_context(token: bytes | None, ca: str | None = None) -> ssl.SSLContext:
    """How the proxy (or a test) checks an instance's HTTPS: against `ca` (a PEM bundle,
    `--tls-ca`) with host names, else against the deployment CA of `token` (chain only),
    else against the system's CAs."""
    if ca is not None:
        try:
            return ssl.create_default_context(cafile=ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"--tls-ca {ca}: {exc}; give the PEM certificates that signed the "
                "instances' --tls-cert"
            ) from None
    if token is None:
        return ssl.create_default_context()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False  # any token holder may sign: the chain is the proof
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=deployment_ca_pem(token).decode())
    return ctx
