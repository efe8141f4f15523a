"""`transfer-check`: real worker processes, real NIXL reads, byte-for-byte verification.

Starts one prefill and one decode instance on this machine, fills every prefill
worker's cache with `num_requests` requests of `num_tokens` tokens (shuffled,
non-contiguous block ids on both sides), pulls them all concurrently through the
runtime, then checks that every decode worker holds exactly the expected bytes and
that every block was released on both sides.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvbridge.harness.cluster import Cluster, Instance
from kvbridge.harness.commands import (
    Expose,
    Finished,
    Pull,
    Released,
    Span,
    Status,
    StatusReply,
    Verified,
    Verify,
)
from kvbridge.plan.copylist import blocks_needed
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import InstanceLayout
from kvbridge.plan.planner import make_plan, whole_block_end


@dataclass
class CheckReport:
    """What `run_check` measured; `verified` is True only if every check passed."""

    verified: bool
    requests: int
    bytes: int
    seconds: float
    gbps: float
    descriptors: int
    descriptors_unmerged: int
    indices: int = 0  # prepared-list entries posted (== descriptors on the exact-list path)
    local_bytes: int = 0  # copied between decode workers of one host (a fan-out's 2nd hop)
    failures: list[str] = field(default_factory=list)
    prefill: str = ""
    decode: str = ""
    tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Workload:
    """Block ids of `num_requests` requests on both instances (token order)."""

    prefill: list[Span]
    decode: list[Span]
    prefill_blocks: int
    decode_blocks: int


def make_workload(
    prefill: InstanceLayout,
    decode: InstanceLayout,
    num_requests: int,
    num_tokens: int,
    seed: int = 0,
    spare_blocks: int = 3,
) -> Workload:
    """Shuffled, non-contiguous block ids: each side's block pool is a permutation with
    spare blocks mixed in, so requests interleave and no request is contiguous by luck.
    A pull reads its last block whole: each decode span's `read_end` says where the
    zeros its producer wrote past the last token end (`whole_block_end`)."""
    rng = np.random.default_rng(seed)
    end = whole_block_end(num_tokens, prefill.block_size, decode.block_size)

    def side(block_size: int, read_end: int) -> tuple[list[Span], int]:
        need = blocks_needed(num_tokens, block_size)
        total = num_requests * need + spare_blocks
        pool = rng.permutation(total)
        spans = [
            Span(pool[i * need : (i + 1) * need].tolist(), num_tokens, 1 + i, read_end=read_end)
            for i in range(num_requests)
        ]
        return spans, total

    p, pn = side(prefill.block_size, 0)
    d, dn = side(decode.block_size, end)
    return Workload(p, d, pn, dn)


def run_check(
    model: ModelKVSpec,
    prefill: InstanceLayout,
    decode: InstanceLayout,
    *,
    num_requests: int = 4,
    num_tokens: int = 64,
    seed: int = 0,
    timeout_s: float = 60.0,
    cluster: Cluster | None = None,
    start_token: int = 0,
    **options: Any,
) -> CheckReport:
    """Run the check (see module docstring); with `start_token`, partial pulls of tokens
    [start_token, num_tokens) that must leave each decode worker's earlier tokens as they
    were. `options` go to every worker (`WorkerSpec`)."""
    make_plan(model, prefill, decode)  # refuse an incompatible pair before spawning
    work = make_workload(prefill, decode, num_requests, num_tokens, seed)
    if start_token:
        work = dataclasses.replace(
            work, decode=[msgspec.structs.replace(s, start_token=start_token) for s in work.decode]
        )
    own = cluster is None
    c = cluster or Cluster()
    failures: list[str] = []
    try:
        pre = c.start(
            "prefill",
            model,
            prefill,
            work.prefill_blocks,
            "check-prefill",
            fill=work.prefill,
            salt=1000,
            **options,
        )
        dec = c.start(
            "decode", model, decode, work.decode_blocks, "check-decode", salt=5000, **options
        )
        t0 = time.perf_counter()
        blocks = (prefill.block_size, decode.block_size)
        finished = _run_requests(c, pre, dec, work, timeout_s, failures, blocks)
        seconds = time.perf_counter() - t0
        done = [f for f in finished if f.state == "done"]
        for f in finished:
            if f.state != "done":
                failures.append(f"request {f.request_id} on decode rank {f.rank}: {f.reason}")
        _verify(c, pre, dec, work, timeout_s, failures)
    finally:
        if own:
            c.close()
    nbytes = sum(f.nbytes for f in done)
    return CheckReport(
        verified=not failures,
        requests=num_requests,
        bytes=nbytes,
        seconds=seconds,
        gbps=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        descriptors=sum(f.num_descriptors for f in done),
        descriptors_unmerged=sum(f.num_unmerged for f in done),
        indices=sum(f.num_indices for f in done),
        local_bytes=sum(f.local_nbytes for f in done),
        failures=failures,
        prefill=prefill.describe(),
        decode=decode.describe(),
        tokens=num_tokens,
    )


def _run_requests(
    c: Cluster,
    pre: Instance,
    dec: Instance,
    work: Workload,
    timeout_s: float,
    failures: list[str],
    block_sizes: tuple[int, int],
) -> list[Finished]:
    """Expose on every prefill worker (unused replicas included: decode worker 0
    notifies them), pull on every decode worker, wait for every result and release.
    A decode span's `start_token` makes a partial pull: only the blocks from the one
    holding that token on are exposed and read, on both sides."""
    readers = pre.workers
    bp, bd = block_sizes
    for i, (ps, ds) in enumerate(zip(work.prefill, work.decode, strict=True)):
        start = ds.start_token  # the decode side holds [0, start) already
        src = ps.block_ids[start // bp :]
        for w in readers:
            w.send(Expose(f"req-{i}", src, ps.num_tokens, start))
        for w in dec.workers:
            w.send(Pull(f"req-{i}", pre.endpoint, src, ds.blocks_from(bd), ds.num_tokens, start))
    n_fin = len(work.decode) * len(dec.workers)
    n_rel = len(work.prefill) * len(readers)
    finished: list[Finished] = []
    released: list[Released] = []

    def all_in() -> bool:
        finished.extend(c.take(Finished))
        released.extend(c.take(Released))
        return len(finished) >= n_fin and len(released) >= n_rel

    if not c.wait_until(all_in, timeout_s):
        failures.append(
            f"timed out after {timeout_s:g} s: {len(finished)}/{n_fin} pulls "
            f"finished, {len(released)}/{n_rel} exposures released"
        )
    for r in released:
        if r.cause != "completed":
            failures.append(
                f"prefill rank {r.rank} released {r.request_id} without all readers: {r.reason}"
            )
    return finished


def _verify(
    c: Cluster, pre: Instance, dec: Instance, work: Workload, timeout_s: float, failures: list[str]
) -> None:
    for w in dec.workers:
        w.send(Verify(work.decode))
    for w in dec.workers:
        v = c.expect(w, Verified, timeout_s)
        if not v.ok:
            failures.append(v.detail)
    for w in [*pre.workers, *dec.workers]:
        w.send(Status())
    for w in [*pre.workers, *dec.workers]:
        s: StatusReply = c.expect(w, StatusReply, timeout_s)
        if s.held_blocks:
            what = "pinned" if w.role == "prefill" else "held"
            failures.append(f"{w.role} rank {w.rank} still has {s.held_blocks} blocks {what}")
