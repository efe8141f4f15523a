"""KVBridgeConnector in real vLLM (CPU build): P/D pairs token-exact against colocated vLLM.

Each case starts a prefill and a decode instance with KVBridgeConnector, sends vLLM's
two-step P/D request, and checks that
  * the tokens equal colocated vLLM's at the prefill's and at the decode's settings
    (the same two instances, asked without kv_transfer_params and with a cache salt,
    so nothing they hold from the P/D request is reused);
  * the decode workers pulled exactly the prompt's KV (tokens [0, prompt_tokens), a
    partial last block included; bytes logged per worker, summed, equal tokens x
    layers x K/V x head_dim x itemsize x heads each decode worker holds; MLA: the
    576-wide latent, which every decode worker holds whole; a hybrid model under vLLM's
    hybrid KV cache manager: its sliding-window layers only the blocks still inside
    the window, `moved_tokens`), so the decode instance did not compute it;
  * a second prompt extending the first, sent through `kvbridge serve --role proxy
    --engine vllm`, pulls only the tokens past the decode instance's prefix cache hit
    (MLA models: the whole prompt, as vLLM's CPU build turns prefix caching off for
    MLA: there is no hit to pull past).
Run in .venv-vllm (`make test-vllm`), one pair at a time under the heavy lock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvbridge.plan.geometry import load_model_spec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.vllm.cache import pipeline_layers
from kvbridge.vllm.launch import HYBRID_ARGS, MLA_ARGS, SSM_ARGS
from tests.vllm.harness import (
    MODELS,
    VLLMServer,
    pd_completion,
    pd_token_exact,
    text,
    through_proxy,
    token_ids,
)

pytestmark = pytest.mark.slow

PROMPT = (
    "Geography quiz. Answer each question with the name of a city.\n"
    "Q: What is the capital of Italy?\nA: Rome.\n"
    "Q: What is the capital of Spain?\nA: Madrid.\n"
    "Q: What is the capital of Germany?\nA: Berlin.\n"
    "Q: What is the capital of Japan?\nA: Tokyo.\n"
    "Q: What is the capital of France?\nA:"
)
MORE = (
    " Paris.\nQ: What is the capital of Portugal?\nA: Lisbon.\n"
    "Q: What is the capital of Austria?\nA:"
)
MAX_TOKENS = 8


@dataclass(frozen=True)
class Case:
    model: str
    prefill_tp: int
    decode_tp: int
    prefill_block: int = 32
    decode_block: int = 32
    #: the connector's kv_export setting ("": its default, auto, inline without a token)
    kv_export: str = ""
    #: the connector's fan_out setting ("": its default, auto: off on one host)
    fan_out: str = ""
    #: pipeline stages per instance (each of its tp workers)
    prefill_pp: int = 1
    decode_pp: int = 1
    #: vLLM arguments of both instances (MLA models: `launch.MLA_ARGS` besides)
    vllm_args: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        def side(tp: int, pp: int) -> str:
            return f"tp{tp}" + (f"pp{pp}" if pp > 1 else "")

        return (
            f"{self.model}-{side(self.prefill_tp, self.prefill_pp)}"
            f"-{side(self.decode_tp, self.decode_pp)}"
            f"-b{self.prefill_block}-b{self.decode_block}"
            + (f"-{self.kv_export}" if self.kv_export else "")
            + (f"-fan-out-{self.fan_out}" if self.fan_out else "")
        )


CASES = [
    # the prefill's KV read from an export process (vLLM's buffer moved into shared memory)
    Case("smollm2-135m", 1, 3, kv_export="process"),
    Case("smollm2-135m", 3, 1),
    # one KV head on both decode workers: one reads it, the other copies it (the fan-out)
    Case("tiny-kv1", 1, 2, fan_out="on"),
    Case("tiny-kv1", 2, 1),
    Case("tiny-kv6", 2, 3),
    Case("tiny-kv6", 3, 2),
    # blocks 64 -> 32: vLLM's CPU page keeps K channel-major, cut by channel rows
    Case("smollm2-135m", 1, 1, prefill_block=64, decode_block=32),
    # MLA (vLLM's CPU MLA backend: the 576-wide latent, blocks of 16): every decode
    # worker holds the whole latent; read once and copied to the sibling (fan-out on),
    # or read by each decode worker from prefill workers that are not a multiple away
    Case("tiny-mla", 1, 2, prefill_block=16, decode_block=16, fan_out="on"),
    Case("tiny-mla", 2, 3, prefill_block=16, decode_block=16),
    # pipeline parallel: each worker holds its stage's layers (vLLM's split, 2 + 2): a
    # decode worker holding every layer reads both prefill stages, a decode stage reads
    # its layers from both prefill workers
    Case("tiny-kv6", 1, 2, prefill_pp=2),
    Case("tiny-kv6", 2, 1, decode_pp=2),
    # a hybrid model (Gemma-3: 6 sliding-window layers, window 32, and 2 full ones)
    # under vLLM's hybrid KV cache manager: 4 KV cache groups, each its own blocks
    Case("tiny-gemma3", 1, 2, vllm_args=HYBRID_ARGS),
    Case("tiny-gemma3", 2, 1, vllm_args=HYBRID_ARGS),
]


def export_processes() -> list[int]:
    """Pids of the KV export processes running now (`kvbridge.transfer.export`)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"kvbridge.transfer.export" in argv:
            found.append(int(entry.name))
    return found


def held_per_token(model: str, tp_size: int, pp_size: int) -> dict[int, int]:
    """KV bytes of one token each worker of an instance holds, by rank: its stage's
    layers (vLLM's split) x its heads (a replicated one included) x K/V x head bytes."""
    spec = load_model_spec(MODELS / model)
    layout = InstanceLayout(
        tp_size=tp_size, pp_size=pp_size, pp_layers=pipeline_layers(spec.num_layers, pp_size)
    )
    return {
        w.rank: w.num_local_layers * w.num_local_heads * spec.num_kv_tensors * spec.head_bytes
        for w in layout.workers(spec)
    }


def layer_bytes_per_token(model: str, tp_size: int) -> int:
    """KV bytes of one token of one layer summed over the workers of an instance at
    `tp_size` (replicated heads counted on every worker holding them; tp_size 1: the
    distinct KV). An MLA model's spec has one head, its latent: every worker holds it."""
    spec = load_model_spec(MODELS / model)
    heads = spec.num_kv_heads
    held = heads if tp_size <= heads else tp_size  # one head per worker when tp > heads
    return spec.num_kv_tensors * spec.head_bytes * held


def moved_tokens(model: str, start: int, num_tokens: int, block_size: int) -> int:
    """Tokens moved for a prompt of `num_tokens` past a decode hit of `start`, summed
    over the model's layers. A sliding-window layer (config.json's `layer_types`) holds
    only the blocks vLLM keeps for the next token's window: it frees (on both sides)
    the whole blocks of the first num_tokens - sliding_window + 1 tokens."""
    cfg = json.loads((MODELS / model / "config.json").read_text())
    kinds = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    freed = max(num_tokens - cfg.get("sliding_window", num_tokens) + 1, 0)
    first_held = {"full_attention": 0, "sliding_attention": freed // block_size * block_size}
    return sum(num_tokens - max(start, first_held[kind]) for kind in kinds)


def pulled_bytes(model: str, tp_size: int, start: int, num_tokens: int, block_size: int) -> int:
    """What an instance at `tp_size` pulls of a prompt past a decode hit of `start`."""
    moved = moved_tokens(model, start, num_tokens, block_size)
    return moved * layer_bytes_per_token(model, tp_size)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_pd_token_exact(case: Case, tmp_path: Path) -> None:
    # pinned one per core only if they fit
    workers = case.prefill_tp * case.prefill_pp + case.decode_tp * case.decode_pp
    traced = case.prefill_pp > 1 or case.decode_pp > 1  # both alike (launch.PP_ARGS)
    extra = {"kv_export": case.kv_export} if case.kv_export else {}
    if case.fan_out:
        extra["fan_out"] = case.fan_out
    is_mla = load_model_spec(MODELS / case.model).is_mla
    # (the same tokens at every tp: launch.MLA_ARGS)
    args = (*MLA_ARGS, *case.vllm_args) if is_mla else case.vllm_args
    prefill = VLLMServer(
        case.model, case.prefill_tp, case.prefill_block, tmp_path / "prefill.log",
        kv_role="kv_producer", first_core=0, workers_on_host=workers, extra=extra,
        vllm_args=args, pp_size=case.prefill_pp, traced=traced,
    )  # fmt: skip
    decode = VLLMServer(
        case.model, case.decode_tp, case.decode_block, tmp_path / "decode.log",
        kv_role="kv_consumer", first_core=1, workers_on_host=workers, extra=extra,
        vllm_args=args, pp_size=case.decode_pp, traced=traced,
    )  # fmt: skip
    try:
        out, since = pd_token_exact(prefill, decode, PROMPT, MAX_TOKENS)
        if case.model == "smollm2-135m":
            assert text(out).startswith(" Paris.")
        if case.kv_export == "process":  # every producer worker exports
            assert len(export_processes()) == case.prefill_tp
        n = out["usage"]["prompt_tokens"]
        # vLLM kept its hybrid KV cache manager on: KVBridgeConnector declares SupportsHMA
        assert "Turning off hybrid kv cache manager" not in decode.log_text()
        pulls = decode.pulled(since)
        held = held_per_token(case.model, case.decode_tp, case.decode_pp)
        assert sorted(p.rank for p in pulls) == sorted(held), decode.log_tail()
        # the prompt's tokens exactly, its partial last block included
        assert {(p.start_token, p.num_tokens) for p in pulls} == {(0, n)}, decode.log_tail()
        # a sliding-window layer pulls only the blocks inside its window (`moved_tokens`)
        layers = load_model_spec(MODELS / case.model).num_layers
        windowed = moved_tokens(case.model, 0, n, case.decode_block) < n * layers
        if not windowed:  # each decode worker its own heads of its own layers
            assert {p.rank: p.nbytes + p.local_nbytes for p in pulls} == {
                rank: n * b for rank, b in held.items()
            }
        got = sum(p.nbytes + p.local_nbytes for p in pulls)
        assert got == pulled_bytes(case.model, case.decode_tp, 0, n, case.decode_block)
        if case.fan_out == "on":  # each head read from the prefill once, copied for the rest
            assert sum(p.nbytes for p in pulls) == pulled_bytes(
                case.model, 1, 0, n, case.decode_block
            )
            assert all(p.local_nbytes for p in pulls if p.nbytes == 0) and got > sum(
                p.nbytes for p in pulls
            )
        # the same pulls in vLLM's own metrics (the connector's stats, on /metrics)
        assert decode.metric("kvbridge_pull_time_seconds_count") == len(held)
        assert decode.metric("kvbridge_pull_bytes_sum") == sum(p.nbytes for p in pulls)
        assert decode.metric("kvbridge_failed_pulls_total") == 0

        # the decode instance's prefix cache holds the first prompt's whole local blocks:
        # it pulls the rest (asked through the proxy, as a client would). vLLM's CPU
        # build turns prefix caching off for MLA models ("forcing chunked prefill and
        # prefix caching to be disabled"): nothing is held, the whole prompt is pulled.
        since = len(decode.log_text())
        longer = PROMPT + MORE
        out2 = through_proxy(prefill, decode, longer, MAX_TOKENS, tmp_path / "proxy.log")
        ref2 = prefill.complete(longer, MAX_TOKENS, cache_salt="colocated")
        assert text(out2) == text(ref2)  # (the OpenAI API through the proxy carries text)
        n2 = out2["usage"]["prompt_tokens"]
        hit = 0 if is_mla else n // case.decode_block * case.decode_block
        pulls = decode.pulled(since)
        assert (hit > 0 or is_mla) and {(p.start_token, p.num_tokens) for p in pulls} == {(hit, n2)}
        if not windowed:  # each decode worker its own heads of its own layers
            assert {p.rank: p.nbytes + p.local_nbytes for p in pulls} == {
                rank: (n2 - hit) * b for rank, b in held.items()
            }
        assert sum(p.nbytes + p.local_nbytes for p in pulls) == pulled_bytes(
            case.model, case.decode_tp, hit, n2, case.decode_block
        )
    finally:
        prefill.stop()
        decode.stop()


def test_a_lost_prefill_is_recomputed_under_the_recompute_policy(tmp_path: Path) -> None:
    """kv_load_failure_policy "recompute": the prefill instance dies after answering;
    the decode workers' pull fails (handshake unanswered), its blocks are reported as
    load errors and vLLM computes the prompt itself: the same tokens, and the reason
    in the decode instance's log."""
    fast = {"handshake_timeout_s": 5, "liveness_timeout_s": 5, "transfer_timeout_s": 20}
    prefill = VLLMServer("tiny-kv1", 1, 32, tmp_path / "prefill.log", first_core=0)
    decode = VLLMServer(
        "tiny-kv1",
        1,
        32,
        tmp_path / "decode.log",
        first_core=1,
        extra=fast,
        failure_policy="recompute",
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()
        first = prefill.complete(PROMPT, 1, kv_transfer_params={"do_remote_decode": True})
        prefill.stop()
        since = len(decode.log_text())
        out = decode.complete(PROMPT, MAX_TOKENS, kv_transfer_params=first["kv_transfer_params"])
        ref = decode.complete(PROMPT, MAX_TOKENS, cache_salt="colocated")
        assert token_ids(out) == token_ids(ref)
        log = decode.log_text()[since:]
        assert "failed to pull" in log and not decode.pulled(since)
        assert decode.metric("kvbridge_failed_pulls_total") == 1
    finally:
        prefill.stop()
        decode.stop()


def ssm_pair(
    tmp_path: Path, prefill_tp: int, decode_tp: int, **decode: Any
) -> tuple[VLLMServer, VLLMServer]:
    """tiny-nemotron-h prefill `prefill_tp` -> decode `decode_tp` (its `decode`
    settings), both ready, prefix caching off (`launch.SSM_ARGS`)."""
    workers = prefill_tp + decode_tp
    prefill = VLLMServer(
        "tiny-nemotron-h", prefill_tp, 32, tmp_path / "prefill.log", kv_role="kv_producer",
        first_core=0, workers_on_host=workers, vllm_args=SSM_ARGS,
    )  # fmt: skip
    consumer = VLLMServer(
        "tiny-nemotron-h", decode_tp, 32, tmp_path / "decode.log", kv_role="kv_consumer",
        first_core=1, workers_on_host=workers, vllm_args=SSM_ARGS, **decode,
    )  # fmt: skip
    try:
        prefill.wait_ready()
        consumer.wait_ready()
    except BaseException:
        prefill.stop()
        consumer.stop()
        raise
    return prefill, consumer


@pytest.mark.parametrize("tp_size", [1, 2])
def test_pd_ssm_hybrid_token_exact(tp_size: int, tmp_path: Path) -> None:
    """An SSM hybrid (tiny-nemotron-h: Mamba-2 layers 0 and 4, attention layer 2) under
    vLLM's hybrid KV cache manager, prefill tp -> decode the same tp: three KV cache
    groups (each Mamba layer's, the attention layer's) over one shared tensor. The
    prefill computes the prompt less its last token, the decode pulls those tokens' KV
    and each Mamba layer's state after them (one page each, whole; at tp 2 each worker
    its own shard) and computes the last token itself: the tokens equal colocated
    vLLM's, and each decode worker pulled exactly its n - 1 tokens' attention KV and
    two state pages."""
    prefill, decode = ssm_pair(tmp_path, tp_size, tp_size)
    try:
        since = len(decode.log_text())
        _, out = pd_completion(prefill, decode, PROMPT, MAX_TOKENS)
        ref_p = prefill.complete(PROMPT, MAX_TOKENS, cache_salt="colocated")
        ref_d = decode.complete(PROMPT, MAX_TOKENS, cache_salt="colocated")
        assert token_ids(out) == token_ids(ref_p) == token_ids(ref_d), text(out)
        n = out["usage"]["prompt_tokens"]
        assert "Turning off hybrid kv cache manager" not in decode.log_text()
        pulls = decode.pulled(since)
        assert sorted((p.rank, p.start_token, p.num_tokens) for p in pulls) == [
            (rank, 0, n - 1) for rank in range(tp_size)
        ]
        # one attention layer: a worker's KV heads (2 / tp) x K/V x 64 x float32 a token;
        # a Mamba layer's state lies in a page of that tensor (32 tokens of it)
        token_bytes = 2 // tp_size * 2 * 64 * 4
        want = (n - 1) * token_bytes + 2 * 32 * token_bytes
        assert [(p.nbytes, p.local_nbytes) for p in pulls] == [(want, 0)] * tp_size
        assert decode.metric("kvbridge_pull_bytes_sum") == want * tp_size
        assert decode.metric("kvbridge_failed_pulls_total") == 0

        # through kvbridge's proxy, a longer prompt (no prefix cache: pulled whole)
        since = len(decode.log_text())
        longer = PROMPT + MORE
        out2 = through_proxy(prefill, decode, longer, MAX_TOKENS, tmp_path / "proxy.log")
        assert text(out2) == text(prefill.complete(longer, MAX_TOKENS, cache_salt="colocated"))
        n2 = out2["usage"]["prompt_tokens"]
        pulled = decode.pulled(since)
        assert {(p.start_token, p.num_tokens) for p in pulled} == {(0, n2 - 1)}
        assert len(pulled) == tp_size
    finally:
        prefill.stop()
        decode.stop()


def test_an_ssm_state_between_tp_sizes_fails_its_pull_naming_both(tmp_path: Path) -> None:
    """tiny-nemotron-h prefill tp 1 -> decode tp 2: a decode worker's state page holds
    its own shard of each Mamba layer's state, not a part of the prefill's page, so the
    state pull fails naming both instances' tp_size; under the recompute policy the
    decode instance computes the prompt itself: the tokens of colocated vLLM."""
    prefill, decode = ssm_pair(tmp_path, 1, 2, failure_policy="recompute")
    try:
        since = len(decode.log_text())
        _, out = pd_completion(prefill, decode, PROMPT, MAX_TOKENS)
        ref = decode.complete(PROMPT, MAX_TOKENS, cache_salt="colocated")
        assert token_ids(out) == token_ids(ref), text(out)
        log = decode.log_text()[since:]
        assert (
            "holds an SSM layer's state, moved as whole pages, but the prefill instance runs "
            "tp_size=1, block_size=32 and this one tp_size=2, block_size=32"
        ) in log, decode.log_tail()
        assert not decode.pulled(since)
        assert decode.metric("kvbridge_failed_pulls_total") == 2  # each decode worker's
    finally:
        prefill.stop()
        decode.stop()
