"""The OpenAI-compatible HTTP server: FastAPI app, request/response shapes, chat prompts, reasoning split,
metrics and errors. `build_app(async_engine, ...)` is the entry point; `deltaserve serve` runs it."""
