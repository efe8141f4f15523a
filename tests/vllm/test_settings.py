"""The connector's settings are refused at start-up with the field, the value and what works."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from kvbridge.connector import RootKey
from kvbridge.connector.settings import OWN_KEYS, SETTINGS, TRANSFER_KEYS, ConnectorSettings
from kvbridge.errors import ConfigError
from kvbridge.transfer.config import TransferConfig
from kvbridge.transfer.integrity import Integrity
from kvbridge.vllm.settings import ROLES, check_vllm, from_extra_config


def test_each_key_is_a_fields_declaration_with_its_default() -> None:
    """The keys are the settings' fields: TransferConfig's (all but the token, which a
    config names by its file) and the connector's own; a key left out takes the
    field's default."""
    fields = tuple(f.name for f in dataclasses.fields(TransferConfig) if f.name != "token")
    assert fields == TRANSFER_KEYS
    assert OWN_KEYS == ("instance_id", "token_file", "claim_s", "credential_file")
    assert [s.key for s in SETTINGS] == [*OWN_KEYS, *TRANSFER_KEYS]
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
            r"kv_connector_extra_config.lease=3 is not a KVBridgeConnector setting; use any of instance_id, token_file, claim_s, credential_file, host",
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


def test_a_credential_file_names_the_instance_and_its_roles(tmp_path) -> None:
    """`credential_file`: every process of the instance reads the same file, so they
    agree on its id (the credential's, bound to its key); each role's contract config
    carries it; a file others may read, or not a credential, or a token without one, is
    refused at start-up naming the setting."""
    root = RootKey.generate()
    cred = root.enroll(ROLES["kv_consumer"], "decode-a")
    path = tmp_path / "decode.credential"
    cred.save(path)
    s = from_extra_config({"credential_file": str(path)})
    assert s.credential == cred and s.bound_instance_id("engine-1") == cred.instance_id
    assert cred.instance_id.startswith("decode-a@")
    (config,) = s.configs(cred.instance_id, ROLES["kv_consumer"])
    assert config.root == root.public and config.credential == cred
    with pytest.raises(ConfigError, match="not for a prefill instance"):
        s.configs(cred.instance_id, ROLES["kv_both"])  # enrolled as a decode only
    with pytest.raises(ConfigError, match="the credential names this instance"):
        from_extra_config({"credential_file": str(path), "instance_id": "x"})
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    plain = from_extra_config({"token_file": str(token)})
    with pytest.raises(ConfigError, match="has a shared token but no credential"):
        plain.configs("engine-1", ROLES["kv_consumer"])
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=r"credential_file=.* may be read by others.*chmod 600"):
        from_extra_config({"credential_file": str(path)})
    bad = tmp_path / "bad.credential"
    bad.write_bytes(b"not a credential")
    bad.chmod(0o600)
    with pytest.raises(ConfigError, match=r"credential_file=.*not a kvbridge credential"):
        from_extra_config({"credential_file": str(bad)})


def test_vllm_settings_the_connector_does_not_serve_are_refused_at_start_up() -> None:
    """kv_role, context parallelism, an fp8 KV cache: refused naming the field, the value
    and what works (vLLM's config read by its attributes); MLA models and pipeline
    parallelism are served."""

    def vllm_config(kv_role: str = "kv_both", use_mla: bool = False, **parallel: int):
        sizes = {"pipeline_parallel_size": 1, "decode_context_parallel_size": 1} | parallel
        return SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_role=kv_role),
            parallel_config=SimpleNamespace(**sizes),
            model_config=SimpleNamespace(model="m", use_mla=use_mla),
        )

    check_vllm(vllm_config())
    check_vllm(vllm_config(use_mla=True))
    check_vllm(vllm_config(pipeline_parallel_size=2))
    with pytest.raises(ConfigError, match=r"kv_role='kv_none' .* use one of kv_producer, "):
        check_vllm(vllm_config("kv_none"))
    with pytest.raises(
        ConfigError, match=r"^parallel_config.decode_context_parallel_size=2 is not .* use 1"
    ):
        check_vllm(vllm_config(decode_context_parallel_size=2))
    with pytest.raises(ConfigError, match=r"^parallel_config.prefill_context_parallel_size=2 "):
        check_vllm(vllm_config(prefill_context_parallel_size=2))
    fp8 = vllm_config()
    fp8.cache_config = SimpleNamespace(cache_dtype="fp8")
    with pytest.raises(
        ConfigError,
        match=r"^cache_config.cache_dtype='fp8' \(--kv-cache-dtype\) is not served .* "
        r"use one of auto, float16, bfloat16$",
    ):
        check_vllm(fp8)
