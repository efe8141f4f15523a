"""A request's hand-over states, owned by the scheduler side of the KV connector.

    prefill instance:  PREFILLING --(first token, not finished)--> EXPOSED --> RELEASED
                       PREFILLING --(finished at its first token, or aborted)--> RELEASED
    decode instance:   WAITING_FOR_REMOTE_KV --(every worker's pull done)--> RUNNING
                       WAITING_FOR_REMOTE_KV --(pull failed or refused)--> RECOMPUTE | FAILED
                       (by the failure policy, `KVLoadFailure`)

RELEASED, RUNNING, RECOMPUTE and FAILED are final for the connector: once there, the
engine owns the request's blocks again (and frees them, in one place: its scheduler).
"""

from __future__ import annotations

import enum

from kvbridge.errors import KVBridgeError


class RequestState(enum.Enum):
    PREFILLING = "prefilling"  # the prompt is being computed; nothing exposed yet
    EXPOSED = "exposed"  # blocks pinned under a lease for one reader (capability issued)
    RELEASED = "released"  # pulled, lease expired, cancelled, declined, or never exposed
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks allocated, pull in flight
    RUNNING = "running"  # the pulled KV is in place: decoding
    RECOMPUTE = "recompute"  # the pull failed: the prompt is computed here
    FAILED = "failed"  # the pull failed and the policy is to fail the request

    @property
    def is_final(self) -> bool:
        return not TRANSITIONS[self]


#: Every allowed move; any other is a bug (`InvalidTransition`).
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.PREFILLING: frozenset({RequestState.EXPOSED, RequestState.RELEASED}),
    RequestState.EXPOSED: frozenset({RequestState.RELEASED}),
    RequestState.RELEASED: frozenset(),
    RequestState.WAITING_FOR_REMOTE_KV: frozenset(
        {RequestState.RUNNING, RequestState.RECOMPUTE, RequestState.FAILED}
    ),
    RequestState.RUNNING: frozenset(),
    RequestState.RECOMPUTE: frozenset(),
    RequestState.FAILED: frozenset(),
}


class KVLoadFailure(enum.Enum):
    """What a decode instance does when a request's KV cannot be pulled."""

    RECOMPUTE = "recompute"  # compute the prompt locally and answer correctly
    FAIL = "fail"  # answer an error


class ConnectorError(KVBridgeError):
    """The KV connector refused or failed something; the message says what and why."""


class InvalidTransition(ConnectorError):
    """A request was moved between two states the table does not connect (a bug)."""


class CapabilityRefused(ConnectorError):
    """A decode request's pull capability is not valid here (signature, reader, expiry,
    or it does not describe this request); nothing was pulled."""


def check_transition(request_id: str, old: RequestState, new: RequestState) -> None:
    if new not in TRANSITIONS[old]:
        allowed = ", ".join(s.name for s in TRANSITIONS[old]) or "none (final)"
        raise InvalidTransition(
            f"request {request_id!r}: {old.name} -> {new.name} is not a transition; "
            f"from {old.name}: {allowed}"
        )
