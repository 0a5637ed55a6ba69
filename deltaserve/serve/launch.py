"""`deltaserve serve`: build the engine, start its thread, print how to call the server, run uvicorn."""

from __future__ import annotations

import argparse
import logging
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


def run_server(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    import uvicorn

    from deltaserve.engine.async_engine import AsyncEngine
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.llm_engine import LLMEngine
    from deltaserve.inspect.routes import build_inspect_router
    from deltaserve.serve.app import build_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig(**engine_kwargs)
    name = args.served_model_name or config.model or DEMO_MODEL_NAME
    log.info("loading %s", config.model or "the embedded demo checkpoint")
    engine = AsyncEngine(LLMEngine(config)).start()
    app = build_app(engine, name, api_key=args.api_key, model_root=config.model,
                    extra_routers=[build_inspect_router(engine.engine)],  # the inspector at /inspect
                    tool_config=tool_config(args, engine.tokenizer))
    print(usage_banner(args.host, args.port, name, args.api_key), flush=True)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_access_log,
            timeout_graceful_shutdown=5,
        )
    )
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0
