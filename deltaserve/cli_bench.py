"""`deltaserve bench serve --url URL --concurrency N --num-prompts M`: load a running server and print
vLLM-style serving numbers (deltaserve/serve/bench.py). Other benchmarks can add sibling subcommands."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (serve: load a running server)")
    kinds = p.add_subparsers(dest="bench_command", required=True)
    s = kinds.add_parser("serve", help="streaming load against a running deltaserve / OpenAI server")
    s.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    s.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    s.add_argument("--api-key", default=None)
    s.add_argument("--concurrency", type=int, nargs="+", default=[1], help="one run per value")
    s.add_argument("--num-prompts", type=int, default=32)
    s.add_argument("--input-len", type=int, default=64, help="prompt length in words")
    s.add_argument("--output-len", type=int, default=64, help="tokens generated per request (ignore_eos)")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=run_bench_serve)


def run_bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from deltaserve.serve.bench import format_report, run_bench

    for c in args.concurrency:
        if c < 1 or args.num_prompts < 1:
            raise ValueError(f"--concurrency and --num-prompts must be >= 1, got {c} and {args.num_prompts}")
        result = asyncio.run(
            run_bench(
                args.url,
                args.model,
                c,
                args.num_prompts,
                args.input_len,
                args.output_len,
                args.api_key,
                args.seed,
            )
        )
        print(format_report(result))
        if result.failed:
            return 1
    return 0
