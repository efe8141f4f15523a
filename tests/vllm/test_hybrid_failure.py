"""A failed pull of a hybrid model's KV cache groups as vLLM hears of it, with real NIXL
agents and no vLLM process: the decode instance is KVBridgeConnector itself (its
scheduler-role and worker-role objects, stepped as vLLM's engine steps them), the
prefill instance test_hybrid's adapter over tiny-gemma3's four groups. vLLM cannot map
block ids back to requests across several groups (its scheduler raises on
`invalid_block_ids` then), so a pull of which one group failed must reach it as a failed
request of an asynchronous load (`get_transfer_results`' `failed_recving`), with the
reason in the decode's log, none of its groups' blocks reported as loaded, and nothing
left pinned on the prefill or held by the decode."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvbridge.connector import ConnectorMetadata, ConnectorRole, Identity, RequestState, RoleWorkers
from kvbridge.transfer.capability import transfer_id
from kvbridge.transfer.connector import Cancel
from kvbridge.vllm.cache import CacheFormat, describe_kv_caches
from kvbridge.vllm.connector import KVBridgeConnector
from kvbridge.vllm.scheduler import log
from kvbridge.vllm.settings import ROLES
from tests.connector.test_hosts import TRANSFER, last_reason, moves, until, vllm_request
from tests.credentials import ROOT
from tests.vllm.test_cache import GEMMA3_GROUPS, names
from tests.vllm.test_hybrid import (
    BLOCK,
    DECODE_TABLES,
    MODEL,
    NUM_TOKENS,
    PREFILL_TABLES,
    Instance,
    hybrid_buffer,
)

pytestmark = pytest.mark.slow

S = RequestState


class ConnectorDecode:
    """A decode instance of tiny-gemma3 at tp 1 as vLLM holds it: KVBridgeConnector with
    role SCHEDULER (the EngineCore's) and with role WORKER (the worker's), built from one
    vLLM config with four KV cache groups. The worker's cache is registered as
    `register_kv_caches` registers it, from the tensors' description (that method reads
    the attention backends and process groups of a running vLLM)."""

    def __init__(self, tmp: Path) -> None:
        credential = ROOT.certify(ROLES["kv_consumer"], "D", Identity.generate())
        credential.save(tmp / "d.cred")
        extra = {
            "credential_file": str(tmp / "d.cred"),
            "lease_s": TRANSFER.lease_s,
            "transfer_timeout_s": TRANSFER.transfer_timeout_s,
            "handshake_timeout_s": TRANSFER.handshake_timeout_s,
        }
        kv = KVTransferConfig(
            kv_connector="KVBridgeConnector",
            kv_connector_module_path="kvbridge.vllm",
            kv_role="kv_consumer",
            kv_connector_extra_config=extra,
        )
        config = SimpleNamespace(
            kv_transfer_config=kv,
            cache_config=CacheConfig(block_size=BLOCK),
            parallel_config=ParallelConfig(),
        )
        groups = SimpleNamespace(
            kv_cache_groups=[
                SimpleNamespace(layer_names=g, kv_cache_spec=None) for g in names(GEMMA3_GROUPS)
            ]
        )
        self.scheduler = KVBridgeConnector(config, KVConnectorRole.SCHEDULER, groups)  # type: ignore[arg-type]
        self.worker = KVBridgeConnector(config, KVConnectorRole.WORKER, groups)  # type: ignore[arg-type]
        self.buf, caches = hybrid_buffer(-1.0)
        made_by = CacheFormat(dict.fromkeys(caches, "CPU_ATTN"), "LBHNC")
        cache = describe_kv_caches(caches, MODEL, 1, BLOCK, made_by, names(GEMMA3_GROUPS))
        self.worker.worker = RoleWorkers(self.worker.configs, cache.model, cache.layout, 0, log)
        self.worker.worker.register_regions(cache.regions, cache.num_blocks, adopt=True)
        handshake = self.worker.get_handshake_metadata()
        assert handshake is not None
        self.scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): handshake})
        #: what vLLM's scheduler was told, over every step so far
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.invalid_block_ids: set[int] = set()
        self.pull_bytes: list[float] = []
        self.failed_pulls = 0

    def step(self) -> None:
        """One engine step with nothing to compute: the scheduler's orders bound on the
        worker, the worker's results and metadata back to the scheduler
        (`KVConnectorModelRunnerMixin`'s order)."""
        output = SimpleNamespace(total_num_scheduled_tokens=0)
        self.worker.bind_connector_metadata(self.scheduler.build_connector_meta(output))  # type: ignore[arg-type]
        results = self.worker.get_transfer_results(set())
        self.finished_recving |= results.finished_recving
        self.failed_recving |= results.failed_recving
        self.invalid_block_ids |= self.worker.get_block_ids_with_load_errors()
        stats = self.worker.get_kv_connector_stats()
        if stats is not None:
            self.pull_bytes += stats.data.get("pull_bytes", [])
            self.failed_pulls += len(stats.data.get("failed_pulls", []))
        meta = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        self.scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))  # type: ignore[arg-type]

    def shutdown(self) -> None:
        self.worker.shutdown()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Instance, ConnectorDecode]]:
    saved = os.environ.get("UCX_NET_DEVICES")  # an agent here sets it for this process
    p = Instance("P", "kv_producer", 1.0)
    try:
        d = ConnectorDecode(tmp_path)
    except BaseException:
        p.worker.shutdown()
        raise
    try:
        yield p, d
    finally:
        d.shutdown()
        p.worker.shutdown()
        if saved is None:
            os.environ.pop("UCX_NET_DEVICES", None)


def prefilled(p: Instance, rid: str) -> dict:
    """The kv_transfer_params of prefill request `rid`, its four groups exposed."""
    req = vllm_request(rid, {"do_remote_decode": True}, first_token=7)
    p.side.on_new_request(req)
    delay, params = p.side.request_finished(req, PREFILL_TABLES, finished_ok=True)
    assert delay and params is not None
    p.step()  # the expose orders, one per group
    return dict(params)


def pulled(d: ConnectorDecode, rid: str, params: dict) -> tuple[int, bool]:
    """vLLM's decode scheduler takes request `rid`: what the connector says loads, then
    its blocks allocated (DECODE_TABLES, one list per group) and announced."""
    assert d.scheduler.scheduler is not None
    req = vllm_request(rid, params)
    d.scheduler.on_new_request(req)
    count, is_async = d.scheduler.get_num_new_matched_tokens(req, 0)
    assert count is not None
    blocks = KVCacheBlocks(tuple([KVCacheBlock(b) for b in ids] for ids in DECODE_TABLES))
    d.scheduler.update_state_after_alloc(req, blocks, count)
    return count, is_async


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def logged() -> Iterator[list[str]]:
    """The lines the connector logs under vLLM's logger (vLLM's own handlers print them)."""
    handler, level = Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def test_a_failed_pull_of_several_groups_reaches_vllm_as_a_failed_request(
    pair: tuple[Instance, ConnectorDecode], logged: list[str]
) -> None:
    p, d = pair
    side = d.scheduler.scheduler
    assert side is not None and not side.in_step_pulls  # four groups: asynchronous only
    consumer, producer = side.consumer, p.side.producer
    assert consumer is not None and producer is not None

    def step() -> None:
        p.step()
        d.step()

    def ended(rid: str) -> bool:
        return consumer.state(rid) is None and not producer.requests

    # a first pull, whole: its producer is met, yet the next pull stays asynchronous
    assert pulled(d, "d-1", prefilled(p, "p-1")) == (NUM_TOKENS, True)
    until(lambda: ended("d-1"), step)
    assert (d.finished_recving, d.failed_recving, d.failed_pulls) == ({"d-1"}, set(), 0)
    assert len(d.pull_bytes) == 1 and side.met
    d.finished_recving.clear()

    # the prefill releases one sliding group's blocks before the decode reads them (as
    # a lease that ran out would): that group's read is stale, the other three land
    params = prefilled(p, "p-2")
    cancel = Cancel(transfer_id("p-2", 1), "released early by the test")
    p.worker.start_load_kv({ConnectorRole.PRODUCER: ConnectorMetadata(reqs_to_cancel=[cancel])})
    p.worker.wait_for_save()
    assert pulled(d, "d-2", params) == (NUM_TOKENS, True)  # not in step (met producer)
    until(lambda: ended("d-2"), step)

    # vLLM hears of the request as finished receiving and failed, of no block as loaded
    # or invalid (it cannot map a block id back to a request across groups)
    assert d.finished_recving == {"d-2"} and d.failed_recving == {"d-2"}
    assert d.invalid_block_ids == set()
    # the metrics count a failed pull, not the three groups' bytes that arrived
    assert d.failed_pulls == 1 and len(d.pull_bytes) == 1
    # the reason, in the decode's contract and its log (vLLM's logger)
    # (the contract's RECOMPUTE: the pull failed, the host's policy decides; vLLM's)
    assert moves(consumer, "d-2")[-1] == (S.WAITING_FOR_REMOTE_KV, S.RECOMPUTE)
    reason = last_reason(consumer, "d-2")
    assert "stale pull" in reason and "released early by the test" in reason, reason
    assert f"request d-2: RECOMPUTE ({reason})" in logged
    assert any(line.startswith("kvbridge decode worker 0 failed to pull d-2: ") for line in logged)
    # nothing pinned or held: the prefill released every group, the decode forgot the
    # request on both sides (its blocks are vLLM's to free or recompute)
    assert producer.pinned_blocks == 0 and not producer.requests
    assert not consumer.requests and not consumer.has_transfers
    assert not side.in_step and side.build_orders(0)[1] == []
    d.step()
    assert d.finished_recving == {"d-2"} and d.failed_recving == {"d-2"}  # reported once
