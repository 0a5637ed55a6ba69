"""`deltaserve serve`: check the port and the tokenizer, build the engine, start its thread, print how to
call the server, run uvicorn; on SIGTERM / SIGINT drain and exit 0."""

from __future__ import annotations

import argparse
import logging
import socket
import threading
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger("deltaserve.serve")

DEMO_MODEL_NAME = "deltaserve-demo"


def usage_banner(host: str, port: int, model: str, api_key: str | None) -> str:
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    auth = f' \\\n  -H "Authorization: Bearer {api_key}"' if api_key else ""
    key = repr(api_key) if api_key else '"unused"'
    return f"""
deltaserve is serving `{model}` at {base}/v1  (metrics: {base}/metrics, health: {base}/health)

  curl {base}/v1/chat/completions -H "Content-Type: application/json"{auth} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 64}}'

  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key={key})
  r = client.chat.completions.create(
      model="{model}", messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=64,
      extra_body={{"chat_template_kwargs": {{"enable_thinking": False}}}},  # omit to let it think first
  )
  print(r.choices[0].message.content)
"""


def tool_config(args: argparse.Namespace, tokenizer: Any) -> Any:
    """--enable-auto-tool-choice and --tool-call-parser, the parser defaulting to the chat template's."""
    from deltaserve.serve.chat_tools import ToolConfig
    from deltaserve.serve.tool_parsers import parser_for_template

    parser = getattr(args, "tool_call_parser", None)
    if parser is None:
        parser = parser_for_template(getattr(tokenizer, "chat_template", None))
        if parser is not None:
            log.info("tool-call parser: %s (from the chat template)", parser)
    return ToolConfig(bool(getattr(args, "enable_auto_tool_choice", False)), parser)


def bind_port(host: str, port: int) -> socket.socket:
    """The listening socket, taken before the model loads: a port in use fails in a second, not after a
    minute of loading. uvicorn serves on this very socket."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: no wait on TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


def check_tokenizer(model_dir: Path, skip_tokenizer_init: bool) -> None:
    has = (model_dir / "tokenizer.json").exists()
    if not has and not skip_tokenizer_init:
        raise ValueError(
            f"{model_dir} has no tokenizer.json: text prompts and chat cannot work. Add the tokenizer files, "
            "or pass --skip-tokenizer-init to serve token ids only (prompts as token ids, outputs as token_ids)"
        )


def make_server(config: Any, engine: Any, grace_s: float) -> Any:
    """uvicorn.Server that drains on SIGTERM / SIGINT: it stops taking connections (uvicorn), lets running
    requests finish for grace_s seconds, then aborts the rest, so that every stream still ends with a
    finish_reason ("abort") and [DONE]; and it exits 0 rather than re-raising the signal."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a requested stop is a clean exit, not death by signal
            if first:
                log.info("stopping: no new requests; running ones get %.0f s to finish", grace_s)
                # A timer thread, not the signal handler, calls into the engine (its lock may be held here).
                timer = threading.Timer(grace_s, engine.abort_all)
                timer.daemon = True
                timer.start()

    return DrainingServer(config)


def run_server(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    import uvicorn

    from deltaserve.engine.async_engine import AsyncEngine
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.generation_config import generation_defaults
    from deltaserve.engine.llm_engine import LLMEngine
    from deltaserve.inspect.routes import build_inspect_router
    from deltaserve.serve.app import ServerOptions, build_app
    from deltaserve.serve.params import RequestRules

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sock = bind_port(args.host, args.port)
    try:
        config = EngineConfig(**engine_kwargs)
        media = media_options(args)
        model_dir = Path(config.model) if config.model else _demo_dir()
        check_tokenizer(model_dir, args.skip_tokenizer_init)
        defaults = generation_defaults(model_dir, args.generation_config)
        name = args.served_model_name or config.model or DEMO_MODEL_NAME
        log.info("loading %s", config.model or "the embedded demo checkpoint")
        engine = AsyncEngine(LLMEngine(config), max_waiting=args.max_waiting_seqs).start()
    except BaseException:
        sock.close()
        raise
    tok = engine.tokenizer
    rules = RequestRules(
        max_n=args.max_n, defaults=defaults, max_token_chars=None if tok is None else tok.max_token_chars
    )
    options = ServerOptions(
        api_key=args.api_key,
        metrics_need_key=not args.disable_metrics_auth,
        max_request_body_bytes=args.max_request_body_bytes,
        rules=rules,
        media=media,
    )
    app = build_app(engine, name, options, model_root=config.model,
                    extra_routers=[build_inspect_router(engine.engine)],  # the inspector at /inspect
                    tool_config=tool_config(args, engine.tokenizer))
    print(usage_banner(args.host, args.port, name, args.api_key), flush=True)
    server = make_server(
        uvicorn.Config(
            app,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_access_log,
            timeout_graceful_shutdown=args.shutdown_grace_s + 5,  # the aborted streams' last chunks
        ),
        engine,
        args.shutdown_grace_s,
    )
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
    return 0


def media_options(args: argparse.Namespace) -> Any:
    from deltaserve.engine.media import MediaOptions

    root = args.allowed_local_media_path
    if root is not None and not Path(root).is_dir():
        raise ValueError(f"--allowed-local-media-path {root!r} is not a folder")
    return MediaOptions(None if root is None else Path(root), args.image_fetch_timeout, args.max_image_bytes)


def _demo_dir() -> Path:
    from deltaserve.assets import demo_checkpoint_path

    return demo_checkpoint_path()
