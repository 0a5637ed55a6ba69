"""Per-request cache bookkeeping for the hybrid model: a growing block table for the attention layers'
paged KV, and one GDN state slot (conv + recurrent state of every GDN layer) per running request."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.cache.block_pool import BlockPool


@dataclass(slots=True)
class CacheUsage:
    used_blocks: int
    total_blocks: int
    used_slots: int
    total_slots: int

    @property
    def block_usage(self) -> float:
        return self.used_blocks / self.total_blocks


class CacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks, "KV block")
        self.slots = BlockPool(num_slots, "GDN state slot")
        self.block_tables: dict[str, list[int]] = {}
        self.state_slots: dict[str, int] = {}

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks request_id needs so that its first num_tokens tokens have a place."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        need_slot = request_id not in self.state_slots
        if need_slot and self.slots.num_free == 0:
            return False
        return self.blocks_needed(request_id, num_tokens) <= self.blocks.num_free

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow request_id's table to hold num_tokens tokens (and give it a state slot). False, with nothing
        changed, when the pools cannot supply it."""
        if not self.can_allocate(request_id, num_tokens):
            return False
        if request_id not in self.state_slots:
            self.state_slots[request_id] = self.slots.allocate(1)[0]
        new = self.blocks.allocate(self.blocks_needed(request_id, num_tokens))
        self.block_tables.setdefault(request_id, []).extend(new)
        return True

    def free(self, request_id: str) -> None:
        """Return everything request_id holds; a request holding nothing is fine (never scheduled)."""
        self.blocks.free(self.block_tables.pop(request_id, []))
        slot = self.state_slots.pop(request_id, None)
        if slot is not None:
            self.slots.free([slot])

    def owners(self) -> tuple[dict[str, list[int]], dict[str, int]]:
        """Copies of who holds which KV blocks and which GDN state slot (read-only; the inspector's view)."""
        return {rid: list(t) for rid, t in self.block_tables.items()}, dict(self.state_slots)

    def usage(self) -> CacheUsage:
        return CacheUsage(
            self.blocks.num_used, self.blocks.num_total, self.slots.num_used, self.slots.num_total
        )
