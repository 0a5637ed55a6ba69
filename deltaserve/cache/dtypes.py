"""The one table of dtype names and sizes that cache sizing, the planner, the engine's options and the CLI
share. Free of torch, so that building the CLI parser does not import it."""

from __future__ import annotations

DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}
_ALIASES = {
    "fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
    "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
}
# What `deltaserve plan` sizes (vLLM's --kv-cache-dtype choices) ...
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
# ... and what this engine's caches hold ('auto': the model's dtype; 'fp8' is 'fp8_e4m3', as in vLLM).
# fp8_e5m2 is refused: E4M3's extra mantissa bit is the better trade once every row has its own scale.
ENGINE_KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp8_e4m3")
# An fp8 KV cache keeps one fp32 scale per (token, kv head) of K and of V (deltaserve/ops/attention.py).
KV_SCALE_BYTES = 4


def normalize_dtype(dtype) -> str:
    """'bfloat16' / torch.bfloat16 / 'bf16' -> 'bfloat16'; raises ValueError naming an unknown dtype."""
    name = dtype.lower() if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not known; accepted: {', '.join(DTYPE_BYTES)}")
    return name


def dtype_bytes(dtype) -> int:
    return DTYPE_BYTES[normalize_dtype(dtype)]


def resolve_kv_cache_dtype(kv_cache_dtype, model_dtype) -> str:
    """'auto' means the model's activation dtype, as in vLLM."""
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype == "auto":
        return normalize_dtype(model_dtype)
    try:
        return normalize_dtype(kv_cache_dtype)
    except ValueError:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported; accepted: {', '.join(KV_CACHE_DTYPES)}"
        ) from None


def kv_scale_bytes(dtype) -> int:
    """Bytes of K's and V's scales per (token, kv head) in a KV cache of this dtype: 0 unless it is fp8."""
    return 2 * KV_SCALE_BYTES if dtype_bytes(dtype) == 1 else 0


def engine_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """The engine's name for an accepted kv_cache_dtype option; ValueError naming the ones it runs."""
    try:
        name = "auto" if kv_cache_dtype == "auto" else normalize_dtype(kv_cache_dtype)
    except ValueError:
        name = None
    if name not in ENGINE_KV_CACHE_DTYPES:
        why = " (its fp8 KV cache is E4M3: use fp8 or fp8_e4m3)" if name == "fp8_e5m2" else ""
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported by this engine{why}; accepted: "
            f"{', '.join(ENGINE_KV_CACHE_DTYPES)} (and the aliases fp32, bf16)"
        )
    return name
