"""The shipped demo checkpoint: its structure, transformers agreement, and deterministic greedy output."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from deltaserve.assets import DEMO_DIR
from deltaserve.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig

pytestmark = pytest.mark.skipif(
    not (DEMO_DIR / "model.safetensors").exists(), reason="demo checkpoint not built (scripts/train_demo.py)"
)


@pytest.fixture(scope="module")
def llm():
    from deltaserve import LLM

    return LLM(max_model_len=512, max_num_seqs=4)


def test_structure_is_the_27b_scaled_down():
    cfg = ModelConfig.from_file(DEMO_DIR)
    assert cfg.model_type == "qwen3_5_text"  # parsed from the qwen3_5 wrapper's text_config
    assert json.loads((DEMO_DIR / "config.json").read_text())["model_type"] == "qwen3_5"
    assert cfg.layer_types == [LINEAR_ATTENTION] * 3 + [FULL_ATTENTION] + [LINEAR_ATTENTION] * 3 + [FULL_ATTENTION]
    assert cfg.linear_num_value_heads == 3 * cfg.linear_num_key_heads
    assert cfg.num_attention_heads == 6 * cfg.num_key_value_heads
    assert cfg.partial_rotary_factor == 0.25 and not cfg.tie_word_embeddings
    names = load_file(str(DEMO_DIR / "model.safetensors")).keys()
    assert "lm_head.weight" in names and "mtp.fc.weight" in names
    assert all(n.startswith(("model.language_model.", "model.visual.", "mtp.", "lm_head.")) for n in names)
    assert cfg.vision is not None and any(n.startswith("model.visual.") for n in names)  # it sees (finetune_demo)
    params = sum(t.numel() for t in load_file(str(DEMO_DIR / "model.safetensors")).values())
    assert 5e6 <= params <= 15e6


def test_transformers_loads_it_and_greedy_output_matches(llm):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from deltaserve import SamplingParams

    text = json.loads((DEMO_DIR / "config.json").read_text())["text_config"]
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text)).float().eval()
    tensors = load_file(str(DEMO_DIR / "model.safetensors"))
    state = {k.replace("model.language_model.", "model.", 1): v.float() for k, v in tensors.items()
             if not k.startswith(("mtp.", "model.visual."))}
    hf.load_state_dict(state, strict=True)
    hf.generation_config.eos_token_id = None  # like ignore_eos: keep going, but EOS may still be chosen
    tok = llm.get_tokenizer()
    prompts = ["Once upon a time", "The capital of France is", "从前有一个小女孩"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ours = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, ours):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()


def test_greedy_output_is_stable_text(llm):
    from deltaserve import SamplingParams

    params = SamplingParams(max_tokens=40, temperature=0)
    first = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    again = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    assert first.token_ids == again.token_ids and first.text == again.text
    assert len(first.text.strip()) > 0 and "\ufffd" not in first.text
    chat = llm.chat([{"role": "user", "content": "What is 2 + 3?"}], SamplingParams(max_tokens=80, temperature=0))
    assert chat[0].outputs[0].text  # thinking is on: the model writes its reasoning first
