"""The pipe protocol between a parent and its transfer worker processes.

Commands go parent -> worker, events worker -> parent, each one msgspec-encoded
frame (`send_bytes`), never pickle. `WorkerSpec` is what a worker is started with.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import msgspec
import numpy as np

from kvbridge.plan.verifier import RequestSpan
from kvbridge.transfer.config import TransferConfig
from kvbridge.transfer.messages import LayoutWire, ModelWire


class Span(msgspec.Struct, frozen=True, array_like=True):
    block_ids: list[int]  # every block of the request, in token order
    num_tokens: int
    key: int
    start_token: int = 0  # a partial pull moves tokens [start_token, num_tokens) only
    read_end: int = 0  # a decode's: slots [num_tokens, read_end) were read as zeros

    def to_request(self) -> RequestSpan:
        ids = np.asarray(self.block_ids, dtype=np.int64)
        return RequestSpan(ids, self.num_tokens, self.key, self.start_token, self.read_end)

    def blocks_from(self, block_size: int) -> list[int]:
        """The blocks holding tokens [start_token, num_tokens)."""
        return self.block_ids[self.start_token // block_size :]


class WorkerSpec(msgspec.Struct, frozen=True):
    role: str  # "prefill" or "decode"
    model: ModelWire
    layout: LayoutWire
    rank: int
    num_blocks: int
    instance_id: str
    salt: int
    fill: list[Span] = []  # prefill: requests whose tokens the cache holds
    host: str = "127.0.0.1"
    base_port: int = 0
    token: bytes | None = None
    lease_s: float = TransferConfig.lease_s
    transfer_timeout_s: float = TransferConfig.transfer_timeout_s
    handshake_timeout_s: float = TransferConfig.handshake_timeout_s
    liveness_timeout_s: float = TransferConfig.liveness_timeout_s
    backend_params: dict[str, str] = {}
    scratch_bytes: int = 0  # benchmarks: a registered contiguous buffer of this size
    pattern: bool = True  # False (benchmarks): skip the verifiable fill, no Verify
    max_units: int = 1 << 22  # TransferConfig.max_units (tests force the exact-list path)
    #: `Integrity` value: the harness checks every pull's digests unless told otherwise
    integrity: str = "on"
    #: "process": a prefill worker's cache and scratch lie in shared memory, read by
    #: peers from an export process (`kvbridge.transfer.export`); "inline": its own agent
    kv_export: str = "inline"
    #: `FanOut` value: the harness's decode workers fan out only when told (one host)
    fan_out: str = "off"
    #: where the cache lies: "" host memory (a numpy array); a torch device ("cuda:0",
    #: "cpu") a torch tensor on it, registered as that device's memory (`memory_of`)
    device: str = ""
    netns: str = ""  # run on this test host (harness.hosts): its network namespace
    hostname: str = ""  # ... under this hostname, in UTS and IPC namespaces ...
    host_pid: int = 0  # ... those of this process (`TestHost.holder_pid`), 0: its own
    #: decode: the instance's own CURVE secret key (`Identity.secret`), for an
    #: `instance_id` bound to it; None: an unbound id and an ephemeral key per connection
    identity: bytes | None = None


# -- parent -> worker ----------------------------------------------------------------
class SetEndpoints(msgspec.Struct, tag=True):
    endpoints: list[str]


class SetSiblings(msgspec.Struct, tag=True):
    """Decode workers: every worker's `Ready.sibling` of their instance, rank order."""

    siblings: list[bytes]


class Expose(msgspec.Struct, tag=True):
    request_id: str
    block_ids: list[int]
    num_tokens: int
    start_token: int = 0
    generation: int = 0
    lease_s: float | None = None  # None: the worker's lease_s
    reader: str | None = None  # the only decode instance whose notifications count


class Pull(msgspec.Struct, tag=True):
    request_id: str
    endpoint: str
    producer_block_ids: list[int]
    local_block_ids: list[int]
    num_tokens: int
    start_token: int = 0
    generation: int = 0


class Verify(msgspec.Struct, tag=True):
    requests: list[Span]


class Status(msgspec.Struct, tag=True):
    pass


class Stop(msgspec.Struct, tag=True):
    pass


class RawRead(msgspec.Struct, tag=True):
    """Benchmark baseline: one single-descriptor READ of `nbytes` from a peer's scratch
    buffer into ours (the peer must already be known, i.e. handshaked); with `write`,
    a WRITE of ours into the peer's instead."""

    agent_name: str
    remote_addr: int
    nbytes: int
    write: bool = False


Command = SetEndpoints | SetSiblings | Expose | Pull | Verify | Status | Stop | RawRead


# -- worker -> parent ----------------------------------------------------------------
class Ready(msgspec.Struct, tag=True):
    rank: int
    endpoint: str
    pid: int
    agent_name: str
    scratch_addr: int
    sibling: bytes = b""  # decode: what its instance's other workers need (`KVConsumer.sibling`)


class Released(msgspec.Struct, tag=True):
    rank: int
    request_id: str
    cause: str
    reason: str
    num_blocks: int


class Finished(msgspec.Struct, tag=True):
    rank: int
    request_id: str
    state: str
    reason: str
    local_block_ids: list[int]
    nbytes: int
    num_descriptors: int
    num_unmerged: int
    num_indices: int
    failure: str = ""  # `PullFailure` value of a failed pull that has one
    local_nbytes: int = 0  # copied from a sibling's cache (a fan-out)
    checked: bool = False  # its bytes were checked against the producers' digests
    phases: dict[str, float] = {}  # `PullPhases`' fields: where its time went
    fenced: int = 0  # producer workers whose fence word confirmed it (`fence.py`)


class Verified(msgspec.Struct, tag=True):
    rank: int
    ok: bool
    detail: str


class StatusReply(msgspec.Struct, tag=True):
    rank: int
    held_blocks: int
    refusals: list[str]
    rejected: int


class Failed(msgspec.Struct, tag=True):
    rank: int
    error: str


class RawDone(msgspec.Struct, tag=True):
    rank: int
    state: str
    seconds: float


Event = Ready | Released | Finished | Verified | StatusReply | Failed | RawDone

_enc = msgspec.msgpack.Encoder()
cmd_decoder: msgspec.msgpack.Decoder[Command] = msgspec.msgpack.Decoder(Command)
event_decoder = msgspec.msgpack.Decoder(Event)


def send(conn: Connection, msg: msgspec.Struct) -> None:
    conn.send_bytes(_enc.encode(msg))


def recv_event(conn: Connection) -> Event:
    return event_decoder.decode(conn.recv_bytes())
