"""The LLM / LLMEngine surface: user errors are specific, text prompts and chat go through the tokenizer,
stop conditions end requests, and the `generate` CLI prints the completion."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.assets import DEMO_DIR
from deltaserve.cli import main as cli_main
from deltaserve.config import UnsupportedFeatureError
from deltaserve.engine.config import EngineConfig, EngineConfigError
from tests.checkpoints import TINY, random_hf_model, save_official_layout

HAS_TOKENIZER = (DEMO_DIR / "tokenizer.json").exists()


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_official_layout(random_hf_model(TINY, seed=2), tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def text_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random model whose vocabulary is the demo tokenizer's, with that tokenizer beside it."""
    if not HAS_TOKENIZER:
        pytest.skip("the demo tokenizer is not in deltaserve/assets/demo yet")
    from deltaserve.tokenizer import Tokenizer

    vocab = Tokenizer.from_dir(DEMO_DIR).vocab_size
    d = save_official_layout(
        random_hf_model(dict(TINY, vocab_size=vocab), seed=4), tmp_path_factory.mktemp("t")
    )
    for f in DEMO_DIR.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, d / f.name)
    return d


def test_prompt_longer_than_max_model_len_names_both_lengths(path: Path) -> None:
    llm = LLM(model=str(path), max_model_len=32)
    with pytest.raises(ValueError, match=r"40 tokens.*max_model_len=32"):
        llm.generate({"prompt_token_ids": list(range(2, 42))}, use_tqdm=False)
    assert llm.engine.cache.usage().used_blocks == 0 and not llm.engine.scheduler.waiting
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="token id 500"):
        llm.generate({"prompt_token_ids": [3, 500]}, use_tqdm=False)


def test_generation_stops_at_max_model_len(path: Path) -> None:
    llm = LLM(model=str(path), max_model_len=32)
    out = llm.generate(
        {"prompt_token_ids": list(range(2, 30))},
        SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_stop_token_ids_and_eos(path: Path) -> None:
    llm = LLM(model=str(path))
    prompt = {"prompt_token_ids": [4, 9, 20, 33]}
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    ids = free[0].outputs[0].token_ids
    stop_at = ids[5]
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == ids[: ids.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(enable_prefix_caching=True, mamba_cache_mode="all"), UnsupportedFeatureError,
         "please use '--mamba-cache-mode=align' instead"),
        (dict(mamba_cache_mode="align", enable_prefix_caching=False), EngineConfigError,
         "drop enable_prefix_caching=False or mamba_cache_mode"),
        (dict(mamba_cache_mode="some"), EngineConfigError, "mamba_cache_mode 'some' is not known"),
        (dict(enable_prefix_caching=True, mamba_block_size=40), EngineConfigError,
         "mamba_block_size=40 must be a multiple of block_size=16"),
        (
            dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
            EngineConfigError,
            "speculative_config.method 'ngram'",
        ),
        (dict(tensor_parallel_size=0), EngineConfigError, "tensor_parallel_size must be a positive integer"),
        (dict(kv_cache_dtype="fp8_e5m2"), EngineConfigError, "kv_cache_dtype 'fp8_e5m2'"),
        (dict(max_num_seqs=0), EngineConfigError, "max_num_seqs"),
    ],
)
def test_engine_config_rejects_unsupported_options(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        EngineConfig(**kwargs)


def test_cache_too_small_for_one_sequence_is_a_config_error(path: Path) -> None:
    with pytest.raises(EngineConfigError, match="max_model_len=256 needs 16"):
        LLM(model=str(path), max_model_len=256, num_kv_blocks=4)


def test_text_prompts_chat_and_stop_strings(text_path: Path) -> None:
    llm = LLM(model=str(text_path), max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate(["Hello there", "Once upon a time"], params, use_tqdm=False)
    tok = llm.get_tokenizer()
    for o in out:
        c = o.outputs[0]
        assert o.prompt is not None and o.prompt_token_ids == tok.encode(o.prompt)
        assert c.text == tok.decode(c.token_ids)
    text = out[0].outputs[0].text
    if len(text) > 3:  # stop on a string taken from the middle of the free-running output
        stop = text[2:4]
        cut = llm.generate(
            "Hello there",
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
            use_tqdm=False,
        )[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop and stop not in cut.text
        assert text.startswith(cut.text)
    chat = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)
    assert len(chat) == 1 and len(chat[0].outputs[0].token_ids) == 12
    assert chat[0].prompt == tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True
    )


def test_cli_generate_prints_text(text_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(
        ["generate", "--model", str(text_path), "--prompt", "Hello", "--max-tokens", "6", "--ignore-eos"]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    llm = LLM(model=str(text_path))
    want = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert printed == want[0].outputs[0].text + "\n"


def test_cli_reports_user_errors_in_one_line(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["generate", "--model", str(path), "--prompt", "x", "--tensor-parallel-size", "3"])
    assert rc == 2 and "tensor parallel size 3 must be a multiple of num_key_value_heads (2)" in capsys.readouterr().err


def test_request_ids_of_live_sequences_cannot_collide(path: Path) -> None:
    """n > 1 names its sequences "<id>#<i>": a live request already called "a#0" must make "a" with n=2
    an error, or both sequences would share one block table and state slot."""
    engine = LLM(model=str(path), max_model_len=64).engine
    engine.add_request("a#0", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="'a#0' is already in use"):
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, n=2))
    engine.abort_request("a#0")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.cache.usage().used_blocks == 0


def test_finished_only_steps_report_just_the_finished_requests(path: Path) -> None:
    """LLM.generate asks step() for finished requests only; what they report equals the streamed last output."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9)]
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    last: dict[str, object] = {}
    finals: dict[str, object] = {}
    for finished_only, seen in ((False, last), (True, finals)):
        llm = LLM(model=str(path))
        for i, (p, sp) in enumerate(zip(prompts, params)):
            llm.engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step(finished_only=finished_only):
                assert out.finished or not finished_only
                seen[out.request_id] = out
    assert all(o.finished for o in last.values())
    for rid, out in finals.items():
        assert out.outputs[0].token_ids == last[rid].outputs[0].token_ids
        assert out.outputs[0].text == last[rid].outputs[0].text
    assert sorted(finals) == ["r0", "r1"]

