"""Images under tensor parallelism (TP = 2, gloo, one worker process) on a small random vision checkpoint
(tests/vision_checkpoint.py): rank 0 runs the vision tower and sends each step's merged image tokens to the
worker with the step, every rank takes the [3, T] mRoPE positions; the greedy tokens equal one process's, for
two pictures of different sizes around text, an image mid-conversation, a batch that mixes image and text
requests with a step budget that cuts the images' chunks, and a repeated prompt through the prefix cache;
rank 0's weights (its text shard and the whole tower) are what `deltaserve plan --tp 2` counts.
Then `deltaserve serve --tensor-parallel-size 2` answers the `openai` client's data: URL picture as one
process does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.config import ModelConfig
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.engine.planner import plan_memory
from tests.server_process import ServerProcess, running_server
from tests.test_vision_engine import IMAGE, PICTURES, PROMPT, run
from tests.test_vision_server import NO_THINKING, QUESTION, ask, data_url, png_bytes
from tests.vision_checkpoint import random_hf_vision_model, save_vision_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# name -> (prompt ids, pictures): two pictures (15 and 7 merged tokens) around text, one picture, text only
CASES = {
    "two": (PROMPT, PICTURES),
    "one": ([7, *IMAGE, 8, 9], [PICTURES[1]]),
    "text": ([20, 21, 22, 23], []),
    "swapped": (PROMPT, [PICTURES[1], PICTURES[0]]),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_vision_checkpoint(random_hf_vision_model(seed=1), tmp_path_factory.mktemp("vision") / "ck")


@pytest.fixture(scope="module")
def alone(ckpt: Path) -> dict[str, list[int]]:
    """One process, each request alone and unchunked."""
    llm = LLM(str(ckpt), enable_prefix_caching=False)
    return {name: run(llm, [case], GREEDY)[0] for name, case in CASES.items()}


def test_tp2_gives_one_processs_tokens_for_images_chunked_and_batched(ckpt: Path, alone: dict) -> None:
    # A 6-token step budget cuts every image's tokens across chunks (the rest comes from the encoder cache);
    # 4 sequences at once batch image and text requests in the same steps.
    engine = LLMEngine(EngineConfig(model=str(ckpt), tensor_parallel_size=2, max_num_batched_tokens=6,
                                    max_num_seqs=4, block_size=4, mamba_block_size=8, enable_prefix_caching=True))
    try:
        assert engine.executor.name == "fused-cpu-tp" and engine.encoder_cache is not None
        # rank 0 holds the whole tower beside its text shard: what `deltaserve plan --tp 2` counts for it
        plan = plan_memory(ModelConfig.from_file(ckpt), 256, 4, tp=2, dtype="float32")
        weights = {p.data_ptr(): p.numel() * p.element_size() for p in engine.model.parameters()}  # tied once
        assert engine.model.visual is not None and sum(weights.values()) == plan.weight_bytes
        order = ["two", "text", "one", "swapped"]
        got, mixed = generate(engine, order)
        assert got == {name: alone[name] for name in order}
        assert mixed, "no step ran an image chunk beside another request"
        cache = engine.encoder_cache
        assert cache.num_encoded == 5 and not cache.outputs and not cache.prompts  # each picture once
        # the same prompt again reads its cached blocks, mid-image, and still gives the same tokens
        hits = engine.cache.prefix.stats.hits
        assert generate(engine, ["two"])[0] == {"two": alone["two"]}
        assert engine.cache.prefix.stats.hits > hits
    finally:
        engine.close()


def generate(engine: LLMEngine, names: list[str]) -> tuple[dict[str, list[int]], bool]:
    """The requests' greedy tokens, and whether a step ran an image's tokens beside another request."""
    for name in names:
        ids, pictures = CASES[name]
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": pictures}} if pictures else ids
        engine.add_request(name, prompt, GREEDY)
    out: dict[str, list[int]] = {}
    mixed = False
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
        scheduled = engine.last_schedule.scheduled
        mixed |= len(scheduled) > 1 and any(touches_image(s) for s in scheduled)
    return out, mixed


def touches_image(s) -> bool:
    """Whether a scheduled chunk runs any of its request's image tokens."""
    end = s.context_len + s.num_tokens
    return any(lo < end and s.context_len < hi for lo, hi, _ in s.request.image_spans)


@pytest.fixture(scope="module")
def server(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--tensor-parallel-size", "2", "--max-model-len", "256", "--max-num-seqs", "2"]
    with running_server(ckpt, args, tmp_path_factory.mktemp("log") / "server.log") as proc:
        yield proc


def test_openai_client_data_url_picture_under_tp2(server: ServerProcess, ckpt: Path) -> None:
    png = png_bytes(70, 40, 0)
    picture_url = data_url(png)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture_url}},
                                             {"type": "text", "text": QUESTION}]}]
    params = SamplingParams(max_tokens=6, temperature=0)
    offline = LLM(str(ckpt)).chat(messages, params, use_tqdm=False, **NO_THINKING)[0].outputs[0].text
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    assert ask(client, picture_url) == offline
