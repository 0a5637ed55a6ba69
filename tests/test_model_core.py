"""The model core against transformers' Qwen3_5ForCausalLM on small random checkpoints (fp32)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.cache.tensors import allocate_cache
from deltaserve.model.context import ForwardContext
from deltaserve.model.loader import load_model
from tests.checkpoints import (
    RATIOS_27B,
    TINY,
    random_hf_model,
    random_mtp_tensors,
    save_causal_lm_layout,
    save_official_layout,
    tied_odd_pattern_model,
)

TOL = 1e-4
BLOCK = 16


@pytest.fixture(scope="module", params=["tiny-official", "27b-ratios-causal-lm", "tied-odd-pattern"])
def pair(request, tmp_path_factory):
    """(transformers model, deltaserve model) with the same weights, in different layouts and shapes."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "tiny-official":
        hf = random_hf_model(TINY, seed=0)
        save_official_layout(hf, path, random_mtp_tensors(TINY))
    elif request.param == "27b-ratios-causal-lm":
        hf = random_hf_model(RATIOS_27B, seed=1)
        save_causal_lm_layout(hf, path)
    else:
        hf = tied_odd_pattern_model(seed=2)
        save_causal_lm_layout(hf, path)
    return hf, load_model(path, dtype="float32")


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


class PagedSequence:
    """One sequence's cache bookkeeping for driving the model directly: contiguous blocks, one slot."""

    def __init__(self, first_block: int, slot: int, max_len: int = 512) -> None:
        self.blocks = list(range(first_block, first_block + max_len // BLOCK))
        self.slot = slot
        self.cached = 0


def run_chunks(model, cache, seq: PagedSequence, ids: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    outs, pos = [], 0
    for n in sizes:
        ctx = ForwardContext.paged(cache, [n], [seq.cached], [seq.blocks], [seq.slot])
        with torch.no_grad():
            outs.append(model.compute_logits(model(ids[pos : pos + n], ctx)))
        pos += n
        seq.cached += n
    return torch.cat(outs)


def new_cache(model, slots: int = 4):
    return allocate_cache(model.config, num_blocks=slots * 512 // BLOCK, block_size=BLOCK, num_slots=slots,
                          with_mtp=model.mtp is not None)


def stateless_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, ForwardContext.stateless([len(ids)])))


def assert_prompt_matches(hf, ours, ids: torch.Tensor, tol: float = TOL) -> None:
    """The whole prompt's logits, stateless and through the paged cache in one chunk, equal transformers'."""
    ref = hf_logits(hf, ids)
    paged = run_chunks(ours, new_cache(ours), PagedSequence(0, 1), ids, [len(ids)])
    assert (stateless_logits(ours, ids) - ref).abs().max() < tol
    assert (paged - ref).abs().max() < tol


def test_full_prompt_matches_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    assert_prompt_matches(hf, ours, ids)


def test_uneven_chunks_match_full_prompt(pair):
    hf, ours = pair
    ids = torch.randint(0, hf.config.vocab_size, (150,), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(hf, ids)
    got = run_chunks(ours, new_cache(ours), PagedSequence(0, 3), ids, [7, 1, 64, 50, 2, 26])
    assert (got - ref).abs().max() < TOL


@pytest.mark.parametrize("length", [1, 63, 64, 65, 130])
def test_prompt_lengths_around_chunk_boundaries(pair, length):
    hf, ours = pair
    ids = torch.randint(0, hf.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    ref = hf_logits(hf, ids)
    got = run_chunks(ours, new_cache(ours), PagedSequence(0, 0), ids, [length])
    assert (got - ref).abs().max() < TOL


def test_prefill_then_30_decode_steps(pair):
    hf, ours = pair
    ids = torch.randint(0, hf.config.vocab_size, (50,), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(hf, ids)
    got = run_chunks(ours, new_cache(ours), PagedSequence(0, 2), ids, [20] + [1] * 30)
    assert (got - ref).abs().max() < TOL


def test_three_sequences_in_one_flat_forward(pair):
    """Fresh prompt, continued prompt chunk and single decode token mixed in ONE forward == each alone."""
    hf, ours = pair
    gen = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(0, hf.config.vocab_size, (n,), generator=gen) for n in (37, 70, 12))
    refs = [hf_logits(hf, x) for x in (a, b, c)]
    cache = new_cache(ours)
    seqs = [PagedSequence(0, 2), PagedSequence(32, 0), PagedSequence(64, 3)]
    # b and c have history; a is fresh. Its slot (2) is dirty on purpose: a fresh sequence must ignore it.
    run_chunks(ours, cache, seqs[0], c, [12])
    seqs[0] = PagedSequence(96, 2)
    run_chunks(ours, cache, seqs[1], b, [30])
    run_chunks(ours, cache, seqs[2], c, [11])
    ctx = ForwardContext.paged(
        cache, [37, 40, 1], [0, 30, 11], [s.blocks for s in seqs], [s.slot for s in seqs]
    )
    flat = torch.cat([a, b[30:], c[11:]])
    with torch.no_grad():
        logits = ours.compute_logits(ours(flat, ctx))
    assert (logits[:37] - refs[0]).abs().max() < TOL
    assert (logits[37:77] - refs[1][30:]).abs().max() < TOL
    assert (logits[77:] - refs[2][11:]).abs().max() < TOL


def test_logits_only_at_requested_rows(pair):
    hf, ours = pair
    ids = torch.randint(0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = ours(ids, ForwardContext.stateless([20]))
        rows = ours.compute_logits(hidden, [3, 19])
    assert rows.shape == (2, hf.config.vocab_size)
    assert (rows - hf_logits(hf, ids)[[3, 19]]).abs().max() < TOL


def test_greedy_64_token_continuation_equals_transformers_generate(pair):
    hf, ours = pair
    prompt = torch.randint(0, hf.config.vocab_size, (9,), generator=torch.Generator().manual_seed(5))
    hf.generation_config.eos_token_id = None  # run all 64 steps without masking any token
    with torch.no_grad():
        expected = hf.generate(prompt[None], max_new_tokens=64, do_sample=False, pad_token_id=0)[0, 9:].tolist()
    cache, seq = new_cache(ours), PagedSequence(0, 1)
    logits = run_chunks(ours, cache, seq, prompt, [9])[-1]
    got = []
    for _ in range(64):
        token = int(logits.argmax())
        got.append(token)
        logits = run_chunks(ours, cache, seq, torch.tensor([token]), [1])[-1]
    assert got == expected
