"""Two hosts simulated as two network namespaces joined by a veth pair (iproute2, needs root): the server
is rank 0 in one, `deltaserve worker` rank 1 in the other with its own copy of the checkpoint (--model),
meeting by the env:// rendezvous over that link; the `openai` client gets the one-process text. Then the
remote worker dies and /health says a rank stopped answering. Slow (make test-all): it changes the network
configuration of the machine for its duration."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.assets import DEMO_DIR
from tests.server_process import text_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"),
    pytest.mark.skipif(not (DEMO_DIR / "tokenizer.json").exists(), reason="needs the demo tokenizer"),
]
A, B = "10.77.0.1", "10.77.0.2"


def sh(*args: str) -> None:
    subprocess.run(args, check=True)


def in_ns(ns: str, cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    full = ["ip", "netns", "exec", ns, "env", *(f"{k}={v}" for k, v in env.items()), *cmd]
    return subprocess.Popen(full, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def request(ns: str, code: str) -> str:
    """Run a few lines of Python inside namespace ns (where the server's address is reachable)."""
    return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], check=True,
                          capture_output=True, text=True, timeout=60).stdout.strip()


def test_two_hosts_as_network_namespaces(tmp_path: Path) -> None:
    ckpt = text_checkpoint(tmp_path / "host_a")
    other = shutil.copytree(ckpt, tmp_path / "host_b")
    tag = str(os.getpid())[-5:]
    na, nb, va, vb = f"dsA{tag}", f"dsB{tag}", f"dva{tag}", f"dvb{tag}"
    procs: list[subprocess.Popen] = []
    sh("ip", "netns", "add", na)
    try:
        sh("ip", "netns", "add", nb)
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, dev, addr in ((na, va, A), (nb, vb, B)):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        env = dict(MASTER_ADDR=A, MASTER_PORT="29555", WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cli = [sys.executable, "-m", "deltaserve.cli"]
        procs.append(in_ns(na, [*cli, "serve", str(ckpt), "--tensor-parallel-size", "2", "--host", A, "--port",
                                "8011", "--served-model-name", "tiny", "--max-model-len", "256"],
                           dict(env, RANK="0", GLOO_SOCKET_IFNAME=va), tmp_path / "a.log"))
        procs.append(in_ns(nb, [*cli, "worker", "--model", str(other)], dict(env, RANK="1", GLOO_SOCKET_IFNAME=vb),
                           tmp_path / "b.log"))
        health = f"import httpx; r = httpx.get('http://{A}:8011/health'); print(r.status_code, r.text)"
        deadline = time.monotonic() + 120
        while not request(na, f"try:\n {health}\nexcept httpx.HTTPError: print(0)").startswith("200"):
            assert time.monotonic() < deadline and procs[0].poll() is None, (tmp_path / "a.log").read_text()
            time.sleep(0.5)
        got = request(na, f"import openai; c = openai.OpenAI(base_url='http://{A}:8011/v1', api_key='x'); "
                          "print(repr(c.completions.create(model='tiny', prompt='Two hosts', max_tokens=8, "
                          "temperature=0).choices[0].text))")
        want = LLM(model=str(ckpt), max_model_len=256).generate(
            "Two hosts", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0].text
        assert got == repr(want)

        procs[1].kill()  # `ip netns exec` execs the worker: this is its process
        deadline = time.monotonic() + 30
        while (reply := request(na, health)).startswith("200"):
            assert time.monotonic() < deadline, "/health still 200 after the remote worker died"
            time.sleep(0.5)
        assert reply.startswith("503") and "a rank stopped or stopped answering" in reply
    finally:
        for p in procs:
            p.kill()
            p.wait()
        subprocess.run(["ip", "netns", "del", na], check=False)
        subprocess.run(["ip", "netns", "del", nb], check=False)
