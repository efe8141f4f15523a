"""A connector's settings as a config document names them: what a host that reads its
connector's configuration from a mapping (vLLM's `kv_connector_extra_config`) gives the
contract, one `KVConnectorConfig` per role (`ConnectorSettings.configs`).

Every key is declared once (`ConnectorSettings`' fields and `TransferConfig`'s); an
unknown key or a bad value is refused when the document is read
(`ConnectorSettings.from_mapping`), naming the key, the value and what would work,
never at the first request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge.connector.scheduler import KVConnectorConfig
from kvbridge.errors import ConfigError
from kvbridge.settings import from_mapping, setting, setting_of, settings
from kvbridge.transfer.config import TransferConfig, load_token
from kvbridge.transfer.connector import ConnectorRole, ConnectorSpec
from kvbridge.transfer.credential import Credential

#: document keys that are `TransferConfig`'s settings (the token comes from token_file)
TRANSFER_KEYS = tuple(str(s.key) for s in settings(TransferConfig) if s.key)
_TOKEN_ENV = setting_of(TransferConfig, "token").env


@dataclass(frozen=True)
class ConnectorSettings:
    """A connector's settings, as a config document names them (every key optional).

    `transfer` is the runtime's settings: the document may set any of `TRANSFER_KEYS`,
    each declared and checked by `TransferConfig`. The other settings are the
    connector's own (`kvbridge.settings`), under the keys `OWN_KEYS`; `SETTINGS` lists
    both, as docs/vllm.md's table shows them. `credential` is what `credential_file`
    holds, read with the document.
    """

    transfer: TransferConfig = field(default_factory=TransferConfig)
    instance_id: str | None = setting(
        None,
        default_text="the host's engine id (vLLM's `engine_id`)",
        help="names this instance to its peers",
    )
    token_file: str | None = setting(
        None,
        env=_TOKEN_ENV,
        help=f"a file holding the shared secret (else {_TOKEN_ENV[0]}, else the file named "
        f"by {_TOKEN_ENV[1]}), at least 16 bytes: the side channel is CURVE-encrypted, "
        "notifications are signed; required unless `host` is loopback (with `credential_file`)",
    )
    claim_s: float = setting(
        120.0, help="how long a pull capability stays valid after the prefill (seconds)"
    )
    credential_file: str | None = setting(
        None,
        help="this instance's role credential (mode 600), made with `kvbridge credential "
        "--root ROOT --role prefill|decode|both --name NAME --out FILE` "
        "(`kvbridge.vllm.launch` makes one per instance): it names the instance "
        "(`NAME@fingerprint` of its own key, which only it can present), a prefill signs "
        "its pull capabilities with it, and a decode takes only capabilities of prefill "
        "instances the same root enrolled. Required with a token",
    )
    credential: Credential | None = None

    def __post_init__(self) -> None:
        if not self.claim_s > 0:
            raise ConfigError(f"claim_s={self.claim_s!r} must be a positive number of seconds")
        object.__setattr__(self, "claim_s", float(self.claim_s))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str, what: str) -> ConnectorSettings:
        """The settings a config document names (`where`: its name in refusals; `what`:
        whose settings its keys are), every file it names read now."""
        document = from_mapping(values, (cls, TransferConfig), where, what)
        own = document[cls]
        token = load_token(path=own.get("token_file"))
        path = own.get("credential_file")
        credential = Credential.load(path, f"{where}.credential_file") if path else None
        if credential is not None and own.get("instance_id") is not None:
            raise ConfigError(
                f"{where}.instance_id={own['instance_id']!r}: the credential names this "
                f"instance ({credential.instance_id!r}); leave instance_id out"
            )
        return cls(
            TransferConfig(**document[TransferConfig], token=token), **own, credential=credential
        )

    def bound_instance_id(self, engine_id: str) -> str:
        """This instance's id: its credential's (every process reads the same file: all
        agree), else `instance_id`, else the host's own (`engine_id`)."""
        if self.credential is not None:
            return self.credential.instance_id
        return self.instance_id or engine_id

    def configs(self, instance_id: str, roles: Iterable[ConnectorRole]) -> list[KVConnectorConfig]:
        """The hand-over contract's config of each role, each carrying the instance's
        credential (its workers present the key it holds)."""
        packed = self.credential.packed() if self.credential is not None else b""
        return [
            KVConnectorConfig(
                ConnectorSpec(role, instance_id, self.transfer, credential=packed),
                claim_s=self.claim_s,
            )
            for role in roles
        ]


#: the connector's own document keys (`ConnectorSettings`' settings)
OWN_KEYS = tuple(str(s.key) for s in settings(ConnectorSettings) if s.key)
#: every document key's setting, the connector's own first
SETTINGS = [s for cls in (ConnectorSettings, TransferConfig) for s in settings(cls) if s.key]
