"""A small random Qwen3_5ForConditionalGeneration (vision tower + hybrid text model) built with transformers and
saved in the official layout (`model.visual.*`, `model.language_model.*`, `lm_head.weight`), with the demo's
tokenizer (it has Qwen's vision tokens) and a preprocessor_config.json sized for small pictures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from deltaserve.assets import DEMO_DIR
from tests.checkpoints import TINY, mrope_section, randomize

# The demo tokenizer's ids of <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>.
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 8183, 8184, 8186, 8187
TEXT = dict(TINY, vocab_size=8192, max_position_embeddings=2048)
# patch 8 (not 16) keeps the pictures small: a 64x48 picture is an 8x6 patch grid, 4x3 merged tokens.
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=8, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=TINY["hidden_size"], num_position_embeddings=16, in_channels=3)
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 8, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 16 * 16, "longest_edge": 128 * 128},
}


def hf_vision_config():
    from transformers import Qwen3_5Config

    text = dict(TEXT)
    partial = text.pop("partial_rotary_factor")
    cfg = Qwen3_5Config(
        text_config=dict(
            **text, eos_token_id=8176, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                             "mrope_section": mrope_section(TEXT["head_dim"], partial), "mrope_interleaved": True},
        ),
        vision_config=dict(VISION),
        image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    cfg.vision_config._attn_implementation = "eager"
    return cfg


def random_hf_vision_model(seed: int = 0):
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(hf_vision_config()).float().eval()
    randomize(model)
    with torch.no_grad():  # LayerNorms of the tower: weight near 1 (randomize's "norm" rule centres them at 0)
        for name, p in model.named_parameters():
            if name.startswith("model.visual.") and "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    return model


def save_vision_checkpoint(model, path: Path, with_tower: bool = True) -> Path:
    """transformers' save (already the official layout) + the demo tokenizer + preprocessor_config.json;
    with_tower False drops model.visual.* and vision_config (a text-only checkpoint of the same model)."""
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    if not with_tower:
        tensors = load_file(str(path / "model.safetensors"))
        save_file({k: v for k, v in tensors.items() if not k.startswith("model.visual.")},
                  str(path / "model.safetensors"))
        config = json.loads((path / "config.json").read_text())
        config.pop("vision_config")
        (path / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_DIR / name, path / name)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    return path
