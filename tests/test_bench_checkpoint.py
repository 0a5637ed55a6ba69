"""benchmarks/bench_tp.write_checkpoint, which writes the random checkpoints bench_formats and bench_moe time
(llama.cpp converts the same files): dense and MoE, it is a released-layout checkpoint that transformers and
deltaserve load as the same model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deltaserve.model.context import ForwardContext
from deltaserve.model.loader import load_model
from tests.checkpoints import MOE, TINY

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_tp import write_checkpoint  # noqa: E402


@pytest.mark.parametrize("experts", [None, MOE], ids=["dense", "moe"])
def test_written_checkpoint_is_the_same_model_in_transformers(tmp_path: Path, experts: dict | None) -> None:
    from transformers import AutoConfig, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    write_checkpoint(tmp_path, 4, TINY, experts)
    ours = load_model(tmp_path, dtype="float32")
    assert ours.config.num_experts == (MOE["num_experts"] if experts else 0)
    text = AutoConfig.from_pretrained(tmp_path).text_config
    cls = Qwen3_5MoeForCausalLM if experts else Qwen3_5ForCausalLM
    theirs = cls.from_pretrained(tmp_path, config=text, dtype=torch.float32).eval()
    ids = torch.randint(2, TINY["vocab_size"], (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(ids[None]).logits[0]
        got = ours.compute_logits(ours(ids, ForwardContext.stateless([24])))
    assert expected.abs().max() > 0.01  # the random weights make a function worth comparing
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
