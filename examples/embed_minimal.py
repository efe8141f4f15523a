"""Embed kvbridge in an engine: two toy "engines" move one request's KV cache.

A prefill engine (tp 2, block 16, BHLNC) and a decode engine (tp 4, block 32, LBNHC)
run one process per worker, each holding a numpy KV cache. The driver (this process)
reaches its workers over pipes carrying msgspec bytes, as an engine's executor would,
and uses nothing but kvbridge's public API. Walked through in docs/embedding.md.

    PYTHONPATH=. python examples/embed_minimal.py     # last line: verified
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import secrets
import sys
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec
import numpy as np

import kvbridge
from kvbridge.plan import cache_shape, num_regions
from kvbridge.transfer import (
    CacheRegions,
    ConnectorReply,
    ConnectorRequest,
    ConnectorRole,
    ConnectorSpec,
    Expose,
    GetEndpoint,
    Poll,
    Pull,
    SetEndpoints,
    TrackedTransfer,
    TransferConfig,
    TransferError,
    TransferTracker,
    WorkerConnector,
    load_token,
)

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # the runtime sets it too; spawned workers inherit

# 1. The model and the two instances' layouts (a toy GQA model: no weights needed).
MODEL = kvbridge.ModelKVSpec(
    num_layers=4, num_attention_heads=8, num_kv_heads=4, head_dim=16,
    dtype="float16", attention=kvbridge.AttentionKind.GQA, name="toy-gqa",
)  # fmt: skip
BHLNC, LBNHC = kvbridge.CacheLayout.parse("BHLNC"), kvbridge.CacheLayout.parse("LBNHC")
PREFILL = kvbridge.InstanceLayout(tp_size=2, block_size=16, cache_layout=BHLNC)
DECODE = kvbridge.InstanceLayout(tp_size=4, block_size=32, cache_layout=LBNHC)
NUM_BLOCKS = {ConnectorRole.PRODUCER: 16, ConnectorRole.CONSUMER: 8}  # per worker
NUM_TOKENS = 45  # not a multiple of either block size: the last blocks are partial
TIMEOUT_S = 60.0  # for every wait of the driver


def transfer_config() -> TransferConfig:
    """Every worker's transfer settings: side channel on 127.0.0.1 (the default host) at
    a free port, the shared token from KVBRIDGE_TRANSFER_TOKEN (`main` makes one up for
    this run when none is set: encrypted handshakes, signed notifications); a consumer
    gives up on a pull (30 s) before a producer's lease on its blocks (60 s) runs out."""
    return TransferConfig(lease_s=60.0, transfer_timeout_s=30.0, token=load_token())


# 2. The engine's own messages; the connector's requests and replies travel beside them.
class Prefill(msgspec.Struct, frozen=True, tag="prefill"):
    """Prefill workers: "compute" the request, writing its KV into `block_ids`."""

    block_ids: list[int]
    num_tokens: int


class Verify(msgspec.Struct, frozen=True, tag="verify"):
    """Decode workers: check the request's KV landed in `block_ids`, nothing else moved."""

    block_ids: list[int]
    num_tokens: int


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    """Close the connector and exit."""


class Answer(msgspec.Struct, frozen=True):
    """A worker's reply: the connector's, a verification problem, or an error."""

    reply: ConnectorReply | None = None
    problem: str = ""
    error: str = ""


to_worker = msgspec.msgpack.Decoder(ConnectorRequest | Prefill | Verify | Stop)
to_driver = msgspec.msgpack.Decoder(Answer)


# 3. The toy engine's "forward pass" and the check, through one view of any layout.
def kv_values(shard: kvbridge.WorkerShard, num_tokens: int) -> np.ndarray:
    """What a forward pass leaves in the cache: uint16 bit patterns that depend on the
    global layer, K/V, head, token and channel, never 0 (the caches start zeroed).
    Shape [layer, K/V, head, token, channel] over the shard's layers and heads."""
    layer, kv, head, token, channel = np.ix_(
        np.arange(*shard.layers), np.arange(MODEL.num_kv_tensors), np.arange(*shard.kv_heads),
        np.arange(num_tokens), np.arange(MODEL.head_dim),
    )  # fmt: skip
    key = (((layer * 2 + kv) * 256 + head) * 65536 + token) * 1024 + channel
    return (key.astype(np.uint64) * np.uint64(2654435761) % np.uint64(65521) + 1).astype(np.uint16)


def slots(cache: np.ndarray, layout: kvbridge.InstanceLayout) -> np.ndarray:
    """The cache's elements as uint16 bits, axes [layer, K/V, head, block, token, channel]
    whatever the layout (a view: writing it writes the cache)."""
    return cache.view(np.uint16).transpose(layout.cache_layout.permutation("LKHBNC"))


def write_request(
    cache: np.ndarray, layout: kvbridge.InstanceLayout, rank: int, block_ids: list[int], n: int
) -> None:
    t = np.arange(n)  # token t lives in block block_ids[t // block_size], slot t % block_size
    block, slot = np.asarray(block_ids)[t // layout.block_size], t % layout.block_size
    slots(cache, layout)[:, :, :, block, slot, :] = kv_values(layout.workers(MODEL)[rank], n)


def check_cache(
    cache: np.ndarray, layout: kvbridge.InstanceLayout, rank: int, block_ids: list[int], n: int
) -> str:
    """'' if `cache` holds exactly the request's KV in `block_ids` and zeros elsewhere."""
    want = np.zeros_like(cache)
    write_request(want, layout, rank, block_ids, n)
    bad = np.argwhere(slots(cache, layout) != slots(want, layout))
    if not len(bad):
        return ""
    shard = layout.workers(MODEL)[rank]
    layer, kv, head, block, slot, channel = (int(i) for i in bad[0])
    return (
        f"decode worker {rank}: {len(bad)} wrong element(s), the first at layer "
        f"{shard.layers[0] + layer} {'KV'[kv]} head {shard.kv_heads[0] + head} block {block} "
        f"slot {slot} channel {channel}"
    )


# 4. A worker process: owns its cache and its connector, serves the driver (the
# connector's progress thread polls NIXL meanwhile, also while a worker computes).
def worker_main(conn: Connection, role: ConnectorRole, rank: int, instance_id: str) -> None:
    os.dup2(2, 1)  # whatever NIXL or UCX prints goes to stderr; stdout is the driver's
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING, format=f"{instance_id} worker {rank}: %(message)s")
    layout = PREFILL if role is ConnectorRole.PRODUCER else DECODE
    shard, num_blocks = layout.workers(MODEL)[rank], NUM_BLOCKS[role]
    cache = np.empty(cache_shape(MODEL, layout, shard, num_blocks), dtype=MODEL.dtype)
    cache.fill(0)  # every page touched before it is registered
    regions = CacheRegions.from_array(cache, num_regions(MODEL, layout, shard))
    spec = ConnectorSpec(role, instance_id, transfer_config())
    try:
        connector = WorkerConnector(spec, MODEL, layout, rank, regions, num_blocks)
    except Exception as exc:
        conn.send_bytes(msgspec.msgpack.encode(Answer(error=f"{type(exc).__name__}: {exc}")))
        return
    try:
        conn.send_bytes(msgspec.msgpack.encode(Answer()))  # ready
        while True:
            if not conn.poll(1.0):  # every wait bounded; the transfers need nothing from us
                continue
            msg = to_worker.decode(conn.recv_bytes())
            if isinstance(msg, Stop):
                return
            try:
                if isinstance(msg, Prefill):
                    write_request(cache, layout, rank, msg.block_ids, msg.num_tokens)
                    answer = Answer()
                elif isinstance(msg, Verify):
                    problem = check_cache(cache, layout, rank, msg.block_ids, msg.num_tokens)
                    answer = Answer(problem=problem)
                else:
                    answer = Answer(reply=connector.handle(msg))
            except Exception as exc:  # reported to the driver; the worker goes on
                answer = Answer(error=f"{type(exc).__name__}: {exc}")
            conn.send_bytes(msgspec.msgpack.encode(answer))
    except (EOFError, KeyboardInterrupt):
        pass  # the driver went away
    finally:
        connector.close()


# 5. The driver's view of one instance: its workers, called all at once, rank order.
class Instance:
    def __init__(self, role: ConnectorRole, layout: kvbridge.InstanceLayout) -> None:
        self.role, self.layout = role, layout
        self.instance_id = f"{role.value}-{uuid.uuid4().hex[:8]}"
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        self.tracker = TransferTracker()

    def start(self) -> Instance:
        ctx = mp.get_context("spawn")
        for rank in range(self.layout.world_size):
            here, there = ctx.Pipe()
            args = (there, self.role, rank, self.instance_id)
            proc = ctx.Process(target=worker_main, args=args, daemon=True)
            proc.start()
            there.close()  # ours closed: a dead worker shows as EOF on `here`
            self.conns.append(here)
            self.procs.append(proc)
        self._collect("start")
        return self

    def call(self, msg: ConnectorRequest | Prefill | Verify) -> list[Answer]:
        for conn in self.conns:
            conn.send_bytes(msgspec.msgpack.encode(msg))
        return self._collect(type(msg).__name__)

    def connector_call(self, request: ConnectorRequest) -> list[ConnectorReply]:
        return [a.reply or ConnectorReply() for a in self.call(request)]

    def _collect(self, what: str) -> list[Answer]:
        answers = []
        for rank, conn in enumerate(self.conns):
            try:
                if not conn.poll(TIMEOUT_S):
                    raise kvbridge.WorkerError(f"no answer to {what} in {TIMEOUT_S:g} s", rank)
                answer = to_driver.decode(conn.recv_bytes())
            except EOFError:
                code = self.procs[rank].exitcode
                raise kvbridge.WorkerError(f"died during {what} (exit code {code})", rank) from None
            if answer.error:
                raise kvbridge.WorkerError(
                    f"{self.instance_id} worker {rank}: {answer.error}", rank
                )
            answers.append(answer)
        return answers

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a worker already gone
                conn.send_bytes(msgspec.msgpack.encode(Stop()))
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


# 6. The driver: one request, start to finish.
def run(prefill: Instance, decode: Instance) -> None:
    plan = kvbridge.make_plan(MODEL, PREFILL, DECODE)  # pre-flight: raises if unsupported
    kvbridge.verify_plan(plan, NUM_TOKENS)
    rng = np.random.default_rng(0)  # non-contiguous, shuffled block ids on both sides
    p_ids = rng.permutation(NUM_BLOCKS[ConnectorRole.PRODUCER])[:3].tolist()
    d_ids = rng.permutation(NUM_BLOCKS[ConnectorRole.CONSUMER])[:2].tolist()
    print(f"{MODEL.describe()}\nprefill {PREFILL.describe()} -> decode {DECODE.describe()}")
    for r in plan.reads:
        print(f"  decode {r.decode_rank} reads heads {r.kv_heads} from prefill {r.prefill_rank}")

    endpoints = [r.endpoint for r in prefill.connector_call(GetEndpoint())]  # rank order
    prefill.connector_call(SetEndpoints(endpoints))
    outcomes: dict[str, tuple[TrackedTransfer, float]] = {}

    def finished(side: str) -> Callable[[TrackedTransfer], None]:  # where an engine frees blocks
        return lambda tr: outcomes.update({side: (tr, time.perf_counter() - tr.started)})

    rid = "req-0"
    print(f"{rid}: {NUM_TOKENS} tokens, prefill blocks {p_ids} -> decode blocks {d_ids}")
    prefill.call(Prefill(p_ids, NUM_TOKENS))
    prefill.connector_call(Expose(rid, p_ids, NUM_TOKENS))
    prefill.tracker.track(rid, p_ids, PREFILL.world_size, on_done=finished("prefill"))
    # your router hands (endpoints[0], p_ids, NUM_TOKENS) to the decode instance
    decode.connector_call(Pull(rid, endpoints[0], p_ids, d_ids, NUM_TOKENS))
    decode.tracker.track(rid, d_ids, DECODE.world_size, on_done=finished("decode"))

    deadline = time.monotonic() + TIMEOUT_S
    while len(outcomes) < 2:  # the workers progress the reads; Poll collects their events
        time.sleep(0.005)
        for inst in (prefill, decode):
            inst.tracker.feed(inst.connector_call(Poll()))
        for side, (tr, _) in outcomes.items():  # a failure is final: report it at once
            if not tr.ok:
                why = "; ".join(sorted(set(tr.failures)))
                raise TransferError(f"{rid!r} failed on the {side} instance: {why}")
        if time.monotonic() > deadline:
            raise TransferError(f"{rid!r} not finished on both sides after {TIMEOUT_S:g} s")
    (pulled, pull_s), (_, release_s) = outcomes["decode"], outcomes["prefill"]
    want = NUM_TOKENS * plan.bytes_per_token
    if pulled.nbytes != want:
        raise TransferError(f"decode workers read {pulled.nbytes} bytes; the plan says {want}")
    print(f"decode: {DECODE.world_size} workers pulled {pulled.nbytes} B in {pull_s * 1e3:.1f} ms")
    print(
        f"prefill: {PREFILL.world_size} workers released the blocks after {release_s * 1e3:.1f} ms"
    )
    problems = [a.problem for a in decode.call(Verify(d_ids, NUM_TOKENS)) if a.problem]
    if problems:
        raise kvbridge.VerificationError("; ".join(problems))


def main() -> int:
    prefill = Instance(ConnectorRole.PRODUCER, PREFILL)
    decode = Instance(ConnectorRole.CONSUMER, DECODE)
    # one secret for the deployment; spawned workers inherit the environment
    os.environ.setdefault("KVBRIDGE_TRANSFER_TOKEN", secrets.token_hex(32))
    try:
        transfer_config()  # a bad token fails here, not in every worker
        prefill.start()
        decode.start()
        run(prefill, decode)
    except kvbridge.KVBridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        decode.close()
        prefill.close()
    print("verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
