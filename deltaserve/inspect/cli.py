"""`deltaserve inspect [MODEL]`: the same server as `deltaserve serve` (OpenAI API with the inspector
mounted at /inspect), started to be looked at: it prints the inspector's URL first. Parsing imports no
torch."""

from __future__ import annotations

import argparse


def add_inspect_parser(sub: argparse._SubParsersAction) -> None:
    from deltaserve.cli import add_engine_args
    from deltaserve.cli_serve import add_server_args

    p = sub.add_parser("inspect", help="web inspector: the model layer by layer, live engine steps")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory (default: the embedded demo model); same as --model")
    add_engine_args(p)
    add_server_args(p)
    p.add_argument("--uvicorn-log-level", default="warning")
    # The page polls and streams; per-request access lines would drown the log.
    p.add_argument("--access-log", dest="disable_access_log", action="store_false")
    p.set_defaults(func=run_inspect, disable_access_log=True)


def inspector_url(host: str, port: int) -> str:
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/inspect"


def run_inspect(args: argparse.Namespace) -> int:
    from deltaserve.cli import engine_kwargs
    from deltaserve.serve.launch import run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    print(f"deltaserve inspector: {inspector_url(args.host, args.port)}", flush=True)
    return run_server(args, engine_kwargs(args))
