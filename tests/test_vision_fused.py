"""The fused C++ step on a checkpoint with a vision tower: [3, T] mRoPE positions and the visual rows that replace
the placeholders' embeddings, against the torch executor and transformers (tests/vision_checkpoint.py's random
Qwen3_5ForConditionalGeneration): whole-prompt logits, greedy tokens, chunks that cut through an image, and
batches that mix image and text requests."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from deltaserve import LLM
from deltaserve.executor.torch_executor import TorchExecutor
from tests.test_vision_engine import GREEDY, IMAGE, PICTURES, PROMPT, hf_greedy, hf_inputs, run
from tests.vision_checkpoint import random_hf_vision_model, save_vision_checkpoint

CASES = {"two": (PROMPT, PICTURES), "one": ([7, *IMAGE, 8, 9], [PICTURES[1]]), "text": ([20, 21, 22, 23], []),
         "other": (PROMPT, [PICTURES[1], PICTURES[0]])}


@pytest.fixture(scope="module")
def hf():
    return random_hf_vision_model(seed=2)


@pytest.fixture(scope="module")
def ckpt(hf, tmp_path_factory):
    return save_vision_checkpoint(hf, tmp_path_factory.mktemp("vision_fused") / "ck")


@pytest.fixture(scope="module")
def torch_tokens(ckpt):
    """Each case's greedy tokens on the torch executor, alone and unchunked."""
    llm = LLM(str(ckpt), enforce_eager=True, enable_prefix_caching=False)
    assert llm.engine.executor.name == "torch"
    return {k: run(llm, [v])[0] for k, v in CASES.items()}


def test_the_factory_picks_the_fused_step_for_a_vision_checkpoint_and_its_prompt_logits_match(hf, ckpt):
    llm = LLM(str(ckpt), enable_prefix_caching=False)  # the whole prompt in one chunk
    engine = llm.engine
    assert engine.executor.name == "fused-cpu"
    engine.add_request("r", {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": PICTURES}}, GREEDY)
    input_ids, ctx = engine.runner.build_context(engine.scheduler.schedule())
    assert ctx.positions.shape == (3, len(input_ids)) and ctx.mm_embeds is not None
    inputs = hf_inputs(PROMPT, PICTURES)
    with torch.no_grad():
        ref = hf(**inputs).logits[0]
    with torch.inference_mode():
        # Both write the same K/V and start the GDN state afresh (context 0), so either may run first.
        reference = TorchExecutor(engine.model, engine.runner.cache)
        torch_logits = reference.compute_logits(reference.forward(input_ids, ctx))
        fused = engine.executor.compute_logits(engine.executor.forward(input_ids, ctx))
    torch.testing.assert_close(fused, torch_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused, ref, atol=1e-4, rtol=1e-4)
    # Without the visual rows or with text positions the logits differ: the step reads both.
    with torch.inference_mode():
        text_rows = engine.executor.compute_logits(engine.executor.forward(input_ids, replace(ctx, mm_embeds=None)))
        flat = replace(ctx, positions=ctx.positions[0].clone())
        text_pos = engine.executor.compute_logits(engine.executor.forward(input_ids, flat))
    assert not torch.allclose(text_rows, ref, atol=1e-2) and not torch.allclose(text_pos, ref, atol=1e-2)
    engine.abort_request("r")


def test_bad_positions_and_visual_rows_get_errors_that_name_them(ckpt):
    engine = LLM(str(ckpt), enable_prefix_caching=False).engine
    engine.add_request("r", {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": PICTURES}}, GREEDY)
    input_ids, ctx = engine.runner.build_context(engine.scheduler.schedule())
    trunk = engine.executor.trunk
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match=r"positions are \[T\] \(text\) or \[3, T\]"):
            trunk._impl.forward(input_ids, ctx.positions[:2].contiguous(), *_rest(ctx), None, None, None)
        rows, embeds = ctx.mm_embeds
        with pytest.raises(RuntimeError, match="mm_rows"):
            trunk._impl.forward(input_ids, ctx.positions, *_rest(ctx), None, rows + len(input_ids), embeds)
        with pytest.raises(RuntimeError, match="mm_embeds is float32"):
            trunk._impl.forward(input_ids, ctx.positions, *_rest(ctx), None, rows, embeds[:, :-1].contiguous())
    engine.abort_request("r")


def _rest(ctx) -> tuple:
    """FusedStack.forward's arguments between positions and output_rows, for a step without verify segments."""
    return (torch.tensor(ctx.query_start_loc), torch.tensor(ctx.context_lens), ctx.block_tables, ctx.slot_mapping,
            ctx.state_slots, torch.full((ctx.num_seqs,), -1), 0, 0, torch.empty(0))


def test_fused_greedy_tokens_match_transformers_and_the_torch_executor(hf, ckpt, torch_tokens):
    llm = LLM(str(ckpt), enable_prefix_caching=False)
    assert llm.engine.executor.name == "fused-cpu"
    tokens = run(llm, [CASES["two"]])[0]
    assert tokens == torch_tokens["two"] == hf_greedy(hf, PROMPT, PICTURES, GREEDY.max_tokens)


def test_fused_chunks_through_images_and_mixed_batches_give_each_requests_torch_tokens(ckpt, torch_tokens):
    chunked = LLM(str(ckpt), max_num_batched_tokens=5, enable_prefix_caching=False)  # chunks cut both images
    assert chunked.engine.executor.name == "fused-cpu"
    assert run(chunked, [CASES["two"]]) == [torch_tokens["two"]]
    assert chunked.engine.encoder_cache.num_encoded == 2
    order = ["two", "text", "one", "other", "text"]
    mixed = LLM(str(ckpt), max_num_batched_tokens=16, enable_prefix_caching=False)
    assert run(mixed, [CASES[k] for k in order]) == [torch_tokens[k] for k in order]
