"""Structural checks every plan must pass, shared by the scenario and property tests."""

from __future__ import annotations

from collections import Counter, defaultdict

from kvbridge.plan.planner import TransferPlan


def check_plan_structure(plan: TransferPlan) -> None:
    # each decode worker reads or copies exactly its (layer, head) cells, each from a
    # holder: a prefill worker, or a decode worker on its host that reads them itself
    for d in plan.decode_workers:
        cells = Counter()
        for r in plan.reads_for(d.rank):
            p = plan.prefill_workers[r.prefill_rank]
            assert p.holds(r.layers, r.kv_heads) and d.holds(r.layers, r.kv_heads)
            for layer in range(*r.layers):
                for head in range(*r.kv_heads):
                    cells[(layer, head)] += 1
        for c in plan.local_copies_for(d.rank):
            assert plan.decode_hosts is not None
            assert plan.decode_hosts[c.source_rank] == plan.decode_hosts[d.rank]
            source = plan.decode_workers[c.source_rank]
            assert source.holds(c.layers, c.kv_heads) and d.holds(c.layers, c.kv_heads)
            assert not plan.local_copies_for(source.rank)  # the source reads them itself
            for layer in range(*c.layers):
                for head in range(*c.kv_heads):
                    cells[(layer, head)] += 1
        want = {(la, h) for la in range(*d.layers) for h in range(*d.kv_heads)}
        assert set(cells) == want and set(cells.values()) == {1}
    # replicas of a head in one pp stage are read within one of each other
    counts = Counter(r.prefill_rank for r in plan.reads)
    replicas = defaultdict(list)
    for w in plan.prefill_workers:
        replicas[(w.pp_rank, w.kv_heads)].append(counts[w.rank])
    for loads in replicas.values():
        assert max(loads) - min(loads) <= 1, loads
    # one notification per distinct reader
    for w in plan.prefill_workers:
        assert plan.expected_notifications[w.rank] == len(plan.readers_of(w.rank))


#: (prefill block size, decode block size, prompt tokens, `TransferPlan.read_end`):
#: equal sizes, a block more than the prompt's on neither side, sizes not multiples
READ_ENDS = [
    (32, 32, 33, 64),
    (32, 32, 64, 64),
    (32, 32, 208, 224),
    (64, 32, 200, 224),
    (32, 64, 200, 224),
    (32, 64, 70, 96),
    (64, 32, 70, 96),
    (16, 24, 40, 48),
    (24, 16, 40, 48),
]
