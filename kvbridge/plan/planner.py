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
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import IncompatibleError
from kvbridge.plan.geometry import ModelKVSpec
from kvbridge.plan.layout import InstanceLayout, WorkerShard


@dataclass(frozen=True)
class Read:
    """One decode worker's read from one prefill worker, for every request.

    `kv_heads` are global head indices and `layers` global layer indices (half-open);
    `bytes_per_token` counts K and V (MLA: the latent) of all of them.
    """

    decode_rank: int
    prefill_rank: int
    kv_heads: tuple[int, int]
    layers: tuple[int, int]
    bytes_per_token: int

    @property
    def num_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class TransferPlan:
    """Every read between the workers of a prefill and a decode instance.

    Built by `make_plan`; immutable and request-independent, so one plan serves every
    request between the same two instances. `expected_notifications[p]` is how many
    decode workers notify prefill worker `p` per request.
    """

    model: ModelKVSpec
    prefill: InstanceLayout
    decode: InstanceLayout
    prefill_workers: tuple[WorkerShard, ...]
    decode_workers: tuple[WorkerShard, ...]
    reads: tuple[Read, ...]
    expected_notifications: tuple[int, ...]

    def reads_for(self, decode_rank: int) -> tuple[Read, ...]:
        return tuple(r for r in self.reads if r.decode_rank == decode_rank)

    def readers_of(self, prefill_rank: int) -> tuple[int, ...]:
        return tuple(sorted({r.decode_rank for r in self.reads if r.prefill_rank == prefill_rank}))

    @property
    def bytes_per_token(self) -> int:
        """Bytes all decode workers read per token (replicas each read their copy)."""
        return sum(r.bytes_per_token for r in self.reads)


def check_compatible(
    prefill_model: ModelKVSpec,
    decode_model: ModelKVSpec,
    prefill: InstanceLayout,
    decode: InstanceLayout,
) -> None:
    """Raise IncompatibleError if the two instances cannot share a KV cache."""
    fields = ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "attention")
    for field in fields:
        p, d = getattr(prefill_model, field), getattr(decode_model, field)
        if p != d:
            p, d = getattr(p, "value", p), getattr(d, "value", d)
            raise IncompatibleError(
                f"prefill and decode run different models: prefill {field}={p}, decode "
                f"{field}={d}; both instances must serve the same model"
            )
    p_dtype, d_dtype = prefill.kv_dtype(prefill_model), decode.kv_dtype(decode_model)
    if p_dtype != d_dtype:
        raise IncompatibleError(
            f"prefill KV dtype={p_dtype} but decode KV dtype={d_dtype}; KV bytes are copied "
            f"as they are, so both instances must use the same cache dtype"
        )


def make_plan(
    prefill_model: ModelKVSpec,
    prefill: InstanceLayout,
    decode: InstanceLayout,
    decode_model: ModelKVSpec | None = None,
) -> TransferPlan:
    """Plan the reads between two instance layouts of the same model.

    Raises LayoutError when a layout is invalid for the model and IncompatibleError
    when the two sides differ in model or cache dtype; both name the values and what
    would work.
    """
    decode_model = decode_model or prefill_model
    check_compatible(prefill_model, decode_model, prefill, decode)
    model = prefill_model.with_dtype(prefill.kv_dtype(prefill_model))
    p_workers = prefill.workers(model, "prefill")
    d_workers = decode.workers(model, "decode")
    p_stages = prefill.layer_ranges(model, "prefill")

    # holders[(pp_rank, head)] -> prefill ranks holding that head in that stage (replicas)
    holders: dict[tuple[int, int], list[int]] = defaultdict(list)
    for w in p_workers:
        for h in range(*w.kv_heads):
            holders[(w.pp_rank, h)].append(w.rank)
    load: dict[int, int] = defaultdict(int)  # reads assigned per prefill worker

    reads: list[Read] = []
    for d in d_workers:
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
        model, prefill, decode, tuple(p_workers), tuple(d_workers), tuple(reads), expected
    )
    _check_cover(plan)
    return plan


def _check_cover(plan: TransferPlan) -> None:
    """Internal invariant: every decode worker's (layer, head) cells are read exactly
    once, each from a prefill worker that holds them."""
    for d in plan.decode_workers:
        covered = np.zeros((d.num_local_layers, d.num_local_heads), dtype=np.int64)
        for r in plan.reads_for(d.rank):
            assert d.holds(r.layers, r.kv_heads), (d, r)
            assert plan.prefill_workers[r.prefill_rank].holds(r.layers, r.kv_heads), r
            covered[
                r.layers[0] - d.layers[0] : r.layers[1] - d.layers[0],
                r.kv_heads[0] - d.kv_heads[0] : r.kv_heads[1] - d.kv_heads[0],
            ] += 1
        assert (covered == 1).all(), (d, covered)
