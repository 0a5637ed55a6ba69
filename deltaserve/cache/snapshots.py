"""GDN state snapshots for prefix caching ("align" mode): the conv and recurrent state of every GDN layer
after exactly n tokens of a prefix, n a multiple of the block size, keyed by the hash of the prefix's last
block. A hit needs one: unlike attention K/V, a recurrent state cannot be rebuilt from a shorter one
without running the tokens again.

Two parts: SnapshotStore holds one rank's snapshot tensors and copies between an entry and a state slot
(index copies of the shared cache tensors, so they work for every executor); SnapshotPool decides which
entry holds which prefix (a fixed number of entries, the planner's budget; when full, the least recently
used snapshot makes room). Under tensor parallelism each rank holds its value heads' states, so every rank
has a store of the same entries and the driver's pool alone decides: rank 0's store logs its copies
(`copies`), the tensor-parallel executor sends them with its next call, and each worker replays them
(`apply`) before that call's forward."""

from __future__ import annotations

from collections import OrderedDict

import torch

from deltaserve.cache.prefix import BlockHash
from deltaserve.model.context import CacheTensors

SAVE, RESTORE = 0, 1  # a logged copy's kind: slot -> entry, entry -> slot


class SnapshotStore:
    def __init__(self, cache: CacheTensors, num_snapshots: int) -> None:
        if num_snapshots <= 0:
            raise ValueError(f"a GDN snapshot pool needs at least one entry, got {num_snapshots}")
        self.num_total = num_snapshots
        # layer id -> [S, conv_dim, K-1] and [S, Hv, dk, dv], in the slots' dtypes
        self.conv = {i: torch.zeros((num_snapshots, *t.shape[1:]), dtype=t.dtype) for i, t in cache.conv.items()}
        self.ssm = {i: torch.zeros((num_snapshots, *t.shape[1:]), dtype=t.dtype) for i, t in cache.ssm.items()}
        # (kind, entry, slot) of every copy since the tensor-parallel executor last took them (None: one rank)
        self.copies: list[tuple[int, int, int]] | None = None
        # Each entry's and each slot's per-layer views, made once: a copy is then one _foreach_copy_ call
        # (measured on the demo: 12 us a snapshot against 33 us for a view and copy_ per tensor).
        self._entry_views = [[t[e] for t in self._tensors()] for e in range(num_snapshots)]
        slot_tensors = list(cache.conv.values()) + list(cache.ssm.values())  # the order of _tensors()
        num_slots = slot_tensors[0].shape[0] if slot_tensors else 0
        self._slot_views = [[t[s] for t in slot_tensors] for s in range(num_slots)]

    @property
    def bytes_per_snapshot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self._tensors())

    @property
    def nbytes(self) -> int:
        """Bytes of all entries: what the store allocated."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        return list(self.conv.values()) + list(self.ssm.values())

    def save(self, entry: int, slot: int) -> None:
        """Entry `entry` takes state slot `slot`'s states."""
        if self.copies is not None:
            self.copies.append((SAVE, entry, slot))
        torch._foreach_copy_(self._entry_views[entry], self._slot_views[slot])

    def restore(self, entry: int, slot: int) -> None:
        """State slot `slot` takes entry `entry`'s states."""
        if self.copies is not None:
            self.copies.append((RESTORE, entry, slot))
        torch._foreach_copy_(self._slot_views[slot], self._entry_views[entry])

    def take_copies(self) -> torch.Tensor:
        """The logged copies as int64 [n, 3] (kind, entry, slot), in order, and a fresh log."""
        copies, self.copies = self.copies or [], []
        return torch.tensor(copies, dtype=torch.long).reshape(-1, 3)

    def apply(self, copies: torch.Tensor) -> None:
        """Replay another rank's copies ([n, 3] from take_copies) on this rank's states."""
        for kind, entry, slot in copies.tolist():
            if kind == SAVE:
                self.save(entry, slot)
            elif kind == RESTORE:
                self.restore(entry, slot)
            else:
                raise ValueError(f"unknown GDN snapshot copy kind {kind}")


class SnapshotPool:
    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.num_total = store.num_total
        self._entries: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._free = list(range(store.num_total - 1, -1, -1))
        self.num_saved = 0
        self.num_evicted = 0

    @property
    def bytes_per_snapshot(self) -> int:
        return self.store.bytes_per_snapshot

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
        self.store.save(entry, slot)
        self._entries[key] = entry
        self.num_saved += 1
        return True

    def restore(self, key: BlockHash, slot: int) -> None:
        """Load the snapshot for key into state slot `slot` (key must be held)."""
        entry = self._entries[key]
        self._entries.move_to_end(key)
        self.store.restore(entry, slot)
