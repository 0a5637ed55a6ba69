"""`deltaserve plan`: print the memory plan (weights, KV cache, GDN state per TP rank) for a model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deltaserve.config import ModelConfig
from deltaserve.engine.known_configs import KNOWN_CONFIGS, known_config

# Kept here (equal to planner.KV_CACHE_DTYPES, a test holds them together) so that building the CLI parser
# does not import torch; the planner is imported when the command runs.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "demo"


def load_plan_config(model: str | None) -> tuple[ModelConfig, str]:
    """A model directory, a config.json path, or a known name ('qwen3.5-27b', 'qwen3.5-27b-fp8')."""
    if model is None:
        return ModelConfig.from_file(DEMO_MODEL_DIR), "demo checkpoint"
    known = known_config(model)
    if known is not None:
        return ModelConfig.from_dict(known), model.lower()
    return ModelConfig.from_file(model), model


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
    p.add_argument("--speculative", action="store_true", help="count the MTP head and its KV cache")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="count the GDN state snapshots of prefix caching, on by default in the engine "
                   "(4 per sequence unless --num-gdn-snapshots)")
    p.add_argument("--num-gdn-snapshots", type=int, default=None,
                   help="GDN snapshots to count with --enable-prefix-caching (default 4 x max-num-seqs)")
    p.add_argument("--no-vision", action="store_true", help="leave the vision tower out of the weights")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="also report how many KV blocks fit in this much memory per rank")
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    from deltaserve.engine.planner import default_num_snapshots, format_plan, plan_memory

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
        plan = plan_memory(
            cfg,
            max_model_len=args.max_model_len or cfg.max_position_embeddings,
            max_num_seqs=args.max_num_seqs,
            kv_cache_dtype=args.kv_cache_dtype,
            tp=args.tp,
            weight_dtype=args.weight_dtype,
            block_size=args.block_size,
            with_mtp=args.speculative,
            include_vision=not args.no_vision,
            dtype=args.dtype,
            model_name=name,
            num_gdn_snapshots=snapshots,
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
