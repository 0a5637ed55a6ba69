"""The tool-use training data (scripts/corpus/gen_tools.py) against the real pieces it must agree with: the demo's
chat template (deltaserve.tokenizer) and the server's qwen3_coder tool parser and reasoning split."""

from __future__ import annotations

import json
import random

import pytest

from deltaserve.assets import DEMO_DIR
from deltaserve.serve.reasoning import split_reasoning
from deltaserve.serve.tool_parsers import Qwen3CoderToolParser, extract_tool_calls, tool_schemas
from deltaserve.tokenizer import Tokenizer
from scripts.corpus import gen_tools

SEEDS = range(300)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(DEMO_DIR)


def _examples(split: str = "train", n: int = len(SEEDS)) -> list[gen_tools.ToolExample]:
    return [gen_tools.sample(random.Random(seed), split) for seed in range(n)]


def _typed(value: object) -> object:
    """A value with its JSON type kept visible (1 and 1.0 and True compare equal in Python)."""
    return json.dumps(value)


def test_segments_concatenate_to_the_template_render(tok: Tokenizer) -> None:
    for ex in _examples():
        segments = gen_tools.training_segments(ex, tok)
        full = tok.apply_chat_template(ex.messages, add_generation_prompt=False, tools=ex.tools,
                                       enable_thinking=ex.enable_thinking)
        assert "".join(t for t, _ in segments) == full
        outputs = [t for t, is_output in segments if is_output]
        assert len(outputs) == sum(m["role"] == "assistant" for m in ex.messages)
        assert all(t.endswith("<|im_end|>") and t.count("<|im_end|>") == 1 for t in outputs)
        assert all("<|im_start|>" not in t for t in outputs)


def test_the_call_parses_back_into_the_expected_call(tok: Tokenizer) -> None:
    parser, kinds = Qwen3CoderToolParser(), set()
    for ex in _examples():
        _, output = gen_tools.first_turn_segments(ex, tok)
        text = output[0].removesuffix("<|im_end|>")
        reasoning, content = split_reasoning(text, ex.enable_thinking)
        assert (reasoning is not None) == ex.enable_thinking
        rest, calls = extract_tool_calls(parser, tool_schemas(ex.tools), content)
        kinds.add((ex.kind, ex.lang, ex.enable_thinking))
        if ex.kind == "no_call":
            assert calls == [] and rest == content and rest.strip()
            continue
        assert ex.expected_call is not None and rest == ""
        assert [(c.name, _typed(c.arguments)) for c in calls] == [
            (ex.expected_call["name"], _typed(ex.expected_call["arguments"]))
        ]
        assert ex.expected_call["name"] in {t["function"]["name"] for t in ex.tools}
    assert len(kinds) == 8  # both kinds, both languages, thinking on and off


def test_the_first_turn_is_what_inference_renders(tok: Tokenizer) -> None:
    """first_turn_segments' prompt is the engine's prompt; with thinking on (and for no_call) the full
    render continues it exactly; with thinking off a call turn is rendered without the empty think block."""
    for ex in _examples():
        (prompt, _), (output, _) = gen_tools.first_turn_segments(ex, tok)
        upto_question = ex.messages[: [m["role"] for m in ex.messages].index("user") + 1]
        assert prompt == tok.apply_chat_template(upto_question, add_generation_prompt=True, tools=ex.tools,
                                                 enable_thinking=ex.enable_thinking)
        full = "".join(t for t, _ in gen_tools.training_segments(ex, tok))
        if ex.enable_thinking or ex.kind == "no_call":
            assert full.startswith(prompt + output)
        else:
            assert full.startswith(prompt.removesuffix("<think>\n\n</think>\n\n") + output)


def test_results_are_right_and_the_answer_repeats_them(tok: Tokenizer) -> None:
    for ex in _examples():
        if ex.kind != "call":
            continue
        assert ex.expected_call is not None
        args = ex.expected_call["arguments"]
        result = json.loads(next(m["content"] for m in ex.messages if m["role"] == "tool"))
        name = ex.expected_call["name"]
        if name == "calculate":
            a, b = args["a"], args["b"]
            exact = {"add": a + b, "subtract": a - b, "multiply": a * b, "divide": a / b}[args["operation"]]
            assert result["result"] == pytest.approx(exact, abs=0.005)
        elif name == "convert_units":
            assert result["value"] == pytest.approx(gen_tools.convert(args["value"], args["from_unit"],
                                                                      args["to_unit"]), abs=0.005)
        elif name == "get_weather":
            assert (result["city"], result["unit"]) == (args["city"], args.get("unit", "celsius"))
        answer = ex.messages[-1]["content"]
        assert all(key in answer for key in gen_tools.answer_keys(ex)), (answer, gen_tools.answer_keys(ex))


def test_chinese_questions_name_the_city_in_chinese_and_call_it_in_english() -> None:
    zh_names = {zh: en for en, zh, _ in gen_tools.CITIES}
    seen = 0
    for ex in _examples():
        call = ex.expected_call
        if ex.lang == "zh" and call and "city" in call["arguments"]:
            q = gen_tools.question(ex)
            assert any(zh in q and zh_names[zh] == call["arguments"]["city"] for zh in zh_names), q
            seen += 1
    assert seen > 10


def test_heldout_questions_never_appear_in_train() -> None:
    train = {gen_tools.question(ex) for ex in _examples("train", 2000)}
    heldout = {gen_tools.question(ex) for ex in _examples("heldout", 300)}
    assert len(heldout) > 200 and not train & heldout
    with pytest.raises(ValueError, match="split"):
        gen_tools.sample(random.Random(0), "test")
    with pytest.raises(ValueError, match="max_tools"):
        gen_tools.sample(random.Random(0), "train", max_tools=5)


def test_max_tools_bounds_the_offered_specs() -> None:
    counts = {len(gen_tools.sample(random.Random(s), "train", max_tools=2).tools) for s in range(200)}
    assert counts == {1, 2}
    counts = {len(gen_tools.sample(random.Random(s), "train").tools) for s in range(400)}
    assert counts == {1, 2, 3, 4}


def test_eval_scores_the_training_answers_right_and_a_mistyped_argument_wrong(tok: Tokenizer) -> None:
    """scripts/eval_demo_tools.py's scoring, fed the outputs the training data teaches: every metric is 100%;
    a number written as a string, or a missing argument, is not the right call."""
    import scripts.eval_demo_tools as ev

    outcomes = []
    for ex in _examples("heldout", 60):
        _, (output, _) = gen_tools.first_turn_segments(ex, tok)
        _, content = split_reasoning(output.removesuffix("<|im_end|>"), ex.enable_thinking)
        _, calls = extract_tool_calls(Qwen3CoderToolParser(), tool_schemas(ex.tools), content)
        answer = ex.messages[-1]["content"] if ex.kind == "call" else None
        outcomes.append(ev.Outcome(ex, output, [{"name": c.name, "arguments": c.arguments} for c in calls], answer))
    summary = ev.summarize(outcomes)
    assert {m for row in summary.values() for m in row} == set(ev.METRICS)
    assert all(c["rate"] == 1.0 for row in summary.values() for c in row.values())
    assert summary["all"]["no_call_ok"]["n"] + summary["all"]["call_made"]["n"] == 60

    o = next(o for o in outcomes if o.example.kind == "call" and o.example.expected_call["name"] == "calculate")
    o.calls = [{"name": "calculate", "arguments": {**o.calls[0]["arguments"], "a": str(o.calls[0]["arguments"]["a"])}}]
    assert o.scores["right_name"] and not o.scores["right_args"]
    o.calls = [{"name": "calculate", "arguments": {"operation": "add", "a": 1}}]
    assert not o.scores["right_args"]
