"""Byte-exact transfers between real worker processes, each with its own NIXL agent.

Each case starts a prefill and a decode instance (one process per worker), pulls
concurrent requests with shuffled, non-contiguous block ids through the runtime (37
tokens: a partial last block, so the second READ of each pull is exercised too), and
checks every decode worker byte for byte (each pull reads its last block whole: zeros
past the prompt's last token) and every block released on both sides.
Cases mix cache layouts (cross-layer and per layer), TP and PP sizes, block sizes, MLA.
"""

from __future__ import annotations

import pytest

from kvbridge.harness.check import make_workload, run_check
from kvbridge.plan.copylist import copy_lists
from kvbridge.plan.geometry import AttentionKind, ModelKVSpec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.plan.planner import make_plan

pytestmark = pytest.mark.slow


def gqa(num_kv_heads: int, num_heads: int, num_layers: int = 3, head_dim: int = 8) -> ModelKVSpec:
    kind = AttentionKind.MHA if num_heads == num_kv_heads else AttentionKind.GQA
    return ModelKVSpec(num_layers, num_heads, num_kv_heads, head_dim, "float16", kind, "test")


def lay(tp: int, layout: str = "BHLNC", block_size: int = 16, pp: int = 1) -> InstanceLayout:
    return InstanceLayout(tp_size=tp, pp_size=pp, block_size=block_size, cache_layout=layout)


CASES = {
    "equal tp 2->2": (gqa(4, 8), lay(2), lay(2)),
    "1->3, LBHNC->BLHNC": (gqa(3, 9), lay(1, "LBHNC"), lay(3, "BLHNC")),
    # (3 -> 9, BHLNC -> LBNHC: test_kv_exported_from_a_process_of_its_own_arrives_byte_exact)
    "9->3, 3 kv heads": (gqa(3, 9), lay(9), lay(3)),
    "9->1, block 32->16, LBNHC->BHLNC": (gqa(3, 9), lay(9, "LBNHC", 32), lay(1)),
    "2->5, HND->BLNHC": (gqa(10, 10), lay(2, "HND"), lay(5, "BLNHC")),
    "BHLNC pp 2 -> pp 1": (gqa(2, 4, num_layers=5), lay(1, pp=2), lay(1)),
    "MLA 2->1, BLNHC->BHLNC": (
        ModelKVSpec(3, 4, 1, 24, "bfloat16", AttentionKind.MLA, "mla"),
        lay(2, "BLNHC"),
        lay(1),
    ),
    "block 16->32, NHD->HND": (gqa(4, 4), lay(2, "NHD"), lay(1, "HND", 32)),
    # vLLM's CPU pages (K channel-major), sizes that are not multiples, blocks 64 -> 32
    "vLLM CPU 2->3, block 64->32": (
        gqa(6, 6),
        lay(2, "LBHKNC:K=CN", 64),
        lay(3, "LBHKNC:K=CN", 32),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_transfer_is_byte_exact_and_releases_every_block(case: str) -> None:
    model, prefill, decode = CASES[case]
    report = run_check(model, prefill, decode, num_requests=3, num_tokens=37, timeout_s=60)
    assert report.failures == []
    assert report.verified
    # every request's bytes arrived once per decode worker that needs them
    from kvbridge.plan.planner import make_plan

    assert report.bytes == 3 * 37 * make_plan(model, prefill, decode).bytes_per_token


def test_a_last_block_read_whole_brings_zeros_past_the_prompt_not_the_prefills_bytes() -> None:
    """vLLM's CPU pages (K channel-major), tp 1 -> tp 1 at block 32, 40-token prompts:
    each pull reads its last block whole (`read_end`, 64) with real NIXL agents. The
    prefill caches' slots past token 40 hold bytes of no request pulled (the harness
    fills them with the worker's own pattern, as another request's KV would be), the
    decode's with its own: the check (`expected_decode_cache` with `read_end`) demands
    the prompt's bytes in [0, 40), zeros in [40, 64) and every other decode byte as it
    was, and the pull takes the descriptors of a whole-block prompt, not a run per
    channel of the last block."""
    model = ModelKVSpec(3, 6, 3, 16, "float32", AttentionKind.GQA, "test")
    prefill = decode = lay(1, "LBHKNC:K=CN", 32)
    plan = make_plan(model, prefill, decode)
    assert plan.read_end(40) == 64
    report = run_check(model, prefill, decode, num_requests=3, num_tokens=40, timeout_s=60)
    assert report.failures == [] and report.verified
    assert report.bytes == 3 * 40 * plan.bytes_per_token  # the prompts' KV, reported
    work = make_workload(prefill, decode, 3, 40)  # the same blocks as the check's
    whole = [
        copy_lists(plan, 0, p.block_ids, d.block_ids, 64)[0].num_descriptors
        for p, d in zip(work.prefill, work.decode, strict=True)
    ]
    assert report.descriptors == sum(whole)


def test_many_concurrent_requests() -> None:
    model = gqa(4, 8)
    report = run_check(
        model,
        InstanceLayout(tp_size=2),
        InstanceLayout(tp_size=4),
        num_requests=24,
        num_tokens=50,
        timeout_s=60,
    )
    assert report.failures == [] and report.verified and report.requests == 24


def test_per_request_descriptor_lists_when_units_would_be_too_many() -> None:
    # max_units=8 forbids prepared unit lists: every READ uses the request's own
    # merged descriptors instead (the path for very fine copy lists)
    model = gqa(4, 4)
    report = run_check(
        model,
        InstanceLayout(tp_size=2, cache_layout="NHD"),
        InstanceLayout(tp_size=1, block_size=32),
        num_requests=2,
        num_tokens=45,
        timeout_s=60,
        max_units=8,
    )
    assert report.failures == [] and report.verified
    assert report.indices == report.descriptors  # one entry per merged descriptor


def test_kv_exported_from_a_process_of_its_own_arrives_byte_exact() -> None:
    """Prefill workers whose cache lies in shared memory, read by the decode workers from
    an export process each (`kv_export="process"`, kvbridge serve's default with a
    token): the same bytes as from the workers' own agents."""
    model, prefill, decode = gqa(3, 9), lay(3), lay(9, "LBNHC")  # decode replicas
    report = run_check(
        model, prefill, decode, num_requests=3, num_tokens=37, timeout_s=60, kv_export="process"
    )
    assert report.failures == []
    assert report.verified
    from kvbridge.plan.planner import make_plan

    assert report.bytes == 3 * 37 * make_plan(model, prefill, decode).bytes_per_token


FAN_OUT = {
    # GQA replicas (3 KV heads, decode tp 9) and a partial pull: the decode side holds
    # tokens [0, 21) already (inside a block on both sides, blocks 16 -> 32), so only
    # the blocks from the one holding token 21 on are exposed, read and copied, and the
    # decode workers' earlier tokens stay as they were
    "3->9, partial": (gqa(3, 9), lay(3, "BHLNC", 16), lay(9, "LBNHC", 32), 21),
    # MLA: every decode worker holds the whole latent
    "MLA 2->4": (
        ModelKVSpec(3, 4, 1, 24, "bfloat16", AttentionKind.MLA, "mla"),
        lay(2, "BLNHC"),
        lay(4),
        0,
    ),
}


@pytest.mark.parametrize("case", list(FAN_OUT))
def test_a_fan_out_on_the_decode_host_arrives_byte_exact(case: str) -> None:
    """Issue #22 item 2 executed: the decode workers holding the same cells read them
    from the prefill once (the lowest rank), the others copy them from its cache on the
    host; every byte is checked, and the prefill's bytes are read once. (The partial
    pull's reads are the same copy lists as without a fan-out.)"""
    model, prefill, decode, start = FAN_OUT[case]
    report = run_check(
        model, prefill, decode, num_requests=2, num_tokens=50, timeout_s=60,
        start_token=start, fan_out="on",
    )  # fmt: skip
    assert report.failures == [] and report.verified
    from kvbridge.plan.planner import make_plan

    fan = make_plan(model, prefill, decode, decode_hosts=["here"] * decode.world_size)
    plain = make_plan(model, prefill, decode)
    tokens = 2 * (50 - start)
    assert report.bytes == tokens * fan.link_bytes_per_token < tokens * plain.bytes_per_token
    assert report.local_bytes == tokens * fan.local_bytes_per_token > 0
    assert report.bytes + report.local_bytes == tokens * plain.bytes_per_token


def test_caches_held_in_torch_tensors_move_byte_exact_with_a_fan_out() -> None:
    """The harness's `device` path, which tests/gpu runs with "cuda:0": each worker's
    cache a torch tensor on that device (here the host's), registered from the tensor
    (`CacheRegions.from_tensor`), read back to verify. MLA prefill tp 2 -> decode tp 4
    with a fan-out: reads, sibling copies and integrity digests on the tensors."""
    model, prefill, decode, _ = FAN_OUT["MLA 2->4"]
    report = run_check(
        model, prefill, decode, num_requests=2, num_tokens=50, timeout_s=60,
        fan_out="on", device="cpu",
    )  # fmt: skip
    assert report.failures == [] and report.verified
    assert report.local_bytes > 0 and report.bytes > 0
