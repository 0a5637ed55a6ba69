"""The fused step: the whole forward of the trunk (FusedTrunk) or of the MTP head (FusedMTP) for one engine
step as one C++ call (deltaserve/ops/csrc), built on first use with the system C++ compiler and cached. The
Python model (deltaserve/model) is the reference; this removes the per-op overhead that dominates a small
model's step on a CPU, and runs the GDN recurrence token by token in C++ (cheaper than the chunked form at
these head sizes).

Used for weights in any format of deltaserve/ops/formats.py, fp32 state caches and an fp32 or fp8 KV cache
(make_executor checks supported()). The C++ stack takes each layer's tensors by name (_layer_weights) and
checks their shapes; it reads the model's own weights where they are, in their stored format (a projection's
`.weight` data and, quantized, its `.weight_scale`), and rewrites or copies none of them: the fused step adds
no weight bytes. Projections that read the same input (GDN q|k|v|z|b|a, attention q|k|v, MLP gate|up) run as
one: their weights go across as the row blocks of one projection, each in its own format (a sparse-MoE
MLP's router, shared expert gate|up and shared_expert_gate too; its experts go across as the model's 3-D
tensors, expert e's weight being row block e). The quantized formats' group sizes go across in the dims
(fp8_group, ...), and so does activation_quantization "int8" of the int8 / int4 weights (int8_activations:
deltaserve/ops/csrc/linear_int.h, the same scheme as the modules' forward).

Under tensor parallelism a rank's stack is built from its shard: the rank's dims (rank_config; its rows of
the padded vocabulary) and an all-reduce hook (the model's Shard) that the C++ calls with each row-parallel
projection's partial output and the vocab-parallel embedding.
"""

from __future__ import annotations

from types import ModuleType

import torch

from deltaserve.model.context import CacheTensors, ForwardContext
from deltaserve.model.moe import SparseMoeBlock
from deltaserve.ops.activation_quant import INT8_ACTIVATION_WEIGHTS, reads_bf16_activations, reads_int8_activations
from deltaserve.ops.attention import FP8
from deltaserve.ops.formats import QUANTIZATIONS, WeightFormat
from deltaserve.ops.fused_ext import load_extension

__all__ = ["FusedMTP", "FusedTrunk", "supported"]


class _Weights(dict):
    """Tensors by the names FusedStack's constructor reads, the group size of each quantized format they
    hold (one per format in a stack: the C++ takes them as dims), and whether their int8 / int4 weights read
    int8 activations (int8_activations: one setting per stack, a dim too; None while there are none) and whether
    its projections read bf16-rounded ones (bf16_activations: "bf16", a dim when set)."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: dict[str, int] = {}
        self.int8_activations: bool | None = None
        self.bf16_activations = False

    def add_format(self, fmt: WeightFormat, what: str, activation_quantization: str | None = None) -> None:
        """A weight in fmt; activation_quantization: its module's setting (None: one already counted)."""
        self.bf16_activations |= reads_bf16_activations(activation_quantization)
        if not fmt.quantized:
            return
        if self.groups.setdefault(fmt.name, fmt.group) != fmt.group:
            raise ValueError(f"the fused step takes one group size per format: {what} is {fmt.name} with group "
                             f"{fmt.group}, another weight has group {self.groups[fmt.name]}")
        if activation_quantization is not None and fmt.name in INT8_ACTIVATION_WEIGHTS:
            self.set_int8_activations(reads_int8_activations(activation_quantization, fmt), what)

    def set_int8_activations(self, on: bool, what: str) -> None:
        if self.int8_activations is None:
            self.int8_activations = on
        elif self.int8_activations != on:
            raise ValueError(f"the fused step takes one activation_quantization per stack: {what} has "
                             f"{'int8' if on else 'none'}, another int8 / int4 weight the other")

    def add_projection(self, parts: dict[str, torch.nn.Module]) -> None:
        """Each part's stored weight as `name` (= "P.weight") and its scales as `name`_scale: the model's
        tensors themselves, in their formats."""
        for name, module in parts.items():
            fmt = module.fmt  # a StoredWeights (deltaserve/model/linear.py)
            self.add_format(fmt, name, getattr(module, "activation_quantization", "none"))
            self[name] = module.weight.detach()
            scale = getattr(module, "weight_scale", None)
            if scale is not None:
                self[name + "_scale"] = scale.detach()

    def add_experts(self, experts: torch.nn.Module, prefix: str) -> None:
        """The experts' 3-D tensors [E, N, K'] (expert e's weight is row block e) and their scales."""
        fmt = experts.fmt
        for name in ("gate_up_proj", "down_proj"):
            self.add_format(fmt, f"{prefix}.{name}", getattr(experts, "activation_quantization", "none"))
            self[f"{prefix}.{name}"] = getattr(experts, name).detach()
            scale = getattr(experts, f"{name}_scale", None)
            if scale is not None:
                self[f"{prefix}.{name}_scale"] = scale.detach()

    def merge(self, other: _Weights) -> None:
        for name, group in other.groups.items():
            self.add_format(WeightFormat(name, group), name)
        if other.int8_activations is not None:
            self.set_int8_activations(other.int8_activations, "a layer")
        self.bf16_activations |= other.bf16_activations


def supported(model: torch.nn.Module, cache: CacheTensors) -> str | None:
    """None if the fused step can run this model and cache, else the reason it cannot."""
    stored = {torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.uint8}
    if any(t.dtype not in stored for t in [*model.parameters(), *model.buffers()] if t.dim() >= 2):
        return "weights are not in a format of deltaserve/ops/formats.py"
    if model.model.norm.weight.dtype != torch.float32:
        return "activations are not float32"
    kv = [t for pair in cache.kv.values() for t in pair]
    if any(t.dtype not in (torch.float32, FP8) for t in kv):
        return "the KV cache is neither float32 nor fp8"
    if any(t.dtype != torch.float32 for t in [*cache.conv.values(), *cache.ssm.values()]):
        return "the GDN state cache is not float32"
    return None


def _one_plus(norm: torch.nn.Module) -> torch.Tensor:
    """The scale of a zero-centred RMSNorm: 1 + weight."""
    return (1.0 + norm.weight.detach().float()).contiguous()


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """A small parameter (conv, dt_bias, a norm's weight) as the C++ reads it: float32, itself when it is."""
    return t.detach().float().contiguous()


def _add_sparse_mlp(w: _Weights, mlp: SparseMoeBlock) -> None:
    """A sparse-MoE MLP's tensors (deltaserve/ops/csrc/moe.h): the router, the shared expert's gate and up and
    the shared expert's gate as one projection (they all read the layer's normed input), the shared expert's
    down, and the experts' 3-D tensors."""
    shared = mlp.shared_expert
    w.add_projection({
        "mlp.gate.weight": mlp.gate, "mlp.shared_expert.gate_proj.weight": shared.gate_proj,
        "mlp.shared_expert.up_proj.weight": shared.up_proj, "mlp.shared_expert_gate.weight": mlp.shared_expert_gate,
    })
    w.add_projection({"mlp.shared_expert.down_proj.weight": shared.down_proj})
    w.add_experts(mlp.experts, "mlp.experts")


def _layer_weights(layer: torch.nn.Module, cache: CacheTensors) -> _Weights:
    """One decoder layer's tensors by the names FusedStack's constructor reads (the modules' own names)."""
    mlp = layer.mlp
    w = _Weights()
    w["input_layernorm.scale"] = _one_plus(layer.input_layernorm)
    w["post_attention_layernorm.scale"] = _one_plus(layer.post_attention_layernorm)
    if isinstance(mlp, SparseMoeBlock):
        _add_sparse_mlp(w, mlp)
    else:
        w.add_projection({"mlp.gate_proj.weight": mlp.gate_proj, "mlp.up_proj.weight": mlp.up_proj})
        w.add_projection({"mlp.down_proj.weight": mlp.down_proj})
    if layer.layer_type == "linear_attention":
        g = layer.linear_attn
        w.add_projection({f"linear_attn.{name}.weight": getattr(g, name)
                          for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")})
        w.add_projection({"linear_attn.out_proj.weight": g.out_proj})
        w.update({
            "linear_attn.conv1d.weight": _fp32(g.conv1d.weight[:, 0, :]),  # [C, 1, K] -> [C, K], a view
            "linear_attn.neg_a": (-g.A_log.detach().float().exp()).contiguous(),
            "linear_attn.dt_bias": _fp32(g.dt_bias),
            "linear_attn.norm.weight": _fp32(g.norm.weight),
            "conv_cache": cache.conv[layer.layer_id], "ssm_cache": cache.ssm[layer.layer_id],
        })
        return w
    a = layer.self_attn
    w.add_projection({f"self_attn.{name}.weight": getattr(a, name) for name in ("q_proj", "k_proj", "v_proj")})
    w.add_projection({"self_attn.o_proj.weight": a.o_proj})
    k_cache, v_cache = cache.kv[layer.layer_id]
    w.update({
        "self_attn.q_norm.scale": _one_plus(a.q_norm), "self_attn.k_norm.scale": _one_plus(a.k_norm),
        "k_cache": k_cache, "v_cache": v_cache,
    })
    if layer.layer_id in cache.kv_scales:  # an fp8 cache's row scales (deltaserve/ops/attention.py)
        w["k_cache_scale"], w["v_cache_scale"] = cache.kv_scales[layer.layer_id]
    return w


DIMS = (  # the config's sizes that FusedStack reads, by their names
    "hidden_size", "intermediate_size", "vocab_size", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rotary_dim",
    # sparse MoE (0 in a dense model; intermediate_size 0 in a model without dense MLPs)
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "norm_topk_prob",
)
GROUP_DIMS = {name: f"{name}_group" for name in QUANTIZATIONS}  # a quantized format's columns per scale


_NO_HIDDEN = torch.empty(0)  # the trunk's forward takes no hidden input


class _FusedStack:
    """Python side of the C++ FusedStack: hands it the named tensors, runs it on a ForwardContext."""

    def __init__(self, model: torch.nn.Module, cache: CacheTensors, head: _Weights, layers,
                 mtp: bool, ext: ModuleType | None = None) -> None:
        """head: the stack's own tensors by name besides the final norm and rotary frequencies (FusedStack's
        constructor lists them); ext: another build of the C++ step (the tests' portable one)."""
        reason = supported(model, cache)
        if reason is not None:
            raise ValueError(f"the fused step cannot run this model: {reason}")
        ext = ext or load_extension()
        cfg = model.rank_config  # this rank's heads and MLP width (the whole model's with one rank)
        with torch.no_grad():
            rotary = model.model.rotary  # the mRoPE position row of each frequency too (all 0 for text)
            head["rotary.inv_freq"], head["rotary.axis"] = rotary.inv_freq.contiguous(), rotary.axis.contiguous()
            weights = [_layer_weights(layer, cache) for layer in layers]
        for w in weights:
            head.merge(w)
        dims = {name: int(getattr(cfg, name)) for name in DIMS}
        dims |= {GROUP_DIMS[name]: group for name, group in head.groups.items()}
        if head.int8_activations:
            dims["int8_activations"] = 1
        if head.bf16_activations:
            dims["bf16_activations"] = 1
        vocab_rows = head["embed_tokens.weight"].shape[0]
        dims["vocab_size"] = vocab_rows  # under tensor parallelism the rank's rows of the padded vocabulary
        self._impl = ext.FusedStack(dims, cfg.rms_norm_eps, head, [layer.layer_type for layer in layers], weights, mtp)
        shard = model.shard
        if shard.size > 1:  # the row-parallel sums and the vocab-parallel embedding meet in the rank's group
            self._impl.set_all_reduce(shard.all_reduce, shard.rank * vocab_rows)
        self.gdn_layer_ids = [layer.layer_id for layer in layers if layer.layer_type == "linear_attention"]

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor the C++ stack holds, by name: the model's and the cache's own, and a few vectors."""
        return self._impl.named_tensors()

    PROFILE_PARTS = ("projections", "gdn_conv_and_recurrence", "attention", "forward")

    def set_loop_kv_bytes(self, kv_bytes: int) -> None:
        """Prompt chunks whose cached keys and values (per layer) exceed this many bytes attend through
        torch's fused kernel rather than the C++ loop (default 8 MB); 0 sends every chunk there."""
        self._impl.set_loop_kv_bytes(kv_bytes)

    def set_profiling(self, on: bool) -> None:
        """While on, every forward adds the seconds spent in each of PROFILE_PARTS to the profile."""
        self._impl.set_profiling(on)

    def profile(self) -> dict[str, float]:
        """Seconds per part since the last call (projections include the lm_head's logits)."""
        return dict(zip(self.PROFILE_PARTS, self._impl.profile(), strict=True))

    def _run(
        self, input_ids: torch.Tensor, ctx: ForwardContext, hidden_in: torch.Tensor,
        output_rows: torch.Tensor | None = None, mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """mm_embeds: (rows, embeddings) that replace those rows' token embeddings (ForwardContext.mm_embeds)."""
        mm_rows, mm_values = (None, None) if mm_embeds is None else (mm_embeds[0], mm_embeds[1].float().contiguous())
        spec_index = torch.full((ctx.num_seqs,), -1, dtype=torch.long)
        if ctx.spec_seqs:
            spec_index[ctx.spec_seqs] = torch.arange(len(ctx.spec_seqs))
        width = max((ctx.query_lens[b] for b in ctx.spec_seqs), default=0)
        hidden, conv_states, ssm_states = self._impl.forward(
            input_ids, ctx.positions.contiguous(), torch.tensor(ctx.query_start_loc, dtype=torch.long),
            torch.tensor(ctx.context_lens, dtype=torch.long), ctx.block_tables, ctx.slot_mapping,
            ctx.state_slots, spec_index, len(ctx.spec_seqs), width, hidden_in, output_rows, mm_rows, mm_values,
        )
        for layer_id, conv, ssm in zip(self.gdn_layer_ids, conv_states, ssm_states):
            ctx.spec_states[layer_id] = (conv, ssm)
        return hidden


class FusedTrunk(_FusedStack):
    """The trunk of a Qwen3_5ForCausalLM over a fixed cache, as one C++ call per step."""

    def __init__(self, model: torch.nn.Module, cache: CacheTensors, ext: ModuleType | None = None) -> None:
        text = model.model
        head = _Weights()
        # as stored: its format's rows and scales (a tied embedding is the lm_head's own, model/linear.py tie)
        head.add_projection({"embed_tokens.weight": text.embed_tokens})
        head["norm.scale"] = _one_plus(text.norm)
        head.add_projection({"lm_head.weight": model.lm_head})
        super().__init__(model, cache, head, list(text.layers), mtp=False, ext=ext)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """The model's compute_logits, through the C++ projection of the lm_head in its format."""
        if rows is not None:
            hidden = hidden[rows]
        return self._impl.logits(hidden.float())

    def greedy_tokens(self, hidden: torch.Tensor, rows: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """compute_logits(hidden, rows).argmax(-1) in one C++ call: the logits never reach Python."""
        if rows is not None:
            hidden = hidden[rows]
        return self._impl.greedy_tokens(hidden.float())

    def masked_greedy_tokens(self, hidden: torch.Tensor, rows: torch.Tensor | list[int] | None,
                             allowed: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of its masked logits (deltaserve/ops/token_mask.py) in one C++ call that projects
        only the lm_head panels holding an allowed token."""
        if rows is not None:
            hidden = hidden[rows]
        return self._impl.masked_greedy_tokens(hidden.float(), allowed)

    def commit_verified(self, ctx: ForwardContext, accepted: list[int]) -> None:
        """Each verify segment's GDN slot takes the states after its last accepted position (row `accepted[r]`
        of ctx.spec_states), as SpecDecoder's commit does op by op."""
        states = [ctx.spec_states[layer_id] for layer_id in self.gdn_layer_ids]
        self._impl.commit_verified(
            [conv.float().contiguous() for conv, _ in states], [ssm.float().contiguous() for _, ssm in states],
            ctx.state_slots[ctx.spec_seqs].contiguous(), torch.tensor(accepted, dtype=torch.long),
        )

    @property
    def greedy_screen(self) -> bool:
        """Whether greedy_tokens screens the vocabulary with bf16 dot products before the exact fp32 pass
        (deltaserve/ops/csrc/greedy_screen.cpp): AVX512-BF16, and a finite lm_head stored in bf16 (any other
        format runs its exact projection with the argmax fused). Same tokens either way; settable to False
        for measurements."""
        return self._impl.greedy_screen_on()

    @greedy_screen.setter
    def greedy_screen(self, on: bool) -> None:
        self._impl.set_greedy_screen(on)

    def __call__(
        self, input_ids: torch.Tensor, ctx: ForwardContext, output_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final-normed hidden states [T, H], like the model's forward; verify segments' per-position
        GDN states go to ctx.spec_states in the layout GatedDeltaNet._verify leaves there.

        With output_rows (int64 [R], ascending), only those rows come back, [R, H]: the last layer still
        caches every token's K/V or GDN state but skips the rest of its work for the others (for a prompt
        chunk, all but its last token), which nothing downstream reads. ctx.positions may be [3, T] mRoPE
        positions, and ctx.mm_embeds' visual tokens replace their placeholders' embeddings, as in TextModel."""
        return self._run(input_ids, ctx, _NO_HIDDEN, output_rows, ctx.mm_embeds)


class FusedMTP(_FusedStack):
    """The MTP head (one layer) as one C++ call per draft pass: Qwen3_5ForCausalLM.mtp_hidden."""

    def __init__(self, model: torch.nn.Module, cache: CacheTensors, ext: ModuleType | None = None) -> None:
        mtp = model.mtp
        if mtp is None or len(mtp.layers) != 1:
            raise ValueError("the fused MTP head needs a model with exactly one MTP layer")
        embed = mtp.embed_tokens if mtp.embed_tokens is not None else model.model.embed_tokens
        # Drafts take their logits from the trunk's lm_head (FusedTrunk.logits); this one's is only checked.
        head = _Weights()
        head.add_projection({"embed_tokens.weight": embed})  # as stored, as the trunk's
        head.add_projection({"lm_head.weight": model.lm_head, "fc.weight": mtp.fc})
        head |= {
            "norm.scale": _one_plus(mtp.norm),
            "pre_fc_norm_embedding.scale": _one_plus(mtp.pre_fc_norm_embedding),
            "pre_fc_norm_hidden.scale": _one_plus(mtp.pre_fc_norm_hidden),
        }
        super().__init__(model, cache, head, list(mtp.layers), mtp=True, ext=ext)

    def __call__(
        self, next_token_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, step: int = 0
    ) -> torch.Tensor:
        """MTP hidden [T, H] from trunk (or previous MTP) hidden at t and token t+1; `step` picks the MTP
        layer in mtp_hidden, and with one layer there is nothing to pick."""
        return self._run(next_token_ids, ctx, hidden)

