"""The demo's vision tower: its config.json and preprocessor_config.json parts, a checkpoint writer, and the
training inputs of one picture question (scripts/corpus/gen_vision.py) for deltaserve's torch model.

The tower is the real Qwen3.5 design at a small size: 16x16 patches over 2 frames, 3 blocks of width 128 (4 heads),
an 8x8 learned position grid, the 2x2 merger projecting to the demo's text width (192). The processor shrinks any
picture to at most 128x128 pixels (16 merged tokens) and keeps its aspect ratio.

How a VisionExample becomes training tensors (vision_training_inputs does all of it):

1. training_segments: the chat template's text of [user: image part + question] with the generation prompt, as
   LLM.chat renders it (the image part is deltaserve.engine.media.IMAGE_PLACEHOLDER, one <|image_pad|>), not
   trained; then the model's output, trained: with thinking `reasoning + "\\n</think>\\n\\n" + answer +
   "<|im_end|>"` (the prompt ends with "<think>\\n"), without `answer + "<|im_end|>"` (the prompt ends with the
   empty think block "<think>\\n\\n</think>\\n\\n").
2. Each piece is tokenized alone (tokenizer.encode, no special tokens added), as the engine tokenizes the prompt
   and then generates the output token by token.
3. deltaserve.engine.multimodal.build_multimodal_prompt(ids, [image], vision, processor) runs the engine's
   processor on the picture (resize, normalize, patches in merge-block order) and expands the single
   <|image_pad|> to one per merged token (16 for a 128x128 picture); it gives the mRoPE positions [3, T] of
   the whole sequence (the output's text continues after the prompt, which is the engine's decode position
   index + delta).
4. loss_mask marks the output's tokens: the logits at row t-1 learn token t where loss_mask[t].

The trainable model: config = demo_config_with_vision(the demo's config.json, its tokenizer);
Qwen3_5ForCausalLM(ModelConfig.from_dict(config), with_mtp=True, with_vision=True); the demo's tensors loaded
with model.language_model.* renamed model.*; init_vision_tower(model.visual). Saved back with
write_vision_checkpoint(DEMO_DIR, out, model.visual.state_dict(), text=the other tensors renamed back).

The forward of a batch (VisionBatch.hidden): merged visual tokens = model.encode_images(pixel values, grids);
ForwardContext.stateless(lengths) with positions = the [3, T] mRoPE positions and mm_embeds = (rows of the image
tokens, the merged visual tokens); model(input_ids, ctx) gives the final-normed hidden [T, H];
model.compute_logits(hidden) the logits.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from deltaserve.config import VisionConfig
from deltaserve.engine.image_processor import ImageProcessor
from deltaserve.engine.media import IMAGE_PLACEHOLDER
from deltaserve.engine.multimodal import build_multimodal_prompt
from deltaserve.model.context import ForwardContext

from .gen_vision import IMAGE_SIZE, VisionExample

DEMO_TEXT_HIDDEN = 192  # the demo's text_config.hidden_size: the merger projects to it
MIN_PIXELS = 64 * 64  # a smaller picture is enlarged to at least 4 merged tokens
MAX_PIXELS = IMAGE_SIZE * IMAGE_SIZE  # any picture is shrunk to at most 128x128 pixels: 16 merged tokens
VISION_TOKENS = {  # config.json field -> the demo tokenizer's token
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def demo_vision_config() -> dict[str, Any]:
    """config.json's vision_config, in the field names of transformers' Qwen3_5VisionConfig (and the engine's)."""
    return {
        "depth": 3,
        "hidden_size": 128,
        "num_heads": 4,
        "intermediate_size": 512,
        "hidden_act": "gelu_pytorch_tanh",  # as Qwen3.5's released vision_config
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "in_channels": 3,
        "out_hidden_size": DEMO_TEXT_HIDDEN,
        "num_position_embeddings": (IMAGE_SIZE // 16) ** 2,  # an 8x8 grid: one per patch of a 128x128 picture
        "deepstack_visual_indexes": [],  # Qwen3.5 has no deepstack (released configs say so explicitly)
        "initializer_range": 0.02,
    }


def demo_preprocessor_config() -> dict[str, Any]:
    """preprocessor_config.json: Qwen3.5's processor (mean / std 0.5, bicubic, patch 16, temporal 2, merge 2)
    with the pixel bounds of the demo: at most 128x128 pixels, at least 64x64."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "resample": 3,  # bicubic
        "rescale_factor": 1 / 255,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    }


def demo_wrapper_fields(tokenizer: Any) -> dict[str, int]:
    """config.json's top-level vision token ids, read from the tokenizer (anything with token_to_id)."""
    fields = {}
    for key, token in VISION_TOKENS.items():
        tid = tokenizer.token_to_id(token)
        if tid is None:
            raise ValueError(f"the tokenizer has no {token} token, which config.json's {key} needs")
        fields[key] = int(tid)
    return fields


def demo_config_with_vision(config: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """The demo's config.json (a Qwen3_5ForConditionalGeneration wrapper with text_config) with the tower added."""
    hidden = config["text_config"]["hidden_size"]
    if hidden != DEMO_TEXT_HIDDEN:
        raise ValueError(f"the text model's hidden_size is {hidden}; the demo tower projects to {DEMO_TEXT_HIDDEN}")
    return {**config, "vision_config": demo_vision_config(), **demo_wrapper_fields(tokenizer)}


def init_vision_tower(tower: torch.nn.Module, std: float = 0.02) -> None:
    """Hugging Face's initialisation of a vision tower: normal(0, std) projections, patch and position
    embeddings, zero biases, LayerNorms at weight 1 and bias 0."""
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if ".norm" in name or name.startswith("norm"):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0, std)


def random_visual_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """An initialised (untrained) demo tower's tensors, named as under model.visual.* (without the prefix)."""
    from deltaserve.model.vision import VisionTower

    torch.manual_seed(seed)
    tower = VisionTower(VisionConfig.from_dict(demo_vision_config()))
    init_vision_tower(tower)
    return {k: v.detach().clone() for k, v in tower.state_dict().items()}


def write_vision_checkpoint(source: Path, out: Path, visual: dict[str, torch.Tensor],
                            text: dict[str, torch.Tensor] | None = None) -> Path:
    """source's checkpoint (the demo) with a vision tower: its tensors (or `text`, in the official names
    model.language_model.* / mtp.* / lm_head.weight, e.g. fine-tuned ones) plus `visual` as model.visual.*, all in
    the source's dtype; config.json with vision_config and the token ids, preprocessor_config.json, the tokenizer
    and generation_config.json copied. out may be source itself."""
    from safetensors.torch import load_file, save_file

    from deltaserve.tokenizer import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    stored = load_file(str(source / "model.safetensors"))
    dtype = next(iter(stored.values())).dtype
    tensors = {k: v.to(dtype).contiguous() for k, v in (stored if text is None else text).items()
               if not k.startswith("model.visual.")}
    tensors |= {f"model.visual.{k}": v.to(dtype).contiguous() for k, v in visual.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config = demo_config_with_vision(config, Tokenizer.from_dir(source))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(demo_preprocessor_config(), indent=2) + "\n")
    for name in COPIED_FILES:
        if (source / name).resolve() != (out / name).resolve():
            shutil.copy(source / name, out / name)
    return out


# ---- training inputs ----

def training_segments(example: VisionExample, tokenizer: Any, enable_thinking: bool) -> list[tuple[str, bool]]:
    """(text, is_model_output) pieces: the chat prompt of [user: image + question] as LLM.chat renders it, then
    what the model must write. tokenizer: deltaserve.tokenizer.Tokenizer (it has the chat template)."""
    messages = [{"role": "user", "content": IMAGE_PLACEHOLDER + example.question}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=enable_thinking)
    output = example.answer + "<|im_end|>"
    if enable_thinking:
        output = example.reasoning + "\n</think>\n\n" + output
    return [(prompt, False), (output, True)]


@dataclass(slots=True)
class VisionTrainingInputs:
    input_ids: torch.Tensor  # [T] long: the prompt (its image placeholder expanded) and the model's output
    positions: torch.Tensor  # [3, T] long: mRoPE positions (t, h, w)
    pixel_values: torch.Tensor  # [patches, 3 * 2 * 16 * 16] float32, the processor's output
    grids: list[tuple[int, int, int]]  # (t, h, w) in patches per image
    image_rows: torch.Tensor  # [merged tokens] long: where input_ids holds image placeholders
    loss_mask: torch.Tensor  # [T] bool: token t is model output (learned by the logits at row t - 1)


def training_inputs_from_ids(prompt_ids: list[int], output_ids: list[int], images: list[Any],
                             processor: ImageProcessor, vision: VisionConfig) -> VisionTrainingInputs:
    """Token ids of a prompt (one <|image_pad|> per image) and of the model's output -> training tensors."""
    if vision.image_token_id in output_ids:
        raise ValueError("the model's output holds an image placeholder; images belong to the prompt")
    ids, mm = build_multimodal_prompt(prompt_ids + output_ids, images, vision, processor)
    input_ids = torch.tensor(ids, dtype=torch.long)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[len(ids) - len(output_ids):] = True
    rows = torch.cat([torch.arange(im.offset, im.end) for im in mm.images])
    return VisionTrainingInputs(input_ids, mm.positions, torch.cat([im.pixel_values for im in mm.images]),
                                [im.grid for im in mm.images], rows, mask)


def vision_training_inputs(example: VisionExample, tokenizer: Any, processor: ImageProcessor, vision: VisionConfig,
                           enable_thinking: bool) -> VisionTrainingInputs:
    """One example's training tensors (the module docstring gives the recipe). processor:
    ImageProcessor.from_dict(demo_preprocessor_config()); vision: ModelConfig.from_dict(config).vision."""
    (prompt, _), (output, _) = training_segments(example, tokenizer, enable_thinking)
    return training_inputs_from_ids(tokenizer.encode(prompt), tokenizer.encode(output), [example.image], processor,
                                    vision)


@dataclass(slots=True)
class VisionBatch:
    """Examples laid end to end, as ForwardContext.stateless lays sequences."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [3, T]
    pixel_values: torch.Tensor
    grids: list[tuple[int, int, int]]
    image_rows: torch.Tensor  # rows into the flat batch
    loss_mask: torch.Tensor  # [T] bool
    lengths: list[int]

    @classmethod
    def collate(cls, items: list[VisionTrainingInputs]) -> VisionBatch:
        starts = [0]
        for it in items:
            starts.append(starts[-1] + len(it.input_ids))
        return cls(
            torch.cat([it.input_ids for it in items]), torch.cat([it.positions for it in items], dim=1),
            torch.cat([it.pixel_values for it in items]), [g for it in items for g in it.grids],
            torch.cat([it.image_rows + s for it, s in zip(items, starts, strict=False)]),
            torch.cat([it.loss_mask for it in items]), [len(it.input_ids) for it in items],
        )

    def hidden(self, model: Any) -> torch.Tensor:
        """The final-normed hidden states [T, H] of deltaserve's Qwen3_5ForCausalLM (built with_vision=True),
        the tower run on the batch's pictures (autograd reaches it)."""
        embeds = model.encode_images(self.pixel_values, self.grids)
        ctx = ForwardContext.stateless(self.lengths)
        ctx.positions = self.positions
        ctx.mm_embeds = (self.image_rows, embeds)
        return model(self.input_ids, ctx)

    def loss(self, model: Any) -> torch.Tensor:
        """Mean cross-entropy of the model's output tokens (the trunk's next-token loss, no MTP)."""
        hidden = self.hidden(model)
        target = self.loss_mask[1:]
        logits = model.compute_logits(hidden[:-1][target])
        return F.cross_entropy(logits, self.input_ids[1:][target])
