"""The tool-tuned demo calls tools: the real server on the embedded demo checkpoint, the official `openai` client,
tool_choice "auto", greedy. A weather question gets a get_weather call with the city (its English name, as
scripts/corpus/gen_tools.py trains it); given the tool's result the answer repeats the temperature; streamed
and non-streamed calls are the same call."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from scripts.corpus.gen_tools import TOOLS
from tests.server_process import ServerProcess

WEATHER = TOOLS["get_weather"]
QUESTIONS = [("What's the weather like in Paris?", "en"), ("巴黎天气怎么样？", "zh")]
RESULT = {"city": "Paris", "temperature": 18, "unit": "celsius", "condition": "sunny"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--served-model-name", "demo", "--max-model-len", "2048", "--enable-auto-tool-choice"]
    with ServerProcess(None, args, tmp_path_factory.mktemp("log") / "server.log").running() as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _ask(client: openai.OpenAI, messages: list[dict], **kw: object) -> object:
    return client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER], tool_choice="auto",
                                          temperature=0, max_tokens=200, **kw)


@pytest.mark.parametrize(("question", "lang"), QUESTIONS)
def test_weather_question_calls_get_weather_and_answers_from_the_result(
        client: openai.OpenAI, question: str, lang: str) -> None:
    messages = [{"role": "user", "content": question}]
    r = _ask(client, messages)
    choice = r.choices[0]
    wrote = (getattr(choice.message, "reasoning_content", None), choice.message.content)
    assert choice.message.tool_calls, f"no call made; the model wrote (reasoning, content) {wrote!r}"
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)  # the city itself: the next test

    # The conversation continues as a client sends it: the assistant message it got back, then the result.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps(RESULT)}]
    answer = _ask(client, messages).choices[0]
    assert not answer.message.tool_calls and answer.finish_reason == "stop"
    assert "18" in answer.message.content, answer.message.content


# The city argument is the English name of the city the question names, in either language: right for 91% of
# held-out weather questions (deltaserve/assets/demo/README.md; the third fine-tune run's city drill).
@pytest.mark.parametrize(("question", "lang"), QUESTIONS)
def test_the_call_names_the_city_of_the_question(client: openai.OpenAI, question: str, lang: str) -> None:
    [call] = _ask(client, [{"role": "user", "content": question}]).choices[0].message.tool_calls
    assert json.loads(call.function.arguments)["city"] == "Paris"


@pytest.mark.parametrize(("question", "lang"), QUESTIONS)
def test_streamed_call_equals_the_non_streamed_one(client: openai.OpenAI, question: str, lang: str) -> None:
    messages = [{"role": "user", "content": question}]
    whole = _ask(client, messages).choices[0].message
    assert whole.tool_calls, f"no call made; the model wrote {whole.content!r}"
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in _ask(client, messages, stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += d.id or ""
            c["name"] += (d.function and d.function.name) or ""
            c["arguments"] += (d.function and d.function.arguments) or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in whole.tool_calls]
