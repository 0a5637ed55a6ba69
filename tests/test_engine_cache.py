"""Cache pressure and cache hygiene: preemption completes every request with unchanged outputs, and no KV
block or GDN state slot outlives the request that held it (finish, abort, preemption)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.manager import CacheManager
from deltaserve.engine.llm_engine import LLMEngine
from tests.checkpoints import TINY, random_hf_model, save_official_layout


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_official_layout(random_hf_model(TINY, seed=1), tmp_path_factory.mktemp("ckpt"))


def _prompts(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 50, (n,), generator=g).tolist()
    return [
        {"prompt_token_ids": torch.randint(2, TINY["vocab_size"], (k,), generator=g).tolist()}
        for k in lengths
    ]


def _all_free(engine: LLMEngine) -> None:
    u = engine.cache.usage()
    assert (u.used_blocks, u.used_slots) == (0, 0), f"leaked {u.used_blocks} blocks, {u.used_slots} slots"
    assert not engine.cache.block_tables and not engine.cache.state_slots
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_preemption_completes_every_request_with_same_outputs(path: Path) -> None:
    prompts = _prompts(12)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 6 + [
        SamplingParams(temperature=0.8, seed=s, max_tokens=24, ignore_eos=True) for s in range(6)
    ]
    roomy = LLM(model=str(path), max_model_len=96, max_num_batched_tokens=48, max_num_seqs=8)
    # 8 blocks of 16 tokens: enough for one sequence of max_model_len (6 blocks), far too few for eight.
    tight = LLM(model=str(path), max_model_len=96, max_num_batched_tokens=48, max_num_seqs=8, num_kv_blocks=8)
    want = roomy.generate(prompts, params, use_tqdm=False)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in got) == tight.engine.scheduler.num_preemptions
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].token_ids) == 24 and g.outputs[0].finish_reason == "length"
    _all_free(tight.engine)
    _all_free(roomy.engine)


def test_everything_freed_after_finish_abort_and_preemption(path: Path) -> None:
    llm = LLM(model=str(path), max_model_len=96, max_num_batched_tokens=32, max_num_seqs=4, num_kv_blocks=8)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(_prompts(8, seed=2)):
        engine.add_request(f"r{i}", p, params)
    seen_abort = set()
    for step in range(200):
        if step == 6:
            engine.abort_request(["r0", "r3", "r7"])  # running, running-or-waiting, waiting
        for out in engine.step():
            if out.outputs[0].finish_reason == "abort":
                seen_abort.add(out.request_id)
                if out.request_id == "r0":
                    assert out.outputs[0].token_ids, "r0 should have been aborted mid-generation"
                assert not out.finished or all(o.finish_reason == "abort" for o in out.outputs)
        if not engine.has_unfinished_requests():
            break
    assert seen_abort == {"r0", "r3", "r7"}
    assert engine.scheduler.num_preemptions > 0
    _all_free(engine)
    # An abort of a finished or unknown id is a no-op.
    engine.abort_request("r1")
    engine.abort_request("nope")
    _all_free(engine)


def test_block_pool_and_manager_accounting() -> None:
    pool = BlockPool(4)
    got = pool.allocate(3)
    assert pool.num_free == 1 and len(set(got)) == 3
    pool.free(got[:1])
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(got[:1])
    m = CacheManager(num_blocks=4, block_size=4, num_slots=1)
    assert m.allocate("a", 9) and len(m.block_tables["a"]) == 3
    assert m.allocate("a", 12) and len(m.block_tables["a"]) == 3  # still fits
    assert not m.can_allocate("b", 1)  # the only state slot is taken
    assert not m.allocate("a", 17)  # would need 2 more blocks; nothing changes
    assert len(m.block_tables["a"]) == 3
    m.free("a")
    assert m.usage().used_blocks == 0 and m.usage().used_slots == 0
