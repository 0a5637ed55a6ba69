"""Load a checkpoint directory (config.json + safetensors) into Qwen3_5ForCausalLM.

Accepted layouts: the official one (`model.language_model.*`, `model.visual.*`, `lm_head.weight`, `mtp.*`)
and the `*ForCausalLM` one (`model.*`). `model.visual.*` is skipped (no vision tower yet). FP8
block-quantized weights (`quantization_config.quant_method == "fp8"`) are dequantized on load with their
`weight_scale_inv` (one scale per block). A missing, unexpected or mis-shaped tensor is an error naming it.

Some checkpoint tensors fill part of a parameter, or several (deltaserve/model/checkpoint_names.py): MoE
experts come fused into 3-D tensors (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, the bf16
releases) or one tensor per expert (`mlp.experts.N.gate_proj.weight`, ..., the FP8 releases and
transformers' own save), both into the same 3-D parameters; Qwen3-Next's fused GDN projections
`in_proj_qkvz` / `in_proj_ba` are split into in_proj_qkv, in_proj_z, in_proj_b and in_proj_a.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from deltaserve.config import ModelConfig
from deltaserve.model.checkpoint_names import (
    CheckpointError,
    Target,
    coverage_problems,
    exists,
    split,
    targets,
    view,
)
from deltaserve.model.decoder import Qwen3_5ForCausalLM
from deltaserve.model.parallel import SINGLE, Shard
from deltaserve.model.sharding import RankPart, rank_part, rank_slice

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = cfg.torch_dtype if dtype in (None, "auto") else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; accepted: float32, bfloat16, float16, auto")
    return DTYPES[name]


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")
    names: dict[str, Path] = {}
    for file in files:
        for name in _open(file).keys():
            names[name] = file
    return names


def _open(file: Path):
    if not file.exists():
        raise CheckpointError(f"checkpoint file {file} is missing")
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"checkpoint file {file} is not a readable safetensors file: {e}") from e


def map_name(name: str) -> str | None:
    """Checkpoint tensor name -> our parameter name (None: skipped on purpose)."""
    if name.startswith("model.visual."):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def iter_tensors(
    path: Path, names: dict[str, Path], keys: list[str], parts: dict[str, RankPart] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """parts: for a tensor-parallel rank, the part of each split tensor to read (only that part is read)."""
    parts = parts or {}
    handles: dict[Path, object] = {}
    for key in tqdm(keys, desc=f"loading {path.name}", unit="tensor", leave=False):
        file = names[key]
        if file not in handles:
            handles[file] = _open(file)
        try:
            part = parts.get(key)
            yield key, handles[file].get_tensor(key) if part is None else part.take(handles[file].get_slice(key))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"tensor {key!r} in {file} cannot be read: {e}") from e


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """W[i, j] = fp8[i, j] * scale_inv[i // bi, j // bj]; a 3-D tensor (experts) expert by expert."""
    if weight.dim() == 3:
        return torch.stack([dequantize_fp8(w, s, block) for w, s in zip(weight, scale_inv, strict=True)])
    bi, bj = block
    scale = scale_inv.float().repeat_interleave(bi, 0).repeat_interleave(bj, 1)
    return weight.float() * scale[: weight.shape[0], : weight.shape[1]]


def load_model(
    path: str | Path, dtype: str | torch.dtype | None = None, with_mtp: bool | None = None,
    shard: Shard = SINGLE,
) -> Qwen3_5ForCausalLM:
    """Build the model from a checkpoint directory. with_mtp None: load the MTP head when present.
    shard: with size N > 1, build rank shard.rank's part and keep each tensor's rank slice (rank_slice);
    a shape that does not split into N gets a ConfigError naming the heads and N."""
    path = Path(path)
    cfg = ModelConfig.from_file(path)
    torch_dtype = resolve_dtype(dtype, cfg)
    names = checkpoint_files(path)
    has_mtp = any(n.startswith("mtp.") for n in names)
    if with_mtp and not has_mtp:
        raise CheckpointError(f"{path} has no mtp.* tensors, so it cannot draft with its MTP head")
    load_mtp = has_mtp if with_mtp is None else with_mtp
    if cfg.vision is not None and any(n.startswith("model.visual.") for n in names):
        log.info("skipping the vision tower (model.visual.*): deltaserve serves text only for now")

    model = Qwen3_5ForCausalLM(cfg, with_mtp=load_mtp, shard=shard)
    params = dict(model.named_parameters(remove_duplicate=False))
    quant = cfg.quantization_config or {}
    fp8 = quant.get("quant_method") == "fp8"
    block = list(quant.get("weight_block_size") or [128, 128])

    wanted: dict[str, list[Target]] = {}  # checkpoint name -> the parameters (or parts) it fills
    unexpected = []
    arch = cfg.architecture
    for name in names:
        if name.endswith("_scale_inv") and fp8:
            continue
        if name.startswith("mtp.") and not load_mtp:
            continue
        target = map_name(name)
        if target is None:
            continue
        if target == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the embedding is the head
        found = targets(target, arch)
        if not all(exists(t, params) for t in found):
            unexpected.append(name)
            continue
        wanted[name] = found
    if unexpected:
        raise CheckpointError(
            f"unexpected tensor(s) in checkpoint {path}: {', '.join(sorted(unexpected)[:5])}"
            + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        )
    skip = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    problems = coverage_problems({n: p for n, p in params.items() if n not in skip}, wanted.values())
    if problems:
        raise CheckpointError(
            f"checkpoint {path} is missing tensor(s): {', '.join(problems[:5])}"
            + (f" and {len(problems) - 5} more" if len(problems) > 5 else "")
        )

    # A rank reads only its part of each split tensor, by the tensor's own name (one expert's, a fused GDN
    # projection's); fp8 weights are read whole, since their scales come in blocks, and sliced once dequantized.
    parts = {}
    if shard.size > 1 and not fp8:
        for n in wanted:
            if (part := rank_part(map_name(n), cfg, shard.rank, shard.size)) is not None:
                parts[n] = part
    with torch.no_grad():
        for name, tensor in iter_tensors(path, names, list(wanted), parts):
            if fp8 and tensor.dtype == torch.float8_e4m3fn:
                scale_name = name + "_scale_inv"  # x.weight -> x.weight_scale_inv; 3-D experts: x_scale_inv
                if scale_name not in names:
                    raise CheckpointError(f"fp8 tensor {name!r} has no {scale_name!r}")
                scale = _open(names[scale_name]).get_tensor(scale_name)
                tensor = dequantize_fp8(tensor, scale, block)
            found = wanted[name]
            if fp8 and shard.size > 1:
                tensor = rank_slice(map_name(name), tensor, cfg, shard.rank, shard.size)
            for t, piece in zip(found, split(name, tensor, model.rank_config, found), strict=True):
                dest = view(params[t.param], t)
                if tuple(piece.shape) != tuple(dest.shape):
                    raise CheckpointError(
                        f"tensor {name!r} has shape {tuple(piece.shape)}, expected {tuple(dest.shape)} "
                        f"for {t.describe()} from config.json"
                    )
                dest.copy_(piece.to(dest.dtype))
    model = model.to(torch_dtype)
    model.eval()
    return model
