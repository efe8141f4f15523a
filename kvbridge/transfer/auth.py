"""Keys of the KV plane, all derived from one shared token (or none).

With a shared token (`--kv-token-file` / KVBRIDGE_TRANSFER_TOKEN):
  * the side channel is private and authenticated: ZMQ CURVE with the server keypair
    derived from the token (`curve_server_secret`), so only token holders can complete
    the encrypted handshake, and every message also carries an HMAC over its body;
  * each handshake makes a *session* between one decode worker and one prefill worker:
    a fresh nonce from each side, and a session key derived from the token, both nonces
    and both parties' identities (`session_key`). It never crosses the network. The
    completion notifications (`ReadDone`, sent over NIXL, not the side channel) are
    signed with it and name their receiver, so they cannot be forged, moved to another
    worker, or replayed into another session.
  * capabilities (`capability.py`) are not: a prefill instance signs them with its own
    key, which the deployment's root certified (`credential.py`).

Without a token (loopback only) the same derivations run on a fixed public key:
messages are checked for integrity and bound to their session, but anyone who can
reach the side channel can handshake.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

#: The key that stands in for a missing token (open mode, loopback only).
OPEN_KEY = b"kvbridge open mode: no shared token"


def sign(token: bytes | None, body: bytes) -> bytes:
    """HMAC-SHA256 of `body` under `token`, or b"" when no token is configured."""
    if token is None:
        return b""
    return hmac.new(token, body, hashlib.sha256).digest()


def verify(token: bytes, body: bytes, mac: bytes) -> bool:
    """True iff `mac` is `body`'s HMAC under `token` (constant-time comparison)."""
    return hmac.compare_digest(sign(token, body), mac)


def derive(token: bytes | None, label: str, *parts: object) -> bytes:
    """A 32-byte key for `label` and `parts` (msgpack-encoded), from `token`."""
    data = label.encode() + b"\0" + msgspec.msgpack.encode(list(parts))
    return hmac.new(token or OPEN_KEY, data, hashlib.sha256).digest()


def session_key(
    token: bytes | None,
    hello_nonce: bytes,
    welcome_nonce: bytes,
    decode: tuple[str, int],
    prefill: tuple[str, int],
) -> bytes:
    """The key of one handshake between decode worker `decode` and prefill worker
    `prefill` ((instance id, rank) each): fresh on both sides, known only to the two
    workers (and, without a token, to whoever saw the handshake)."""
    return derive(token, "kvbridge session v2", hello_nonce, welcome_nonce, *decode, *prefill)


def session_id(key: bytes) -> bytes:
    """The public name of a session (sent in the clear; reveals nothing of the key)."""
    return hashlib.sha256(b"kvbridge session id\0" + key).digest()[:16]


def curve_server_secret(token: bytes) -> bytes:
    """The raw 32-byte CURVE secret key of every producer's side channel, from `token`."""
    return derive(token, "kvbridge curve server v2")
