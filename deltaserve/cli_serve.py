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
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("DELTASERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $DELTASERVE_API_KEY, else open)",
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
    p.add_argument("--uvicorn-log-level", default="info")
    p.add_argument("--disable-access-log", action="store_true", help="no per-request uvicorn log lines")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from deltaserve.cli import engine_kwargs
    from deltaserve.serve.launch import run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    return run_server(args, engine_kwargs(args))
