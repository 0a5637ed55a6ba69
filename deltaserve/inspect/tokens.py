"""The tokenization view: what ids a prompt (or a chat rendered by the chat template) becomes, and which
characters each id came from. Byte-level BPE splits a CJK character into several ids when the vocabulary
lacks it whole, so every piece also carries its raw bytes."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any


class TraceInputError(ValueError):
    """A trace request the inspector cannot run (empty, too long, no tokenizer for text, bad ids)."""


@dataclass(slots=True)
class TokenizedPrompt:
    text: str | None  # the text that was encoded (after the chat template), None for raw ids
    ids: list[int]
    offsets: list[tuple[int, int]] | None


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 bytes (what byte-level BPE pieces are spelled in), reversed."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


def piece_bytes(piece: str | None) -> bytes | None:
    """The bytes a byte-level BPE piece stands for; None when the piece is not byte-level (special tokens)."""
    if not piece:
        return None
    table = _byte_decoder()
    if not all(ch in table for ch in piece):
        return None
    return bytes(table[ch] for ch in piece)


def tokenize_input(
    tokenizer: Any | None, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
    token_ids: list[int] | None = None, vocab_size: int | None = None, max_tokens: int = 512,
) -> TokenizedPrompt:
    """Exactly one of prompt / messages / token_ids; messages go through the chat template."""
    given = [x is not None for x in (prompt, messages, token_ids)]
    if sum(given) != 1:
        raise TraceInputError("give exactly one of 'prompt', 'messages' or 'token_ids'")
    if token_ids is not None:
        tp = TokenizedPrompt(None, [int(t) for t in token_ids], None)
    else:
        if tokenizer is None:
            raise TraceInputError("this model has no tokenizer.json; trace 'token_ids' instead of text")
        if messages is not None:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids, offsets = tokenizer.encode_with_offsets(prompt)
        tp = TokenizedPrompt(prompt, ids, offsets)
    if not tp.ids:
        raise TraceInputError("the prompt is empty; it needs at least one token")
    if len(tp.ids) > max_tokens:
        raise TraceInputError(
            f"the prompt has {len(tp.ids)} tokens; the inspector traces at most {max_tokens}"
        )
    if vocab_size is not None:
        bad = [t for t in tp.ids if not 0 <= t < vocab_size]
        if bad:
            raise TraceInputError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return tp


def token_view(tokenizer: Any | None, tp: TokenizedPrompt) -> list[dict[str, Any]]:
    """One entry per id: id, the vocabulary piece, its decoded text, its bytes (hex), special or not, and
    the character span of the input text it came from."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    out = []
    for i, tid in enumerate(tp.ids):
        entry: dict[str, Any] = {"id": tid, "piece": None, "text": str(tid), "bytes": None,
                                 "special": tid in special, "span": None}
        if tokenizer is not None:
            piece = tokenizer.convert_ids_to_tokens(tid)
            raw = None if entry["special"] else piece_bytes(piece)
            entry.update(piece=piece, text=tokenizer.decode([tid], skip_special_tokens=False),
                         bytes=raw.hex(" ") if raw is not None else None)
        if tp.offsets is not None:
            entry["span"] = list(tp.offsets[i])
        out.append(entry)
    return out
