"""Automatic prefix caching: hits, confirmation, sharing, LRU eviction; same tokens."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.engine import block_manager as bm_module
from kvbridge.engine.block_manager import BlockManager
from kvbridge.engine.errors import EngineError
from kvbridge.engine.llm_engine import LLMEngine
from kvbridge.engine.sampling import SamplingParams


def _sequence(bm: BlockManager, tokens: list[int], cache_salt: str | None = None) -> list[int]:
    """Blocks for `tokens`, computed and registered, as a finished prefill leaves them."""
    hit = bm.match_prefix(tokens, cache_salt=cache_salt)
    bm.acquire(hit)
    ids = hit + bm.allocate(bm.blocks_for(len(tokens)) - len(hit))
    bm.cache_blocks(ids, tokens, cache_salt)
    return ids


def test_a_prompt_hits_the_full_blocks_of_an_earlier_one_and_shares_them() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    first = _sequence(bm, list(range(10)))  # blocks [0-3] [4-7] full, [8, 9] partial
    assert bm.match_prefix(list(range(10))) == first[:2]
    assert bm.match_prefix([*range(8), 99, 98]) == first[:2]
    assert bm.match_prefix([0, 1, 2, 3, 4, 5, 6, 99]) == first[:1]
    assert bm.match_prefix(list(range(10)), max_tokens=7) == first[:1]
    second = _sequence(bm, [*range(8), 50, 51, 52, 53, 54])
    assert second[:2] == first[:2] and [bm.ref_count(b) for b in second[:2]] == [2, 2]
    bm.free(first)
    assert [bm.ref_count(b) for b in second[:2]] == [1, 1]  # still held by the second


def test_a_hash_match_is_confirmed_by_the_token_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    _sequence(bm, [1, 2, 3, 4])
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, tokens: b"same for all")
    bm2 = BlockManager(8, 4, enable_prefix_caching=True)
    _sequence(bm2, [1, 2, 3, 4])
    assert bm2.match_prefix([1, 2, 3, 4]) != []
    assert bm2.match_prefix([5, 6, 7, 8]) == []  # same hash, other tokens: a miss


def test_the_salt_separates_caches_and_disabled_caching_never_hits() -> None:
    a = BlockManager(8, 4, enable_prefix_caching=True, salt=b"model a")
    b = BlockManager(8, 4, enable_prefix_caching=True, salt=b"model b")
    ids_a = _sequence(a, [1, 2, 3, 4])
    assert a.salt != b.salt and a.match_prefix([1, 2, 3, 4]) == ids_a[:1]
    off = BlockManager(8, 4)
    _sequence(off, [1, 2, 3, 4])
    assert off.match_prefix([1, 2, 3, 4]) == [] and off.num_cached_blocks == 0


def test_a_cache_salt_shares_blocks_only_with_requests_of_the_same_salt() -> None:
    """vLLM's cache_salt: the salt enters the first block's hash, so every block of a
    salted request chains to its namespace; another salt, or none, never finds it."""
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    secret = [7, 7, 7, 7, 1, 2, 3, 4, 9]
    victim = _sequence(bm, secret, cache_salt="tenant-a")
    assert bm.match_prefix(secret, cache_salt="tenant-a") == victim[:2]
    for other in ("tenant-b", "", None):
        assert bm.match_prefix(secret, cache_salt=other) == [], other
    # another namespace computes and registers its own copy; neither sees the other's
    attacker = _sequence(bm, secret, cache_salt="tenant-b")
    assert set(attacker).isdisjoint(victim)
    assert bm.match_prefix(secret, cache_salt="tenant-b") == attacker[:2]
    assert bm.match_prefix(secret, cache_salt="tenant-a") == victim[:2]
    shared = _sequence(bm, secret)  # unsalted requests share among themselves only
    assert set(shared).isdisjoint(victim + attacker)
    assert bm.match_prefix(secret) == shared[:2]


def test_cached_free_blocks_count_as_free_and_are_evicted_least_recently_used_first() -> None:
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    old = _sequence(bm, [1, 2])
    new = _sequence(bm, [3, 4])
    bm.free(old)
    bm.free(new)  # freed last: used most recently
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 2
    bm.allocate(2)  # the two never-cached blocks first: nothing evicted
    assert bm.num_evictions == 0 and bm.match_prefix([1, 2]) == old
    bm.allocate(1)  # now the least recently used cached block goes
    assert bm.num_evictions == 1
    assert bm.match_prefix([1, 2]) == [] and bm.match_prefix([3, 4]) == new


def test_acquiring_a_cached_free_block_takes_it_out_of_the_free_count() -> None:
    bm = BlockManager(2, 2, enable_prefix_caching=True)
    ids = _sequence(bm, [1, 2])
    bm.free(ids)
    hit = bm.match_prefix([1, 2, 3])
    assert bm.num_to_acquire(hit) == 1
    bm.acquire(hit)
    assert bm.num_free_blocks == 1 and bm.ref_count(hit[0]) == 1
    with pytest.raises(EngineError, match="not in the prefix cache"):
        bm.acquire(bm.allocate(1))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 2), min_size=1, max_size=9)), max_size=40
    )
)
def test_random_requests_keep_every_block_in_exactly_one_state(
    ops: list[tuple[bool, list[int]]],
) -> None:
    """In use, cached-free or free, never two; frees never double; hits hold their tokens."""
    bm = BlockManager(10, 2, enable_prefix_caching=True)
    held: list[tuple[list[int], list[int]]] = []
    for is_free, tokens in ops:
        if is_free and held:
            bm.free(held.pop(0)[0])
            continue
        hit = bm.match_prefix(tokens)
        need = bm.blocks_for(len(tokens)) - len(hit)
        if not bm.can_allocate(need + bm.num_to_acquire(hit)):
            continue
        ids = _sequence(bm, tokens)
        assert ids[: len(hit)] == hit
        held.append((ids, tokens))
    in_use = {b for ids, _ in held for b in ids}
    assert bm.num_free_blocks == bm.num_blocks - len(in_use)
    for _, tokens in held:  # what a later prompt would hit is what these blocks hold
        for i, block in enumerate(bm.match_prefix(tokens)):
            assert bm._cached[block][1] == tuple(tokens[2 * i : 2 * i + 2])
    for ids, _ in held:
        bm.free(ids)
    assert bm.num_free_blocks == bm.num_blocks
    assert all(bm.ref_count(i) == 0 for i in range(bm.num_blocks))


SYSTEM = (
    "You are a helpful assistant. The user asks about the geography of Europe and "
    "wants short, precise answers. Question: What is the capital of France?"
)


@pytest.mark.slow
@pytest.mark.parametrize("config", [{"tp_size": 1}, {"tp_size": 3}], ids=["tp1", "tp3"])
def test_a_conversation_computes_only_its_new_turn_with_the_same_tokens(
    engine_factory: Callable[..., LLMEngine], config: dict[str, object]
) -> None:
    cached = engine_factory(**config)  # the engines other tests use too
    plain = engine_factory(**config, enable_prefix_caching=False)
    bs = cached.config.block_size
    params = SamplingParams(max_tokens=8)
    conversation, previous = SYSTEM, 0
    for turn in range(3):
        a = cached.generate([conversation], params)[0]
        b = plain.generate([conversation], params)[0]
        assert a.token_ids == b.token_ids, turn
        assert b.num_cached_tokens == 0
        # the earlier turn's full blocks are reused (but one, should the tokenizer merge
        # across the join), never the last token
        assert (previous // bs - 1) * bs <= a.num_cached_tokens < len(a.prompt_ids), turn
        if turn:
            assert a.num_cached_tokens > 0
        previous = len(a.prompt_ids) + len(a.token_ids) - 1  # the tokens whose K/V exist
        conversation += a.text + f" Question {turn}: and the capital of Spain?"
    bm = cached.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_cached_free_blocks > 0
