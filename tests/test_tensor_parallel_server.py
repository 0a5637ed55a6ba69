"""`deltaserve serve --tensor-parallel-size 2` end to end: the `openai` client gets the same greedy text as
one process computes, and a repeated prompt's cached tokens; killing the worker process turns /health into
a 503 naming rank 1 and makes the next request fail at once (an error response, not a hang)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.assets import DEMO_DIR
from tests.server_process import ServerProcess, running_server, text_checkpoint

pytestmark = pytest.mark.skipif(
    not (DEMO_DIR / "tokenizer.json").exists(), reason="the demo tokenizer is not in the package yet"
)
MODEL = "tiny-tp"
PROMPT = "The tensor-parallel ranks"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def server(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--served-model-name", MODEL, "--max-model-len", "256", "--max-num-seqs", "4",
            "--tensor-parallel-size", "2"]
    with running_server(ckpt, args, tmp_path_factory.mktemp("log") / "server.log") as proc:
        yield proc


def worker_pids(parent: int) -> list[int]:
    """The server's tensor-parallel worker processes (its children running deltaserve.executor.tp_worker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"deltaserve.executor.tp_worker" in cmdline:
            pids.append(int(entry.name))
    return pids


def test_openai_client_then_a_killed_worker(server: ServerProcess, ckpt: Path) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    want = LLM(model=str(ckpt), max_model_len=256, max_num_seqs=4).generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
    )
    assert got.choices[0].text == want[0].outputs[0].text

    # Prefix caching is on under tensor parallelism too: the same long prompt again reuses all but its last
    # block (each rank restored its heads' GDN snapshot), and answers the same.
    long = " ".join([PROMPT] * 8)
    first, again = (client.completions.create(model=MODEL, prompt=long, max_tokens=8, temperature=0) for _ in range(2))
    assert first.choices[0].text == again.choices[0].text
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // 16 * 16 > 0

    (pid,) = worker_pids(server.proc.pid)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (health := httpx.get(f"{server.url}/health", timeout=5)).status_code == 200:
        assert time.monotonic() < deadline, "/health still reports 200 after the worker died"
        time.sleep(0.2)
    assert health.status_code == 503 and "worker rank 1" in health.text
    with pytest.raises(openai.APIStatusError) as err:  # answered, not left waiting (the client's timeout)
        client.with_options(timeout=30).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert err.value.status_code >= 500
