"""Tokenizer: a Hugging Face `tokenizers` fast tokenizer loaded from `tokenizer.json`, plus what
`tokenizer_config.json` / `generation_config.json` add (special tokens, EOS ids, the chat template).

The chat template is rendered the way `transformers` renders it (sandboxed jinja2 with trim_blocks and
lstrip_blocks, its `tojson`, `raise_exception`, `strftime_now`), so prompts are byte-identical to what
`AutoTokenizer.apply_chat_template` produces without importing transformers at serving time."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class TokenizerError(ValueError):
    """A tokenizer directory deltaserve cannot use; the message names the file and what is wrong."""


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (raise_exception) or failed to render."""


_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Names a message's reasoning may come under; transformers aliases them so templates find `reasoning_content`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        config: dict[str, Any] | None = None,
        chat_template: str | None = None,
        generation_eos: list[int] | None = None,
    ) -> None:
        self._tok = tokenizer
        self._max_token_chars: int | None = None
        self.config = dict(config or {})
        self.chat_template = chat_template
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = _token_content(self.config.get(key))
            if value is not None:
                self.special_tokens[key] = value
        eos: list[int] = []
        if "eos_token" in self.special_tokens:
            tid = self._tok.token_to_id(self.special_tokens["eos_token"])
            if tid is None:
                raise TokenizerError(
                    f"tokenizer_config.json eos_token {self.special_tokens['eos_token']!r} "
                    "is not in the vocabulary"
                )
            eos.append(tid)
        for tid in generation_eos or []:
            if tid not in eos:
                eos.append(tid)
        self.eos_token_ids: list[int] = eos
        added = self._tok.get_added_tokens_decoder()  # id -> AddedToken
        self.added_token_ids: frozenset[int] = frozenset(added)  # whole tokens, never split (special or not)
        self.all_special_ids: list[int] = sorted(i for i, t in added.items() if t.special)
        self.all_special_tokens: list[str] = [added[i].content for i in self.all_special_ids]

    # ---- loading -------------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise TokenizerError(f"no tokenizer.json in {path}")
        try:
            tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"{tok_file} could not be loaded: {e}") from e
        config = read_json_object(path / "tokenizer_config.json") or {}
        template = _pick_template(config.get("chat_template"))
        # Newer transformers saves the template beside the config rather than inside it.
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text(encoding="utf-8")
        gen = read_json_object(path / "generation_config.json") or {}
        gen_eos = gen.get("eos_token_id")
        gen_eos_ids = [] if gen_eos is None else ([gen_eos] if isinstance(gen_eos, int) else list(gen_eos))
        return cls(tok, config, template, [int(t) for t in gen_eos_ids])

    # ---- encode / decode -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL while the Rust side works (encode does not): a server tokenizing
        # a long prompt in a worker thread keeps its event loop, and every other stream, running.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry (added tokens included): no token covers more text,
        so a prompt has at least about len(text) / max_token_chars tokens."""
        if self._max_token_chars is None:
            self._max_token_chars = max(len(t) for t in self._tok.get_vocab(with_added_tokens=True))
        return self._max_token_chars

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and, per id, the [start, end) character span of `text` it came from (the inspector shows how
        a string splits; byte-level pieces of one character share its span)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def to_json(self) -> str:
        """The tokenizer.json text (a grammar engine builds its token trie from it)."""
        return self._tok.to_str()

    # ---- chat template -------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        template = chat_template or self.chat_template
        if template is None:
            raise ChatTemplateError(
                "this tokenizer has no chat_template (tokenizer_config.json / chat_template.jinja)"
            )
        if tools is not None:
            for tool in tools:
                if not isinstance(tool, dict):
                    raise ChatTemplateError(f"tools must be JSON-schema dicts, got {type(tool).__name__}")
        chat = []
        for m in messages:
            if not isinstance(m, dict):
                raise ChatTemplateError(f"chat messages must be dicts, got {m!r}")
            reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [_arguments_as_mapping(c) for c in m["tool_calls"]]}
            chat.append(m)
        kwargs = {**self.special_tokens, **template_kwargs}
        documents = kwargs.pop("documents", None)
        try:
            return _compile(template).render(
                messages=chat, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, **kwargs,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            # Python errors inside the template's own expressions (a filter given a value of the wrong
            # type, a field the conversation lacks): the conversation does not fit the template.
            raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from e


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _arguments_as_mapping(call: Any) -> Any:
    """OpenAI sends a tool call's arguments as a JSON string; templates that render each parameter (Qwen3.5's
    `<parameter=NAME>`) iterate them as a mapping, so decode the string as vLLM does (a string that is not
    a JSON object stays as it is)."""
    if not isinstance(call, dict):
        return call
    fn = call.get("function") if isinstance(call.get("function"), dict) else None
    args = (fn or call).get("arguments")
    if not isinstance(args, str):
        return call
    try:
        decoded = json.loads(args)
    except json.JSONDecodeError:
        return call
    if not isinstance(decoded, dict):
        return call
    if fn is not None:
        return {**call, "function": {**fn, "arguments": decoded}}
    return {**call, "arguments": decoded}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes (<, >, &, '); chat templates expect plain JSON, as transformers gives.
    if isinstance(x, jinja2.Undefined):
        raise jinja2.exceptions.UndefinedError("tojson was given an undefined value (a field the message lacks)")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse (line {e.lineno}): {e.message}") from e


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", "special": true, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {d.get("name"): d.get("template") for d in value if isinstance(d, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in path, None if there is no file; TokenizerError (a ValueError) naming the file
    if it is not a JSON object."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data
