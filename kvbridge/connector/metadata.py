"""What crosses between the connector's scheduler side (the driver) and its worker side
(every worker process): typed msgspec structs, never pickles.

    driver ── ConnectorMetadata (per step: pulls, exposes, cancels, ...) ──▶ each worker
    driver ◀── KVWorkerOutput (finished sending / receiving, with reasons) ── each worker

`KVTransferParams` is a request's hand-over record (vLLM's `kv_transfer_params`):
`RemoteDecode` asks a prefill instance to expose a request's KV for a reader;
`RemotePrefill` is the prefill instance's answer, which a decode instance is given to
pull the KV (the signed capability and the first token). `encode_transfer_params` and
`decode_transfer_params` write and read them as vLLM's JSON dict, in vLLM's P/D keys
(`do_remote_decode`, `do_remote_prefill`, `remote_engine_id`, `remote_request_id`) and
kvbridge's own (`CAPABILITY_KEY`, `READER_KEY`).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from kvbridge.transfer.connector import Cancel, Connect, ConnectorEvent, Decline, Expose, Pull

_Name = Annotated[str, msgspec.Meta(max_length=256)]


class RemoteDecode(msgspec.Struct, frozen=True, tag="remote_decode"):
    """Prefill side: expose this request's KV for the decode instance `reader`, which
    holds the prompt's first `start_token` tokens already (its prefix cache)."""

    reader: _Name = ""
    start_token: int = 0


class RemotePrefill(msgspec.Struct, frozen=True, tag="remote_prefill"):
    """Decode side: pull the request's KV with `capability` (signed by the prefill
    instance `instance_id`); `first_token_id` is the token the prefill sampled (None
    where the host samples it again, as vLLM does). `request_id` is the request's id
    at the prefill instance, which its capability names ("": the same id as here). An
    empty capability means there is no KV to pull (the failure policy applies)."""

    first_token_id: int | None = None
    capability: Annotated[bytes, msgspec.Meta(max_length=1 << 24)] = b""
    instance_id: _Name = ""
    request_id: _Name = ""


KVTransferParams = RemoteDecode | RemotePrefill

#: kv_transfer_params key carrying the capability (base64 of its signed bytes)
CAPABILITY_KEY = "kvbridge_capability"
#: kv_transfer_params key a proxy may set on the prefill request: the decode instance
#: id that alone may pull it (without it, any holder of the token may)
READER_KEY = "kvbridge_reader"


def encode_transfer_params(params: KVTransferParams, request_id: str = "") -> dict[str, Any]:
    """`params` as `kv_transfer_params`: a `RemoteDecode` as a proxy sends it to a prefill
    instance (its reader; the prefill exposes the whole prompt), a `RemotePrefill` as
    the prefill instance answers it for the request `request_id` there (no first
    token: vLLM samples it again)."""
    if isinstance(params, RemoteDecode):
        return {"do_remote_decode": True} | ({READER_KEY: params.reader} if params.reader else {})
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        CAPABILITY_KEY: base64.b64encode(params.capability).decode(),
        "remote_engine_id": params.instance_id,
        "remote_request_id": params.request_id or request_id,
    }


def decode_transfer_params(params: Mapping[str, Any]) -> KVTransferParams | None:
    """The hand-over `kv_transfer_params` ask for (`encode_transfer_params`); None for
    none (a decode request computing its prompt: `do_remote_prefill` false).
    ValueError (binascii.Error) for a capability that is not base64."""
    if params.get("do_remote_decode"):
        return RemoteDecode(params.get(READER_KEY) or "")
    if params.get("do_remote_prefill") and CAPABILITY_KEY in params:
        return RemotePrefill(
            capability=base64.b64decode(params[CAPABILITY_KEY], validate=True),
            instance_id=str(params.get("remote_engine_id") or ""),
            request_id=str(params.get("remote_request_id") or ""),
        )
    return None


class ConnectorMetadata(msgspec.Struct, frozen=True):
    """One step's orders from the scheduler side to every worker (vLLM's
    `KVConnectorMetadata`). Empty lists: nothing to do but progress and report."""

    reqs_to_recv: list[Pull] = msgspec.field(default_factory=list)
    #: the host's id of each pull in `reqs_to_recv` (same order): a pull's own
    #: `request_id` is the prefill instance's, the workers report the host's
    recv_request_ids: list[str] = msgspec.field(default_factory=list)
    reqs_to_send: list[Expose] = msgspec.field(default_factory=list)
    #: the host's id of each exposure in `reqs_to_send` (same order): a request of
    #: several cache groups is exposed once per group (`transfer_id`)
    send_request_ids: list[str] = msgspec.field(default_factory=list)
    reqs_to_cancel: list[Cancel] = msgspec.field(default_factory=list)
    reqs_to_decline: list[Decline] = msgspec.field(default_factory=list)
    peers_to_connect: list[Connect] = msgspec.field(default_factory=list)
    #: producer workers: every worker's side channel of this instance, in rank order
    worker_endpoints: list[str] | None = None
    #: consumer workers: every worker's `sibling` (base64) of this instance, rank order
    siblings: list[str] | None = None
    #: consumer workers: after starting `reqs_to_recv`, wait up to this many seconds for
    #: them to end before reporting (the host would rather start its next step with
    #: them than without); 0: report at once
    recv_wait_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 0.0
    #: a step with nothing to compute: a worker with transfers in flight and nothing to
    #: report yet may wait up to this many seconds for one to end before it reports (a
    #: host that keeps stepping while transfers run sleeps on them, not spins); 0: never
    idle_wait_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 0.0

    def pulls(self) -> list[tuple[str, Pull]]:
        """`reqs_to_recv` with the host's id of each (`recv_request_ids`; without them,
        the host names a request as the prefill instance does)."""
        ids = self.recv_request_ids or [p.request_id for p in self.reqs_to_recv]
        return list(zip(ids, self.reqs_to_recv, strict=True))

    def sends(self) -> list[tuple[str, Expose]]:
        """`reqs_to_send` with the host's id of each (`send_request_ids`; without them,
        the exposure's own)."""
        ids = self.send_request_ids or [e.request_id for e in self.reqs_to_send]
        return list(zip(ids, self.reqs_to_send, strict=True))

    @property
    def is_empty(self) -> bool:
        return not (
            self.reqs_to_recv
            or self.reqs_to_send
            or self.reqs_to_cancel
            or self.reqs_to_decline
            or self.peers_to_connect
            or self.worker_endpoints is not None
            or self.siblings is not None
        )


class KVWorkerOutput(msgspec.Struct, frozen=True):
    """One worker's report after a step (vLLM's `KVConnectorOutput`): the requests whose
    sending (blocks released: `ok` when pulled) or receiving (pull DONE or FAILED)
    finished on this worker since its last report."""

    finished_sending: list[ConnectorEvent] = msgspec.field(default_factory=list)
    finished_recving: list[ConnectorEvent] = msgspec.field(default_factory=list)
    pinned_blocks: int = 0  # producer: blocks pinned; consumer: blocks being pulled into
    replays_refused: int = 0  # producer: forged, replayed or misdirected messages so far
    error: str = ""  # a connector error on this worker (the orders were not all carried out)
    #: consumer: introduced producer endpoints (`peers_to_connect`) this worker has met
    connected: list[str] = msgspec.field(default_factory=list)


metadata_decoder = msgspec.msgpack.Decoder(ConnectorMetadata)
output_decoder = msgspec.msgpack.Decoder(KVWorkerOutput)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: ConnectorMetadata | KVWorkerOutput) -> bytes:
    return _encoder.encode(msg)
