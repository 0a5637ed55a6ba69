"""`deltaserve plan` counts the vision encoder cache with the engine's own arithmetic (engine/encoder_cache.py
encoder_cache_tokens), and the engine's cache really stays within that capacity: a second request's image waits
while the first still holds its merged tokens, and both give the tokens they give alone."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from deltaserve import LLM, SamplingParams
from deltaserve.cli_plan import main as plan_main
from deltaserve.cli_plan import max_tokens_per_image
from deltaserve.config import ModelConfig
from deltaserve.engine.planner import plan_memory
from tests.vision_checkpoint import (
    IMAGE_PAD,
    TEXT,
    VISION_END,
    VISION_START,
    random_hf_vision_model,
    save_vision_checkpoint,
)

IMAGE = [VISION_START, IMAGE_PAD, VISION_END]
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
BUDGET = 32  # max_num_batched_tokens; the largest picture (128 x 128 px, tests/vision_checkpoint.py) has 64 tokens


def picture(seed: int) -> Image.Image:
    """128 x 96 px: a 16 x 12 patch grid, 8 x 6 = 48 merged tokens."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_vision_checkpoint(random_hf_vision_model(seed=4), tmp_path_factory.mktemp("vision") / "ck")


def test_plan_counts_the_encoder_cache_the_engine_holds(ckpt, capsys):
    llm = LLM(str(ckpt), max_num_batched_tokens=BUDGET, enable_prefix_caching=False)
    cache = llm.engine.encoder_cache
    cfg = ModelConfig.from_file(ckpt)
    plan = plan_memory(cfg, 256, 1, dtype="float32", max_num_batched_tokens=BUDGET,
                       max_tokens_per_image=max_tokens_per_image(str(ckpt), cfg))
    assert plan.encoder_tokens_per_image == 64 and plan.encoder_cache_tokens == cache.capacity_tokens == 64
    assert plan.encoder_cache_bytes == cache.capacity_bytes == 64 * TEXT["hidden_size"] * 4
    assert plan.total_bytes == plan.weight_bytes + plan.cache_bytes
    assert plan.cache_bytes == (plan.kv_cache_bytes + plan.gdn_state_bytes + plan.gdn_snapshot_bytes
                                + plan.encoder_cache_bytes)
    # a bigger step budget is the capacity when it is more than one largest picture
    assert plan_memory(cfg, 256, 1, max_num_batched_tokens=100, max_tokens_per_image=64).encoder_cache_tokens == 100
    # under tensor parallelism rank 0 holds the whole tower and the same cache; none without the tower
    two = plan_memory(cfg, 256, 1, dtype="float32", tp=2, max_num_batched_tokens=BUDGET, max_tokens_per_image=64)
    assert two.encoder_cache_bytes == plan.encoder_cache_bytes
    tower = {p.name: p.total_bytes_per_rank for p in plan.weight_parts}["vision tower"]
    assert {p.name: p.total_bytes_per_rank for p in two.weight_parts}["vision tower"] == tower
    assert plan_memory(cfg, 256, 1, include_vision=False).encoder_cache_bytes == 0

    engine = llm.engine
    # a: 18 text tokens, its picture at [19, 67), 3 more; b: its picture at [2, 50). a's chunks [0, 32) (it
    # encodes a's 48 tokens), [32, 64), then [64, 70) with 26 tokens left for b, whose picture would make 96
    # tokens held: b's chunk ends before it, and it is encoded in the next step, once a has passed its own.
    prompts = {"a": [*range(20, 38), *IMAGE, 40, 41], "b": [10, *IMAGE, 11, 12]}
    pictures = {"a": picture(0), "b": picture(1)}
    for rid, ids in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": ids, "multi_modal_data": {"image": [pictures[rid]]}}, GREEDY)
    tokens, chunks, held_bytes = {}, [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        chunks.append({s.request.request_id: s.num_tokens for s in engine.last_schedule.scheduled})
        if cache.outputs:
            held_bytes.append(cache.num_bytes / cache.num_cached_tokens)
    assert chunks[:4] == [{"a": 32}, {"a": 32}, {"a": 6, "b": 2}, {"a": 1, "b": BUDGET - 1}]
    assert cache.max_cached_tokens == 48 <= cache.capacity_tokens
    # what one held token really takes is the plan's bytes per token
    assert held_bytes and set(held_bytes) == {plan.encoder_cache_bytes / plan.encoder_cache_tokens}
    for rid, ids in prompts.items():
        alone = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [pictures[rid]]}}, GREEDY,
                             use_tqdm=False)
        assert tokens[rid] == alone[0].outputs[0].token_ids

    assert plan_main(["plan", "--model", str(ckpt), "--max-num-batched-tokens", str(BUDGET)]) == 0
    text = capsys.readouterr().out
    assert "Vision encoder cache" in text and "64 merged tokens" in text and "largest picture's 64 tokens" in text
