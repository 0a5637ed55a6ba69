"""Memory planner: how many bytes the weights, the paged KV cache of the attention layers, the
per-sequence GDN states and the vision encoder cache take, per tensor-parallel rank (rank 0's, which alone
holds the vision tower and its encoder cache), for a workload. The
cache arithmetic is deltaserve/cache/sizing.py's (and engine/encoder_cache.py's), the same functions the
engine sizes its pools with, so the two can never disagree; per-rank head counts are
deltaserve/model/sharding.py's; `deltaserve plan` prints the plan (deltaserve/cli_plan.py)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from deltaserve.cache.dtypes import DTYPE_BYTES, normalize_dtype, resolve_kv_cache_dtype
from deltaserve.cache.sizing import (
    gdn_conv_bytes_per_layer,
    gdn_recurrent_bytes_per_layer,
    gdn_state_bytes_per_seq,
    kv_bytes_per_block,
    kv_bytes_per_token_per_layer,
    num_kv_cache_layers,
)
from deltaserve.config import ModelConfig, VisionConfig
from deltaserve.engine.encoder_cache import encoder_cache_tokens
from deltaserve.engine.image_processor import ImageProcessor
from deltaserve.model.linear import Linear, quantizable
from deltaserve.model.sharding import RankShape, rank_shape
from deltaserve.ops.formats import WeightFormat

# Modules an FP8 block-quantized checkpoint keeps in high precision when its config does not list them:
# embeddings and the output head, the tiny GDN a/b projections (Hv rows, below one 128 block) and the vision
# tower; norms, conv1d, A_log and dt_bias are not linear weights and are never quantized. MoE: the router
# and the shared expert's gate (assumed kept, as vLLM runs shared_expert_gate unquantized).
DEFAULT_FP8_NOT_CONVERTED = ("lm_head", "embed_tokens", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
                             "model.visual", "mtp.fc", "mlp.gate", "mlp.shared_expert_gate")


# ---- weights -------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Tensor:
    name: str  # module path relative to its part, e.g. "linear_attn.in_proj_qkv"
    full: tuple[int, ...]
    rank: tuple[int, ...]
    linear: bool = False  # a 2-D matmul weight, the only kind FP8 quantizes


@dataclass(slots=True)
class WeightPart:
    """One kind of weight group. Numbers are per instance; `count` instances exist (e.g. 48 GDN layers)."""

    name: str
    count: int
    params: int  # whole-model parameters of one instance
    params_per_rank: int
    bytes_per_rank: int  # one instance on one rank (FP8: 1 byte per weight + block scales)
    active_params: int = 0  # whole-model parameters of one instance one decode token reads
    active_bytes_per_rank: int = 0  # what one decode token reads of one instance on one rank
    included: bool = True  # counted in the totals (MTP only when speculating; vision when loaded)
    module: str = ""  # checkpoint name prefix, for matching modules_to_not_convert

    @property
    def total_params(self) -> int:
        return self.count * self.params

    @property
    def total_bytes_per_rank(self) -> int:
        return self.count * self.bytes_per_rank

    @property
    def total_active_bytes_per_rank(self) -> int:
        return self.count * self.active_bytes_per_rank


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


# Tensor-parallel splits, by parameter name within a layer: which dimension a rank holds part of, and how
# much of it (vLLM's column-parallel projections, and the row-parallel ones after them; MoE experts split
# along their width, see deltaserve/model/sharding.py).
def _rank_splits(cfg: ModelConfig, r: RankShape) -> dict[str, tuple[int, int]]:
    dk, dv, hd = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.head_dim
    conv = 2 * r.gdn_key_heads * dk + r.gdn_value_heads * dv
    rows = {
        "linear_attn.in_proj_qkv": conv, "linear_attn.in_proj_z": r.gdn_value_heads * dv,
        "linear_attn.in_proj_b": r.gdn_value_heads, "linear_attn.in_proj_a": r.gdn_value_heads,
        "linear_attn.conv1d": conv, "linear_attn.A_log": r.gdn_value_heads,
        "linear_attn.dt_bias": r.gdn_value_heads,
        "self_attn.q_proj": 2 * r.attention_heads * hd,  # query + gate
        "self_attn.k_proj": r.kv_heads * hd, "self_attn.v_proj": r.kv_heads * hd,
        "mlp.gate_proj": r.intermediate, "mlp.up_proj": r.intermediate,
        "mlp.shared_expert.gate_proj": r.shared_expert_intermediate,
        "mlp.shared_expert.up_proj": r.shared_expert_intermediate,
        "embed_tokens": r.vocab, "lm_head": r.vocab,  # mtp.fc is replicated (model/sharding.py rank_slice)
    }
    cols = {
        "linear_attn.out_proj": r.gdn_value_heads * cfg.linear_value_head_dim,
        "self_attn.o_proj": r.attention_heads * cfg.head_dim, "mlp.down_proj": r.intermediate,
        "mlp.shared_expert.down_proj": r.shared_expert_intermediate,
    }
    return {
        **{k: (0, v) for k, v in rows.items()}, **{k: (1, v) for k, v in cols.items()},
        "mlp.experts.gate_up_proj": (1, 2 * r.expert_intermediate),  # [E, 2I, H]
        "mlp.experts.down_proj": (2, r.expert_intermediate),  # [E, H, I]
    }


EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _meta_model(cfg: ModelConfig) -> torch.nn.Module:
    """The model with every part the config describes (the MTP head too), built without memory: its
    parameters' shapes are the inventory."""
    from deltaserve.model.decoder import Qwen3_5ForCausalLM

    with torch.device("meta"):
        return Qwen3_5ForCausalLM(cfg, with_mtp=cfg.mtp_num_hidden_layers > 0)


def _tensors(module: torch.nn.Module, cfg: ModelConfig, r: RankShape, prefix: str = "") -> list[_Tensor]:
    """module's parameters (names relative to it, prefixed) with their whole-model and per-rank shapes. The
    3-D expert weights count as linear: FP8 releases quantize them expert by expert."""
    splits = _rank_splits(cfg, r)
    linear = {name for name, m in module.named_modules() if isinstance(m, Linear)}
    out = []
    for name, p in module.named_parameters():
        owner = "" if name == "weight" else name.removesuffix(".weight")  # the module holding p
        key = prefix + owner
        split = re.sub(r"^layers\.\d+\.", "", key)  # an MTP layer splits as a decoder layer does
        shape = tuple(p.shape)
        rank = list(shape)
        if split in splits:
            dim, size = splits[split]
            rank[dim] = size
        out.append(_Tensor(key, shape, tuple(rank), owner in linear or split in EXPERT_WEIGHTS))
    return out


def _active_share(t: _Tensor, cfg: ModelConfig, shape: tuple[int, ...]) -> float:
    """The share of tensor t one decode token reads: its top-k of the routed experts, its embedding row (all
    of a tied embedding: it is the lm_head too)."""
    if ".experts." in f".{t.name}":
        return cfg.num_experts_per_tok / cfg.num_experts
    if t.name.endswith("embed_tokens") and not cfg.tie_word_embeddings:
        return 1 / shape[0]
    return 1.0


def _names_module(full_name: str, module: str) -> bool:
    """Whether a modules_to_not_convert entry names full_name: whole dotted components, so 'mlp.gate' (the
    router) does not match 'mlp.gate_proj'."""
    return re.search(rf"(^|\.){re.escape(module)}(\.|$)", full_name) is not None


def _vision_tensors(cfg: ModelConfig) -> list[_Tensor]:
    """The tower's tensors; under tensor parallelism rank 0 holds them all (the plan sizes rank 0, the largest)
    and the other ranks none: the tower is not sharded (executor/tensor_parallel.py)."""
    v = cfg.vision
    assert v is not None
    h, i, p = v.hidden_size, v.intermediate_size, v.patch_size
    m = h * v.spatial_merge_size**2
    out = v.out_hidden_size
    t = [
        _Tensor("patch_embed.proj.weight", (h, v.in_channels, v.temporal_patch_size, p, p),
                (h, v.in_channels, v.temporal_patch_size, p, p)),
        _Tensor("patch_embed.proj.bias", (h,), (h,)),
        _Tensor("pos_embed", (v.num_position_embeddings, h), (v.num_position_embeddings, h)),
    ]
    block = [
        _Tensor("norm1", (2 * h,), (2 * h,)),
        _Tensor("norm2", (2 * h,), (2 * h,)),
        _Tensor("attn.qkv", (3 * h, h), (3 * h, h), True),
        _Tensor("attn.qkv.bias", (3 * h,), (3 * h,)),
        _Tensor("attn.proj", (h, h), (h, h), True),
        _Tensor("attn.proj.bias", (h,), (h,)),
        _Tensor("mlp.linear_fc1", (i, h), (i, h), True),
        _Tensor("mlp.linear_fc1.bias", (i,), (i,)),
        _Tensor("mlp.linear_fc2", (h, i), (h, i), True),
        _Tensor("mlp.linear_fc2.bias", (h,), (h,)),
    ]
    t += [_Tensor(f"blocks.{b}.{x.name}", x.full, x.rank, x.linear) for b in range(v.depth) for x in block]
    t += [
        _Tensor("merger.norm", (2 * h,), (2 * h,)),
        _Tensor("merger.linear_fc1", (m, m), (m, m), True),
        _Tensor("merger.linear_fc1.bias", (m,), (m,)),
        _Tensor("merger.linear_fc2", (out, m), (out, m), True),
        _Tensor("merger.linear_fc2.bias", (out,), (out,)),
    ]
    return t


def weight_parts(
    cfg: ModelConfig, tp: int = 1, weight_dtype: str | None = None, with_mtp: bool = False,
    include_vision: bool = True, quantization: str | None = None, group_size: int | None = None,
    quantize_lm_head: bool = True,
) -> list[WeightPart]:
    """Weights grouped by part, with per-rank bytes in `weight_dtype` (default: fp8 for an FP8 checkpoint,
    else the config's dtype). With 'fp8', linear weights (2-D, and the 3-D experts expert by expert) not
    listed as kept are 1 byte each plus one fp32 scale per block; everything else stays in the config's
    dtype. With `quantization` (fp8 / int8 / int4), the projections the engine quantizes
    (deltaserve/model/linear.py quantizable: a tied embedding with its head) take that format's bytes,
    WeightFormat.nbytes, the engine's own arithmetic. Each part also says what one decode token reads of it
    (active): num_experts_per_tok of the num_experts routed experts, one embedding row, everything else
    whole."""
    r = rank_shape(cfg, tp)
    quant = cfg.quantization_config or {}
    quant_fp8 = quant.get("quant_method") == "fp8"
    if weight_dtype:
        wdtype = normalize_dtype(weight_dtype)
    else:
        wdtype = "fp8" if quant_fp8 else normalize_dtype(cfg.torch_dtype)
    hp_dtype = normalize_dtype(cfg.torch_dtype)
    if DTYPE_BYTES[hp_dtype] == 1:
        hp_dtype = "bfloat16"
    fp8 = DTYPE_BYTES[wdtype] == 1
    block = list(quant.get("weight_block_size") or [128, 128])
    not_converted = list(
        quant.get("modules_to_not_convert") or quant.get("ignored_layers") or DEFAULT_FP8_NOT_CONVERTED
    )

    quantized = None if quantization is None else WeightFormat.of(quantization, group_size)

    def stored_format(full_name: str, t: _Tensor) -> WeightFormat | None:
        """The format the engine stores a linear weight in (None: not a linear weight)."""
        tied_head = cfg.tie_word_embeddings and full_name.endswith("embed_tokens")
        if not (t.linear or tied_head):
            return None
        if quantized is not None and quantizable("lm_head" if tied_head else full_name, quantize_lm_head):
            return quantized
        if fp8 and t.linear and not any(_names_module(full_name, k) for k in not_converted):
            return WeightFormat("fp8", block[1])  # one fp32 scale per row and 128 columns (ops/formats.py)
        return None

    def nbytes(module: str, t: _Tensor) -> int:
        fmt = stored_format(f"{module}.{t.name}" if module else t.name, t)
        if fmt is not None:
            *experts, rows, cols = t.rank
            return math.prod(experts) * fmt.nbytes(rows, cols)
        return _numel(t.rank) * DTYPE_BYTES[wdtype if not fp8 else hp_dtype]

    def part(name: str, module: str, count: int, tensors: list[_Tensor], included: bool = True) -> WeightPart:
        return WeightPart(
            name=name, count=count, params=sum(_numel(t.full) for t in tensors),
            params_per_rank=sum(_numel(t.rank) for t in tensors),
            bytes_per_rank=sum(nbytes(module, t) for t in tensors),
            active_params=round(sum(_numel(t.full) * _active_share(t, cfg, t.full) for t in tensors)),
            active_bytes_per_rank=round(sum(nbytes(module, t) * _active_share(t, cfg, t.rank) for t in tensors)),
            included=included, module=module,
        )

    lm = "model.language_model"
    model = _meta_model(cfg)
    text = model.model
    # Sample layer indices give modules_to_not_convert a concrete name to match (e.g. "layers.0.mlp").
    gdn_i = cfg.gdn_layer_ids[0] if cfg.gdn_layer_ids else 0
    att_i = cfg.attention_layer_ids[0] if cfg.attention_layer_ids else 0
    gdn_layer, att_layer = text.layers[gdn_i], text.layers[att_i]
    norms = [t for t in _tensors(gdn_layer, cfg, r) if t.name.endswith("layernorm")]
    dense, sparse = cfg.dense_layer_ids, cfg.sparse_layer_ids
    parts = [
        part("embedding", lm, 1, _tensors(text.embed_tokens, cfg, r, "embed_tokens")),
        part("lm_head", "", 0 if cfg.tie_word_embeddings else 1, _tensors(model.lm_head, cfg, r, "lm_head")),
        part("GDN mixer", f"{lm}.layers.{gdn_i}", len(cfg.gdn_layer_ids),
             _tensors(gdn_layer.linear_attn, cfg, r, "linear_attn.") if cfg.gdn_layer_ids else []),
        part("attention mixer", f"{lm}.layers.{att_i}", len(cfg.attention_layer_ids),
             _tensors(att_layer.self_attn, cfg, r, "self_attn.") if cfg.attention_layer_ids else []),
    ]
    if dense:
        mlp = _tensors(text.layers[dense[0]].mlp, cfg, r, "mlp.")
        parts.append(part("MLP", f"{lm}.layers.{dense[0]}", len(dense), mlp))
    if sparse:
        moe, module = text.layers[sparse[0]].mlp, f"{lm}.layers.{sparse[0]}"
        parts += [
            part("MoE router", module, len(sparse), _tensors(moe.gate, cfg, r, "mlp.gate")
                 + _tensors(moe.shared_expert_gate, cfg, r, "mlp.shared_expert_gate")),
            part("routed experts", module, len(sparse), _tensors(moe.experts, cfg, r, "mlp.experts.")),
            part("shared expert", module, len(sparse), _tensors(moe.shared_expert, cfg, r, "mlp.shared_expert.")),
        ]
    parts += [
        part("layer norms", f"{lm}.layers.{gdn_i}", cfg.num_hidden_layers, norms),
        part("final norm", lm, 1, _tensors(text.norm, cfg, r, "norm")),
    ]
    if model.mtp is not None:
        parts.append(part("MTP", "mtp", 1, _tensors(model.mtp, cfg, r), included=with_mtp))
    if cfg.vision is not None:
        vision = _vision_tensors(cfg)
        parts.append(part("vision tower", "model.visual", 1, vision, included=include_vision))
    return parts


# ---- the plan ------------------------------------------------------------------------------------------
def text_parts(parts: list[WeightPart]) -> list[WeightPart]:
    """The text model's parts among weight_parts: the MTP head and vision tower aside."""
    return [p for p in parts if p.name not in ("MTP", "vision tower")]


@dataclass(slots=True)
class MemoryPlan:
    tp: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    with_mtp: bool
    model_dtype: str
    weight_dtype: str
    kv_cache_dtype: str
    ssm_state_dtype: str
    num_layers: int
    num_attention_layers: int
    num_gdn_layers: int
    num_kv_cache_layers: int
    rank: RankShape
    num_experts: int  # 0: dense
    num_experts_per_tok: int
    num_sparse_layers: int
    # paged KV of the attention layers (per rank)
    kv_bytes_per_token_per_layer: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    blocks_per_seq: int
    num_kv_blocks: int
    kv_cache_bytes: int
    # GDN state slots (per rank)
    gdn_recurrent_bytes_per_layer: int
    gdn_conv_bytes_per_layer: int
    gdn_state_bytes_per_seq: int
    gdn_state_bytes: int
    # GDN state snapshots of prefix caching (per rank): each the size of one slot
    num_gdn_snapshots: int = 0
    gdn_snapshot_bytes: int = 0
    # the vision tower's outputs kept for prefill (engine/encoder_cache.py's capacity); 0 without images
    max_num_batched_tokens: int = 0
    encoder_tokens_per_image: int = 0  # merged tokens of the largest picture the processor makes
    encoder_cache_tokens: int = 0
    encoder_cache_bytes: int = 0
    # weights (per rank)
    weight_parts: list[WeightPart] = field(default_factory=list)
    weight_bytes: int = 0
    # what one decode token reads of the loaded text weights (per rank): with MoE, num_experts_per_tok of
    # the routed experts; one embedding row (a tied one whole: it is the lm_head); the MTP head when
    # speculating; never the vision tower
    active_weight_bytes: int = 0
    active_params: int = 0  # whole-model parameters of the text model (no MTP) one decode token reads
    # whole-model parameter counts
    text_params: int = 0
    mtp_params: int = 0
    vision_params: int = 0
    quantization: str = ""  # --quantization's format of the projections ("": the checkpoint's)
    total_bytes: int = 0
    model_name: str = ""

    @property
    def cache_bytes(self) -> int:
        return self.kv_cache_bytes + self.gdn_state_bytes + self.gdn_snapshot_bytes + self.encoder_cache_bytes


def default_max_tokens_per_image(vision: VisionConfig) -> int:
    """The largest picture's merged tokens for a checkpoint without a preprocessor_config.json (the engine
    then uses Qwen3.5's defaults with the tower's patch sizes, ImageProcessor.from_dir)."""
    cut = dict(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
               merge_size=vision.spatial_merge_size)
    return ImageProcessor.from_dict(cut).max_tokens_per_image


def plan_memory(
    cfg: ModelConfig,
    max_model_len: int,
    max_num_seqs: int,
    kv_cache_dtype: str = "auto",
    tp: int = 1,
    weight_dtype: str | None = None,
    block_size: int = 16,
    with_mtp: bool = False,
    include_vision: bool = True,
    dtype: str | torch.dtype | None = None,
    model_name: str = "",
    num_gdn_snapshots: int = 0,
    quantization: str | None = None,
    group_size: int | None = None,
    quantize_lm_head: bool = True,
    max_num_batched_tokens: int = 2048,
    max_tokens_per_image: int | None = None,
) -> MemoryPlan:
    """Worst-case memory per TP rank for max_num_seqs sequences of max_model_len tokens each: every sequence
    holds ceil(max_model_len / block_size) KV blocks and one GDN state slot; prefix caching adds
    num_gdn_snapshots GDN state snapshots; a loaded vision tower adds the encoder cache's capacity
    (encoder_cache_tokens of max_num_batched_tokens and max_tokens_per_image, the largest picture's merged
    tokens: default Qwen3.5's processor) in the activation dtype. `dtype` is the activation /
    model dtype (default the config's); it sets 'auto' KV and the conv state."""
    sizes = (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs), ("block_size", block_size),
             ("max_num_batched_tokens", max_num_batched_tokens))
    for name, value in sizes:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    model_dtype = normalize_dtype(dtype if dtype is not None else cfg.torch_dtype)
    if DTYPE_BYTES[model_dtype] == 1:
        raise ValueError(f"model dtype {model_dtype!r} cannot be an fp8 dtype; activations run in 16/32-bit")
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, model_dtype)
    ssm_dtype = normalize_dtype(cfg.mamba_ssm_dtype)
    r = rank_shape(cfg, tp)
    quant = cfg.quantization_config or {}
    wdtype = normalize_dtype(weight_dtype) if weight_dtype else (
        "fp8" if quant.get("quant_method") == "fp8" else model_dtype
    )
    parts = weight_parts(cfg, tp, wdtype, with_mtp, include_vision, quantization, group_size, quantize_lm_head)

    per_tok_layer = kv_bytes_per_token_per_layer(cfg, kv_dtype, tp)
    n_kv_layers = num_kv_cache_layers(cfg, with_mtp)
    per_block = kv_bytes_per_block(cfg, block_size, kv_dtype, with_mtp, tp)
    blocks_per_seq = math.ceil(max_model_len / block_size)
    num_blocks = blocks_per_seq * max_num_seqs
    rec = gdn_recurrent_bytes_per_layer(cfg, ssm_dtype, tp)
    conv = gdn_conv_bytes_per_layer(cfg, model_dtype, tp)
    per_seq = gdn_state_bytes_per_seq(cfg, model_dtype, ssm_dtype, tp)
    weight_bytes = sum(p.total_bytes_per_rank for p in parts if p.included)
    active_bytes = sum(p.total_active_bytes_per_rank for p in parts if p.included and p.name != "vision tower")

    per_image = encoder_tokens = encoder_bytes = 0
    if cfg.vision is not None and include_vision:  # under TP on rank 0, beside the tower
        per_image = default_max_tokens_per_image(cfg.vision) if max_tokens_per_image is None else max_tokens_per_image
        encoder_tokens = encoder_cache_tokens(max_num_batched_tokens, per_image)
        encoder_bytes = encoder_tokens * cfg.vision.out_hidden_size * DTYPE_BYTES[model_dtype]

    by_name = {p.name: p for p in parts}
    text = text_parts(parts)
    plan = MemoryPlan(
        tp=tp, max_model_len=max_model_len, max_num_seqs=max_num_seqs, block_size=block_size,
        with_mtp=with_mtp, model_dtype=model_dtype, weight_dtype=wdtype, kv_cache_dtype=kv_dtype,
        ssm_state_dtype=ssm_dtype, num_layers=cfg.num_hidden_layers,
        num_attention_layers=len(cfg.attention_layer_ids), num_gdn_layers=len(cfg.gdn_layer_ids),
        num_kv_cache_layers=n_kv_layers, rank=r, num_experts=cfg.num_experts if cfg.is_moe else 0,
        num_experts_per_tok=cfg.num_experts_per_tok, num_sparse_layers=len(cfg.sparse_layer_ids),
        kv_bytes_per_token_per_layer=per_tok_layer, kv_bytes_per_token=per_tok_layer * n_kv_layers,
        kv_bytes_per_block=per_block, blocks_per_seq=blocks_per_seq, num_kv_blocks=num_blocks,
        kv_cache_bytes=num_blocks * per_block,
        gdn_recurrent_bytes_per_layer=rec, gdn_conv_bytes_per_layer=conv, gdn_state_bytes_per_seq=per_seq,
        gdn_state_bytes=per_seq * max_num_seqs,
        num_gdn_snapshots=num_gdn_snapshots, gdn_snapshot_bytes=per_seq * num_gdn_snapshots,
        max_num_batched_tokens=max_num_batched_tokens, encoder_tokens_per_image=per_image,
        encoder_cache_tokens=encoder_tokens, encoder_cache_bytes=encoder_bytes,
        weight_parts=parts, weight_bytes=weight_bytes, quantization=quantization or "",
        text_params=sum(p.total_params for p in text), active_weight_bytes=active_bytes,
        active_params=sum(p.count * p.active_params for p in text),
        mtp_params=by_name["MTP"].total_params if "MTP" in by_name else 0,
        vision_params=by_name["vision tower"].total_params if "vision tower" in by_name else 0,
        model_name=model_name,
    )
    # The fused CPU step reads the weights as loaded: no copies to count.
    plan.total_bytes = plan.weight_bytes + plan.cache_bytes
    return plan
