"""Sparse MoE at the Qwen3.5-35B-A3B's ratios, scaled down: deltaserve's weight formats beside llama.cpp's at
the same bytes per weight (and transformers), with a dense checkpoint of the same active parameters, one
machine, one run (not a test; timing decides nothing).

    .venv/bin/python benchmarks/bench_moe.py [--layers 12] [--formats bf16,int8,int4] [--threads 1,2]
        [--decode 128] [--prompt 512] [--requests 4] [--no-transformers] [--no-dense] [--write]
    .venv/bin/python benchmarks/bench_moe.py --check     # do deltaserve and llama.cpp run the same model?

The MoE checkpoint is random, the 35B-A3B's shape (REFERENCE.md) scaled down: hidden 1024 instead of 2048,
128 experts instead of 256, top-8, expert and shared-expert width hidden / 4, 8 / 2 attention heads of 128,
GDN 8 key and 16 value heads of 64, [lin, lin, lin, full] layers, vocab 32000, tied embeddings, bf16 on
disk with the experts fused into 3-D tensors as in the bf16 releases. With 12 layers: 1.30 B parameters
(2.6 GB bf16), 0.17 B read per decode token. The dense checkpoint is the same with one MLP as wide as what a
token reads of the MoE block (top_k x expert width + shared width = 2304; the router's 128 x 1024 aside).
Both are written once under ~/.cache/deltaserve/bench_moe/ (bench_tp's writer) and converted there with
llama.cpp's own converter (arch qwen35moe / qwen35) and quantizer (bench_formats' machinery).

The workloads, the process per engine, the interleaving (each deltaserve format, then its peers at the same
bytes per weight, MoE then dense), the resident memory (peak VmHWM, steady VmRSS) and the read-bandwidth
column are bench_formats.py's, which also says how the llama.cpp peer is built. Bytes per decode token count
the routed experts' tensors at top_k / num_experts (the experts one token reads).

--check runs each deltaserve format (fused executor) greedily on a prompt and has llama.cpp score the same
sequence at the same bytes per weight: how often llama.cpp's argmax is the token deltaserve chose, and the
largest difference between the two engines' log-probabilities of those tokens."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Only the standard library at the top: the llama.cpp scorer runs this file in the peer's venv (no torch).
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_formats import (  # noqa: E402
    CACHE,
    LLAMA_PEER,
    Job,
    Result,
    add_run_arguments,
    deltaserve_bytes_per_token,
    gguf_bytes_per_token,
    gguf_files,
    llama_src,
    ratios,
    read_bandwidth,
    run_job,
    table,
    tokens,
)

WORKDIR = CACHE / "bench_moe"
SECTION = "## Sparse MoE decode (bench_moe)"
FORMATS = ("bf16", "int8", "int4")  # the formats llama.cpp has a peer for

HIDDEN = 1024
SHAPE = dict(
    vocab_size=32000, hidden_size=HIDDEN, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
    head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4, partial_rotary_factor=0.25, max_position_embeddings=4096,
)
EXPERTS = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=HIDDEN // 4,
               shared_expert_intermediate_size=HIDDEN // 4)
EXPERT_SHARE = EXPERTS["num_experts_per_tok"] / EXPERTS["num_experts"]
DENSE_WIDTH = EXPERTS["num_experts_per_tok"] * EXPERTS["moe_intermediate_size"] + EXPERTS[
    "shared_expert_intermediate_size"]
CHECK_PROMPT = CHECK_NEW = 32


def checkpoints(layers: int, dense: bool) -> dict[str, Path]:
    """{"MoE": dir, "dense": dir}, each written once."""
    from bench_tp import write_checkpoint

    paths = {"MoE": WORKDIR / f"moe-{layers}l"}
    write_checkpoint(paths["MoE"], layers, SHAPE, EXPERTS)
    if dense:
        paths["dense"] = WORKDIR / f"dense-{layers}l"
        write_checkpoint(paths["dense"], layers, dict(SHAPE, intermediate_size=DENSE_WIDTH))
    return paths


def share(model: str) -> float:
    return EXPERT_SHARE if model == "MoE" else 1.0


def bytes_per_weight(path: Path, fmt: str, gguf: Path | None, src: Path | None) -> str:
    """The whole checkpoint's bytes per weight at fmt (deltaserve) and in its llama.cpp peer's file."""
    n = deltaserve_bytes_per_token(path, "bf16") / 2  # every tensor at 2 bytes: the parameter count
    text = f"deltaserve {fmt} {deltaserve_bytes_per_token(path, fmt) / n:.3f}"
    if gguf is not None:
        text += f", llama.cpp {LLAMA_PEER[fmt]} {gguf_bytes_per_token(gguf, src) / n:.3f}"
    return text


# ---- --check: the same model on both engines ------------------------------------------------------------
def llama_score_main(gguf: str, ids_file: str) -> None:
    """Run in the peer's venv: per position, llama.cpp's argmax and log-probability of the next token."""
    import numpy as np
    from bench_quality import llama_logits

    ids = json.loads(Path(ids_file).read_text())
    logits = next(llama_logits(gguf, [ids])).astype(np.float64)
    logprobs = logits - logits.max(-1, keepdims=True)
    logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
    nxt = np.array(ids[1:])
    out = dict(argmax=logprobs[:-1].argmax(-1).tolist(), logprob=logprobs[np.arange(len(nxt)), nxt].tolist())
    print("RESULT " + json.dumps(out), flush=True)


def deltaserve_greedy(path: Path, fmt: str, threads: int) -> tuple[list[int], list[float]]:
    """CHECK_NEW greedy tokens after the check prompt, on the fused executor, with their log-probabilities."""
    import gc

    from deltaserve.engine.llm import LLM
    from deltaserve.sampling import SamplingParams

    llm = LLM(model=str(path), num_threads=threads, max_num_seqs=1, max_model_len=256,
              **({} if fmt == "bf16" else {"quantization": fmt}))
    params = SamplingParams(temperature=0.0, max_tokens=CHECK_NEW, ignore_eos=True, logprobs=0)
    out = llm.generate({"prompt_token_ids": tokens(CHECK_PROMPT, 5)}, params, use_tqdm=False)[0].outputs[0]
    executor = llm.engine.executor.name
    del llm
    gc.collect()
    assert executor != "torch", "the check is of the fused step, the one the benchmark times"
    return list(out.token_ids), [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)]


def check(args: argparse.Namespace, paths: dict[str, Path], src: Path) -> list[str]:
    lines = ["| checkpoint | deltaserve | llama.cpp | llama.cpp's argmax = deltaserve's token | max abs logprob diff |",
             "|---|---|---|---|---|"]
    for model, path in paths.items():
        ggufs = gguf_files(path, src, args.peer_python, [LLAMA_PEER[f] for f in args.formats], stem=path.name,
                           workdir=WORKDIR)
        for fmt in args.formats:
            new, logprobs = deltaserve_greedy(path, fmt, args.threads[-1])
            ids = tokens(CHECK_PROMPT, 5) + new
            with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
                json.dump(ids, f)
                f.flush()
                proc = subprocess.run([args.peer_python, __file__, "--llama-score", str(ggufs[LLAMA_PEER[fmt]]),
                                       f.name], capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"llama.cpp scoring failed: {proc.stderr.strip().splitlines()[-3:]}")
            theirs = json.loads(line[len("RESULT "):])
            first = CHECK_PROMPT - 1  # the position whose next token is deltaserve's first
            agree = sum(theirs["argmax"][first + i] == t for i, t in enumerate(new))
            diff = max(abs(theirs["logprob"][first + i] - lp) for i, lp in enumerate(logprobs))
            lines.append(f"| {model} | {fmt} | {LLAMA_PEER[fmt]} | {agree} / {len(new)} | {diff:.3f} |")
            print(lines[-1], flush=True)
    return lines


# ---- the benchmark -------------------------------------------------------------------------------------
def plan(args: argparse.Namespace, paths: dict[str, Path],
         ggufs: dict[str, dict[str, Path]]) -> list[tuple[str, Job, str]]:
    """(checkpoint, job, python) in run order: per thread count and format, each checkpoint's deltaserve
    then its peers, so the MoE / dense and deltaserve / llama.cpp pairs run next to each other."""
    jobs = []
    for threads in args.threads:
        for fmt in args.formats:
            for model, path in paths.items():
                def job(engine: str, weights: str, p: Path = path, t: int = threads) -> Job:
                    return Job(engine, weights, t, str(p), args.decode, args.prompt, args.requests)

                jobs.append((model, job("deltaserve", fmt), sys.executable))
                if fmt == "bf16" and args.transformers:
                    jobs.append((model, job("transformers", "bf16"), sys.executable))
                if LLAMA_PEER[fmt] in ggufs.get(model, {}):
                    jobs.append((model, job("llama.cpp", LLAMA_PEER[fmt], ggufs[model][LLAMA_PEER[fmt]]),
                                 args.peer_python))
    return jobs


def moe_vs_dense(results: dict[str, list[Result]]) -> list[str]:
    """Each engine and weights: dense decode tok/s over MoE decode tok/s (target for deltaserve: <= 1.3)."""
    dense = {(r.job.engine, r.job.weights, r.job.threads): r for r in results.get("dense", []) if not r.note}
    out = []
    for r in results["MoE"]:
        d = dense.get((r.job.engine, r.job.weights, r.job.threads))
        if d is None or r.note:
            continue
        out.append(f"- {r.job.engine} {r.job.weights}, {r.job.threads} thread(s): dense decode is "
                   f"{d.decode_tok_s / r.decode_tok_s:.2f}x the MoE's, dense prefill "
                   f"{d.prefill_tok_s / r.prefill_tok_s:.2f}x")
    return out


def report(args: argparse.Namespace, paths: dict[str, Path], ggufs: dict[str, dict[str, Path]], src: Path | None,
           results: dict[str, list[Result]], bandwidth: dict[int, float], load_before: tuple[float, ...]) -> str:
    """The docs section: how it ran, per checkpoint its bytes per weight, table and ratios to llama.cpp, then
    MoE against dense."""
    from report import machine

    load = ", ".join(f"{x:.1f}" for x in load_before)
    text = [SECTION, "", f"`benchmarks/bench_moe.py --layers {args.layers} --threads "
            f"{','.join(map(str, args.threads))}{'' if args.transformers else ' --no-transformers'}`, "
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC: {machine()} at the end, {load} at the start.",
            f"Decode at batch 1 ({args.decode} new tokens after 32), prefill of {args.prompt} tokens, "
            f"{args.requests} requests batched (64 + 64 tokens each), each engine in its own process, interleaved. "
            "Read bandwidth: " + ", ".join(f"{t} thread(s) {b / 1e9:.1f} GB/s" for t, b in bandwidth.items()) + "."]
    for model, path in paths.items():
        text += ["", f"### {model}: `{path.name}`", "", "Bytes per weight, the whole checkpoint: " + "; ".join(
            bytes_per_weight(path, f, ggufs.get(model, {}).get(LLAMA_PEER[f]), src) for f in args.formats) + ".",
            "", table(results[model], bandwidth), "", *ratios(results[model])]
    if "dense" in results:
        text += ["", "### MoE against dense (same active parameters)", "", *moe_vs_dense(results)]
    return "\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    ap.add_argument("--formats", type=lambda s: s.split(","), default=list(FORMATS))
    add_run_arguments(ap, requests=4)
    ap.add_argument("--no-dense", dest="dense", action="store_false")
    ap.add_argument("--check", action="store_true", help="only check that both engines run the same model")
    ap.add_argument("--write", action="store_true", help="write the tables to docs/benchmarks.md")
    ap.add_argument("--llama-score", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_score:  # in the peer's venv: nothing of deltaserve's
        return llama_score_main(*args.llama_score)
    unknown = [f for f in args.formats if f not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown format(s) {', '.join(unknown)}; choose from {', '.join(FORMATS)} (the formats "
                         "llama.cpp has a peer for)")
    if args.check and not args.llama_cpp:
        raise SystemExit("--check compares with llama.cpp: it cannot run with --no-llama-cpp")
    sys.path.insert(0, str(ROOT))
    from report import write_section

    paths = checkpoints(args.layers, args.dense)
    src = llama_src(args.llama_cpp_src) if args.llama_cpp else None
    if args.check:
        check(args, paths, src)
        return
    ggufs = {model: gguf_files(path, src, args.peer_python, [LLAMA_PEER[f] for f in args.formats], stem=path.name,
                               workdir=WORKDIR) for model, path in paths.items()} if src else {}
    bandwidth = {t: read_bandwidth(t) for t in args.threads}
    load_before = os.getloadavg()
    print("read bandwidth: " + ", ".join(f"{t} thread(s) {b / 1e9:.1f} GB/s" for t, b in bandwidth.items()) +
          f"; load average {load_before[0]:.1f}", flush=True)
    results: dict[str, list[Result]] = {model: [] for model in paths}
    for model, job, python in plan(args, paths, ggufs):
        print(f"{model}:", end="", flush=True)
        res = run_job(job, python)
        path = paths[model]
        if job.engine == "llama.cpp":
            res.bytes_per_token = gguf_bytes_per_token(Path(job.path), src, share(model))
        else:
            res.bytes_per_token = deltaserve_bytes_per_token(path, "bf16" if job.engine == "transformers" else
                                                             job.weights, share(model))
        results[model].append(res)
        if not res.note:
            print(f"    steady {res.steady_rss / 2**30:.2f} GiB, {res.bytes_per_token / 1e9:.3f} GB per decode token, "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)

    text = report(args, paths, ggufs, src, results, bandwidth, load_before)
    print("\n" + text)
    if args.write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
