"""A real `deltaserve serve` process on a free loopback port, for the server tests and the benchmark's
self-check: a random small model with the demo tokenizer beside it (its output text is noise, which is
fine for checks of format, equality and cache hygiene)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from deltaserve.assets import DEMO_DIR
from tests.checkpoints import (
    TINY,
    random_hf_model,
    random_hf_moe_model,
    save_causal_lm_layout,
    save_official_layout,
)

ROOT = Path(__file__).resolve().parent.parent


def text_checkpoint(path: Path, seed: int = 3, moe_family: str | None = None) -> Path:
    """A random TINY model over the demo tokenizer's 8192 ids (and 4096 positions, so that a request can
    run long enough to be interrupted), with that tokenizer copied in; sparse-MoE with moe_family
    ('qwen3_5_moe' or 'qwen3_next')."""
    shape = dict(TINY, vocab_size=8192, max_position_embeddings=4096)
    if moe_family is None:
        save_official_layout(random_hf_model(shape, seed=seed), path)
    else:
        save = save_official_layout if moe_family == "qwen3_5_moe" else save_causal_lm_layout
        save(random_hf_moe_model(moe_family, shape, seed=seed), path)
    for f in DEMO_DIR.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, path / f.name)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: Path | None, args: list[str], log_path: Path, threads: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "deltaserve.cli", "serve"]
        if model is not None:
            cmd.append(str(model))
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--disable-access-log", *args]
        # One intra-op thread: tiny models gain nothing from more, and the machine is shared.
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        self._log = open(log_path, "w")  # a file, not a pipe: a full pipe would stall the server
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.proc.returncode}:\n{self.log_path.read_text()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the server did not become healthy in {timeout}s:\n{self.log_path.read_text()}")

    @contextlib.contextmanager
    def running(self, timeout: float = 120.0) -> Iterator[ServerProcess]:
        """The server, healthy, for the with-block; stopped after it (a pytest fixture yields inside)."""
        try:
            self.wait_ready(timeout)
            yield self
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@contextlib.contextmanager
def running_server(model: Path | None, args: list[str], log_path: Path) -> Iterator[ServerProcess]:
    """A started, healthy server for the block (a module fixture's body), stopped after it."""
    proc = ServerProcess(model, args, log_path)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
