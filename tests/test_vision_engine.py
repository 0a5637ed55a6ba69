"""Images through the engine against transformers' Qwen3_5ForConditionalGeneration on a small random checkpoint
(tests/vision_checkpoint.py): mRoPE positions, merged input embeddings, prompt logits and greedy tokens; then
the engine's own cases (chunked prefill through an image, preemption, mixed batches, abort, prefix caching) each
give the tokens of the request run alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from deltaserve import LLM, SamplingParams
from deltaserve.engine.config import EngineConfigError
from deltaserve.engine.multimodal import MultiModalError
from tests.vision_checkpoint import (
    IMAGE_PAD,
    PREPROCESSOR,
    VISION_END,
    VISION_START,
    random_hf_vision_model,
    save_vision_checkpoint,
)

IMAGE = [VISION_START, IMAGE_PAD, VISION_END]


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# Two pictures of different sizes and odd merged grids: 83x45 -> 80x48 pixels, patch grid 6x10, merged 3x5
# (15 tokens); 110x17 -> 112x16, patch grid 2x14, merged 1x7 (7 tokens).
PICTURES = [picture(83, 45, 0), picture(110, 17, 1)]
# An image mid-conversation: text, image, text, image, text.
PROMPT = [10, 11, *IMAGE, 12, 13, 14, *IMAGE, 15, 16]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf():
    return random_hf_vision_model(seed=1)


@pytest.fixture(scope="module")
def ckpt(hf, tmp_path_factory):
    return save_vision_checkpoint(hf, tmp_path_factory.mktemp("vision") / "ck")


def hf_inputs(prompt: list[int], pictures: list[Image.Image]) -> dict:
    """transformers' processor output for the prompt: placeholders expanded, pixel values, grids, token types."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(**PREPROCESSOR)(images=pictures, return_tensors="pt")
    counts = iter((proc["image_grid_thw"].prod(-1) // 4).tolist())
    ids = []
    for t in prompt:
        ids += [t] * next(counts) if t == IMAGE_PAD else [t]
    input_ids = torch.tensor([ids])
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=proc["pixel_values"],
                image_grid_thw=proc["image_grid_thw"], mm_token_type_ids=(input_ids == IMAGE_PAD).int())


def hf_greedy(hf, prompt, pictures, n: int) -> list[int]:
    inputs = hf_inputs(prompt, pictures)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def run(llm: LLM, prompts: list[tuple[list[int], list]], params=GREEDY) -> list[list[int]]:
    requests = [{"prompt_token_ids": p, "multi_modal_data": {"image": pics}} if pics else {"prompt_token_ids": p}
                for p, pics in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]


def test_positions_embeddings_and_prompt_logits_match_transformers(hf, ckpt):
    llm = LLM(str(ckpt), enforce_eager=True, enable_prefix_caching=False)  # the whole prompt in one chunk
    engine = llm.engine
    assert engine.executor.name == "torch"
    engine.add_request("r", {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": PICTURES}}, GREEDY)
    sched = engine.scheduler.schedule()
    input_ids, ctx = engine.runner.build_context(sched)
    inputs = hf_inputs(PROMPT, PICTURES)
    assert input_ids.tolist() == inputs["input_ids"][0].tolist()  # placeholders expanded from the grids
    with torch.no_grad():
        ref_pos, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                 image_grid_thw=inputs["image_grid_thw"])
        ref_embeds = hf.model.get_input_embeddings()(inputs["input_ids"])[0]
        feats = torch.cat(hf.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output)
        ref_embeds[inputs["input_ids"][0] == IMAGE_PAD] = feats
        ref_logits = hf(**inputs).logits[0]
    assert torch.equal(ctx.positions, ref_pos[:, 0])
    assert engine.encoder_cache.prompts["r"].delta == int(delta)
    rows, embeds = ctx.mm_embeds
    assert torch.equal(rows, torch.nonzero(input_ids == IMAGE_PAD)[:, 0])
    merged = engine.model.model.embed_tokens(input_ids).index_copy(0, rows, embeds)
    torch.testing.assert_close(merged, ref_embeds, atol=2e-5, rtol=1e-4)
    with torch.inference_mode():
        logits = engine.executor.compute_logits(engine.executor.forward(input_ids, ctx))
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    engine.abort_request("r")


def test_greedy_tokens_match_transformers(hf, ckpt):
    ref = hf_greedy(hf, PROMPT, PICTURES, GREEDY.max_tokens)
    llm = LLM(str(ckpt))  # the fused step, the tower in torch (tests/test_vision_fused.py checks it against torch)
    assert llm.engine.executor.name == "fused-cpu"
    assert run(llm, [(PROMPT, PICTURES)]) == [ref]


@pytest.fixture(scope="module")
def alone(ckpt):
    """Each request's greedy tokens run alone, unchunked: what every engine case must reproduce."""
    llm = LLM(str(ckpt), enable_prefix_caching=False)
    cases = {"two": (PROMPT, PICTURES), "one": ([7, *IMAGE, 8, 9], [PICTURES[1]]), "text": ([20, 21, 22, 23], []),
             "other": (PROMPT, [PICTURES[1], PICTURES[0]])}
    return cases, {k: run(llm, [v])[0] for k, v in cases.items()}


def test_chunked_prefill_through_images_encodes_each_image_once(ckpt, alone):
    cases, tokens = alone
    llm = LLM(str(ckpt), max_num_batched_tokens=5, enable_prefix_caching=False)  # chunks cut both images
    assert run(llm, [cases["two"]]) == [tokens["two"]]
    cache = llm.engine.encoder_cache
    assert cache.num_encoded == 2 and not cache.outputs and not cache.prompts


def test_the_encoder_budget_cuts_a_chunk_before_an_image_it_has_no_room_for(ckpt, alone):
    cases, tokens = alone
    # 7 and 15 merged tokens; the first 16-token chunk reaches both, but the encoder budget (the token budget,
    # 16) holds one: the chunk ends before the second, which the next step encodes.
    prompt = [*IMAGE, *IMAGE, 30, 31]
    pictures = [PICTURES[1], PICTURES[0]]
    ref = run(LLM(str(ckpt), enable_prefix_caching=False), [(prompt, pictures)])
    llm = LLM(str(ckpt), max_num_batched_tokens=16, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("b", {"prompt_token_ids": prompt, "multi_modal_data": {"image": pictures}}, GREEDY)
    per_step, chunks, out = [], [], []
    while engine.has_unfinished_requests():
        before = engine.encoder_cache.num_encoded_tokens
        for o in engine.step():
            out = o.outputs[0].token_ids
        per_step.append(engine.encoder_cache.num_encoded_tokens - before)
        chunks.append(engine.last_schedule.num_tokens)
    # [0, 10): up to the second image; [10, 26): it and the next token; [26, 28): the prompt's end; decodes.
    assert chunks[:3] == [10, 16, 2] and per_step[:3] == [7, 15, 0]
    assert out == ref[0]


def test_mixed_batches_and_preemption_give_each_requests_own_tokens(ckpt, alone):
    cases, tokens = alone
    order = ["two", "text", "one", "other", "text"]
    # 12 blocks of 4 tokens cannot hold all five at once: the newest are preempted and recomputed (images too).
    llm = LLM(str(ckpt), block_size=4, num_kv_blocks=12, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert run(llm, [cases[k] for k in order]) == [tokens[k] for k in order]
    assert llm.engine.scheduler.num_preemptions > 0
    cache = llm.engine.encoder_cache
    assert not cache.outputs and not cache.prompts


def test_prefix_caching_keeps_requests_with_other_pictures_apart(ckpt, alone):
    cases, tokens = alone
    llm = LLM(str(ckpt), block_size=4, mamba_block_size=8, enable_prefix_caching=True)
    # Same ids, other pictures: no block past the first image may be shared.
    stats = llm.engine.cache.prefix.stats
    assert run(llm, [cases["two"]]) == [tokens["two"]]
    assert run(llm, [cases["other"]]) == [tokens["other"]]
    assert stats.hits == 0  # the text before the first image is shorter than one snapshot interval
    assert run(llm, [cases["two"]]) == [tokens["two"]]  # the same pictures do hit the cache, mid-image
    assert stats.hits > 0


def test_abort_mid_image_frees_the_encoder_cache(ckpt):
    llm = LLM(str(ckpt), max_num_batched_tokens=6)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": PICTURES}}, GREEDY)
    engine.step()  # the chunk ends inside the first image: its encoder output is kept for the next chunk
    assert engine.encoder_cache.outputs and engine.encoder_cache.num_bytes > 0
    assert engine.encoder_cache.num_cached_tokens == sum(t.shape[0] for t in engine.encoder_cache.outputs.values())
    engine.abort_request("a")
    assert not engine.encoder_cache.outputs and not engine.encoder_cache.prompts
    assert engine.encoder_cache.num_bytes == engine.encoder_cache.num_cached_tokens == 0  # the running counts too


def test_bad_multimodal_inputs_get_errors_that_name_the_problem(hf, ckpt, tmp_path):
    llm = LLM(str(ckpt), limit_mm_per_prompt={"image": 1})
    with pytest.raises(MultiModalError, match="2 image placeholder.* but 1 image"):
        run(llm, [(PROMPT, [PICTURES[0]])])
    with pytest.raises(MultiModalError, match="more than the limit of 1"):
        run(llm, [(PROMPT, PICTURES)])
    with pytest.raises(MultiModalError, match="'video': video input is not supported: at most 0 video"):
        llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"video": [PICTURES[0]]}}, use_tqdm=False)
    with pytest.raises(MultiModalError, match="video and audio inputs are not implemented"):
        llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": [PICTURES[0]]}}, use_tqdm=False)
    with pytest.raises(EngineConfigError, match="video is not supported"):
        LLM(str(ckpt), limit_mm_per_prompt={"video": 1})
    assert not llm.engine.encoder_cache.prompts
    text_only = LLM(str(save_vision_checkpoint(hf, tmp_path / "text", with_tower=False)))
    with pytest.raises(MultiModalError, match="no vision tower"):
        run(text_only, [(PROMPT, PICTURES)])
