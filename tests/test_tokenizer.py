"""Tokenizer wrapper: loading, encode/decode, special tokens, EOS ids and the chat template, checked against
transformers' own rendering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltaserve.tokenizer import ChatTemplateError, Tokenizer, TokenizerError
from tests.tiny_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_tokenizer

DEMO_DIR = Path(__file__).resolve().parents[1] / "deltaserve" / "assets" / "demo"

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "你好! What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
    {"role": "user", "content": "And <b>3+3</b> & more?"},
]
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "a < b & c",
    "parameters": {"type": "object", "properties": {"a": {"type": "int"}}},
}}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def test_loads_special_tokens_and_eos(tok: Tokenizer) -> None:
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert tok.all_special_ids == sorted(ids)
    # tokenizer_config eos first, then generation_config's extra ids
    assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    assert tok.eos_token == "<|im_end|>"
    assert tok.vocab_size == 420


def test_encode_decode_roundtrip(tok: Tokenizer) -> None:
    text = "Hello world! 你好，世界！鲸 deltaserve"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(ids[0]) == tok.convert_ids_to_tokens(ids)[0]
    with_special = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert with_special[0] == tok.token_to_id("<|im_start|>")
    assert tok.decode(with_special, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(with_special, skip_special_tokens=True) == "user\nhi"


def test_chat_template_renders(tok: Tokenizer) -> None:
    out = tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=True)
    assert out == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                   "<|im_start|>user\n你好! What is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    no_think = tok.apply_chat_template(MESSAGES[:2], enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # tojson must not HTML-escape (jinja's built-in filter would turn < into \u003c)
    assert '"a < b & c"' in tok.apply_chat_template(MESSAGES[:2], tools=TOOLS)


def test_chat_template_raise_exception(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="unknown role robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_chat_template_is_sandboxed(tok: Tokenizer) -> None:
    evil = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(MESSAGES, chat_template=evil)


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_template_from_chat_template_jinja(tok_dir: Path, tmp_path: Path) -> None:
    for f in ("tokenizer.json",):
        (tmp_path / f).write_bytes((tok_dir / f).read_bytes())
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    t = Tokenizer.from_dir(tmp_path)
    assert t.apply_chat_template(MESSAGES[:1]).startswith("<|im_start|>system")
    assert t.eos_token_ids == [t.token_to_id("<|im_end|>")]


def _hf_render(path: Path, messages: list, **kwargs) -> str:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    return hf.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(add_generation_prompt=True),
    dict(add_generation_prompt=False),
    dict(add_generation_prompt=True, tools=TOOLS),
    dict(add_generation_prompt=True, enable_thinking=False),
])
def test_chat_template_matches_transformers(tok_dir: Path, tok: Tokenizer, kwargs: dict) -> None:
    assert tok.apply_chat_template(MESSAGES, **kwargs) == _hf_render(tok_dir, MESSAGES, **kwargs)


TOOL_TURNS = [
    {"role": "developer", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris, and 2+3?"},
    {"role": "assistant", "content": "", "reasoning_content": "Two tools.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}},
        {"id": "c2", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": [3, {"x": None}]}}},
    ]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "5"},
]


@pytest.mark.skipif(not (DEMO_DIR / "tokenizer.json").exists(), reason="demo tokenizer not built yet")
def test_demo_template_renders_qwen35_tool_turns() -> None:
    tok = Tokenizer.from_dir(DEMO_DIR)
    text = tok.apply_chat_template(TOOL_TURNS, tools=TOOLS)
    assert text == _hf_render(DEMO_DIR, TOOL_TURNS, tools=TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n") and "\n\nUse tools.<|im_end|>" in text
    assert ("<think>\nTwo tools.\n</think>\n\n<tool_call>\n<function=weather>\n<parameter=city>\nParis\n"
            "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n") in text
    assert '<parameter=b>\n[3, {"x": null}]\n</parameter>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n5\n</tool_response>" in text
    # OpenAI sends arguments as a JSON string: it renders as the mapping does
    as_strings = [dict(m, tool_calls=[{**c, "function": {**c["function"], "arguments": json.dumps(
        c["function"]["arguments"])}} for c in m["tool_calls"]]) if "tool_calls" in m else m for m in TOOL_TURNS]
    assert tok.apply_chat_template(as_strings, tools=TOOLS) == text
    with pytest.raises(ChatTemplateError, match="Unexpected message role 'robot'"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


@pytest.mark.skipif(not (DEMO_DIR / "tokenizer.json").exists(), reason="demo tokenizer not built yet")
@pytest.mark.parametrize("kwargs", [
    dict(add_generation_prompt=True),
    dict(add_generation_prompt=True, enable_thinking=False),
    dict(add_generation_prompt=True, tools=TOOLS),
])
def test_demo_tokenizer_matches_transformers(kwargs: dict) -> None:
    tok = Tokenizer.from_dir(DEMO_DIR)
    assert tok.eos_token_ids, "the demo tokenizer must name an EOS token"
    text = "Hello, 你好! <think>x</think>"
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    if tok.chat_template is None:
        pytest.skip("demo tokenizer has no chat template")
    for messages in (MESSAGES[1:2], MESSAGES):  # one turn; multi-turn with reasoning and a system prompt
        assert tok.apply_chat_template(messages, **kwargs) == _hf_render(DEMO_DIR, messages, **kwargs)


@pytest.mark.skipif(not (DEMO_DIR / "tokenizer.json").exists(), reason="demo tokenizer not built yet")
def test_demo_template_is_the_corpus_source_of_truth() -> None:
    """train_tokenizer.py stores scripts/corpus/chat.py's CHAT_TEMPLATE: a rebuild keeps the template."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "corpus" / "chat.py"
    spec = importlib.util.spec_from_file_location("corpus_chat", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert Tokenizer.from_dir(DEMO_DIR).chat_template == module.CHAT_TEMPLATE
