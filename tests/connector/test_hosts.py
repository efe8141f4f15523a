"""One state table, both hosts: every scenario of a hand-over runs through the reference
engine (two `LLMEngine`s, tp 1) and through vLLM's adapter (`kvbridge.vllm`'s scheduler
and worker sides, with vLLM's own `Request` objects where vLLM is installed), each pair
with real NIXL agents, and both must move the contract's `RequestState`s exactly as the
table says and leave nothing pinned. The engine's tokens are checked in
tests/engine/test_kv_connector.py, vLLM's in tests/vllm/test_pd.py; here the bytes a
vLLM-adapter decode worker pulled are compared with the prefill's."""

from __future__ import annotations

import base64
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

import msgspec
import pytest
import torch

from kvbridge.connector import (
    CapabilityRefused,
    ConnectorRole,
    ConnectorSpec,
    Identity,
    KVConnectorConfig,
    KVConnectorScheduler,
    RemoteDecode,
    RequestState,
    RoleWorkers,
    RootKey,
    TransferConfig,
)
from kvbridge.connector.metadata import CAPABILITY_KEY
from kvbridge.connector.settings import ConnectorSettings
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.llm_engine import LLMEngine
from kvbridge.engine.sampling import SamplingParams
from kvbridge.plan.geometry import load_model_spec
from kvbridge.transfer.capability import issue
from kvbridge.vllm.cache import CacheFormat, describe_kv_caches
from kvbridge.vllm.scheduler import SchedulerSide
from kvbridge.vllm.settings import ROLES
from tests.credentials import ROOT, enrolled, opened, resigned

pytestmark = pytest.mark.slow

S = RequestState
P, C = ConnectorRole.PRODUCER, ConnectorRole.CONSUMER
PROMPT = list(range(1000, 1070))  # 70 tokens: 2 whole blocks of 32 and a partial one
TRANSFER = TransferConfig(lease_s=30.0, transfer_timeout_s=10.0, handshake_timeout_s=5.0)
Moves = list[tuple[RequestState, RequestState]]


@dataclass(frozen=True)
class Scenario:
    """What happens to one request, the moves each side's contract must log, and words
    of the reason each side's last move gives."""

    name: str
    prefill: Moves
    decode: Moves
    prefill_reason: str
    decode_reason: str = ""


EXPOSED_RELEASED = [(S.PREFILLING, S.EXPOSED), (S.EXPOSED, S.RELEASED)]
PULLED = Scenario("pulled", EXPOSED_RELEASED, [(S.WAITING_FOR_REMOTE_KV, S.RUNNING)], "pulled")
ABORTED_PREFILL = Scenario(
    "prefill aborted", [(S.PREFILLING, S.RELEASED)], [], "finished without a hand-over"
)
ABORTED_DECODE = Scenario(  # declined: released at once, not at the lease
    "decode aborted before its pull",
    EXPOSED_RELEASED,
    [(S.WAITING_FOR_REMOTE_KV, S.FAILED)],
    "declined: the request was aborted before its KV was pulled",
    "the request was aborted before its KV was pulled",
)
CANCELLED = Scenario(
    "exposure cancelled before the pull",
    EXPOSED_RELEASED,
    [(S.WAITING_FOR_REMOTE_KV, S.RECOMPUTE)],
    "cancelled: no decode instance took it",
    "stale pull",
)
TABLE = [PULLED, ABORTED_PREFILL, ABORTED_DECODE, CANCELLED]


class Host(Protocol):
    """A prefill and a decode instance of one engine, driven through the hand-over."""

    prefill_kv: KVConnectorScheduler
    decode_kv: KVConnectorScheduler

    def prefill(self, rid: str, abort: bool = False) -> Any: ...  # the hand-over, or None
    def cancel(self, rid: str) -> None: ...
    def decode(self, rid: str, handover: Any, abort: bool = False) -> None: ...
    def pinned(self) -> bool: ...
    def refused(self, rid: str, handover: Any, capability: bytes) -> str: ...  # the reason


def moves(kv: KVConnectorScheduler, rid: str) -> Moves:
    return [(t.old, t.new) for t in kv.log if t.request_id == rid]


def last_reason(kv: KVConnectorScheduler, rid: str) -> str:
    return [t.reason for t in kv.log if t.request_id == rid][-1]


def until(done: Callable[[], bool], step: Callable[[], None], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        step()
        assert time.monotonic() < deadline, "the hand-over did not end in time"
        time.sleep(0.002)


# -- the reference engine ------------------------------------------------------------------
class EngineHost:
    def __init__(self) -> None:
        def make(role: ConnectorRole, name: str) -> LLMEngine:
            spec = ConnectorSpec(role, name, TRANSFER, enrolled(role, name).packed())
            config = KVConnectorConfig(spec, claim_s=30.0)
            return LLMEngine("smollm2-135m", EngineConfig(num_blocks=24), connector=config)

        self.p = make(P, "P")
        try:
            self.d = make(C, "D")
        except BaseException:
            self.p.shutdown()
            raise
        assert self.p.kv is not None and self.d.kv is not None
        self.prefill_kv, self.decode_kv = self.p.kv, self.d.kv

    def _drive(self, done: Callable[[], bool]) -> None:
        def step() -> None:
            for e in (self.p, self.d):
                if e.has_unfinished():
                    e.step()
                e.poll_kv()

        until(done, step)

    def prefill(self, rid: str, abort: bool = False) -> Any:
        params = SamplingParams(max_tokens=4)
        self.p.add_request(PROMPT, params, rid, kv_transfer_params=RemoteDecode("D"))
        if abort:
            self.p.abort(rid)
        self._drive(lambda: self.p.is_finished(rid))
        return self.p.pop(rid).kv_transfer_params

    def cancel(self, rid: str) -> None:
        assert self.p.cancel_kv(rid, "no decode instance took it")
        self._drive(lambda: self.prefill_kv.state(rid) is None)

    def decode(self, rid: str, handover: Any, abort: bool = False) -> None:
        self.d.add_request(PROMPT, SamplingParams(max_tokens=2), rid, kv_transfer_params=handover)
        if abort:
            self.d.abort(rid)
        self._drive(lambda: self.d.is_finished(rid))
        self.d.pop(rid)

    def refused(self, rid: str, handover: Any, capability: bytes) -> str:
        forged = msgspec.structs.replace(handover, capability=capability)
        with pytest.raises(CapabilityRefused) as refusal:
            self.d.add_request(PROMPT, SamplingParams(max_tokens=2), rid, kv_transfer_params=forged)
        return str(refusal.value)

    def pinned(self) -> bool:
        self._drive(lambda: not self.p.scheduler.held and not self.d.scheduler.held)
        return any(
            e.block_manager.num_free_blocks != e.block_manager.num_blocks for e in (self.p, self.d)
        )

    def close(self) -> None:
        self.d.shutdown()
        self.p.shutdown()


# -- vLLM's adapter ------------------------------------------------------------------------
def vllm_request(rid: str, params: dict[str, Any], first_token: int | None = None) -> Any:
    """vLLM's own Request where vLLM is installed, else the attributes the adapter reads;
    a prefill's has computed its prompt and sampled `first_token`."""
    if importlib.util.find_spec("vllm") is not None:
        from vllm import SamplingParams as VSamplingParams
        from vllm.v1.request import Request

        sampling = VSamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
        req = Request(rid, list(PROMPT), sampling, None)
        assert req.kv_transfer_params is params
    else:
        req = SimpleNamespace(
            request_id=rid,
            kv_transfer_params=params,
            prompt_token_ids=list(PROMPT),
            num_prompt_tokens=len(PROMPT),
            num_computed_tokens=0,
            output_token_ids=[],
        )
    if first_token is not None:
        req.num_computed_tokens = len(PROMPT)
        if isinstance(req, SimpleNamespace):
            req.output_token_ids.append(first_token)
        else:
            req.append_output_token_ids(first_token)
    return req


class VLLMInstance:
    """One vLLM instance as the adapter sees it: its scheduler side and one worker (tp
    1) over caches of vLLM's CPU layout; `step` is what KVBridgeConnector does in one
    engine step (orders to the worker, its report to the scheduler side)."""

    BLOCK, NUM_BLOCKS = 32, 8

    def __init__(self, name: str, kv_role: str, fill: float) -> None:
        model = load_model_spec("smollm2-135m")
        self.caches = {
            f"model.layers.{i}.self_attn.attn": torch.full(
                (self.NUM_BLOCKS, model.num_kv_heads, self.BLOCK, 2 * model.head_dim), fill
            )
            for i in range(model.num_layers)
        }
        for i, t in enumerate(self.caches.values()):  # every element its own value
            t += torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) * 1e-3 + i
        made_by = CacheFormat(dict.fromkeys(self.caches, "CPU_ATTN"), "LBHNC")  # vLLM's CPU build
        cache = describe_kv_caches(self.caches, model, 1, self.BLOCK, made_by)
        roles = ROLES[kv_role]
        credential = ROOT.certify(roles, name, Identity.generate())
        settings = ConnectorSettings(transfer=TRANSFER, credential=credential)
        configs = settings.configs(name, roles)
        self.side = SchedulerSide(configs, self.BLOCK, 1)
        self.worker = RoleWorkers(configs, model, cache.layout, 0)
        self.worker.register_regions(cache.regions, cache.num_blocks, adopt=True)
        endpoint, sibling = self.worker.get_handshake_metadata()
        self.side.set_worker_endpoints([endpoint], [sibling])
        self.load_errors: set[int] = set()

    def step(self) -> None:
        orders, in_step = self.side.build_orders(0)
        self.worker.start_load_kv(orders)
        # KVBridgeConnector.bind_connector_metadata: vLLM computes over in-step pulls'
        # blocks next; each pull ends (done or failed) within its transfer timeout
        assert not self.worker.wait_for_pulls(in_step, 60.0)
        self.worker.wait_for_save()
        res = self.worker.get_finished()
        self.load_errors |= self.worker.get_block_ids_with_load_errors()
        self.side.update_connector_output({role: [out] for role, out in res.reports.items()})


class VLLMHost:
    def __init__(self) -> None:
        self.p = VLLMInstance("P", "kv_producer", 1.0)
        try:
            self.d = VLLMInstance("D", "kv_consumer", -1.0)
        except BaseException:
            self.p.worker.shutdown()
            raise
        assert self.p.side.producer is not None and self.d.side.consumer is not None
        self.prefill_kv, self.decode_kv = self.p.side.producer, self.d.side.consumer

    def _drive(self, done: Callable[[], bool]) -> None:
        def step() -> None:
            self.p.step()
            self.d.step()

        until(done, step)

    def prefill(self, rid: str, abort: bool = False) -> Any:
        req = vllm_request(rid, {"do_remote_decode": True}, first_token=7)
        self.p.side.on_new_request(req)
        self.p.step()
        delay, params = self.p.side.request_finished(req, ([3, 5, 6],), finished_ok=not abort)
        assert delay is (not abort)
        self.p.step()  # the expose order
        return params

    def cancel(self, rid: str) -> None:
        assert self.prefill_kv.cancel(rid, "no decode instance took it")
        self._drive(lambda: self.prefill_kv.state(rid) is None)

    def decode(self, rid: str, handover: Any, abort: bool = False) -> None:
        req = vllm_request(rid, dict(handover))
        self.d.side.on_new_request(req)
        if abort:
            assert self.d.side.request_finished(req, ([],), finished_ok=False) == (False, None)
            self._drive(lambda: self.decode_kv.state(rid) is None)
            return
        count, is_async = self.d.side.num_new_matched_tokens(req, 0)
        # the first pull from the prefill instance: asynchronous; the next ones in step
        # (vLLM computes the last prompt token itself, the pull still brings it)
        met = bool(self.d.side.met)
        assert (count, is_async) == ((len(PROMPT) - 1, False) if met else (len(PROMPT), True))
        self.d.side.after_alloc(req, ([7, 1, 4],), count)
        self._drive(lambda: self.decode_kv.state(rid) is None)

    def refused(self, rid: str, handover: Any, capability: bytes) -> str:
        forged = {**handover, CAPABILITY_KEY: base64.b64encode(capability).decode()}
        req = vllm_request(rid, forged)
        warnings: list[logging.LogRecord] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = warnings.append  # type: ignore[method-assign]
        logging.getLogger("vllm.kvbridge").addHandler(handler)
        try:
            self.d.side.on_new_request(req)
        finally:
            logging.getLogger("vllm.kvbridge").removeHandler(handler)
        assert forged["do_remote_prefill"] is False  # vLLM computes the prompt itself
        assert self.d.side.num_new_matched_tokens(req, 0) == (0, False)
        return warnings[-1].getMessage()

    def pinned(self) -> bool:
        self._drive(lambda: not self.prefill_kv.requests)
        return self.prefill_kv.pinned_blocks > 0 or self.decode_kv.pinned_blocks > 0

    def close(self) -> None:
        self.d.worker.shutdown()
        self.p.worker.shutdown()


@pytest.fixture(scope="module", params=["engine", "vllm"])
def host(request: pytest.FixtureRequest) -> Iterator[Host]:
    saved = os.environ.get("UCX_NET_DEVICES")  # an agent here sets it for this process
    made: EngineHost | VLLMHost = EngineHost() if request.param == "engine" else VLLMHost()
    try:
        yield made
    finally:
        made.close()
        if saved is None:
            os.environ.pop("UCX_NET_DEVICES", None)
        else:
            os.environ["UCX_NET_DEVICES"] = saved


@pytest.mark.parametrize("scenario", TABLE, ids=lambda s: s.name)
def test_both_hosts_move_the_states_the_table_says(host: Host, scenario: Scenario) -> None:
    rid = scenario.name.replace(" ", "-")
    handover = host.prefill(rid, abort=scenario is ABORTED_PREFILL)
    if scenario is CANCELLED:
        host.cancel(rid)
    if scenario.decode:
        assert handover is not None
        host.decode(rid, handover, abort=scenario is ABORTED_DECODE)
    else:
        assert handover is None
    assert not host.pinned()
    assert moves(host.prefill_kv, rid) == scenario.prefill
    assert moves(host.decode_kv, rid) == scenario.decode
    assert scenario.prefill_reason in last_reason(host.prefill_kv, rid)
    if scenario.decode_reason:
        assert scenario.decode_reason in last_reason(host.decode_kv, rid)


def capability_of(handover: Any) -> bytes:
    if isinstance(handover, dict):  # vLLM's kv_transfer_params
        return base64.b64decode(handover[CAPABILITY_KEY])
    return bytes(handover.capability)


def test_both_hosts_take_capabilities_only_from_enrolled_prefill_instances(host: Host) -> None:
    """What a party holding a decode host's files can make of a real capability:
    re-signed for another prompt with the decode's key, pointed to an endpoint of its
    own, signed as its own by a decode credential: each refused at arrival with its
    reason, the same on both hosts; nothing pulled, nothing pinned."""
    handover = host.prefill("forged")
    real = capability_of(handover)
    cap = opened(real)
    decode = enrolled(C, "D")  # the decode host's own credential
    forgeries = [
        (
            resigned(real, decode, prompt_digest=b"x" * 16),
            "not signed by the key certified for 'P'",
        ),
        (
            resigned(real, decode, endpoint="tcp://10.9.9.9:1"),
            "not signed by the key certified for 'P'",
        ),
        (
            issue(msgspec.structs.replace(cap, producer="D", endpoint="tcp://10.9.9.9:1"), decode),
            "enrolled as a decode instance",
        ),
        (issue(cap, enrolled(P, "P", RootKey.generate())), "not by this deployment's root"),
    ]
    for data, words in forgeries:
        assert words in host.refused("forged", handover, data)
        assert host.decode_kv.state("forged") is None and not host.decode_kv.has_transfers
    assert capability_of(handover) == real  # the real one intact
    host.cancel("forged")
    assert not host.pinned()


def test_a_vllm_decode_worker_holds_the_prefill_bytes_after_its_pull() -> None:
    """The adapter's pull moves the prompt's bytes: the decode's blocks 7 and 1 hold what
    the prefill's blocks 3 and 5 held (the prompt's two whole blocks), block by block;
    the first pull asynchronously, the next one in step."""
    host = VLLMHost()
    try:
        handover = host.prefill("bytes")
        host.decode("bytes", handover)
        assert moves(host.decode_kv, "bytes") == PULLED.decode
        for name, src in host.p.caches.items():
            dst = host.d.caches[name]
            assert torch.equal(dst[[7, 1]], src[[3, 5]]), name
        assert not host.d.load_errors
        # the next pull from that prefill instance goes in step: the step that orders it
        # ends it (`VLLMInstance.step`), and its bytes are the prefill's
        for cache in host.d.caches.values():
            cache[[7, 1]] = 0
        handover = host.prefill("bytes-2")
        host.decode("bytes-2", handover)
        assert host.d.side.met and moves(host.decode_kv, "bytes-2") == PULLED.decode
        for name, src in host.p.caches.items():
            assert torch.equal(host.d.caches[name][[7, 1]], src[[3, 5]]), name
        assert not host.d.load_errors
    finally:
        host.close()
