"""HMAC authentication of side-channel messages and notifications with a shared token.

Authentication, not secrecy: bodies are sent in the clear, so a token stops a
stranger from handshaking (and learning region addresses) or forging completion
notifications, while anyone on the path can still read the bytes.
"""

from __future__ import annotations

import hashlib
import hmac


def sign(token: bytes | None, body: bytes) -> bytes:
    """HMAC-SHA256 of `body` under `token`, or b"" when no token is configured."""
    if token is None:
        return b""
    return hmac.new(token, body, hashlib.sha256).digest()


def verify(token: bytes, body: bytes, mac: bytes) -> bool:
    """True iff `mac` is `body`'s HMAC under `token` (constant-time comparison)."""
    return hmac.compare_digest(sign(token, body), mac)
