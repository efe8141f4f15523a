"""An SSM hybrid's caches as vLLM 0.32 registers them, named in kvbridge's terms.

vLLM's hybrid KV cache manager gives each Mamba layer a KV cache group of its own and
pads its state (a conv and an SSM state per request) to the attention page; the
connector gets each Mamba layer as a byte view, [num_blocks, 1, 1, state bytes], one
page apart, over the tensor its attention layers share. A request's state is the page
of its one block; it moves whole, byte for byte, where each decode worker's page is the
page of the prefill worker of its rank (`TransferPlan.same_pages`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.plan import from_hf_config, make_plan
from kvbridge.plan.copylist import copy_lists
from kvbridge.plan.verifier import apply_copy_lists, region_bytes
from kvbridge.vllm.cache import CacheFormat, describe_kv_caches
from tests.vllm.test_cache import GEMMA3

#: tiny-nemotron-h: Mamba-2 layers 0 and 4, attention layer 2 (2 KV heads of 64); vLLM
#: makes three KV cache groups of one layer each over one shared tensor
ATTENTION = "model.layers.2.mixer.attn"
MAMBA = ("model.layers.0.mixer", "model.layers.4.mixer")
GROUPS = [[MAMBA[0]], [MAMBA[1]], [ATTENTION]]
MODEL = from_hf_config({**GEMMA3, "num_hidden_layers": 6})
BLOCKS, BLOCK, HEAD_DIM = 6, 32, 64
#: a Mamba layer's state at tp 1, as vLLM sizes it for tiny-nemotron-h: conv (256 + 2 x
#: 2 x 16 channels x 3) and SSM (8 heads x 32 x 16), float32; tp 2 holds half of each
STATE_BYTES = {1: (320 * 3 + 8 * 32 * 16) * 4, 2: (160 * 3 + 4 * 32 * 16) * 4}


def hybrid_caches(tp_size: int, page_apart: bool = True) -> dict[str, torch.Tensor]:
    """One worker's caches: the attention layer's view of the shared tensor and each
    Mamba layer's byte view of the same pages (vLLM's `_reshape_kv_cache`)."""
    heads = 2 // tp_size
    buf = torch.zeros(BLOCKS, heads, BLOCK, 2 * HEAD_DIM)
    page = heads * BLOCK * 2 * HEAD_DIM * 4
    size = STATE_BYTES[tp_size]
    raw = buf.view(-1).view(torch.int8)
    state = raw.as_strided((BLOCKS, 1, 1, size), (page if page_apart else size, size, size, 1))
    return {ATTENTION: buf, MAMBA[0]: state, MAMBA[1]: state}


def made_by(caches: dict[str, torch.Tensor]) -> CacheFormat:
    backends = {name: "MAMBA2_ATTN" for name in MAMBA} | {ATTENTION: "CPU_ATTN"}
    return CacheFormat({n: backends[n] for n in caches}, "LBHNC")


def describe(caches: dict[str, torch.Tensor], tp_size: int):  # type: ignore[no-untyped-def]
    return describe_kv_caches(
        caches, MODEL, tp_size, BLOCK, made_by(caches), GROUPS, state_layers=frozenset(MAMBA)
    )


def test_the_state_layers_share_the_attention_tensors_pages() -> None:
    """Three groups over one shared tensor: kvbridge registers it once, as one layer."""
    caches = hybrid_caches(1)
    reg = describe(caches, 1)
    assert reg.model.num_layers == 1 and reg.num_blocks == BLOCKS
    assert reg.regions.addresses == (caches[ATTENTION].data_ptr(),)
    assert reg.regions.lengths == (BLOCKS * 2 * BLOCK * 2 * HEAD_DIM * 4,)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_state_page_moves_byte_exact_between_instances_alike(tp_size: int) -> None:
    """Prefill and decode at the same tp_size: each decode worker's read of a state
    group's block, tokens [0, block_size), lands the prefill worker's state in its own
    block, every byte of both Mamba layers' state, and writes nothing else."""
    rng = np.random.default_rng(tp_size)
    prefill = [hybrid_caches(tp_size) for _ in range(tp_size)]
    decode = [hybrid_caches(tp_size) for _ in range(tp_size)]
    p, d = describe(prefill[0], tp_size), describe(decode[0], tp_size)
    plan = make_plan(p.model, p.layout, d.layout)
    assert plan.same_pages
    for caches in prefill:  # every byte of every page its own
        region_bytes(caches[ATTENTION].numpy(), 1)[:] = rng.integers(
            0, 256, (1, p.regions.lengths[0])
        )
    for rank in range(tp_size):
        before = decode[rank][ATTENTION].clone()
        (cl,) = copy_lists(plan, rank, [4], [1], BLOCK)
        src = region_bytes(prefill[cl.read.prefill_rank][ATTENTION].numpy(), 1)
        copied = apply_copy_lists(src, region_bytes(decode[rank][ATTENTION].numpy(), 1), [cl])
        assert cl.read.prefill_rank == rank and copied == before[0].numel() * 4  # one page
        for name in MAMBA:
            assert torch.equal(decode[rank][name][1], prefill[rank][name][4])
        others = [b for b in range(BLOCKS) if b != 1]
        assert torch.equal(decode[rank][ATTENTION][others], before[others])


def test_a_state_page_does_not_move_between_other_tp_sizes() -> None:
    """tp 1 -> 2: a decode worker's page holds half the heads of the state, sharded its
    own way (conv channels x, B, C; SSM heads), not half the prefill's page: no state
    pull is posted (`PullPlanner.post` fails it, naming both instances)."""
    one, two = describe(hybrid_caches(1), 1), describe(hybrid_caches(2), 2)
    assert not make_plan(one.model, one.layout, two.layout).same_pages
    assert not make_plan(one.model, two.layout, one.layout).same_pages


def test_a_state_view_that_is_not_whole_pages_is_refused_naming_it() -> None:
    caches = hybrid_caches(1, page_apart=False)  # states packed, not one per page
    with pytest.raises(
        ConfigError,
        match=r"SSM layer 'model.layers.0.mixer' \(backend MAMBA2_ATTN\) is \(6, 1, 1, 20224\) "
        r"torch.int8 with strides \(20224, .* whole pages of an attention layer's tensor",
    ):
        describe(caches, 1)


def test_an_ssm_layers_state_tensors_are_refused_naming_the_layer() -> None:
    """A state registered as separate tensors (not vLLM 0.32's byte view of pages)."""
    caches: dict = hybrid_caches(1)
    caches[MAMBA[1]] = [torch.zeros(BLOCKS, 320, 3), torch.zeros(BLOCKS, 8, 32, 16)]
    with pytest.raises(
        ConfigError, match=r"SSM layer 'model.layers.4.mixer' \(backend MAMBA2_ATTN\) is 2 state "
    ):
        describe(caches, 1)
