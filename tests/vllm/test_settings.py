"""The connector's settings are refused at start-up with the field, the value and what works."""

from __future__ import annotations

import dataclasses

import pytest

from kvbridge.connector.settings import OWN_KEYS, TRANSFER_KEYS, ConnectorSettings
from kvbridge.errors import ConfigError
from kvbridge.transfer.config import TransferConfig
from kvbridge.transfer.identity import Identity
from kvbridge.transfer.integrity import Integrity
from kvbridge.vllm.settings import EXTRA_CONFIG, from_extra_config


def test_each_key_is_a_fields_declaration_with_its_default() -> None:
    """The keys are the settings' fields: TransferConfig's (all but the token, which a
    config names by its file) and the connector's own; a key left out takes the
    field's default."""
    fields = tuple(f.name for f in dataclasses.fields(TransferConfig) if f.name != "token")
    assert fields == TRANSFER_KEYS
    assert OWN_KEYS == ("instance_id", "token_file", "claim_s", "identity_file")
    assert [s.key for s in EXTRA_CONFIG] == [*OWN_KEYS, *TRANSFER_KEYS]
    empty = from_extra_config({})
    assert empty == ConnectorSettings() and empty.transfer == TransferConfig()
    assert empty.claim_s == ConnectorSettings.claim_s == 120.0


def test_transfer_keys_reach_the_runtime_config() -> None:
    s = from_extra_config({"lease_s": 300, "base_port": 7000, "claim_s": 60})
    assert (s.transfer.lease_s, s.transfer.base_port, s.claim_s) == (300, 7000, 60.0)
    # a JSON config names the integrity mode: the runtime gets the mode itself
    assert from_extra_config({"integrity": "on"}).transfer.integrity is (Integrity.ON)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (
            {"lease": 3},
            r"kv_connector_extra_config.lease=3 is not a KVBridgeConnector setting; use any of instance_id, token_file, claim_s, identity_file, host",
        ),
        ({"lease_s": 0}, r"lease_s=0 must be a positive number of seconds"),
        ({"claim_s": "x"}, r"kv_connector_extra_config.claim_s='x' must be a number"),
        ({"claim_s": 0}, r"claim_s=0 must be a positive number of seconds"),
        ({"lease_s": "x"}, r"kv_connector_extra_config.lease_s='x' must be a number"),
        ({"token_file": 3}, r"kv_connector_extra_config.token_file=3 must be a string"),
        ({"host": "0.0.0.0"}, r"binds every interface"),
        ({"host": "10.0.0.1", "advertise_host": "10.0.0.1"}, r"needs a shared secret"),
        ({"instance_id": 3}, r"instance_id=3 must be a string"),
        ({"integrity": "maybe"}, r"integrity='maybe' is not a KV integrity mode; use on, off"),
        ({"kv_export": "elsewhere"}, r"kv_export='elsewhere' is not a KV export mode; use"),
    ],
)
def test_bad_settings_are_refused_with_what_works(extra: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        from_extra_config(extra)


def test_an_identity_file_binds_the_instance_id_to_its_key(tmp_path) -> None:
    """`identity_file` (issue #21 item 3): every process of the instance reads the same
    key, so they agree on the bound id; a file others may read, or not a key, is refused
    at start-up naming the setting."""
    key = Identity.generate()
    path = tmp_path / "decode.key"
    key.save(path)
    s = from_extra_config({"identity_file": str(path)})
    assert s.identity == key and s.identity.bind("engine-1") == key.bind("engine-1")
    assert key.bind("engine-1").startswith("engine-1@")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=r"identity_file=.* may be read by others.*chmod 600"):
        from_extra_config({"identity_file": str(path)})
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not a key")
    bad.chmod(0o600)
    with pytest.raises(ConfigError, match=r"identity_file=.*not a CURVE secret key"):
        from_extra_config({"identity_file": str(bad)})
