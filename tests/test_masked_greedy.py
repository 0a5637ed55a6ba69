"""Greedy tokens under a grammar's bitmask: FusedTrunk.masked_greedy_tokens (deltaserve/ops/csrc/
masked_argmax.cpp) projects only the lm_head panels that hold an allowed token, and must give exactly
torch.argmax of the masked logits (deltaserve/ops/token_mask.py) of FusedTrunk.logits, for every kind of
mask (one token, a few, most, none) and row (near ties, NaN, logits that overflow), in every lm_head
format; the executors' plain implementation gives the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltaserve.cache.tensors import allocate_cache
from deltaserve.executor.base import Executor
from deltaserve.executor.fused_cpu.stack import FusedTrunk
from deltaserve.model.linear import store
from deltaserve.model.loader import load_model
from deltaserve.ops.formats import WeightFormat, quantize
from deltaserve.ops.token_mask import mask_logits_
from tests.checkpoints import TINY, random_hf_model, save_causal_lm_layout
from tests.test_greedy_screen import TIED, VOCAB, near_tie_head

WORDS = (VOCAB + 31) // 32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = random_hf_model(dict(TINY, vocab_size=VOCAB, hidden_size=48), seed=12)
    return load_model(save_causal_lm_layout(hf, tmp_path_factory.mktemp("masked")), dtype="float32")


def bitmask_of(allowed: list[list[int]]) -> torch.Tensor:
    bits = np.zeros((len(allowed), WORDS), dtype=np.uint32)
    for r, tokens in enumerate(allowed):
        for t in tokens:
            bits[r, t >> 5] |= np.uint32(1 << (t & 31))
    return torch.from_numpy(bits.view(np.int32))


def masks_and_rows(hidden: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of many kinds, each with a mask: the hidden rows, and the bitmask [R, WORDS]."""
    n = hidden.shape[0]
    allowed = []
    for r in range(n):
        kind = r % 6
        if kind == 0:  # one token
            allowed.append([int(torch.randint(VOCAB, (1,), generator=g))])
        elif kind == 1:  # a handful, in one or two panels
            allowed.append(torch.randint(VOCAB, (5,), generator=g).tolist())
        elif kind == 2:  # most of the vocabulary
            allowed.append([t for t in range(VOCAB) if torch.rand(1, generator=g) < 0.9])
        elif kind == 3:  # the tied rows and some others
            allowed.append(TIED + torch.randint(VOCAB, (3,), generator=g).tolist())
        elif kind == 4:  # nothing at all: every value -inf
            allowed.append([])
        else:  # the whole last, partial panel and one token before it
            allowed.append([3] + list(range(VOCAB // 64 * 64, VOCAB)))
    return hidden, bitmask_of(allowed)


def _heads(hidden_size: int, g: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    head, _ = near_tie_head(hidden_size, g)
    # "+int8": the int8 head reads int8 activations (its default), which compute_logits quantizes per call
    return [("bfloat16", head), ("float32", head), ("int8", head), ("int8+int8", head)]


def _set_head(model, fmt: str, head: torch.Tensor) -> None:
    if fmt == "bfloat16":
        store(model.lm_head, WeightFormat("float32"))
        model.lm_head.weight = torch.nn.Parameter(head.bfloat16(), requires_grad=False)
        return
    f = WeightFormat.of(fmt) if fmt != "float32" else WeightFormat("float32")
    store(model.lm_head, f)
    if fmt == "float32":
        model.lm_head.weight.data.copy_(head)
    else:
        data, scale = quantize(head, f)
        model.lm_head.weight.data.copy_(data)
        model.lm_head.weight_scale.data.copy_(scale)


def test_masked_greedy_tokens_equal_the_masked_logits_argmax(model) -> None:
    g = torch.Generator().manual_seed(5)
    for fmt, head in _heads(model.config.hidden_size, g):
        fmt, _, activations = fmt.partition("+")
        _set_head(model, fmt, head)
        model.lm_head.activation_quantization = activations or "none"
        fused = FusedTrunk(model, allocate_cache(model.config, num_blocks=4, block_size=16, num_slots=1))
        u = head[TIED[0]] / head[TIED[0]].norm()
        hidden = 4 * u + 1e-3 * torch.randn(120, u.numel(), generator=g)
        hidden[7] = head[TIED[0]]  # the tied rows hold the maximum: the first allowed one wins
        hidden[8, 2] = float("nan")  # every logit NaN: refused, all -inf
        hidden[9] *= 1e38  # logits overflow to +-inf: a refused +inf must not win, an allowed one does
        hidden[10] = -hidden[10]
        hidden, bitmask = masks_and_rows(hidden, g)
        with torch.inference_mode():
            for rows in (list(range(120)), [1], [7, 9, 13], list(range(12))):
                expected = mask_logits_(fused.logits(hidden, rows), bitmask[rows].numpy()).argmax(dim=-1)
                got = fused.masked_greedy_tokens(hidden, rows, bitmask[rows].contiguous())
                assert torch.equal(got, expected), (fmt, rows, (got != expected).nonzero())
                # the executors' plain implementation: the logits, masked
                plain = Executor.masked_greedy_tokens(_Logits(fused), hidden, rows, bitmask[rows].contiguous())
                assert torch.equal(plain, expected), (fmt, rows)
        if activations:
            assert_int8_activation_order(model, fused, g)
    store(model.lm_head, WeightFormat("float32"))
    model.lm_head.activation_quantization = "none"


def assert_int8_activation_order(model, fused: FusedTrunk, g: torch.Generator) -> None:
    """Rows allowing two tokens whose order int8 activations reverse: the masked greedy token is the one
    compute_logits ranks first, not the float rows' (the masked pass once projected unquantized rows)."""
    x = torch.randn(64, model.config.hidden_size, generator=g)
    with torch.inference_mode():
        quantized = fused.logits(x, None)
        unquantized = x @ model.lm_head.weight_values().T
    rows, pairs = [], []
    for r in range(x.shape[0]):
        order = quantized[r].argsort(descending=True).tolist()
        flipped = [(a, b) for a, b in zip(order, order[1:]) if unquantized[r, a] < unquantized[r, b]]
        if flipped:
            rows.append(r)
            pairs.append(flipped[0])
    assert rows, "no row whose order int8 activations change"
    got = fused.masked_greedy_tokens(x, rows, bitmask_of([list(p) for p in pairs]).contiguous())
    assert got.tolist() == [a for a, _ in pairs]


class _Logits:
    """What Executor.masked_greedy_tokens reads of an executor: its compute_logits."""

    def __init__(self, fused: FusedTrunk) -> None:
        self.compute_logits = fused.logits


def test_masked_greedy_tokens_checks_the_bitmask(model) -> None:
    fused = FusedTrunk(model, allocate_cache(model.config, num_blocks=4, block_size=16, num_slots=1))
    hidden = torch.randn(2, model.config.hidden_size)
    with pytest.raises(RuntimeError, match=r"allowed must be int32 \[2, 29\]"):
        fused.masked_greedy_tokens(hidden, None, torch.zeros(2, 28, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int32"):
        fused.masked_greedy_tokens(hidden, None, torch.zeros(2, WORDS, dtype=torch.int64))


def test_mask_logits_refuses_whatever_the_logit() -> None:
    logits = torch.tensor([[float("inf"), float("nan"), 1.0, -2.0, float("inf")]])
    bitmask = np.array([[0b10110]], dtype=np.int32)  # tokens 1, 2 and 4 allowed
    out = mask_logits_(logits.clone(), bitmask)
    assert out.tolist() == [[float("-inf"), float("-inf"), 1.0, float("-inf"), float("inf")]]
    assert out.argmax(dim=-1).item() == 4
