"""The engine on quantized weights: greedy tokens equal those of the same model with its weights replaced by
their dequantized values (the format's reference), for every format, with MTP speculation too."""

from __future__ import annotations

import pytest
import torch

from deltaserve.assets import demo_checkpoint_path
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.model.linear import StoredWeights
from deltaserve.model.loader import load_model
from tests.test_tensor_parallel import greedy  # three prompts, the longest chunked
from tests.test_weight_storage import _bf16_checkpoint

OPTIONS = dict(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=16)  # prompts run in chunks


def dequantized_reference(model) -> torch.nn.Module:
    """The demo in fp32 with each stored weight set to the values `model` stores for it."""
    ref = load_model(demo_checkpoint_path(), dtype="float32", with_mtp=model.mtp is not None)
    ref_modules = dict(ref.named_modules())
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, StoredWeights):
                for attr in m.WEIGHTS:
                    getattr(ref_modules[name], attr).copy_(m.weight_values(attr))
    return ref


@pytest.mark.parametrize("quantization, k", [("int8", 0), ("int4", 0), ("fp8", 0), ("int8", 2)])
def test_greedy_tokens_equal_the_dequantized_reference(quantization, k):
    """activation_quantization "none": the quantized weights' values, multiplied by the float rows."""
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    engine = LLMEngine(EngineConfig(quantization=quantization, speculative_config=spec, activation_quantization="none",
                                    **OPTIONS))
    assert quantization in engine.model.weight_formats()
    ref = LLMEngine(EngineConfig(dtype="float32", speculative_config=spec, **OPTIONS),
                    model=dequantized_reference(engine.model))
    assert greedy(engine) == greedy(ref)


@pytest.mark.parametrize("quantization, k", [("int8", 0), ("int4", 0), ("int8", 2), ("int4", 2)])
def test_int8_activations_give_the_torch_executors_greedy_tokens(quantization, k):
    """activation_quantization "int8" (the default for int8 / int4 weights): the fused step's integer kernel
    and the Python model's Linear / Experts compute the same scheme (deltaserve/ops/activation_quant.py), so
    the two executors give the same greedy tokens; and they are not the float rows' tokens everywhere."""
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    fused = LLMEngine(EngineConfig(quantization=quantization, speculative_config=spec, **OPTIONS))
    assert fused.config.activation_quantization == "int8" and fused.executor.name == "fused-cpu"
    eager = LLMEngine(EngineConfig(quantization=quantization, speculative_config=spec, enforce_eager=True,
                                   **OPTIONS))
    assert eager.executor.name != "fused-cpu"
    assert greedy(fused) == greedy(eager)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_tied_head_with_int8_activations_runs_fused(tmp_path, quantization):
    """A tied checkpoint (the 0.8B's layout): the embedding is the int8 / int4 head's weight, a lookup that
    reads no activations; the fused step once refused it as a second activation_quantization setting."""
    path = _bf16_checkpoint(tmp_path, tie=True)
    options = dict(model=str(path), quantization=quantization, **OPTIONS)
    fused = LLMEngine(EngineConfig(**options))
    assert fused.executor.name == "fused-cpu" and fused.config.activation_quantization == "int8"
    assert greedy(fused) == greedy(LLMEngine(EngineConfig(enforce_eager=True, **options)))

