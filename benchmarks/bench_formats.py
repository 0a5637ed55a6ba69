"""Weight formats at the Qwen3.5-0.8B shape: deltaserve beside transformers and llama.cpp, one machine, one run
(not a test; timing decides nothing).

    .venv/bin/python benchmarks/bench_formats.py [--formats bf16,fp8,int8,int4] [--threads 1,2]
        [--decode 128] [--prompt 512] [--requests 16] [--no-transformers] [--no-llama-cpp] [--write]

The checkpoint is random at the released Qwen3.5-0.8B config (REFERENCE.md "Released shapes"): hidden 1024,
24 layers [lin, lin, lin, full] x 6, MLP 3584, attention 8 query / 2 KV heads of 256 (output gate, partial
rotary 0.25, rope_theta 1e7), GDN 16 key / 16 value heads of 128 with conv kernel 4, vocab 248320, tied
embeddings, no MTP layer, bf16 on disk (about 1.5 GB). It is written once under
~/.cache/deltaserve/bench_formats/ (bench_tp.py's writer and field list) and converted there to GGUF with
llama.cpp's own convert_hf_to_gguf.py (bf16), then quantized by llama.cpp to Q8_0 and Q4_K_M.

Workloads, greedy, end of text ignored: decode at batch 1 (a 32-token prompt, then --decode new tokens; tok/s
over the tokens after the first), prefill (a --prompt-token prompt, tok/s to its first token, the best of two
prompts), batched (--requests requests of 64 prompt and 64 new tokens at once; generated tok/s over the whole
run). Every
engine and thread count runs in a process of its own, interleaved (deltaserve, then its peers at the same
bytes per weight, then the next format), so load changes on the shared machine hit them alike; the peak
(VmHWM) and steady (VmRSS after the workloads, the model still loaded) resident memory are that process's
alone (llama.cpp's weights are a mapped file: they count once touched). Both engines hold the same cache:
KV for kv_cells tokens (llama.cpp's n_ctx) and the GDN state of --requests sequences.

Decode bandwidth = bytes read per decode token x decode tok/s, against the machine's read bandwidth (a
large torch sum, measured here at each thread count). Bytes per token: every weight a decode step reads
(the tied embedding once, as the lm_head; not the embedding lookup) at the format's bytes per weight,
scales included (BYTES_PER_WEIGHT); for llama.cpp, the GGUF's own tensor sizes.

Peers live outside the repository (never in CI): transformers from the project's .venv; llama.cpp from the
llama-cpp-python source package, built into its own venv (see --peer-python, --llama-cpp-src):

    python3 -m venv ~/.cache/deltaserve/peers/venv
    ~/.cache/deltaserve/peers/venv/bin/pip download --no-binary :all: --no-deps llama-cpp-python \\
        -d ~/.cache/deltaserve/peers/sdist        # then untar it there (the converter and gguf-py)
    CMAKE_ARGS=-DGGML_NATIVE=ON ~/.cache/deltaserve/peers/venv/bin/pip install \\
        ~/.cache/deltaserve/peers/sdist/llama_cpp_python-*.tar.gz
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Only the standard library at the top: the llama.cpp worker runs this file in the peer's venv (no torch).
ROOT = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "deltaserve"
PEERS = CACHE / "peers"
WORKDIR = CACHE / "bench_formats"
SECTION = "## Weight formats at the 0.8B shape"
DEMO_TOKENIZER_DIR = ROOT / "deltaserve" / "assets" / "demo"

FORMATS = ("bf16", "bf16-act", "fp8", "int8", "int4")
# bf16-act: the bf16 checkpoint with activation_quantization "bf16" (every projection reads its rows rounded to
# bf16, as llama.cpp's BF16 path does; deltaserve/ops/activation_quant.py). The others keep the default.
ACTIVATION_QUANTIZATION = {"bf16-act": "bf16"}
# Bytes per weight of each deltaserve format, scales included (deltaserve/ops/formats.py): fp8 E4M3 with one
# fp32 scale per row and 128 columns (a 128x128 block's scale, kept with each of its rows);
# int8 / int4 group-wise with one bf16 scale per group of 32 (the default group size).
BYTES_PER_WEIGHT = {"bf16": 2.0, "bf16-act": 2.0, "fp8": 1 + 4 / 128, "int8": 1 + 2 / 32, "int4": 0.5 + 2 / 32}
# The llama.cpp file at the same bytes per weight as each deltaserve format (fp8 has none).
LLAMA_PEER = {"bf16": "BF16", "bf16-act": "BF16", "int8": "Q8_0", "int4": "Q4_K_M"}
LLAMA_FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
# Kept at their stored dtype by every format (as Qwen's FP8 release does); they are small. The MoE router
# (mlp.gate) and shared-expert gate too (deltaserve/model/linear.py KEEP_UNQUANTIZED).
UNQUANTIZED = ("norm", "conv1d", "A_log", "dt_bias", "in_proj_a", "in_proj_b", "mlp.gate.weight",
               "shared_expert_gate")

DECODE_PROMPT = 32
BATCH_PROMPT = BATCH_NEW = 64
PREFILL_SALTS = (1, 3)  # prefill is one call: the best of two different prompts of the same length


@dataclass(slots=True)
class Job:
    """One engine process: which engine, its weights, and the workload sizes."""

    engine: str  # deltaserve | transformers | llama.cpp
    weights: str  # deltaserve format, transformers dtype (fp32 / bf16), or llama.cpp type (BF16, Q8_0, Q4_K_M)
    threads: int
    path: str  # checkpoint directory, or the .gguf file
    decode: int
    prompt: int
    requests: int


@dataclass(slots=True)
class Result:
    job: Job
    decode_tok_s: float = float("nan")
    prefill_tok_s: float = float("nan")
    batch_tok_s: float = float("nan")
    peak_rss: int = 0  # bytes
    steady_rss: int = 0
    bytes_per_token: float = float("nan")
    note: str = ""
    extra: dict = field(default_factory=dict)


def tokens(n: int, salt: int = 0) -> list[int]:
    """Deterministic token ids away from the special tokens at the end of the 248k vocabulary."""
    return [(7 * i + 101 * salt + 3) % 240000 + 100 for i in range(n)]


def context_tokens(job: Job) -> int:
    """The longest sequence any workload makes."""
    return max(job.prompt + 1, DECODE_PROMPT + job.decode + 1, BATCH_PROMPT + BATCH_NEW)


def kv_cells(job: Job) -> int:
    """Tokens of KV cache both engines get: llama.cpp's context (one unified pool of n_ctx cells for all its
    sequences) and deltaserve's KV blocks (that many tokens, plus a block per sequence for partly filled
    ones), so that neither holds more cache than the other needs."""
    return max(context_tokens(job), max(job.requests, 1) * (BATCH_PROMPT + BATCH_NEW))


def rss_bytes() -> tuple[int, int]:
    """(VmHWM, VmRSS) of this process."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) * 1024
    return fields.get("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), fields["VmRSS"]


# ---- workers: each runs in its own process and prints one JSON object --------------------------------
def run_deltaserve(job: Job) -> dict:
    import torch

    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.llm import LLM
    from deltaserve.sampling import SamplingParams

    torch.set_num_threads(job.threads)
    # The KV blocks hold kv_cells tokens, as llama.cpp's context does (by default the planner would give each
    # of the max_num_seqs sequences room for max_model_len: 5x its cells, in fp32 against f16); the GDN
    # states take max_num_seqs slots, as llama.cpp's recurrent state does. Prefix caching is off: no prompt
    # shares a prefix.
    n_seq = max(job.requests, 1)
    kwargs = dict(model=job.path, num_threads=job.threads, max_num_seqs=n_seq, max_model_len=context_tokens(job),
                  max_num_batched_tokens=max(job.prompt, job.requests * BATCH_PROMPT),
                  num_kv_blocks=-(-kv_cells(job) // EngineConfig().block_size) + n_seq, enable_prefix_caching=False)
    if job.weights not in ("bf16", "bf16-act"):  # the checkpoint's own format needs no parameter
        kwargs["quantization"] = job.weights
    if job.weights in ACTIVATION_QUANTIZATION:
        kwargs["activation_quantization"] = ACTIVATION_QUANTIZATION[job.weights]
    engine = LLM(**kwargs).engine

    def run(prompts: list[list[int]], new: int) -> tuple[float, float]:
        """(seconds of the first step, seconds of the rest) for these prompts run together."""
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{time.monotonic_ns()}-{i}", ids, params)
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return t1 - t0, time.perf_counter() - t1

    run([tokens(16)], 4)  # warm-up: first-call costs (thread pools, allocations) stay out of the numbers
    out = dict(prefill_tok_s=max(job.prompt / sum(run([tokens(job.prompt, salt)], 1)) for salt in PREFILL_SALTS))
    _, rest = run([tokens(DECODE_PROMPT, 2)], job.decode + 1)
    out["decode_tok_s"] = job.decode / rest
    first, rest = run([tokens(BATCH_PROMPT, 10 + r) for r in range(job.requests)], BATCH_NEW)
    out["batch_tok_s"] = job.requests * BATCH_NEW / (first + rest)
    out["executor"] = engine.executor.name
    out["peak_rss"], out["steady_rss"] = rss_bytes()  # while the engine is alive
    return out


def run_transformers(job: Job) -> dict:
    import torch
    from transformers import AutoConfig, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    torch.set_num_threads(job.threads)
    cfg = AutoConfig.from_pretrained(job.path)
    text = getattr(cfg, "text_config", cfg)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[job.weights]
    cls = Qwen3_5MoeForCausalLM if text.model_type == "qwen3_5_moe_text" else Qwen3_5ForCausalLM
    model = cls.from_pretrained(job.path, config=text, dtype=dtype).eval()

    def generate(ids: list[list[int]], new: int) -> float:
        x = torch.tensor(ids)
        t0 = time.perf_counter()
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    with torch.inference_mode():
        generate([tokens(16)], 4)  # warm-up
        best = 0.0
        for salt in PREFILL_SALTS:
            t0 = time.perf_counter()
            model(torch.tensor([tokens(job.prompt, salt)]), logits_to_keep=1)
            best = max(best, job.prompt / (time.perf_counter() - t0))
        out = dict(prefill_tok_s=best)
        first = generate([tokens(DECODE_PROMPT, 2)], 1)
        out["decode_tok_s"] = (job.decode - 1) / (generate([tokens(DECODE_PROMPT, 2)], job.decode) - first)
        batch = [tokens(BATCH_PROMPT, 10 + r) for r in range(job.requests)]
        out["batch_tok_s"] = job.requests * BATCH_NEW / generate(batch, BATCH_NEW)
    out["peak_rss"], out["steady_rss"] = rss_bytes()
    return out


def run_llama_cpp(job: Job) -> dict:
    """llama.cpp through llama-cpp-python's C bindings: one context holding --requests sequences, batches
    of llama_decode, greedy argmax in numpy (a small cost beside a step over 248k logits)."""
    import ctypes

    import llama_cpp as C
    import numpy as np

    C.llama_backend_init()
    mparams = C.llama_model_default_params()
    model = C.llama_model_load_from_file(job.path.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {job.path}")
    n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
    cparams = C.llama_context_default_params()
    n_seq = max(job.requests, 1)
    cparams.n_ctx = kv_cells(job)
    cparams.n_batch = cparams.n_ubatch = max(job.prompt, n_seq * BATCH_PROMPT)
    cparams.n_seq_max = n_seq
    cparams.kv_unified = True  # one pool of n_ctx cells for all sequences, not n_ctx / n_seq each
    cparams.n_threads = cparams.n_threads_batch = job.threads
    ctx = C.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    batch = C.llama_batch_init(cparams.n_batch, 0, 1)

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits)."""
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, int(logits)
        if C.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(i: int) -> int:
        row = ctypes.cast(C.llama_get_logits_ith(ctx, i), ctypes.POINTER(ctypes.c_float * n_vocab)).contents
        return int(np.argmax(np.frombuffer(row, dtype=np.float32)))

    def run(prompts: list[list[int]], new: int) -> tuple[float, float]:
        """(seconds to the first tokens, seconds of the rest), every prompt in one batch, then one token each."""
        C.llama_memory_clear(C.llama_get_memory(ctx), True)
        t0 = time.perf_counter()
        decode([(tok, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, tok in enumerate(ids)])
        last = list(np.cumsum([len(ids) for ids in prompts]) - 1)
        nxt = [argmax(int(i)) for i in last]
        t1 = time.perf_counter()
        for step in range(new - 1):
            decode([(tok, len(ids) + step, s, True) for s, (tok, ids) in enumerate(zip(nxt, prompts, strict=True))])
            nxt = [argmax(s) for s in range(len(prompts))]
        return t1 - t0, time.perf_counter() - t1

    run([tokens(16)], 4)  # warm-up
    out = dict(prefill_tok_s=max(job.prompt / run([tokens(job.prompt, salt)], 1)[0] for salt in PREFILL_SALTS))
    _, rest = run([tokens(DECODE_PROMPT, 2)], job.decode + 1)
    out["decode_tok_s"] = job.decode / rest
    first, rest = run([tokens(BATCH_PROMPT, 10 + r) for r in range(job.requests)], BATCH_NEW)
    out["batch_tok_s"] = job.requests * BATCH_NEW / (first + rest)
    out["system_info"] = C.llama_print_system_info().decode()
    out["peak_rss"], out["steady_rss"] = rss_bytes()  # before the model is freed
    C.llama_batch_free(batch)
    C.llama_free(ctx)
    C.llama_model_free(model)
    return out


WORKERS = {"deltaserve": run_deltaserve, "transformers": run_transformers, "llama.cpp": run_llama_cpp}


def worker_main(job: Job) -> None:
    out = WORKERS[job.engine](job)  # each measures its resident memory before it lets go of the model
    print("RESULT " + json.dumps(out), flush=True)


QWEN2_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
               "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def convert_main(src: str, ckpt: str, out: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py, bf16. It names a BPE tokenizer's pre-tokenizer by hashing how the
    trained vocabulary splits a test text, so it refuses the demo's own tokenizer (BPE pre-tokenizer was not
    recognized) although that splits with Qwen2's regex exactly: for such a tokenizer, and only then, it is
    told "qwen2"."""
    import runpy

    sys.path[:0] = [src, str(Path(src) / "gguf-py")]
    import conversion.base as base

    recognise = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer) -> str:  # noqa: ANN001 - a transformers tokenizer
        try:
            return recognise(self, tokenizer)
        except NotImplementedError:
            spec = json.loads((Path(self.dir_model) / "tokenizer.json").read_text())["pre_tokenizer"]
            if spec.get("pretokenizers", [{}])[0].get("pattern", {}).get("Regex") != QWEN2_SPLIT:
                raise
            return "qwen2"

    base.TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = ["convert_hf_to_gguf.py", ckpt, "--outtype", "bf16", "--outfile", out]
    config = json.loads((Path(ckpt) / "config.json").read_text())
    if not config.get("text_config", config).get("mtp_num_hidden_layers"):
        sys.argv.append("--no-mtp")  # it takes a Qwen3.5 checkpoint without it to have an MTP head otherwise
    runpy.run_path(str(Path(src) / "convert_hf_to_gguf.py"), run_name="__main__")


def quantize_main(src: str, dst: str, kind: str) -> None:
    """Run in the peer's venv: llama.cpp's own quantizer (llama-quantize's library call)."""
    import ctypes

    import llama_cpp as C

    params = C.llama_model_quantize_default_params()
    params.ftype = getattr(C, LLAMA_FTYPES[kind])
    params.nthread = 2
    if C.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize {kind} failed")


# ---- the parent: checkpoint, GGUF files, the interleaved runs, the table ------------------------------
def checkpoint() -> Path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_tp import SHAPE, write_checkpoint

    path = WORKDIR / "qwen3.5-0.8b-random"
    assert SHAPE["hidden_size"] == 1024 and SHAPE["vocab_size"] == 248320  # the fields the docstring states
    write_checkpoint(path, SHAPE["num_hidden_layers"])
    return path


def llama_src(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    found = sorted(PEERS.glob("sdist/llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        raise SystemExit(f"no llama.cpp source under {PEERS}/sdist (see this script's docstring), or pass "
                         "--llama-cpp-src, or --no-llama-cpp")
    return found[-1]


def gguf_files(ckpt: Path, src: Path, peer_python: str, kinds: list[str],
               stem: str = "qwen3.5-0.8b-random", workdir: Path = WORKDIR) -> dict[str, Path]:
    """The checkpoint as GGUF in each wanted type, converted / quantized once and kept in workdir."""
    workdir.mkdir(parents=True, exist_ok=True)
    files = {"BF16": workdir / f"{stem}.BF16.gguf"}
    if not files["BF16"].exists():
        source = ckpt
        if not (ckpt / "tokenizer.json").exists():
            # The converter needs a tokenizer, and the random checkpoint has none: the demo's, beside links
            # to the checkpoint's files (it pads the vocabulary to the config's 248320). The ids are the same.
            source = workdir / f"{stem}-with-tokenizer"
            source.mkdir(exist_ok=True)
            for name in ("config.json", "model.safetensors"):
                if not (source / name).exists():
                    (source / name).symlink_to(ckpt / name)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(DEMO_TOKENIZER_DIR / name, source / name)
        subprocess.run([sys.executable, __file__, "--convert", str(src), str(source), str(files["BF16"])],
                       check=True)
    for kind in kinds:
        if kind == "BF16":
            continue
        files[kind] = workdir / f"{stem}.{kind}.gguf"
        if not files[kind].exists():
            subprocess.run([peer_python, __file__, "--quantize", str(files["BF16"]), str(files[kind]), kind],
                           check=True)
    return {k: v for k, v in files.items() if k in kinds}


def deltaserve_bytes_per_token(ckpt: Path, fmt: str, expert_share: float = 1.0) -> float:
    """Bytes a decode step reads at `fmt`, from the checkpoint's tensor names and shapes; of the routed
    experts' tensors only `expert_share` (top_k / num_experts: the experts one token chooses)."""
    from safetensors import safe_open

    total = 0.0
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if name.startswith("mtp."):
                continue
            n = 1
            for d in f.get_slice(name).get_shape():
                n *= d
            kept = len(f.get_slice(name).get_shape()) < 2 or any(k in name for k in UNQUANTIZED)
            share = expert_share if ".mlp.experts." in name else 1.0
            total += n * share * (2.0 if kept else BYTES_PER_WEIGHT[fmt])
    return total


def gguf_bytes_per_token(path: Path, src: Path, expert_share: float = 1.0) -> float:
    """As deltaserve_bytes_per_token, from the GGUF's own tensor sizes (routed experts: ffn_*_exps)."""
    sys.path.insert(0, str(src / "gguf-py"))
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) * (expert_share if "_exps." in t.name else 1.0)
               for t in GGUFReader(str(path)).tensors}
    if "output.weight" in tensors:  # untied: the lm_head is read, the embedding only looked up
        tensors.pop("token_embd.weight", None)
    return float(sum(tensors.values()))


def read_bandwidth(threads: int) -> float:
    """Bytes per second of a sum over 1 GiB of fp32 (far larger than any cache), best of 5."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum().item()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def run_job(job: Job, python: str) -> Result:
    env = dict(os.environ, OMP_NUM_THREADS=str(job.threads))
    print(f"  {job.engine} {job.weights}, {job.threads} thread(s) ...", flush=True)
    proc = subprocess.run([python, __file__, "--worker", json.dumps(asdict(job))], capture_output=True,
                          text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"    failed: {tail}", flush=True)
        return Result(job, note=f"failed: {tail}")
    out = json.loads(lines[-1][len("RESULT "):])
    res = Result(job, out.pop("decode_tok_s"), out.pop("prefill_tok_s"), out.pop("batch_tok_s"),
                 out.pop("peak_rss"), out.pop("steady_rss"), extra=out)
    print(f"    decode {res.decode_tok_s:.2f}, prefill {res.prefill_tok_s:.1f}, batch {res.batch_tok_s:.1f} tok/s, "
          f"peak {res.peak_rss / 2**30:.2f} GiB", flush=True)
    return res


def supports_quantization() -> bool:
    import inspect

    from deltaserve.engine.llm import LLM

    return "quantization" in inspect.signature(LLM).parameters


def plan(args: argparse.Namespace, ckpt: Path, ggufs: dict[str, Path]) -> list[tuple[Job, str]]:
    """(job, python) in run order: per thread count, each deltaserve format followed by its peers."""
    jobs = []
    for threads in args.threads:
        def job(engine: str, weights: str, path: Path, t: int = threads) -> Job:
            return Job(engine, weights, t, str(path), args.decode, args.prompt, args.requests)

        for fmt in args.formats:
            jobs.append((job("deltaserve", fmt, ckpt), sys.executable))
            if fmt == "bf16" and args.transformers:
                jobs += [(job("transformers", "fp32", ckpt), sys.executable),
                         (job("transformers", "bf16", ckpt), sys.executable)]
            peer = LLAMA_PEER.get(fmt)
            ran = any(j.engine == "llama.cpp" and j.weights == peer and j.threads == threads for j, _ in jobs)
            if peer in ggufs and not ran:  # (bf16 and bf16-act share llama.cpp's BF16 run)
                jobs.append((job("llama.cpp", peer, ggufs[peer]), args.peer_python))
    return jobs


def table(results: list[Result], bandwidth: dict[int, float]) -> str:
    gib = 2**30
    lines = ["| engine | weights | threads | decode tok/s | prefill tok/s | batched tok/s | peak / steady RSS GiB "
             "| bytes/token | decode GB/s (of read bw) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        j = r.job
        if r.note:
            lines.append(f"| {j.engine} | {j.weights} | {j.threads} | {r.note} | | | | | |")
            continue
        bw = r.bytes_per_token * r.decode_tok_s
        lines.append(
            f"| {j.engine} | {j.weights} | {j.threads} | {r.decode_tok_s:.2f} | {r.prefill_tok_s:.1f} | "
            f"{r.batch_tok_s:.1f} | {r.peak_rss / gib:.2f} / {r.steady_rss / gib:.2f} | "
            f"{r.bytes_per_token / 1e9:.3f} G | {bw / 1e9:.2f} ({bw / bandwidth[j.threads]:.0%}) |"
        )
    return "\n".join(lines)


def ratios(results: list[Result]) -> list[str]:
    """deltaserve over llama.cpp at the same bytes per weight, per thread count."""
    by = {(r.job.engine, r.job.weights, r.job.threads): r for r in results if not r.note}
    out = []
    for (engine, fmt, threads), ours in by.items():
        theirs = by.get(("llama.cpp", LLAMA_PEER.get(fmt, ""), threads))
        if engine != "deltaserve" or theirs is None:
            continue
        parts = [f"{name} {getattr(ours, a) / getattr(theirs, a):.2f}x" for name, a in (
            ("decode", "decode_tok_s"), ("prefill", "prefill_tok_s"), ("batched", "batch_tok_s"),
            ("peak memory", "peak_rss"), ("steady memory", "steady_rss"))]
        out.append(f"- deltaserve {fmt} / llama.cpp {theirs.job.weights}, {threads} thread(s): " + ", ".join(parts))
    return out


def add_run_arguments(ap: argparse.ArgumentParser, requests: int) -> None:
    """The options every engine-against-peers run takes (bench_formats, bench_moe): thread counts, workload
    sizes, which peers, and where the llama.cpp peer lives."""
    ap.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")], default=[1, 2])
    ap.add_argument("--decode", type=int, default=128, help="new tokens at batch 1")
    ap.add_argument("--prompt", type=int, default=512, help="prefill prompt tokens")
    ap.add_argument("--requests", type=int, default=requests, help="batched requests (64 + 64 tokens each)")
    ap.add_argument("--no-transformers", dest="transformers", action="store_false")
    ap.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    ap.add_argument("--peer-python", default=str(PEERS / "venv" / "bin" / "python"),
                    help="the venv python with llama-cpp-python installed")
    ap.add_argument("--llama-cpp-src", default=None,
                    help="llama.cpp source (convert_hf_to_gguf.py, gguf-py); default: the sdist under peers/")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", type=lambda s: s.split(","), default=list(FORMATS))
    add_run_arguments(ap, requests=16)
    ap.add_argument("--write", action="store_true", help="write the table to docs/benchmarks.md")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quantize", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--convert", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(Job(**json.loads(args.worker)))
    if args.quantize:
        return quantize_main(*args.quantize)
    if args.convert:
        return convert_main(*args.convert)

    unknown = [f for f in args.formats if f not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown format(s) {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from report import machine, write_section

    if not supports_quantization():
        skipped = [f for f in args.formats if f != "bf16"]
        if skipped:
            print(f"note: skipping {', '.join(skipped)}: the installed deltaserve has no `quantization` "
                  "parameter (issue 23); only bf16 runs", flush=True)
        args.formats = [f for f in args.formats if f == "bf16"]
    ckpt = checkpoint()
    ggufs: dict[str, Path] = {}
    src = None
    if args.llama_cpp:
        src = llama_src(args.llama_cpp_src)
        peers = sorted({LLAMA_PEER[f] for f in args.formats if f in LLAMA_PEER})
        ggufs = gguf_files(ckpt, src, args.peer_python, peers)
    bandwidth = {t: read_bandwidth(t) for t in args.threads}
    print("read bandwidth: " + ", ".join(f"{t} thread(s) {b / 1e9:.1f} GB/s" for t, b in bandwidth.items()))

    results = []
    for job, python in plan(args, ckpt, ggufs):
        res = run_job(job, python)
        if job.engine == "llama.cpp":
            res.bytes_per_token = gguf_bytes_per_token(Path(job.path), src)
        elif job.engine == "transformers":
            res.bytes_per_token = deltaserve_bytes_per_token(ckpt, "bf16") * (2 if job.weights == "fp32" else 1)
        else:
            res.bytes_per_token = deltaserve_bytes_per_token(ckpt, job.weights)
        results.append(res)

    llama_info = next((r.extra["system_info"] for r in results if "system_info" in r.extra), "")
    text = "\n".join([
        SECTION, "",
        f"`benchmarks/bench_formats.py`, {datetime.date.today()}: {machine()}.",
        "Random weights at the Qwen3.5-0.8B config, bf16 on disk; decode at batch 1 "
        f"({args.decode} new tokens), prefill of {args.prompt} tokens, {args.requests} requests batched. "
        "Read bandwidth: " + ", ".join(f"{t} thread(s) {b / 1e9:.1f} GB/s" for t, b in bandwidth.items()) + ".",
        *([f"llama.cpp: {llama_info.strip()}"] if llama_info else []), "",
        table(results, bandwidth), "", *ratios(results),
    ])
    print("\n" + text)
    if args.write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
