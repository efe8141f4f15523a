"""The connector's settings: `kv_connector_extra_config`, checked once at start-up.

Every key is declared here once (`ConnectorSettings`); an unknown key or a bad value
is refused when vLLM builds the connector, naming the field, the value and what
would work, never at the first request. vLLM settings the connector cannot serve
are refused the same way (`check_vllm`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge.connector import (
    ConnectorRole,
    ConnectorSpec,
    Identity,
    KVConnectorConfig,
    TransferConfig,
    load_token,
)
from kvbridge.errors import ConfigError
from kvbridge.settings import from_mapping, setting, setting_of, settings

#: kv_role -> the hand-over roles the instance plays
ROLES = {
    "kv_producer": (ConnectorRole.PRODUCER,),
    "kv_consumer": (ConnectorRole.CONSUMER,),
    "kv_both": (ConnectorRole.PRODUCER, ConnectorRole.CONSUMER),
}


#: extra-config keys that are `TransferConfig`'s settings (the token comes from token_file)
TRANSFER_KEYS = tuple(str(s.key) for s in settings(TransferConfig) if s.key)
_TOKEN_ENV = setting_of(TransferConfig, "token").env
_WHERE = "kv_connector_extra_config"


@dataclass(frozen=True)
class ConnectorSettings:
    """`kv_connector_extra_config` of a KVBridgeConnector (every key optional).

    `transfer` is the runtime's settings: the extra config may set any of
    `TRANSFER_KEYS`, each declared and checked by `TransferConfig`. The other settings
    are the connector's own (`kvbridge.settings`), under the keys `OWN_KEYS`;
    docs/vllm.md's table of every key is rendered from both (`EXTRA_CONFIG`).
    `identity` is the key `identity_file` holds, read at start-up.
    """

    transfer: TransferConfig = field(default_factory=TransferConfig)
    instance_id: str | None = setting(
        None, default_text="vLLM's `engine_id`", help="names this instance to its peers"
    )
    token_file: str | None = setting(
        None,
        env=_TOKEN_ENV,
        help=f"a file holding the shared secret (else {_TOKEN_ENV[0]}, else the file named "
        f"by {_TOKEN_ENV[1]}), at least 16 bytes: the side channel is CURVE-encrypted, "
        "capabilities and notifications are signed; required unless `host` is loopback",
    )
    claim_s: float = setting(
        120.0, help="how long a pull capability stays valid after the prefill (seconds)"
    )
    identity_file: str | None = setting(
        None,
        help="a file (mode 600) holding this instance's own key (`Identity.save`; "
        "`kvbridge.vllm.launch` makes one per instance): the instance id becomes bound to "
        "it (`instance_id@fingerprint`), and with a token the prefill refuses anyone "
        "else's handshake in that name, and keeps room for its handshakes while a request "
        "names it; without it the id is unbound: any token holder may claim it, and its "
        "handshakes compete with everyone's for a prefill worker's shared pool of sessions",
    )
    identity: Identity | None = None

    def __post_init__(self) -> None:
        if not self.claim_s > 0:
            raise ConfigError(f"claim_s={self.claim_s!r} must be a positive number of seconds")
        object.__setattr__(self, "claim_s", float(self.claim_s))

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        values = from_mapping(extra, (cls, TransferConfig), _WHERE, "a KVBridgeConnector setting")
        own = values[cls]
        token = load_token(path=own.get("token_file"))
        path = own.get("identity_file")
        identity = Identity.load(path, f"{_WHERE}.identity_file") if path else None
        return cls(TransferConfig(**values[TransferConfig], token=token), **own, identity=identity)

    def configs(self, instance_id: str, roles: Iterable[ConnectorRole]) -> list[KVConnectorConfig]:
        """The hand-over contract's config of each role; a consumer's workers present
        the instance's own key (`identity`)."""
        secret = self.identity.secret.decode() if self.identity else ""

        def spec(role: ConnectorRole) -> ConnectorSpec:
            identity = secret if role is ConnectorRole.CONSUMER else ""
            return ConnectorSpec(role, instance_id, self.transfer, identity=identity)

        return [KVConnectorConfig(spec(role), claim_s=self.claim_s) for role in roles]


#: the connector's own extra-config keys (`ConnectorSettings`' settings)
OWN_KEYS = tuple(str(s.key) for s in settings(ConnectorSettings) if s.key)
#: every extra-config key, as docs/vllm.md's table lists them
EXTRA_CONFIG = [s for cls in (ConnectorSettings, TransferConfig) for s in settings(cls) if s.key]


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
    for name, value, ok in checks:
        if value != ok:
            raise ConfigError(
                f"{name}={value} is not supported by KVBridgeConnector yet; use {ok} "
                "(kvbridge's planner handles pp, this connector does not wire it up)"
            )
    if getattr(vllm_config.model_config, "use_mla", False):
        raise ConfigError(
            f"model {vllm_config.model_config.model!r} uses MLA, which KVBridgeConnector "
            "does not serve in vLLM yet; use a model with standard attention (MHA/GQA/MQA)"
        )
