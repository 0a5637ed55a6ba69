"""ModelRunner.make_context builds positions and KV slots in a Python loop for small steps and with tensor
ops for large ones: both must give the same context, and the one ForwardContext.paged builds."""

from __future__ import annotations

import pytest
import torch

from deltaserve.cache.manager import CacheManager
from deltaserve.engine import runner as runner_module
from deltaserve.engine.runner import ModelRunner
from deltaserve.model.context import ForwardContext


@pytest.mark.parametrize("loop_tokens", [0, 10_000], ids=["tensor-ops", "python-loop"])
def test_make_context_matches_the_reference_context(monkeypatch, loop_tokens: int) -> None:
    monkeypatch.setattr(runner_module, "_LOOP_TOKENS", loop_tokens)
    manager = CacheManager(num_blocks=64, block_size=4, num_slots=8)
    # (request, context_len, query_len): decodes, a prompt chunk, a continued chunk
    steps = [("a", 9, 1), ("b", 0, 7), ("c", 5, 6), ("d", 13, 1)]
    for rid, c, _ in steps:  # the context first, the new tokens in a second round: b's and c's tables
        assert manager.allocate(rid, max(c, 1))  # are not contiguous
    for rid, c, q in steps:
        assert manager.allocate(rid, c + q)
    table = manager.block_tables["c"]
    assert table != list(range(table[0], table[0] + len(table)))
    cache = _BlockSize(4)
    runner = ModelRunner(executor=None, cache=cache, manager=manager, sampler=None, head=None)
    q_lens, c_lens, ids = [q for _, _, q in steps], [c for _, c, _ in steps], [r for r, _, _ in steps]
    got = runner.make_context(q_lens, c_lens, ids)
    want = ForwardContext.paged(
        cache, q_lens, c_lens, [manager.block_tables[r] for r in ids], [manager.state_slots[r] for r in ids]
    )
    assert torch.equal(got.positions, want.positions)
    assert torch.equal(got.slot_mapping, want.slot_mapping)
    assert torch.equal(got.block_tables, want.block_tables)
    assert torch.equal(got.state_slots, want.state_slots)
    assert got.query_start_loc == want.query_start_loc


class _BlockSize:
    """Stands in for the cache tensors: building a context reads only the block size."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
