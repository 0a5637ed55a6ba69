"""Prefix caching under tensor parallelism (TP = 2, gloo): the scheduler and the cache manager run once, in
the driver, and every rank holds its own heads' KV blocks, GDN slots and GDN snapshots; the snapshot copies
the driver's prefix cache makes (a hit's restore, a step's save) reach the workers with the next call. Greedy
outputs equal those without caching, hits have the expected lengths, and each rank allocated its snapshots
as `deltaserve plan --tp 2` counts them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.engine.planner import plan_memory
from deltaserve.outputs import RequestOutput
from deltaserve.sampling import SamplingParams
from tests.checkpoints import TINY, random_hf_model, random_mtp_tensors, save_official_layout

BLOCK, SNAP, MAX_LEN, SEQS = 16, 64, 256, 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make_engine(path: Path, caching: bool, k: int = 0, eager: bool = False) -> LLMEngine:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    return LLMEngine(EngineConfig(
        model=str(path), tensor_parallel_size=2, enable_prefix_caching=caching, enforce_eager=eager,
        mamba_block_size=SNAP if caching else None, max_num_seqs=SEQS, max_model_len=MAX_LEN, block_size=BLOCK,
        max_num_batched_tokens=48, speculative_config=spec,
    ))


def run(engine: LLMEngine, tag: str, prompts: list[list[int]]) -> list[RequestOutput]:
    """The prompts in one batch (max_num_seqs at a time: later ones are admitted as earlier ones finish)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, GREEDY)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    return [done[f"{tag}{i}"] for i in range(len(prompts))]


def tokens(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(2, TINY["vocab_size"], (n,), generator=g).tolist()


def aligned_end(n: int) -> int:
    """The prompt-end snapshot point of an n-token prompt."""
    return (n - 1) // BLOCK * BLOCK


def conversation(engine: LLMEngine, g: torch.Generator) -> list[RequestOutput]:
    """Three turns (each prompt is the last one, its answer and a new message), then a shared 100-token
    system prompt with four questions in one batch (two at a time, in chunks of at most 48 tokens)."""
    outs, prompt = [], tokens(70, g)
    for turn in range(3):
        out = run(engine, f"t{turn}-", [prompt])[0]
        outs.append(out)
        prompt = prompt + list(out.outputs[0].token_ids) + tokens(9 + 5 * turn, g)
    system = tokens(100, g)
    return outs + run(engine, "s", [system + [2 + i] + tokens(6 + 5 * i, g) for i in range(4)])


@pytest.mark.parametrize(("k", "eager"), [(0, False), (2, True)], ids=["fused", "torch-mtp"])
def test_prefix_caching_under_tensor_parallelism(tmp_path: Path, k: int, eager: bool) -> None:
    path = save_official_layout(random_hf_model(TINY, seed=3), tmp_path, random_mtp_tensors(TINY, seed=4))
    plain = make_engine(path, False, k, eager)  # one process group at a time: the engines run in turn
    try:
        assert plain.cache.prefix is None
        want = conversation(plain, torch.Generator().manual_seed(1))
    finally:
        plain.close()
    cached = make_engine(path, True, k, eager)
    try:
        got = conversation(cached, torch.Generator().manual_seed(1))
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        hits = [o.num_cached_tokens for o in got]
        # each turn reuses the last one's prompt and answer up to the answer's last block boundary (its decode
        # snapshot; a verify step under MTP lands on a boundary only by chance, so at least up to the prompt's);
        # the first two questions run together (nothing cached yet), the later two reuse the system prompt's
        # 6 blocks and the first question's snapshot after them
        assert hits[0] == 0 and hits[3:] == [0, 0, 96, 96], hits
        for hit, o in zip(hits[1:3], got[:2], strict=True):
            prompt, answer = len(o.prompt_token_ids), len(o.outputs[0].token_ids)
            start, end = aligned_end(prompt), aligned_end(prompt + answer)
            assert (hit == end) if k == 0 else (start <= hit <= end), (hits, start, end)
        assert cached.stats().prefix_cache.hits == sum(hits)
        cfg = ModelConfig.from_file(path)
        plan = plan_memory(cfg, MAX_LEN, SEQS, tp=2, block_size=BLOCK, dtype="float32", with_mtp=k > 0,
                           num_gdn_snapshots=cached.cache.prefix.snapshots.num_total)
        assert plan.gdn_snapshot_bytes > 0 and cached.executor.cache_bytes_per_rank() == [plan.cache_bytes] * 2
    finally:
        cached.close()
