"""The test deployment's root key, and credentials it enrolls (`credential.py`)."""

from __future__ import annotations

from kvbridge.connector import ConnectorRole, Credential, Identity, RootKey

ROOT = RootKey.generate()


def enrolled(role: ConnectorRole, instance_id: str, root: RootKey = ROOT) -> Credential:
    """A credential `root` certified for `instance_id` in `role` (a new key pair)."""
    return root.certify((role,), instance_id, Identity.generate())
