"""A layer's operator chain and data structures with the loaded model's real shapes and dtypes, whole and
per tensor-parallel rank (the split the planner uses, vLLM's). Shapes come from the config ("config");
weight shapes and dtypes from the loaded parameters ("measured")."""

from __future__ import annotations

from typing import Any

import torch

from deltaserve.config import FULL_ATTENTION, ConfigError
from deltaserve.inspect.trace import CONFIG, MEASURED, layer_kind
from deltaserve.model.sharding import rank_shape


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _s(*dims: Any) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def layer_detail(
    model: torch.nn.Module, layer_id: int, num_tokens: int, tp: int = 1,
    kv_dtype: torch.dtype | None = None, num_slots: int | str = "R", num_blocks: int | str = "P",
    block_size: int = 16,
) -> dict[str, Any]:
    """ops: the computation in order; tensors: each tensor's kind (weight / activation / cache), dtype,
    lifetime, global and per-rank shape; weights: the loaded parameters of this layer."""
    cfg = model.config
    if not 0 <= layer_id < cfg.num_hidden_layers:
        raise ValueError(f"layer {layer_id} is outside [0, {cfg.num_hidden_layers})")
    try:
        r = rank_shape(cfg, tp)
    except (ConfigError, ValueError) as e:
        raise ValueError(f"tensor parallel size {tp} does not fit this model: {e}") from e
    layer = model.model.layers[layer_id]
    act = _dt(model.activation_dtype)
    kv = _dt(kv_dtype) if kv_dtype is not None else act
    T, H, I = num_tokens, cfg.hidden_size, cfg.intermediate_size
    Ir = r.intermediate
    is_attn = cfg.layer_types[layer_id] == FULL_ATTENTION
    tensors: list[dict[str, Any]] = [
        _t("X / Y residual", "activation", act, "layer", _s(T, H), _s(T, H)),
    ]
    if is_attn:
        nh, nkv, hd, rot = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
        nhr, nkvr = r.attention_heads, r.kv_heads
        ops = [
            _op("input", "X⁽ℓ⁾", _s(T, H)),
            _op("norm", "U = X·rsqrt(mean(X²)+ε)·(1+γ)", f"{_s(T, H)} → {_s(T, H)}"),
            _op("qproj", "[Q | G] = U W_q (per head: hd query, hd gate)",
                f"{_s(T, H)} → {_s(T, nh, 2 * hd)}"),
            _op("kvproj", "K = U W_k; V = U W_v", f"{_s(T, H)} → K,V {_s(T, nkv, hd)}"),
            _op("qknorm", "Q, K = RMSNorm_head(Q), RMSNorm_head(K)", f"{_s(T, nh, hd)}, {_s(T, nkv, hd)}"),
            _op("rope", f"RoPE on dims [0,{rot}) of {hd}; [{rot},{hd}) unrotated", f"{_s(T, nh, hd)}"),
            _op("cache_write", "K, V → paged cache (block table, slot mapping)", f"{_s(T, nkv, hd)} ×2"),
            _op("attend", f"A = softmax(QKᵀ/√{hd} + causal) V; q head h reads kv head h//{nh // nkv}",
                f"{_s(nh, T, 'L')} → {_s(T, nh, hd)}"),
            _op("gate", "O = A ⊙ sigmoid(G)", f"{_s(T, nh * hd)}"),
            _op("oproj", "Δmix = O W_o", f"{_s(T, nh * hd)} × {_s(nh * hd, H)} → {_s(T, H)}"),
        ]
        tensors += [
            _t("Q / gate G", "activation", act, "layer", _s(T, nh, hd) + " ×2", _s(T, nhr, hd) + " ×2"),
            _t("K / V (new tokens)", "activation", act, "layer", _s(T, nkv, hd) + " ×2",
               _s(T, nkvr, hd) + " ×2"),
            _t("scores / weights", "activation", "float32", "layer", _s(nh, T, "L"), _s(nhr, T, "L")),
            # keys transposed within a block (deltaserve/ops/attention.py), values row by row
            _t("KV cache", "cache", kv, "request",
               f"K {_s(num_blocks, nkv, hd, block_size)}, V {_s(num_blocks, block_size, nkv, hd)}",
               f"K {_s(num_blocks, nkvr, hd, block_size)}, V {_s(num_blocks, block_size, nkvr, hd)}"),
        ]
    else:
        Hk, Hv, dk, dv, K = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                             cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)
        Hkr, Hvr = r.gdn_key_heads, r.gdn_value_heads
        conv, convr = cfg.conv_dim, 2 * Hkr * dk + Hvr * dv
        ops = [
            _op("input", "X⁽ℓ⁾", _s(T, H)),
            _op("norm", "U = X·rsqrt(mean(X²)+ε)·(1+γ)", f"{_s(T, H)} → {_s(T, H)}"),
            _op("gdnproj", "[Q₀,K₀,V₀] = U W_qkv; Z = U W_z; a = U W_a; b = U W_b",
                f"QKV {_s(T, conv)} · Z {_s(T, Hv, dv)} · a,b {_s(T, Hv)}"),
            _op("conv", f"QKV = SiLU(causal depthwise conv, {K} taps, history [conv_dim,{K - 1}])",
                f"{_s(T, conv)} → {_s(T, conv)}"),
            _op("qknorm_gdn", f"q,k = L2norm; q ·= dk^-½; value head j uses key head j//{Hv // Hk}",
                f"Q,K {_s(T, Hk, dk)} → {_s(T, Hv, dk)}"),
            _op("gates", "β = sigmoid(b); g = −exp(A_log)·softplus(a + dt_bias)", _s(T, Hv)),
            _op("delta", "S̄ = e^g S; u = β(v − S̄ᵀk); S = S̄ + k uᵀ; o = Sᵀq",
                f"S {_s('R', Hv, dk, dv)}; o {_s(T, Hv, dv)}"),
            _op("gnorm", "O = RMSNorm_dv(o)·w ⊙ SiLU(Z)", f"{_s(T, Hv, dv)} → {_s(T, Hv * dv)}"),
            _op("outproj", "Δmix = O W_out", f"{_s(T, Hv * dv)} × {_s(Hv * dv, H)} → {_s(T, H)}"),
        ]
        tensors += [
            _t("Q / K", "activation", act, "layer", _s(T, Hk, dk), _s(T, Hkr, dk)),
            _t("V / Z", "activation", act, "layer", _s(T, Hv, dv), _s(T, Hvr, dv)),
            _t("g / β", "activation", "float32", "layer", _s(T, Hv), _s(T, Hvr)),
            _t("recurrent state S", "cache", "float32", "request", _s(num_slots, Hv, dk, dv),
               _s(num_slots, Hvr, dk, dv)),
            _t("conv history", "cache", kv, "request", _s(num_slots, conv, K - 1),
               _s(num_slots, convr, K - 1)),
        ]
    ops += [
        _op("residual", "Y = X + Δmix", f"{_s(T, H)} + {_s(T, H)}"),
        _op("norm2", "N = RMSNorm(Y)·(1+γ)", _s(T, H)),
        _op("ffn_up", "G = N W_gate; Uf = N W_up", f"{_s(T, H)} × {_s(H, I)} → {_s(T, I)} ×2"),
        _op("swiglu", "F = SiLU(G) ⊙ Uf", _s(T, I)),
        _op("ffn_down", "Δffn = F W_down", f"{_s(T, I)} × {_s(I, H)} → {_s(T, H)}"),
        _op("output", "X⁽ℓ⁺¹⁾ = Y + Δffn", _s(T, H)),
    ]
    tensors.append(_t("FFN gate / up", "activation", act, "layer", _s(T, I) + " ×2", _s(T, Ir) + " ×2"))
    weights = [
        {"name": name, "shape": list(p.shape), "dtype": _dt(p.dtype), "numel": p.numel(), "source": MEASURED}
        for name, p in layer.named_parameters()
    ]
    tensors.append(_t("weights (this layer)", "weight", weights[0]["dtype"] if weights else act, "model",
                      f"{sum(w['numel'] for w in weights):,} params", "column/row split; norms replicated"))
    return {
        "layer": layer_id, "type": layer_kind(cfg.layer_types[layer_id]), "tp": tp, "num_tokens": T,
        "module": f"model.language_model.layers.{layer_id}",
        "ops": ops, "tensors": tensors, "weights": weights, "source": CONFIG,
        "rank": {"attention_heads": r.attention_heads, "kv_heads": r.kv_heads,
                 "gdn_key_heads": r.gdn_key_heads, "gdn_value_heads": r.gdn_value_heads,
                 "intermediate": r.intermediate},
    }


def _op(key: str, formula: str, shape: str) -> dict[str, str]:
    return {"key": key, "formula": formula, "shape": shape}


def _t(name: str, kind: str, dtype: str, lifetime: str, shape: str, rank_shape: str) -> dict[str, str]:
    return {"name": name, "kind": kind, "dtype": dtype, "lifetime": lifetime, "shape": shape,
            "rank_shape": rank_shape, "source": CONFIG}
