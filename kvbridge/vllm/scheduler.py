"""The connector's scheduler side in vLLM: one per engine, in the EngineCore process.

It only translates. vLLM's `Request`s and their `kv_transfer_params` dicts become calls
on the hand-over contract (`kvbridge.connector.KVConnectorScheduler`), one per role the
instance plays (`kv_role`; `kvbridge.connector.RoleSchedulers`), which checks and
issues capabilities, orders exposes, pulls and declines, and keeps each request's
`RequestState` (docs/architecture.md maps each vLLM hook to its call). The workers'
reports reach it as vLLM's connector worker metadata. vLLM owns every block: a decode
request aborted while pulling waits in vLLM's own scheduler. A request's blocks come
per KV cache group (`group_tables`; one group without vLLM's hybrid KV cache manager).
A model with state groups (SSM layers) prefills its prompt less the last token
(`truncate_prompt`). Nothing here imports vLLM (requests are read by their attributes).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvbridge.connector import (
    CapabilityRefused,
    KVRequest,
    RemoteDecode,
    RemotePrefill,
    RequestState,
    RoleSchedulers,
)
from kvbridge.connector.metadata import decode_transfer_params, encode_transfer_params
from kvbridge.connector.roles import Orders, Reports
from kvbridge.connector.scheduler import BlockTable

#: vLLM's null block (`BlockPool.null_block`, the pool's first): what a KV cache group's
#: block table holds where the group freed a request's block, leading the table (a
#: sliding window frees the blocks behind it, on the prefill after its prompt and on
#: the decode when it allocates past the tokens it loads)
NULL_BLOCK_ID = 0

#: the adapter's logger, under vLLM's "vllm" logger so vLLM's handlers print it
log = logging.getLogger("vllm.kvbridge")

#: How long a worker may wait in an empty step (no token scheduled) for a transfer in
#: flight to finish. vLLM keeps stepping while a request waits for its KV (decode) or
#: its KV is exposed (prefill), and an empty step returns at once: its engine process
#: and every worker would spin at 100 % for the whole transfer, on the cores the other
#: instance's workers need to serve it. Waiting on the transfer runtime's event
#: instead returns the moment a transfer finishes; a request that arrives meanwhile
#: waits at most this long for its first step.
EMPTY_STEP_WAIT_S = 0.02


def group_tables(block_ids: Sequence[Sequence[int]], block_size: int) -> list[BlockTable]:
    """A request's blocks as vLLM gives them, one list per KV cache group, as the
    contract's tables: each from the first block its group holds (past the leading
    null blocks)."""
    tables = []
    for ids in block_ids:
        skip = next((i for i, b in enumerate(ids) if b != NULL_BLOCK_ID), len(ids))
        tables.append(BlockTable([int(b) for b in ids[skip:]], skip * block_size))
    return tables


def truncate_prompt(request: Any, num_tokens: int) -> None:
    """Drop the last `num_tokens` prompt tokens of a vLLM request before it is scheduled
    (as vLLM's NixlConnector does for Mamba models): a prefill of a model with state
    groups computes the state after the tokens its decode does not recompute."""
    del request.prompt_token_ids[-num_tokens:]
    del request._all_token_ids[-num_tokens:]
    request.num_prompt_tokens -= num_tokens


class SchedulerSide(RoleSchedulers):
    """The engine's hand-over contracts, one per role (`RoleSchedulers`: each role's
    config, vLLM's block size and TP size, `log`), reading vLLM's requests; called from
    vLLM's scheduler thread only (`KVBridgeConnector`'s scheduler-role methods).

    A pull goes in step when its producer was pulled from before: vLLM is told the
    tokens load synchronously, schedules the request in the step that allocated its
    blocks, and the workers wait for the pull before that step's forward, which
    computes the prompt's last token and samples the first one. vLLM takes an
    asynchronous load's request only at the step after the one that reported its end:
    two steps later at best, a decode step each under load. A first pull (its
    handshake can take seconds) stays asynchronous, and so does every pull of a model
    with several KV cache groups (`in_step_pulls` off): vLLM hears of its failed pulls
    as failed requests, which it takes only from asynchronous loads."""

    def __init__(self, *args: Any, in_step_pulls: bool = True, **kwargs: Any) -> None:
        """`RoleSchedulers`' arguments, and whether a pull from a met producer may go in
        step (`in_step_pulls`: off for several KV cache groups)."""
        super().__init__(*args, **kwargs)
        self.in_step_pulls = in_step_pulls
        self.met: set[str] = set()  # producer endpoints a pull ended from, RUNNING
        self.in_step: set[str] = set()  # requests told to load synchronously, not yet pulled
        self._ordered_in_step: list[str] = []  # this step's in-step pulls

    # -- arrival -------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        """A request with a hand-over enters the contract; a decode request whose
        capability is refused is computed here (vLLM answers it all the same)."""
        params = request.kv_transfer_params
        if not params:
            return
        rid = request.request_id
        try:
            handover = decode_transfer_params(params)
            if isinstance(handover, RemoteDecode) and self.producer is not None:
                prompt = list(request.prompt_token_ids)
                covered = self.producer.covered_prompt(prompt)
                if 0 < len(covered) < len(prompt):  # (vLLM schedules no empty prompt)
                    truncate_prompt(request, len(prompt) - len(covered))
                self.producer.add_request(rid, covered, handover)
            elif isinstance(handover, RemotePrefill) and self.consumer is not None:
                self.consumer.add_request(rid, list(request.prompt_token_ids), handover)
        except (CapabilityRefused, ValueError) as exc:  # binascii.Error: not base64
            log.warning("request %s: %s; computing the prompt", rid, exc)
            params["do_remote_prefill"] = False

    # -- decode --------------------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens the prefill instance supplies past the local hit, loaded asynchronously;
        (0, False) for a request with nothing to pull (any more)."""
        rid = request.request_id
        if self.consumer is None or rid not in self.consumer.requests:
            return 0, False
        if self.consumer.requests[rid].remaining:  # pulling already (vLLM asked again)
            return 0, False
        count, is_async = self.consumer.get_num_new_matched_tokens(rid, num_computed_tokens)
        if not is_async:
            self._ended(request, self.consumer.pop_ended(rid).reason)
            return count, is_async
        cap = self.consumer.requests[rid].capability
        if self.in_step_pulls and count > 1 and cap is not None and cap.endpoint in self.met:
            # in step: vLLM computes the last prompt token in this step (its KV is
            # pulled too; the forward writes it again), so it is not announced
            self.in_step.add(rid)
            return count - 1, False
        self.in_step.discard(rid)
        return count, True

    def after_alloc(
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """vLLM allocated the request's blocks (one list per KV cache group): pull into
        them (one pull per request)."""
        rid = request.request_id
        consumer = self.consumer
        if consumer is None or rid not in consumer.requests or consumer.requests[rid].remaining:
            return
        in_step = rid in self.in_step and num_external_tokens > 0
        self.in_step.discard(rid)
        tables = group_tables(block_ids, self.block_size)
        # an in-step pull brings the last prompt token too (`num_new_matched_tokens`)
        consumer.update_state_after_alloc(rid, tables, num_external_tokens + int(in_step))
        if in_step and rid in consumer.requests:
            self._ordered_in_step.append(rid)
        request.kv_transfer_params["do_remote_prefill"] = False
        if rid not in consumer.requests:  # nothing to pull: declined
            self._ended(request, consumer.pop_ended(rid).reason)

    def _ended(self, request: Any, reason: str) -> None:
        log.info("request %s: computing the prompt here (%s)", request.request_id, reason)
        request.kv_transfer_params["do_remote_prefill"] = False

    # -- both ----------------------------------------------------------------------------
    def request_finished(
        self, request: Any, block_ids: Sequence[Sequence[int]], finished_ok: bool
    ) -> tuple[bool, dict[str, Any] | None]:
        """(delay_free_blocks, kv_transfer_params) for a finished request with its blocks
        (one list per KV cache group): a finished prefill is exposed and
        its blocks kept until its workers release them; a decode request aborted
        before its pull declines it (vLLM keeps the blocks of one aborted while
        pulling until its workers report it)."""
        rid = request.request_id
        self.in_step.discard(rid)
        if self.consumer is not None and rid in self.consumer.requests:
            self.consumer.request_finished(rid, [], None, done=True)
            request.kv_transfer_params["do_remote_prefill"] = False
            return False, None
        if self.producer is None or rid not in self.producer.requests:
            return False, None
        done = not finished_ok or request.num_computed_tokens < request.num_prompt_tokens
        first = request.output_token_ids[0] if request.output_token_ids else None
        tables = group_tables(block_ids, self.block_size)
        delay, params = self.producer.request_finished(rid, tables, first, done)
        return delay, encode_transfer_params(params, rid) if params is not None else None

    # -- every step ----------------------------------------------------------------------
    def build_orders(self, num_scheduled_tokens: int) -> tuple[Orders, list[str]]:
        """This step's orders per role, and the requests whose pulls the workers finish
        before its forward (in step); a step with no token to compute lets the workers
        wait for their transfers (`EMPTY_STEP_WAIT_S`)."""
        in_step, self._ordered_in_step = self._ordered_in_step, []
        idle = EMPTY_STEP_WAIT_S if num_scheduled_tokens == 0 else 0.0
        return self.build_connector_meta(idle), in_step

    def update_connector_output(self, reports: Reports) -> list[KVRequest]:
        """`RoleSchedulers.update_connector_output`; a pull that put its KV in place
        makes its producer one the next pulls go in step from."""
        ended = super().update_connector_output(reports)
        for rec in ended:
            if rec.state is RequestState.RUNNING and rec.capability is not None:
                self.met.add(rec.capability.endpoint)
        return ended
