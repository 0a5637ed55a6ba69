"""Per-request cache bookkeeping for the hybrid model: a growing block table for the attention layers'
paged KV, and one GDN state slot (conv + recurrent state of every GDN layer) per running request.

With prefix caching (cache/prefix_cache.py) full blocks are shared between requests by hash and GDN
states are snapshotted at chosen block boundaries; a request admitted with a hit starts with the hit's
blocks in its table and the snapshot's state in its slot."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.kv_blocks import KVBlockPool
from deltaserve.cache.prefix import TokenSequence
from deltaserve.cache.prefix_cache import PrefixCache, PrefixHit
from deltaserve.cache.snapshots import SnapshotPool


@dataclass(slots=True)
class CacheUsage:
    used_blocks: int
    total_blocks: int
    used_slots: int
    total_slots: int
    cached_blocks: int = 0  # blocks registered for prefix reuse (held or waiting in the LRU queue)
    shared_blocks: int = 0  # blocks held by more than one request
    used_snapshots: int = 0
    total_snapshots: int = 0
    snapshot_bytes: int = 0  # memory of the snapshots held

    @property
    def block_usage(self) -> float:
        return self.used_blocks / self.total_blocks


class CacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int, snapshots: SnapshotPool | None = None,
                 snapshot_interval: int = 512, with_mtp: bool = False) -> None:
        """snapshots: the GDN snapshot pool, which turns prefix caching on (None: off); snapshot_interval:
        tokens between snapshots of a long prompt; with_mtp: the blocks hold the MTP layer's KV too."""
        self.block_size = block_size
        self.blocks = KVBlockPool(num_blocks)
        self.slots = BlockPool(num_slots, "GDN state slot")
        self.block_tables: dict[str, list[int]] = {}
        self.state_slots: dict[str, int] = {}
        self.prefix: PrefixCache | None = None
        if snapshots is not None:
            self.prefix = PrefixCache(self.blocks, snapshots, block_size, snapshot_interval, with_mtp)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks request_id needs so that its first num_tokens tokens have a place."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, request_id: str, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        need_slot = request_id not in self.state_slots
        if need_slot and self.slots.num_free == 0:
            return False
        need = self.blocks_needed(request_id, num_tokens)
        if hit is not None:  # the hit's blocks count as had, and those now free stop being free
            need = max(0, need - len(hit.blocks)) + self.blocks.num_reclaimed_by(hit.blocks)
        return need <= self.blocks.num_free

    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Grow request_id's table to hold num_tokens tokens (and give it a state slot). With a prefix hit
        (a request holding nothing yet), the table starts with the hit's cached blocks and the slot with its
        GDN snapshot. False, with nothing changed, when the pools cannot supply it."""
        if not self.can_allocate(request_id, num_tokens, hit):
            return False
        if request_id not in self.state_slots:
            self.state_slots[request_id] = self.slots.allocate(1)[0]
        if hit is not None and hit.num_tokens:
            assert request_id not in self.block_tables, "a prefix hit starts a request's table"
            self.blocks.touch(hit.blocks)
            self.block_tables[request_id] = list(hit.blocks)
            self.prefix.restore(hit, self.state_slots[request_id])
        new = self.blocks.allocate(self.blocks_needed(request_id, num_tokens))
        self.block_tables.setdefault(request_id, []).extend(new)
        return True

    def free(self, request_id: str) -> None:
        """Return everything request_id holds; a request holding nothing is fine (never scheduled). Its
        cached blocks stay cached (in the LRU queue) for later hits."""
        self.blocks.free(self.block_tables.pop(request_id, []))
        slot = self.state_slots.pop(request_id, None)
        if slot is not None:
            self.slots.free([slot])
        if self.prefix is not None:
            self.prefix.forget(request_id)

    # ---- prefix caching (each a no-op without it) -----------------------------------------------------
    def lookup_prefix(self, seq: TokenSequence) -> PrefixHit:
        """The cached prefix a request about to be admitted (holding nothing) can start from."""
        return PrefixHit() if self.prefix is None else self.prefix.lookup(seq)

    def clip_chunk(self, request_id: str, start: int, num_tokens: int) -> int:
        """A prompt chunk of num_tokens from start, cut so it ends on the request's next snapshot point."""
        if self.prefix is None or num_tokens == 1:  # a decode (most calls) ends on its own token anyway
            return num_tokens
        return self.prefix.clip_chunk(request_id, start, num_tokens)

    def admitted(self, seq: TokenSequence, hit: PrefixHit) -> None:
        """seq was admitted with hit (after allocate succeeded): count it in the prefix cache stats."""
        if self.prefix is not None:
            self.prefix.admitted(seq, hit)

    def after_step(self, entries: list[tuple[TokenSequence, int]]) -> None:
        """(request, context_len) of every request a step ran, after num_computed_tokens advanced and
        before any of them is freed: snapshots and newly cached blocks."""
        if self.prefix is not None:
            self.prefix.after_step(entries, self.block_tables, self.state_slots)

    def owners(self) -> tuple[dict[str, list[int]], dict[str, int]]:
        """Copies of who holds which KV blocks and which GDN state slot (read-only; the inspector's view)."""
        return {rid: list(t) for rid, t in self.block_tables.items()}, dict(self.state_slots)

    def usage(self) -> CacheUsage:
        u = CacheUsage(self.blocks.num_used, self.blocks.num_total, self.slots.num_used, self.slots.num_total)
        if self.prefix is not None:
            snaps = self.prefix.snapshots
            u.cached_blocks, u.shared_blocks = self.blocks.num_cached, self.blocks.num_shared
            u.used_snapshots, u.total_snapshots, u.snapshot_bytes = snaps.num_used, snaps.num_total, snaps.bytes_used
        return u
