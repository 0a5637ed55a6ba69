"""GDN state snapshots for prefix caching ("align" mode): the conv and recurrent state of every GDN layer
after exactly n tokens of a prefix, n a multiple of the block size, keyed by the hash of the prefix's last
block. A prefix hit needs one: unlike attention K/V, a recurrent state cannot be rebuilt from a shorter
one without running the tokens again.

The pool has its own tensors and a fixed number of entries (its memory budget, from the planner); when
full, the least recently used snapshot makes room. Saving and restoring are index copies between a
state slot of the shared cache tensors and an entry, so they work for every executor."""

from __future__ import annotations

from collections import OrderedDict

import torch

from deltaserve.cache.prefix import BlockHash
from deltaserve.model.context import CacheTensors


class SnapshotPool:
    def __init__(self, cache: CacheTensors, num_snapshots: int) -> None:
        if num_snapshots <= 0:
            raise ValueError(f"a GDN snapshot pool needs at least one entry, got {num_snapshots}")
        self.cache = cache
        self.num_total = num_snapshots
        # layer id -> [S, conv_dim, K-1] and [S, Hv, dk, dv], in the slots' dtypes
        self.conv = {i: torch.zeros((num_snapshots, *t.shape[1:]), dtype=t.dtype) for i, t in cache.conv.items()}
        self.ssm = {i: torch.zeros((num_snapshots, *t.shape[1:]), dtype=t.dtype) for i, t in cache.ssm.items()}
        self._entries: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_snapshots - 1, -1, -1))
        self.num_saved = 0
        self.num_evicted = 0

    @property
    def bytes_per_snapshot(self) -> int:
        tensors = list(self.conv.values()) + list(self.ssm.values())
        return sum(t[0].numel() * t.element_size() for t in tensors)

    @property
    def num_used(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        return self.num_used * self.bytes_per_snapshot

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._entries

    def save(self, key: BlockHash, slot: int, replacing: BlockHash | None = None) -> bool:
        """Keep state slot `slot` as the snapshot for key (a key already held is only marked used). With
        `replacing` (a key held or not), its entry is reused instead of taking another. True when key's
        entry was written (the caller may later replace it), False when key was held already."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return False
        if replacing is not None and replacing in self._entries:
            entry = self._entries.pop(replacing)
        elif self._free:
            entry = self._free.pop()
        else:
            _, entry = self._entries.popitem(last=False)
            self.num_evicted += 1
        for i, t in self.conv.items():
            t[entry].copy_(self.cache.conv[i][slot])
        for i, t in self.ssm.items():
            t[entry].copy_(self.cache.ssm[i][slot])
        self._entries[key] = entry
        self.num_saved += 1
        return True

    def restore(self, key: BlockHash, slot: int) -> None:
        """Load the snapshot for key into state slot `slot` (key must be held)."""
        entry = self._entries[key]
        self._entries.move_to_end(key)
        for i, t in self.conv.items():
            self.cache.conv[i][slot].copy_(t[entry])
        for i, t in self.ssm.items():
            self.cache.ssm[i][slot].copy_(t[entry])
