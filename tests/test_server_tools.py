"""Tool calling, structured outputs and /v1/responses end to end: a real `deltaserve serve` (random tiny
model, the demo tokenizer and its Qwen3.5 chat template) driven by the official `openai` client. A random model writes
noise, so these check what constrained decoding guarantees: every forced call parses and its arguments
validate against the tool's schema, every json_schema answer validates, whatever the seed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from deltaserve.assets import DEMO_DIR
from tests.server_process import ServerProcess, text_checkpoint

pytestmark = pytest.mark.skipif(
    not (DEMO_DIR / "tokenizer.json").exists(), reason="the demo tokenizer is not in the package yet"
)

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# Bounded values, so a random model's output ends inside max_tokens: the grammar forces it to.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "detail": {"type": "boolean"},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -99, "maximum": 99},
                "b": {"type": "number", "minimum": 0, "maximum": 9},
                "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 2},
            },
            "required": ["a", "b"],
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    ckpt = text_checkpoint(tmp_path_factory.mktemp("ckpt"))
    # The random model's EOS (1) is `"` in the demo vocabulary: make it the tokenizer's, as in a real checkpoint.
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["eos_token_id"] = 8176
    (ckpt / "config.json").write_text(json.dumps(cfg))
    args = ["--served-model-name", "tiny", "--max-model-len", "1024", "--max-num-seqs", "16",
            "--enable-auto-tool-choice"]
    with ServerProcess(ckpt, args, tmp_path_factory.mktemp("log") / "server.log").running() as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _check_call(call: object) -> None:
    fn = call.function  # type: ignore[attr-defined]
    assert call.type == "function" and call.id  # type: ignore[attr-defined]
    jsonschema.validate(json.loads(fn.arguments), SCHEMAS[fn.name])


@pytest.mark.parametrize("seed", range(8))
def test_required_calls_always_parse_and_validate(client: openai.OpenAI, seed: int) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=USER, tools=[WEATHER, ADD], tool_choice="required", max_tokens=200,
        temperature=1.0, seed=seed, extra_body=NO_THINK, parallel_tool_calls=False,  # one call: it must end
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call)


def _tool(name: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties, "required": list(properties)}}}


def _strict(tool: dict) -> dict:
    return {"type": "function", "function": {**tool["function"], "strict": True}}


@pytest.mark.parametrize("seed", range(4))
def test_auto_calls_of_strict_functions_always_validate(client: openai.OpenAI, seed: int) -> None:
    """tool_choice auto with `"strict": true`: the model opens a call (forced by logit_bias, as in
    test_auto_with_a_broken_call_keeps_it_as_text, where the same noise stays text) and the grammar makes it
    a valid call."""
    r = client.chat.completions.create(
        model="tiny", messages=USER, tools=[_strict(WEATHER), _strict(ADD)], tool_choice="auto", max_tokens=200,
        temperature=1.0, seed=seed, logit_bias={"8188": 100}, extra_body=NO_THINK, parallel_tool_calls=False,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    _check_call(call)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("opens_a_call", [False, True])
def test_auto_with_strict_functions_and_a_json_schema_answers_or_calls(
        client: openai.OpenAI, seed: int, opens_a_call: bool) -> None:
    """Strict tools beside response_format (as the Agents SDK sends an agent's output type): the output is an
    answer valid for the schema, or valid calls; a model that opens a call (logit_bias) gets to make it."""
    r = client.chat.completions.create(
        model="tiny", messages=USER, tools=[_strict(WEATHER)], tool_choice="auto", max_tokens=200,
        temperature=1.0, seed=seed, extra_body=NO_THINK, logit_bias={"8188": 100} if opens_a_call else None,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}},
    )
    message = r.choices[0].message
    assert message.tool_calls or not opens_a_call, message
    for call in message.tool_calls or []:
        _check_call(call)
    if not message.tool_calls:
        jsonschema.validate(json.loads(message.content), PERSON)


def test_responses_strict_function_is_enforced(client: openai.OpenAI) -> None:
    """/v1/responses passes a function's strict on: a strict function whose schema cannot be enforced is a
    400 there too (without strict it is served unchecked)."""
    tool = {"type": "function", "name": "book", "parameters": {
        "type": "object", "properties": {"ref": {"type": "string", "format": "iri"}}, "required": ["ref"]}}
    kw = dict(model="tiny", input="Book it.", max_output_tokens=4, reasoning={"effort": "none"})
    assert client.responses.create(tools=[{**tool, "strict": False}], **kw).status == "incomplete"
    with pytest.raises(openai.BadRequestError, match="string format 'iri' is not supported"):
        client.responses.create(tools=[{**tool, "strict": True}], **kw)


BOOK = _tool("book", {"day": {"type": "string", "format": "date"}, "host": {"type": "string", "format": "ipv4"},
                      "ref": {"type": "string", "format": "uuid"}, "at": {"type": "string", "format": "time"}})


@pytest.mark.parametrize("seed", range(4))
def test_required_call_string_formats_hold(client: openai.OpenAI, seed: int) -> None:
    """qwen3_coder writes strings raw: the call grammar enforces their formats itself."""
    import datetime
    import ipaddress
    import uuid

    r = client.chat.completions.create(model="tiny", messages=USER, tools=[BOOK], tool_choice="required",
                                       max_tokens=200, temperature=1.0, seed=seed, extra_body=NO_THINK,
                                       parallel_tool_calls=False)
    args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    datetime.date.fromisoformat(args["day"])
    ipaddress.IPv4Address(args["host"])
    uuid.UUID(args["ref"])
    datetime.time.fromisoformat(args["at"])


@pytest.mark.parametrize("seed", range(3))
def test_parallel_required_calls_each_validate(client: openai.OpenAI, seed: int) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=USER, tools=[WEATHER, ADD], tool_choice="required", max_tokens=300,
        temperature=1.0, seed=seed, extra_body=NO_THINK, parallel_tool_calls=True,
    )
    calls = r.choices[0].message.tool_calls
    assert calls  # one or more; a call cut off by max_tokens stays text
    assert len({c.id for c in calls}) == len(calls)
    for call in calls:
        _check_call(call)


@pytest.mark.parametrize("seed", range(6))
def test_named_call_is_that_function(client: openai.OpenAI, seed: int) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=USER, tools=[WEATHER, ADD], max_tokens=200, temperature=1.0, seed=seed,
        tool_choice={"type": "function", "function": {"name": "add"}}, extra_body=NO_THINK,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "add"
    _check_call(calls[0])


def test_required_call_after_reasoning(client: openai.OpenAI) -> None:
    # thinking on: the reasoning is free (cut short here by the stop of the think block the grammar allows
    # at any point), then the call; it never lands in reasoning_content or content.
    r = client.chat.completions.create(
        model="tiny", messages=USER, tools=[ADD], tool_choice="required", max_tokens=300, temperature=0,
        logit_bias={"8191": 100},  # `</think>` at once, so the random model leaves its reasoning
    )
    m = r.choices[0].message
    assert m.tool_calls and m.tool_calls[0].function.name == "add"
    _check_call(m.tool_calls[0])
    assert not m.content


@pytest.mark.parametrize("seed", range(8))
def test_json_schema_outputs_validate(client: openai.OpenAI, seed: int) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=200, temperature=1.0, seed=seed, extra_body=NO_THINK,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_structured_outputs_field(client: openai.OpenAI) -> None:
    def ask(so: dict, endpoint: str = "chat") -> str:
        if endpoint == "chat":
            r = client.chat.completions.create(
                model="tiny", messages=USER, max_tokens=40, temperature=1.0, seed=1,
                extra_body={**NO_THINK, "structured_outputs": so},
            )
            return r.choices[0].message.content
        return client.completions.create(
            model="tiny", prompt="The answer:", max_tokens=40, temperature=1.0, seed=1,
            extra_body={"structured_outputs": so},
        ).choices[0].text

    assert ask({"choice": ["yes", "no", "maybe"]}) in ("yes", "no", "maybe")
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", ask({"regex": r"[0-9]{3}-[a-z]{2}"}, "completions"))
    assert ask({"grammar": 'start: "a" ("b" | "c") "d"'}) in ("abd", "acd")
    assert ask({"grammar": 'root ::= "x" [0-9]'})[0] == "x"
    legacy = client.chat.completions.create(  # vLLM's older field name
        model="tiny", messages=USER, max_tokens=10, extra_body={**NO_THINK, "guided_choice": ["left", "right"]},
    ).choices[0].message.content
    assert legacy in ("left", "right")
    obj = json.loads(ask({"json": {"type": "object", "properties": {"k": {"type": "boolean"}},
                                   "required": ["k"], "additionalProperties": False}}))
    assert isinstance(obj["k"], bool)


def test_invalid_schema_and_grammar_are_400(client: openai.OpenAI) -> None:
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
         "objectx"),
        ({"structured_outputs": {"regex": "(ab"}}, "unclosed group"),
        ({"structured_outputs": {"grammar": "start: foo"}}, "foo"),
        ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "exactly one"),
        ({"structured_outputs": {"xml": "b"}}, "structured_outputs.xml"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [_tool("book", {"ref": {"type": "string", "format": "iri"}})], "tool_choice": "required"},
         "tool 'book', parameter 'ref': string format 'iri' is not supported"),
        # strict under auto enforces the schema, so one it cannot enforce is refused, not ignored
        ({"tools": [_strict(_tool("book", {"ref": {"type": "string", "format": "iri"}}))], "tool_choice": "auto"},
         "tool 'book', parameter 'ref': string format 'iri' is not supported"),
        ({"tools": [{"type": "function", "function": {**WEATHER["function"], "strict": "yes"}}]},
         "tools[0].function.strict must be true or false"),
        ({"tools": [_strict(WEATHER)], "structured_outputs": {"regex": "a+"}},
         "strict tools with tool_choice auto combine with a JSON response_format only"),
    ]
    for extra, needle in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, extra_body=extra)
        assert needle in str(e.value), (extra, str(e.value))


def test_unknown_role_is_400_and_developer_is_system(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="robot"):
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}], max_tokens=2)
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "developer", "content": "Be terse."}, *USER], max_tokens=2,
    )
    assert r.choices[0].finish_reason == "length"


def _stream_calls(client: openai.OpenAI, **kwargs: object) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    headers = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    headers.append(d.index)
                    slot["id"], slot["name"] = d.id, d.function.name
                    assert d.type == "function" and d.function.arguments == ""
                else:
                    assert slot["id"] is not None, "argument fragments come after the call's header"
                    slot["arguments"] += d.function.arguments
    assert headers == sorted(calls)
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_equal_non_streamed(client: openai.OpenAI, choice: object) -> None:
    kwargs = dict(model="tiny", messages=USER, tools=[WEATHER, ADD], tool_choice=choice, max_tokens=200,
                  temperature=0, extra_body=NO_THINK)
    whole = client.chat.completions.create(**kwargs).choices[0]  # type: ignore[call-overload]
    streamed, finish = _stream_calls(client, **kwargs)
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]


def test_streamed_arguments_arrive_while_the_call_is_generated(client: openai.OpenAI) -> None:
    """With logprobs every token has its chunk, so the order shows when the call's fragments came: the
    header and first argument while later arguments were still being generated, not all at the end."""
    kwargs = dict(model="tiny", messages=USER, tools=[WEATHER], tool_choice="required", max_tokens=200,
                  temperature=0, logprobs=True, extra_body=NO_THINK)
    order, fragments = [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                order.append("call")
                fragments.append(d.function.arguments)
            if ch.logprobs and ch.logprobs.content:
                order.append("token")
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls  # type: ignore[call-overload]
    assert "".join(fragments) == whole[0].function.arguments
    first, last = order.index("call"), len(order) - 1 - order[::-1].index("call")
    assert "token" in order[first:last], order  # tokens were generated between the call's first and last delta
    assert len(json.loads(whole[0].function.arguments)) >= 2 and fragments.count("{") == 1


def test_tool_round_trip_with_reasoning(client: openai.OpenAI) -> None:
    """An assistant turn with reasoning and a call, then the tool's result, render and continue."""
    messages = [
        *USER,
        {"role": "assistant", "content": "", "reasoning_content": "I need the weather tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=4)
    assert r.usage.prompt_tokens > 100  # the tools and the tool response are in the prompt


def test_auto_needs_the_flag(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Not a server start of its own: the module server has the flag; the check is in plan_tools.
    from deltaserve.serve.chat_tools import ToolConfig, plan_tools
    from deltaserve.serve.errors import APIError

    with pytest.raises(APIError, match="enable-auto-tool-choice"):
        plan_tools([WEATHER], "auto", True, ToolConfig(False, "qwen3_coder"), None)
    plan = plan_tools([WEATHER], None, True, ToolConfig(True, "qwen3_coder"), None)
    assert plan.choice == "auto" and plan.parser is not None and plan.structured is None
    assert plan_tools([WEATHER], "none", True, ToolConfig(False, None), None).parser is None


def test_mixed_batch_gives_each_its_own_result(client: openai.OpenAI) -> None:
    """Structured, tool and plain requests at once (greedy) answer as each does alone."""
    import concurrent.futures

    requests = [
        dict(messages=USER, max_tokens=60, temperature=0, extra_body=NO_THINK),
        dict(messages=USER, max_tokens=120, temperature=0, extra_body=NO_THINK, tools=[WEATHER, ADD],
             tool_choice="required"),
        dict(messages=USER, max_tokens=120, temperature=0, extra_body=NO_THINK,
             response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}),
        dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=40, temperature=0),
    ]

    def run(kw: dict) -> tuple:
        c = client.chat.completions.create(model="tiny", **kw).choices[0]  # type: ignore[call-overload]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return c.message.content, c.message.reasoning_content, calls, c.finish_reason

    alone = [run(kw) for kw in requests]
    with concurrent.futures.ThreadPoolExecutor(len(requests) * 2) as pool:
        together = list(pool.map(run, requests * 2))
    assert together == alone * 2


# ---- /v1/responses -------------------------------------------------------------------------------------
FLAT_ADD = {"type": "function", **ADD["function"]}  # the Responses API's tools are flat


def _collect(events: list) -> tuple[dict, list[str]]:
    """The final response of a stream, and the event types in order. The client's parser types every event
    (constructed, not validated): each must also validate as its openai type."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import BaseModel, TypeAdapter

    adapter: TypeAdapter = TypeAdapter(ResponseStreamEvent)
    for e in events:
        assert isinstance(e, BaseModel) and type(adapter.validate_python(e.to_dict())) is type(e), e
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events[-1].response, kinds


def test_responses_text_streamed_and_not(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", input="Say hi.", instructions="Be terse.", max_output_tokens=12, temperature=0,
              reasoning={"effort": "none"})
    r = client.responses.create(**kw)  # type: ignore[call-overload]
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output_text
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 5
    events = list(client.responses.create(stream=True, **kw))  # type: ignore[call-overload]
    final, kinds = _collect(events)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == r.output_text
    assert "response.output_item.added" in kinds and "response.content_part.done" in kinds


def test_responses_reasoning_item(client: openai.OpenAI) -> None:
    # thinking on (the default): a random model does not close its think block in 10 tokens
    r = client.responses.create(model="tiny", input="Think.", max_output_tokens=10, temperature=0)
    assert [o.type for o in r.output] == ["reasoning"] and r.output[0].content[0].text
    events = list(client.responses.create(model="tiny", input="Think.", max_output_tokens=10, temperature=0,
                                          stream=True))
    final, kinds = _collect(events)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == r.output[0].content[0].text
    assert final.output[0].content[0].text == r.output[0].content[0].text


def test_responses_tools_and_previous_response(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", input="Add 2 and 3.", tools=[FLAT_ADD], tool_choice="required", temperature=0,
              max_output_tokens=150, reasoning={"effort": "none"}, parallel_tool_calls=False)
    r = client.responses.create(**kw)  # type: ignore[call-overload]
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), ADD["function"]["parameters"])
    events = list(client.responses.create(stream=True, **kw))  # type: ignore[call-overload]
    final, kinds = _collect(events)
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == calls[0].arguments == [o for o in final.output if o.type == "function_call"][0].arguments
    # continue: the stored conversation plus the tool's output
    follow = client.responses.create(
        model="tiny", previous_response_id=r.id, max_output_tokens=4, reasoning={"effort": "none"},
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}], tools=[FLAT_ADD],
        tool_choice="none",
    )
    assert follow.previous_response_id == r.id and follow.usage.input_tokens > r.usage.input_tokens
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model="tiny", previous_response_id="resp_nope", input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="function tools"):
        client.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}], max_output_tokens=2)


FLAT_WEATHER = {"type": "function", **WEATHER["function"]}


def test_responses_streamed_call_events(client: openai.OpenAI) -> None:
    """A named call streamed: its events come as OpenAI sends them (item added with empty arguments, in
    progress; the argument deltas; arguments done; item done), the deltas joined are the non-streamed call's
    arguments, and the client's stream helper accepts it all."""
    from openai.types.responses import ResponseFunctionToolCall

    kw = dict(model="tiny", input="Weather in Paris?", tools=[FLAT_WEATHER], temperature=0, max_output_tokens=200,
              tool_choice={"type": "function", "name": "get_weather"}, reasoning={"effort": "none"})
    whole = [o for o in client.responses.create(**kw).output]  # type: ignore[call-overload]
    assert [o.type for o in whole] == ["function_call"] and whole[0].name == "get_weather"
    events = list(client.responses.create(stream=True, **kw))  # type: ignore[call-overload]
    final, kinds = _collect(events)
    call = [k for k in kinds if "output_item" in k or "function_call" in k]
    assert call[0] == "response.output_item.added" and call[-2:] == [
        "response.function_call_arguments.done", "response.output_item.done"]
    assert set(call[1:-2]) == {"response.function_call_arguments.delta"} and len(call) >= 6  # {, 2+ args, }
    added = events[kinds.index("response.output_item.added")]
    assert isinstance(added.item, ResponseFunctionToolCall) and added.item.status == "in_progress"
    assert added.item.arguments == "" and added.item.name == "get_weather" and added.item.call_id
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert all(d.item_id == added.item.id and d.output_index == added.output_index for d in deltas)
    streamed = "".join(d.delta for d in deltas)
    done = events[kinds.index("response.output_item.done")]
    assert streamed == whole[0].arguments == events[kinds.index("response.function_call_arguments.done")].arguments
    assert done.item.arguments == streamed and done.item.status == "completed" and done.item.id == added.item.id
    assert final.output[0].arguments == streamed and final.status == "completed"
    jsonschema.validate(json.loads(streamed), WEATHER["function"]["parameters"])

    # the client's stream helper (it checks item identities and builds each delta's snapshot)
    with client.responses.stream(**kw) as stream:  # type: ignore[arg-type]
        snapshots = [e.snapshot for e in stream if e.type == "response.function_call_arguments.delta"]
        helped = stream.get_final_response()
    assert snapshots[-1] == streamed and [o.arguments for o in helped.output] == [streamed]


def test_responses_input_items_round_trip(client: openai.OpenAI) -> None:
    """Explicit items: a reasoning item, a function call and its output, then a user turn."""
    r = client.responses.create(
        model="tiny", max_output_tokens=3, tools=[FLAT_ADD], tool_choice="none",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Add 1 and 2."}]},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "use add"}]},
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
            {"type": "function_call_output", "call_id": "c1", "output": "3"},
        ],
    )
    assert r.status == "incomplete" and r.usage.input_tokens > 200


def test_auto_with_a_broken_call_keeps_it_as_text(client: openai.OpenAI) -> None:
    """tool_choice auto: the model opens `<tool_call>` (forced here) and writes noise: no call, the text
    stays content, streamed as not."""
    kw = dict(model="tiny", messages=USER, tools=[WEATHER], tool_choice="auto", max_tokens=12, temperature=0,
              logit_bias={"8188": 100}, extra_body=NO_THINK)
    whole = client.chat.completions.create(**kw).choices[0]  # type: ignore[call-overload]
    assert whole.message.content.startswith("<tool_call>") and not whole.message.tool_calls
    assert whole.finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                   if c.choices)  # type: ignore[call-overload]
    assert text == whole.message.content


def test_responses_json_schema_text_format(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="tiny", input="A person, please.", max_output_tokens=200, temperature=1.0, reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)


def test_responses_with_no_input_is_400(client: openai.OpenAI) -> None:
    """Found by schemathesis: an empty input list became a chat request without messages, a 500."""
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input=[], max_output_tokens=4)
    assert e.value.body["param"] == "input" and "at least 1 item" in e.value.body["message"]


def test_responses_top_logprobs_is_refused_by_name(client: openai.OpenAI) -> None:
    """OpenAI's top_logprobs would otherwise be silently ignored: the output items carry no logprobs."""
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="x", max_output_tokens=2, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs" and "chat/completions" in e.value.body["message"]

