"""Tool-use conversations (English and Chinese) in the demo template's Qwen3.5 tools format.

Four tools: get_weather, calculate, get_time, convert_units. An example is either
  * "call": a matching tool is offered (among 1-4 tools, shuffled); the assistant calls it, the tool's result
    (a JSON string computed here) comes back, and the assistant answers from it in the question's language;
  * "no_call": no offered tool matches (a tool-type question whose tool is missing, or a general question from
    gen_qa); the assistant answers directly, briefly.
Thinking on: the call turn carries a short reasoning (which tool and why), the answer turn a one-line one.

Conventions
  * The city argument is always the city's English name, whatever the question's language ("巴黎" -> "Paris"):
    it is what a weather or time service expects.
  * Weather is invented deterministically from (city, day), the day drawn per example, so the same city has
    varied weather and the answer must be read from the result; times are drawn per example; arithmetic and
    unit conversions are exact (conversions rounded to 2 decimals).
  * Held-out split: by a hash of the user's question text (1 in 10 questions is held out), so no held-out
    question appears in train; cities, tools and templates are shared.

Lengths (demo tokenizer, whole conversations, 2000 train examples): the template's fixed tools instructions are
264 tokens and each spec 104-162 more, so with max_tools=4 (the default) the mean is 630 tokens, p95 944, max
1075; with max_tools=1 the mean is 537, max 669 (99% within 640). Train at a length of about 1100, or pass a
smaller max_tools.

The interface (scripts/finetune_demo.py and scripts/eval_demo_tools.py use it): ToolExample, sample,
training_segments, first_turn_segments, answer_keys, TOOLS.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any

from . import gen_qa

# (English name, Chinese name, UTC offset in hours): the argument is the English name.
CITIES = [("Paris", "巴黎", 1), ("London", "伦敦", 0), ("Tokyo", "东京", 9), ("Beijing", "北京", 8),
          ("Shanghai", "上海", 8), ("New York", "纽约", -5), ("Berlin", "柏林", 1), ("Sydney", "悉尼", 10),
          ("Moscow", "莫斯科", 3), ("Rome", "罗马", 1), ("Madrid", "马德里", 1), ("Cairo", "开罗", 2),
          ("Seoul", "首尔", 9), ("Singapore", "新加坡", 8), ("Bangkok", "曼谷", 7), ("Dubai", "迪拜", 4),
          ("Toronto", "多伦多", -5), ("Chicago", "芝加哥", -6), ("Los Angeles", "洛杉矶", -8),
          ("Guangzhou", "广州", 8), ("Shenzhen", "深圳", 8), ("Hong Kong", "香港", 8), ("Chengdu", "成都", 8),
          ("Hangzhou", "杭州", 8), ("Wuhan", "武汉", 8), ("Xi'an", "西安", 8), ("Nanjing", "南京", 8),
          ("Vienna", "维也纳", 1), ("Amsterdam", "阿姆斯特丹", 1), ("Athens", "雅典", 2), ("Lisbon", "里斯本", 0),
          ("Mumbai", "孟买", 5), ("Istanbul", "伊斯坦布尔", 3), ("Mexico City", "墨西哥城", -6),
          ("Rio de Janeiro", "里约热内卢", -3), ("Nairobi", "内罗毕", 3), ("Oslo", "奥斯陆", 1),
          ("Stockholm", "斯德哥尔摩", 1), ("Hanoi", "河内", 7), ("Osaka", "大阪", 9)]

# condition as the tool writes it -> (English answer word, Chinese answer word)
CONDITIONS = {"sunny": ("sunny", "晴"), "cloudy": ("cloudy", "多云"), "rainy": ("rainy", "有雨"),
              "windy": ("windy", "有风"), "foggy": ("foggy", "有雾"), "snowy": ("snowy", "下雪")}

# unit -> (English name, Chinese name, factor to the base unit of its kind, kind); temperatures are special.
UNITS = {"km": ("kilometers", "公里", 1000.0, "length"), "mi": ("miles", "英里", 1609.344, "length"),
         "m": ("meters", "米", 1.0, "length"), "ft": ("feet", "英尺", 0.3048, "length"),
         "cm": ("centimeters", "厘米", 0.01, "length"), "in": ("inches", "英寸", 0.0254, "length"),
         "kg": ("kilograms", "公斤", 1000.0, "mass"), "lb": ("pounds", "磅", 453.59237, "mass"),
         "g": ("grams", "克", 1.0, "mass"), "oz": ("ounces", "盎司", 28.349523125, "mass"),
         "l": ("liters", "升", 1.0, "volume"), "gal": ("gallons", "加仑", 3.785411784, "volume"),
         "celsius": ("degrees Celsius", "摄氏度", 1.0, "temperature"),
         "fahrenheit": ("degrees Fahrenheit", "华氏度", 1.0, "temperature")}
UNIT_PAIRS = [("km", "mi"), ("mi", "km"), ("m", "ft"), ("ft", "m"), ("cm", "in"), ("in", "cm"), ("kg", "lb"),
              ("lb", "kg"), ("g", "oz"), ("oz", "g"), ("l", "gal"), ("gal", "l"), ("celsius", "fahrenheit"),
              ("fahrenheit", "celsius")]

# operation -> (symbol, English word, Chinese word)
OPERATIONS = {"add": ("+", "plus", "加"), "subtract": ("-", "minus", "减"), "multiply": ("×", "times", "乘以"),
              "divide": ("÷", "divided by", "除以")}


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


# Short descriptions and no per-parameter ones: the tools block is in every prompt, the demo's tokenizer spends
# ~100-150 tokens on each spec's JSON, and the template's fixed instructions take ~270 more. The unit enum
# (14 names, ~120 tokens) is left out: the model learns the unit names from the calls.
TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": _fn("get_weather", "Get the current weather in a city (English name).", {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    "calculate": _fn("calculate", "Do arithmetic on two numbers.", {
        "operation": {"type": "string", "enum": list(OPERATIONS)},
        "a": {"type": "number"}, "b": {"type": "number"}}, ["operation", "a", "b"]),
    "get_time": _fn("get_time", "Get the local time in a city (English name).", {
        "city": {"type": "string"}}, ["city"]),
    "convert_units": _fn("convert_units", "Convert a value between units.", {
        "value": {"type": "number"}, "from_unit": {"type": "string"}, "to_unit": {"type": "string"}},
        ["value", "from_unit", "to_unit"]),
}

HELDOUT_ONE_IN = 10


@dataclass(slots=True)
class ToolExample:
    messages: list[dict]  # OpenAI-style: system?/user/assistant(tool_calls, reasoning_content)/tool/assistant
    tools: list[dict]  # OpenAI function specs, in the order offered
    enable_thinking: bool
    kind: str  # "call" or "no_call"
    lang: str  # "en" or "zh"
    expected_call: dict | None  # {"name", "arguments"} (typed as the schema says) for "call", else None
    topic: str | None = None  # the tool the question is about, offered or not (None: a general question)


@dataclass(slots=True)
class _Item:
    """One question's content before it becomes a conversation."""

    tool: str | None  # the tool it needs (None: a general question)
    question: str
    arguments: dict[str, Any] | None  # the call's arguments (tool questions)
    result: dict[str, Any] | None  # what the tool returns
    call_think: str  # reasoning before the call
    answer: str  # the answer from the result (tool questions) or the direct answer
    direct_answer: str  # the answer without the tool (no_call)
    answer_think: str  # reasoning before the answer


def _num(x: float) -> int | float:
    """A result as a person writes it: whole numbers without '.0', others to at most 2 decimals."""
    x = round(x, 2)
    return int(x) if x == int(x) else x


def _hash_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def weather_for(city: str, day: int) -> tuple[int, str]:
    """Invented but deterministic (celsius, condition) for a city on a day."""
    h = _hash_int(f"{city}|{day}")
    celsius = h % 41 - 5  # -5 .. 35
    conditions = list(CONDITIONS) if celsius <= 2 else [c for c in CONDITIONS if c != "snowy"]
    return celsius, conditions[(h >> 16) % len(conditions)]


# ----------------------------------------------------------------- items

def _weather(r: random.Random, lang: str) -> _Item:
    en, zh, _ = r.choice(CITIES)
    unit = r.choice([None, None, None, "celsius", "fahrenheit"])
    celsius, cond = weather_for(en, r.randrange(365))
    temp = celsius if unit != "fahrenheit" else round(celsius * 9 / 5 + 32)
    sym = "°F" if unit == "fahrenheit" else "°C"
    args: dict[str, Any] = {"city": en} if unit is None else {"city": en, "unit": unit}
    result = {"city": en, "temperature": temp, "unit": unit or "celsius", "condition": cond}
    word_en, word_zh = CONDITIONS[cond]
    if lang == "en":
        q = r.choice([f"What's the weather like in {en}?", f"What is the weather in {en} today?",
                      f"How is the weather in {en}?", f"Is it cold in {en} right now?",
                      f"Tell me the weather in {en}.", f"weather in {en}?"])
        if unit:
            q = q.rstrip("?.") + f", in {unit}?"
        think = f"The user wants the current weather in {en}. The get_weather tool gives it, so I call it."
        ans = r.choice([f"It is {temp}{sym} and {word_en} in {en}.", f"In {en} it is {temp}{sym} and {word_en}.",
                        f"The weather in {en}: {temp}{sym}, {word_en}."])
        direct = f"I can't check the current weather in {en}."
        ans_think = f"The tool says {temp}{sym} and {word_en}."
    else:
        q = r.choice([f"{zh}天气怎么样？", f"{zh}今天天气如何？", f"{zh}现在冷吗？", f"告诉我{zh}的天气。",
                      f"查一下{zh}的天气", f"{zh}现在是什么天气？"])
        if unit:
            q = q.rstrip("？。") + ("，用华氏度？" if unit == "fahrenheit" else "，用摄氏度？")
        think = f"用户想知道{zh}现在的天气。get_weather工具可以查询，城市参数用英文名{en}。"
        ans = r.choice([f"{zh}现在{temp}{sym}，{word_zh}。", f"{zh}的天气：{temp}{sym}，{word_zh}。"])
        direct = f"我无法查询{zh}现在的天气。"
        ans_think = f"工具返回{temp}{sym}，{word_zh}。"
    return _Item("get_weather", q, args, result, think, ans, direct, ans_think)


def _operands(r: random.Random, op: str) -> tuple[int | float, int | float]:
    if op == "divide":
        b = r.randint(2, 25)
        return b * r.randint(2, 40), b
    if r.random() < 0.15:
        return round(r.uniform(1, 100), 1), r.randint(2, 50)
    hi = 99 if op == "multiply" else 999
    return r.randint(2, hi), r.randint(2, hi)


def _calculate(r: random.Random, lang: str) -> _Item:
    op = r.choice(list(OPERATIONS))
    a, b = _operands(r, op)
    value = _num({"add": a + b, "subtract": a - b, "multiply": a * b, "divide": a / b}[op])
    sym, word_en, word_zh = OPERATIONS[op]
    args = {"operation": op, "a": a, "b": b}
    if lang == "en":
        q = r.choice([f"What is {a} {word_en} {b}?", f"What's {a} {sym} {b}?", f"Calculate {a} {word_en} {b}.",
                      f"Can you work out {a} {sym} {b}?", f"How much is {a} {word_en} {b}?"])
        think = f"This is arithmetic: {op} {a} and {b}. The calculate tool does it exactly."
        ans = r.choice([f"{a} {sym} {b} = {value}.", f"{a} {word_en} {b} is {value}.", f"The answer is {value}."])
        ans_think = f"The tool returned {value}."
    else:
        q = r.choice([f"{a}{word_zh}{b}等于多少？", f"算一下{a} {sym} {b}。", f"{a} {sym} {b}是多少？",
                      f"请计算{a}{word_zh}{b}。", f"{a}{word_zh}{b}是几？"])
        think = f"这是一道算术题：{a}{word_zh}{b}。用calculate工具算，operation是{op}。"
        ans = r.choice([f"{a} {sym} {b} = {value}。", f"{a}{word_zh}{b}等于{value}。", f"答案是{value}。"])
        ans_think = f"工具返回{value}。"
    direct = f"{a} {sym} {b} = {value}." if lang == "en" else f"{a} {sym} {b} = {value}。"
    return _Item("calculate", q, args, {"result": value}, think, ans, direct, ans_think)


def _time(r: random.Random, lang: str) -> _Item:
    en, zh, offset = r.choice(CITIES)
    hhmm = f"{r.randrange(24):02d}:{r.randrange(60):02d}"
    utc = f"UTC{offset:+d}" if offset else "UTC"
    result = {"city": en, "time": hhmm, "utc_offset": utc}
    if lang == "en":
        q = r.choice([f"What time is it in {en}?", f"What's the time in {en} now?", f"Current time in {en}?",
                      f"Tell me the local time in {en}.", f"what time is it in {en} right now?"])
        think = f"The user asks for the local time in {en}. The get_time tool gives it."
        ans = r.choice([f"It is {hhmm} in {en}.", f"The local time in {en} is {hhmm}.", f"In {en} it's {hhmm} now."])
        direct = f"I can't see the current time in {en}."
        ans_think = f"The tool says it is {hhmm}."
    else:
        q = r.choice([f"{zh}现在几点？", f"{zh}现在是几点钟？", f"告诉我{zh}的当地时间。", f"{zh}现在什么时间？",
                      f"查一下{zh}现在的时间"])
        think = f"用户想知道{zh}的当地时间。get_time工具可以查询，城市参数用英文名{en}。"
        ans = r.choice([f"{zh}现在是{hhmm}。", f"{zh}的当地时间是{hhmm}。"])
        direct = f"我无法查看{zh}现在的时间。"
        ans_think = f"工具返回{hhmm}。"
    return _Item("get_time", q, {"city": en}, result, think, ans, direct, ans_think)


def convert(value: float, src: str, dst: str) -> float:
    if src == "celsius":
        return value * 9 / 5 + 32
    if src == "fahrenheit":
        return (value - 32) * 5 / 9
    return value * UNITS[src][2] / UNITS[dst][2]


def _convert(r: random.Random, lang: str) -> _Item:
    src, dst = r.choice(UNIT_PAIRS)
    value: int | float = r.randint(1, 200) if r.random() < 0.8 else round(r.uniform(0.5, 100), 1)
    out = _num(convert(value, src, dst))
    (se, sz, *_), (de, dz, *_) = UNITS[src], UNITS[dst]
    args = {"value": value, "from_unit": src, "to_unit": dst}
    if lang == "en":
        q = r.choice([f"How many {de} is {value} {se}?", f"Convert {value} {se} to {de}.",
                      f"What is {value} {se} in {de}?", f"{value} {se} in {de}?"])
        think = f"The user wants {value} {se} in {de}. The convert_units tool does it: from {src} to {dst}."
        ans = r.choice([f"{value} {se} is about {out} {de}.", f"That is about {out} {de}."])
        direct = f"{value} {se} is about {out} {de}."
        ans_think = f"The tool returned {out} {dst}."
    else:
        q = r.choice([f"{value}{sz}是多少{dz}？", f"把{value}{sz}换算成{dz}。", f"{value}{sz}等于多少{dz}？",
                      f"{value}{sz}换成{dz}是多少？"])
        think = f"用户要把{value}{sz}换算成{dz}。用convert_units工具，从{src}到{dst}。"
        ans = r.choice([f"{value}{sz}约等于{out}{dz}。", f"大约是{out}{dz}。"])
        direct = f"{value}{sz}约等于{out}{dz}。"
        ans_think = f"工具返回{out} {dst}。"
    return _Item("convert_units", q, args, {"value": out, "unit": dst}, think, ans, direct, ans_think)


ITEMS = {"get_weather": _weather, "calculate": _calculate, "get_time": _time, "convert_units": _convert}


def _general(r: random.Random, lang: str) -> _Item:
    """A question no tool answers, from the general QA generators."""
    q, think, a = gen_qa.pick(r, gen_qa.EN_ITEMS if lang == "en" else gen_qa.ZH_ITEMS)
    pre = "No tool is needed for this. " if lang == "en" else "这个问题不需要工具。"
    return _Item(None, q, None, None, pre + think, a, a, "")


# ----------------------------------------------------------------- examples

def _count(r: random.Random, lo: int, hi: int) -> int:
    """How many tools to offer, in lo..hi: fewer more often (each spec costs ~100-150 tokens)."""
    counts = list(range(lo, hi + 1))
    return r.choices(counts, weights=[2 ** (hi - c) for c in counts])[0]


def _draw(r: random.Random, max_tools: int, topics: tuple[str, ...] | None = None) -> ToolExample:
    lang = r.choice(["en", "zh"])
    thinking = r.random() < 0.5
    kind = "call" if r.random() < 0.7 or topics is not None else "no_call"
    if kind == "call":
        item = ITEMS[r.choice(list(topics or ITEMS))](r, lang)
        others = [t for t in TOOLS if t != item.tool]
        offered = [item.tool, *r.sample(others, _count(r, 0, max_tools - 1))]
    elif r.random() < 0.6:  # a tool question whose tool is not offered
        item = ITEMS[r.choice(list(ITEMS))](r, lang)
        others = [t for t in TOOLS if t != item.tool]
        offered = r.sample(others, _count(r, 1, min(3, max_tools)))
    else:
        item = _general(r, lang)
        offered = r.sample(list(TOOLS), _count(r, 1, max_tools))
    r.shuffle(offered)
    messages: list[dict] = []
    if r.random() < 0.4:
        messages.append({"role": "system", "content": r.choice(gen_qa.SYSTEM_EN if lang == "en" else gen_qa.SYSTEM_ZH)})
    messages.append({"role": "user", "content": item.question})
    expected = None
    if kind == "call":
        assert item.tool is not None and item.arguments is not None
        expected = {"name": item.tool, "arguments": item.arguments}
        call = {"id": "call_1", "type": "function",
                "function": {"name": item.tool, "arguments": json.dumps(item.arguments, ensure_ascii=False)}}
        messages.append(_assistant("", item.call_think if thinking else None, [call]))
        messages.append({"role": "tool", "tool_call_id": "call_1", "content": json.dumps(item.result, ensure_ascii=False)})
        messages.append(_assistant(item.answer, item.answer_think if thinking else None))
    else:
        if thinking and item.tool is not None:
            item.call_think = ("No offered tool can do this, so I answer directly." if lang == "en"
                               else "提供的工具都不适用，我直接回答。")
        messages.append(_assistant(item.direct_answer, item.call_think if thinking else None))
    return ToolExample(messages, [TOOLS[t] for t in offered], thinking, kind, lang, expected, item.tool)


def _assistant(content: str, reasoning: str | None, tool_calls: list[dict] | None = None) -> dict:
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        m["reasoning_content"] = reasoning
    if tool_calls:
        m["tool_calls"] = tool_calls
    return m


def question(example: ToolExample) -> str:
    return next(m["content"] for m in example.messages if m["role"] == "user")


def is_heldout(text: str) -> bool:
    return _hash_int(text) % HELDOUT_ONE_IN == 0


def sample(rng: random.Random, split: str, max_tools: int = 4, topics: tuple[str, ...] | None = None) -> ToolExample:
    """One example of split "train" or "heldout" (a question is in exactly one of them, by its hash), with
    1..max_tools tool specs offered (fewer more often; a no_call tool question gets at most 3, all others).
    topics: only "call" examples of these tools (the city-argument drill: ("get_weather", "get_time"))."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if not 1 <= max_tools <= len(TOOLS):
        raise ValueError(f"max_tools must be 1..{len(TOOLS)}, got {max_tools}")
    unknown = sorted(set(topics or ()) - set(ITEMS))
    if unknown:
        raise ValueError(f"unknown topic {unknown[0]!r}; the topics are {', '.join(ITEMS)}")
    while True:
        ex = _draw(rng, max_tools, topics)
        if is_heldout(question(ex)) == (split == "heldout"):
            return ex


def answer_keys(example: ToolExample) -> list[str]:
    """What the final answer of a "call" example must contain: the result's key values, as the answer
    writes them in the question's language."""
    if example.expected_call is None:
        raise ValueError("answer_keys is for 'call' examples")
    result = json.loads(next(m["content"] for m in example.messages if m["role"] == "tool"))
    name = example.expected_call["name"]
    if name == "get_weather":
        sym = "°F" if result["unit"] == "fahrenheit" else "°C"
        en, zh = CONDITIONS[result["condition"]]
        return [f"{result['temperature']}{sym}", en if example.lang == "en" else zh]
    if name == "calculate":
        return [str(result["result"])]
    if name == "get_time":
        return [result["time"]]
    return [str(result["value"])]


# ----------------------------------------------------------------- rendering for training

def _generation_prompt(tokenizer: Any, example: ToolExample) -> str:
    """What the template appends for add_generation_prompt (with this example's thinking switch)."""
    msgs = example.messages[:1]
    kw = {"tools": example.tools, "enable_thinking": example.enable_thinking}
    full = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, **kw)
    return full[len(tokenizer.apply_chat_template(msgs, add_generation_prompt=False, **kw)):]


def training_segments(example: ToolExample, tokenizer: Any) -> list[tuple[str, bool]]:
    """The whole conversation as the template renders it, in (text, is_model_output) pieces. Each assistant
    turn's output is True from after the generation prompt (or, for a turn the template renders without a
    think block, i.e. a thinking-off call turn in history, from after `<|im_start|>assistant\\n`) through its
    `<|im_end|>`; the `\\n` after it and everything else is False.

    A thinking-off call turn is generated after `...<think>\\n\\n</think>\\n\\n` but rendered in history
    without that empty block (the template drops it before the tool result): to train that turn exactly as
    inference sees it, add first_turn_segments as well."""
    full = tokenizer.apply_chat_template(example.messages, add_generation_prompt=False, tools=example.tools,
                                         enable_thinking=example.enable_thinking)
    gen = _generation_prompt(tokenizer, example)
    head = "<|im_start|>assistant\n"
    out: list[tuple[str, bool]] = []
    pos = 0
    while (start := full.find(head, pos)) != -1:
        body = start + (len(gen) if full.startswith(gen, start) else len(head))
        end = full.index("<|im_end|>", body) + len("<|im_end|>")
        out += [(full[pos:body], False), (full[body:end], True)]
        pos = end
    out.append((full[pos:], False))
    return [(t, m) for t, m in out if t]


def first_turn_segments(example: ToolExample, tokenizer: Any) -> list[tuple[str, bool]]:
    """The first turn exactly as inference sees it: the prompt through the generation prompt (False), then
    the assistant's first output through `<|im_end|>` (True): the call, or the direct answer."""
    user = next(i for i, m in enumerate(example.messages) if m["role"] == "user")
    prompt = tokenizer.apply_chat_template(example.messages[:user + 1], add_generation_prompt=True,
                                           tools=example.tools, enable_thinking=example.enable_thinking)
    output = next(t for t, is_output in training_segments(example, tokenizer) if is_output)
    return [(prompt, False), (output, True)]
