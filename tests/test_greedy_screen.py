"""FusedTrunk.greedy_tokens screens a bf16 lm_head's vocabulary with bf16 dot products, reading the weight
row-major where it is, and decides with the fp32 projection kernel (deltaserve/ops/csrc/greedy_screen.cpp,
screened_greedy); an lm_head in another format runs the exact projection with its argmax fused. Its tokens
must be exactly torch.argmax of the logits that FusedTrunk.logits returns, also where the logits are so
close that the bf16 screen alone would pick wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.cache.tensors import allocate_cache
from deltaserve.executor.fused_cpu.stack import FusedTrunk
from deltaserve.model.linear import store
from deltaserve.model.loader import load_model
from deltaserve.ops.formats import WeightFormat, dequantize, quantize
from tests.checkpoints import TINY, random_hf_model, save_causal_lm_layout

VOCAB = 900  # 14 full panels of 64 outputs and a partial one of 4 (the screen's bounds are per panel)
TIED = [150, 470, 850]  # three equal rows, in panels 2, 7 and 13


def cpu_has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.fixture(scope="module", params=[48, 47], ids=["even-hidden", "odd-hidden"])
def model(request, tmp_path_factory):
    hf = random_hf_model(dict(TINY, vocab_size=VOCAB, hidden_size=request.param), seed=11)
    return load_model(save_causal_lm_layout(hf, tmp_path_factory.mktemp("screen")), dtype="float32")


def near_tie_head(hidden: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An lm_head and a direction u. 152 rows, spread over every panel, are w0 + d with w0 along u and each
    d its own random vector at right angles to u, as long as w0: along u they tie, so for hidden rows near u
    their logits differ by about as much as rounding a row to bf16 moves them. The rows TIED are exact
    copies of one of them (a tie for torch.argmax to break); the rest lie far below."""
    u = torch.randn(hidden, generator=g)
    u /= u.norm()
    head = torch.randn(VOCAB, hidden, generator=g) * 0.05
    others = [i for i in torch.randperm(VOCAB, generator=g).tolist() if i not in TIED]
    rows = torch.tensor(TIED + others[:149])
    d = torch.randn(len(rows), hidden, generator=g)
    d -= (d @ u)[:, None] * u
    head[rows] = 2 * u + 2 * d / d.norm(dim=1, keepdim=True)
    head[TIED[1:]] = head[TIED[0]].clone()
    return head.bfloat16().float(), u


def set_head(model, head: torch.Tensor) -> None:
    """The lm_head stored as bf16 (its values are bf16 numbers), as a bf16 checkpoint loads it."""
    model.lm_head.weight = torch.nn.Parameter(head.bfloat16(), requires_grad=False)


def test_greedy_tokens_are_exact_where_logits_nearly_tie(model) -> None:
    g = torch.Generator().manual_seed(0)
    head, u = near_tie_head(model.config.hidden_size, g)
    set_head(model, head)
    fused = FusedTrunk(model, allocate_cache(model.config, num_blocks=4, block_size=16, num_slots=1))
    assert fused.greedy_screen == cpu_has_avx512_bf16()
    hidden = 4 * u + 1e-3 * torch.randn(300, u.numel(), generator=g)
    hidden[5] *= 1e35  # logits near overflow: outside the screen's range, the plain path
    hidden[6] = 4 * u  # exactly along u
    hidden[7] = head[TIED[0]]  # the three TIED rows hold the maximum: the first of them wins
    hidden[8, 2] = float("nan")  # NaN logits count as the largest, as in torch.argmax
    with torch.inference_mode():
        for rows in (list(range(300)), [6], [6, 8], list(range(10))):
            expected = fused.logits(hidden, rows).argmax(dim=-1)
            assert torch.equal(fused.greedy_tokens(hidden, rows), expected)
            fused.greedy_screen = False
            assert torch.equal(fused.greedy_tokens(hidden, rows), expected)
            fused.greedy_screen = True
        assert fused.greedy_tokens(hidden, [7, 0])[0] == TIED[0]
        # the screen was put to the test: bf16 dot products alone pick another token for many rows
        exact = fused.logits(hidden).argmax(dim=-1)
        rounded = (hidden.bfloat16().float() @ head.T).argmax(dim=-1)
    assert (exact != rounded).float().mean() > 0.2


def hidden_winner_case(H: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A hidden row h and an lm_head whose winning row (WINNER) is 60 e / ||e||, e = h - bf16(h) being h's
    rounding error: its bf16 logit is lower than its true one by the whole Cauchy-Schwarz bound ||e|| ||w||.
    A rival row along h trails the winner by 15% of that, so the bf16 logits pick the rival. Tries h until
    a screen with half the bound (scale ||e|| x 1.25 / 2) would drop the winner's panel."""
    winner, rival = WINNER, RIVAL
    for _ in range(200):
        h = torch.randn(H, generator=g)
        h = 4 * h / h.norm()
        e = h.double() - h.bfloat16().double()
        head = (torch.randn(VOCAB, H, generator=g) * 0.05).bfloat16().double()
        head[winner] = (60 * e / e.norm()).bfloat16().double()
        a_w = h.double() @ head[winner]
        along_h = h.double() / h.double().norm()
        head[rival] = ((a_w - 9 * e.norm()) / h.double().norm() * along_h).bfloat16().double()
        exact = h.double() @ head.T
        rounded = h.bfloat16().double() @ head.T
        half_bound = 0.5 * 1.25 * e.norm() * head.norm(dim=1)
        if (exact.argmax() == winner and rounded.argmax() == rival
                and rounded[winner] + half_bound[winner] < rounded[rival] - half_bound[rival]):
            return h, head.float()
    raise AssertionError("no such case found")


WINNER, RIVAL = 100, 700  # panels 1 and 10


def test_greedy_tokens_are_exact_when_rounding_the_row_hides_the_winner(model) -> None:
    """The bound is needed at its full width, not only in principle: see hidden_winner_case."""
    h, head = hidden_winner_case(model.config.hidden_size, torch.Generator().manual_seed(1))
    set_head(model, head)
    fused = FusedTrunk(model, allocate_cache(model.config, num_blocks=4, block_size=16, num_slots=1))
    assert fused.greedy_screen == cpu_has_avx512_bf16()
    rows = torch.stack([h, h])
    with torch.inference_mode():
        assert fused.logits(rows).argmax(dim=-1).tolist() == [WINNER, WINNER]
        assert fused.greedy_tokens(rows).tolist() == [WINNER, WINNER]


def test_an_lm_head_in_another_format_has_no_screen_and_exact_tokens(model) -> None:
    """float32 and int8 lm_heads: no screen; greedy_tokens is the fused projection's argmax, exactly
    torch.argmax of the logits (near ties included)."""
    g = torch.Generator().manual_seed(2)
    head, u = near_tie_head(model.config.hidden_size, g)
    hidden = 4 * u + 1e-3 * torch.randn(40, u.numel(), generator=g)
    int8 = WeightFormat.of("int8")
    data, scale = quantize(head, int8)
    for weight, weight_scale, fmt in ((head, None, None), (data, scale, int8)):
        store(model.lm_head, fmt or WeightFormat("float32"))
        model.lm_head.weight.data.copy_(weight)
        if weight_scale is not None:
            model.lm_head.weight_scale.data.copy_(weight_scale)
        fused = FusedTrunk(model, allocate_cache(model.config, num_blocks=4, block_size=16, num_slots=1))
        assert not fused.greedy_screen
        with torch.inference_mode():
            logits = fused.logits(hidden)
            torch.testing.assert_close(logits, hidden @ dequantize(data, scale, int8, head.shape[1]).T
                                       if fmt else hidden @ head.T, atol=1e-4, rtol=1e-4)
            for rows in (list(range(40)), [3], [3, 5]):
                assert torch.equal(fused.greedy_tokens(hidden, rows), fused.logits(hidden, rows).argmax(dim=-1))
    store(model.lm_head, WeightFormat("float32"))  # the module's other tests set their own float weights
