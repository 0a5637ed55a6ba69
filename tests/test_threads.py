"""The engine's compute threads: num_threads when given; else the process's own setting, lowered to one per
physical core."""

from __future__ import annotations

import os

import pytest
import torch

from deltaserve import LLM
from deltaserve.engine.threads import physical_cores
from tests.checkpoints import TINY, random_hf_model, save_causal_lm_layout


@pytest.fixture()
def keep_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_follow_the_option_else_physical_cores(tmp_path, keep_threads) -> None:
    path = save_causal_lm_layout(random_hf_model(TINY, seed=1), tmp_path)
    cores = physical_cores()
    assert 1 <= cores <= os.cpu_count()
    LLM(model=str(path), num_threads=1, max_model_len=64)
    assert torch.get_num_threads() == 1  # asked for
    LLM(model=str(path), max_model_len=64)
    assert torch.get_num_threads() == 1  # the process's own setting stays when it is within the cores
    torch.set_num_threads(4 * cores)
    LLM(model=str(path), max_model_len=64)
    assert torch.get_num_threads() == cores  # more threads than cores is lowered to the cores
