"""The block manager: allocation, ref counts, exhaustion errors, no leaks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.engine.block_manager import BlockManager
from kvbridge.engine.errors import EngineError, OutOfBlocksError


def test_allocate_gives_distinct_ids_in_range() -> None:
    bm = BlockManager(8, 16)
    ids = bm.allocate(5) + bm.allocate(3)
    assert sorted(ids) == list(range(8))
    assert bm.num_free_blocks == 0


def test_out_of_blocks_names_the_numbers_and_takes_nothing() -> None:
    bm = BlockManager(4, 16)
    bm.allocate(3)
    with pytest.raises(OutOfBlocksError, match="need 2 KV-cache blocks but only 1 of 4 are free"):
        bm.allocate(2)
    assert bm.num_free_blocks == 1


def test_ref_counts_keep_shared_blocks_until_last_free() -> None:
    bm = BlockManager(4, 16)
    ids = bm.allocate(2)
    bm.incref(ids)
    assert [bm.ref_count(i) for i in ids] == [2, 2]
    bm.free(ids)
    assert bm.num_free_blocks == 2  # still held by the second reference
    bm.free(ids)
    assert bm.num_free_blocks == 4


def test_double_free_and_bad_ids_raise() -> None:
    bm = BlockManager(4, 16)
    ids = bm.allocate(1)
    bm.free(ids)
    with pytest.raises(EngineError, match="freed twice"):
        bm.free(ids)
    with pytest.raises(EngineError, match=r"outside \[0, 4\)"):
        bm.free([7])
    with pytest.raises(EngineError, match="is free"):
        bm.incref([0])


def test_blocks_for_rounds_up() -> None:
    bm = BlockManager(4, 16)
    assert [bm.blocks_for(n) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=60))
def test_random_alloc_free_never_leaks_or_duplicates(ops: list[tuple[bool, int]]) -> None:
    bm = BlockManager(16, 4)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            if bm.can_allocate(n):
                held.append(bm.allocate(n))
            else:
                with pytest.raises(OutOfBlocksError):
                    bm.allocate(n)
        elif held:
            bm.free(held.pop(n % len(held)))
        owned = [i for ids in held for i in ids]
        assert len(owned) == len(set(owned))
        assert bm.num_free_blocks + len(owned) == 16
    for ids in held:
        bm.free(ids)
    assert bm.num_free_blocks == 16
