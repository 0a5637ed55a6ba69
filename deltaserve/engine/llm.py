"""LLM: the offline entry point (vLLM's names): build an engine, run prompts to completion, return
RequestOutputs in input order."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deltaserve.assets import demo_checkpoint_path
from deltaserve.cache.sizing import DEFAULT_CACHE_MEMORY_FRACTION
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.generation_config import generation_defaults
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.engine.media import MediaOptions, content_parts, load_image, render_parts
from deltaserve.outputs import RequestOutput
from deltaserve.sampling import SamplingParams

PromptType = str | dict[str, Any] | list[int]
Message = dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        quantization: str | None = None,
        quantization_group_size: int | None = None,
        quantize_lm_head: bool = True,
        activation_quantization: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool | None = None,
        mamba_cache_mode: str = "none",
        mamba_block_size: int | None = None,
        num_gdn_snapshots: int | None = None,
        speculative_config: dict[str, Any] | str | None = "auto",
        tensor_parallel_size: int = 1,
        kv_cache_dtype: str = "auto",
        kv_cache_memory: int | None = None,
        cache_memory_fraction: float = DEFAULT_CACHE_MEMORY_FRACTION,
        seed: int = 0,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        enforce_eager: bool = False,
        num_threads: int | None = None,
        generation_config: str = "auto",
        limit_mm_per_prompt: dict[str, int] | None = None,
        allowed_local_media_path: str | None = None,
    ) -> None:
        self.config = EngineConfig(
            model=None if model is None else str(model),
            dtype=dtype,
            quantization=quantization,
            quantization_group_size=quantization_group_size,
            quantize_lm_head=quantize_lm_head,
            activation_quantization=activation_quantization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            mamba_cache_mode=mamba_cache_mode,
            mamba_block_size=mamba_block_size,
            num_gdn_snapshots=num_gdn_snapshots,
            speculative_config=speculative_config,
            tensor_parallel_size=tensor_parallel_size,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory=kv_cache_memory,
            cache_memory_fraction=cache_memory_fraction,
            seed=seed,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            enforce_eager=enforce_eager,
            num_threads=num_threads,
            limit_mm_per_prompt=limit_mm_per_prompt,
        )
        self.engine = LLMEngine(self.config)
        # LLM.chat's image_url parts: file: URLs only below this folder (vLLM's allowed_local_media_path).
        self.media = MediaOptions(None if allowed_local_media_path is None else Path(allowed_local_media_path))
        self._ids = itertools.count()
        model_dir = Path(model) if model is not None else demo_checkpoint_path()
        # As vLLM: what generate uses without sampling_params ("auto": the model's generation_config.json).
        self._default_params = generation_defaults(model_dir, generation_config)

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self._default_params)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """prompts: a string, a list of strings, {"prompt_token_ids": [...]} or a list of those; a dict may
        carry "multi_modal_data": {"image": PIL image or list} with one <|image_pad|> per image in the prompt."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} sampling_params for {len(prompts)} prompts; "
                    "pass one, or one per prompt"
                )
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)  # nothing half-queued stays behind in the engine
            self.engine.discard_pending_outputs()
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or a list of conversations; tools
        (OpenAI's function specs) go to the chat template, as in vLLM's LLM.chat. Content may be a list of
        parts: text, image_url (data:, http(s): or allowed file: URLs) and image_pil (a PIL image)."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model directory has no tokenizer.json, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = []
        for c in conversations:
            convo, images = self._with_images(c)
            text = tok.apply_chat_template(
                convo, add_generation_prompt=add_generation_prompt, tools=tools, **(chat_template_kwargs or {})
            )
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if images else text)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _with_images(self, conversation: list[Message]) -> tuple[list[Message], list[Any]]:
        """Messages whose content parts are rendered to text (images as their placeholders), and the images."""
        convo, images = [], []
        for i, m in enumerate(conversation):
            if not isinstance(m.get("content"), list):
                convo.append(m)
                continue
            parts = content_parts(m["content"], f"messages[{i}].content")
            for j, (kind, value) in enumerate(parts):
                if kind == "image_url":
                    images.append(load_image(value, f"messages[{i}].content[{j}]", self.media))
                elif kind == "image_pil":
                    images.append(value)
            convo.append({**m, "content": render_parts(parts)})
        return convo, images

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req")
        try:
            while len(final) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step(finished_only=True):
                    if out.finished and out.request_id in wanted:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            # An interrupted generate must not leave its requests holding cache for the next call.
            self.engine.abort_request([i for i in ids if i not in final])
            self.engine.discard_pending_outputs()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[i] for i in ids]
