"""The transfer plan: which bytes every decode worker reads from which prefill worker.

For a pair of instance layouts of the same model, each decode worker must end up
holding the KV of its layers x its KV heads. The plan covers that set exactly with
`Read`s, each naming one prefill worker that holds the read's layers and heads:

    decode worker d: layers [a, b) x heads [h, k)
        split [a, b) at the prefill pp stage boundaries    -> one segment per stage
        split [h, k) at the prefill tp head boundaries     -> one read per holder
        replicated heads (prefill tp > num_kv_heads): choose the replica with the
        fewest reads so far, so replicas' read counts differ by at most one.

Each decode worker notifies every prefill worker it read from once per request, so
a prefill worker expects as many notifications as it has distinct readers; an unused
replica expects none and may free its blocks as soon as prefill is done.

Fan-out on a decode host (`decode_hosts` given: each decode worker's host identity).
Decode workers that hold the same layers and heads (GQA heads replicated when decode tp
> num_kv_heads; MLA's latent, held by every tp worker of a pp stage) need the same
bytes. When several of them share a host, only the first (lowest rank) reads them over
the link; each other one gets a `LocalCopy` from it, a second hop on the host once the
reader's reads are done:

    SmolLM2 (3 KV heads), decode tp 9 on one host:
        workers 0, 1, 2 hold head 0: worker 0 reads it; 1 and 2 copy from worker 0
        link bytes per token: 1x the distinct KV (3x without fan-out)

Only the link readers notify the prefill workers. Without `decode_hosts` every decode
worker reads its own bytes, as before.

A KV dtype converted in flight (`cast.py`): when the decode cache keeps another dtype
than the prefill's (float32, bfloat16, float16), the plan's `cast` says which, its
`decode` is the layout the reads land in (the decode workers' staging: their cache's
layout in the prefill's dtype) and every decode worker reads its own bytes (no fan-out:
a second hop would copy converted bytes, which the plan counts in the prefill's dtype).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import IncompatibleError, LayoutError
from kvbridge.plan.cast import Cast, check_castable, staging_layout
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import InstanceLayout, WorkerShard


class _Cells:
    """Half-open global `kv_heads` x `layers` of a read or a local copy."""

    kv_heads: tuple[int, int]
    layers: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class Read(_Cells):
    """One decode worker's read from one prefill worker, for every request.

    `kv_heads` are global head indices and `layers` global layer indices (half-open);
    `bytes_per_token` counts K and V (MLA: the latent) of all of them.
    """

    decode_rank: int
    prefill_rank: int
    kv_heads: tuple[int, int]
    layers: tuple[int, int]
    bytes_per_token: int


@dataclass(frozen=True)
class LocalCopy(_Cells):
    """A decode worker's copy of cells that another decode worker on its host reads over
    the link (the second hop of a fan-out), for every request.

    `source_rank` holds the same `layers` x `kv_heads` (global, half-open) and reads them
    itself; the copy may start once the source's reads of the request are done, and
    covers the same tokens. `bytes_per_token` counts K and V (MLA: the latent).
    """

    decode_rank: int
    source_rank: int
    kv_heads: tuple[int, int]
    layers: tuple[int, int]
    bytes_per_token: int


def whole_block_end(num_tokens: int, prefill_block: int, decode_block: int) -> int:
    """Where a pull of a request's first `num_tokens` tokens stops reading: on to the
    end of the last block where both sides' last blocks go on,

        min(ceil(n / bp) * bp, ceil(n / bd) * bd)      (bp, bd: the block sizes)

    so the prompt's partial last block moves whole (a run per page, like a full block)
    instead of cut at its last token (in a channel-major page: a run per channel). The
    slots past the last token are the decode request's own, unused until it computes
    them; the producer zeroes its own there before it exposes them (other requests' KV
    may lie in them)."""
    bp, bd = prefill_block, decode_block
    return min(-(-num_tokens // bp) * bp, -(-num_tokens // bd) * bd)


@dataclass(frozen=True)
class TransferPlan:
    """Every read between the workers of a prefill and a decode instance.

    Built by `make_plan`; immutable and request-independent, so one plan serves every
    request between the same two instances. `expected_notifications[p]` is how many
    decode workers notify prefill worker `p` per request. `reads` cross from the prefill
    instance (over the link when it runs on another host); `local_copies` are the
    second hops on a decode host (empty unless planned with `decode_hosts`). `cast`
    converts the KV on the decode side when its cache dtype differs: `decode` is then the
    layout the reads land in (the staging, in the prefill's dtype), `cast.dst` the
    dtype of the decode cache the decode workers cast it into.
    """

    model: ModelKVSpec
    prefill: InstanceLayout
    decode: InstanceLayout
    prefill_workers: tuple[WorkerShard, ...]
    decode_workers: tuple[WorkerShard, ...]
    reads: tuple[Read, ...]
    expected_notifications: tuple[int, ...]
    local_copies: tuple[LocalCopy, ...] = ()
    decode_hosts: tuple[str, ...] | None = None  # decode rank -> host identity
    cast: Cast | None = None  # the decode side converts what it reads

    def reads_for(self, decode_rank: int) -> tuple[Read, ...]:
        return tuple(r for r in self.reads if r.decode_rank == decode_rank)

    def local_copies_for(self, decode_rank: int) -> tuple[LocalCopy, ...]:
        return tuple(c for c in self.local_copies if c.decode_rank == decode_rank)

    @property
    def same_pages(self) -> bool:
        """Whether each decode worker's page of a block is byte for byte the page of the
        prefill worker of its own rank, read from that worker alone: both instances
        alike (tp_size, pp_size, block_size, layout, dtype) and no fan-out. Only then may
        a page that holds no heads or tokens (an SSM layer's state, sharded its own way)
        move whole."""
        p, d = self.prefill, self.decode
        return (
            (p.tp_size, p.pp_size, p.block_size, p.cache_layout, p.dtype)
            == (d.tp_size, d.pp_size, d.block_size, d.cache_layout, d.dtype)
            and self.cast is None
            and not self.local_copies
            and all(r.prefill_rank == r.decode_rank for r in self.reads)
        )

    def readers_of(self, prefill_rank: int) -> tuple[int, ...]:
        return tuple(sorted({r.decode_rank for r in self.reads if r.prefill_rank == prefill_rank}))

    def read_end(self, num_tokens: int) -> int:
        """Where a pull of a request's first `num_tokens` tokens stops reading
        (`whole_block_end` of this pair's block sizes)."""
        return whole_block_end(num_tokens, self.prefill.block_size, self.decode.block_size)

    @property
    def bytes_per_token(self) -> int:
        """Bytes all decode workers receive per token (replicas each get their copy),
        over the link and on the host together."""
        return self.link_bytes_per_token + self.local_bytes_per_token

    @property
    def link_bytes_per_token(self) -> int:
        """Bytes read from the prefill workers per token: what crosses the link when the
        prefill and decode instances run on different hosts."""
        return sum(r.bytes_per_token for r in self.reads)

    @property
    def local_bytes_per_token(self) -> int:
        """Bytes copied between decode workers of one host per token (the second hop)."""
        return sum(c.bytes_per_token for c in self.local_copies)


def check_compatible(
    prefill_model: ModelKVSpec,
    decode_model: ModelKVSpec,
    prefill: InstanceLayout,
    decode: InstanceLayout,
) -> None:
    """Raise IncompatibleError if the two instances cannot share a KV cache: another
    model, or cache dtypes that do not convert (`cast.CASTABLE`)."""
    fields = ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "attention")
    for field in fields:
        p, d = getattr(prefill_model, field), getattr(decode_model, field)
        if p != d:
            p, d = getattr(p, "value", p), getattr(d, "value", d)
            raise IncompatibleError(
                f"prefill and decode run different models: prefill {field}={p}, decode "
                f"{field}={d}; both instances must serve the same model"
            )
    check_castable(prefill.kv_dtype(prefill_model), decode.kv_dtype(decode_model))


def make_plan(
    prefill_model: ModelKVSpec,
    prefill: InstanceLayout,
    decode: InstanceLayout,
    decode_model: ModelKVSpec | None = None,
    *,
    decode_hosts: Sequence[str] | None = None,
) -> TransferPlan:
    """Plan the reads between two instance layouts of the same model; with
    `decode_hosts` (decode rank -> host identity), decode workers holding the same cells
    on one host fan out: one reads, the others copy from it (`LocalCopy`).

    Raises LayoutError when a layout is invalid for the model (or `decode_hosts` does
    not name one host per decode worker) and IncompatibleError when the two sides
    differ in model or in cache dtypes that do not convert; both name the values and
    what would work. Cache dtypes that convert give a plan with a `cast` (no fan-out).
    """
    decode_model = decode_model or prefill_model
    check_compatible(prefill_model, decode_model, prefill, decode)
    model = prefill_model.with_dtype(prefill.kv_dtype(prefill_model))
    cast = None
    if decode.kv_dtype(decode_model) != model.dtype:
        cast = Cast(model.dtype, decode.kv_dtype(decode_model))
        decode, decode_hosts = staging_layout(decode, model.dtype), None
    p_workers = prefill.workers(model, "prefill")
    d_workers = decode.workers(model, "decode")
    p_stages = prefill.layer_ranges(model, "prefill")
    hosts = _check_hosts(decode_hosts, len(d_workers))

    # fan-out: the first decode worker holding a shard's cells on a host reads them
    source: dict[tuple[str, tuple[int, int], tuple[int, int]], int] = {}
    local: list[LocalCopy] = []
    readers_d = []
    for d in d_workers:
        if hosts is None:
            readers_d.append(d)
            continue
        src = source.setdefault((hosts[d.rank], d.kv_heads, d.layers), d.rank)
        if src == d.rank:
            readers_d.append(d)
            continue
        per_token = d.num_local_layers * model.num_kv_tensors * d.num_local_heads * model.head_bytes
        local.append(LocalCopy(d.rank, src, d.kv_heads, d.layers, per_token))

    # holders[(pp_rank, head)] -> prefill ranks holding that head in that stage (replicas)
    holders: dict[tuple[int, int], list[int]] = defaultdict(list)
    for w in p_workers:
        for h in range(*w.kv_heads):
            holders[(w.pp_rank, h)].append(w.rank)
    load: dict[int, int] = defaultdict(int)  # reads assigned per prefill worker

    reads: list[Read] = []
    for d in readers_d:
        for pp_rank, (s0, s1) in enumerate(p_stages):
            la, lb = max(d.layers[0], s0), min(d.layers[1], s1)
            if la >= lb:
                continue
            h = d.kv_heads[0]
            while h < d.kv_heads[1]:
                candidates = holders[(pp_rank, h)]
                src = min(candidates, key=lambda r: (load[r], r))
                load[src] += 1
                # extend the read over the following heads this worker also holds
                end = min(d.kv_heads[1], p_workers[src].kv_heads[1])
                per_token = (lb - la) * model.num_kv_tensors * (end - h) * model.head_bytes
                reads.append(Read(d.rank, src, (h, end), (la, lb), per_token))
                h = end

    readers: dict[int, set[int]] = defaultdict(set)
    for r in reads:
        readers[r.prefill_rank].add(r.decode_rank)
    expected = tuple(len(readers[w.rank]) for w in p_workers)
    plan = TransferPlan(
        model,
        prefill,
        decode,
        tuple(p_workers),
        tuple(d_workers),
        tuple(reads),
        expected,
        tuple(local),
        hosts,
        cast,
    )
    _check_cover(plan)
    return plan


def _check_hosts(decode_hosts: Sequence[str] | None, num_workers: int) -> tuple[str, ...] | None:
    if decode_hosts is None:
        return None
    hosts = tuple(decode_hosts)
    if len(hosts) != num_workers or not all(isinstance(h, str) and h for h in hosts):
        raise LayoutError(
            f"decode_hosts={list(hosts)!r} must name one host (a non-empty string) per "
            f"decode worker: {num_workers} of them, in rank order"
        )
    return hosts


def _check_cover(plan: TransferPlan) -> None:
    """Internal invariant: every decode worker's (layer, head) cells are read or copied
    exactly once, each from a prefill worker that holds them or from a decode worker on
    the same host that holds them and reads them itself."""
    for c in plan.local_copies:
        src = plan.decode_workers[c.source_rank]
        assert plan.decode_hosts is not None, c
        assert plan.decode_hosts[c.source_rank] == plan.decode_hosts[c.decode_rank], c
        assert src.holds(c.layers, c.kv_heads) and not plan.local_copies_for(src.rank), c
    for d in plan.decode_workers:
        covered = np.zeros((d.num_local_layers, d.num_local_heads), dtype=np.int64)
        for r in plan.reads_for(d.rank):
            assert d.holds(r.layers, r.kv_heads), (d, r)
            assert plan.prefill_workers[r.prefill_rank].holds(r.layers, r.kv_heads), r
            covered[
                r.layers[0] - d.layers[0] : r.layers[1] - d.layers[0],
                r.kv_heads[0] - d.kv_heads[0] : r.kv_heads[1] - d.kv_heads[0],
            ] += 1
        for c in plan.local_copies_for(d.rank):
            assert d.holds(c.layers, c.kv_heads), (d, c)
            covered[
                c.layers[0] - d.layers[0] : c.layers[1] - d.layers[0],
                c.kv_heads[0] - d.kv_heads[0] : c.kv_heads[1] - d.kv_heads[0],
            ] += 1
        assert (covered == 1).all(), (d, covered)
