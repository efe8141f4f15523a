"""The shared secret, for the layers above the connector: reading it (`load_token`),
whether an address is loopback (none needed), and keys and HMACs derived from it for
what is signed outside the KV plane (an instance's internal HTTP calls). The transfer
layer's own functions, so that one derivation serves both planes."""

from kvbridge.transfer.auth import derive, sign
from kvbridge.transfer.config import is_loopback, load_token

__all__ = ["derive", "is_loopback", "load_token", "sign"]
