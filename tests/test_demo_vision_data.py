"""The demo's picture questions (scripts/corpus/gen_vision.py) and its vision tower's configuration and training
inputs (scripts/corpus/demo_vision_config.py), on the real demo text weights with a random tower: the engine
takes the checkpoint (16 merged tokens per picture, any picture shrunk to 128x128), transformers'
Qwen3_5ForConditionalGeneration loads it and gives the engine's logits, and the training tensors are the ones
the engine builds for the same chat request."""

from __future__ import annotations

import json
import random

import pytest
import torch
from PIL import Image

from deltaserve import LLM, SamplingParams
from deltaserve.assets import DEMO_DIR
from deltaserve.config import ModelConfig
from deltaserve.engine.image_processor import ImageProcessor
from deltaserve.tokenizer import Tokenizer
from scripts.corpus import gen_vision
from scripts.corpus.demo_vision_config import (
    VisionBatch,
    demo_preprocessor_config,
    demo_vision_config,
    random_visual_tensors,
    training_inputs_from_ids,
    training_segments,
    vision_training_inputs,
    write_vision_checkpoint,
)
from scripts.corpus.gen_vision import IMAGE_SIZE, KINDS, LANGS, answer_is_right, sample

pytestmark = pytest.mark.skipif(
    not (DEMO_DIR / "model.safetensors").exists(), reason="demo checkpoint not built (scripts/train_demo.py)"
)
NO_THINKING = {"enable_thinking": False}


def test_every_kind_and_language_draws_a_picture_whose_own_answer_is_right():
    rng = random.Random(0)
    for kind in KINDS:
        for lang in LANGS:
            for split in ("train", "heldout"):
                for _ in range(10):
                    ex = sample(rng, split, kind, lang)
                    assert ex.image.mode == "RGB" and ex.image.size == (IMAGE_SIZE, IMAGE_SIZE)
                    assert (ex.kind, ex.lang) == (kind, lang) and ex.expected in ex.answer
                    assert answer_is_right(ex, ex.answer)
                    assert answer_is_right(ex, ex.reasoning + "\n</think>\n\n" + ex.answer, thinking=True)
                    assert not answer_is_right(ex, ex.reasoning, thinking=True)  # thinking never closed
    with pytest.raises(ValueError, match="split 'test' is not known"):
        sample(rng, "test")


def test_wrong_answers_are_refused():
    rng = random.Random(1)
    red = next(e for e in iter(lambda: sample(rng, "train", "colour", "en"), None) if e.expected == "red")
    assert answer_is_right(red, "It is red.") and answer_is_right(red, "Red.")
    assert not answer_is_right(red, "It is blue.") and not answer_is_right(red, "It is red or blue.")
    assert not answer_is_right(red, "It is redish.")  # a word, not a part of one
    assert not answer_is_right(red, "是红色的。")  # an English question wants the English word
    three = next(e for e in iter(lambda: sample(rng, "train", "count", "zh"), None) if e.expected == "3")
    assert answer_is_right(three, "图中有3个圆形。") and answer_is_right(three, "图中有3个三角形。")
    assert not answer_is_right(three, "图中有13个圆形。") and not answer_is_right(three, "图中有3个或4个圆形。")
    assert not answer_is_right(three, "图中有两个圆形。")
    left = next(e for e in iter(lambda: sample(rng, "train", "position", "zh"), None) if e.expected == "左边")
    assert answer_is_right(left, "圆形在图片的左边。")
    assert not answer_is_right(left, "圆形在图片的左边和右边。") and not answer_is_right(left, "在右边。")
    star = next(e for e in iter(lambda: sample(rng, "train", "shape", "en"), None) if e.expected == "star")
    assert answer_is_right(star, "It is a star.") and not answer_is_right(star, "It is a star or a circle.")


def test_the_split_is_decided_by_the_rounded_scene():
    rng = random.Random(2)
    scenes = [gen_vision._scene(rng, KINDS[i % len(KINDS)]) for i in range(3000)]
    held = [s for s in scenes if s.split() == "heldout"]
    assert 0.07 < len(held) / len(scenes) < 0.13
    held_keys = {s.key() for s in held}
    assert not held_keys & {s.key() for s in scenes if s.split() == "train"}
    rng = random.Random(3)
    a = sample(rng, "heldout")
    b = sample(random.Random(3), "heldout")
    assert (a.question, a.answer, a.image.tobytes()) == (b.question, b.answer, b.image.tobytes())  # seeded


def test_training_segments_are_the_chat_corpus_format():
    tok = Tokenizer.from_dir(DEMO_DIR)
    ex = sample(random.Random(4), "train", "colour", "en")
    for thinking in (True, False):
        (prompt, p_out), (output, o_out) = training_segments(ex, tok, thinking)
        assert (p_out, o_out) == (False, True)
        assert prompt.count("<|image_pad|>") == 1 and prompt.endswith("<think>\n" if thinking else "</think>\n\n")
        turn = {"role": "assistant", "content": ex.answer, **({"reasoning_content": ex.reasoning} if thinking else {})}
        user = {"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>" + ex.question}
        assert tok.apply_chat_template([user, turn], add_generation_prompt=False) == prompt + output + "\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_vision_checkpoint(DEMO_DIR, tmp_path_factory.mktemp("vision_demo") / "ck", random_visual_tensors(0))


@pytest.fixture(scope="module")
def llm(ckpt):
    llm = LLM(str(ckpt), enable_prefix_caching=False)
    llm.seen = []
    llm.engine.multimodal_listeners.append(lambda rid, ids, mm: llm.seen.append((ids, mm)))
    return llm


def chat(llm: LLM, image: Image.Image, question: str, max_tokens: int = 8) -> tuple[list[int], list[int], object]:
    """Greedy LLM.chat with an image_pil part: (prompt ids as the engine expanded them, output ids, its images)."""
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": question}]}]
    out = llm.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False,
                   chat_template_kwargs=NO_THINKING)
    ids, mm = llm.seen[-1]
    return ids, list(out[0].outputs[0].token_ids), mm


def test_the_checkpoint_takes_pictures_through_llm_chat(ckpt, llm):
    config = json.loads((ckpt / "config.json").read_text())
    assert config["vision_config"] == demo_vision_config() and config["image_token_id"] == 8186
    assert config["text_config"]["hidden_size"] == demo_vision_config()["out_hidden_size"]
    pad = config["image_token_id"]
    ex = sample(random.Random(5), "heldout", "shape", "en")
    ids, out, mm = chat(llm, ex.image, ex.question)
    assert ids.count(pad) == 16 and mm.images[0].grid == (1, 8, 8) and len(out) == 8
    big = ex.image.resize((448, 448))
    ids, _, mm = chat(llm, big, ex.question)
    assert ids.count(pad) == 16 and mm.images[0].grid == (1, 8, 8) and mm.images[0].source_size == (448, 448)
    wide = ex.image.resize((640, 360))  # about the aspect kept (96x160 pixels), at most 128x128 pixels
    ids, _, mm = chat(llm, wide, ex.question)
    _, h, w = mm.images[0].grid
    assert (h, w) == (6, 10) and ids.count(pad) == 15 and h * w * 16 * 16 <= IMAGE_SIZE**2
    tiny = ex.image.resize((20, 20))  # enlarged to the 64x64 minimum
    assert chat(llm, tiny, ex.question)[2].images[0].grid == (1, 4, 4)


def test_transformers_loads_the_checkpoint_and_gives_the_engines_logits(ckpt, llm):
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ex = sample(random.Random(6), "heldout", "count", "zh")
    ids, _, mm = chat(llm, ex.image, ex.question, max_tokens=1)
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    proc = Qwen2VLImageProcessorPil(**demo_preprocessor_config())(images=[ex.image], return_tensors="pt")
    torch.testing.assert_close(proc["pixel_values"], mm.images[0].pixel_values, atol=1e-6, rtol=0)
    input_ids = torch.tensor([ids])
    pad = hf.config.image_token_id
    with torch.no_grad():
        ref = hf(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=proc["pixel_values"],
                 image_grid_thw=proc["image_grid_thw"], mm_token_type_ids=(input_ids == pad).int()).logits[0]
    # the engine's own forward of that prompt, as one prefill chunk (tests/test_vision_engine.py does the same)
    engine = LLM(str(ckpt), enforce_eager=True, enable_prefix_caching=False).engine
    engine.add_request("r", {"prompt_token_ids": ids, "multi_modal_data": {"image": [ex.image]}},
                       SamplingParams(max_tokens=1))
    input_ids, ctx = engine.runner.build_context(engine.scheduler.schedule())
    with torch.inference_mode():
        logits = engine.executor.compute_logits(engine.executor.forward(input_ids, ctx))
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    engine.abort_request("r")


def test_training_inputs_are_what_the_engine_builds_and_reproduce_its_greedy_tokens(ckpt, llm):
    tok = Tokenizer.from_dir(ckpt)
    config = ModelConfig.from_file(ckpt / "config.json")
    processor = ImageProcessor.from_dict(demo_preprocessor_config())
    ex = sample(random.Random(7), "heldout", "digit", "en")
    ids, out, mm = chat(llm, ex.image, ex.question, max_tokens=6)
    (prompt, _), _ = training_segments(ex, tok, enable_thinking=False)
    inputs = training_inputs_from_ids(tok.encode(prompt), out, [ex.image], processor, config.vision)
    P = len(ids)
    assert inputs.input_ids[:P].tolist() == ids and inputs.input_ids[P:].tolist() == out
    assert torch.equal(inputs.positions[:, :P], mm.positions)
    assert torch.equal(inputs.positions[:, P:], (torch.arange(P, P + len(out)) + mm.delta).expand(3, -1))
    assert torch.equal(inputs.pixel_values, mm.images[0].pixel_values) and inputs.grids == [mm.images[0].grid]
    assert inputs.image_rows.tolist() == list(range(mm.images[0].offset, mm.images[0].end))
    assert inputs.loss_mask.tolist() == [False] * P + [True] * len(out)
    # teacher-forced through the torch model the engine loaded, the output tokens are the greedy ones
    model = llm.engine.model
    with torch.inference_mode():
        logits = model.compute_logits(VisionBatch.collate([inputs]).hidden(model))
    assert logits[P - 1 : -1].argmax(-1).tolist() == out
    full = vision_training_inputs(ex, tok, processor, config.vision, enable_thinking=True)
    assert tok.decode(full.input_ids[full.loss_mask].tolist(), skip_special_tokens=False) == (
        ex.reasoning + "\n</think>\n\n" + ex.answer + "<|im_end|>")


def test_a_batch_gives_each_examples_own_hidden_and_trains_the_tower(ckpt):
    from safetensors.torch import load_file

    from deltaserve.model.decoder import Qwen3_5ForCausalLM

    tok = Tokenizer.from_dir(ckpt)
    config = ModelConfig.from_file(ckpt / "config.json")
    processor = ImageProcessor.from_dict(demo_preprocessor_config())
    model = Qwen3_5ForCausalLM(config, with_vision=True)
    state = {k.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1): v.float()
             for k, v in load_file(str(ckpt / "model.safetensors")).items() if not k.startswith("mtp.")}
    model.load_state_dict(state, strict=True)
    rng = random.Random(8)
    items = [vision_training_inputs(sample(rng, "train"), tok, processor, config.vision, enable_thinking=t)
             for t in (True, False)]
    assert len(items[0].input_ids) != len(items[1].input_ids)
    batch = VisionBatch.collate(items)
    with torch.no_grad():
        together = batch.hidden(model)
        alone = torch.cat([VisionBatch.collate([it]).hidden(model) for it in items])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    loss = batch.loss(model)
    loss.backward()
    assert torch.isfinite(loss) and model.visual.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert model.visual.patch_embed.proj.weight.grad.abs().sum() > 0


def test_the_eval_script_scores_every_cell_through_the_engine(llm):
    from scripts.eval_demo_vision import evaluate, heldout_examples

    examples = heldout_examples(10, seed=0)
    assert [(e.kind, e.lang) for e in examples] == [(k, lang) for k in KINDS for lang in LANGS]
    result = evaluate(llm, examples, thinking=False, samples=10)
    assert all(c["total"] == 1 for row in result["counts"].values() for c in row.values())
    right = [answer_is_right(ex, s["output"]) for ex, s in zip(examples, result["samples"], strict=True)]
    assert [s["right"] for s in result["samples"]] == right
    assert result["accuracy"] == sum(right) / 10


def test_the_checkpoint_writer_stores_given_text_weights_and_the_tower(ckpt, tmp_path):
    from safetensors.torch import load_file

    stored = load_file(str(ckpt / "model.safetensors"))
    text = {k: v.float() for k, v in stored.items() if not k.startswith("model.visual.")}
    text["lm_head.weight"] = torch.zeros_like(text["lm_head.weight"])  # "fine-tuned"
    visual = random_visual_tensors(seed=1)
    out = write_vision_checkpoint(ckpt, tmp_path / "tuned", visual, text=text)
    saved = load_file(str(out / "model.safetensors"))
    assert saved["lm_head.weight"].dtype == torch.bfloat16 and not saved["lm_head.weight"].any()
    assert set(saved) == set(stored)
    assert all(torch.equal(saved[f"model.visual.{k}"], v.to(torch.bfloat16)) for k, v in visual.items())
    assert not torch.equal(saved["model.visual.pos_embed.weight"], stored["model.visual.pos_embed.weight"])
    assert json.loads((out / "preprocessor_config.json").read_text()) == demo_preprocessor_config()
