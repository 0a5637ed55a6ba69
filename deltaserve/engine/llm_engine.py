"""LLMEngine: requests in, one scheduled forward per step(), incremental RequestOutputs out."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from deltaserve.cache.manager import CacheManager, CacheUsage
from deltaserve.cache.prefix_cache import PrefixCacheStats
from deltaserve.cache.sizing import CacheOptions, CacheSizeError, plan_cache
from deltaserve.cache.snapshots import SnapshotPool, SnapshotStore
from deltaserve.cache.tensors import allocate_cache, kv_cache_torch_dtype
from deltaserve.config import ModelConfig
from deltaserve.engine.config import SPECULATION_AUTO, EngineConfig, EngineConfigError
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.encoder_cache import EncoderCache, encoder_cache_tokens
from deltaserve.engine.image_processor import ImageProcessor
from deltaserve.engine.logits_head import LogitsHead
from deltaserve.engine.media import VIDEO_NOT_SUPPORTED
from deltaserve.engine.multimodal import MultiModalError, MultiModalPrompt, build_multimodal_prompt
from deltaserve.engine.output_processor import OutputProcessor
from deltaserve.engine.request import Request, RequestGroup, RequestStatus
from deltaserve.engine.runner import ModelRunner
from deltaserve.engine.sampler import Sampler, make_sampling_state, validate_params_for_vocab
from deltaserve.engine.scheduler import PREFILL, Scheduler, SchedulerOutput
from deltaserve.engine.spec_decode import SpecDecoder
from deltaserve.engine.spec_default import auto_speculative_config
from deltaserve.engine.spec_policy import DraftPolicy, spec_clock
from deltaserve.engine.structured import GrammarCompiler
from deltaserve.engine.threads import set_compute_threads
from deltaserve.executor import make_executor, start_tensor_parallel
from deltaserve.model.decoder import Qwen3_5ForCausalLM
from deltaserve.model.loader import load_model, release_idle_heap
from deltaserve.model.sharding import rank_config
from deltaserve.ops.fused_ext import release_step_memory
from deltaserve.outputs import RequestOutput, SpecDecodeMetrics
from deltaserve.sampling import SamplingParams

log = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class PromptTooLongError(ValueError):
    """The prompt has more tokens than max_model_len allows."""


@dataclass(slots=True)
class EngineStats:
    num_steps: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    cache: CacheUsage
    prompt_tokens: int  # tokens run through the model as prompt/recompute chunks, all steps
    generation_tokens: int  # tokens sampled, all steps
    spec: SpecDecodeMetrics | None = None  # speculative decoding counters (None without speculation)
    prefix_cache: PrefixCacheStats | None = None  # prefix cache counters (None without prefix caching)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, model: Qwen3_5ForCausalLM | None = None, tokenizer: Any | None = None
    ) -> None:
        self.config = config
        torch.manual_seed(config.seed)  # unseeded random sampling draws from the global generator
        set_compute_threads(config.num_threads)
        dtype = torch.float32 if config.dtype == "auto" else TORCH_DTYPES[config.dtype]
        path = self._model_path()
        if config.speculative_config == SPECULATION_AUTO:  # by the checkpoint; the config keeps what was chosen
            config = self.config = replace(config, speculative_config=auto_speculative_config(path, model))
        k = config.num_speculative_tokens
        tp = config.tensor_parallel_size
        if tp > 1:
            if model is not None:
                raise EngineConfigError(
                    f"tensor_parallel_size={tp} loads each rank's shard from the checkpoint: pass a model path, "
                    "not a model object"
                )
            # The shards are loaded with the cache below; an indivisible shape fails here, before any start.
            self.model_config = ModelConfig.from_file(path)
        else:
            # Speculation drafts with the checkpoint's MTP head: the loader names a checkpoint without mtp.*.
            self.model = model if model is not None else load_model(
                path, config.dtype, with_mtp=k > 0, **config.weight_options)
            if k and self.model.mtp is None:
                raise EngineConfigError(
                    "speculative_config method 'mtp' needs the model's MTP head, and this model has none "
                    "(no mtp.* tensors); drop speculative_config"
                )
            self.model_config = self.model.config
        rank_cfg = rank_config(self.model_config, tp)  # each rank's heads: the cache budget is per rank
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(path)
        kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
        try:
            plan = plan_cache(rank_cfg, kv_dtype, CacheOptions.of(config), with_mtp=k > 0)
        except CacheSizeError as e:
            raise EngineConfigError(str(e)) from None
        self.max_model_len = plan.max_model_len
        if tp > 1:
            self.executor = start_tensor_parallel(
                str(path), config.dtype, tp, weight_options=config.weight_options, with_mtp=k > 0,
                num_blocks=plan.num_blocks, block_size=config.block_size,
                num_slots=plan.num_slots, kv_dtype=kv_dtype, enforce_eager=config.enforce_eager,
                num_snapshots=plan.num_snapshots,
            )
            self.model, self.cache_tensors = self.executor.model, self.executor.cache  # rank 0's shard
            store = self.executor.snapshots  # every rank has its entries; the pool below picks them
        else:
            self.cache_tensors = allocate_cache(
                self.model_config, plan.num_blocks, config.block_size, plan.num_slots, kv_dtype, with_mtp=k > 0
            )
            self.executor = make_executor(
                self.model, self.cache_tensors, enforce_eager=config.enforce_eager, with_mtp=k > 0
            )
            store = SnapshotStore(self.cache_tensors, plan.num_snapshots) if plan.num_snapshots else None
        try:  # under tensor parallelism from rank 0's model, which holds the vision tower
            self.image_processor, self.encoder_cache = self._vision_inputs(path)
        except EngineConfigError:
            self.executor.close()  # the workers started already
            raise
        snapshots = None if store is None else SnapshotPool(store)
        self.cache = CacheManager(
            plan.num_blocks, config.block_size, plan.num_slots, snapshots, config.mamba_block_size, with_mtp=k > 0
        )
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = sorted(eos)
        self.output_processor = OutputProcessor(self.eos_token_ids, self.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.scheduler = Scheduler(
            self.cache, config.max_num_seqs, config.max_num_batched_tokens, self.output_processor, k,
            encoder_cache=self.encoder_cache,
        )
        sampler = Sampler(self.eos_token_ids)
        head = LogitsHead(self.executor.compute_logits, self.executor.greedy_tokens, self.executor.masked_greedy_tokens)
        spec = None
        self.spec_metrics: SpecDecodeMetrics | None = None
        self._policy: DraftPolicy | None = None  # set with adaptive k, which the steps' costs feed
        if k:
            policy = DraftPolicy(k, adaptive=config.adaptive_speculation)
            self._policy = policy if policy.adaptive else None
            spec = SpecDecoder(self.executor, self.cache, sampler, k, self.max_model_len, head, policy)
            self.spec_metrics = SpecDecodeMetrics(accepted_per_position=[0] * k)
        self.runner = ModelRunner(
            self.executor, self.cache_tensors, self.cache, sampler, head, spec, encoder_cache=self.encoder_cache
        )
        self.groups: dict[str, RequestGroup] = {}
        self.requests: dict[str, Request] = {}
        self._aborted_outputs: list[RequestOutput] = []
        self.num_steps = 0
        self.last_schedule: SchedulerOutput | None = None
        # Called after every step with its SchedulerOutput (metrics, the inspector's step trace).
        self.step_listeners: list[Callable[[SchedulerOutput], None]] = []
        # Called for every accepted request with images: its id, its expanded prompt ids and its images with
        # their mRoPE positions (the inspector's vision panel).
        self.multimodal_listeners: list[Callable[[str, list[int], MultiModalPrompt], None]] = []

    def _vision_inputs(self, path: Path) -> tuple[ImageProcessor | None, EncoderCache | None]:
        """The image processor (the checkpoint's preprocessor_config.json) and the encoder cache, for a model
        whose vision tower is loaded; (None, None) for a text-only one."""
        vision = self.model_config.vision
        if self.model.visual is None:
            return None, None
        processor = ImageProcessor.from_dir(path, vision.patch_size, vision.temporal_patch_size,
                                            vision.spatial_merge_size)
        mine = (processor.patch_size, processor.temporal_patch_size, processor.merge_size)
        tower = (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
        if mine != tower:
            raise EngineConfigError(
                f"preprocessor_config.json cuts (patch, temporal patch, merge) = {mine}, but the vision tower "
                f"takes {tower}"
            )
        capacity = encoder_cache_tokens(self.config.max_num_batched_tokens, processor.max_tokens_per_image)
        row_bytes = vision.out_hidden_size * self.model.activation_dtype.itemsize  # one merged token's output
        return processor, EncoderCache(capacity, row_bytes)

    def _model_path(self) -> Path:
        if self.config.model is not None:
            return Path(self.config.model)
        from deltaserve.assets import demo_checkpoint_path

        return demo_checkpoint_path()

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | None = None,
    ) -> None:
        """Queue a request. prompt: text, token ids, or {"prompt_token_ids": [...]} / {"prompt": text}; a dict
        may carry "cache_salt" (vLLM's): only prompts with the same salt share cached prefixes."""
        params = params or SamplingParams()
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        # The cache is keyed by the sequence ids: two live sequences with one id would share blocks and a slot.
        taken = [rid for rid in (request_id, *child_ids) if rid in self.groups or rid in self.requests]
        if taken:
            raise ValueError(f"request_id {taken[0]!r} is already in use")
        text, ids = self._tokenize(prompt)
        ids, mm = self._multimodal(prompt, ids)
        self._validate_prompt(ids)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        validate_params_for_vocab(params, self.model_config.vocab_size)
        # structured outputs: compiled once per request (GrammarError, a ValueError, names a bad schema)
        grammar = None if params.structured_outputs is None else self.grammars.compile(params.structured_outputs)
        group = RequestGroup(request_id, text, ids, params)
        for i, child_id in enumerate(child_ids):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            req = Request(
                request_id=child_id,
                prompt_token_ids=ids,
                params=params,
                sampling=make_sampling_state(params, ids, seed_offset=i, grammar=grammar),
                detokenizer=detok,
                group=group,
                index=i,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
                cache_salt=salt,
                image_spans=[] if mm is None else [(im.offset, im.end, im.hash) for im in mm.images],
            )
            req.sampling.output_token_ids = req.output_token_ids  # one list: penalties read what we append
            if self.spec_metrics is not None:
                k = self.config.num_speculative_tokens
                req.spec_metrics = SpecDecodeMetrics(accepted_per_position=[0] * k)
            req.metrics.arrival_time = group.arrival_time
            group.children.append(req)
            self.requests[child_id] = req
            if mm is not None:
                self.encoder_cache.add(child_id, mm)
            self.scheduler.add(req)
        self.groups[request_id] = group
        if mm is not None:
            for listener in self.multimodal_listeners:
                listener(request_id, ids, mm)

    def _multimodal(self, prompt: Any, ids: list[int]) -> tuple[list[int], MultiModalPrompt | None]:
        """A prompt dict's multi_modal_data (vLLM's: {"image": a PIL image or a list of them}): the ids with
        the image placeholders expanded, and the images; (ids, None) without images."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is None:
            return ids, None
        if not isinstance(data, dict):
            raise MultiModalError(f"multi_modal_data must be a dict like {{'image': image}}, got {type(data).__name__}")
        if "video" in data:
            raise MultiModalError(f"multi_modal_data 'video': {VIDEO_NOT_SUPPORTED}")
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise MultiModalError(
                f"multi_modal_data {unknown} is not supported: deltaserve takes images only ('image'); video "
                "and audio inputs are not implemented"
            )
        images = data.get("image")
        images = list(images) if isinstance(images, list | tuple) else [images]
        if not images:
            return ids, None
        limit = (self.config.limit_mm_per_prompt or {}).get("image")
        vision = self.model_config.vision if self.encoder_cache is not None else None
        return build_multimodal_prompt(ids, images, vision, self.image_processor, limit)

    def _tokenize(self, prompt: str | list[int] | dict[str, Any]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(
                    f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
                )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "this model directory has no tokenizer.json; pass prompt_token_ids instead of text"
                )
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple):
            return None, [int(t) for t in prompt]
        raise TypeError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty; it needs at least one token")
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens, longer than max_model_len={self.max_model_len}"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop a request (all its n sequences) now and free its cache; its final output, finish_reason
        "abort", comes from the next step(). Unknown or finished ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            for req in group.children:
                if not req.is_finished:
                    self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                    req.metrics.finished_time = time.monotonic()
                self.requests.pop(req.request_id, None)
            self._aborted_outputs.append(group.output())

    def discard_pending_outputs(self) -> None:
        """Drop the final outputs of aborted requests that no one will read."""
        self._aborted_outputs.clear()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._aborted_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    def check_health(self) -> None:
        """Raise if steps can no longer run (a tensor-parallel rank died): the server's /health asks."""
        self.executor.check_health()

    def close(self) -> None:
        """Stop what the executor started (tensor-parallel workers); the engine runs no step after it."""
        self.executor.close()

    # ---- the loop -------------------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One scheduled forward. Returns a RequestOutput for every request that got tokens (streaming
        needs them), or with finished_only only for requests that finished (as vLLM's FINAL_ONLY output
        kind, which LLM.generate uses): building the others' outputs copies every token list every step."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        started = spec_clock() if self._policy is not None else 0.0
        sched = self.scheduler.schedule()
        self.last_schedule = sched
        if sched.is_empty:
            return outputs
        self.num_steps += 1
        out = self.runner.execute(sched)
        for rid, v in out.verified.items():
            req = self.requests[rid]
            k = len(req.spec_metrics.accepted_per_position)
            req.spec_metrics.record(v.num_drafted, v.num_accepted, k)
            self.spec_metrics.record(v.num_drafted, v.num_accepted, k)
        touched = {req.group.request_id: req.group for req in self.scheduler.update_from_output(sched, out)}
        for group in touched.values():
            if group.finished or not finished_only:
                outputs.append(group.output())
            if group.finished:
                del self.groups[group.request_id]
                for req in group.children:
                    self.requests.pop(req.request_id, None)
        for listener in self.step_listeners:
            listener(sched)
        if self._policy is not None and all(s.kind != PREFILL for s in sched.scheduled):
            # Adaptive k weighs a step's rows against its time (spec_clock), everything but the drafting it prices
            # apart (scheduling and output handling too: they grow with the tokens a step emits). Only steps of
            # decode and verify rows, the steps it prices: a prompt chunk's rows cost otherwise than verify rows
            # (no per-position GDN states, one sampled row).
            spent = spec_clock() - started - self.runner.spec.draft_seconds
            self._policy.record_step(sched.num_tokens, spent)
        if not self.has_unfinished_requests():
            release_idle_heap()  # idle: the steps' freed activations go back to the system
            release_step_memory()
        return outputs

    @property
    def prompt_tokens(self) -> int:
        """Tokens run through the model as prompt/recompute chunks, all steps."""
        return self.scheduler.prompt_tokens

    @property
    def generation_tokens(self) -> int:
        """Tokens generated, all steps."""
        return self.output_processor.generation_tokens

    def stats(self) -> EngineStats:
        return EngineStats(
            num_steps=self.num_steps,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            cache=self.cache.usage(),
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            spec=None if self.spec_metrics is None else copy.deepcopy(self.spec_metrics),
            prefix_cache=None if self.cache.prefix is None else copy.copy(self.cache.prefix.stats),
        )


def _load_tokenizer(path: Path) -> Any | None:
    """The checkpoint's tokenizer, or None when it ships none (random test checkpoints)."""
    if not (path / "tokenizer.json").exists():
        return None
    from deltaserve.tokenizer import Tokenizer

    return Tokenizer.from_dir(path)
