"""The inspector's trace API against the model's own paths: residual bookkeeping and hidden states (vs
transformers), top-k vs the plain forward's logits, GDN states vs the engine's paged cache, attention rows,
on a random checkpoint and (when built) the embedded demo checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.assets import DEMO_DIR
from deltaserve.cache.tensors import allocate_cache
from deltaserve.inspect.recorder import TraceRecorder
from deltaserve.inspect.shapes import layer_detail
from deltaserve.inspect.tokens import TraceInputError, token_view, tokenize_input
from deltaserve.inspect.trace import (
    attention_lab,
    attention_probs,
    forward_trace,
    gdn_state_lab,
    gdn_states,
    run_traced,
)
from deltaserve.model.context import ForwardContext
from deltaserve.model.loader import load_model
from tests.checkpoints import RATIOS_27B, random_hf_model, save_official_layout


@pytest.fixture(scope="module")
def hf_and_path(tmp_path_factory: pytest.TempPathFactory):
    hf = random_hf_model(RATIOS_27B, seed=7)
    return hf, save_official_layout(hf, tmp_path_factory.mktemp("ckpt"))


def _demo_or_skip() -> Path:
    if not (DEMO_DIR / "model.safetensors").exists():
        pytest.skip("the demo checkpoint (deltaserve/assets/demo/model.safetensors) is not built yet")
    return DEMO_DIR


@pytest.fixture(scope="module", params=["random", "demo"])
def model(request, hf_and_path):
    path = hf_and_path[1] if request.param == "random" else _demo_or_skip()
    return load_model(path, torch.float32)


def _ids(model, n: int = 40, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist()


def test_residual_stream_adds_up_and_hands_over(model) -> None:
    ids = _ids(model)
    tr = forward_trace(model, None, ids, coords=[0, 3, 5])
    cfg = model.config
    assert [L["layer"] for L in tr["layers"]] == list(range(cfg.num_hidden_layers))
    assert [L["type"] for L in tr["layers"]] == [
        "gdn" if t == "linear_attention" else "attention" for t in cfg.layer_types
    ]
    for L in tr["layers"]:
        assert L["residual_error"] < 1e-5  # X_out = X_in + Δmix + Δffn, to fp32 rounding
        assert L["handoff_error"] == 0.0  # the next layer's X_in is exactly this X_out
        assert len(L["x_out_norm"]) == len(ids) and len(L["x_in"][0]) == 3
        for t in range(len(ids)):  # the coordinates add up too
            s = L["x_in"][t][1] + L["mix"][t][1] + L["ffn"][t][1]
            assert s == pytest.approx(L["x_out"][t][1], abs=1e-4)


def test_layer_outputs_match_transformers_hidden_states(hf_and_path) -> None:
    hf, path = hf_and_path
    model = load_model(path, torch.float32)
    ids = _ids(model, 30, seed=1)
    tr = forward_trace(model, None, ids)
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for i, L in enumerate(tr["layers"][:-1]):  # transformers' last entry is after the final norm
        want = hs[i + 1][0].norm(dim=-1)
        torch.testing.assert_close(torch.tensor(L["x_out_norm"]), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.tensor(tr["layers"][0]["x_in_norm"]), hs[0][0].norm(dim=-1),
                               rtol=1e-4, atol=1e-4)


def test_top_k_equals_the_plain_forward(model) -> None:
    ids = _ids(model, 24, seed=2)
    tr = forward_trace(model, None, ids, top_k=5)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), ForwardContext.stateless([len(ids)])))
    probs = logits.softmax(-1)
    for t, pos in enumerate(tr["final"]["positions"]):
        p, i = probs[t].topk(5)
        assert [c["id"] for c in pos["top"]] == i.tolist()
        assert [c["p"] for c in pos["top"]] == pytest.approx(p.tolist(), abs=1e-5)
        if t + 1 < len(ids):
            assert pos["p_next"] == pytest.approx(float(probs[t, ids[t + 1]]), abs=1e-5)


def test_gdn_states_equal_the_engine_cache_path(model) -> None:
    """The trace's per-token states end where the engine's paged path (chunked prefill in two chunks, then a
    decode token) leaves the slot's recurrent state."""
    cfg = model.config
    ids = _ids(model, 37, seed=3)
    layers = set(cfg.gdn_layer_ids)
    recorder, _ = run_traced(model, ids, [0], capture=layers)
    cache = allocate_cache(cfg, num_blocks=8, block_size=16, num_slots=3)
    table, slot = [5, 2, 7], 1
    with torch.inference_mode():
        for start, end in ((0, 20), (20, 36), (36, 37)):
            ctx = ForwardContext.paged(cache, [end - start], [start], [table], [slot])
            model(torch.tensor(ids[start:end]), ctx)
    for layer in cfg.gdn_layer_ids:
        states, _, _ = gdn_states(recorder.gdn_layers[layer])
        torch.testing.assert_close(states[-1], cache.ssm[layer][slot], rtol=1e-4, atol=1e-5)
    lab = gdn_state_lab(model, ids, cfg.gdn_layer_ids[-1], head=cfg.linear_num_value_heads - 1)
    last = torch.tensor(lab["states"][-1])
    torch.testing.assert_close(last, cache.ssm[cfg.gdn_layer_ids[-1]][slot][-1], rtol=1e-3, atol=1e-4)
    assert len(lab["states"]) == len(ids) and all(0 < d <= 1 for d in lab["decay"])
    assert all(0 < b < 1 for b in lab["beta"])


class _FullRecorder(TraceRecorder):
    """Also keeps every layer's full X_in and Δmix, to recompute the attention output from the weights."""

    def __init__(self, capture: set[int]) -> None:
        super().__init__(coords=[0], capture=capture)
        self.full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, layer_id, x, mix, ffn) -> None:
        self.full[layer_id] = (x.clone(), mix.clone())
        TraceRecorder.layer(self, layer_id, x, mix, ffn)


def test_attention_weights_are_the_layers_own(model) -> None:
    cfg = model.config
    ids = _ids(model, 21, seed=4)
    layer = cfg.attention_layer_ids[0]
    rec = _FullRecorder({layer})
    with torch.inference_mode():
        ctx = ForwardContext.stateless([len(ids)])
        ctx.trace = rec
        model(torch.tensor(ids), ctx)
        cap = rec.attention_layers[layer]
        w, _, _ = attention_probs(cap, cfg.rotary_dim)  # [nh, T, T]
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:2]), rtol=0, atol=1e-5)
        assert float(w.triu(1).abs().max()) == 0.0  # causal
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        v = cap.v.float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [nh, T, hd]
        o = (w @ v).transpose(0, 1).reshape(len(ids), -1) * torch.sigmoid(cap.gate.reshape(len(ids), -1))
        mix = model.model.layers[layer].self_attn.o_proj(o)
        torch.testing.assert_close(mix, rec.full[layer][1], rtol=1e-4, atol=1e-5)
    lab = attention_lab(model, ids, layer, head=1)
    assert len(lab["weights"]) == cfg.num_attention_heads
    for head in lab["weights"]:
        for row in head:
            assert sum(row) == pytest.approx(1.0, abs=1e-3)
    assert sum(len(g) for g in lab["groups"]) == cfg.num_attention_heads
    assert lab["rope"]["rotary_dim"] == cfg.rotary_dim


def test_errors_name_the_bad_value(model) -> None:
    cfg = model.config
    ids = _ids(model, 5)
    with pytest.raises(ValueError, match="not a GDN layer"):
        gdn_state_lab(model, ids, cfg.attention_layer_ids[0], 0)
    with pytest.raises(ValueError, match="not an attention layer"):
        attention_lab(model, ids, cfg.gdn_layer_ids[0], 0)
    with pytest.raises(ValueError, match="outside the hidden size"):
        forward_trace(model, None, ids, coords=[cfg.hidden_size])
    with pytest.raises(TraceInputError, match="at most 4"):
        tokenize_input(None, token_ids=list(range(5)), max_tokens=4)
    with pytest.raises(TraceInputError, match="outside the vocabulary"):
        tokenize_input(None, token_ids=[cfg.vocab_size], vocab_size=cfg.vocab_size)
    with pytest.raises(TraceInputError, match="no tokenizer"):
        tokenize_input(None, prompt="hi")


def test_layer_detail_shapes_per_rank(model) -> None:
    cfg = model.config
    gdn = layer_detail(model, cfg.gdn_layer_ids[0], num_tokens=7)
    assert gdn["type"] == "gdn" and any(t["kind"] == "cache" and "S" in t["name"] for t in gdn["tensors"])
    names = {w["name"]: w["shape"] for w in gdn["weights"]}
    assert names["linear_attn.in_proj_qkv.weight"] == [cfg.conv_dim, cfg.hidden_size]
    attn = layer_detail(model, cfg.attention_layer_ids[0], num_tokens=7)
    assert attn["type"] == "attention" and attn["ops"][0]["shape"] == f"[7,{cfg.hidden_size}]"


def test_chinese_tokenization_view() -> None:
    from deltaserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(DEMO_DIR)
    tp = tokenize_input(tok, prompt="猫坐在垫上")
    view = token_view(tok, tp)
    assert [v["id"] for v in view] == tok.encode("猫坐在垫上")
    joined = b"".join(bytes.fromhex(v["bytes"]) for v in view)
    assert joined.decode("utf-8") == "猫坐在垫上"  # the byte pieces spell the string
    assert all(v["span"] is not None for v in view)
    chat = tokenize_input(tok, messages=[{"role": "user", "content": "猫"}])
    assert "<|im_start|>" in chat.text and any(v["special"] for v in token_view(tok, chat))
