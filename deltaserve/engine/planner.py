"""Memory planner: the one place that knows how many bytes the weights, the paged KV cache of the attention
layers and the per-sequence GDN states take, per tensor-parallel rank. The engine sizes its pools with these
functions and `deltaserve plan` prints them, so the two can never disagree.

Tensor parallelism follows vLLM: attention heads nh/tp, KV heads max(1, nkv/tp) (replicated when
tp > nkv), GDN key/value heads Hk/tp, Hv/tp, MLP width I/tp, embedding and lm_head vocab-parallel
(vocabulary padded to a multiple of 64, then split), norms replicated."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from deltaserve.config import ConfigError, ModelConfig, UnsupportedFeatureError
from deltaserve.executor.fused_cpu.stack import PANEL

DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}
_DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
    "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
}
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
VOCAB_PADDING = 64  # vLLM's VocabParallelEmbedding pads the vocabulary to this multiple before splitting
FP8_SCALE_BYTES = 4  # one fp32 weight_scale_inv per block
# Modules an FP8 block-quantized checkpoint keeps in high precision when its config does not list them:
# embeddings and the output head, the tiny GDN a/b projections (Hv rows, below one 128 block) and the vision
# tower; norms, conv1d, A_log and dt_bias are not linear weights and are never quantized.
DEFAULT_FP8_NOT_CONVERTED = ("lm_head", "embed_tokens", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
                             "model.visual", "mtp.fc")


def normalize_dtype(dtype: str | torch.dtype) -> str:
    """'bfloat16' / torch.bfloat16 / 'bf16' -> 'bfloat16'; raises ValueError naming an unknown dtype."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = str(dtype).lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not known to the planner; accepted: {', '.join(DTYPE_BYTES)}")
    return name


def dtype_bytes(dtype: str | torch.dtype) -> int:
    return DTYPE_BYTES[normalize_dtype(dtype)]


def resolve_kv_cache_dtype(kv_cache_dtype: str | torch.dtype, model_dtype: str | torch.dtype) -> str:
    """'auto' means the model's activation dtype, as in vLLM."""
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype == "auto":
        return normalize_dtype(model_dtype)
    try:
        return normalize_dtype(kv_cache_dtype)
    except ValueError:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported; accepted: {', '.join(KV_CACHE_DTYPES)}"
        ) from None


# ---- per-rank head counts -------------------------------------------------------------------------------
@dataclass(slots=True)
class RankShape:
    """How many heads / channels of each kind one tensor-parallel rank holds."""

    tp: int
    attention_heads: int
    kv_heads: int
    gdn_key_heads: int
    gdn_value_heads: int
    intermediate: int
    vocab: int  # padded vocabulary rows per rank


def rank_shape(cfg: ModelConfig, tp: int = 1) -> RankShape:
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")

    def split(name: str, value: int) -> int:
        if value % tp:
            raise ConfigError(f"{name} ({value}) is not divisible by tensor parallel size {tp}")
        return value // tp

    nkv = cfg.num_key_value_heads
    if tp >= nkv:
        if tp % nkv:
            raise ConfigError(f"tensor parallel size {tp} must be a multiple of num_key_value_heads ({nkv})")
        kv_heads = 1  # replicated: each of the nkv heads lives on tp/nkv ranks
    else:
        kv_heads = split("num_key_value_heads", nkv)
    padded_vocab = _round_up(cfg.vocab_size, VOCAB_PADDING)
    return RankShape(
        tp=tp,
        attention_heads=split("num_attention_heads", cfg.num_attention_heads),
        kv_heads=kv_heads,
        gdn_key_heads=split("linear_num_key_heads", cfg.linear_num_key_heads),
        gdn_value_heads=split("linear_num_value_heads", cfg.linear_num_value_heads),
        intermediate=split("intermediate_size", cfg.intermediate_size),
        vocab=math.ceil(padded_vocab / tp),
    )


# ---- cache arithmetic (what the engine sizes its pools with) -------------------------------------------
def num_kv_cache_layers(cfg: ModelConfig, with_mtp: bool = False) -> int:
    """Attention layers with a paged KV cache; the MTP layer(s) add their own when speculating (the same
    count `deltaserve.cache.tensors.allocate_cache` allocates)."""
    n = len(cfg.attention_layer_ids)
    if with_mtp:
        n += max(cfg.mtp_num_hidden_layers, 1)
    return n


def kv_bytes_per_token_per_layer(cfg: ModelConfig, dtype: str | torch.dtype, tp: int = 1) -> int:
    """K and V of one token in one attention layer: 2 * nkv * hd * bytes (per rank)."""
    return 2 * rank_shape(cfg, tp).kv_heads * cfg.head_dim * dtype_bytes(dtype)


def kv_bytes_per_block(
    cfg: ModelConfig, block_size: int, dtype: str | torch.dtype, with_mtp: bool = False, tp: int = 1
) -> int:
    """One block id's storage: block_size tokens across every KV-cached layer (blocks are allocated for all
    attention layers at once)."""
    return block_size * kv_bytes_per_token_per_layer(cfg, dtype, tp) * num_kv_cache_layers(cfg, with_mtp)


def gdn_recurrent_bytes_per_layer(
    cfg: ModelConfig, ssm_dtype: str | torch.dtype | None = None, tp: int = 1
) -> int:
    """Recurrent state S [Hv, dk, dv] of one sequence in one GDN layer (fp32 by mamba_ssm_dtype)."""
    ssm = ssm_dtype if ssm_dtype is not None else cfg.mamba_ssm_dtype
    hv = rank_shape(cfg, tp).gdn_value_heads
    return hv * cfg.linear_key_head_dim * cfg.linear_value_head_dim * dtype_bytes(ssm)


def gdn_conv_dim(cfg: ModelConfig, tp: int = 1) -> int:
    r = rank_shape(cfg, tp)
    return 2 * r.gdn_key_heads * cfg.linear_key_head_dim + r.gdn_value_heads * cfg.linear_value_head_dim


def gdn_conv_bytes_per_layer(cfg: ModelConfig, dtype: str | torch.dtype, tp: int = 1) -> int:
    """Conv state [conv_dim, K-1] of one sequence in one GDN layer, in the model dtype."""
    return gdn_conv_dim(cfg, tp) * (cfg.linear_conv_kernel_dim - 1) * dtype_bytes(dtype)


def gdn_state_bytes_per_seq(
    cfg: ModelConfig, dtype: str | torch.dtype, ssm_dtype: str | torch.dtype | None = None, tp: int = 1
) -> int:
    """All GDN layers' state for one sequence (one state slot): layers * (recurrent + conv). `dtype` is the
    conv state's (model) dtype; the recurrent state uses `ssm_dtype`, default cfg.mamba_ssm_dtype."""
    per_layer = gdn_recurrent_bytes_per_layer(cfg, ssm_dtype, tp) + gdn_conv_bytes_per_layer(cfg, dtype, tp)
    return len(cfg.gdn_layer_ids) * per_layer


def num_blocks_for(
    memory_bytes: int, cfg: ModelConfig, block_size: int, dtype: str | torch.dtype,
    with_mtp: bool = False, tp: int = 1,
) -> int:
    """How many KV blocks fit in memory_bytes (0 if none)."""
    per_block = kv_bytes_per_block(cfg, block_size, dtype, with_mtp, tp)
    if per_block == 0:
        raise ConfigError("this model has no attention layers, so it has no KV blocks to size")
    return max(0, int(memory_bytes) // per_block)


def num_slots_for(
    memory_bytes: int, cfg: ModelConfig, dtype: str | torch.dtype,
    ssm_dtype: str | torch.dtype | None = None, tp: int = 1,
) -> int:
    """How many GDN state slots (concurrent sequences) fit in memory_bytes."""
    per_seq = gdn_state_bytes_per_seq(cfg, dtype, ssm_dtype, tp)
    return max(0, int(memory_bytes) // per_seq) if per_seq else 0


def default_num_snapshots(max_num_seqs: int, num_gdn_snapshots: int | None = None) -> int:
    """The GDN snapshot pool of prefix caching: num_gdn_snapshots, or 4 per sequence slot. A request saves
    a snapshot at its prompt's end, at the end of a prefix it shares with an earlier one and every
    mamba_block_size tokens; the pool should keep those of the last turns of every running conversation."""
    return num_gdn_snapshots or 4 * max_num_seqs


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
    included: bool = True  # counted in the totals (MTP only when speculating; vision when loaded)
    module: str = ""  # checkpoint name prefix, for matching modules_to_not_convert

    @property
    def total_params(self) -> int:
        return self.count * self.params

    @property
    def total_bytes_per_rank(self) -> int:
        return self.count * self.bytes_per_rank


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _gdn_tensors(cfg: ModelConfig, r: RankShape) -> list[_Tensor]:
    H, K = cfg.hidden_size, cfg.linear_conv_kernel_dim
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    hv = cfg.linear_num_value_heads
    conv, conv_r = cfg.conv_dim, 2 * r.gdn_key_heads * dk + r.gdn_value_heads * dv
    return [
        _Tensor("linear_attn.in_proj_qkv", (conv, H), (conv_r, H), True),
        _Tensor("linear_attn.in_proj_z", (hv * dv, H), (r.gdn_value_heads * dv, H), True),
        _Tensor("linear_attn.in_proj_b", (hv, H), (r.gdn_value_heads, H), True),
        _Tensor("linear_attn.in_proj_a", (hv, H), (r.gdn_value_heads, H), True),
        _Tensor("linear_attn.conv1d", (conv, 1, K), (conv_r, 1, K)),
        _Tensor("linear_attn.A_log", (hv,), (r.gdn_value_heads,)),
        _Tensor("linear_attn.dt_bias", (hv,), (r.gdn_value_heads,)),
        _Tensor("linear_attn.norm", (dv,), (dv,)),
        _Tensor("linear_attn.out_proj", (H, hv * dv), (H, r.gdn_value_heads * dv), True),
    ]


def _attention_tensors(cfg: ModelConfig, r: RankShape) -> list[_Tensor]:
    H, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    return [
        _Tensor("self_attn.q_proj", (2 * nh * hd, H), (2 * r.attention_heads * hd, H), True),  # query + gate
        _Tensor("self_attn.k_proj", (nkv * hd, H), (r.kv_heads * hd, H), True),
        _Tensor("self_attn.v_proj", (nkv * hd, H), (r.kv_heads * hd, H), True),
        _Tensor("self_attn.o_proj", (H, nh * hd), (H, r.attention_heads * hd), True),
        _Tensor("self_attn.q_norm", (hd,), (hd,)),
        _Tensor("self_attn.k_norm", (hd,), (hd,)),
    ]


def _mlp_tensors(cfg: ModelConfig, r: RankShape) -> list[_Tensor]:
    H, I = cfg.hidden_size, cfg.intermediate_size
    return [
        _Tensor("mlp.gate_proj", (I, H), (r.intermediate, H), True),
        _Tensor("mlp.up_proj", (I, H), (r.intermediate, H), True),
        _Tensor("mlp.down_proj", (H, I), (H, r.intermediate), True),
    ]


def _layer_norm_tensors(cfg: ModelConfig) -> list[_Tensor]:
    H = cfg.hidden_size
    return [_Tensor("input_layernorm", (H,), (H,)), _Tensor("post_attention_layernorm", (H,), (H,))]


def _vision_tensors(cfg: ModelConfig, tp: int) -> list[_Tensor]:
    v = cfg.vision
    assert v is not None
    h, i, p = v.hidden_size, v.intermediate_size, v.patch_size
    m = h * v.spatial_merge_size**2
    out = v.out_hidden_size
    c = math.ceil
    t = [
        _Tensor("patch_embed.proj.weight", (h, v.in_channels, v.temporal_patch_size, p, p),
                (h, v.in_channels, v.temporal_patch_size, p, p)),
        _Tensor("patch_embed.proj.bias", (h,), (h,)),
        _Tensor("pos_embed", (v.num_position_embeddings, h), (v.num_position_embeddings, h)),
    ]
    block = [  # vLLM shards the ViT blocks' attention and MLP like the text model
        _Tensor("norm1", (2 * h,), (2 * h,)),
        _Tensor("norm2", (2 * h,), (2 * h,)),
        _Tensor("attn.qkv", (3 * h, h), (c(3 * h / tp), h), True),
        _Tensor("attn.qkv.bias", (3 * h,), (c(3 * h / tp),)),
        _Tensor("attn.proj", (h, h), (h, c(h / tp)), True),
        _Tensor("attn.proj.bias", (h,), (h,)),
        _Tensor("mlp.linear_fc1", (i, h), (c(i / tp), h), True),
        _Tensor("mlp.linear_fc1.bias", (i,), (c(i / tp),)),
        _Tensor("mlp.linear_fc2", (h, i), (h, c(i / tp)), True),
        _Tensor("mlp.linear_fc2.bias", (h,), (h,)),
    ]
    t += [_Tensor(f"blocks.{b}.{x.name}", x.full, x.rank, x.linear) for b in range(v.depth) for x in block]
    t += [
        _Tensor("merger.norm", (2 * h,), (2 * h,)),
        _Tensor("merger.linear_fc1", (m, m), (c(m / tp), m), True),
        _Tensor("merger.linear_fc1.bias", (m,), (c(m / tp),)),
        _Tensor("merger.linear_fc2", (out, m), (out, c(m / tp)), True),
        _Tensor("merger.linear_fc2.bias", (out,), (out,)),
    ]
    return t


def weight_parts(
    cfg: ModelConfig, tp: int = 1, weight_dtype: str | None = None, with_mtp: bool = False,
    include_vision: bool = True,
) -> list[WeightPart]:
    """Weights grouped by part, with per-rank bytes in `weight_dtype` (default: fp8 for an FP8 checkpoint,
    else the config's dtype). With 'fp8', 2-D linear weights not listed as kept are 1 byte each plus one fp32
    scale per block; everything else stays in the config's dtype."""
    if cfg.is_moe:
        raise UnsupportedFeatureError(
            f"the planner counts dense MLPs only; model_type {cfg.model_type!r} is MoE "
            f"({cfg.num_experts} experts)"
        )
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

    def nbytes(module: str, tensors: list[_Tensor]) -> int:
        total = 0
        for t in tensors:
            full_name = f"{module}.{t.name}" if module else t.name
            if fp8 and t.linear and not any(k in full_name for k in not_converted):
                rows, cols = t.rank
                scales = math.ceil(rows / block[0]) * math.ceil(cols / block[1])
                total += rows * cols + scales * FP8_SCALE_BYTES
            else:
                total += _numel(t.rank) * DTYPE_BYTES[wdtype if not fp8 else hp_dtype]
        return total

    def part(name: str, module: str, count: int, tensors: list[_Tensor], included: bool = True) -> WeightPart:
        return WeightPart(
            name=name, count=count, params=sum(_numel(t.full) for t in tensors),
            params_per_rank=sum(_numel(t.rank) for t in tensors), bytes_per_rank=nbytes(module, tensors),
            included=included, module=module,
        )

    H, V = cfg.hidden_size, cfg.vocab_size
    lm = "model.language_model"
    emb = [_Tensor("embed_tokens", (V, H), (r.vocab, H))]
    # Sample layer indices give modules_to_not_convert a concrete name to match (e.g. "layers.0.mlp").
    gdn_i = cfg.gdn_layer_ids[0] if cfg.gdn_layer_ids else 0
    att_i = cfg.attention_layer_ids[0] if cfg.attention_layer_ids else 0
    parts = [
        part("embedding", lm, 1, emb),
        part("lm_head", "", 0 if cfg.tie_word_embeddings else 1,
             [_Tensor("lm_head", (V, H), (r.vocab, H), True)]),
        part("GDN mixer", f"{lm}.layers.{gdn_i}", len(cfg.gdn_layer_ids), _gdn_tensors(cfg, r)),
        part("attention mixer", f"{lm}.layers.{att_i}", len(cfg.attention_layer_ids),
             _attention_tensors(cfg, r)),
        part("MLP", f"{lm}.layers.{gdn_i}", cfg.num_hidden_layers, _mlp_tensors(cfg, r)),
        part("layer norms", f"{lm}.layers.{gdn_i}", cfg.num_hidden_layers, _layer_norm_tensors(cfg)),
        part("final norm", lm, 1, [_Tensor("norm", (H,), (H,))]),
    ]
    if cfg.mtp_num_hidden_layers > 0:
        mtp = [
            _Tensor("fc", (H, 2 * H), (math.ceil(H / tp), 2 * H), True),
            _Tensor("pre_fc_norm_embedding", (H,), (H,)),
            _Tensor("pre_fc_norm_hidden", (H,), (H,)),
            _Tensor("norm", (H,), (H,)),
        ]
        per_layer = _attention_tensors(cfg, r) + _mlp_tensors(cfg, r) + _layer_norm_tensors(cfg)
        for li in range(cfg.mtp_num_hidden_layers):
            mtp += [_Tensor(f"layers.{li}.{t.name}", t.full, t.rank, t.linear) for t in per_layer]
        if cfg.mtp_use_dedicated_embeddings:
            mtp += [_Tensor("embed_tokens", (V, H), (r.vocab, H))]
        parts.append(part("MTP", "mtp", 1, mtp, included=with_mtp))
    if cfg.vision is not None:
        vision = _vision_tensors(cfg, tp)
        parts.append(part("vision tower", "model.visual", 1, vision, included=include_vision))
    return parts


# ---- the plan ------------------------------------------------------------------------------------------
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
    # weights (per rank)
    weight_parts: list[WeightPart] = field(default_factory=list)
    weight_bytes: int = 0
    # whole-model parameter counts
    text_params: int = 0
    mtp_params: int = 0
    vision_params: int = 0
    fused_copy_bytes: int = 0  # fp32 compute of a bf16 checkpoint on a CPU: fused_copy_bytes()
    total_bytes: int = 0
    model_name: str = ""

    @property
    def cache_bytes(self) -> int:
        return self.kv_cache_bytes + self.gdn_state_bytes + self.gdn_snapshot_bytes


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
) -> MemoryPlan:
    """Worst-case memory per TP rank for max_num_seqs sequences of max_model_len tokens each: every sequence
    holds ceil(max_model_len / block_size) KV blocks and one GDN state slot; prefix caching adds
    num_gdn_snapshots GDN state snapshots. `dtype` is the activation /
    model dtype (default the config's); it sets 'auto' KV and the conv state."""
    sizes = (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs), ("block_size", block_size))
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
    parts = weight_parts(cfg, tp, wdtype, with_mtp, include_vision)

    per_tok_layer = kv_bytes_per_token_per_layer(cfg, kv_dtype, tp)
    n_kv_layers = num_kv_cache_layers(cfg, with_mtp)
    per_block = kv_bytes_per_block(cfg, block_size, kv_dtype, with_mtp, tp)
    blocks_per_seq = math.ceil(max_model_len / block_size)
    num_blocks = blocks_per_seq * max_num_seqs
    rec = gdn_recurrent_bytes_per_layer(cfg, ssm_dtype, tp)
    conv = gdn_conv_bytes_per_layer(cfg, model_dtype, tp)
    per_seq = gdn_state_bytes_per_seq(cfg, model_dtype, ssm_dtype, tp)
    weight_bytes = sum(p.total_bytes_per_rank for p in parts if p.included)

    by_name = {p.name: p for p in parts}
    text_params = sum(p.total_params for p in parts if p.name not in ("MTP", "vision tower"))
    plan = MemoryPlan(
        tp=tp, max_model_len=max_model_len, max_num_seqs=max_num_seqs, block_size=block_size,
        with_mtp=with_mtp, model_dtype=model_dtype, weight_dtype=wdtype, kv_cache_dtype=kv_dtype,
        ssm_state_dtype=ssm_dtype, num_layers=cfg.num_hidden_layers,
        num_attention_layers=len(cfg.attention_layer_ids), num_gdn_layers=len(cfg.gdn_layer_ids),
        num_kv_cache_layers=n_kv_layers, rank=r,
        kv_bytes_per_token_per_layer=per_tok_layer, kv_bytes_per_token=per_tok_layer * n_kv_layers,
        kv_bytes_per_block=per_block, blocks_per_seq=blocks_per_seq, num_kv_blocks=num_blocks,
        kv_cache_bytes=num_blocks * per_block,
        gdn_recurrent_bytes_per_layer=rec, gdn_conv_bytes_per_layer=conv, gdn_state_bytes_per_seq=per_seq,
        gdn_state_bytes=per_seq * max_num_seqs,
        num_gdn_snapshots=num_gdn_snapshots, gdn_snapshot_bytes=per_seq * num_gdn_snapshots,
        weight_parts=parts, weight_bytes=weight_bytes, text_params=text_params,
        mtp_params=by_name["MTP"].total_params if "MTP" in by_name else 0,
        vision_params=by_name["vision tower"].total_params if "vision tower" in by_name else 0,
        model_name=model_name,
    )
    if tp == 1 and wdtype == "float32" and normalize_dtype(cfg.torch_dtype) == "bfloat16":
        plan.fused_copy_bytes = fused_copy_bytes(cfg, with_mtp)
    plan.total_bytes = plan.weight_bytes + plan.fused_copy_bytes + plan.cache_bytes
    return plan


def fused_copy_bytes(cfg: ModelConfig, with_mtp: bool = False) -> int:
    """What the CPU fused step (deltaserve/model/fused.py; one process, no tensor parallelism) adds to fp32
    weights whose values are bf16 numbers: a bf16 copy in panels of every projection it runs, projections
    that read the same input fused into one (GDN q|k|v|z|b|a, attention q|k|v, MLP gate|up) and each padded
    to a whole number of 64-output panels; and the lm_head once more, in pairs along its input, for the
    greedy screen (CPUs with AVX512-BF16). The MTP head's layer and fc when it is loaded (one MTP layer)."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    dk, dv, hk, hv = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_key_heads, \
        cfg.linear_num_value_heads

    def panels(rows: int, cols: int) -> int:
        return -(-rows // PANEL) * PANEL * cols

    gdn = panels(2 * hk * dk + 2 * hv * dv + 2 * hv, H) + panels(H, hv * dv)
    attention = panels(2 * nh * hd + 2 * nkv * hd, H) + panels(H, nh * hd)
    mlp = panels(2 * I, H) + panels(H, I)
    weights = len(cfg.gdn_layer_ids) * gdn + len(cfg.attention_layer_ids) * attention
    weights += cfg.num_hidden_layers * mlp + panels(V, H) + panels(V, 2 * -(-H // 2))
    if with_mtp and cfg.mtp_num_hidden_layers == 1:
        weights += panels(H, 2 * H) + attention + mlp
    return 2 * weights


# ---- printing ------------------------------------------------------------------------------------------
def format_bytes(n: int | float) -> str:
    """Binary units, chosen so the number reads well: 4.00 KiB, 3.00 MiB, 50.12 GiB."""
    n = float(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n)} B"


def format_params(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.3f} B"
    if n >= 1e6:
        return f"{n / 1e6:.2f} M"
    return f"{n:,}"


def format_plan(plan: MemoryPlan, gpu_memory_bytes: int | None = None) -> str:
    r = plan.rank
    lines: list[str] = []
    add = lines.append
    title = f"Memory plan{' for ' + plan.model_name if plan.model_name else ''}"
    add(title)
    add("=" * len(title))
    add(f"layers {plan.num_layers}: {plan.num_gdn_layers} GDN + {plan.num_attention_layers} attention"
        f"{' (+ MTP layer with its own KV cache)' if plan.with_mtp else ''}")
    add(f"tensor parallel {plan.tp}: per rank attention heads {r.attention_heads}, KV heads {r.kv_heads}, "
        f"GDN heads {r.gdn_key_heads}k/{r.gdn_value_heads}v, MLP width {r.intermediate}, "
        f"vocab rows {r.vocab}")
    add(f"dtypes: model {plan.model_dtype}, weights {plan.weight_dtype}, KV cache {plan.kv_cache_dtype}, "
        f"GDN recurrent state {plan.ssm_state_dtype}, conv state {plan.model_dtype}")
    add(f"workload: {plan.max_num_seqs} sequences x {plan.max_model_len:,} tokens, "
        f"block size {plan.block_size}")
    add("")
    add("Weights (per rank)")
    w = max(len(p.name) for p in plan.weight_parts) if plan.weight_parts else 10
    add(f"  {'part':<{w}}  {'count':>5}  {'params (model)':>14}  {'bytes each':>12}  {'bytes total':>12}")
    for p in plan.weight_parts:
        note = "" if p.included else "  (not loaded)"
        add(f"  {p.name:<{w}}  {p.count:>5}  {format_params(p.total_params):>14}  "
            f"{format_bytes(p.bytes_per_rank):>12}  {format_bytes(p.total_bytes_per_rank):>12}{note}")
    add(f"  {'total loaded':<{w}}  {'':>5}  {'':>14}  {'':>12}  {format_bytes(plan.weight_bytes):>12}")
    add(f"  parameters: text {format_params(plan.text_params)}, MTP {format_params(plan.mtp_params)}, "
        f"vision {format_params(plan.vision_params)}")
    if plan.fused_copy_bytes:
        add(f"  fused step on a CPU: + {format_bytes(plan.fused_copy_bytes)} of bf16 copies (the projections "
            "in panels, the lm_head twice)")
    add("")
    def row(label: str, value: int, note: str = "") -> None:
        add(f"  {label:<24}{format_bytes(value):>12}{'   ' + note if note else ''}")

    add("Attention KV cache (per rank)")
    row("per token per layer", plan.kv_bytes_per_token_per_layer,
        f"(2 x {r.kv_heads} KV heads x head_dim x {DTYPE_BYTES[plan.kv_cache_dtype]} B)")
    row(f"per token, {plan.num_kv_cache_layers} layers", plan.kv_bytes_per_token)
    row("per block", plan.kv_bytes_per_block)
    row("per sequence", plan.kv_bytes_per_block * plan.blocks_per_seq, f"({plan.blocks_per_seq:,} blocks)")
    row("all sequences", plan.kv_cache_bytes, f"({plan.num_kv_blocks:,} blocks)")
    add("")
    add("GDN state (per rank; fixed size, independent of sequence length)")
    row("recurrent per layer", plan.gdn_recurrent_bytes_per_layer)
    row("conv per layer", plan.gdn_conv_bytes_per_layer)
    row(f"per sequence, {plan.num_gdn_layers} layers", plan.gdn_state_bytes_per_seq)
    row("all sequences", plan.gdn_state_bytes, f"({plan.max_num_seqs} slots)")
    if plan.num_gdn_snapshots:
        row("prefix-cache snapshots", plan.gdn_snapshot_bytes,
            f"({plan.num_gdn_snapshots} snapshots of one slot each)")
    add("")
    copies = f" + fused copies {format_bytes(plan.fused_copy_bytes)}" if plan.fused_copy_bytes else ""
    add(f"Total per rank            {format_bytes(plan.total_bytes):>12}   "
        f"(weights {format_bytes(plan.weight_bytes)}{copies}, cache {format_bytes(plan.cache_bytes)}; "
        "activations not included)")
    if gpu_memory_bytes is not None:
        free = gpu_memory_bytes - plan.weight_bytes - plan.gdn_state_bytes - plan.gdn_snapshot_bytes
        blocks = max(0, free) // plan.kv_bytes_per_block if plan.kv_bytes_per_block else 0
        add(f"With {format_bytes(gpu_memory_bytes)} per rank: {blocks:,} KV blocks fit after weights and "
            f"{plan.max_num_seqs} GDN slots = {blocks * plan.block_size:,} cached tokens, "
            f"{blocks // plan.blocks_per_seq if plan.blocks_per_seq else 0} sequences at full length")
    return "\n".join(lines)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
