"""Load a checkpoint directory (config.json + safetensors) into Qwen3_5ForCausalLM.

Accepted layouts: the official one (`model.language_model.*`, `model.visual.*`, `lm_head.weight`, `mtp.*`)
and the `*ForCausalLM` one (`model.*`). `model.visual.*` fills the vision tower (model/vision.py, the same
names under `visual.*`) when config.json has a vision_config (under tensor parallelism on rank 0 only,
whole); without one it is skipped. FP8 block-quantized weights (`quantization_config.quant_method == "fp8"`)
are dequantized on load with their `weight_scale_inv` (one scale per block). A missing, unexpected or
mis-shaped tensor is an error naming it.

Some checkpoint tensors fill part of a parameter, or several (deltaserve/model/checkpoint_names.py): MoE
experts come fused into 3-D tensors (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, the bf16
releases) or one tensor per expert (`mlp.experts.N.gate_proj.weight`, ..., the FP8 releases and
transformers' own save), both into the same 3-D parameters; Qwen3-Next's fused GDN projections
`in_proj_qkvz` / `in_proj_ba` are split into in_proj_qkv, in_proj_z, in_proj_b and in_proj_a.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import math
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
from deltaserve.model.linear import Embedding, StoredWeights, WeightPolicy, store, tie
from deltaserve.model.parallel import SINGLE, Shard
from deltaserve.model.sharding import RankPart, rank_part, rank_slice
from deltaserve.ops.formats import QUANTIZATIONS, WeightFormat, dequantize, fp8_from_blocks, quantize

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


def map_name(name: str, with_vision: bool = False) -> str | None:
    """Checkpoint tensor name -> our parameter name (None: skipped on purpose)."""
    if name.startswith("model.visual."):
        return "visual." + name[len("model.visual."):] if with_vision else None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def iter_tensors(
    path: Path, names: dict[str, Path], keys: list[str], parts: dict[str, RankPart] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """parts: for a tensor-parallel rank, the part of each split tensor to read (only that part is read)."""
    parts = parts or {}
    handles = {file: _open(file) for file in {names[key] for key in keys}}
    sizes = {key: _nbytes(handles[names[key]], key) for key in keys}
    handles.clear()
    with tqdm(total=sum(sizes.values()), desc=f"loading {path.name}", unit="B", unit_scale=True,
              unit_divisor=1024, leave=False) as progress:
        for key in keys:
            file = names[key]
            # A handle per tensor: safetensors maps the file, and the pages a read touches stay resident
            # while the mapping lives; so each mapping lives exactly as long as the tensor read from it
            # (the weight itself when it is kept as read, else until it is converted). Measured: one handle
            # for the whole int8 load of tests/test_load_memory.py kept 756 MB resident, one per tensor 450.
            handle = _open(file)
            try:
                part = parts.get(key)
                yield key, handle.get_tensor(key) if part is None else part.take(handle.get_slice(key))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"tensor {key!r} in {file} cannot be read: {e}") from e
            del handle
            progress.update(sizes[key])


_ITEM_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
               "I8": 1, "U8": 1, "BOOL": 1}


def _nbytes(handle, key: str) -> int:
    """A checkpoint tensor's bytes, from the file's header (for the progress bar)."""
    s = handle.get_slice(key)
    return math.prod(s.get_shape()) * _ITEM_BYTES.get(s.get_dtype(), 4)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """W[i, j] = fp8[i, j] * scale_inv[i // bi, j // bj] (experts too): the fp8 format's own reference."""
    data, scale = fp8_from_blocks(weight, scale_inv, tuple(block))
    return dequantize(data, scale, WeightFormat("fp8", block[1]), weight.shape[-1])


def return_freed_memory() -> None:
    """Have glibc's malloc hand large freed blocks back to the system. By default its mmap threshold rises
    to the size of each large block freed, after which blocks of that size come from the heap and stay
    resident when freed: loading a model that converts its weights (quantizing each tensor through a few
    fp32 temporaries) then kept ~2x the weights' bytes resident (measured: 550 MB for 177 MB of int8
    weights, 382 MB with this). A fixed threshold of 1 MiB keeps every large block its own mapping.
    Process-wide; the fused step sets its own policy when it is built (csrc/parallel.h); a no-op where libc is
    not glibc."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)


def release_idle_heap() -> None:
    """Hand the heap's free memory back to the system (glibc's malloc_trim). While steps run, the fused step
    keeps their freed activations on the heap, up to a 512 MB trim threshold (csrc/parallel.h), so that the
    next step does not fault them in again; once the engine has nothing left to run, that memory is only
    resident (measured: 80-90 MB after the Qwen3.5-0.8B-shaped benchmark's 16-request batch). The engine calls
    this when it goes idle, beside the fused step's own pool of large blocks (ops/fused_ext.py
    release_step_memory); the next burst faults in what it needs once. A no-op where libc is not glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, or None where the C library is another (its malloc has neither mallopt nor malloc_trim)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
QUANTIZE_ROWS = 1024  # rows quantized at once (a multiple of fp8's 128-row blocks)
_SAFETENSORS_FORMATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "fp8"}


def weight_policy(dtype: str | torch.dtype | None, cfg: ModelConfig, quantization: str | None = None,
                  group_size: int | None = None, quantize_lm_head: bool = True,
                  activation_quantization: str | None = None) -> WeightPolicy:
    """dtype None / "auto": activations in float32 (the CPU's), weights as the checkpoint stores them; a
    dtype named: activations and every unquantized weight in it. quantization: fp8 / int8 / int4.
    activation_quantization: "int8" / "bf16" / "none" (deltaserve/ops/activation_quant.py), None its default."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; accepted: {', '.join(QUANTIZATIONS)}")
    explicit = dtype not in (None, "auto")
    compute = resolve_dtype(dtype, cfg) if explicit else torch.float32
    return WeightPolicy(compute, quantization, group_size, explicit, quantize_lm_head, activation_quantization)


def _stored_format(handle, name: str, block: list[int]) -> WeightFormat:
    """The format a checkpoint tensor is stored in (from the file's header, nothing read)."""
    dtype = handle.get_slice(name).get_dtype()
    if dtype not in _SAFETENSORS_FORMATS:
        raise CheckpointError(f"tensor {name!r} has dtype {dtype}, which this engine does not load")
    fmt = _SAFETENSORS_FORMATS[dtype]
    return WeightFormat(fmt, block[1]) if fmt == "fp8" else WeightFormat(fmt)


def _owner(model: torch.nn.Module, param: str) -> tuple[str, torch.nn.Module, str]:
    """(module name, module, attribute) of a parameter name."""
    module_name, _, attr = param.rpartition(".")
    return module_name, model.get_submodule(module_name), attr


def _materialize(model: torch.nn.Module, cfg: ModelConfig, policy: WeightPolicy,
                 stored: dict[str, WeightFormat]) -> None:
    """Give every parameter of the meta-built model its memory: stored weights in the format the policy
    picks for them (from their checkpoint tensors' formats, `stored` by module name), the rest (norms,
    conv, A_log, dt_bias) in the activation dtype; embeddings hand out rows in that dtype."""
    head = model.lm_head
    for name, module in model.named_modules():
        if isinstance(module, Embedding):  # (a tied one too: its rows were handed out in bf16 from a bf16 head)
            module.out_dtype = policy.dtype
        if isinstance(module, StoredWeights):
            if module is model.model.embed_tokens and cfg.tie_word_embeddings:
                continue  # the head's weight, below
            store(module, policy.format_for(name, module, stored.get(name) or WeightFormat("float32")))
            # (int8 / int4 modules use "int8"; "bf16" is the language model's: the vision tower keeps its path)
            visual = name.startswith("model.visual.")
            bf16 = policy.activation_quantization == "bf16"
            module.activation_quantization = "none" if visual and bf16 else policy.activation_quantization
    if cfg.tie_word_embeddings:
        tie(model.model.embed_tokens, head)
    for module in model.modules():
        for attr, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                module.register_parameter(attr, torch.nn.Parameter(
                    torch.empty(p.shape, dtype=policy.dtype), requires_grad=False))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a module that computes a tensor at construction must do it on the CPU (see RotaryEmbedding)
        raise RuntimeError(f"the loader left {', '.join(left[:3])} on the meta device")


def _is_stored_weight(module: torch.nn.Module, attr: str) -> bool:
    """Whether module.attr is a stored weight (in a weight format), not a plain parameter such as a bias."""
    return isinstance(module, StoredWeights) and attr in module.WEIGHTS


def _fill(dest: torch.nn.Module, attr: str, t: Target, piece: torch.Tensor, fp8_scale: torch.Tensor | None,
          block: list[int], name: str) -> None:
    """Write one checkpoint piece (fp8 with its block scales, or plain values) into its part of a parameter,
    converted to that parameter's format."""
    param = getattr(dest, attr)
    if not _is_stored_weight(dest, attr):
        values = piece if fp8_scale is None else dequantize_fp8(piece, fp8_scale, block)
        _copy(view(param, t), values, name, t)
        return
    fmt, k = dest.fmt, dest.logical_shape(attr)[-1]
    data_dest, scale_dest = view(param, t), dest.scale(attr)
    scale_dest = None if scale_dest is None else view(scale_dest, t)
    if fp8_scale is not None and fmt.name == "fp8" and fmt.group == block[1]:
        data, scale = fp8_from_blocks(piece, fp8_scale, tuple(block))  # the checkpoint's own bytes
        _copy(data_dest, data, name, t)
        _copy(scale_dest, scale, name, t)
        return
    values = piece if fp8_scale is None else dequantize_fp8(piece, fp8_scale, block)
    if t.expert is None and not fmt.quantized and values.dtype == param.dtype and values.shape == param.shape:
        param.data = values.contiguous()  # the tensor as read becomes the weight: no second copy, ever
        return
    expected = (*data_dest.shape[:-1], k)  # the part's shape in numbers (int4 data holds two per byte)
    if tuple(values.shape) != expected:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(values.shape)}, expected {expected} "
                              f"for {t.describe()} from config.json")
    # A few rows at a time (and 3-D experts one at a time): quantizing works in fp32, and a whole vocabulary's
    # head or a layer's experts in fp32 would be a transient copy several times the weight's own bytes.
    matrices = [(v, d, s) for v, d, s in zip(values, data_dest, scale_dest if scale_dest is not None else
                                              [None] * len(values))] if values.dim() == 3 else [
        (values, data_dest, scale_dest)]
    for v, d, s in matrices:
        for r0 in range(0, v.shape[0], QUANTIZE_ROWS):
            rows = slice(r0, r0 + QUANTIZE_ROWS)
            data, scale = quantize(v[rows], fmt)
            _copy(d[rows], data, name, t)
            if scale is not None:
                _copy(s[rows], scale, name, t)


def _copy(dest: torch.Tensor, piece: torch.Tensor, name: str, t: Target) -> None:
    if tuple(piece.shape) != tuple(dest.shape):
        raise CheckpointError(
            f"tensor {name!r} has shape {tuple(piece.shape)}, expected {tuple(dest.shape)} "
            f"for {t.describe()} from config.json"
        )
    dest.copy_(piece)


def load_model(
    path: str | Path, dtype: str | torch.dtype | None = None, with_mtp: bool | None = None,
    shard: Shard = SINGLE, quantization: str | None = None, group_size: int | None = None,
    quantize_lm_head: bool = True, activation_quantization: str | None = None,
) -> Qwen3_5ForCausalLM:
    """Build the model from a checkpoint directory, each weight stored once in its format (weight_policy:
    dtype None keeps the checkpoint's formats and computes in float32; quantization fp8 / int8 / int4
    quantizes the projections as they are read; activation_quantization "int8" (the default for int8 /
    int4) has those quantize their inputs too). with_mtp None: load the MTP head when present.
    shard: with size N > 1, build rank shard.rank's part and keep each tensor's rank slice (rank_slice);
    a shape that does not split into N gets a ConfigError naming the heads and N."""
    path = Path(path)
    cfg = ModelConfig.from_file(path)
    return_freed_memory()
    policy = weight_policy(dtype, cfg, quantization, group_size, quantize_lm_head, activation_quantization)
    names = checkpoint_files(path)
    has_mtp = any(n.startswith("mtp.") for n in names)
    if with_mtp and not has_mtp:
        raise CheckpointError(f"{path} has no mtp.* tensors, so it cannot draft with its MTP head")
    load_mtp = has_mtp if with_mtp is None else with_mtp
    has_visual = any(n.startswith("model.visual.") for n in names)
    # Under tensor parallelism rank 0 holds the whole tower and runs it (executor/tensor_parallel.py); the
    # other ranks receive its merged tokens with each step.
    with_vision = cfg.vision is not None and has_visual and shard.rank == 0
    if has_visual and not with_vision:
        why = "config.json has no vision_config" if cfg.vision is None else f"rank 0 runs it, not rank {shard.rank}"
        log.info("skipping the vision tower (model.visual.*): %s", why)

    with torch.device("meta"):  # shapes only: every parameter gets its memory once, in its format
        model = Qwen3_5ForCausalLM(cfg, with_mtp=load_mtp, shard=shard, with_vision=with_vision)
    params = {n: p for n, p in model.named_parameters(remove_duplicate=False) if not n.endswith("_scale")}
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
        target = map_name(name, with_vision)
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

    stored: dict[str, WeightFormat] = {}  # module name -> the format its checkpoint tensors are in
    for name, found in wanted.items():
        module_name, module, attr = _owner(model, found[0].param)
        if not _is_stored_weight(module, attr):
            continue  # a Linear's bias: kept in the activation dtype, as the norms are
        if cfg.tie_word_embeddings and module_name == "model.embed_tokens":
            module_name = "lm_head"  # one tensor for both: the head's format decides
        stored.setdefault(module_name, _stored_format(_open(names[name]), name, block))
    _materialize(model, cfg, policy, stored)

    # A rank reads only its part of each split tensor, by the tensor's own name (one expert's, a fused GDN
    # projection's); fp8 weights are read whole, since their scales come in blocks, and sliced once dequantized.
    parts = {}
    if shard.size > 1 and not fp8:
        for n in wanted:
            if (part := rank_part(map_name(n, with_vision), cfg, shard.rank, shard.size)) is not None:
                parts[n] = part
    with torch.no_grad():
        for name, tensor in iter_tensors(path, names, list(wanted), parts):
            scale = None
            found = wanted[name]
            if fp8 and tensor.dtype == torch.float8_e4m3fn:
                scale_key = name + "_scale_inv"  # x.weight -> x.weight_scale_inv; 3-D experts: x_scale_inv
                if scale_key not in names:
                    raise CheckpointError(f"fp8 tensor {name!r} has no {scale_key!r}")
                scale = _open(names[scale_key]).get_tensor(scale_key)
                if len(found) > 1 or shard.size > 1:  # split or sliced: through its values
                    tensor, scale = dequantize_fp8(tensor, scale, block), None
            if fp8 and shard.size > 1:
                tensor = rank_slice(map_name(name, with_vision), tensor, cfg, shard.rank, shard.size)
            pieces = [tensor] if scale is not None else split(name, tensor, model.rank_config, found)
            for t, piece in zip(found, pieces, strict=True):
                _, dest, attr = _owner(model, t.param)
                _fill(dest, attr, t, piece, scale, block, name)
    model.eval()
    return model
