"""Dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.model.linear import Linear, shared_activations
from deltaserve.model.parallel import SINGLE, Shard


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, shard: Shard = SINGLE) -> None:
        """intermediate_size: this rank's share; down_proj's partial sums meet in shard."""
        super().__init__()
        self.shard = shard
        self.gate_proj = Linear(hidden_size, intermediate_size)
        self.up_proj = Linear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_gate, x_up = shared_activations(x, self.gate_proj, self.up_proj)
        return self.shard.all_reduce(self.down_proj(F.silu(self.gate_proj(x, x_gate)) * self.up_proj(x, x_up)))
