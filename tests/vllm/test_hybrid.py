"""A hybrid model's KV cache groups through vLLM's adapter with real NIXL agents (no vLLM
process): caches laid out as vLLM's hybrid KV cache manager lays them out (the j-th layer
of each of tiny-gemma3's four groups views the j-th of two shared tensors), block
tables as vLLM's scheduler hands them over (a sliding-window group's freed blocks are
its null block, 0), one prefill and one decode instance stepped as KVBridgeConnector
steps them. Each group's blocks arrive byte for byte in the decode's blocks of that
group, the blocks a sliding window freed are not moved, and the decode worker reports
the request once with the bytes of every group (tests/vllm/test_pd.py runs the same in
real vLLM instances)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from kvbridge.connector import Identity, RoleWorkers
from kvbridge.connector.settings import ConnectorSettings
from kvbridge.plan.geometry import from_hf_config
from kvbridge.vllm.cache import CacheFormat, describe_kv_caches
from kvbridge.vllm.scheduler import NULL_BLOCK_ID, SchedulerSide
from kvbridge.vllm.settings import ROLES
from tests.connector.test_hosts import TRANSFER, until, vllm_request
from tests.credentials import ROOT
from tests.vllm.test_cache import GEMMA3, GEMMA3_GROUPS, names

pytestmark = pytest.mark.slow

BLOCK, NUM_BLOCKS, HEADS, HEAD_DIM = 32, 16, 2, 64
#: test_hosts' prompt: 70 tokens, 2 whole blocks and 6 tokens of a third
NUM_TOKENS = 70
#: the sliding window (32) frees the whole blocks of the first 70 - 32 + 1 tokens: 1
FREED = 1
MODEL = from_hf_config({**GEMMA3, "num_hidden_layers": 8})

#: block tables per group, as vLLM's scheduler hands them over (groups 0-2 sliding,
#: group 3 full attention); block ids are unique across groups on each side
PREFILL_TABLES = ([0, 1, 13], [0, 2, 14], [0, 3, 15], [4, 5, 6])
DECODE_TABLES = ([0, 9, 1], [0, 7, 2], [0, 8, 3], [10, 12, 11])


def tokens(buf: torch.Tensor, block: int, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `num` tokens of `block` in every tensor and head: K's page half is
    [channel][token], V's [token][channel] (vLLM's CPU layout)."""
    pages = buf[:, block].reshape(2, HEADS, 2, -1)
    k = pages[:, :, 0].reshape(2, HEADS, HEAD_DIM, BLOCK)[..., :num]
    v = pages[:, :, 1].reshape(2, HEADS, BLOCK, HEAD_DIM)[:, :, :num]
    return k, v


def hybrid_buffer(fill: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vLLM's hybrid allocation for tiny-gemma3 at tp 1: two shared tensors (every
    element its own value), and each layer's cache, the j-th layer of every group
    viewing the j-th tensor."""
    buf = torch.full((2, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM), fill)
    buf += torch.arange(buf.numel(), dtype=buf.dtype).reshape(buf.shape) * 1e-3
    caches = {
        f"model.layers.{i}.self_attn.attn": buf[j] for g in GEMMA3_GROUPS for j, i in enumerate(g)
    }
    return buf, caches


class Instance:
    """One vLLM instance of tiny-gemma3 at tp 1 as the adapter sees it."""

    def __init__(self, name: str, kv_role: str, fill: float) -> None:
        self.buf, caches = hybrid_buffer(fill)
        made_by = CacheFormat(dict.fromkeys(caches, "CPU_ATTN"), "LBHNC")
        cache = describe_kv_caches(caches, MODEL, 1, BLOCK, made_by, names(GEMMA3_GROUPS))
        roles = ROLES[kv_role]
        credential = ROOT.certify(roles, name, Identity.generate())
        configs = ConnectorSettings(transfer=TRANSFER, credential=credential).configs(name, roles)
        # as KVBridgeConnector makes it for several groups
        self.side = SchedulerSide(configs, BLOCK, 1, in_step_pulls=False)
        self.worker = RoleWorkers(configs, cache.model, cache.layout, 0)
        self.worker.register_regions(cache.regions, cache.num_blocks, adopt=True)
        self.side.set_worker_endpoints(*map(lambda e: [e], self.worker.get_handshake_metadata()))
        self.pulled: list[int] = []

    def step(self) -> None:
        self.worker.start_load_kv(self.side.build_orders(0)[0])
        self.worker.wait_for_save()
        res = self.worker.get_finished()
        self.side.update_connector_output({role: [out] for role, out in res.reports.items()})
        for out in res.reports.values():
            self.pulled += [ev.nbytes for ev in out.finished_recving if ev.ok]


@pytest.fixture
def pair() -> Iterator[tuple[Instance, Instance]]:
    saved = os.environ.get("UCX_NET_DEVICES")  # an agent here sets it for this process
    p = Instance("P", "kv_producer", 1.0)
    d = Instance("D", "kv_consumer", -1.0)
    try:
        yield p, d
    finally:
        d.worker.shutdown()
        p.worker.shutdown()
        if saved is None:
            os.environ.pop("UCX_NET_DEVICES", None)


def test_each_group_moves_its_own_blocks_and_a_window_only_what_it_holds(
    pair: tuple[Instance, Instance],
) -> None:
    p, d = pair
    before = d.buf.clone()
    req = vllm_request("p-1", {"do_remote_decode": True}, first_token=7)
    p.side.on_new_request(req)
    delay, params = p.side.request_finished(req, PREFILL_TABLES, finished_ok=True)
    assert delay and params is not None
    p.step()  # the expose orders, one per group
    dreq = vllm_request("d-1", dict(params))
    d.side.on_new_request(dreq)
    count, is_async = d.side.num_new_matched_tokens(dreq, 0)
    assert (count, is_async) == (NUM_TOKENS, True)
    d.side.after_alloc(dreq, DECODE_TABLES, count)
    assert d.side.consumer is not None and p.side.producer is not None
    consumer, producer = d.side.consumer, p.side.producer

    def step() -> None:
        p.step()
        d.step()

    until(lambda: consumer.state("d-1") is None and not producer.requests, step)
    # one report for the request, with every group's bytes (a token is 2 tensors x 2
    # heads x 128 floats): the full group all 70 tokens, each sliding group the 38 of
    # the blocks its window holds, not the block it freed
    token_bytes = 2 * HEADS * 2 * HEAD_DIM * 4
    assert d.pulled == [(NUM_TOKENS + 3 * (NUM_TOKENS - FREED * BLOCK)) * token_bytes]
    moved = set()
    for theirs, ours in zip(PREFILL_TABLES, DECODE_TABLES, strict=True):
        for i, (src, dst) in enumerate(zip(theirs, ours, strict=True)):
            if NULL_BLOCK_ID in (src, dst):
                continue
            num = min(BLOCK, NUM_TOKENS - i * BLOCK)
            got, want = tokens(d.buf, dst, num), tokens(p.buf, src, num)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (src, dst)
            moved.add(dst)
    assert moved == {9, 1, 7, 2, 8, 3, 10, 12, 11}
    # nothing else was written: the other blocks
    untouched = [b for b in range(NUM_BLOCKS) if b not in moved]
    assert torch.equal(d.buf[:, untouched], before[:, untouched])
    # each group's last block was read whole: past token 70 it holds the zeros its
    # prefill wrote there before exposing it (those slots held other bytes), not them
    last = NUM_TOKENS % BLOCK
    for buf, b in [(d.buf, b) for b in (1, 2, 3, 11)] + [(p.buf, b) for b in (13, 14, 15, 6)]:
        k, v = tokens(buf, b, BLOCK)
        assert not k[..., last:].any() and not v[:, :, last:].any(), b
    assert before[:, [1, 2, 3, 11]].all()  # (the decode's slots were not zero before)
    assert producer.pinned_blocks == 0
