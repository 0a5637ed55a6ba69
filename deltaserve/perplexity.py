"""Perplexity of a model on a text file (`deltaserve eval ppl`): how a weight format's quality is measured.

Each document is tokenized on its own (no special tokens added) and cut into windows of at most
`window` tokens with no overlap; every token of a window but the first is scored given the ones before it in
that window, with the same stateless forward and logprobs as prompt scoring (serve/scoring.py). The
perplexity is exp(total negative log-likelihood / scored tokens), overall and per source."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deltaserve.serve.scoring import score_prompt


@dataclass(slots=True)
class Document:
    source: str
    text: str


@dataclass(slots=True)
class SourceScore:
    """Summed negative log-likelihood (nats) over the scored tokens of one source's windows."""

    source: str
    documents: int = 0
    windows: int = 0
    tokens: int = 0
    nll: float = 0.0

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    def add(self, other: SourceScore) -> None:
        self.documents += other.documents
        self.windows += other.windows
        self.tokens += other.tokens
        self.nll += other.nll

    def as_dict(self) -> dict[str, Any]:
        nll_per_token = self.nll / self.tokens if self.tokens else float("nan")
        return dict(source=self.source, documents=self.documents, windows=self.windows, tokens=self.tokens,
                    nll_per_token=nll_per_token, perplexity=self.perplexity)


@dataclass(slots=True)
class PerplexityResult:
    total: SourceScore
    sources: list[SourceScore] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.total.as_dict(), sources=[s.as_dict() for s in self.sources])


def load_documents(path: str | Path) -> list[Document]:
    """A .jsonl file of {"text": ..., "source": optional} objects, one a line; any other file is one document
    (its source: the file name)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    if path.suffix != ".jsonl":
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise ValueError(f"{path} is empty")
        return [Document(path.name, text)]
    docs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {n} is not JSON: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ValueError(f'{path} line {n} has no "text" string')
        docs.append(Document(str(obj.get("source", path.stem)), obj["text"]))
    if not docs:
        raise ValueError(f"{path} has no documents")
    return docs


def windows(ids: list[int], window: int) -> list[list[int]]:
    """Consecutive non-overlapping pieces of at most `window` tokens; a last piece of one token (nothing to
    score) is dropped."""
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids) - i > 1]


def score_window(model: torch.nn.Module, ids: list[int]) -> float:
    """Negative log-likelihood (nats) of ids[1:] given the tokens before each."""
    return -sum(s.logprob for s in score_prompt(model, ids, top_k=0)[1:] if s is not None)


def perplexity(model: torch.nn.Module, tokenizer: Any, docs: list[Document], window: int) -> PerplexityResult:
    if window < 2:
        raise ValueError(f"the window must hold at least 2 tokens, got {window}")
    by_source: dict[str, SourceScore] = {}
    for doc in docs:
        score = by_source.setdefault(doc.source, SourceScore(doc.source))
        score.documents += 1
        for piece in windows(tokenizer.encode(doc.text), window):
            score.windows += 1
            score.tokens += len(piece) - 1
            score.nll += score_window(model, piece)
    total = SourceScore("all")
    for s in by_source.values():
        total.add(s)
    if not total.tokens:
        raise ValueError("the text has no token to score (every document is shorter than 2 tokens)")
    return PerplexityResult(total, list(by_source.values()))
