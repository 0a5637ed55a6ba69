"""The architectures deltaserve runs, by the `architectures` name of a config.json.

Every entry builds the same model (deltaserve/model/decoder.py); what differs is read from the config
(dense or sparse-MoE MLPs) and, here, how the checkpoint stores its weights. This module imports nothing
from the model so the config parser can use it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str
    model_types: tuple[str, ...]  # the model_type values a config.json of this architecture may carry
    # Qwen3-Next keeps the GDN input projections fused: in_proj_qkvz and in_proj_ba, grouped per key head.
    fused_gdn_projections: bool = False
    # Qwen3-Next reads decoder_sparse_step, mlp_only_layers and norm_topk_prob (and allows 0 experts);
    # Qwen3.5-MoE makes every layer sparse and always renormalises the top-k weights.
    moe_layout_fields: bool = False


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("Qwen3_5ForCausalLM", ("qwen3_5_text",)),
        Architecture("Qwen3_5ForConditionalGeneration", ("qwen3_5",)),
        Architecture("Qwen3_5MoeForCausalLM", ("qwen3_5_moe_text",)),
        Architecture("Qwen3_5MoeForConditionalGeneration", ("qwen3_5_moe",)),
        Architecture("Qwen3NextForCausalLM", ("qwen3_next",), fused_gdn_projections=True,
                     moe_layout_fields=True),
    )
}
# A config.json without `architectures` (transformers' save always writes it) gets its model_type's.
DEFAULT_FOR_MODEL_TYPE = {t: a for a in ARCHITECTURES.values() for t in a.model_types}


class UnknownArchitectureError(ValueError):
    pass


def resolve_architecture(architectures: list[str], model_type: str) -> Architecture:
    """The config's architecture: its first `architectures` entry, which must be known and agree with
    model_type; without any, the model_type's default."""
    if not architectures:
        return DEFAULT_FOR_MODEL_TYPE[model_type]
    name = architectures[0]
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise UnknownArchitectureError(
            f"architecture {name!r} is not supported; known architectures: {', '.join(ARCHITECTURES)}"
        )
    if model_type not in arch.model_types:
        raise UnknownArchitectureError(
            f"architecture {name!r} expects model_type {' or '.join(map(repr, arch.model_types))}, "
            f"but config.json says {model_type!r}"
        )
    return arch
