"""The fused trunk step: the whole forward of a step made of short segments (decode tokens, speculative
verify segments, short prompt tails) as one C++ call (csrc/fused_step.cpp), built on first use with the
system C++ compiler and cached by torch. The Python model (deltaserve/model) is the reference; this only
removes the per-op overhead that dominates a small model's decode step on a CPU.

Used only for fp32 weights and caches, text positions, no trace, every segment at most MAX_FUSED_TOKENS
long; anything else runs the Python model. The projections that read the same input are fused into one
weight (GDN q|k|v|z|b|a, attention q|k|v, MLP gate|up); the modules' own weights become views into it, so
memory is not doubled and both paths read the same numbers.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
from pathlib import Path

import torch

from deltaserve.model.context import CacheTensors, ForwardContext

log = logging.getLogger(__name__)

MAX_FUSED_TOKENS = 16  # longer segments (prompt chunks) are faster as the Python model's batched kernels
SOURCE = Path(__file__).parent / "csrc" / "fused_step.cpp"

_lock = threading.Lock()
_module = None


class FusedBuildError(RuntimeError):
    """The C++ step could not be compiled or loaded (no compiler?); the Python model still works."""


def _cpu_tag() -> str:
    """Build directory key: the code is compiled with -march=native, so a cache must not cross CPUs."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name")):
                flags += line
    except OSError:
        flags = platform.processor()
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def load_extension():
    """Compile (once per machine and source version; about 30 s) and import the C++ step."""
    global _module
    with _lock:
        if _module is None:
            from torch.utils.cpp_extension import _get_build_directory, load

            name = f"deltaserve_fused_step_{_cpu_tag()}"
            build_dir = Path(_get_build_directory(name, verbose=False))
            if not any(build_dir.glob("*.so")):
                log.info("building the fused decode step (C++, once per machine; about 30 s)")
            try:
                _module = load(
                    name=name, sources=[str(SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=False,
                )
            except Exception as e:  # compiler missing or failing: say so, the caller falls back
                raise FusedBuildError(f"could not build the fused step from {SOURCE.name}: {e}") from e
        return _module


def _fuse_rows(modules_and_names: list[tuple[torch.nn.Module, str]]) -> torch.Tensor:
    """One weight whose row blocks are the given Linear weights; each module's weight becomes a view."""
    weights = [getattr(m, n).weight for m, n in modules_and_names]
    fused = torch.cat([w.detach() for w in weights]).contiguous()
    start = 0
    for (m, n), w in zip(modules_and_names, weights):
        rows = w.shape[0]
        getattr(m, n).weight.data = fused[start : start + rows]
        start += rows
    return fused


def _linear(weight: torch.Tensor) -> list[torch.Tensor]:
    """A projection for the C++ step: the fp32 weight and, when all its values are bfloat16 numbers (a bf16
    checkpoint computed in fp32), a bf16 copy that streams half the bytes for identical products."""
    weight = weight.detach()
    as_bf16 = weight.to(torch.bfloat16)
    exact = torch.equal(as_bf16.float(), weight)
    return [weight, as_bf16 if exact else torch.empty(0)]


def supported(model: torch.nn.Module, cache: CacheTensors) -> str | None:
    """None if the fused step can run this model and cache, else the reason it cannot."""
    if any(p.dtype != torch.float32 for p in model.model.parameters()):
        return "weights are not float32"
    caches = [t for pair in cache.kv.values() for t in pair] + list(cache.conv.values()) + list(cache.ssm.values())
    if any(t.dtype != torch.float32 for t in caches):
        return "the cache is not float32"
    return None


class FusedTrunk:
    """The trunk of a Qwen3_5ForCausalLM over a fixed cache, as the C++ step."""

    def __init__(self, model: torch.nn.Module, cache: CacheTensors) -> None:
        reason = supported(model, cache)
        if reason is not None:
            raise ValueError(f"the fused step cannot run this model: {reason}")
        ext = load_extension()
        cfg = model.config
        text = model.model
        one_plus = lambda norm: (1.0 + norm.weight.detach().float()).contiguous()  # noqa: E731
        tensors = [text.embed_tokens.weight.detach(), one_plus(text.norm), text.rotary.inv_freq.contiguous()]
        tensors += _linear(model.lm_head.weight)
        is_gdn = []
        with torch.no_grad():
            for layer in text.layers:
                mlp = layer.mlp
                tensors += [
                    one_plus(layer.input_layernorm), one_plus(layer.post_attention_layernorm),
                    *_linear(_fuse_rows([(mlp, "gate_proj"), (mlp, "up_proj")])), *_linear(mlp.down_proj.weight),
                ]
                if layer.layer_type == "linear_attention":
                    g = layer.linear_attn
                    in_proj = _fuse_rows([(g, "in_proj_qkv"), (g, "in_proj_z"), (g, "in_proj_b"), (g, "in_proj_a")])
                    tensors += [
                        *_linear(in_proj),
                        g.conv1d.weight.detach()[:, 0, :].contiguous(),
                        (-g.A_log.detach().float().exp()).contiguous(),
                        g.dt_bias.detach().float().contiguous(),
                        g.norm.weight.detach().contiguous(),
                        *_linear(g.out_proj.weight),
                        cache.conv[layer.layer_id], cache.ssm[layer.layer_id],
                    ]
                else:
                    a = layer.self_attn
                    k_cache, v_cache = cache.kv[layer.layer_id]
                    tensors += [
                        *_linear(_fuse_rows([(a, "q_proj"), (a, "k_proj"), (a, "v_proj")])),
                        one_plus(a.q_norm), one_plus(a.k_norm), *_linear(a.o_proj.weight), k_cache, v_cache,
                    ]
                is_gdn.append(int(layer.layer_type == "linear_attention"))
        dims = [
            cfg.hidden_size, cfg.intermediate_size,
            cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.conv_dim, cfg.linear_conv_kernel_dim,
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim,
        ]
        self._impl = ext.FusedTrunk(tensors, is_gdn, dims, cfg.rms_norm_eps)
        self.gdn_layer_ids = [layer.layer_id for layer in text.layers if layer.layer_type == "linear_attention"]

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """The model's compute_logits, through the C++ projection (bf16-stored lm_head for a few rows)."""
        if rows is not None:
            hidden = hidden[rows]
        return self._impl.logits(hidden.float())

    @staticmethod
    def eligible(ctx: ForwardContext) -> bool:
        return (
            ctx.cache is not None and ctx.trace is None and ctx.positions.dim() == 1
            and max(ctx.query_lens, default=0) <= MAX_FUSED_TOKENS
        )

    def __call__(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Final-normed hidden states [T, H], like the model's forward; verify segments' per-position
        GDN states go to ctx.spec_states in the layout GatedDeltaNet._verify leaves there."""
        spec_index = torch.full((ctx.num_seqs,), -1, dtype=torch.long)
        spec_index[ctx.spec_seqs] = torch.arange(len(ctx.spec_seqs))
        width = max((ctx.query_lens[b] for b in ctx.spec_seqs), default=0)
        hidden, conv_states, ssm_states = self._impl.forward(
            input_ids, ctx.positions, torch.tensor(ctx.query_start_loc, dtype=torch.long),
            torch.tensor(ctx.context_lens, dtype=torch.long), ctx.block_tables, ctx.slot_mapping,
            ctx.state_slots, spec_index, len(ctx.spec_seqs), width,
        )
        for layer_id, conv, ssm in zip(self.gdn_layer_ids, conv_states, ssm_states):
            ctx.spec_states[layer_id] = (conv, ssm)
        return hidden
