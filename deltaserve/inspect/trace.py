"""The trace API: run a prompt through the loaded model in a forward of its own (stateless context: no
engine cache is read or written) with a TraceRecorder attached, and return plain JSON-able dicts.

- `forward_trace`: per layer and token ‖X_in‖, ‖Δmix‖, ‖Δffn‖, ‖X_out‖ and chosen coordinates, then final
  norm -> lm_head -> top-k next-token probabilities at every position;
- `gdn_state_lab`: one GDN layer / value head: the recurrent state S after every token, exp(g), beta, the
  delta write ‖k uᵀ‖, recomputed with the delta-rule kernel from the q, k, v, g, beta the layer produced;
- `attention_lab`: one attention layer: softmax weights per query head grouped by KV head, sigmoid output
  gates, and the split of each score into RoPE-rotated and unrotated dims.

Every section names its source: "measured" (this run), "config" (computed from the config)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from deltaserve.config import FULL_ATTENTION, LINEAR_ATTENTION
from deltaserve.inspect.recorder import AttentionCapture, GDNCapture, TraceRecorder
from deltaserve.model.context import ForwardContext
from deltaserve.ops.conv import causal_conv1d
from deltaserve.ops.delta_rule import delta_rule_recurrent

MEASURED = "measured"
CONFIG = "config"
DOC = "doc"


def _r(t: torch.Tensor | float, nd: int = 5) -> Any:
    """Rounded Python numbers (JSON stays small and readable)."""
    if isinstance(t, torch.Tensor):
        return torch.round(t.detach().double(), decimals=nd).tolist()
    return round(float(t), nd)


def layer_kind(layer_type: str) -> str:
    return {LINEAR_ATTENTION: "gdn", FULL_ATTENTION: "attention"}.get(layer_type, layer_type)


@torch.inference_mode()
def run_traced(
    model: torch.nn.Module, ids: list[int], coords: list[int], capture: set[int] | None = None
) -> tuple[TraceRecorder, torch.Tensor]:
    """One stateless forward with a recorder; returns it and the final-normed hidden states [T, H]."""
    recorder = TraceRecorder(coords=coords, capture=set(capture or ()))
    ctx = ForwardContext.stateless([len(ids)])
    ctx.trace = recorder
    hidden = model(torch.tensor(ids, dtype=torch.long), ctx)
    return recorder, hidden


def check_coords(coords: list[int] | None, hidden_size: int) -> list[int]:
    coords = [0, 1, 2, 3][:hidden_size] if not coords else [int(c) for c in coords]
    if len(coords) > 16:
        raise ValueError(f"at most 16 coordinates, got {len(coords)}")
    bad = [c for c in coords if not 0 <= c < hidden_size]
    if bad:
        raise ValueError(f"coordinate {bad[0]} is outside the hidden size [0, {hidden_size})")
    return coords


def forward_trace(
    model: torch.nn.Module, tokenizer: Any | None, ids: list[int], coords: list[int] | None = None,
    top_k: int = 5,
) -> dict[str, Any]:
    cfg = model.config
    coords = check_coords(coords, cfg.hidden_size)
    recorder, hidden = run_traced(model, ids, coords)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)  # [T, V] fp32, every position (only the inspector asks)
    probs = logits.softmax(-1)
    k = max(1, min(int(top_k), cfg.vocab_size, 20))
    top_p, top_i = probs.topk(k, dim=-1)
    decode = (lambda i: tokenizer.decode([i], skip_special_tokens=False)) if tokenizer else str
    positions = []
    for t in range(len(ids)):
        nxt = ids[t + 1] if t + 1 < len(ids) else None
        positions.append({
            "top": [{"id": int(i), "text": decode(int(i)), "p": _r(p, 6), "logit": _r(logits[t, i], 4)}
                    for p, i in zip(top_p[t], top_i[t], strict=True)],
            "next_id": nxt,
            "p_next": _r(probs[t, nxt], 6) if nxt is not None else None,
        })
    last = recorder.last_out.float()  # [T, H] X_L before the final norm
    idx = torch.tensor(coords)
    layers = []
    for s in recorder.layers:
        layers.append({
            "layer": s.layer_id, "type": layer_kind(cfg.layer_types[s.layer_id]),
            "x_in_norm": _r(s.x_in_norm), "mix_norm": _r(s.mix_norm), "ffn_norm": _r(s.ffn_norm),
            "x_out_norm": _r(s.x_out_norm),
            "x_in": _r(s.x_in), "mix": _r(s.mix), "ffn": _r(s.ffn), "x_out": _r(s.x_out),
            "residual_error": s.residual_error, "handoff_error": s.handoff_error,
        })
    return {
        "source": MEASURED,
        "num_tokens": len(ids),
        "coords": coords,
        "layers": layers,
        "final": {
            "source": MEASURED,
            "x_norm": _r(last.norm(dim=-1)), "h_norm": _r(hidden.float().norm(dim=-1)),
            "x": _r(last[:, idx]), "h": _r(hidden.float()[:, idx]),
            "temperature": 1.0, "top_k": k, "positions": positions,
        },
    }


# ---- GDN state lab ------------------------------------------------------------------------------------
def gdn_inputs(cap: GDNCapture) -> tuple[torch.Tensor, ...]:
    """q, k [T, Hv, dk] (normalised, q scaled), v [T, Hv, dv], g, beta [T, Hv] as the layer's kernel sees
    them: the causal conv (fresh sequence: zero history) and SiLU applied with the layer's own weights."""
    m = cap.mixer
    weight = m.conv1d.weight[:, 0, :]
    mixed, _ = causal_conv1d(cap.qkv, weight, cap.qkv.new_zeros(m.conv_dim, m.kernel_size - 1))
    q, k, v = m._split_heads(F.silu(mixed))
    return q, k, v, cap.g.float(), cap.beta.float()


@torch.inference_mode()
def gdn_states(cap: GDNCapture) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """States after every token [T, Hv, dk, dv] and outputs [T, Hv, dv], from a zero state."""
    q, k, v, g, beta = gdn_inputs(cap)
    m = cap.mixer
    zero = torch.zeros(1, m.num_v_heads, m.head_k_dim, m.head_v_dim)
    out, states = delta_rule_recurrent(q[None], k[None], v[None], g[None], beta[None], zero)
    return states[0], out[0], (q, k, v, g, beta)


def gdn_state_lab(model: torch.nn.Module, ids: list[int], layer: int, head: int) -> dict[str, Any]:
    cfg = model.config
    if layer not in cfg.gdn_layer_ids:
        raise ValueError(f"layer {layer} is not a GDN layer; GDN layers: {cfg.gdn_layer_ids}")
    hv = cfg.linear_num_value_heads
    if not 0 <= head < hv:
        raise ValueError(f"value head {head} is outside [0, {hv})")
    recorder, _ = run_traced(model, ids, [0], capture={layer})
    states, out, (q, k, v, g, beta) = gdn_states(recorder.gdn_layers[layer])
    S = states[:, head]  # [T, dk, dv]
    prev = torch.cat([torch.zeros_like(S[:1]), S[:-1]])
    decay = g[:, head].exp()  # [T]
    write = S - decay[:, None, None] * prev  # = k uᵀ, the delta write of each token
    # u = beta (v - S̄ᵀk): what the write stores; v - S̄ᵀk is the prediction error it corrects
    kt = k[:, head]  # [T, dk]
    predicted = torch.einsum("tkv,tk->tv", decay[:, None, None] * prev, kt)
    err = v[:, head] - predicted
    rep = hv // cfg.linear_num_key_heads
    return {
        "source": MEASURED,
        "layer": layer, "head": head, "key_head": head // rep,
        "dk": cfg.linear_key_head_dim, "dv": cfg.linear_value_head_dim,
        "states": _r(S, 5),  # [T][dk][dv]
        "decay": _r(decay, 6), "g": _r(g[:, head], 6), "beta": _r(beta[:, head], 6),
        "write_norm": _r(write.flatten(1).norm(dim=-1), 6),
        "error_norm": _r(err.norm(dim=-1), 6),
        "state_norm": _r(S.flatten(1).norm(dim=-1), 6),
        "out_norm": _r(out[:, head].norm(dim=-1), 6),
        "abs_max": _r(S.abs().max(), 6),
    }


# ---- attention lab ------------------------------------------------------------------------------------
def attention_probs(
    cap: AttentionCapture, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal softmax weights [nh, T, T] and the score split into RoPE-rotated / unrotated dims
    ([nh, T, T] each)."""
    m = cap.mixer
    nh, nkv = m.num_heads, m.num_kv_heads
    q = cap.q.float().transpose(0, 1)  # [nh, T, hd]
    k = cap.k.float().repeat_interleave(nh // nkv, dim=1).transpose(0, 1)  # [nh, T, hd]: kv head h // rep
    r = rotary_dim
    rot = (q[..., :r] @ k[..., :r].transpose(-1, -2)) * m.scale
    plain = (q[..., r:] @ k[..., r:].transpose(-1, -2)) * m.scale
    T = q.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    weights = (rot + plain).masked_fill(~causal, float("-inf")).softmax(-1)
    return weights, rot.masked_fill(~causal, 0.0), plain.masked_fill(~causal, 0.0)


def attention_lab(model: torch.nn.Module, ids: list[int], layer: int, head: int = 0) -> dict[str, Any]:
    cfg = model.config
    if layer not in cfg.attention_layer_ids:
        raise ValueError(
            f"layer {layer} is not an attention layer; attention layers: {cfg.attention_layer_ids}"
        )
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if not 0 <= head < nh:
        raise ValueError(f"query head {head} is outside [0, {nh})")
    recorder, _ = run_traced(model, ids, [0], capture={layer})
    cap = recorder.attention_layers[layer]
    weights, rot, plain = attention_probs(cap, cfg.rotary_dim)
    gate = torch.sigmoid(cap.gate.float())  # [T, nh, hd]
    rope = model.model.rotary
    half = cfg.rotary_dim // 2
    rep = nh // nkv
    q = cap.q.float()
    return {
        "source": MEASURED,
        "layer": layer, "head": head, "num_heads": nh, "num_kv_heads": nkv, "head_dim": cfg.head_dim,
        "groups": [list(range(g * rep, (g + 1) * rep)) for g in range(nkv)],
        "weights": _r(weights, 5),  # [nh][T][T]
        "gate_mean": _r(gate.mean(-1), 5),  # [T][nh]
        "gate_min": _r(gate.amin(-1), 5), "gate_max": _r(gate.amax(-1), 5),
        "rope": {
            "source": CONFIG,
            "rotary_dim": cfg.rotary_dim, "head_dim": cfg.head_dim,
            "partial_rotary_factor": cfg.partial_rotary_factor, "theta": cfg.rope_theta,
            "mrope_section": cfg.mrope_section,
            "wavelengths": _r(2 * torch.pi / rope.inv_freq[:half], 2),  # tokens per turn, each pair
            "score_rotated": _r(rot[head], 5), "score_unrotated": _r(plain[head], 5),  # [T][T], this head
            "q_energy_rotated": _r(q[..., : cfg.rotary_dim].pow(2).sum(-1).mean(0), 5),  # [nh]
            "q_energy_unrotated": _r(q[..., cfg.rotary_dim :].pow(2).sum(-1).mean(0), 5),
        },
    }
