"""`deltaserve plan`: print the memory plan (weights, KV cache, GDN state, vision encoder cache per TP rank)
for a model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from deltaserve.cache.dtypes import DTYPE_BYTES, KV_CACHE_DTYPES, kv_scale_bytes
from deltaserve.config import ModelConfig
from deltaserve.engine.known_configs import KNOWN_CONFIGS, known_config
from deltaserve.ops.format_names import QUANTIZATIONS

if TYPE_CHECKING:
    from deltaserve.engine.planner import MemoryPlan

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "demo"


def load_plan_config(model: str | None) -> tuple[ModelConfig, str]:
    """A model directory, a config.json path, or a known name ('qwen3.5-27b', 'qwen3.5-27b-fp8')."""
    if model is None:
        return ModelConfig.from_file(DEMO_MODEL_DIR), "demo checkpoint"
    known = known_config(model)
    if known is not None:
        return ModelConfig.from_dict(known), model.lower()
    return ModelConfig.from_file(model), model


def max_tokens_per_image(model: str | None, cfg: ModelConfig) -> int | None:
    """The largest picture's merged tokens by the model directory's preprocessor_config.json, as the engine
    reads it (None: no directory, or no tower; the planner then takes Qwen3.5's defaults)."""
    from deltaserve.engine.image_processor import ImageProcessor

    folder = DEMO_MODEL_DIR if model is None else Path(model)
    if folder.is_file():
        folder = folder.parent
    if cfg.vision is None or not folder.is_dir():
        return None
    v = cfg.vision
    processor = ImageProcessor.from_dir(folder, v.patch_size, v.temporal_patch_size, v.spatial_merge_size)
    return processor.max_tokens_per_image


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="print the memory plan (weights, KV cache, GDN state) per tensor-parallel rank",
        description="Memory needed per tensor-parallel rank for the weights, the paged KV cache of the "
                    "attention layers and the per-sequence GDN states, for max-num-seqs sequences of "
                    "max-model-len tokens.",
    )
    p.add_argument("--model", default=None,
                   help="model directory or config.json, or a known config: " + ", ".join(KNOWN_CONFIGS)
                   + " (default: the embedded demo checkpoint)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens per sequence (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="concurrent sequences (default 256)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default=None, help="model (activation) dtype; default: the config's")
    p.add_argument("--weight-dtype", default=None,
                   help="bfloat16 | float16 | float32 | fp8 "
                   "(default: fp8 for an FP8 checkpoint, else --dtype)")
    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATIONS,
                   help="count the projections in this format, as `deltaserve serve --quantization` stores them")
    p.add_argument("--quantization-group-size", type=int, default=None,
                   help="columns per scale for int8 / int4 (default 32)")
    p.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=None,
                   help="count the MTP head and its KV cache (default: as the engine's speculative_config "
                   "'auto' decides, on for a config with an MTP layer and 100M text parameters or more)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="count the GDN state snapshots of prefix caching, on by default in the engine "
                   "(4 per sequence unless --num-gdn-snapshots)")
    p.add_argument("--num-gdn-snapshots", type=int, default=None,
                   help="GDN snapshots to count with --enable-prefix-caching (default 4 x max-num-seqs)")
    p.add_argument("--no-vision", action="store_true",
                   help="leave the vision tower (and its encoder cache) out of the plan")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="one step's token budget, which sizes the vision encoder cache (default: the engine's)")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="also report how many KV blocks fit in this much memory per rank")
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    from deltaserve.cache.sizing import default_num_snapshots
    from deltaserve.engine.planner import plan_memory
    from deltaserve.engine.spec_default import speculates_by_default

    try:
        if args.num_gdn_snapshots is not None and not args.enable_prefix_caching:
            raise ValueError("--num-gdn-snapshots counts prefix caching's snapshots; "
                             "drop --no-enable-prefix-caching")
        if args.num_gdn_snapshots is not None and args.num_gdn_snapshots < 1:
            raise ValueError(f"--num-gdn-snapshots must be a positive integer, got {args.num_gdn_snapshots}")
        snapshots = 0
        if args.enable_prefix_caching:
            snapshots = default_num_snapshots(args.max_num_seqs, args.num_gdn_snapshots)
        cfg, name = load_plan_config(args.model)
        budget = args.max_num_batched_tokens
        if budget is None:
            from deltaserve.engine.config import EngineConfig

            budget = EngineConfig().max_num_batched_tokens
        plan = plan_memory(
            cfg,
            max_model_len=args.max_model_len or cfg.max_position_embeddings,
            max_num_seqs=args.max_num_seqs,
            kv_cache_dtype=args.kv_cache_dtype,
            tp=args.tp,
            weight_dtype=args.weight_dtype,
            block_size=args.block_size,
            with_mtp=args.speculative if args.speculative is not None else speculates_by_default(
                cfg, cfg.mtp_num_hidden_layers > 0),
            include_vision=not args.no_vision,
            dtype=args.dtype,
            model_name=name,
            num_gdn_snapshots=snapshots,
            quantization=args.quantization,
            group_size=args.quantization_group_size,
            quantize_lm_head=args.quantize_lm_head,
            max_num_batched_tokens=budget,
            max_tokens_per_image=None if args.no_vision else max_tokens_per_image(args.model, cfg),
        )
    except (ValueError, NotImplementedError) as e:  # ConfigError and UnsupportedFeatureError included
        print(f"deltaserve plan: error: {e}", file=sys.stderr)
        return 2
    gpu = int(args.gpu_memory_gib * (1 << 30)) if args.gpu_memory_gib else None
    print(format_plan(plan, gpu))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltaserve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())


# ---- printing ------------------------------------------------------------------------------------------
def format_bytes(n: int | float) -> str:
    """Binary units, chosen so the number reads well: 4.00 KiB, 3.00 MiB, 50.12 GiB."""
    n = float(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n)} B"


def format_params(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.3f} B"
    if n >= 1e6:
        return f"{n / 1e6:.2f} M"
    return f"{n:,}"


def embedding_read(plan: MemoryPlan) -> str:
    """What a decode token reads of the embedding: a tied one is the lm_head (the plan counts no head)."""
    tied = any(p.name == "lm_head" and p.count == 0 for p in plan.weight_parts)
    return "the tied embedding whole, as the lm_head" if tied else "one embedding row"


def format_plan(plan: MemoryPlan, gpu_memory_bytes: int | None = None) -> str:
    r = plan.rank
    lines: list[str] = []
    add = lines.append
    title = f"Memory plan{' for ' + plan.model_name if plan.model_name else ''}"
    add(title)
    add("=" * len(title))
    add(f"layers {plan.num_layers}: {plan.num_gdn_layers} GDN + {plan.num_attention_layers} attention"
        f"{' (+ MTP layer with its own KV cache)' if plan.with_mtp else ''}")
    if plan.num_experts:
        add(f"sparse MoE: {plan.num_sparse_layers} of {plan.num_layers} layers, {plan.num_experts} experts, "
            f"top-{plan.num_experts_per_tok}, plus a shared expert")
    widths = [f"MLP width {r.intermediate}"] if r.intermediate else []
    if plan.num_experts:
        widths += [f"expert width {r.expert_intermediate}", f"shared expert width {r.shared_expert_intermediate}"]
    add(f"tensor parallel {plan.tp}: per rank attention heads {r.attention_heads}, KV heads {r.kv_heads}, "
        f"GDN heads {r.gdn_key_heads}k/{r.gdn_value_heads}v, {', '.join(widths)}, vocab rows {r.vocab}")
    weights = plan.weight_dtype + (f", projections {plan.quantization}" if plan.quantization else "")
    add(f"dtypes: model {plan.model_dtype}, weights {weights}, KV cache {plan.kv_cache_dtype}, "
        f"GDN recurrent state {plan.ssm_state_dtype}, conv state {plan.model_dtype}")
    add(f"workload: {plan.max_num_seqs} sequences x {plan.max_model_len:,} tokens, "
        f"block size {plan.block_size}")
    add("")
    add("Weights (per rank)")
    w = max(len(p.name) for p in plan.weight_parts) if plan.weight_parts else 10
    add(f"  {'part':<{w}}  {'count':>5}  {'params (model)':>14}  {'bytes each':>12}  {'bytes total':>12}")
    for p in plan.weight_parts:
        note = "" if p.included else "  (not loaded)"
        if p.included and p.name == "vision tower" and plan.tp > 1:
            note = "  (rank 0 only: the total is rank 0's)"
        add(f"  {p.name:<{w}}  {p.count:>5}  {format_params(p.total_params):>14}  "
            f"{format_bytes(p.bytes_per_rank):>12}  {format_bytes(p.total_bytes_per_rank):>12}{note}")
    add(f"  {'total loaded':<{w}}  {'':>5}  {'':>14}  {'':>12}  {format_bytes(plan.weight_bytes):>12}")
    add(f"  parameters: text {format_params(plan.text_params)}, MTP {format_params(plan.mtp_params)}, "
        f"vision {format_params(plan.vision_params)}")
    add(f"  per decode token: reads {format_bytes(plan.active_weight_bytes)} of the {format_bytes(plan.weight_bytes)}"
        f" loaded; active parameters {format_params(plan.active_params)} of {format_params(plan.text_params)}"
        f" ({'top-k routed experts, ' if plan.num_experts else ''}{embedding_read(plan)})")
    add("")
    def row(label: str, value: int, note: str = "") -> None:
        add(f"  {label:<24}{format_bytes(value):>12}{'   ' + note if note else ''}")

    add("Attention KV cache (per rank)")
    scales = " + an fp32 scale a row" if kv_scale_bytes(plan.kv_cache_dtype) else ""
    row("per token per layer", plan.kv_bytes_per_token_per_layer,
        f"(2 x {r.kv_heads} KV heads x (head_dim x {DTYPE_BYTES[plan.kv_cache_dtype]} B{scales}))")
    row(f"per token, {plan.num_kv_cache_layers} layers", plan.kv_bytes_per_token)
    row("per block", plan.kv_bytes_per_block)
    row("per sequence", plan.kv_bytes_per_block * plan.blocks_per_seq, f"({plan.blocks_per_seq:,} blocks)")
    row("all sequences", plan.kv_cache_bytes, f"({plan.num_kv_blocks:,} blocks)")
    add("")
    add("GDN state (per rank; fixed size, independent of sequence length)")
    row("recurrent per layer", plan.gdn_recurrent_bytes_per_layer)
    row("conv per layer", plan.gdn_conv_bytes_per_layer)
    row(f"per sequence, {plan.num_gdn_layers} layers", plan.gdn_state_bytes_per_seq)
    row("all sequences", plan.gdn_state_bytes, f"({plan.max_num_seqs} slots)")
    if plan.num_gdn_snapshots:
        row("prefix-cache snapshots", plan.gdn_snapshot_bytes,
            f"({plan.num_gdn_snapshots} snapshots of one slot each)")
    if plan.encoder_cache_tokens:
        add("")
        where = "; rank 0 holds it and the whole tower, which it alone runs" if plan.tp > 1 else ""
        add(f"Vision encoder cache (the tower's outputs kept through prefill{where})")
        row(f"{plan.encoder_cache_tokens:,} merged tokens", plan.encoder_cache_bytes,
            f"(max of max-num-batched-tokens {plan.max_num_batched_tokens:,} and the largest picture's "
            f"{plan.encoder_tokens_per_image:,} tokens, x {plan.encoder_cache_bytes // plan.encoder_cache_tokens:,} B)")
    add("")
    add(f"Total per rank            {format_bytes(plan.total_bytes):>12}   "
        f"(weights {format_bytes(plan.weight_bytes)}, cache {format_bytes(plan.cache_bytes)}; "
        "activations not included)")
    if gpu_memory_bytes is not None:
        free = (gpu_memory_bytes - plan.weight_bytes - plan.gdn_state_bytes - plan.gdn_snapshot_bytes
                - plan.encoder_cache_bytes)
        blocks = max(0, free) // plan.kv_bytes_per_block if plan.kv_bytes_per_block else 0
        add(f"With {format_bytes(gpu_memory_bytes)} per rank: {blocks:,} KV blocks fit after weights and "
            f"{plan.max_num_seqs} GDN slots = {blocks * plan.block_size:,} cached tokens, "
            f"{blocks // plan.blocks_per_seq if plan.blocks_per_seq else 0} sequences at full length")
    return "\n".join(lines)
