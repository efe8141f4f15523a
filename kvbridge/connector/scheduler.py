"""The scheduler side of the KV connector: in the driver, next to the engine's scheduler.

Shaped like vLLM's `KVConnectorBase_V1` scheduler role, and knowing nothing of any
engine's classes (request ids, token counts and block ids only), so that our engine and
vLLM host the same connector. The host calls it where vLLM's scheduler calls its
connector:

    add_request                    a request with `kv_transfer_params` arrives
                                   (decode: its capability is checked here; 403-worthy
                                   `CapabilityRefused` if it is not valid for us)
    get_num_new_matched_tokens     decode: how many prompt tokens come from the remote
                                   instance after the local prefix-cache hit
    update_state_after_alloc       decode: the blocks allocated for them: pull into them
    build_connector_meta           every step: the orders for the workers
    update_connector_output        the workers' reports: requests whose hand-over ended
    request_finished               a request finished: (delay_free_blocks,
                                   kv_transfer_params); prefill: expose and issue the
                                   capability; decode: an abort while pulling waits
    cancel / load_refused / connect   release an exposure nobody took; refuse a pull
                                   (decline, then the failure policy); meet a producer

Each request is in one `RequestState` (states.py); a request whose hand-over ended is
returned by `update_connector_output` (or reported by the call that ended it) so the
host frees or uses its blocks: the connector never frees a block itself.

Cache groups: a host whose layers keep their blocks in several block tables (a hybrid
model: sliding-window layers and full-attention ones, each group with its own blocks
from one pool) passes a request's blocks as one `BlockTable` per group, each from the
first block the group still holds; a host with one table passes its block ids. Each
group moves as a transfer of its own (`transfer_id`): tokens [start, num_tokens), start
past the decode's prefix hit and past the first token either side's group still holds
(a window's older blocks are freed on both sides). The workers report a request once
its groups all ended (`KVConnectorWorker`).

State groups (`state_groups`: an SSM layer's conv and SSM state, vLLM's Mamba groups)
hold one state per request, no token axis: a request's last block in such a group (its
running state) moves whole, as that block's tokens [0, block_size), so both instances
must page it alike (the same block_size and tp_size). A state cannot be rewound: the
decode recomputes the prompt's last token (it needs its logits), so it must start from
the state after the others. The producer host therefore computes the prompt less its
last token and names that prefix (`add_request`); a consumer with state groups takes a
capability for its prompt less its last token, digest and all, and pulls those tokens.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from kvbridge.connector.metadata import (
    ConnectorMetadata,
    KVTransferParams,
    KVWorkerOutput,
    RemoteDecode,
    RemotePrefill,
)
from kvbridge.connector.states import (
    CapabilityRefused,
    ConnectorError,
    KVLoadFailure,
    RequestState,
    check_transition,
)
from kvbridge.errors import ConfigError
from kvbridge.settings import DEFAULT_CLAIM_S
from kvbridge.transfer.capability import (
    BlockTable,
    Capability,
    CapabilityExpired,
    Redeemed,
    issue,
    new_generation,
    prompt_digest,
    transfer_id,
)
from kvbridge.transfer.capability import check as check_capability
from kvbridge.transfer.connector import (
    Cancel,
    Connect,
    ConnectorEvent,
    ConnectorRole,
    ConnectorSpec,
    Decline,
    Expose,
    Pull,
)
from kvbridge.transfer.credential import ROLE_NAMES, Credential
from kvbridge.transfer.errors import AuthError

#: How long the host polls at the busy cadence after an introduction or a decline (their
#: handshakes and notifications progress only while the workers poll).
CONNECT_POLL_S = 30.0

#: A request's blocks as a host gives them: its block ids (one block table), or one
#: `BlockTable` per cache group
BlockIds = Sequence[int] | Sequence[BlockTable]


def block_tables(block_ids: BlockIds) -> list[BlockTable]:
    """`block_ids` as one table per cache group."""
    if block_ids and isinstance(block_ids[0], BlockTable):
        return [t for t in block_ids if isinstance(t, BlockTable)]
    return [BlockTable([int(b) for b in block_ids if not isinstance(b, BlockTable)])]


def held_blocks(table: BlockTable, start: int, num_tokens: int, block_size: int) -> list[int]:
    """The blocks of `table` holding tokens [start, num_tokens), start at or past its
    first token."""
    first = table.first_token // block_size
    return table.block_ids[start // block_size - first : -(-num_tokens // block_size) - first]


class Transition(NamedTuple):
    request_id: str
    old: RequestState
    new: RequestState
    reason: str = ""


@dataclass(frozen=True)
class KVConnectorConfig:
    """One instance's connector: the workers' transfer runtime (`spec`) and the
    scheduler side's policy. `claim_s`: a pull capability expires this long after it is
    issued; `exposure_lease_s`: how long exposed blocks stay pinned unread (None: the
    transfer config's lease); `kv_load_failure`: what a failed pull does. The spec's
    role credential (`credential.py`: a prefill signs its capabilities with it, a decode
    takes capabilities certified by its root) is required with a shared token (none
    without one: open mode, a throwaway key, any signer trusted)."""

    spec: ConnectorSpec
    claim_s: float = DEFAULT_CLAIM_S
    exposure_lease_s: float | None = None
    kv_load_failure: KVLoadFailure = KVLoadFailure.RECOMPUTE

    @functools.cached_property
    def credential(self) -> Credential | None:
        return Credential.unpacked(self.spec.credential)

    def __post_init__(self) -> None:
        cred = self.credential
        if cred is None:
            if self.spec.transfer.token is not None:
                raise ConfigError(
                    f"credential: {ROLE_NAMES[self.role]} instance {self.spec.instance_id!r} "
                    "has a shared token but no credential, so it could not prove (prefill) "
                    "or check (decode) who issued a capability; give it one made with "
                    "`kvbridge credential --root ROOT --role "
                    f"{ROLE_NAMES[self.role]} --name NAME --out FILE`"
                )
            return
        cred.check_role(self.role, "credential")
        if cred.instance_id != self.spec.instance_id:
            raise ConfigError(
                f"instance_id={self.spec.instance_id!r}, but the credential is for "
                f"{cred.instance_id!r}: use the credential's instance id"
            )

    @property
    def root(self) -> bytes | None:
        """The root whose certificates this instance trusts (None: any, open mode)."""
        return self.credential.root if self.credential is not None else None

    @property
    def role(self) -> ConnectorRole:
        return self.spec.role


@dataclass
class KVRequest:
    """The connector's record of one request's hand-over."""

    request_id: str
    state: RequestState
    num_tokens: int  # the prompt's
    params: KVTransferParams
    capability: Capability | None = None  # decode: what to pull; prefill: what was issued
    prompt_digest: bytes = b""  # prefill: what its capability binds (`prompt_digest`)
    block_ids: list[int] = field(default_factory=list)  # the host's blocks it concerns
    num_groups: int = 1  # cache groups, each moved as a transfer of its own
    num_cached_tokens: int = 0  # decode: leading tokens the local prefix cache held
    remaining: int = 0  # workers yet to report the transfer
    failures: list[str] = field(default_factory=list)
    nbytes: int = 0
    local_nbytes: int = 0  # decode: copied between its workers on the host (a fan-out)
    handshakes: int = 0  # decode: workers whose pull waited for a handshake
    cold_peers: int = 0  # decode: (worker, producer worker) paths its READs crossed first
    started: float = 0.0
    transfer_ms: float | None = None
    #: the slowest worker's own time from Expose/Pull to done (no wait for the host's step)
    worker_ms: float = 0.0
    reason: str = ""  # why it ended as it did (RELEASED, RECOMPUTE, FAILED)
    #: prefill: its workers' release causes so far (`ConnectorEvent.cause`)
    release_causes: list[str] = field(default_factory=list)
    aborted: bool = False  # decode: the host aborted it while its pull was in flight
    #: decode: why its workers' pulls failed, where a counter tells it apart
    #: (`ConnectorEvent.cause`: stale, integrity)
    pull_failures: set[str] = field(default_factory=set)

    @property
    def first_token_id(self) -> int | None:
        return self.params.first_token_id if isinstance(self.params, RemotePrefill) else None


#: A released request's cause, from its workers' causes: the first of these any has.
RELEASE_CAUSES = ("lease_expired", "aborted", "closed", "completed")


def release_cause(worker_causes: Iterable[str]) -> str:
    """Why an exposed request's blocks were released, from each worker's cause: lease
    expired if any worker's lease did (someone never said), else aborted if any worker
    was told the pull failed or was declined or cancelled (a worker that could not
    expose counts so), else closed, else completed (every decode worker pulled)."""
    got = set(worker_causes)
    return next((c for c in RELEASE_CAUSES if c in got), "completed")


class KVConnectorScheduler:
    """The driver's connector. Owned by the host's scheduler; single-threaded."""

    def __init__(
        self,
        config: KVConnectorConfig,
        block_size: int,
        world_size: int,
        state_groups: frozenset[int] = frozenset(),
    ) -> None:
        """`state_groups`: the cache groups holding a per-request state (module
        docstring), whose block moves whole."""
        self.config = config
        self.block_size = block_size
        self.world_size = world_size
        self.state_groups = state_groups
        self.endpoint = ""  # producer: worker 0's side channel (in capabilities)
        self.requests: dict[str, KVRequest] = {}  # hand-overs not ended
        self.redeemed = Redeemed()  # decode: the capabilities it has taken (each once)
        #: the last transitions, oldest first
        self.log: collections.deque[Transition] = collections.deque(maxlen=1024)
        self.pinned_blocks = 0
        self.replays_refused = 0
        #: prefill: exposed requests released so far, by cause (`release_cause`)
        self.releases: collections.Counter[str] = collections.Counter()
        #: decode: requests whose pull failed so far, by the cause a counter tells apart
        #: (stale: a producer did not hold what was read for the whole read; integrity:
        #: the bytes read differ from the producer's digest)
        self.pull_failures: collections.Counter[str] = collections.Counter()
        #: consumer: introduced endpoints every worker had met at the last report
        self.connected: list[str] = []
        self.nbytes_total = 0
        self.busy_until = 0.0  # time.monotonic() until which the host polls busily
        #: orders naming no request that a worker could not carry out, last report
        self.errors: list[str] = []
        self._meta = _MetaBuilder()
        self._ended: dict[str, KVRequest] = {}  # ended by a call, until `pop_ended`
        #: what capabilities are signed with (open mode, no credential: a throwaway key)
        self._signing = config.credential or Credential.ephemeral(config.role, self.instance_id)

    @property
    def role(self) -> ConnectorRole:
        return self.config.role

    @property
    def instance_id(self) -> str:
        return self.config.spec.instance_id

    @property
    def has_transfers(self) -> bool:
        """Whether a transfer is in flight (the host then polls at the busy cadence)."""
        return any(r.remaining for r in self.requests.values())

    def set_worker_endpoints(self, endpoints: list[str]) -> None:
        """Start-up: every worker's `KVConnectorWorker.get_handshake_metadata` (rank
        order), handed to all workers with the next orders: a producer's side channels,
        a consumer's siblings (the fan-out)."""
        if self.role is ConnectorRole.PRODUCER:
            self.endpoint = endpoints[0]
            self._meta.worker_endpoints = list(endpoints)
        else:
            self._meta.siblings = list(endpoints)

    # -- arrival ------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_ids: list[int], params: KVTransferParams
    ) -> KVRequest:
        """Take a request with hand-over params. Decode: its capability is checked now
        (CapabilityRefused: nothing will be pulled, nothing is held); a genuine one that
        expired before this call is taken as a load that failed (`kv_load_failure`:
        the prompt recomputed here, or the request failed), nothing pulled. With state
        groups the prefill's `prompt_ids` are its prompt less the last token (the host
        computes only those), and a decode pulls its prompt less its last token."""
        if isinstance(params, RemoteDecode):
            self._need(ConnectorRole.PRODUCER, "RemoteDecode")
            rec = KVRequest(request_id, RequestState.PREFILLING, len(prompt_ids), params)
            rec.prompt_digest = prompt_digest(prompt_ids)
            return self._new(rec)
        self._need(ConnectorRole.CONSUMER, "RemotePrefill")
        covered = self.covered_prompt(prompt_ids)
        rec = KVRequest(request_id, RequestState.WAITING_FOR_REMOTE_KV, len(covered), params)
        if params.capability:
            try:
                rec.capability = self._check(params, request_id, covered)
            except CapabilityExpired as exc:  # genuine but late: a failed load, no refusal
                rec.reason = f"KV not pulled: {exc}"
        return self._new(rec)

    def covered_prompt(self, prompt_ids: list[int]) -> list[int]:
        """The tokens of a prompt a hand-over covers: all of them, or, with state groups,
        all but the last (the decode recomputes it from the state after the others; a
        one-token prompt: none, the decode computes it)."""
        return prompt_ids[:-1] if self.state_groups else prompt_ids

    def _check(self, params: RemotePrefill, request_id: str, prompt_ids: list[int]) -> Capability:
        """The capability, checked: signed by a prefill instance our root enrolled,
        issued to this instance (or to no instance in particular: a prefill request that
        named no reader), for this request (`params.request_id`, or this id) and its
        prompt (its token ids, not only their number), unexpired (CapabilityExpired if
        all else holds), and not used before (a capability opens one pull)."""
        num_tokens = len(prompt_ids)
        request_id = params.request_id or request_id
        expired = None
        try:
            cap = check_capability(params.capability, self.config.root, self.instance_id)
        except CapabilityExpired as exc:  # checked as the rest; raised if all else holds
            cap, expired = exc.cap, exc
        except AuthError as exc:
            raise CapabilityRefused(f"KV capability refused: {exc}") from None
        if cap.block_size <= 0 or not 0 <= cap.start_token <= cap.num_tokens:
            raise CapabilityRefused(
                f"KV capability refused: block_size={cap.block_size} and start_token="
                f"{cap.start_token} of {cap.num_tokens} tokens do not describe blocks"
            )
        if cap.request_id != request_id or cap.num_tokens != num_tokens:
            raise CapabilityRefused(
                f"KV capability refused: it covers request {cap.request_id!r} with "
                f"{cap.num_tokens} tokens, not {request_id!r} with {num_tokens}"
            )
        if cap.prompt_digest != prompt_digest(prompt_ids):
            raise CapabilityRefused(
                f"KV capability refused: it covers another prompt of {cap.num_tokens} tokens "
                f"than the one request {request_id!r} names"
            )
        if expired is not None:
            raise expired
        try:
            self.redeemed.redeem(cap)
        except AuthError as exc:
            raise CapabilityRefused(f"KV capability refused: {exc}") from None
        return cap

    # -- decode: loading ----------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(prompt tokens the remote instance supplies beyond the `num_computed_tokens`
        the local prefix cache holds, whether they load asynchronously). (0, False): none
        will come; the request has gone to RECOMPUTE or FAILED (`pop_ended`)."""
        rec = self.requests[request_id]
        cap = rec.capability
        if cap is None:  # none given, or one that expired before this instance took it
            self._end_load(rec, rec.reason or "no KV to pull")
            return 0, False
        if num_computed_tokens < cap.start_token:  # evicted since the router asked
            self._refuse(
                rec,
                f"the prefix cache holds {num_computed_tokens} tokens of the prompt, fewer "
                f"than the {cap.start_token} the prefill instance left out",
            )
            return 0, False
        if num_computed_tokens % self.block_size:
            self._refuse(
                rec,
                f"the prefix cache hit of {num_computed_tokens} tokens is not a whole number "
                f"of blocks of {self.block_size}",
            )
            return 0, False
        if rec.num_tokens == 0:  # `covered_prompt` of a one-token prompt
            self._refuse(rec, "the hand-over covers no token: the decode computes the prompt")
            return 0, False
        if num_computed_tokens >= rec.num_tokens:
            self._refuse(rec, "the decode instance holds the whole prompt")
            return 0, False
        return rec.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(
        self, request_id: str, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        """The host allocated `block_ids` (the whole prompt's, its cached prefix first;
        or one table per cache group): pull the last `num_external_tokens` tokens into
        them (none: nothing to pull, the prefill instance is told and the request ends
        here, `pop_ended`)."""
        rec = self.requests[request_id]
        cap = rec.capability
        assert cap is not None and rec.state is RequestState.WAITING_FOR_REMOTE_KV
        if num_external_tokens <= 0:
            self._refuse(rec, "the decode instance holds the prompt")
            return
        local, remote = block_tables(block_ids), cap.tables
        if len(local) != len(remote):
            self._refuse(
                rec,
                f"the prefill instance exposed {len(remote)} cache group(s), this instance "
                f"has {len(local)}: both must serve the same model with the same KV cache "
                "groups",
            )
            return
        n = rec.num_tokens
        cached = n - num_external_tokens
        bp, bd = cap.block_size, self.block_size
        rec.block_ids = [b for t in local for b in t.block_ids]
        rec.num_cached_tokens = cached
        rec.num_groups = len(local)
        rec.remaining = self.world_size
        rec.started = time.perf_counter()
        # per group, tokens [start, num_tokens): past the local hit and past the first
        # token either side's group holds; both block lists start with the block
        # holding token `start` (a whole number of local blocks; inside a prefill block
        # when the block sizes differ); the plan cuts pages at both sides' boundaries
        if self.state_groups and bp != bd:
            self._refuse(
                rec,
                f"the prefill instance's block_size={bp} differs from this instance's "
                f"{bd}: a state group's block (an SSM layer's state) moves whole, so both "
                "instances must run the same block_size",
            )
            return
        for g, (theirs, ours) in enumerate(zip(remote, local, strict=True)):
            if g in self.state_groups:  # the running state: the last block, whole
                self._meta.recv.append(
                    Pull(
                        transfer_id(cap.request_id, g),
                        cap.endpoint,
                        theirs.block_ids[-1:],
                        ours.block_ids[-1:],
                        bd,
                        generation=cap.generation,
                        is_state=True,
                    )
                )
                self._meta.recv_request_ids.append(request_id)
                continue
            start = max(cached, theirs.first_token, ours.first_token)
            self._meta.recv.append(
                Pull(
                    transfer_id(cap.request_id, g),
                    cap.endpoint,
                    held_blocks(theirs, start, n, bp),
                    held_blocks(ours, start, n, bd),
                    n,
                    start_token=start,
                    generation=cap.generation,
                )
            )
            self._meta.recv_request_ids.append(request_id)

    def load_refused(self, request_id: str, reason: str) -> KVRequest:
        """Pull nothing (no blocks to receive it, ...): the prefill instance is told at
        once (it frees its blocks), then the failure policy applies."""
        self._refuse(self.requests[request_id], reason)
        return self.pop_ended(request_id)

    def _refuse(self, rec: KVRequest, reason: str) -> None:
        """Decline the pull and end the request by the failure policy; its record waits
        for the caller in `pop_ended`."""
        self._decline(rec, reason)
        self._end_load(rec, reason)

    def _decline(self, rec: KVRequest, reason: str) -> None:
        cap = rec.capability
        if cap is not None:
            self._meta.decline += [
                Decline(transfer_id(cap.request_id, g), cap.endpoint, reason)
                for g in range(len(cap.tables))
            ]
            self.busy_until = time.monotonic() + CONNECT_POLL_S

    def pop_ended(self, request_id: str) -> KVRequest:
        """The record of a hand-over a call has just ended (RECOMPUTE, FAILED, RELEASED)."""
        return self._ended.pop(request_id)

    def connect(self, endpoints: Iterable[str], instance_ids: Iterable[str] = ()) -> None:
        """Decode: meet producer instances ahead of their first request (`instance_ids`,
        when given, name them: one restarted at the same address is met afresh). The
        next `update_connector_output` says which every worker has met (`connected`)."""
        self._need(ConnectorRole.CONSUMER, "connect")
        ids = list(instance_ids)
        eps = list(endpoints)
        ids += [""] * (len(eps) - len(ids))
        self._meta.connect += [Connect(e, i) for e, i in zip(eps, ids, strict=True)]
        self.busy_until = time.monotonic() + CONNECT_POLL_S

    # -- prefill: exposing --------------------------------------------------------------
    def request_finished(
        self, request_id: str, block_ids: BlockIds, first_token_id: int | None, done: bool
    ) -> tuple[bool, KVTransferParams | None]:
        """The host finished a request (`done`: it needs no decode elsewhere, e.g. a stop
        at its first token, or it was aborted); `block_ids` as `update_state_after_alloc`
        takes them. Returns (delay_free_blocks, kv_transfer_params): a prefill not done
        is exposed for its reader, the host keeps its blocks until
        `update_connector_output` releases them and answers the params; a decode aborted
        while pulling keeps its blocks until the pull ends."""
        rec = self.requests.get(request_id)
        if rec is None:
            return False, None
        if rec.state is RequestState.WAITING_FOR_REMOTE_KV:
            if rec.remaining:  # a pull in flight writes into the blocks: wait for it
                rec.aborted = True
                return True, None
            rec.aborted = True
            self._refuse(rec, "the request was aborted before its KV was pulled")
            self._ended.pop(request_id)
            return False, None
        if rec.state is not RequestState.PREFILLING:
            return False, None
        tables = block_tables(block_ids)
        if done or first_token_id is None or not any(t.block_ids for t in tables):
            self._move(rec, RequestState.RELEASED, "finished without a hand-over")
            self._ended.pop(request_id)
            return False, None
        return True, self._expose(rec, tables, first_token_id)

    def _expose(
        self, rec: KVRequest, tables: list[BlockTable], first_token_id: int
    ) -> RemotePrefill:
        assert isinstance(rec.params, RemoteDecode)
        n = rec.num_tokens
        start = min(max(rec.params.start_token, 0), n)  # the reader holds [0, start)
        lease = self.config.exposure_lease_s
        generation = new_generation()
        exposed = []
        for g, table in enumerate(tables):
            if g in self.state_groups:  # the running state: the last block, whole
                first, blocks, num_tokens = 0, table.block_ids[-1:], self.block_size
            else:
                first = min(max(start, table.first_token), n)
                blocks, num_tokens = held_blocks(table, first, n, self.block_size), n
            exposed.append(BlockTable(blocks, first))
            expose = Expose(
                transfer_id(rec.request_id, g),
                blocks,
                num_tokens,
                rec.params.reader or None,
                first,
                lease,
                generation,
            )
            self._meta.send.append(expose)
            self._meta.send_request_ids.append(rec.request_id)
        one = len(tables) == 1
        cap = Capability(
            rec.request_id,
            self.instance_id,
            self.endpoint,
            list(exposed[0].block_ids) if one else [],
            n,
            rec.params.reader,
            time.time() + self.config.claim_s,
            start,
            self.block_size,
            rec.prompt_digest,
            generation,
            [] if one else exposed,
        )
        rec.capability, rec.block_ids = cap, [b for t in tables for b in t.block_ids]
        rec.num_groups = len(tables)
        rec.remaining, rec.started = self.world_size, time.perf_counter()
        self._move(rec, RequestState.EXPOSED)
        return RemotePrefill(first_token_id, issue(cap, self._signing), self.instance_id)

    def cancel(self, request_id: str, reason: str) -> bool:
        """Release an exposed request nobody will pull (its router gave up); the
        release comes back through `update_connector_output`. False if not exposed."""
        rec = self.requests.get(request_id)
        if rec is None or rec.state is not RequestState.EXPOSED:
            return False
        self._cancel(rec, reason)
        return True

    def _cancel(self, rec: KVRequest, reason: str) -> None:
        self._meta.cancel += [
            Cancel(transfer_id(rec.request_id, g), reason) for g in range(rec.num_groups)
        ]

    # -- every step -----------------------------------------------------------------------
    def build_connector_meta(
        self, recv_wait_s: float = 0.0, idle_wait_s: float = 0.0
    ) -> ConnectorMetadata:
        """The orders gathered since the last call, for every worker; with `recv_wait_s`
        the workers wait up to that long for the pulls ordered now to end before they
        report (`ConnectorMetadata.recv_wait_s`); with `idle_wait_s` (a step with
        nothing to compute) for any transfer in flight (`ConnectorMetadata.idle_wait_s`)."""
        meta, self._meta = self._meta.build(), _MetaBuilder()
        if recv_wait_s > 0 and meta.reqs_to_recv:
            meta = msgspec.structs.replace(meta, recv_wait_s=recv_wait_s)
        if idle_wait_s > 0:
            meta = msgspec.structs.replace(meta, idle_wait_s=idle_wait_s)
        return meta

    def update_connector_output(self, outputs: list[KVWorkerOutput]) -> list[KVRequest]:
        """Fold one report per worker; the requests whose hand-over ended (every worker
        reported): RELEASED (prefill: free its blocks), RUNNING (decode: its KV is in
        place), RECOMPUTE or FAILED (decode: free its blocks; `aborted` ones too)."""
        ended = []
        self.errors = [o.error for o in outputs if o.error]
        for out in outputs:
            for ev in [*out.finished_sending, *out.finished_recving]:
                rec = self.requests.get(ev.request_id)
                if rec is not None and rec.remaining and self._fold(rec, ev):
                    ended.append(self._ended.pop(rec.request_id))
        met = [set(o.connected) for o in outputs]
        self.connected = sorted(set.intersection(*met)) if met else []
        self.pinned_blocks = sum(o.pinned_blocks for o in outputs)
        self.replays_refused = sum(o.replays_refused for o in outputs)
        return ended

    def _fold(self, rec: KVRequest, ev: ConnectorEvent) -> bool:
        rec.remaining -= 1
        rec.nbytes += ev.nbytes
        rec.local_nbytes += ev.local_nbytes
        rec.handshakes += ev.handshake
        rec.cold_peers += ev.cold_peers
        rec.worker_ms = max(rec.worker_ms, ev.elapsed_ms)
        rec.release_causes.append(ev.cause or ("completed" if ev.ok else "aborted"))
        if not ev.ok:
            rec.failures.append(ev.reason)
            if rec.state is not RequestState.EXPOSED and ev.cause:
                rec.pull_failures.add(ev.cause)
            if rec.state is RequestState.EXPOSED and rec.remaining:
                # one worker could not expose or lost it: release the others now
                self._cancel(rec, ev.reason)
        if rec.remaining:
            return False
        rec.transfer_ms = (time.perf_counter() - rec.started) * 1e3
        self.nbytes_total += rec.nbytes
        reason = "; ".join(sorted(set(rec.failures)))
        self.pull_failures.update(rec.pull_failures)  # once per request
        if rec.state is RequestState.EXPOSED:
            self.releases[release_cause(rec.release_causes)] += 1
            self._move(rec, RequestState.RELEASED, reason or "pulled")
        elif rec.aborted:
            self._move(rec, RequestState.FAILED, "the request was aborted while its KV was pulled")
        elif reason:
            self._end_load(rec, reason)
        else:
            self._move(rec, RequestState.RUNNING)
        return True

    # -- states ---------------------------------------------------------------------------
    def state(self, request_id: str) -> RequestState | None:
        rec = self.requests.get(request_id)
        return rec.state if rec is not None else None

    def _end_load(self, rec: KVRequest, reason: str) -> None:
        policy = self.config.kv_load_failure
        failed = policy is KVLoadFailure.FAIL or rec.aborted
        self._move(rec, RequestState.FAILED if failed else RequestState.RECOMPUTE, reason)

    def _new(self, rec: KVRequest) -> KVRequest:
        self.requests[rec.request_id] = rec
        return rec

    def _move(self, rec: KVRequest, new: RequestState, reason: str = "") -> None:
        check_transition(rec.request_id, rec.state, new)
        if reason:
            rec.reason = reason
        self.log.append(Transition(rec.request_id, rec.state, new, reason))
        rec.state = new
        if new.is_final:  # the host takes the blocks back (the caller reports `rec`)
            self.requests.pop(rec.request_id, None)
            self._ended[rec.request_id] = rec

    def _need(self, role: ConnectorRole, what: str) -> None:
        if self.role is not role:
            raise ConnectorError(
                f"{what} is for a {role.value} instance's connector; this one is a "
                f"{self.role.value}"
            )


@dataclass
class _MetaBuilder:
    recv: list[Pull] = field(default_factory=list)
    recv_request_ids: list[str] = field(default_factory=list)
    send: list[Expose] = field(default_factory=list)
    send_request_ids: list[str] = field(default_factory=list)
    cancel: list[Cancel] = field(default_factory=list)
    decline: list[Decline] = field(default_factory=list)
    connect: list[Connect] = field(default_factory=list)
    worker_endpoints: list[str] | None = None
    siblings: list[str] | None = None

    def build(self) -> ConnectorMetadata:
        return ConnectorMetadata(
            reqs_to_recv=self.recv,
            recv_request_ids=self.recv_request_ids,
            reqs_to_send=self.send,
            send_request_ids=self.send_request_ids,
            reqs_to_cancel=self.cancel,
            reqs_to_decline=self.decline,
            peers_to_connect=self.connect,
            worker_endpoints=self.worker_endpoints,
            siblings=self.siblings,
        )
