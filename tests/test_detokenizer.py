"""Incremental detokenization (multi-byte characters split across byte-level tokens) and stop checks."""

from __future__ import annotations

import pytest

from deltaserve.engine.detokenizer import IncrementalDetokenizer, StopResult, check_stop, stop_holdback
from deltaserve.sampling import SamplingParams
from deltaserve.tokenizer import Tokenizer
from tests.tiny_tokenizer import build_tiny_tokenizer

# Characters absent from the training text, so each is spelled as several byte tokens.
CHINESE = "你好，世界！鲸鱼在大海里游泳。我们测试增量解码器。"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, skip: bool = True):
    detok = IncrementalDetokenizer(tok, prompt or [], skip_special_tokens=skip)
    deltas = [detok.add(t) for t in ids]
    return detok, deltas


def test_chinese_split_across_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(CHINESE)
    # the premise: some tokens are partial UTF-8 sequences on their own
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert len(ids) > len(CHINESE)
    detok, deltas = _stream(tok, ids, prompt=tok.encode("Say hello: "))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == CHINESE == detok.text == tok.decode(ids)
    assert "" in deltas  # something was held back until its character completed


def test_mixed_text_with_special_tokens(tok: Tokenizer) -> None:
    text = "Hello 鲸鱼 world"
    ids = tok.encode(text) + [tok.token_to_id("<|im_end|>")]
    detok, deltas = _stream(tok, ids)
    assert detok.text == text and deltas[-1] == ""
    detok, deltas = _stream(tok, ids, skip=False)
    assert detok.text == text + "<|im_end|>" and deltas[-1] == "<|im_end|>"


def test_prompt_ending_mid_character(tok: Tokenizer) -> None:
    ids = tok.encode("鲸鱼")
    cut = 1  # the prompt ends one byte token into a 3-byte character
    detok, deltas = _stream(tok, ids[cut:], prompt=tok.encode("hi ") + ids[:cut])
    assert all("\ufffd" not in d for d in deltas)
    assert detok.text.endswith("鱼")


def test_flush_emits_incomplete_bytes(tok: Tokenizer) -> None:
    ids = tok.encode("鲸")
    assert len(ids) > 1
    detok, deltas = _stream(tok, ids[:-1])
    assert detok.text == ""
    assert detok.flush() == tok.decode(ids[:-1])


# ---- check_stop ---------------------------------------------------------------------------------------
def _run(tok: Tokenizer, ids: list[int], params: SamplingParams, eos: list[int]) -> tuple[StopResult, int]:
    """Drives detokenizer + check_stop as the engine does; returns the final result and tokens used."""
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=params.skip_special_tokens)
    result = StopResult(None, None, "")
    for n, t in enumerate(ids, start=1):
        delta = detok.add(t)
        result = check_stop(detok.text, len(delta), t, n, params, eos)
        if result.finished:
            return result, n
    return result, len(ids)


def test_stop_string_spanning_tokens(tok: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    stop = "own fox ju"
    # the stop string covers several tokens, none of which contains it alone
    assert not any(stop in tok.decode([i]) for i in ids)
    res, used = _run(tok, ids, SamplingParams(stop=[stop], max_tokens=100), [])
    assert res.finish_reason == "stop" and res.stop_reason == stop
    assert res.text == "The quick br" and used < len(ids)
    res, _ = _run(tok, ids, SamplingParams(stop=stop, include_stop_str_in_output=True, max_tokens=100), [])
    assert res.text == "The quick brown fox ju"


def test_stop_string_chinese(tok: Tokenizer) -> None:
    ids = tok.encode(CHINESE)
    res, _ = _run(tok, ids, SamplingParams(stop=["大海"], max_tokens=100), [])
    assert res.text == "你好，世界！鲸鱼在" and res.stop_reason == "大海"


def test_earliest_stop_string_wins() -> None:
    p = SamplingParams(stop=["zz", "b"], max_tokens=100)
    res = check_stop("aazzb", 3, 5, 3, p, [])
    assert res.text == "aa" and res.stop_reason == "zz"


def test_stop_string_only_searched_near_new_text() -> None:
    # "stop" lies entirely before the window (an earlier step would have caught it); it must not re-fire
    p = SamplingParams(stop=["stop"], max_tokens=100)
    assert check_stop("stop......xy", 2, 5, 9, p, []).finish_reason is None
    assert check_stop("......stxy", 2, 5, 9, p, []).finish_reason is None
    assert check_stop("......sto", 1, 5, 9, p, []).finish_reason is None
    assert check_stop("......stop", 1, 5, 9, p, []).text == "......"


def test_eos(tok: Tokenizer) -> None:
    eos = tok.token_to_id("<|im_end|>")
    ids = tok.encode("Hello world") + [eos] + tok.encode(" more")
    res, used = _run(tok, ids, SamplingParams(max_tokens=100), [eos])
    assert (res.finish_reason, res.stop_reason, res.text) == ("stop", None, "Hello world")
    assert used == len(tok.encode("Hello world")) + 1
    # EOS text stays out even when special tokens are rendered
    res, _ = _run(tok, ids, SamplingParams(max_tokens=100, skip_special_tokens=False), [eos])
    assert res.text == "Hello world"
    res, used = _run(tok, ids, SamplingParams(max_tokens=100, ignore_eos=True), [eos])
    assert res.finish_reason is None and used == len(ids)


def test_stop_token_ids(tok: Tokenizer) -> None:
    think_end = tok.token_to_id("</think>")
    ids = tok.encode("Hello") + [think_end] + tok.encode(" world")
    res, used = _run(tok, ids, SamplingParams(stop_token_ids=[think_end], skip_special_tokens=False), [])
    assert (res.finish_reason, res.stop_reason, res.text) == ("stop", think_end, "Hello")
    res, _ = _run(tok, ids, SamplingParams(stop_token_ids=[think_end], skip_special_tokens=False,
                                           include_stop_str_in_output=True), [])
    assert res.text == "Hello</think>"


def test_min_tokens_delays_every_stop() -> None:
    p = SamplingParams(min_tokens=3, stop=["x"], stop_token_ids=[9], max_tokens=10)
    assert not check_stop("ax", 1, 1, 2, p, [1]).finished  # EOS before min_tokens
    assert not check_stop("ax", 1, 9, 2, p, [1]).finished  # stop token before min_tokens
    assert not check_stop("ax", 1, 4, 2, p, [1]).finished  # stop string before min_tokens
    assert check_stop("axx", 1, 1, 3, p, [1]).finish_reason == "stop"
    assert check_stop("aax", 1, 4, 3, p, [1]).stop_reason == "x"


def test_max_tokens_length(tok: Tokenizer) -> None:
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    res, used = _run(tok, ids, SamplingParams(max_tokens=3), [])
    assert res.finish_reason == "length" and res.stop_reason is None and used == 3
    assert res.text == tok.decode(ids[:3])


def test_stop_holdback() -> None:
    assert stop_holdback(SamplingParams(stop=["abc", "de"])) == 2
    assert stop_holdback(SamplingParams(stop=["abc"], include_stop_str_in_output=True)) == 0
    assert stop_holdback(SamplingParams()) == 0
