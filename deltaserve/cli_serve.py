"""`deltaserve serve [MODEL]`: the OpenAI-compatible HTTP server (deltaserve/serve/). Parsing imports no
torch; the engine is built only when the command runs."""

from __future__ import annotations

import argparse
import os


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from deltaserve.cli import add_engine_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, metrics)")
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="checkpoint directory (default: the embedded demo model); same as --model",
    )
    add_engine_args(p)
    add_server_args(p)
    p.add_argument("--uvicorn-log-level", default="info")
    p.add_argument("--disable-access-log", action="store_true", help="no per-request uvicorn log lines")
    p.set_defaults(func=run_serve)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """HTTP server flags, shared by `serve` and `inspect` (the same server)."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("DELTASERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (or HTTP Basic with KEY as password, for a browser) on "
        "every route but /health (default: $DELTASERVE_API_KEY, else everything is open)",
    )
    p.add_argument(
        "--disable-metrics-auth",
        action="store_true",
        help="with --api-key, leave /metrics open too (for a Prometheus scraper without the key)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients send as `model` (default: the model path, or deltaserve-demo)",
    )
    p.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs a tool-call parser',
    )
    p.add_argument(
        "--tool-call-parser", choices=["qwen3_coder", "hermes"], default=None,
        help="how tool calls are read from the output (default: the one the chat template's call format needs)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="default sampling parameters: 'auto' reads the model's generation_config.json (as vLLM), "
        "'vllm' ignores it, or a folder holding a generation_config.json",
    )
    p.add_argument("--max-n", type=_positive, default=128, help="the largest n (sequences per prompt) allowed")
    p.add_argument(
        "--max-waiting-seqs",
        type=_positive,
        default=1024,
        help="sequences that may wait for a slot; past it a request gets 503 with Retry-After",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=_positive,
        default=16 * 1024 * 1024,
        help="larger request bodies get 413 (default 16 MiB)",
    )
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=10.0,
        help="on SIGTERM / SIGINT, seconds running requests may finish before they are aborted",
    )
    p.add_argument(
        "--allowed-local-media-path", default=None,
        help="let image_url parts name file: URLs below this folder (default: no local files)",
    )
    p.add_argument("--image-fetch-timeout", type=float, default=5.0,
                   help="seconds an http(s) image_url may take to fetch (default 5)")
    p.add_argument("--max-image-bytes", type=_positive, default=20 * 1024 * 1024,
                   help="larger images (fetched, decoded from data: URLs or read from files) get 400 (default 20 MiB)")
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="serve a checkpoint without tokenizer.json: prompts as token ids, outputs as token_ids (no chat)",
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def run_serve(args: argparse.Namespace) -> int:
    from deltaserve.cli import engine_kwargs
    from deltaserve.serve.launch import run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    return run_server(args, engine_kwargs(args))
