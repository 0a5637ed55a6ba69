"""Small random checkpoints built with transformers, saved in either layout, for the tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TINY = dict(
    vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_conv_kernel_dim=4, partial_rotary_factor=0.5, max_position_embeddings=512,
)
# 27B ratios: Hv = 3 Hk, nh = 6 nkv, partial rotary 0.25, [lin, lin, lin, full] x 2; dk != dv
RATIOS_27B = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
    num_attention_heads=6, num_key_value_heads=1, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, partial_rotary_factor=0.25, max_position_embeddings=1024,
)


# Sparse-MoE additions to a shape: 8 experts, top-2, expert and shared-expert widths unlike the dense one.
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=24)
MOE_FAMILIES = ("qwen3_5_moe", "qwen3_next")


def mrope_section(head_dim: int, partial: float) -> list[int]:
    """Split the rotary half-dims over (t, h, w) as the 27B does ([11, 11, 10] of 32)."""
    half = int(head_dim * partial) // 2
    h = w = half // 3
    return [half - h - w, h, w]


def hf_config(shape: dict, tie: bool = False, layer_types: list[str] | None = None):
    from transformers import Qwen3_5TextConfig

    kwargs = dict(shape)
    partial = kwargs.pop("partial_rotary_factor")
    cfg = Qwen3_5TextConfig(
        **kwargs, tie_word_embeddings=tie, layer_types=layer_types,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                         "mrope_section": mrope_section(shape["head_dim"], partial), "mrope_interleaved": True},
        eos_token_id=1, pad_token_id=0, bos_token_id=None,
    )
    cfg._attn_implementation = "eager"
    return cfg


def hf_moe_config(family: str, shape: dict, **fields):
    """A transformers Qwen3_5MoeTextConfig or Qwen3NextConfig (plain RoPE, no mrope) with MOE experts;
    `fields` adds or overrides config fields (mlp_only_layers, decoder_sparse_step, norm_topk_prob...)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig

    kwargs = {**shape, **MOE, **fields}
    partial = kwargs.pop("partial_rotary_factor")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
    if family == "qwen3_5_moe":
        kwargs.pop("intermediate_size", None)  # no dense MLP anywhere
        rope.update(mrope_section=mrope_section(shape["head_dim"], partial), mrope_interleaved=True)
        cls = Qwen3_5MoeTextConfig
    else:
        cls = Qwen3NextConfig
    cfg = cls(**kwargs, rope_parameters=rope, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the reference loop over hit experts, not a grouped kernel
    return cfg


def random_hf_moe_model(family: str, shape: dict = TINY, seed: int = 0, **fields):
    """A transformers Qwen3_5MoeForCausalLM or Qwen3NextForCausalLM with every parameter random; the router
    weights larger than the rest, so routing is decisive (no near-ties unless a test makes them)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

    cls = Qwen3_5MoeForCausalLM if family == "qwen3_5_moe" else Qwen3NextForCausalLM
    torch.manual_seed(seed)
    model = cls(hf_moe_config(family, shape, **fields)).float().eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(8.0)
    return model


def random_hf_model(shape: dict = TINY, seed: int = 0, tie: bool = False, layer_types=None):
    """A transformers Qwen3_5ForCausalLM whose every parameter (norm weights included) is random."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(hf_config(shape, tie, layer_types)).float().eval()
    randomize(model)
    return model


def randomize(model) -> None:
    """Random values for every parameter, norm weights and the GDN decay constants included."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 8).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                p.copy_(torch.randn_like(p) * 0.08)


def tied_odd_pattern_model(seed: int = 2):
    """A random TINY model with tied embeddings and an attention layer first: 5 layers, not [lin x3, full]."""
    pattern = ["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"]
    return random_hf_model(dict(TINY, num_hidden_layers=5), seed=seed, tie=True, layer_types=pattern)


def random_mtp_tensors(shape: dict, seed: int = 1, moe: dict | None = None) -> dict[str, torch.Tensor]:
    """mtp.* tensors for the official layout: fc, two pre-fc norms, one attention decoder layer, norm. With
    `moe` (e.g. MOE) the layer's MLP is sparse, as in the MoE releases: router, experts one tensor each,
    shared expert and its gate."""
    g = torch.Generator().manual_seed(seed)
    H, I = shape["hidden_size"], shape.get("intermediate_size", 0)
    nh, nkv, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    r = lambda *s, scale=0.08: torch.randn(*s, generator=g) * scale  # noqa: E731
    p = "mtp.layers.0."
    if moe:
        E, Ie, Is = moe["num_experts"], moe["moe_intermediate_size"], moe["shared_expert_intermediate_size"]
        mlp = {"mlp.gate.weight": r(E, H, scale=0.6), "mlp.shared_expert_gate.weight": r(1, H),
               "mlp.shared_expert.gate_proj.weight": r(Is, H), "mlp.shared_expert.up_proj.weight": r(Is, H),
               "mlp.shared_expert.down_proj.weight": r(H, Is)}
        for e in range(E):
            mlp.update({f"mlp.experts.{e}.gate_proj.weight": r(Ie, H), f"mlp.experts.{e}.up_proj.weight": r(Ie, H),
                        f"mlp.experts.{e}.down_proj.weight": r(H, Ie)})
    else:
        mlp = {"mlp.gate_proj.weight": r(I, H), "mlp.up_proj.weight": r(I, H), "mlp.down_proj.weight": r(H, I)}
    return {
        "mtp.fc.weight": r(H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": r(H, scale=0.2),
        "mtp.pre_fc_norm_hidden.weight": r(H, scale=0.2),
        "mtp.norm.weight": r(H, scale=0.2),
        p + "input_layernorm.weight": r(H, scale=0.2),
        p + "post_attention_layernorm.weight": r(H, scale=0.2),
        p + "self_attn.q_proj.weight": r(2 * nh * hd, H),
        p + "self_attn.k_proj.weight": r(nkv * hd, H),
        p + "self_attn.v_proj.weight": r(nkv * hd, H),
        p + "self_attn.o_proj.weight": r(H, nh * hd),
        p + "self_attn.q_norm.weight": r(hd, scale=0.2),
        p + "self_attn.k_norm.weight": r(hd, scale=0.2),
        **{p + k: v for k, v in mlp.items()},
    }


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' save writes one tensor per expert (`X.experts.N.gate_proj.weight`, up, down); the bf16
    releases keep 3-D tensors (`X.experts.gate_up_proj` [E, 2I, H], `X.experts.down_proj` [E, H, I])."""
    out, groups = {}, {}
    for name, t in tensors.items():
        m = PER_EXPERT.match(name)
        if m:
            groups.setdefault(m["experts"], {})[(int(m["e"]), m["proj"])] = t
        else:
            out[name] = t
    for experts, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{experts}.gate_up_proj"] = torch.stack([torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in range(n)])
        out[f"{experts}.down_proj"] = torch.stack([parts[e, "down"] for e in range(n)])
    return out


PER_EXPERT = re.compile(r"^(?P<experts>(.+\.)?experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def save_causal_lm_layout(model, path: Path, mtp: dict[str, torch.Tensor] | None = None,
                          fused_experts: bool = False) -> Path:
    """transformers' own save: `model.*` names, model_type qwen3_5_text (or the MoE model's own); MoE
    experts one tensor each unless fused_experts."""
    model.save_pretrained(path)
    if mtp or fused_experts:
        tensors = load_file(str(path / "model.safetensors"))
        tensors = fuse_experts(tensors) if fused_experts else tensors
        tensors.update(mtp or {})
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    if mtp:
        config = json.loads((path / "config.json").read_text())
        config["mtp_num_hidden_layers"] = 1
        (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def save_official_layout(model, path: Path, mtp: dict[str, torch.Tensor] | None = None,
                         fused_experts: bool = False) -> Path:
    """The released layout: `model.language_model.*` + `mtp.*`, config model_type qwen3_5 (qwen3_5_moe)
    with text_config."""
    tmp = path / "_hf"
    model.save_pretrained(tmp)
    tensors = load_file(str(tmp / "model.safetensors"))
    tensors = fuse_experts(tensors) if fused_experts else tensors
    out = {}
    for name, t in tensors.items():
        out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    if "lm_head.weight" not in out and not model.config.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight.detach().clone()
    out.update(mtp or {})
    save_file({k: v.contiguous() for k, v in out.items()}, str(path / "model.safetensors"))
    text = json.loads((tmp / "config.json").read_text())
    moe = text["model_type"] == "qwen3_5_moe_text"
    text["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
    if mtp:
        text["mtp_num_hidden_layers"] = 1
    config = {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "text_config": text, "tie_word_embeddings": model.config.tie_word_embeddings,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    return path


def quantize_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 2-D weight as FP8 block quantization stores it: E4M3 values, one scale_inv per block (the block's
    max |w| / 448), and the weight they dequantize to."""
    rows, cols = (w.shape[0] + block - 1) // block, (w.shape[1] + block - 1) // block
    padded = torch.zeros(rows * block, cols * block)
    padded[: w.shape[0], : w.shape[1]] = w
    amax = padded.view(rows, block, cols, block).abs().amax(dim=(1, 3)).clamp(min=1e-6)
    scale_inv = amax / 448.0
    full = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)
    q = (padded / full).to(torch.float8_e4m3fn)[: w.shape[0], : w.shape[1]].contiguous()
    return q, scale_inv, q.float() * full[: w.shape[0], : w.shape[1]]
