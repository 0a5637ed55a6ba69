"""FusedTrunk.greedy_tokens screens the vocabulary with bf16 dot products and decides with the fp32 panel
kernel (fused_step.cpp, screened_greedy). Its tokens must be exactly torch.argmax of the logits that
FusedTrunk.logits returns, also where the logits are so close that the bf16 screen alone would pick wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.cache.tensors import allocate_cache
from deltaserve.model.fused import FusedTrunk
from deltaserve.model.loader import load_model
from tests.checkpoints import TINY, random_hf_model, save_causal_lm_layout

VOCAB = 900  # 14 full panels of 64 outputs and a partial one of 4


def cpu_has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = random_hf_model(dict(TINY, vocab_size=VOCAB), seed=11)
    with torch.no_grad():  # a bf16 checkpoint computed in fp32: the lm_head gets panels (and the screen)
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    return load_model(save_causal_lm_layout(hf, tmp_path_factory.mktemp("screen")), dtype="float32")


def near_tie_head(hidden: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An lm_head and a direction u. 150 rows, spread over every panel, are w0 + d with w0 along u and each
    d its own random vector at right angles to u, as long as w0: along u they tie, so for hidden rows near u
    their logits differ by about as much as rounding a row to bf16 moves them. Two more rows are exact
    copies of one of them (a tie for torch.argmax to break); the rest lie far below."""
    u = torch.randn(hidden, generator=g)
    u /= u.norm()
    head = torch.randn(VOCAB, hidden, generator=g) * 0.05
    rows = torch.randperm(VOCAB, generator=g)[:152]
    d = torch.randn(len(rows), hidden, generator=g)
    d -= (d @ u)[:, None] * u
    head[rows] = 2 * u + 2 * d / d.norm(dim=1, keepdim=True)
    head[rows[-2:]] = head[rows[0]].clone()
    return head.bfloat16().float(), u


def test_greedy_tokens_are_exact_where_logits_nearly_tie(model) -> None:
    g = torch.Generator().manual_seed(0)
    head, u = near_tie_head(model.config.hidden_size, g)
    model.lm_head.weight.data.copy_(head)
    fused = FusedTrunk(model, allocate_cache(model.config, num_blocks=4, block_size=16, num_slots=1))
    assert fused.greedy_screen == cpu_has_avx512_bf16()
    hidden = 4 * u + 1e-3 * torch.randn(300, u.numel(), generator=g)
    hidden[5] *= 1e35  # logits near overflow: outside the screen's range, the plain path
    hidden[6] = 4 * u  # exactly along u
    hidden[8, 2] = float("nan")  # NaN logits count as the largest, as in torch.argmax
    with torch.inference_mode():
        for rows in (list(range(300)), [6], [6, 8], list(range(10))):
            expected = fused.logits(hidden, rows).argmax(dim=-1)
            assert torch.equal(fused.greedy_tokens(hidden, rows), expected)
            fused.greedy_screen = False
            assert torch.equal(fused.greedy_tokens(hidden, rows), expected)
            fused.greedy_screen = True
    # the screen was put to the test: the top logits of most rows lie within its bf16 rounding of each other
    logits = fused.logits(hidden)
    top2 = logits.topk(2, dim=-1).values
    assert ((top2[:, 0] - top2[:, 1]) < 1e-3 * top2[:, 0].abs()).float().mean() > 0.5
