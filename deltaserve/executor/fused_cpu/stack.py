"""The fused step: the whole forward of the trunk (FusedTrunk) or of the MTP head (FusedMTP) for one engine
step as one C++ call (deltaserve/ops/csrc), built on first use with the system C++ compiler and cached. The
Python model (deltaserve/model) is the reference; this removes the per-op overhead that dominates a small
model's step on a CPU, and runs the GDN recurrence token by token in C++ (cheaper than the chunked form at
these head sizes).

Used for fp32 weights and caches, or an fp8 KV cache beside fp32 state caches (make_executor checks
supported()). The C++ stack takes each layer's tensors
by name (_layer_weights) and checks their shapes; it reads the model's own weights where they are and
rewrites none of them. Projections that read the same input (GDN q|k|v|z|b|a, attention q|k|v, MLP gate|up)
run as one: their weights go across as the row blocks of one projection (a sparse-MoE MLP's router, shared
expert gate|up and shared_expert_gate too; its experts go across as the model's 3-D tensors, expert e's
weight being row block e). Weights whose values are all bfloat16 numbers also get a bf16 copy in panels,
one per such projection and per expert (half a weight's fp32 bytes, +50% weight memory), that every
projection streams instead of the fp32 weight. On CPUs with AVX512-BF16 such an
lm_head keeps one more bf16 copy, in pairs along K, for greedy_tokens' screen.

Under tensor parallelism a rank's stack is built from its shard: the rank's dims (rank_config; its rows of
the padded vocabulary) and an all-reduce hook (the model's Shard) that the C++ calls with each row-parallel
projection's partial output and the vocab-parallel embedding.
"""

from __future__ import annotations

from types import ModuleType

import torch

from deltaserve.model.context import CacheTensors, ForwardContext
from deltaserve.model.moe import SparseMoeBlock
from deltaserve.ops.attention import FP8
from deltaserve.ops.fused_ext import load_extension

__all__ = ["FusedMTP", "FusedTrunk", "supported"]


PANEL = 64  # outputs per bf16 panel (kPanel in the C++)


def _linear(parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A projection for the C++ step from its row blocks, weights [N_i, K] in output order: the blocks
    themselves (the model's tensors, not copied) and, when all their values are bfloat16 numbers (a bf16
    checkpoint computed in fp32), the same values as bf16 panels [ceil(N/64), K, 64] of all N rows, which
    the C++ projections stream instead (half the bytes, identical products); else an empty tensor.

    Within a panel's row k the 64 outputs are interleaved in two halves of 32: output 32h + i sits at
    word 32h + 2i, and output 32h + 16 + i at word 32h + 2i + 1. Read as 32-bit lanes, the low words are
    16 consecutive outputs and the high words the next 16, so the kernel turns 32 weights into fp32 with
    one shift and one mask (kPanel in the C++)."""
    parts = [p.detach().float() for p in parts]  # until the kernels read stored formats: bf16 widened
    as_bf16 = [p.to(torch.bfloat16) for p in parts]
    if not all(torch.equal(b.float(), p) for b, p in zip(as_bf16, parts)):
        return parts, torch.empty(0)
    N, K = sum(p.shape[0] for p in parts), parts[0].shape[1]
    P = -(-N // PANEL)
    padded = torch.cat([*as_bf16, as_bf16[0].new_zeros(P * PANEL - N, K)])
    # [panel, half, low/high word, i, K] -> [panel, K, half, i, low/high word]
    interleaved = padded.view(P, 2, 2, PANEL // 4, K).permute(0, 4, 1, 3, 2)
    return parts, interleaved.reshape(P, K, PANEL).contiguous()


def _add_projection(weights: dict[str, torch.Tensor], panels_name: str, parts: dict[str, torch.Tensor]) -> None:
    """weights[name] = each row block of one projection, and weights[panels_name] = its panels if it has any."""
    blocks, panels = _linear(list(parts.values()))
    weights.update(zip(parts, blocks))
    if panels.numel() > 0:
        weights[panels_name] = panels


def _add_experts(weights: dict[str, torch.Tensor], name: str, experts: torch.Tensor) -> None:
    """weights[name] = the model's 3-D expert tensor [E, N, K] itself (expert e's weight is its row block e),
    and weights[name + ".panels"] = [E, ceil(N/64), K, 64], every expert's bf16 panels, when all its values
    are bfloat16 numbers. One expert at a time: no fp32 temporary of all the experts."""
    experts = experts.detach().float()
    panels = []
    for e in range(experts.shape[0]):
        panels.append(_linear([experts[e]])[1])
        if panels[-1].numel() == 0:
            break
    weights[name] = experts
    if panels[-1].numel() > 0:
        weights[name + ".panels"] = torch.stack(panels)


def supported(model: torch.nn.Module, cache: CacheTensors) -> str | None:
    """None if the fused step can run this model and cache, else the reason it cannot."""
    stored = {p.dtype for p in model.parameters()}
    if not stored <= {torch.float32, torch.bfloat16}:
        return f"weights are stored as {', '.join(sorted(str(d).removeprefix('torch.') for d in stored))}"
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


def _add_sparse_mlp(w: dict[str, torch.Tensor], mlp: SparseMoeBlock) -> None:
    """A sparse-MoE MLP's tensors (deltaserve/ops/csrc/moe.h): the router, the shared expert's gate and up and
    the shared expert's gate as one projection (they all read the layer's normed input), the shared expert's
    down, and the experts' 3-D tensors with their panels per expert."""
    shared = mlp.shared_expert
    _add_projection(w, "mlp.router_shared.panels", {
        "mlp.gate.weight": mlp.gate.weight, "mlp.shared_expert.gate_proj.weight": shared.gate_proj.weight,
        "mlp.shared_expert.up_proj.weight": shared.up_proj.weight,
        "mlp.shared_expert_gate.weight": mlp.shared_expert_gate.weight,
    })
    _add_projection(w, "mlp.shared_expert.down_proj.panels",
                    {"mlp.shared_expert.down_proj.weight": shared.down_proj.weight})
    _add_experts(w, "mlp.experts.gate_up_proj", mlp.experts.gate_up_proj)
    _add_experts(w, "mlp.experts.down_proj", mlp.experts.down_proj)


def _layer_weights(layer: torch.nn.Module, cache: CacheTensors) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors by the names FusedStack's constructor reads (the modules' own names)."""
    mlp = layer.mlp
    w = {
        "input_layernorm.scale": _one_plus(layer.input_layernorm),
        "post_attention_layernorm.scale": _one_plus(layer.post_attention_layernorm),
    }
    if isinstance(mlp, SparseMoeBlock):
        _add_sparse_mlp(w, mlp)
    else:
        _add_projection(w, "mlp.gate_up_proj.panels",
                        {"mlp.gate_proj.weight": mlp.gate_proj.weight, "mlp.up_proj.weight": mlp.up_proj.weight})
        _add_projection(w, "mlp.down_proj.panels", {"mlp.down_proj.weight": mlp.down_proj.weight})
    if layer.layer_type == "linear_attention":
        g = layer.linear_attn
        _add_projection(w, "linear_attn.in_proj.panels", {
            f"linear_attn.{name}.weight": getattr(g, name).weight
            for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        })
        _add_projection(w, "linear_attn.out_proj.panels", {"linear_attn.out_proj.weight": g.out_proj.weight})
        w |= {
            "linear_attn.conv1d.weight": g.conv1d.weight.detach()[:, 0, :],  # [C, 1, K] -> [C, K], a view
            "linear_attn.neg_a": (-g.A_log.detach().float().exp()).contiguous(),
            "linear_attn.dt_bias": g.dt_bias.detach(),
            "linear_attn.norm.weight": g.norm.weight.detach(),
            "conv_cache": cache.conv[layer.layer_id], "ssm_cache": cache.ssm[layer.layer_id],
        }
        return w
    a = layer.self_attn
    _add_projection(w, "self_attn.qkv_proj.panels", {
        f"self_attn.{name}.weight": getattr(a, name).weight for name in ("q_proj", "k_proj", "v_proj")
    })
    _add_projection(w, "self_attn.o_proj.panels", {"self_attn.o_proj.weight": a.o_proj.weight})
    k_cache, v_cache = cache.kv[layer.layer_id]
    w |= {
        "self_attn.q_norm.scale": _one_plus(a.q_norm), "self_attn.k_norm.scale": _one_plus(a.k_norm),
        "k_cache": k_cache, "v_cache": v_cache,
    }
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


_NO_HIDDEN = torch.empty(0)  # the trunk's forward takes no hidden input


class _FusedStack:
    """Python side of the C++ FusedStack: hands it the named tensors, runs it on a ForwardContext."""

    def __init__(self, model: torch.nn.Module, cache: CacheTensors, head: dict[str, torch.Tensor], layers,
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
            head = head | {"rotary.inv_freq": rotary.inv_freq.contiguous(), "rotary.axis": rotary.axis.contiguous()}
            weights = [_layer_weights(layer, cache) for layer in layers]
        dims = {name: int(getattr(cfg, name)) for name in DIMS}
        vocab_rows = head["embed_tokens.weight"].shape[0]
        dims["vocab_size"] = vocab_rows  # under tensor parallelism the rank's rows of the padded vocabulary
        self._impl = ext.FusedStack(dims, cfg.rms_norm_eps, head, [layer.layer_type for layer in layers], weights, mtp)
        shard = model.shard
        if shard.size > 1:  # the row-parallel sums and the vocab-parallel embedding meet in the rank's group
            self._impl.set_all_reduce(shard.all_reduce, shard.rank * vocab_rows)
        self.gdn_layer_ids = [layer.layer_id for layer in layers if layer.layer_type == "linear_attention"]

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor the C++ stack holds, by name: the model's and the cache's own, and its bf16 copies."""
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
        head = {"embed_tokens.weight": text.embed_tokens.weight.detach().float(), "norm.scale": _one_plus(text.norm)}
        _add_projection(head, "lm_head.panels", {"lm_head.weight": model.lm_head.weight})
        super().__init__(model, cache, head, list(text.layers), mtp=False, ext=ext)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """The model's compute_logits, through the C++ projection (bf16 panels when the weights allow)."""
        if rows is not None:
            hidden = hidden[rows]
        return self._impl.logits(hidden.float())

    def greedy_tokens(self, hidden: torch.Tensor, rows: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """compute_logits(hidden, rows).argmax(-1) in one C++ call: the logits never reach Python."""
        if rows is not None:
            hidden = hidden[rows]
        return self._impl.greedy_tokens(hidden.float())

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
        (deltaserve/ops/csrc/greedy_screen.cpp): AVX512-BF16, and a finite lm_head of bf16 values. Same tokens
        either way; settable to False for measurements."""
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
        # Drafts take their logits from the trunk's lm_head (FusedTrunk.logits): no second bf16 copy here.
        head = {
            "embed_tokens.weight": embed.weight.detach().float(), "norm.scale": _one_plus(mtp.norm),
            "lm_head.weight": model.lm_head.weight.detach().float(),
            "pre_fc_norm_embedding.scale": _one_plus(mtp.pre_fc_norm_embedding),
            "pre_fc_norm_hidden.scale": _one_plus(mtp.pre_fc_norm_hidden),
        }
        _add_projection(head, "fc.panels", {"fc.weight": mtp.fc.weight})
        super().__init__(model, cache, head, list(mtp.layers), mtp=True, ext=ext)

    def __call__(
        self, next_token_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, step: int = 0
    ) -> torch.Tensor:
        """MTP hidden [T, H] from trunk (or previous MTP) hidden at t and token t+1; `step` picks the MTP
        layer in mtp_hidden, and with one layer there is nothing to pick."""
        return self._run(next_token_ids, ctx, hidden)

