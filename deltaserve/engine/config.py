"""EngineConfig: how the engine runs a model (lengths, batch limits, cache budget), validated up front."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltaserve.cache.dtypes import engine_kv_cache_dtype
from deltaserve.cache.sizing import DEFAULT_CACHE_MEMORY_FRACTION
from deltaserve.config import UnsupportedFeatureError
from deltaserve.ops.activation_quant import resolve_activation_quantization
from deltaserve.ops.formats import QUANTIZATIONS, WeightFormat

# speculative_config's default: on or off by the checkpoint (engine/spec_default.py)
SPECULATION_AUTO = "auto"
DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


class EngineConfigError(ValueError):
    """An engine option with a value the engine cannot use; the message names option, value and what fits."""


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # checkpoint directory; None = the embedded demo checkpoint
    dtype: str = "auto"  # activations; "auto" = float32 on CPU, weights as the checkpoint stores them
    # Weight format of the projections (vLLM's name): None keeps the checkpoint's (bf16 stays bf16, an FP8
    # release stays fp8); "fp8", "int8" or "int4" quantizes them as they load (deltaserve/ops/formats.py).
    quantization: str | None = None
    quantization_group_size: int | None = None  # columns per scale for int8 / int4 (default 32)
    quantize_lm_head: bool = True  # False: --quantization leaves lm_head in the checkpoint's format
    # "int8": int8 / int4 projections quantize their input rows to int8 per group too and sum integer products
    # (llama.cpp's Q8 activations; deltaserve/ops/activation_quant.py); "none": they multiply the float rows.
    # None: "int8" for quantization int8 / int4, else "none" ("int8" for other weights is an error).
    activation_quantization: str | None = None
    max_model_len: int | None = None  # None = the model's max_position_embeddings, if the cache holds it
    max_num_seqs: int = 64
    # One step's token budget. Larger chunks prefill faster on CPU; decode steps never come near it.
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    # Bytes for KV blocks + GDN state slots; capped by what max_num_seqs sequences of max_model_len need.
    # None: cache_memory_fraction of the memory available once the weights are loaded (cache/sizing.py).
    kv_cache_memory: int | None = None
    cache_memory_fraction: float = DEFAULT_CACHE_MEMORY_FRACTION
    num_kv_blocks: int | None = None  # force the block count (tests of cache pressure); overrides memory
    # Reuse cached prefixes (KV blocks + GDN snapshots). None (the default): on, unless the snapshot pool
    # does not fit in kv_cache_memory (then off, with a warning); True: on, and that is an error.
    enable_prefix_caching: bool | None = None
    # How GDN state is cached for prefix caching (vLLM's flag): "align" snapshots it at block boundaries;
    # "none" means align once prefix caching is on (as vLLM sets it for this family); "all" is refused.
    mamba_cache_mode: str = "none"
    # Tokens between GDN snapshots of a long prompt (vLLM's name; a multiple of block_size). None: 32 blocks.
    mamba_block_size: int | None = None
    num_gdn_snapshots: int | None = None  # GDN snapshot pool size (default 4 * max_num_seqs)
    # {"method": "mtp", "num_speculative_tokens": k, "adaptive": True}: MTP drafting of up to k tokens per
    # step, as many as measure to pay per request (adaptive, the default) or always k. None: off. "auto" (the
    # default): adaptive, up to 3, for a checkpoint with an MTP head whose weights stream from memory, else
    # off (engine/spec_default.py); the engine replaces it with what it chose.
    speculative_config: dict[str, Any] | str | None = SPECULATION_AUTO
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    seed: int = 0
    # Compute threads of the kernels; None: OMP_NUM_THREADS, else one per physical core (engine/threads.py).
    num_threads: int | None = None
    # True: every step runs the Python model op by op. False: steps run the fused C++ step when the model
    # and cache are float32 (deltaserve/executor; vLLM's name for "no graphs / compilation").
    enforce_eager: bool = False
    # Most items of each modality one prompt may carry (vLLM's --limit-mm-per-prompt); None: no limit.
    limit_mm_per_prompt: dict[str, int] | None = None

    @property
    def num_speculative_tokens(self) -> int:
        """k drafts per step with MTP speculation, 0 without (once "auto" is resolved)."""
        spec = self.speculative_config
        if spec == SPECULATION_AUTO:
            raise RuntimeError('speculative_config "auto" is resolved by the engine (spec_default.py) first')
        return 0 if spec is None else int(spec["num_speculative_tokens"])

    @property
    def adaptive_speculation(self) -> bool:
        """Whether each request drafts 0..k tokens per step as its measured acceptance and the measured
        step costs make pay (deltaserve/engine/spec_policy.py), rather than always k."""
        spec = self.speculative_config
        return self.num_speculative_tokens > 0 and bool(spec.get("adaptive", True))

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise EngineConfigError(f"{name} must be a positive integer, got {value!r}")

        for name in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "kv_cache_memory",
            "num_kv_blocks",
            "tensor_parallel_size",
            "num_threads",
        ):
            positive(name)
        if self.dtype not in DTYPES:
            raise EngineConfigError(f"dtype {self.dtype!r} is not supported; accepted: {', '.join(DTYPES)}")
        self._check_quantization()
        if not 0 < self.cache_memory_fraction <= 1:
            raise EngineConfigError(f"cache_memory_fraction must be in (0, 1], got {self.cache_memory_fraction!r}")
        try:
            engine_kv_cache_dtype(self.kv_cache_dtype)
        except ValueError as e:
            raise EngineConfigError(str(e)) from None
        self._check_prefix_caching()
        self._check_mm_limits()
        if self.speculative_config is not None:
            validate_speculative_config(self.speculative_config)

    def _check_quantization(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise EngineConfigError(
                f"quantization {self.quantization!r} is not supported; accepted: {', '.join(QUANTIZATIONS)}")
        if self.quantization_group_size is not None:
            if self.quantization not in ("int8", "int4"):
                raise EngineConfigError("quantization_group_size applies to quantization int8 or int4, "
                                        f"not {self.quantization!r}")
            try:
                WeightFormat.of(self.quantization, self.quantization_group_size)
            except ValueError as e:
                raise EngineConfigError(str(e)) from None
        try:
            self.activation_quantization = resolve_activation_quantization(self.activation_quantization,
                                                                           self.quantization)
        except ValueError as e:
            raise EngineConfigError(str(e)) from None

    @property
    def weight_options(self) -> dict[str, Any]:
        """load_model's weight arguments."""
        return {"quantization": self.quantization, "group_size": self.quantization_group_size,
                "quantize_lm_head": self.quantize_lm_head, "activation_quantization": self.activation_quantization}

    def _check_prefix_caching(self) -> None:
        for name in ("mamba_block_size", "num_gdn_snapshots"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise EngineConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise EngineConfigError(
                f"mamba_cache_mode {self.mamba_cache_mode!r} is not known; accepted: {', '.join(MAMBA_CACHE_MODES)}"
            )
        if self.mamba_cache_mode == "all":
            raise UnsupportedFeatureError(
                "this model does not support 'all' prefix caching, please use '--mamba-cache-mode=align' instead"
            )
        if self.mamba_cache_mode == "align" and self.enable_prefix_caching is False:
            raise EngineConfigError("mamba_cache_mode='align' caches GDN states for prefix caching; "
                                    "drop enable_prefix_caching=False or mamba_cache_mode")
        if self.mamba_block_size is None:
            self.mamba_block_size = 32 * self.block_size
        if self.mamba_block_size % self.block_size:
            raise EngineConfigError(
                f"mamba_block_size={self.mamba_block_size} must be a multiple of block_size={self.block_size}"
            )
        if self.enable_prefix_caching is not False:
            self.mamba_cache_mode = "align"


    def _check_mm_limits(self) -> None:
        limits = self.limit_mm_per_prompt
        if limits is None:
            return
        if not isinstance(limits, dict):
            raise EngineConfigError(f'limit_mm_per_prompt must be a dict like {{"image": 2}}, got {limits!r}')
        unknown = sorted(set(limits) - set(MM_MODALITIES))
        if unknown:
            raise EngineConfigError(
                f"limit_mm_per_prompt names {unknown}; accepted: {', '.join(MM_MODALITIES)} (video is not supported)"
            )
        for key, value in limits.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise EngineConfigError(f"limit_mm_per_prompt[{key!r}] must be an integer >= 0, got {value!r}")


MM_MODALITIES = ("image",)
MAMBA_CACHE_MODES = ("none", "align", "all")
SPEC_METHODS = ("mtp",)


SPEC_KEYS = ("method", "num_speculative_tokens", "adaptive")


def validate_speculative_config(spec: Any) -> None:
    """{"method": "mtp", "num_speculative_tokens": k, "adaptive": true}: the model's own MTP head drafts up
    to k tokens per step; with "adaptive" (the default) as many as pay for each request, else always k. Or
    "auto" (engine/spec_default.py)."""
    if spec == SPECULATION_AUTO:
        return
    if not isinstance(spec, dict):
        raise EngineConfigError(
            f'speculative_config must be "auto", None (off) or a dict like {{"method": "mtp", '
            f'"num_speculative_tokens": 2}}, got {type(spec).__name__} {spec!r}'
        )
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise EngineConfigError(f"speculative_config has unknown keys {unknown}; accepted: {', '.join(SPEC_KEYS)}")
    method = spec.get("method")
    if method not in SPEC_METHODS:
        raise EngineConfigError(
            f"speculative_config.method {method!r} is not supported; accepted: {', '.join(SPEC_METHODS)}"
        )
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise EngineConfigError(
            f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}"
        )
    if not isinstance(spec.get("adaptive", True), bool):
        raise EngineConfigError(f"speculative_config.adaptive must be true or false, got {spec['adaptive']!r}")
