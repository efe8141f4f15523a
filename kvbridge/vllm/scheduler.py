"""The connector's scheduler side: one per vLLM engine, in the EngineCore process.

A request's path through it (vLLM's two-step P/D request, a proxy drives it):

  prefill instance                          decode instance
  ----------------                          ---------------
  request with kv_transfer_params
  {"do_remote_decode": true}, max_tokens 1
  `request_finished`: keep the blocks,
  issue a pull capability (signed, names
  the request, blocks, tokens, endpoint,
  reader), return it as kv_transfer_params
  next step's metadata: Expose -> workers   the proxy sends the prompt again with them
                                            `get_num_new_matched_tokens`: check the
                                            capability; the tokens past the local prefix
                                            cache hit load asynchronously
                                            `update_state_after_alloc`: Pull (or Decline
                                            if nothing is left to load) -> workers
  workers release when the decode workers   workers report each pull done or failed
  notified (or at the lease): finished_sending  (failed blocks: kv_load_failure_policy)

Only plain data leaves this object: the metadata each step (`StepOrders`).
"""

from __future__ import annotations

import base64
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from kvbridge.transfer.capability import (
    Capability,
    Redeemed,
    check,
    issue,
    new_generation,
    prompt_digest,
)
from kvbridge.transfer.connector import Decline, Expose, Pull
from kvbridge.transfer.errors import AuthError
from kvbridge.vllm.settings import ROLES, ConnectorSettings

log = logging.getLogger("vllm.kvbridge")

#: kv_transfer_params key carrying the capability (base64 of its signed bytes)
#: How long a worker may wait in an empty step (no token scheduled) for a transfer in
#: flight to finish. vLLM keeps stepping while a request waits for its KV (decode) or
#: its KV is exposed (prefill), and an empty step returns at once: its engine process
#: and every worker would spin at 100 % for the whole transfer, on the cores the other
#: instance's workers need to serve it. Waiting on the transfer runtime's event
#: instead returns the moment a transfer finishes; a request that arrives meanwhile
#: waits at most this long for its first step.
EMPTY_STEP_WAIT_S = 0.02
CAPABILITY_KEY = "kvbridge_capability"
#: kv_transfer_params key a proxy may set on the prefill request: the decode instance
#: id that alone may pull it (without it, any holder of the token may)
READER_KEY = "kvbridge_reader"


@dataclass
class PullOrder:
    """A pull for the decode workers, with the vLLM request it loads."""

    request_id: str  # vLLM's id on this (decode) instance
    pull: Pull


@dataclass
class StepOrders:
    """What the scheduler side tells every worker in one step."""

    endpoints: list[str] = field(default_factory=list)  # producer side channels, rank order
    #: consumer workers' `sibling`s (base64), rank order: in the first step only (the
    #: workers meet each other once; the fan-out, `TransferConfig.fan_out`)
    siblings: list[str] = field(default_factory=list)
    exposes: list[Expose] = field(default_factory=list)
    pulls: list[PullOrder] = field(default_factory=list)
    declines: list[Decline] = field(default_factory=list)
    #: a step with no token to compute: a worker with transfers in flight may wait up to
    #: this long in `get_finished` for one to finish (see `EMPTY_STEP_WAIT_S`)
    idle_wait_s: float = 0.0


class SchedulerSide:
    """Decides what to expose, pull or decline; owned by the connector's scheduler
    instance and called from vLLM's scheduler thread only."""

    def __init__(
        self,
        settings: ConnectorSettings,
        instance_id: str,
        kv_role: str,
        block_size: int,
    ) -> None:
        self.settings = settings
        self.instance_id = instance_id
        self.is_producer, self.is_consumer = ROLES[kv_role]
        self.block_size = block_size
        self.token = settings.transfer.token
        self.endpoints: list[str] = []
        self._siblings: list[str] = []  # until sent in a step's orders
        self._orders = StepOrders()
        self._caps: dict[str, Capability] = {}  # decode: checked capabilities by request
        self._redeemed = Redeemed()  # decode: capabilities taken (each opens one pull)

    # -- both ---------------------------------------------------------------------------
    def set_endpoints(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints

    def set_siblings(self, siblings: list[str]) -> None:
        self._siblings = siblings

    def build_orders(self, num_scheduled_tokens: int) -> StepOrders:
        """This step's orders; `num_scheduled_tokens` = 0 (nothing to compute) lets the
        workers wait for their transfers (`StepOrders.idle_wait_s`)."""
        out, self._orders = self._orders, StepOrders()
        out.endpoints = list(self.endpoints)
        out.siblings, self._siblings = self._siblings, []
        if num_scheduled_tokens == 0:
            out.idle_wait_s = EMPTY_STEP_WAIT_S
        return out

    # -- decode -------------------------------------------------------------------------
    def _capability(self, request: Any) -> Capability | None:
        """The checked capability of a decode request (None: not a remote prefill)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or CAPABILITY_KEY not in params:
            return None
        rid = request.request_id
        if rid in self._caps:
            return self._caps[rid]
        try:
            raw = base64.b64decode(params[CAPABILITY_KEY], validate=True)
            cap = _check(raw, self.token, self.instance_id)
        except (AuthError, ValueError) as exc:
            log.warning("request %s: KV capability refused (%s); computing the prompt", rid, exc)
            params["do_remote_prefill"] = False
            return None
        if cap.block_size <= 0:
            log.warning(
                "request %s: its capability does not say the prefill instance's block_size "
                "(%d); computing the prompt (a KVBridgeConnector prefill instance says it)",
                rid,
                cap.block_size,
            )
            self._refuse(cap, params, "the capability names no block size")
            return None
        if cap.num_tokens != request.num_prompt_tokens:
            log.warning(
                "request %s: its capability covers %d tokens of block %d, the prompt has %d; "
                "computing the prompt",
                rid,
                cap.num_tokens,
                cap.block_size,
                request.num_prompt_tokens,
            )
            self._refuse(cap, params, "prompt differs from the capability")
            return None
        if cap.prompt_digest != prompt_digest(request.prompt_token_ids):
            log.warning(
                "request %s: its capability covers another prompt of %d tokens; computing "
                "the prompt",
                rid,
                cap.num_tokens,
            )
            self._refuse(cap, params, "prompt differs from the capability")
            return None
        try:
            self._redeemed.redeem(cap)
        except AuthError as exc:
            log.warning("request %s: KV capability refused (%s); computing the prompt", rid, exc)
            params["do_remote_prefill"] = False
            return None
        self._caps[rid] = cap
        return cap

    def _refuse(self, cap: Capability, params: dict[str, Any], why: str) -> None:
        """Compute the prompt here; the producer releases its blocks now (Decline)."""
        self._orders.declines.append(Decline(cap.request_id, cap.endpoint, why))
        params["do_remote_prefill"] = False

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.is_consumer:
            return 0, False
        cap = self._capability(request)
        if cap is None:
            return 0, False
        # the producer exposed tokens [cap.start_token, num_tokens); we hold
        # [0, num_computed_tokens) (vLLM's prefix cache hit, whole local blocks)
        if num_computed_tokens < cap.start_token or num_computed_tokens % self.block_size:
            return 0, False
        count = cap.num_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        cap = self._caps.pop(request.request_id, None)
        if cap is None:
            return
        params = request.kv_transfer_params
        params["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens <= 0:
            self._orders.declines.append(
                Decline(cap.request_id, cap.endpoint, "the decode instance holds the prompt")
            )
            return
        # tokens [start, num_tokens): the prompt's past our prefix cache hit (a whole
        # number of local blocks; inside a prefill block when the block sizes differ).
        # Both block lists start with the block holding token `start`; the plan cuts
        # pages at both sides' boundaries, a channel-major K half by channel rows.
        start = cap.num_tokens - num_external_tokens
        bd, bp = self.block_size, cap.block_size
        local = block_ids[start // bd : math.ceil(cap.num_tokens / bd)]
        remote = cap.block_ids[start // bp - cap.start_token // bp :]
        pull = Pull(
            cap.request_id,
            cap.endpoint,
            list(remote),
            list(local),
            cap.num_tokens,
            start,
            cap.generation,
        )
        self._orders.pulls.append(PullOrder(request.request_id, pull))

    def finished_unscheduled(self, request: Any) -> None:
        """A decode request ended before its pull began: let the producer go now."""
        cap = self._caps.pop(request.request_id, None)
        if cap is not None:
            self._orders.declines.append(Decline(cap.request_id, cap.endpoint, "request aborted"))

    # -- prefill ------------------------------------------------------------------------
    def request_finished(
        self, request: Any, block_ids: list[int], finished_ok: bool
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # a decode request aborted before its pull
            self.finished_unscheduled(request)
            params["do_remote_prefill"] = False
            return False, None
        if not (self.is_producer and params.get("do_remote_decode") and finished_ok):
            return False, None
        if not self.endpoints:
            log.warning("request %s: no worker endpoints yet; not exposing", request.request_id)
            return False, None
        n = request.num_prompt_tokens
        ids = list(block_ids[: math.ceil(n / self.block_size)])
        if not ids or request.num_computed_tokens < n:
            return False, None
        reader = params.get(READER_KEY) or ""
        rid = request.request_id
        generation = new_generation()
        # the prompt's tokens, a partial last block included
        self._orders.exposes.append(
            Expose(
                rid,
                ids,
                n,
                reader=reader or None,
                lease_s=self.settings.transfer.lease_s,
                generation=generation,
            )
        )
        cap = Capability(
            rid,
            self.instance_id,
            self.endpoints[0],
            ids,
            n,
            reader,
            time.time() + self.settings.claim_s,
            0,
            self.block_size,
            prompt_digest(request.prompt_token_ids),
            generation,
        )
        out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            CAPABILITY_KEY: base64.b64encode(issue(cap, self.token)).decode(),
            "remote_engine_id": self.instance_id,
            "remote_request_id": rid,
        }
        return True, out


def _check(raw: bytes, token: bytes | None, me: str) -> Capability:
    """A capability issued to this instance, or to any reader ("": the prefill request
    named none); AuthError naming what is wrong otherwise."""
    try:
        return check(raw, token, me)
    except AuthError as exc:
        if "was issued to decode instance ''" not in str(exc):
            raise
    return check(raw, token, "")
