"""A free list of fixed-size cache units (KV blocks, or GDN state slots): allocate, free, count."""

from __future__ import annotations

from collections import deque


class CacheExhaustedError(RuntimeError):
    """Asked for more units than are free; the scheduler checks first, so this means a bookkeeping bug."""


class BlockPool:
    def __init__(self, num_blocks: int, name: str = "KV block") -> None:
        if num_blocks <= 0:
            raise ValueError(f"a {name} pool needs at least one unit, got {num_blocks}")
        self.name = name
        self.num_total = num_blocks
        # FIFO reuse keeps recently freed blocks cold a little longer (useful once prefix caching lands).
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_total - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheExhaustedError(f"asked for {n} {self.name}s, only {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._is_free[b] = False
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._is_free[b]:
                raise ValueError(f"{self.name} {b} freed twice")
            self._is_free[b] = True
            self._free.append(b)
