"""Serving benchmark, `vllm bench serve`-style (not a test; timing decides nothing).

    .venv/bin/python benchmarks/bench_serve.py [--model PATH | --random] [--concurrency 1 8 32] [--no-write]
    .venv/bin/python benchmarks/bench_serve.py --url http://127.0.0.1:8000 ...   # an already running server

Starts `deltaserve serve` on a free loopback port (the embedded demo checkpoint by default; --random: a
small random model with the demo tokenizer, to check the script itself), then for each concurrency sends
--num-prompts streaming /v1/completions requests (fixed prompt and output lengths, ignore_eos) and records
TTFT, TPOT, ITL, end-to-end latency and throughput. The table goes into docs/benchmarks.md under
"Serving (bench serve)" (that section is replaced, others are kept)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import machine, write_section  # noqa: E402

from deltaserve.serve.bench import BenchResult, format_report, run_bench  # noqa: E402

SECTION = "## Serving (bench serve)"
DOC = ROOT / "docs" / "benchmarks.md"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_checkpoint(path: Path) -> Path:
    from deltaserve.assets import DEMO_DIR
    from tests.checkpoints import TINY, random_hf_model, save_official_layout

    save_official_layout(random_hf_model(dict(TINY, vocab_size=8192), seed=3), path)
    for f in DEMO_DIR.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, path / f.name)
    return path


def start_server(
    model: Path | None, threads: int, max_model_len: int, log: Path
) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "deltaserve.cli",
        "serve",
        *([str(model)] if model else []),
        "--port",
        str(port),
        "--disable-access-log",
        "--max-model-len",
        str(max_model_len),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server not healthy:\n{log.read_text()}")


def table(rows: list[BenchResult]) -> list[str]:
    out = [
        "| concurrency | requests | req/s | output tok/s | TTFT (ms) | TPOT (ms) | ITL (ms) | E2E (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def q(d: dict[str, float]) -> str:
        return " / ".join(
            f"{d[k]:.0f}" if d[k] >= 100 else f"{d[k]:.1f}" for k in ("mean", "p50", "p90", "p99")
        )

    for r in rows:
        out.append(
            f"| {r.concurrency} | {r.completed}/{r.num_prompts} | {r.request_throughput:.2f} | "
            f"{r.output_throughput:.1f} | {q(r.ttft_ms)} | {q(r.tpot_ms)} | {q(r.itl_ms)} | {q(r.e2e_ms)} |"
        )
    return out




def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="benchmark this running server instead of starting one")
    ap.add_argument("--model", default=None, help="checkpoint to serve (default: the embedded demo)")
    ap.add_argument("--random", action="store_true", help="serve a small random model (script check)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument(
        "--num-prompts", type=int, default=None, help="per run (default: max(8, 2 x concurrency))"
    )
    ap.add_argument("--input-len", type=int, default=64, help="prompt words")
    ap.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server process")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--note", default="", help="a sentence appended to the run description")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()

    proc = None
    tmp = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    label = "the embedded demo checkpoint"
    try:
        url = args.url
        if url is None:
            model = Path(args.model) if args.model else None
            if args.random:
                model, label = random_checkpoint(tmp / "ckpt"), "a random 4-layer test model (TINY shape)"
            elif model is not None:
                label = f"`{model}`"
            proc, url = start_server(model, args.threads, args.max_model_len, tmp / "server.log")
        else:
            label = f"the server at {url}"
        rows = []
        for c in args.concurrency:
            n = args.num_prompts or max(8, 2 * c)
            r = asyncio.run(run_bench(url, None, c, n, args.input_len, args.output_len))
            print(format_report(r), flush=True)
            rows.append(r)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)

    head = (
        f"Run {datetime.date.today().isoformat()} on {machine()} "
        f"(server with torch threads = {args.threads}); {label}, fp32, over HTTP on loopback. Each request: a "
        f"{args.input_len}-word prompt, {args.output_len} generated tokens (greedy, ignore_eos), streamed "
        "via /v1/completions; all requests queued at once, at most `concurrency` in flight. TTFT: request "
        "sent to first text chunk; TPOT: (latency - TTFT) / (tokens - 1); ITL: gaps between chunks. "
        "Produced by `benchmarks/bench_serve.py` (the same client as `deltaserve bench serve`)."
        + (f" {args.note}" if args.note else "")
    )
    lines = [head, "", "Latency cells: mean / p50 / p90 / p99.", "", *table(rows)]
    print("\n".join(lines))
    if not args.no_write:
        write_section(SECTION, "\n".join([SECTION, "", *lines]))
        print(f"wrote {DOC.relative_to(ROOT)}")
    return 0 if all(r.failed == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
