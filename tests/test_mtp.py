"""The MTP head against a from-the-formula reference built on transformers' own decoder layer."""

from __future__ import annotations

import pytest
import torch

from deltaserve.cache.tensors import allocate_cache
from deltaserve.model.context import ForwardContext
from deltaserve.model.loader import CheckpointError, load_model
from tests.checkpoints import TINY, fuse_experts, random_hf_model, random_mtp_tensors, save_official_layout


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def reference_mtp_logits(hf, mtp: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """logits[t] for token t+2 from h_t (final-normed trunk hidden) and token t+1, for t < T-1. The MTP layer
    is hf's own decoder layer class (sparse-MoE too for a MoE model, its experts given one tensor each)."""
    decoder_layer, rotary = type(hf.model.layers[0]), type(hf.model.rotary_emb)
    cfg = hf.config
    eps = cfg.rms_norm_eps
    with torch.no_grad():
        h = hf.model(ids[None]).last_hidden_state[0]  # final-normed, what lm_head reads
        e = hf.model.embed_tokens(ids)
        x = torch.cat([rms(e[1:], mtp["mtp.pre_fc_norm_embedding.weight"], eps),
                       rms(h[:-1], mtp["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1)
        x = x @ mtp["mtp.fc.weight"].t()
        layer_cfg = cfg.__class__(**{**cfg.to_dict(), "layer_types": ["full_attention"] * cfg.num_hidden_layers})
        layer_cfg._attn_implementation = "eager"
        layer_cfg._experts_implementation = "eager"
        layer = decoder_layer(layer_cfg, 0).eval()
        state = {k[len("mtp.layers.0."):]: v for k, v in mtp.items() if k.startswith("mtp.layers.0.")}
        layer.load_state_dict(fuse_experts(state))
        T = x.shape[0]
        positions = torch.arange(T)[None]  # the MTP entry for trunk position t sits at rotary position t
        cos_sin = rotary(layer_cfg)(x[None], positions)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = layer(x[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)[0]
        y = rms(y, mtp["mtp.norm.weight"], eps)
        return hf.lm_head(y).float()


@pytest.fixture(scope="module")
def mtp_pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp")
    hf = random_hf_model(TINY, seed=4)
    mtp = random_mtp_tensors(TINY, seed=5)
    save_official_layout(hf, path, mtp)
    return hf, mtp, load_model(path, dtype="float32")


def test_mtp_logits_match_formula_reference(mtp_pair):
    hf, mtp, ours = mtp_pair
    ids = torch.randint(0, TINY["vocab_size"], (30,), generator=torch.Generator().manual_seed(0))
    ref = reference_mtp_logits(hf, mtp, ids)
    with torch.no_grad():
        h = ours(ids, ForwardContext.stateless([30]))
        got = ours.compute_logits(ours.mtp_hidden(ids[1:], h[:-1], ForwardContext.stateless([29])))
    assert (got - ref).abs().max() < 1e-4


def test_mtp_layer_uses_its_own_paged_kv_cache(mtp_pair):
    hf, mtp, ours = mtp_pair
    ids = torch.randint(0, TINY["vocab_size"], (30,), generator=torch.Generator().manual_seed(1))
    ref = reference_mtp_logits(hf, mtp, ids)
    cfg = ours.config
    cache = allocate_cache(cfg, num_blocks=8, block_size=16, num_slots=2, with_mtp=True)
    assert cfg.num_hidden_layers in cache.kv  # the MTP layer's K/V pages
    with torch.no_grad():
        h = ours(ids, ForwardContext.stateless([30]))
        outs, done = [], 0
        for n in (12, 1, 1, 15):
            ctx = ForwardContext.paged(cache, [n], [done], [[0, 1]], [0])
            outs.append(ours.compute_logits(ours.mtp_hidden(ids[done + 1 : done + 1 + n], h[done : done + n], ctx)))
            done += n
    assert (torch.cat(outs) - ref).abs().max() < 1e-4


def test_requesting_mtp_from_a_checkpoint_without_it_is_an_error(tmp_path):
    hf = random_hf_model(TINY, seed=6)
    save_official_layout(hf, tmp_path)
    with pytest.raises(CheckpointError, match="no mtp"):
        load_model(tmp_path, with_mtp=True)
    model = load_model(tmp_path)
    assert model.mtp is None
    with pytest.raises(ValueError, match="no MTP head"):
        model.mtp_hidden(torch.tensor([1]), torch.zeros(1, TINY["hidden_size"]), ForwardContext.stateless([1]))
