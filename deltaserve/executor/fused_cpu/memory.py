"""What the fused CPU executor holds beside the model's own weights, counted from a config (the planner's
numbers; tests/test_planner.py holds them to what stack.py builds)."""

from __future__ import annotations

from deltaserve.config import ModelConfig
from deltaserve.executor.fused_cpu.stack import PANEL


def fused_copy_bytes(cfg: ModelConfig, with_mtp: bool = False) -> int:
    """What the CPU fused step (deltaserve/executor/fused_cpu; cfg: one rank's under tensor parallelism) adds to fp32
    weights whose values are bf16 numbers: a bf16 copy in panels of every projection it runs, projections
    that read the same input fused into one (GDN q|k|v|z|b|a, attention q|k|v, MLP gate|up, a sparse MLP's
    router | shared expert gate|up | shared_expert_gate) and each padded to a whole number of 64-output
    panels, and of every expert's gate|up and down; and the lm_head once more, in pairs along its input, for the
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
    sparse = 0
    if cfg.is_moe:  # router | shared gate | shared up | shared_expert_gate, shared down, each expert's two
        E, Im, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        sparse = panels(E + 2 * Is + 1, H) + panels(H, Is) + E * (panels(2 * Im, H) + panels(H, Im))
    weights = len(cfg.gdn_layer_ids) * gdn + len(cfg.attention_layer_ids) * attention
    weights += len(cfg.dense_layer_ids) * mlp + len(cfg.sparse_layer_ids) * sparse
    weights += panels(V, H) + panels(V, 2 * -(-H // 2))
    if with_mtp and cfg.mtp_num_hidden_layers == 1:
        mtp_sparse = cfg.sparse_mlp(cfg.num_hidden_layers)
        weights += panels(H, 2 * H) + attention + (sparse if mtp_sparse else mlp)
    return 2 * weights
