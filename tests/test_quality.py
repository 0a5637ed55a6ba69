"""Quality of the weight formats, measured: the trained demo's perplexity on its held-out text
(deltaserve/assets/demo/heldout.jsonl) with int8 weights stays within 1% of bf16's, with int4 within 5%, and
fp8 within 2%."""

from __future__ import annotations

import pytest

from deltaserve.assets import demo_checkpoint_path
from deltaserve.model.loader import load_model
from deltaserve.perplexity import load_documents, perplexity
from deltaserve.tokenizer import Tokenizer

WINDOW = 512
BOUND = {"int8": 0.01, "fp8": 0.02, "int4": 0.05}


@pytest.fixture(scope="module")
def scored():
    path = demo_checkpoint_path()
    docs, tokenizer = load_documents(path / "heldout.jsonl"), Tokenizer.from_dir(path)

    def ppl(quantization: str | None) -> float:
        return perplexity(load_model(path, quantization=quantization), tokenizer, docs, WINDOW).total.perplexity

    return ppl, ppl(None)


@pytest.mark.parametrize("quantization", ["int8", "fp8", "int4"])
def test_perplexity_stays_near_bf16(scored, quantization):
    ppl, bf16 = scored
    got = ppl(quantization)
    print(f"demo held-out perplexity: bf16 {bf16:.5f}, {quantization} {got:.5f} ({got / bf16 - 1:+.3%})")
    assert got / bf16 - 1 < BOUND[quantization]
    assert got != bf16  # the format really was used
