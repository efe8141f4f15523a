"""Embed kvbridge in an engine: two toy "engines" hand one request's KV cache over.

A prefill engine (tp 2, block 16, BHLNC) and a decode engine (tp 4, block 32, LBNHC)
run one process per worker, each holding a numpy KV cache. Each engine hosts kvbridge's
connector contract (`kvbridge.connector`), as kvbridge's own engine and vLLM do: a
`KVConnectorScheduler` in its driver (this process) owns the request's hand-over state
and gives the orders, a `KVConnectorWorker` in every worker process carries them out.
The orders (`ConnectorMetadata`) and the reports (`KVWorkerOutput`) cross the pipes
between them as msgspec bytes, as an engine's executor would carry them; the prefill
instance's answer (`RemotePrefill`: the signed capability and the first token) goes to
the decode instance as the router would carry it. Walked through in docs/embedding.md.

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
from multiprocessing.connection import Connection

import msgspec
import numpy as np

import kvbridge
from kvbridge.connector import (
    ConnectorRole,
    ConnectorSpec,
    KVConnectorConfig,
    KVConnectorScheduler,
    KVLoadFailure,
    KVRequest,
    RemoteDecode,
    RemotePrefill,
    RequestState,
    RootKey,
)
from kvbridge.connector.metadata import encode, metadata_decoder, output_decoder
from kvbridge.connector.worker import KVConnectorWorker
from kvbridge.plan import cache_shape, num_regions
from kvbridge.transfer import CacheRegions, TransferConfig, TransferError, load_token

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
FIRST_TOKEN = 7  # the token the toy prefill "samples"; the decode continues from it
TIMEOUT_S = 60.0  # for every wait of the driver
#: a driver step with nothing to compute lets the workers sleep up to this long on
#: their transfers before they report (`ConnectorMetadata.idle_wait_s`), not spin
IDLE_WAIT_S = 0.02


def transfer_config() -> TransferConfig:
    """Every worker's transfer settings: side channel on 127.0.0.1 (the default host) at
    a free port, the shared token from KVBRIDGE_TRANSFER_TOKEN (`main` makes one up for
    this run when none is set: encrypted handshakes, signed notifications and pull
    capabilities); a consumer gives up on a pull (30 s) before a producer's lease on its
    blocks (60 s) runs out."""
    return TransferConfig(lease_s=60.0, transfer_timeout_s=30.0, token=load_token())


# 2. The engine's own messages to its workers; the connector's orders travel inside.
class KVStep(msgspec.Struct, frozen=True, tag="kv_step"):
    """Every worker: carry out one step's connector orders, `encode(ConnectorMetadata)`."""

    metadata: bytes


class Prefill(msgspec.Struct, frozen=True, tag="prefill"):
    """Prefill workers: "compute" the request, writing its KV into `block_ids`."""

    block_ids: list[int]
    num_tokens: int


class Verify(msgspec.Struct, frozen=True, tag="verify"):
    """Decode workers: check the request's KV landed in `block_ids`, nothing else moved."""

    block_ids: list[int]
    num_tokens: int


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    """Shut the connector down and exit."""


class Answer(msgspec.Struct, frozen=True):
    """A worker's reply: its handshake metadata (once ready), its connector report
    (`encode(KVWorkerOutput)`), a verification problem, or an error."""

    handshake: str = ""
    kv_output: bytes = b""
    problem: str = ""
    error: str = ""


to_worker = msgspec.msgpack.Decoder(KVStep | Prefill | Verify | Stop)
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


# 4. A worker process: owns its cache and its connector's worker side, serves the driver
# (the transfer layer's progress thread polls NIXL meanwhile, also while a worker computes).
def worker_main(conn: Connection, spec_bytes: bytes, rank: int) -> None:
    os.dup2(2, 1)  # whatever NIXL or UCX prints goes to stderr; stdout is the driver's
    sys.stdout = sys.stderr
    spec = msgspec.msgpack.decode(spec_bytes, type=ConnectorSpec)  # the same for every worker
    logging.basicConfig(level=logging.WARNING, format=f"{spec.instance_id} {rank}: %(message)s")
    layout = PREFILL if spec.role is ConnectorRole.PRODUCER else DECODE
    shard, num_blocks = layout.workers(MODEL)[rank], NUM_BLOCKS[spec.role]
    cache = np.empty(cache_shape(MODEL, layout, shard, num_blocks), dtype=MODEL.dtype)
    cache.fill(0)  # every page touched before it is registered
    worker = KVConnectorWorker(spec, MODEL, layout, rank)
    try:
        # a torch tensor in the layout's axis order: worker.register_kv_caches(tensor, n)
        regions = CacheRegions.from_array(cache, num_regions(MODEL, layout, shard))
        worker.register_regions(regions, num_blocks)
        ready = Answer(handshake=worker.get_handshake_metadata())
    except Exception as exc:
        ready = Answer(error=f"{type(exc).__name__}: {exc}")
    try:
        conn.send_bytes(msgspec.msgpack.encode(ready))
        while not ready.error:
            if not conn.poll(1.0):  # every wait bounded; the transfers need nothing from us
                continue
            msg = to_worker.decode(conn.recv_bytes())
            if isinstance(msg, Stop):
                return
            try:
                if isinstance(msg, KVStep):  # never raises: a failed order is in the report
                    output = worker.execute(metadata_decoder.decode(msg.metadata))
                    answer = Answer(kv_output=encode(output))
                elif isinstance(msg, Prefill):
                    write_request(cache, layout, rank, msg.block_ids, msg.num_tokens)
                    answer = Answer()
                else:
                    problem = check_cache(cache, layout, rank, msg.block_ids, msg.num_tokens)
                    answer = Answer(problem=problem)
            except Exception as exc:  # reported to the driver; the worker goes on
                answer = Answer(error=f"{type(exc).__name__}: {exc}")
            conn.send_bytes(msgspec.msgpack.encode(answer))
    except (EOFError, KeyboardInterrupt):
        pass  # the driver went away
    finally:
        worker.shutdown()


# 5. The driver's view of one instance: the connector's scheduler side, and the workers,
# called all at once, answers in rank order.
class Instance:
    def __init__(self, role: ConnectorRole, layout: kvbridge.InstanceLayout, root: RootKey) -> None:
        self.role, self.layout = role, layout
        # its role credential, enrolled by the deployment's root: a prefill instance signs
        # its capabilities and handshakes with it, a decode instance takes only those of
        # prefill instances the root enrolled; its id names the instance's own key
        credential = root.enroll((role,), role.value)
        self.instance_id = credential.instance_id
        self.spec = ConnectorSpec(role, self.instance_id, transfer_config(), credential.packed())
        # a decode instance of this toy engine cannot compute a prompt: a failed pull
        # fails the request (an engine that can says KVLoadFailure.RECOMPUTE)
        config = KVConnectorConfig(self.spec, kv_load_failure=KVLoadFailure.FAIL)
        self.kv = KVConnectorScheduler(config, layout.block_size, layout.world_size)
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []

    def start(self) -> Instance:
        ctx = mp.get_context("spawn")
        spec_bytes = msgspec.msgpack.encode(self.spec)
        for rank in range(self.layout.world_size):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(there, spec_bytes, rank), daemon=True)
            proc.start()
            there.close()  # ours closed: a dead worker shows as EOF on `here`
            self.conns.append(here)
            self.procs.append(proc)
        # every worker's handshake metadata, to all of them with the next orders: a
        # prefill's side channels (worker 0's goes into capabilities), a decode's
        # siblings; sent now, so the instance takes requests with its workers ready
        self.kv.set_worker_endpoints([a.handshake for a in self._collect("start")])
        self.step()
        return self

    def step(self, idle_wait_s: float = 0.0) -> list[KVRequest]:
        """One connector step: the orders to every worker, their reports folded; the
        requests whose hand-over ended (every worker reported)."""
        meta = self.kv.build_connector_meta(idle_wait_s=idle_wait_s)
        outputs = [output_decoder.decode(a.kv_output) for a in self.call(KVStep(encode(meta)))]
        ended = self.kv.update_connector_output(outputs)
        if self.kv.errors:  # an order naming no request failed (a request's: in `ended`)
            raise TransferError(f"{self.instance_id}: {'; '.join(self.kv.errors)}")
        return ended

    def call(self, msg: KVStep | Prefill | Verify) -> list[Answer]:
        for conn in self.conns:
            conn.send_bytes(msgspec.msgpack.encode(msg))
        return self._collect(type(msg).__name__)

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


# 6. The drivers: one request, start to finish.
def run(prefill: Instance, decode: Instance) -> None:
    plan = kvbridge.make_plan(MODEL, PREFILL, DECODE)  # pre-flight: raises if unsupported
    kvbridge.verify_plan(plan, NUM_TOKENS)
    rng = np.random.default_rng(0)  # non-contiguous, shuffled block ids on both sides
    p_ids = rng.permutation(NUM_BLOCKS[ConnectorRole.PRODUCER])[:3].tolist()
    d_ids = rng.permutation(NUM_BLOCKS[ConnectorRole.CONSUMER])[:2].tolist()
    prompt_ids = rng.integers(0, 32000, NUM_TOKENS).tolist()
    print(f"{MODEL.describe()}\nprefill {PREFILL.describe()} -> decode {DECODE.describe()}")
    for r in plan.reads:
        print(f"  decode {r.decode_rank} reads heads {r.kv_heads} from prefill {r.prefill_rank}")
    rid = "req-0"
    print(f"{rid}: {NUM_TOKENS} tokens, prefill blocks {p_ids} -> decode blocks {d_ids}")

    # prefill instance: the request comes with its hand-over (who decodes it, and that
    # it holds none of the prompt), is computed, and finishes at its first token
    prefill.kv.add_request(rid, prompt_ids, RemoteDecode(reader=decode.instance_id))
    prefill.call(Prefill(p_ids, NUM_TOKENS))
    # (True, RemotePrefill): the engine keeps the blocks until the connector releases them
    keep_blocks, answer = prefill.kv.request_finished(rid, p_ids, FIRST_TOKEN, done=False)
    assert keep_blocks and prefill.kv.state(rid) is RequestState.EXPOSED
    prefill.step()  # the workers pin the blocks for the reader (the Expose order)

    # your router carries the answer to the decode instance (here: as msgpack bytes)
    params = msgspec.msgpack.decode(msgspec.msgpack.encode(answer), type=RemotePrefill)
    decode.kv.add_request(rid, prompt_ids, params)  # the capability is checked here
    num_external, _ = decode.kv.get_num_new_matched_tokens(rid, 0)  # no local prefix hit
    decode.kv.update_state_after_alloc(rid, d_ids, num_external)  # pull into these blocks

    ended: dict[str, KVRequest] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while len(ended) < 2:  # each driver steps; its workers report what ended meanwhile
        for side, inst in (("prefill", prefill), ("decode", decode)):
            for rec in inst.step(IDLE_WAIT_S):  # where an engine frees or uses blocks
                ended[side] = rec
        pulled, released = ended.get("decode"), ended.get("prefill")
        if pulled is not None and pulled.state is not RequestState.RUNNING:
            raise TransferError(f"{rid!r} failed on the decode instance: {pulled.reason}")
        if released is not None and released.failures:  # a failure is final: say it at once
            raise TransferError(f"{rid!r} failed on the prefill instance: {released.reason}")
        if time.monotonic() > deadline:
            raise TransferError(f"{rid!r} not finished on both sides after {TIMEOUT_S:g} s")
    pulled, released = ended["decode"], ended["prefill"]
    want = NUM_TOKENS * plan.bytes_per_token
    if pulled.nbytes != want:
        raise TransferError(f"decode workers read {pulled.nbytes} bytes; the plan says {want}")
    ms = pulled.worker_ms  # the slowest worker's own time, Pull to done
    print(f"decode: {DECODE.world_size} workers pulled {pulled.nbytes} B in {ms:.1f} ms")
    print(f"decode: {pulled.state.name} from the prefill's first token {pulled.first_token_id}")
    causes = ", ".join(prefill.kv.releases)  # completed: every reader said it pulled
    ms = released.worker_ms
    print(f"prefill: {PREFILL.world_size} workers released the blocks after {ms:.1f} ms: {causes}")
    problems = [a.problem for a in decode.call(Verify(d_ids, NUM_TOKENS)) if a.problem]
    if problems:
        raise kvbridge.VerificationError("; ".join(problems))


def main() -> int:
    # one secret for the deployment, and its root key (the operator's: it enrolls each
    # instance); spawned workers get their instance's credential in their ConnectorSpec
    os.environ.setdefault("KVBRIDGE_TRANSFER_TOKEN", secrets.token_hex(32))
    root = RootKey.generate()
    instances: list[Instance] = []
    try:
        prefill = Instance(ConnectorRole.PRODUCER, PREFILL, root)  # a bad token fails here
        decode = Instance(ConnectorRole.CONSUMER, DECODE, root)
        instances += [decode, prefill]
        prefill.start()
        decode.start()
        run(prefill, decode)
    except kvbridge.KVBridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for inst in instances:
            inst.close()
    print("verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
