"""deltaserve: an inference engine for Qwen3.5 / Qwen3.8 hybrid (Gated DeltaNet + gated attention) models."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> Any:
    # Lazy: `import deltaserve.model` (tests, tools) must not pull in the whole engine.
    if name == "LLM":
        from deltaserve.engine.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from deltaserve import sampling

        return getattr(sampling, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from deltaserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'deltaserve' has no attribute {name!r}")
