"""Quality of the weight formats, measured: the trained demo's perplexity on its held-out text
(deltaserve/assets/demo/heldout.jsonl) with int8 weights stays within 1% of bf16's, with int4 within 5%, and
fp8 within 2%; int8 and int4 with int8 activations (their default) too."""

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

    def ppl(quantization: str | None, activations: str | None = None) -> float:
        model = load_model(path, quantization=quantization, activation_quantization=activations)
        return perplexity(model, tokenizer, docs, WINDOW).total.perplexity

    return ppl, ppl(None)


# int8 / int4 with their default int8 activations (deltaserve/ops/activation_quant.py) and without
@pytest.mark.parametrize("quantization, activations", [("int8", "int8"), ("int8", "none"), ("fp8", None),
                                                       ("int4", "int8"), ("int4", "none")])
def test_perplexity_stays_near_bf16(scored, quantization, activations):
    ppl, bf16 = scored
    got = ppl(quantization, activations)
    print(f"demo held-out perplexity: bf16 {bf16:.5f}, {quantization} (activations {activations}) {got:.5f} "
          f"({got / bf16 - 1:+.3%})")
    assert got / bf16 - 1 < BOUND[quantization]
    assert got != bf16  # the format really was used
