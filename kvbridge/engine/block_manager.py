"""Allocation of KV-cache blocks, by id, with reference counts.

Block ids are [0, num_blocks) and index the first dim of every cache region on every
worker of the instance (all ranks allocate identically; the driver decides). A block is
free iff its ref count is 0. Freeing a block whose count is already 0 is a bug and raises.
"""

from __future__ import annotations

from collections import deque

from kvbridge.engine.errors import EngineError, OutOfBlocksError


class BlockManager:
    """Owned by the driver (LLMEngine); not thread-safe, called from the engine loop only."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise EngineError(f"num_blocks={num_blocks}, block_size={block_size}: both must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` fresh block ids with ref count 1, or OutOfBlocksError (nothing taken)."""
        if num_blocks < 0:
            raise EngineError(f"num_blocks={num_blocks} must be >= 0")
        if num_blocks > len(self._free):
            raise OutOfBlocksError(
                f"need {num_blocks} KV-cache blocks but only {len(self._free)} of "
                f"{self.num_blocks} are free; finish or release requests, or start the "
                f"engine with more blocks (--num-blocks / kv_cache_mb)"
            )
        ids = [self._free.popleft() for _ in range(num_blocks)]
        for i in ids:
            self._ref_counts[i] = 1
        return ids

    def incref(self, block_ids: list[int]) -> None:
        """Share already-allocated blocks (e.g. one prompt's KV read by two consumers)."""
        for i in block_ids:
            self._check(i)
            if self._ref_counts[i] == 0:
                raise EngineError(f"block {i} is free; only allocated blocks can be shared")
        for i in block_ids:
            self._ref_counts[i] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 is free again."""
        for i in block_ids:
            self._check(i)
            if self._ref_counts[i] == 0:
                raise EngineError(f"block {i} freed twice (its ref count is already 0)")
        for i in block_ids:
            self._ref_counts[i] -= 1
            if self._ref_counts[i] == 0:
                self._free.append(i)

    def ref_count(self, block_id: int) -> int:
        self._check(block_id)
        return self._ref_counts[block_id]

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise EngineError(f"block id {block_id} is outside [0, {self.num_blocks})")
