"""Quality of each weight format (not a test): perplexity on the demo's held-out text for every deltaserve
format and for llama.cpp's BF16 / Q8_0 / Q4_K_M of the same checkpoint, on the same token windows.

    .venv/bin/python benchmarks/bench_quality.py [--model DIR] [--text FILE] [--formats bf16,fp8,int8,int4]
        [--window 1024] [--no-llama-cpp] [--peer-python PY] [--llama-cpp-src DIR]

deltaserve's numbers come from `deltaserve eval ppl`'s code (deltaserve/perplexity.py); llama.cpp scores the
same windows (the checkpoint's tokenizer, each document alone, non-overlapping windows) through its C API in
the peer's venv, with every position's logits. Both columns are against the same engine's bf16, so a
format's loss shows apart from the engines' own small differences. GGUF files are kept under
~/.cache/deltaserve/bench_formats/ (see bench_formats.py for the peer build)."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_formats import DEMO_TOKENIZER_DIR as DEMO_DIR  # noqa: E402
from bench_formats import FORMATS, PEERS, gguf_files, llama_src  # noqa: E402


def llama_logits(gguf: str, pieces: list[list[int]]) -> Iterator:
    """Run in the peer's venv: each piece's logits at every position, a numpy [len, vocab] float32 view of
    llama.cpp's own buffer (valid until the next piece: no copy of a window's 248k-wide rows), every piece
    alone from an empty context, through llama.cpp's C API."""
    import ctypes

    import llama_cpp as C
    import numpy as np

    C.llama_backend_init()
    model = C.llama_model_load_from_file(gguf.encode(), C.llama_model_default_params())
    n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
    cparams = C.llama_context_default_params()
    longest = max(len(p) for p in pieces)
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = longest
    ctx = C.llama_init_from_model(model, cparams)
    batch = C.llama_batch_init(longest, 0, 1)
    for ids in pieces:
        C.llama_memory_clear(C.llama_get_memory(ctx), True)
        batch.n_tokens = len(ids)
        for i, tok in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, 1
            batch.seq_id[i][0] = 0
        if C.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = ctypes.cast(C.llama_get_logits(ctx), ctypes.POINTER(ctypes.c_float * (n_vocab * len(ids)))).contents
        yield np.frombuffer(rows, dtype=np.float32).reshape(len(ids), n_vocab)


def llama_worker(gguf: str, windows_file: str) -> None:
    """Run in the peer's venv: summed NLL of every window's tokens after its first, one JSON line."""
    import numpy as np

    pieces = json.loads(Path(windows_file).read_text())
    nll = 0.0
    for ids, logits in zip(pieces, llama_logits(gguf, pieces), strict=True):
        for i in range(len(ids) - 1):
            row = logits[i].astype(np.float64)
            top = row.max()
            nll += top + math.log(np.exp(row - top).sum()) - row[ids[i + 1]]
    print("RESULT " + json.dumps(dict(nll=nll, tokens=sum(len(p) - 1 for p in pieces))), flush=True)


def deltaserve_ppl(args: argparse.Namespace, fmt: str, docs: list) -> tuple[float, int] | str:
    """(summed NLL, tokens), or why the format did not run."""
    from deltaserve.cli_eval import engine_for_scoring
    from deltaserve.perplexity import perplexity

    ns = argparse.Namespace(model=args.model, dtype="auto", num_threads=args.threads,
                            quantization=None if fmt == "bf16" else fmt)
    try:
        llm = engine_for_scoring(ns)
    except (ValueError, NotImplementedError) as e:
        return f"skipped: {e}"
    total = perplexity(llm.engine.model, llm.get_tokenizer(), docs, args.window).total
    return total.nll, total.tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEMO_DIR), help="checkpoint directory (default: the demo)")
    ap.add_argument("--text", default=str(DEMO_DIR / "heldout.jsonl"))
    ap.add_argument("--formats", type=lambda s: s.split(","), default=list(FORMATS))
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    ap.add_argument("--peer-python", default=str(PEERS / "venv" / "bin" / "python"))
    ap.add_argument("--llama-cpp-src", default=None)
    ap.add_argument("--llama-worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_worker:  # before any deltaserve import: the peer's venv has none
        return llama_worker(*args.llama_worker)
    from deltaserve.perplexity import load_documents, windows
    from deltaserve.tokenizer import Tokenizer

    docs = load_documents(args.text)
    rows: list[tuple[str, str, tuple[float, int] | str]] = []
    for fmt in args.formats:
        rows.append(("deltaserve", fmt, deltaserve_ppl(args, fmt, docs)))
    if args.llama_cpp:
        tok = Tokenizer.from_dir(args.model)
        pieces = [p for d in docs for p in windows(tok.encode(d.text), args.window)]
        kinds = ["BF16", "Q8_0", "Q4_K_M"]
        files = gguf_files(Path(args.model), llama_src(args.llama_cpp_src), args.peer_python, kinds,
                           stem=Path(args.model).name)
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(pieces, f)
            f.flush()
            for kind in kinds:
                proc = subprocess.run([args.peer_python, __file__, "--llama-worker", str(files[kind]), f.name],
                                      capture_output=True, text=True)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    rows.append(("llama.cpp", kind, f"failed: {proc.stderr.strip().splitlines()[-1:]}"))
                    continue
                out = json.loads(line[len("RESULT "):])
                rows.append(("llama.cpp", kind, (out["nll"], out["tokens"])))

    base = {engine: r for engine, w, r in rows if w in ("bf16", "BF16") and not isinstance(r, str)}
    print(f"Perplexity on {args.text} ({len(docs)} documents, windows of {args.window})\n")
    print("| engine | weights | tokens | perplexity | vs the engine's bf16 |\n|---|---|---|---|---|")
    for engine, weights, r in rows:
        if isinstance(r, str):
            print(f"| {engine} | {weights} | {r} | | |")
            continue
        ppl = math.exp(r[0] / r[1])
        ref = base.get(engine)
        rel = f"{ppl / math.exp(ref[0] / ref[1]) - 1:+.3%}" if ref else ""
        print(f"| {engine} | {weights} | {r[1]} | {ppl:.5f} | {rel} |")


if __name__ == "__main__":
    main()
