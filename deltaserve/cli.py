"""`deltaserve` command line: one small `add_*_parser(sub)` per subcommand, so each author adds theirs
without touching the others."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from deltaserve.cli_bench import add_bench_parser
from deltaserve.cli_eval import add_eval_parser
from deltaserve.cli_plan import add_plan_parser
from deltaserve.cli_serve import add_serve_parser
from deltaserve.inspect.cli import add_inspect_parser
from deltaserve.ops.format_names import ACTIVATION_QUANTIZATIONS, QUANTIZATIONS


def json_object(text: str) -> dict[str, Any]:
    """argparse type for JSON-object flags: a clear message instead of "invalid loads value"."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'expected a JSON object like {{"method": "mtp"}}, got {text!r}')
    return value


def speculative_config(text: str) -> dict[str, Any] | str | None:
    """argparse type for --speculative-config: "auto", "off", or a JSON object."""
    if text == "off":
        return None
    return text if text == "auto" else json_object(text)  # (engine.config.SPECULATION_AUTO: the parser loads no torch)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, spelled as in vLLM; shared by every subcommand that builds an engine."""
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded demo model)")
    p.add_argument("--dtype", default="auto",
                   help="activations: auto (float32 on CPU, weights kept as the checkpoint stores them), "
                   "float32, bfloat16, float16 (weights in it too)")
    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATIONS,
                   help="store the projections' weights as fp8 (E4M3, 128x128 blocks), int8 or int4 "
                   "(group-wise, symmetric), quantized as they load (default: the checkpoint's format)")
    p.add_argument("--quantization-group-size", type=int, default=None,
                   help="columns per scale for int8 / int4 (default 32)")
    p.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction, default=True,
                   help="whether --quantization covers lm_head too (default: yes)")
    p.add_argument("--activation-quantization", default=None, choices=ACTIVATION_QUANTIZATIONS,
                   help="int8: int8 / int4 projections quantize their input rows to int8 per group as well and "
                   "sum integer products (as llama.cpp's Q8 activations); bf16: every projection rounds its input "
                   "rows to bf16 (as llama.cpp's BF16 path; bf16 weights then multiply bf16 pairs, about twice as "
                   "fast on prompts where the CPU has AVX512-BF16); none: they multiply the float rows "
                   "(default: int8 with --quantization int8 / int4, else none)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes for KV blocks + GDN state slots (default: --cache-memory-fraction of the memory "
                   "available after the weights load)")
    p.add_argument("--cache-memory-fraction", type=float, default=0.5,
                   help="share of the available memory the cache pools may take without --kv-cache-memory")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model dtype), float32, bfloat16, or fp8 (= fp8_e4m3: E4M3 with a scale per token "
                   "and KV head)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks and GDN state snapshots of prompts' common prefixes (default: on "
                   "when the snapshot pool fits in the cache memory)")
    p.add_argument("--mamba-cache-mode", default="none", choices=("none", "align", "all"),
                   help="GDN state caching for prefix caching: align (snapshots at block boundaries; the "
                   "mode whenever prefix caching is on); all is not supported")
    p.add_argument("--mamba-block-size", type=int, default=None,
                   help="tokens between GDN snapshots of a long prompt (default 32 blocks)")
    p.add_argument(
        "--speculative-config",
        type=speculative_config,
        default="auto",
        help='auto (the default: adaptive MTP drafting, up to 3 tokens, for a checkpoint with an MTP head and '
             '100M text parameters or more, else off), off, or JSON, e.g. \'{"method": "mtp", '
             '"num_speculative_tokens": 3}\': the MTP head drafts up to 3 tokens a step, as many as measure to pay '
             'for each request; "adaptive": false drafts 3 every step',
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, dest="num_threads",
                   help="compute threads (default: $OMP_NUM_THREADS, else one per physical core)")
    p.add_argument(
        "--limit-mm-per-prompt", type=json_object, default=None,
        help='most images one prompt may carry, as JSON, e.g. \'{"image": 2}\' (default: no limit)',
    )
    p.add_argument(
        "--enforce-eager", action="store_true",
        help="run every step through the Python model op by op instead of the fused C++ step",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) / EngineConfig(...) keyword arguments from the flags add_engine_args defined."""
    return dict(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        quantize_lm_head=args.quantize_lm_head,
        activation_quantization=args.activation_quantization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        cache_memory_fraction=args.cache_memory_fraction,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        mamba_cache_mode=args.mamba_cache_mode,
        mamba_block_size=args.mamba_block_size,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        num_threads=args.num_threads,
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace) -> Any:
    from deltaserve.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


# ---- generate ---------------------------------------------------------------------------------------
def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete one or more prompts and print the text")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from deltaserve.engine.llm import LLM

    llm = LLM(**engine_kwargs(args))
    params = sampling_params(args)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for out in outputs:
        print(out.outputs[0].text)
    return 0


# ---- worker -----------------------------------------------------------------------------------------
def add_worker_parser(sub: argparse._SubParsersAction) -> None:
    from deltaserve.executor.tp_worker import MODEL_HELP

    p = sub.add_parser("worker", help="a tensor-parallel rank 1..N-1 (env:// rendezvous with the engine, rank 0)")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.set_defaults(func=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    from deltaserve.executor.tp_worker import run

    return run(args.model)


# ---- other subcommands: each author adds an add_<name>_parser(sub) here and to SUBCOMMANDS ----------
# serve:   add_serve_parser   (HTTP server; reuse add_engine_args / engine_kwargs)
# chat:    add_chat_parser    (interactive chat loop)
# bench:   add_bench_parser   (benchmarks)
# plan:    add_plan_parser    (memory planner, deltaserve/cli_plan.py)
# inspect: add_inspect_parser (web inspector)
# eval:    add_eval_parser    (perplexity, deltaserve/cli_eval.py)

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_generate_parser,
    add_plan_parser,
    add_serve_parser,
    add_bench_parser,
    add_inspect_parser,
    add_eval_parser,
    add_worker_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaserve", description="Qwen3.5 / Qwen3.8 inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        # Errors a user caused (bad flag value, prompt too long, missing checkpoint): one line, no trace.
        print(f"deltaserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
