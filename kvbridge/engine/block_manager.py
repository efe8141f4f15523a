"""Allocation of KV-cache blocks, by id, with reference counts and a prefix cache.

Block ids are [0, num_blocks) and index the first dim of every cache region on every
worker of the instance (all ranks allocate identically; the driver decides). Freeing a
block whose count is already 0 is a bug and raises.

Prefix caching (automatic, like vLLM's): a *full* block whose K/V is computed can be
registered under a chained hash of its token ids,

    hash[i] = blake2b(hash[i - 1] || token ids of block i),   hash[-1] = the root

where the root is the salt, which names everything else that changes the block's bytes
(model, layout, dtype, tp, block size), and for a request with a `cache_salt` (vLLM's
request parameter: a tenant's namespace) blake2b(salt || cache_salt). Every block's hash
chains back to its request's root, so a block computed under one cache salt is never
found by a request with another salt or none: prefix caching is shared only within a
namespace (no tenant learns from a cache hit what another one sent). A later prompt that starts with the same tokens takes those
blocks by reference instead of computing them again. A hit is confirmed by comparing
the block's token ids and its parent's hash, never by its hash alone. A registered
block whose count drops to 0 is *cached-free*: it counts as free and keeps its K/V until
an allocation needs the memory, which evicts the least recently used one first.

Every block is in exactly one of: in use (count > 0), cached-free, free.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from kvbridge.engine.errors import EngineError, OutOfBlocksError


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained hash of one full block (see the module docstring)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.digest()


class BlockManager:
    """Owned by the driver (LLMEngine); not thread-safe, called from the engine loop only."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        salt: bytes = b"",
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise EngineError(f"num_blocks={num_blocks}, block_size={block_size}: both must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = hashlib.blake2b(salt, digest_size=16).digest()
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # prefix cache: hash -> block; block -> (parent hash, token ids, own hash)
        self._by_hash: dict[bytes, int] = {}
        self._cached: dict[int, tuple[bytes, tuple[int, ...], bytes]] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached-free, LRU first
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free and cached-free."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        """Blocks nobody uses that keep their K/V for a later prompt (evicted on demand)."""
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, in use or not."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` fresh block ids with ref count 1, or OutOfBlocksError (nothing
        taken). Free blocks go first; then cached-free ones, least recently used first."""
        if num_blocks < 0:
            raise EngineError(f"num_blocks={num_blocks} must be >= 0")
        if num_blocks > self.num_free_blocks:
            raise OutOfBlocksError(
                f"need {num_blocks} KV-cache blocks but only {self.num_free_blocks} of "
                f"{self.num_blocks} are free; finish or release requests, or start the "
                f"engine with more blocks (--num-blocks / kv_cache_mb)"
            )
        ids = []
        for _ in range(num_blocks):
            if self._free:
                ids.append(self._free.popleft())
            else:
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
                self.num_evictions += 1
                ids.append(block)
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
        """Drop one reference to each block; a block whose count reaches 0 is free again
        (cached-free if it is registered: most recently used)."""
        for i in block_ids:
            self._check(i)
            if self._ref_counts[i] == 0:
                raise EngineError(f"block {i} freed twice (its ref count is already 0)")
        for i in block_ids:
            self._ref_counts[i] -= 1
            if self._ref_counts[i] == 0:
                if i in self._cached:
                    self._evictable[i] = None
                else:
                    self._free.append(i)

    def ref_count(self, block_id: int) -> int:
        self._check(block_id)
        return self._ref_counts[block_id]

    # ---- prefix cache ----
    def root(self, cache_salt: str | None = None) -> bytes:
        """The parent hash of a request's first block: the salt, or under a request's
        `cache_salt` a hash of both (its own namespace; see the module docstring)."""
        if cache_salt is None:
            return self.salt
        h = hashlib.blake2b(self.salt, digest_size=16, person=b"kvbridge-salt")
        h.update(cache_salt.encode("utf-8", "surrogatepass"))
        return h.digest()

    def match_prefix(
        self,
        token_ids: Sequence[int],
        max_tokens: int | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        """The registered blocks holding the longest cached prefix of `token_ids` (whole
        blocks, at most `max_tokens` tokens) under `cache_salt`, each confirmed by its
        token ids and its parent's hash. Takes no reference: `acquire` them before the
        next allocation."""
        if not self.enable_prefix_caching:
            return []
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        bs, parent, found = self.block_size, self.root(cache_salt), []
        for i in range(limit // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            block = self._by_hash.get(h)
            if block is None or self._cached[block][:2] != (parent, tokens):
                break
            found.append(block)
            parent = h
        return found

    def num_to_acquire(self, block_ids: list[int]) -> int:
        """How many of `block_ids` are cached-free (acquiring them leaves fewer free)."""
        return sum(1 for b in block_ids if b in self._evictable)

    def acquire(self, block_ids: list[int]) -> None:
        """Take a reference to each cached block from `match_prefix` (in use or not)."""
        for i in block_ids:
            if i not in self._cached:
                raise EngineError(f"block {i} is not in the prefix cache; match_prefix first")
        for i in block_ids:
            if self._ref_counts[i] == 0:
                del self._evictable[i]
            self._ref_counts[i] += 1

    def cache_blocks(
        self, block_ids: Sequence[int], token_ids: Sequence[int], cache_salt: str | None = None
    ) -> None:
        """Register the full blocks of a sequence whose K/V for `token_ids` (from token 0)
        sits in `block_ids`, under the request's `cache_salt`. Blocks registered already
        are skipped; a block whose tokens another block holds already stays unregistered
        (that one is the cached copy)."""
        if not self.enable_prefix_caching:
            return
        bs, parent = self.block_size, self.root(cache_salt)
        for i in range(min(len(token_ids) // bs, len(block_ids))):
            block = block_ids[i]
            entry = self._cached.get(block)
            if entry is not None:
                parent = entry[2]
                continue
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            if h not in self._by_hash:
                self._by_hash[h] = block
                self._cached[block] = (parent, tokens, h)
            parent = h

    def _forget(self, block: int) -> None:
        _, _, h = self._cached.pop(block)
        del self._by_hash[h]

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise EngineError(f"block id {block_id} is outside [0, {self.num_blocks})")
