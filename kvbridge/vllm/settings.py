"""The connector's settings: `kv_connector_extra_config`, checked once at start-up.

Every key is declared here once (`ConnectorSettings`); an unknown key or a bad value
is refused when vLLM builds the connector, naming the field, the value and what
would work, never at the first request. vLLM settings the connector cannot serve
are refused the same way (`check_vllm`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.transfer.config import TransferConfig, load_token

#: kv_role -> (runs a producer, runs a consumer)
ROLES = {
    "kv_producer": (True, False),
    "kv_consumer": (False, True),
    "kv_both": (True, True),
}


@dataclass(frozen=True)
class ConnectorSettings:
    """`kv_connector_extra_config` of a KVBridgeConnector (all optional).

    Attributes:
        instance_id: names this instance to its peers (default: vLLM's engine_id).
        host, advertise_host, base_port, lease_s, transfer_timeout_s,
        liveness_timeout_s, handshake_timeout_s: as `TransferConfig`.
        token_file: a file holding the shared token (else KVBRIDGE_TRANSFER_TOKEN or
            KVBRIDGE_TRANSFER_TOKEN_FILE); required unless the side channel is on loopback.
        claim_s: how long a pull capability stays valid after the prefill (seconds).
    """

    instance_id: str | None = None
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    base_port: int = 0
    token_file: str | None = None
    lease_s: float = 120.0
    transfer_timeout_s: float = 30.0
    liveness_timeout_s: float = 5.0
    handshake_timeout_s: float = 5.0
    claim_s: float = 120.0

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorSettings:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in extra.items():
            if key not in fields:
                raise ConfigError(
                    f"kv_connector_extra_config.{key}={value!r} is not a KVBridgeConnector "
                    f"setting; use any of {', '.join(fields)}"
                )
            want = fields[key].type
            if "float" in str(want) and not (
                isinstance(value, int | float) and not isinstance(value, bool) and value > 0
            ):
                raise ConfigError(
                    f"kv_connector_extra_config.{key}={value!r} must be a positive number "
                    "of seconds"
                )
            if "int" in str(want) and "float" not in str(want) and not isinstance(value, int):
                raise ConfigError(f"kv_connector_extra_config.{key}={value!r} must be an integer")
            if "str" in str(want) and value is not None and not isinstance(value, str):
                raise ConfigError(f"kv_connector_extra_config.{key}={value!r} must be a string")
        out = cls(**extra)
        out.transfer_config()  # refuse a bad host/port/token now
        return out

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(
            host=self.host,
            advertise_host=self.advertise_host,
            base_port=self.base_port,
            token=load_token(path=self.token_file),
            lease_s=self.lease_s,
            transfer_timeout_s=self.transfer_timeout_s,
            liveness_timeout_s=self.liveness_timeout_s,
            handshake_timeout_s=self.handshake_timeout_s,
        )


def check_vllm(vllm_config: Any) -> None:
    """Refuse vLLM settings the connector does not serve (field, value, what works)."""
    kv = vllm_config.kv_transfer_config
    if kv.kv_role not in ROLES:
        raise ConfigError(
            f"kv_transfer_config.kv_role={kv.kv_role!r} is not served by KVBridgeConnector; "
            f"use one of {', '.join(ROLES)}"
        )
    par = vllm_config.parallel_config
    checks = [
        ("parallel_config.pipeline_parallel_size", par.pipeline_parallel_size, 1),
        (
            "parallel_config.decode_context_parallel_size",
            getattr(par, "decode_context_parallel_size", 1),
            1,
        ),
        (
            "parallel_config.prefill_context_parallel_size",
            getattr(par, "prefill_context_parallel_size", 1),
            1,
        ),
    ]
    for field, value, ok in checks:
        if value != ok:
            raise ConfigError(
                f"{field}={value} is not supported by KVBridgeConnector yet; use {ok} "
                "(kvbridge's planner handles pp, this connector does not wire it up)"
            )
    if getattr(vllm_config.model_config, "use_mla", False):
        raise ConfigError(
            f"model {vllm_config.model_config.model!r} uses MLA, which KVBridgeConnector "
            "does not serve in vLLM yet; use a model with standard attention (MHA/GQA/MQA)"
        )
