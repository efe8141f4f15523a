"""Errors of the transfer layer (all `KVBridgeError`s)."""

from __future__ import annotations

from kvbridge.errors import KVBridgeError


class TransferError(KVBridgeError):
    """A transfer could not be set up or did not complete; the message says why."""


class ProtocolError(TransferError):
    """A side-channel message is malformed, oversized, of an unknown kind or version."""


class AuthError(ProtocolError):
    """A side-channel message lacks the shared token's HMAC, or carries a wrong one."""


class HandshakeError(TransferError):
    """A producer refused a handshake, or did not answer it in time."""
