"""The decoder stack: layers dispatched on `layer_types`, the text model, and the causal-LM head."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from deltaserve.model.attention import GatedAttention
from deltaserve.model.context import ForwardContext
from deltaserve.model.gdn import GatedDeltaNet
from deltaserve.model.layers import RMSNorm, RotaryEmbedding
from deltaserve.model.linear import Embedding, Linear, StoredWeights, tie
from deltaserve.model.mlp import MLP
from deltaserve.model.moe import SparseMoeBlock
from deltaserve.model.parallel import SINGLE, Shard, VocabParallelEmbedding
from deltaserve.model.sharding import rank_config, rank_shape


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x += mixer(input_layernorm(x)); x += mlp(post_attention_layernorm(x))."""

    def __init__(self, cfg: ModelConfig, layer_id: int, layer_type: str, shard: Shard = SINGLE) -> None:
        """cfg: this rank's heads and MLP width (rank_config); shard: where row-parallel sums meet."""
        super().__init__()
        self.layer_id = layer_id
        self.layer_type = layer_type
        if layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(cfg, layer_id, shard)
        elif layer_type == FULL_ATTENTION:
            self.self_attn = GatedAttention(cfg, layer_id, shard)
        else:
            raise ValueError(f"layer {layer_id}: unknown layer type {layer_type!r}")
        self.mlp = (SparseMoeBlock(cfg, shard) if cfg.sparse_mlp(layer_id)
                    else MLP(cfg.hidden_size, cfg.intermediate_size, shard))
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def mix(self, x: torch.Tensor, ctx: ForwardContext, rope: RotaryEmbedding, cos_sin: tuple) -> torch.Tensor:
        """The mixer's contribution to the residual stream (before the MLP)."""
        h = self.input_layernorm(x)
        if self.layer_type == LINEAR_ATTENTION:
            return self.linear_attn(h, ctx)
        return self.self_attn(h, ctx, rope, *cos_sin)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, rope: RotaryEmbedding, cos_sin: tuple) -> torch.Tensor:
        mix = self.mix(x, ctx, rope, cos_sin)
        y = x + mix
        ffn = self.mlp(self.post_attention_layernorm(y))
        if ctx.trace is not None:
            ctx.trace.layer(self.layer_id, x, mix, ffn)
        return y + ffn


def vocab_embedding(cfg: ModelConfig, shard: Shard) -> Embedding:
    """The whole vocabulary's embedding, or with tensor parallelism this rank's rows of it."""
    if shard.size == 1:
        return Embedding(cfg.vocab_size, cfg.hidden_size)
    return VocabParallelEmbedding(rank_shape(cfg, shard.size).vocab, cfg.hidden_size, shard)


class TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg, shard)
        layer_cfg = rank_config(cfg, shard.size)
        self.layers = nn.ModuleList(DecoderLayer(layer_cfg, i, t, shard) for i, t in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] -> final-normed hidden states [T, H]."""
        x = self.embed_tokens(input_ids)  # in the activation dtype (Embedding.out_dtype)
        if ctx.mm_embeds is not None:  # visual tokens replace their placeholders' embeddings
            rows, embeds = ctx.mm_embeds
            x = x.index_copy(0, rows, embeds.to(x.dtype))
        cos_sin = self.rotary.cos_sin(ctx.positions)
        for layer in self.layers:
            x = layer(x, ctx, self.rotary, cos_sin)
        return self.norm(x)


class Qwen3_5ForCausalLM(nn.Module):
    """Trunk + lm_head (+ the MTP head when the checkpoint has one). Every architecture of
    deltaserve.config.ARCHITECTURES builds this model; its MLPs are dense or sparse-MoE as the config says.
    With a shard of size N > 1, the rank's part of every layer (model/sharding.py): `config` stays the
    whole model's, `rank_config` has the rank's heads (its cache is allocated from it), lm_head holds the
    rank's vocabulary rows."""

    def __init__(
        self, cfg: ModelConfig, with_mtp: bool = False, shard: Shard = SINGLE, with_vision: bool = False
    ) -> None:
        """with_vision: build the vision tower of config.json's vision_config (model/vision.py)."""
        super().__init__()
        self.config = cfg
        self.shard = shard
        self.rank_config = rank_config(cfg, shard.size)
        self.model = TextModel(cfg, shard)
        vocab_rows = cfg.vocab_size if shard.size == 1 else rank_shape(cfg, shard.size).vocab
        self.lm_head = Linear(cfg.hidden_size, vocab_rows)
        if cfg.tie_word_embeddings:
            tie(self.model.embed_tokens, self.lm_head)
        self.mtp = None
        if with_mtp:
            from deltaserve.model.mtp import MTPHead

            self.mtp = MTPHead(cfg, shard)
        self.visual = None
        if with_vision:
            from deltaserve.model.vision import VisionTower

            self.visual = VisionTower(cfg.vision)

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype the model computes in (its norms hold it; the weights keep their own formats)."""
        return self.model.norm.weight.dtype

    def weight_formats(self) -> list[str]:
        """The formats its stored weights are in, e.g. ['bfloat16', 'int8']."""
        return sorted({m.fmt.name for m in self.modules() if isinstance(m, StoredWeights)})

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Final-normed hidden states [T, H]; no logits (ask compute_logits for the rows you need)."""
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """Logits (fp32) only at the requested rows of the final-normed hidden states; with tensor
        parallelism every rank's vocabulary rows, gathered, without the padding rows."""
        if rows is not None:
            hidden = hidden[rows]
        logits = self.lm_head(hidden).float()
        if self.shard.size == 1:
            return logits
        return self.shard.all_gather_last(logits)[:, : self.config.vocab_size]

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Merged visual tokens [sum of t*h*w / merge**2, H] of the images' patches (VisionTower.forward)."""
        if self.visual is None:
            raise ValueError("this model has no vision tower (no model.visual.* tensors), so it cannot take images")
        return self.visual(pixels, grids)

    def mtp_hidden(
        self, next_token_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, step: int = 0
    ) -> torch.Tensor:
        """MTP hidden [T, H] from trunk (or previous MTP) hidden at t and token t+1; logits via compute_logits."""
        if self.mtp is None:
            raise ValueError("this checkpoint has no MTP head (no mtp.* tensors)")
        embed = self.mtp.embed_tokens if self.mtp.embed_tokens is not None else self.model.embed_tokens
        return self.mtp(embed(next_token_ids), hidden, ctx, self.model.rotary, step)
