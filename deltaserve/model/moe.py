"""Sparse mixture-of-experts MLP (Qwen3.5-MoE, Qwen3-Next): a softmax top-k router over num_experts SwiGLU
experts of width moe_intermediate_size, plus one shared expert scaled by sigmoid(shared_expert_gate(x)).

Routing follows transformers exactly, ties included: logits in the activation dtype, softmax in fp32,
torch.topk on the probabilities, renormalised over the k chosen when norm_topk_prob, then cast back to the
activation dtype. The experts run grouped: the (token, choice) pairs are sorted by expert and every expert
some token chose runs one gate|up and one down matmul over its tokens; an expert no token chose is never
read. That is the shape a fused kernel takes, so this is its reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.model.linear import Linear, StoredWeights
from deltaserve.model.mlp import MLP
from deltaserve.model.parallel import SINGLE, Shard
from deltaserve.ops.formats import dequantize


class Experts(StoredWeights):
    """All experts' weights as 3-D tensors, as the bf16 releases store them: gate_up_proj [E, 2I, H] (per
    expert the gate rows, then the up rows) and down_proj [E, H, I], in one weight format (expert e's
    weight is block e of the data and of the scales)."""

    WEIGHTS = ("gate_up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        # Left uninitialised, as transformers does: the loader fills every expert (and checks it did), and
        # a random init of the 35B-A3B's 32 B expert weights would cost minutes for nothing.
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.register_parameter("gate_up_proj_scale", None)
        self.register_parameter("down_proj_scale", None)

    def logical_shape(self, name: str) -> tuple[int, int, int]:
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        return (E, 2 * I, H) if name == "gate_up_proj" else (E, H, I)

    def expert_weight(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's weight `name` as numbers in dtype (only that expert's bytes are read)."""
        scale = self.scale(name)
        return dequantize(getattr(self, name)[e], None if scale is None else scale[e], self.fmt,
                          self.logical_shape(name)[-1], dtype)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; expert_ids, weights [T, k] -> sum over the k choices of weight * expert(x), [T, H]."""
        k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert, tokens ascending
        counts = torch.bincount(flat, minlength=self.num_experts)
        touched = counts.nonzero().flatten()  # only these experts' weights are read
        tokens = order // k
        xs = self.activations(x)[tokens]  # per row: each token quantized once, not once per choice
        ws = weights.reshape(-1)[order, None]
        ys = torch.empty_like(xs)
        start = 0
        for e, n in zip(touched.tolist(), counts[touched].tolist(), strict=True):
            rows = slice(start, start + n)
            gate, up = F.linear(xs[rows], self.expert_weight("gate_up_proj", e, x.dtype)).chunk(2, dim=-1)
            act = self.activations(F.silu(gate) * up)
            ys[rows] = F.linear(act, self.expert_weight("down_proj", e, x.dtype)) * ws[rows]
            start += n
        return torch.zeros_like(x).index_add_(0, tokens, ys)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard = SINGLE) -> None:
        """cfg: this rank's expert and shared-expert widths (rank_config); the router and the shared expert's
        gate are whole on every rank, so the ranks route alike, and their partial outputs meet in shard."""
        super().__init__()
        self.shard = shard
        H = cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Linear(H, cfg.num_experts)  # the router
        self.experts = Experts(cfg.num_experts, H, cfg.moe_intermediate_size)
        self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(H, 1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> chosen expert ids [T, k] (int64) and their weights [T, k] in x's dtype."""
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return expert_ids, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert_ids, weights = self.route(x)
        routed = self.experts(x, expert_ids, weights)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.shard.all_reduce(routed + shared)
