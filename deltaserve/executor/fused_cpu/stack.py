"""The fused step: the whole forward of the trunk (FusedTrunk) or of the MTP head (FusedMTP) for one engine
step as one C++ call (deltaserve/ops/csrc), built on first use with the system C++ compiler and cached. The
Python model (deltaserve/model) is the reference; this removes the per-op overhead that dominates a small
model's step on a CPU, and runs the GDN recurrence token by token in C++ (cheaper than the chunked form at
these head sizes).

Used for fp32 weights and caches (make_executor checks supported()). The projections that read the same
input are fused into one weight (GDN q|k|v|z|b|a, attention q|k|v, MLP gate|up); the modules' own weights
become views into it, so memory is not doubled and both paths read the same numbers. Weights whose values
are all bfloat16 numbers also keep a bf16 copy in panels (half a weight's fp32 bytes, +50% weight memory)
that every projection streams instead of the fp32 weight. On CPUs with AVX512-BF16 such an lm_head keeps
one more bf16 copy, in pairs along K, for greedy_tokens' screen.
"""

from __future__ import annotations

from types import ModuleType

import torch

from deltaserve.model.context import CacheTensors, ForwardContext
from deltaserve.ops.fused_ext import load_extension

__all__ = ["FusedMTP", "FusedTrunk", "supported"]


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


PANEL = 64  # outputs per bf16 panel (kPanel in the C++)


def _linear(weight: torch.Tensor) -> list[torch.Tensor]:
    """A projection for the C++ step: the fp32 weight [N, K] and, when all its values are bfloat16 numbers
    (a bf16 checkpoint computed in fp32), the same values as bf16 panels [ceil(N/64), K, 64], which the
    C++ projections stream instead (half the bytes, identical products); else an empty tensor.

    Within a panel's row k the 64 outputs are interleaved in two halves of 32: output 32h + i sits at
    word 32h + 2i, and output 32h + 16 + i at word 32h + 2i + 1. Read as 32-bit lanes, the low words are
    16 consecutive outputs and the high words the next 16, so the kernel turns 32 weights into fp32 with
    one shift and one mask (kPanel in the C++)."""
    weight = weight.detach()
    as_bf16 = weight.to(torch.bfloat16)
    if not torch.equal(as_bf16.float(), weight):
        return [weight, torch.empty(0)]
    N, K = weight.shape
    P = -(-N // PANEL)
    padded = torch.cat([as_bf16, as_bf16.new_zeros(P * PANEL - N, K)])
    # [panel, half, low/high word, i, K] -> [panel, K, half, i, low/high word]
    interleaved = padded.view(P, 2, 2, PANEL // 4, K).permute(0, 4, 1, 3, 2)
    return [weight, interleaved.reshape(P, K, PANEL).contiguous()]


def supported(model: torch.nn.Module, cache: CacheTensors) -> str | None:
    """None if the fused step can run this model and cache, else the reason it cannot."""
    if any(p.dtype != torch.float32 for p in model.model.parameters()):
        return "weights are not float32"
    caches = [t for pair in cache.kv.values() for t in pair] + list(cache.conv.values()) + list(cache.ssm.values())
    if any(t.dtype != torch.float32 for t in caches):
        return "the cache is not float32"
    return None


def _one_plus(norm: torch.nn.Module) -> torch.Tensor:
    """The scale of a zero-centred RMSNorm: 1 + weight."""
    return (1.0 + norm.weight.detach().float()).contiguous()


def _layer_tensors(layer: torch.nn.Module, cache: CacheTensors) -> list[torch.Tensor]:
    """One decoder layer's tensors in the order FusedStack's constructor reads them."""
    mlp = layer.mlp
    tensors = [
        _one_plus(layer.input_layernorm), _one_plus(layer.post_attention_layernorm),
        *_linear(_fuse_rows([(mlp, "gate_proj"), (mlp, "up_proj")])), *_linear(mlp.down_proj.weight),
    ]
    if layer.layer_type == "linear_attention":
        g = layer.linear_attn
        in_proj = _fuse_rows([(g, "in_proj_qkv"), (g, "in_proj_z"), (g, "in_proj_b"), (g, "in_proj_a")])
        return tensors + [
            *_linear(in_proj),
            g.conv1d.weight.detach()[:, 0, :].contiguous(),
            (-g.A_log.detach().float().exp()).contiguous(),
            g.dt_bias.detach().float().contiguous(),
            g.norm.weight.detach().contiguous(),
            *_linear(g.out_proj.weight),
            cache.conv[layer.layer_id], cache.ssm[layer.layer_id],
        ]
    a = layer.self_attn
    k_cache, v_cache = cache.kv[layer.layer_id]
    return tensors + [
        *_linear(_fuse_rows([(a, "q_proj"), (a, "k_proj"), (a, "v_proj")])),
        _one_plus(a.q_norm), _one_plus(a.k_norm), *_linear(a.o_proj.weight), k_cache, v_cache,
    ]


_NO_HIDDEN = torch.empty(0)  # the trunk's forward takes no hidden input


class _FusedStack:
    """Python side of the C++ FusedStack: builds its tensor list, runs it on a ForwardContext."""

    def __init__(self, model: torch.nn.Module, cache: CacheTensors, embed: torch.Tensor, final_norm,
                 lm_head: list[torch.Tensor], prologue: list[torch.Tensor], layers,
                 ext: ModuleType | None = None) -> None:
        reason = supported(model, cache)
        if reason is not None:
            raise ValueError(f"the fused step cannot run this model: {reason}")
        ext = ext or load_extension()  # ext: another build of the C++ step (the tests' portable one)
        cfg = model.config
        with torch.no_grad():
            tensors = [embed.detach(), _one_plus(final_norm), model.model.rotary.inv_freq.contiguous()]
            tensors += lm_head + prologue
            for layer in layers:
                tensors += _layer_tensors(layer, cache)
        dims = [
            cfg.hidden_size, cfg.intermediate_size,
            cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.conv_dim, cfg.linear_conv_kernel_dim,
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim,
        ]
        is_gdn = [int(layer.layer_type == "linear_attention") for layer in layers]
        self._impl = ext.FusedStack(tensors, is_gdn, dims, cfg.rms_norm_eps, bool(prologue))
        self.gdn_layer_ids = [layer.layer_id for layer in layers if layer.layer_type == "linear_attention"]

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
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        spec_index = torch.full((ctx.num_seqs,), -1, dtype=torch.long)
        if ctx.spec_seqs:
            spec_index[ctx.spec_seqs] = torch.arange(len(ctx.spec_seqs))
        width = max((ctx.query_lens[b] for b in ctx.spec_seqs), default=0)
        hidden, conv_states, ssm_states = self._impl.forward(
            input_ids, ctx.positions, torch.tensor(ctx.query_start_loc, dtype=torch.long),
            torch.tensor(ctx.context_lens, dtype=torch.long), ctx.block_tables, ctx.slot_mapping,
            ctx.state_slots, spec_index, len(ctx.spec_seqs), width, hidden_in, output_rows,
        )
        for layer_id, conv, ssm in zip(self.gdn_layer_ids, conv_states, ssm_states):
            ctx.spec_states[layer_id] = (conv, ssm)
        return hidden


class FusedTrunk(_FusedStack):
    """The trunk of a Qwen3_5ForCausalLM over a fixed cache, as one C++ call per step."""

    def __init__(self, model: torch.nn.Module, cache: CacheTensors, ext: ModuleType | None = None) -> None:
        text = model.model
        super().__init__(
            model, cache, text.embed_tokens.weight, text.norm, _linear(model.lm_head.weight), [], list(text.layers),
            ext,
        )

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
        (fused_step.cpp, screened_greedy): AVX512-BF16, and a finite lm_head of bf16 values. Same tokens
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
        chunk, all but its last token), which nothing downstream reads."""
        return self._run(input_ids, ctx, _NO_HIDDEN, output_rows)


class FusedMTP(_FusedStack):
    """The MTP head (one layer) as one C++ call per draft pass: Qwen3_5ForCausalLM.mtp_hidden."""

    def __init__(self, model: torch.nn.Module, cache: CacheTensors, ext: ModuleType | None = None) -> None:
        mtp = model.mtp
        if mtp is None or len(mtp.layers) != 1:
            raise ValueError("the fused MTP head needs a model with exactly one MTP layer")
        embed = mtp.embed_tokens if mtp.embed_tokens is not None else model.model.embed_tokens
        prologue = _linear(mtp.fc.weight) + [_one_plus(mtp.pre_fc_norm_embedding), _one_plus(mtp.pre_fc_norm_hidden)]
        # Drafts take their logits from the trunk's lm_head (FusedTrunk.logits): no second bf16 copy here.
        lm_head = [model.lm_head.weight.detach(), torch.empty(0)]
        super().__init__(model, cache, embed.weight, mtp.norm, lm_head, prologue, list(mtp.layers), ext)

    def __call__(
        self, next_token_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, step: int = 0
    ) -> torch.Tensor:
        """MTP hidden [T, H] from trunk (or previous MTP) hidden at t and token t+1; `step` picks the MTP
        layer in mtp_hidden, and with one layer there is nothing to pick."""
        return self._run(next_token_ids, ctx, hidden)

