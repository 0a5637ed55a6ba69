"""make_executor, the one place that chooses how steps run, and the two executors behind one interface."""

from __future__ import annotations

import logging

import pytest
import torch

from deltaserve.cache.tensors import allocate_cache
from deltaserve.executor import Executor, TorchExecutor, make_executor
from deltaserve.model.context import ForwardContext
from deltaserve.model.loader import load_model
from tests.checkpoints import TINY, random_hf_model, save_causal_lm_layout


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_causal_lm_layout(random_hf_model(TINY, seed=4), tmp_path_factory.mktemp("executor"))


def build(checkpoint, dtype: str, caplog, **kwargs) -> Executor:
    model = load_model(checkpoint, dtype=dtype)
    cache = allocate_cache(model.config, num_blocks=8, block_size=16, num_slots=2, dtype=model.lm_head.weight.dtype)
    with caplog.at_level(logging.INFO, logger="deltaserve.executor.factory"):
        return make_executor(model, cache, **kwargs)


@pytest.mark.parametrize(
    ("dtype", "kwargs", "name", "why"),
    [
        ("float32", {}, "fused-cpu", "executor: fused-cpu"),
        ("float32", {"enforce_eager": True}, "torch", "executor: torch (enforce_eager)"),
        ("bfloat16", {}, "torch", "executor: torch, since the cache is not float32"),
    ],
)
def test_the_factory_logs_which_executor_and_why(checkpoint, caplog, dtype, kwargs, name, why) -> None:
    executor = build(checkpoint, dtype, caplog, **kwargs)
    assert executor.name == name
    assert why in caplog.text


def test_both_executors_give_the_same_step(checkpoint) -> None:
    """A prompt chunk and the decode after it through each executor's interface: hidden rows, chosen output
    rows, logits and greedy tokens agree."""
    model = load_model(checkpoint, dtype="float32")

    def cache():
        return allocate_cache(model.config, num_blocks=8, block_size=16, num_slots=1)

    fused_cache, ref_cache = cache(), cache()
    executors = [(make_executor(model, fused_cache), fused_cache), (TorchExecutor(model, ref_cache), ref_cache)]
    assert executors[0][0].name == "fused-cpu"
    results = []
    for executor, kv in executors:
        with torch.inference_mode():
            hidden = executor.forward(torch.arange(3, 23), ForwardContext.paged(kv, [20], [0], [[0, 1]], [0]))
            decode = ForwardContext.paged(kv, [1], [20], [[0, 1]], [0])
            last = executor.forward(torch.tensor([5]), decode, torch.tensor([0]))
            results.append((hidden, executor.compute_logits(hidden, [4, 19]), executor.greedy_tokens(last)))
    (h1, l1, g1), (h2, l2, g2) = results
    torch.testing.assert_close(h1, h2, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(l1, l2, atol=2e-5, rtol=1e-4)
    assert torch.equal(g1, g2)
