"""Model configuration parsed from a Hugging Face `config.json` of the Qwen3.5 / Qwen3.8 family (dense and
sparse-MoE) and of Qwen3-Next."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)

# model_type -> (is vision-language wrapper, may be MoE: num_experts > 0 gives sparse MLPs)
MODEL_TYPES = {
    "qwen3_5": (True, False),
    "qwen3_5_text": (False, False),
    "qwen3_5_moe": (True, True),
    "qwen3_5_moe_text": (False, True),
    "qwen3_next": (False, True),
}
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


class ConfigError(ValueError):
    """A config.json that deltaserve cannot use: the message names the field, its value and what was expected."""


class UnsupportedFeatureError(NotImplementedError):
    """A valid configuration that names a feature deltaserve does not run yet (vision tower, ...)."""


# ---- the architectures, by the `architectures` name of a config.json -------------------------------------
# Every entry builds the same model (deltaserve/model/decoder.py); what differs is read from the config
# (dense or sparse-MoE MLPs) and, here, how the checkpoint stores its weights.
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


def resolve_architecture(architectures: list[str], model_type: str) -> Architecture:
    """The config's architecture: its first `architectures` entry, which must be known and agree with
    model_type; without any, the model_type's default."""
    if not architectures:
        return DEFAULT_FOR_MODEL_TYPE[model_type]
    name = architectures[0]
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise ConfigError(
            f"architecture {name!r} is not supported; known architectures: {', '.join(ARCHITECTURES)}"
        )
    if model_type not in arch.model_types:
        raise ConfigError(
            f"architecture {name!r} expects model_type {' or '.join(map(repr, arch.model_types))}, "
            f"but config.json says {model_type!r}"
        )
    return arch


@dataclass(slots=True)
class VisionConfig:
    """The vision tower of a `*ForConditionalGeneration` checkpoint (config.json's `vision_config`), with the
    wrapper's special token ids (`image_token_id`, ... sit beside `vision_config` in config.json)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10_000.0
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054

    @classmethod
    def from_dict(cls, d: dict[str, Any], wrapper: dict[str, Any] | None = None) -> VisionConfig:
        wrapper = wrapper or {}
        # Qwen3-VL's deepstack (visual features added to early decoder layers) is not part of Qwen3.5, whose
        # transformers model deletes it; a config that asks for it needs a model deltaserve does not build.
        if d.get("deepstack_visual_indexes"):
            raise UnsupportedFeatureError(
                f"vision_config.deepstack_visual_indexes {d['deepstack_visual_indexes']} asks for Qwen3-VL's "
                "deepstack mergers, which Qwen3.5 does not have and deltaserve does not run; accepted: [] or absent"
            )
        rope = dict(d.get("rope_parameters") or {})
        cfg = cls(
            depth=int(d.get("depth", 27)),
            hidden_size=int(d.get("hidden_size", 1152)),
            num_heads=int(d.get("num_heads", 16)),
            intermediate_size=int(d.get("intermediate_size", 4304)),
            patch_size=int(d.get("patch_size", 16)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            spatial_merge_size=int(d.get("spatial_merge_size", 2)),
            out_hidden_size=int(d.get("out_hidden_size", 3584)),
            num_position_embeddings=int(d.get("num_position_embeddings", 2304)),
            in_channels=int(d.get("in_channels", 3)),
            hidden_act=str(d.get("hidden_act", "gelu_pytorch_tanh")),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10_000.0))),
            **{k: int(wrapper[k]) for k in VISION_TOKEN_FIELDS if k in wrapper},
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ConfigError(
                f"vision_config.hidden_act {self.hidden_act!r} is not supported; accepted: "
                f"{', '.join(VISION_ACTIVATIONS)}"
            )
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ConfigError(
                f"vision_config.hidden_size {self.hidden_size} must split into num_heads {self.num_heads} heads "
                "whose size is a multiple of 4 (the 2-D rotary rotates a quarter of each head per axis)"
            )
        side = int(round(self.num_position_embeddings**0.5))
        if side * side != self.num_position_embeddings:
            raise ConfigError(
                f"vision_config.num_position_embeddings {self.num_position_embeddings} must be a square "
                "(the learned position grid is side x side)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def num_parameters(self) -> int:
        h, i, p = self.hidden_size, self.intermediate_size, self.patch_size
        patch_embed = self.in_channels * self.temporal_patch_size * p * p * h + h
        block = (3 * h * h + 3 * h) + (h * h + h) + (2 * h * i + i + h) + 4 * h
        merged = h * self.spatial_merge_size**2
        merger = 2 * h + merged * merged + merged + merged * self.out_hidden_size + self.out_hidden_size
        return patch_embed + self.num_position_embeddings * h + self.depth * block + merger


VISION_TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu", "quick_gelu")


@dataclass(slots=True)
class ModelConfig:
    """The text model's shape and math constants; names follow the Hugging Face config fields."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: list[str]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: list[int] | None = None
    mrope_interleaved: bool = True
    max_position_embeddings: int = 262_144
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False
    mamba_ssm_dtype: str = "float32"
    # Sparse MoE (0 experts: dense MLPs of intermediate_size everywhere). Layer i is sparse unless it is in
    # mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (Qwen3-Next's fields; Qwen3.5-MoE has neither).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    quantization_config: dict[str, Any] | None = None
    vision: VisionConfig | None = None
    architectures: list[str] = field(default_factory=list)
    architecture: Architecture | None = None  # from ARCHITECTURES, by config.json's `architectures`

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return MODEL_TYPES[self.model_type][1] and self.num_experts > 0

    def sparse_mlp(self, layer_id: int) -> bool:
        """Whether layer `layer_id` has a sparse-MoE MLP. Ids past the trunk are MTP layers: sparse in a MoE
        model, as in the released MoE checkpoints (their mtp.layers.0.mlp has experts)."""
        if not self.is_moe:
            return False
        if layer_id >= self.num_hidden_layers:
            return True
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0

    @property
    def sparse_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.sparse_mlp(i)]

    @property
    def dense_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.sparse_mlp(i)]

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def gdn_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    # ---- parsing -------------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"no config.json at {path}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        model_type = data.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; accepted: {', '.join(sorted(MODEL_TYPES))}"
            )
        is_wrapper = MODEL_TYPES[model_type][0]
        text = dict(data.get("text_config") or {}) if is_wrapper else dict(data)
        if is_wrapper and not text:
            raise ConfigError(f"model_type {model_type!r} needs a 'text_config' section")
        # Top-level fields that wrappers keep outside text_config.
        for key in ("tie_word_embeddings", "torch_dtype", "dtype", "quantization_config", "eos_token_id"):
            if key not in text and key in data:
                text[key] = data[key]
        text_type = f"{model_type}_text" if is_wrapper else model_type
        architecture = resolve_architecture(list(data.get("architectures") or []), model_type)

        def need(key: str) -> Any:
            if key not in text:
                raise ConfigError(f"config field {key!r} is missing (model_type {model_type!r})")
            return text[key]

        num_layers = int(need("num_hidden_layers"))
        layer_types = _layer_types(text, num_layers)
        rope = dict(text.get("rope_parameters") or {})
        rope_scaling = dict(text.get("rope_scaling") or {})
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        mrope_section = rope.get("mrope_section", rope_scaling.get("mrope_section"))
        mrope_interleaved = rope.get("mrope_interleaved", rope_scaling.get("mrope_interleaved", True))
        eos = text.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        moe = _moe_fields(text, need, architecture) if MODEL_TYPES[model_type][1] else {}
        cfg = cls(
            model_type=text_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(text.get("intermediate_size") or 0),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads", heads)),
            head_dim=int(text.get("head_dim") or hidden // heads),
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            layer_types=layer_types,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            mrope_section=[int(s) for s in mrope_section] if mrope_section else None,
            mrope_interleaved=bool(mrope_interleaved),
            max_position_embeddings=int(text.get("max_position_embeddings", 262_144)),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            hidden_act=str(text.get("hidden_act", "silu")),
            eos_token_ids=eos_ids,
            bos_token_id=text.get("bos_token_id"),
            pad_token_id=text.get("pad_token_id"),
            torch_dtype=str(text.get("dtype") or text.get("torch_dtype") or "bfloat16"),
            # Qwen3-Next configs may name it as DeepSeek-V3 does.
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers", 0))),
            mtp_use_dedicated_embeddings=bool(text.get("mtp_use_dedicated_embeddings", False)),
            mamba_ssm_dtype=str(text.get("mamba_ssm_dtype", "float32")),
            **moe,
            quantization_config=text.get("quantization_config"),
            vision=VisionConfig.from_dict(data["vision_config"], data) if data.get("vision_config") else None,
            architectures=list(data.get("architectures") or []),
            architecture=architecture,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {value!r}")

        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim",
        ):
            positive(name)
        if self.is_moe:
            for name in MOE_FIELDS:
                positive(name)
            if self.num_experts_per_tok > self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) is more than num_experts ({self.num_experts})"
                )
            if self.decoder_sparse_step < 1:
                raise ConfigError(f"decoder_sparse_step must be a positive integer, got {self.decoder_sparse_step}")
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ConfigError(
                    f"mlp_only_layers {self.mlp_only_layers} names layer(s) {bad} outside "
                    f"0..{self.num_hidden_layers - 1}"
                )
        if self.dense_layer_ids:
            positive("intermediate_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ConfigError(
                f"partial_rotary_factor {self.partial_rotary_factor} gives rotary dim {self.rotary_dim} of "
                f"head_dim {self.head_dim}; it must be a positive even number of dims"
            )
        if self.mrope_section is not None and 2 * sum(self.mrope_section) != self.rotary_dim:
            raise ConfigError(
                f"mrope_section {self.mrope_section} must sum to rotary_dim/2 = {self.rotary_dim // 2}"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported; accepted: 'silu'")
        if self.mamba_ssm_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"mamba_ssm_dtype {self.mamba_ssm_dtype!r} must be float32, bfloat16 or float16")


def _moe_fields(text: dict[str, Any], need: Callable[[str], Any], architecture: Architecture) -> dict[str, Any]:
    """The sparse-MoE fields of a MoE-capable config. Qwen3-Next may set num_experts 0 (dense); otherwise the
    expert shapes are required, not guessed. Qwen3.5-MoE has every layer sparse and always renormalises the
    top-k weights (transformers reads none of the three fields for it), so other values there are errors."""
    if int(text.get("num_experts", 0)) == 0 and "num_experts" in text and architecture.moe_layout_fields:
        return {"num_experts": 0}
    if not architecture.moe_layout_fields:
        if int(need("num_experts")) <= 0:
            raise ConfigError(f"config field 'num_experts' must be a positive integer for {architecture.name}")
        for key, default in (("norm_topk_prob", True), ("decoder_sparse_step", 1), ("mlp_only_layers", [])):
            if key in text and text[key] not in (default, None):
                raise ConfigError(
                    f"config field {key!r} is {text[key]!r}, but {architecture.name} supports only "
                    f"{default!r} (every layer sparse, top-k weights renormalised)"
                )
    return dict(
        num_experts=int(need("num_experts")),
        num_experts_per_tok=int(need("num_experts_per_tok")),
        moe_intermediate_size=int(need("moe_intermediate_size")),
        shared_expert_intermediate_size=int(need("shared_expert_intermediate_size")),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        decoder_sparse_step=int(text.get("decoder_sparse_step", 1)),
        mlp_only_layers=[int(i) for i in text.get("mlp_only_layers") or []],
    )


def _layer_types(text: dict[str, Any], num_layers: int) -> list[str]:
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        if interval <= 0:
            raise ConfigError(f"full_attention_interval must be positive, got {interval}")
        return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ConfigError(
            f"layer_types has {len(layer_types)} entries but num_hidden_layers is {num_layers}"
        )
    for i, t in enumerate(layer_types):
        if t not in LAYER_TYPES:
            raise ConfigError(
                f"layer_types[{i}] is {t!r}: unknown layer type for layer {i}; accepted: {', '.join(LAYER_TYPES)}"
            )
    return list(layer_types)
