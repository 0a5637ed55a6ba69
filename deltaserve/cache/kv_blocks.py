"""The KV block pool of the attention layers, with prefix caching: reference-counted blocks, a map from
block hash to the cached blocks holding it, and an LRU queue of freed cached blocks.

A block is in one of three states: in use (ref_count > 0; shared when > 1), free and cached (ref_count 0,
its hash still registered, waiting in the LRU queue: a later request with that prefix takes it back), or
free and plain. Allocation takes plain blocks first and evicts the least recently freed cached block only
when none is left, so cached prefixes live until memory is actually needed.

Without prefix caching no hash is ever registered and the pool is a plain FIFO free list."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from deltaserve.cache.block_pool import CacheExhaustedError
from deltaserve.cache.prefix import BlockHash


@dataclass(slots=True)
class CachedBlock:
    block_id: int
    # The token after this block in the sequence that wrote it (None without speculation): the MTP layer's
    # entry at the block's last position was made from it, so it is valid only for sequences with the
    # same next token.
    next_token: int | None


class KVBlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a KV block pool needs at least one block, got {num_blocks}")
        self.num_total = num_blocks
        self.ref_counts = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._plain: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._cached: dict[BlockHash, dict[int, CachedBlock]] = {}
        self.num_evicted = 0
        # Kept as counts (not recounted) because the server reads them after every step.
        self.num_cached = 0  # blocks whose hash is registered (in use or waiting in the LRU queue)
        self.num_shared = 0  # blocks held by more than one request right now

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: plain ones plus cached ones no request holds."""
        return len(self._plain) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_total - self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise CacheExhaustedError(f"asked for {n} KV blocks, only {self.num_free} free")
        out = []
        for _ in range(n):
            if self._plain:
                b = self._plain.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._uncache(b)
                self.num_evicted += 1
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take one more reference on cached blocks (a prefix hit); free ones leave the LRU queue."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._evictable[b]
            elif self.ref_counts[b] == 1:
                self.num_shared += 1
            self.ref_counts[b] += 1

    def num_reclaimed_by(self, blocks: list[int]) -> int:
        """How many of these blocks touch() would take out of the free count."""
        return sum(1 for b in set(blocks) if self.ref_counts[b] == 0)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference on each block. The tail of a sequence is queued first, so it is evicted before
        the prefix it extends (which more requests are likely to share)."""
        for b in reversed(blocks):
            if self.ref_counts[b] <= 0:
                raise ValueError(f"KV block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 1:
                self.num_shared -= 1
            elif self.ref_counts[b] == 0:
                if self._hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._plain.append(b)

    def cache(self, block: int, block_hash: BlockHash, next_token: int | None) -> None:
        """Register an in-use, fully written block under its hash. A block equal to one already cached
        (same hash, same next token) stays plain: it is freed normally and the first copy serves hits."""
        if self._hash[block] is not None:
            return
        holders = self._cached.setdefault(block_hash, {})
        if any(c.next_token == next_token for c in holders.values()):
            return
        holders[block] = CachedBlock(block, next_token)
        self._hash[block] = block_hash
        self.num_cached += 1

    def lookup(self, block_hash: BlockHash) -> list[CachedBlock]:
        """The cached blocks holding this hash (empty if none)."""
        holders = self._cached.get(block_hash)
        return list(holders.values()) if holders else []

    def _uncache(self, block: int) -> None:
        h = self._hash[block]
        self._hash[block] = None
        holders = self._cached[h]
        del holders[block]
        if not holders:
            del self._cached[h]
        self.num_cached -= 1
