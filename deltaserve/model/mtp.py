"""The MTP (multi-token prediction) head used as the speculative drafter.

For trunk position t with final-normed hidden h_t and the next token x_{t+1}:
    m = fc(cat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])
then one full-attention decoder layer (its own KV cache, rotary position t), then `norm`, then the trunk's
lm_head gives logits for token t+2. Drafting more tokens feeds the head its own output and sampled token.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.config import FULL_ATTENTION, ModelConfig
from deltaserve.model.context import ForwardContext
from deltaserve.model.decoder import DecoderLayer, vocab_embedding
from deltaserve.model.layers import RMSNorm, RotaryEmbedding
from deltaserve.model.linear import Linear
from deltaserve.model.parallel import SINGLE, Shard
from deltaserve.model.sharding import rank_config


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard = SINGLE) -> None:
        """cfg: the whole model's. With tensor parallelism fc and the norms are replicated (fc is small:
        2H x H), its decoder layer is split as the trunk's are, a dedicated embedding is vocab-parallel."""
        super().__init__()
        H = cfg.hidden_size
        n = max(cfg.mtp_num_hidden_layers, 1)
        layer_cfg = rank_config(cfg, shard.size)
        self.fc = Linear(2 * H, H)
        self.pre_fc_norm_embedding = RMSNorm(H, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(H, eps=cfg.rms_norm_eps)
        # Its attention layers cache K/V under layer ids after the trunk's.
        self.layers = nn.ModuleList(
            DecoderLayer(layer_cfg, cfg.num_hidden_layers + i, FULL_ATTENTION, shard) for i in range(n)
        )
        self.norm = RMSNorm(H, eps=cfg.rms_norm_eps)
        self.embed_tokens = vocab_embedding(cfg, shard) if cfg.mtp_use_dedicated_embeddings else None

    @property
    def layer_ids(self) -> list[int]:
        return [layer.layer_id for layer in self.layers]

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, rope: RotaryEmbedding,
        step: int = 0,
    ) -> torch.Tensor:
        """embeds: embeddings of x_{t+1} [T, H]; hidden: h_t [T, H] -> MTP hidden [T, H] (after `norm`)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        layer = self.layers[step % len(self.layers)]
        x = layer(x, ctx, rope, rope.cos_sin(ctx.positions))
        return self.norm(x)
