"""Transfer plans for the seed scenarios: structure, byte-exact verification, refusals."""

from __future__ import annotations

import pytest

from kvbridge.errors import IncompatibleError, LayoutError
from kvbridge.plan.geometry import from_hf_config, load_model_spec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.plan.planner import LocalCopy, Read, make_plan
from kvbridge.plan.verifier import verify_plan
from tests.plan.helpers import check_plan_structure


def synthetic(layers: int, heads: int, kv_heads: int, head_dim: int = 32, dtype="float16"):
    return from_hf_config(
        {
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "torch_dtype": dtype,
        },
        name=f"synthetic-{kv_heads}kv",
    )


MODELS = {
    "tinyllama": lambda: load_model_spec("tinyllama-1.1b"),  # 4 KV heads
    "llama": lambda: load_model_spec("llama-3.2-1b"),  # 8 KV heads
    "qwen3": lambda: load_model_spec("qwen3-0.6b"),  # 8 KV heads, head_dim 128
    "mha32": lambda: synthetic(4, 32, 32),  # 32 KV heads
    "kv2": lambda: synthetic(6, 32, 2),  # 2 KV heads
    "kv10": lambda: synthetic(5, 40, 10),  # 10 KV heads
    "smollm2": lambda: load_model_spec("smollm2-135m"),  # 3 KV heads
    "mla": lambda: load_model_spec("deepseek-v2-lite"),
}

SCENARIOS = [
    # model, prefill (tp, pp, block, layout), decode (tp, pp, block, layout)
    ("tinyllama", (2, 1, 16, "HND"), (8, 1, 16, "HND")),
    ("llama", (2, 1, 16, "HND"), (4, 1, 16, "HND")),
    ("llama", (4, 1, 16, "HND"), (8, 1, 16, "HND")),
    ("llama", (8, 1, 16, "HND"), (16, 1, 16, "HND")),
    ("qwen3", (4, 1, 16, "HND"), (16, 1, 16, "HND")),
    ("llama", (16, 1, 16, "HND"), (8, 1, 16, "HND")),  # prefill-side replication
    ("mha32", (4, 1, 16, "HND"), (8, 1, 16, "HND")),
    ("kv2", (4, 1, 16, "HND"), (8, 1, 16, "HND")),
    ("kv10", (2, 1, 16, "HND"), (5, 1, 16, "HND")),  # not multiples of each other
    ("kv10", (5, 1, 16, "NHD"), (2, 1, 16, "HND")),
    ("smollm2", (3, 1, 16, "HND"), (9, 1, 16, "HND")),
    ("smollm2", (9, 1, 16, "HND"), (3, 1, 16, "HND")),
    ("smollm2", (9, 1, 16, "HND"), (1, 1, 16, "HND")),
    ("smollm2", (1, 1, 16, "NHD"), (9, 1, 32, "HND")),
    ("mla", (2, 1, 16, "HND"), (1, 1, 16, "HND")),
    ("mla", (1, 1, 16, "HND"), (2, 1, 16, "HND")),
    ("llama", (4, 2, 16, "HND"), (8, 1, 16, "HND")),  # pp 2 -> pp 1
    ("llama", (8, 1, 16, "HND"), (4, 2, 16, "HND")),  # pp 1 -> pp 2
    ("smollm2", (3, 4, 16, "HND"), (9, 3, 8, "NHD")),  # stages cut at different layers
    ("llama", (4, 1, 16, "HND"), (4, 1, 32, "HND")),  # block 16 -> 32
    ("llama", (4, 1, 32, "HND"), (4, 1, 16, "HND")),  # block 32 -> 16
    ("llama", (2, 1, 16, "NHD"), (4, 1, 16, "HND")),  # NHD -> HND
    ("llama", (4, 1, 16, "HND"), (2, 1, 48, "NHD")),  # HND -> NHD, 16 -> 48 (not a multiple)
    ("smollm2", (3, 1, 16, "BHLNC"), (9, 1, 16, "LBNHC")),  # cross-layer -> per layer
    ("llama", (4, 2, 16, "BHLNC"), (8, 1, 32, "BLHNC")),  # pp 2 -> 1, 16 -> 32
    ("mla", (2, 1, 16, "BLNHC"), (1, 3, 8, "BHLNC")),
]


def layout(t: tuple[int, int, int, str]) -> InstanceLayout:
    return InstanceLayout(tp_size=t[0], pp_size=t[1], block_size=t[2], cache_layout=t[3])


@pytest.mark.parametrize(
    "name, prefill, decode",
    SCENARIOS,
    ids=[f"{m}-{p[0]}x{p[1]}b{p[2]}{p[3]}-{d[0]}x{d[1]}b{d[2]}{d[3]}" for m, p, d in SCENARIOS],
)
def test_scenario_verifies_byte_exact(name, prefill, decode):
    model = MODELS[name]()
    plan = make_plan(model, layout(prefill), layout(decode))
    check_plan_structure(plan)
    tokens = 2 * max(prefill[2], decode[2]) + 5
    report = verify_plan(plan, tokens, seed=1)
    assert report.bytes_copied == tokens * plan.bytes_per_token > 0


def test_replicated_smollm2_3_to_9_reads():
    plan = make_plan(load_model_spec("smollm2-135m"), InstanceLayout(3), InstanceLayout(9))
    per_token = 30 * 2 * 64 * 2  # layers x (K, V) x head_dim x bf16
    assert plan.reads == tuple(
        Read(d, d // 3, (d // 3, d // 3 + 1), (0, 30), per_token) for d in range(9)
    )
    assert plan.expected_notifications == (3, 3, 3)


def test_prefill_replicas_share_reads_and_unused_ones_expect_nothing():
    m = load_model_spec("smollm2-135m")
    plan = make_plan(m, InstanceLayout(9), InstanceLayout(3))
    # three decode workers, one head each; each head has three prefill replicas
    assert [r.prefill_rank for r in plan.reads] == [0, 3, 6]
    assert plan.expected_notifications == (1, 0, 0, 1, 0, 0, 1, 0, 0)
    plan = make_plan(m, InstanceLayout(9), InstanceLayout(9))
    assert [r.prefill_rank for r in plan.reads] == list(range(9))  # each reads its twin
    plan = make_plan(m, InstanceLayout(9), InstanceLayout(1, pp_size=3))
    # decode pp 3: each stage's worker needs all three heads -> 9 reads spread on 9 replicas
    assert sorted(r.prefill_rank for r in plan.reads) == list(range(9))


def test_pp_stages_split_reads():
    plan = make_plan(
        load_model_spec("llama-3.2-1b"), InstanceLayout(4, pp_size=2), InstanceLayout(8)
    )
    assert plan.reads_for(0) == (
        Read(0, 0, (0, 1), (0, 8), 8 * 2 * 64 * 2),
        Read(0, 4, (0, 1), (8, 16), 8 * 2 * 64 * 2),
    )


@pytest.mark.parametrize(
    "decode_cfg, words",
    [
        (dict(num_hidden_layers=15), "prefill num_layers=16, decode num_layers=15"),
        (dict(head_dim=128), "prefill head_dim=64, decode head_dim=128"),
        (dict(num_key_value_heads=4), "prefill num_kv_heads=8, decode num_kv_heads=4"),
    ],
)
def test_different_models_refused(decode_cfg, words):
    base = {
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "torch_dtype": "bfloat16",
    }
    p, d = from_hf_config(base), from_hf_config({**base, **decode_cfg})
    with pytest.raises(IncompatibleError, match=words):
        make_plan(p, InstanceLayout(2), InstanceLayout(4), decode_model=d)


def test_dtype_mismatch_and_bad_tp_refused():
    m = load_model_spec("llama-3.2-1b")
    with pytest.raises(
        IncompatibleError, match="prefill KV dtype=bfloat16 but decode KV dtype=float8_e4m3fn"
    ):
        make_plan(m, InstanceLayout(2), InstanceLayout(2, dtype="fp8"))
    with pytest.raises(LayoutError, match="prefill tp_size=3 does not divide"):
        make_plan(m, InstanceLayout(3), InstanceLayout(2))
    with pytest.raises(
        LayoutError, match=r"decode tp_size=5 does not divide.*use one of 1, 2, 4, 8, 16, 32"
    ):
        make_plan(m, InstanceLayout(2), InstanceLayout(5))


def test_replicas_on_one_decode_host_read_once_and_copy_locally():
    """SmolLM2 (3 KV heads) tp 3 -> tp 9 on one decode host: each head crosses the link
    once (the first of its three replicas reads it) instead of three times."""
    m = load_model_spec("smollm2-135m")
    per_token = 30 * 2 * 64 * 2
    plan = make_plan(m, InstanceLayout(3), InstanceLayout(9), decode_hosts=["h2"] * 9)
    assert plan.reads == tuple(
        Read(d, d // 3, (d // 3, d // 3 + 1), (0, 30), per_token) for d in (0, 3, 6)
    )
    assert plan.local_copies == tuple(
        LocalCopy(d, d - d % 3, (d // 3, d // 3 + 1), (0, 30), per_token) for d in range(9) if d % 3
    )
    assert plan.expected_notifications == (1, 1, 1)  # only the link readers notify
    flat = make_plan(m, InstanceLayout(3), InstanceLayout(9))
    assert flat.link_bytes_per_token == 3 * m.bytes_per_token
    assert plan.link_bytes_per_token == m.bytes_per_token
    assert plan.local_bytes_per_token == 2 * m.bytes_per_token
    # split over three hosts of three workers: one reader per head and host
    hosts = ["a", "b", "c"] * 3
    plan = make_plan(m, InstanceLayout(3), InstanceLayout(9), decode_hosts=hosts)
    assert plan.link_bytes_per_token == 3 * m.bytes_per_token and not plan.local_copies


def test_mla_latent_crosses_the_link_once_per_decode_host():
    m = load_model_spec("deepseek-v2-lite")
    flat = make_plan(m, InstanceLayout(1), InstanceLayout(8))
    plan = make_plan(m, InstanceLayout(1), InstanceLayout(8), decode_hosts=["h"] * 8)
    assert flat.link_bytes_per_token == 8 * m.bytes_per_token
    assert plan.link_bytes_per_token == m.bytes_per_token
    assert plan.local_bytes_per_token == 7 * m.bytes_per_token
    assert verify_plan(plan, 37, start_token=5).local_bytes == 32 * 7 * m.bytes_per_token


def test_decode_hosts_must_name_one_host_per_worker():
    m = load_model_spec("smollm2-135m")
    with pytest.raises(LayoutError, match=r"decode_hosts=\['a'\] must name one host .* 9 of them"):
        make_plan(m, InstanceLayout(3), InstanceLayout(9), decode_hosts=["a"])
