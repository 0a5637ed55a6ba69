"""`deltaserve eval ppl`: a model's perplexity on a text file, by default the demo checkpoint's held-out
sample (deltaserve/assets/demo/heldout.jsonl, built by scripts/build_demo_heldout.py), so each weight format's
quality can be compared with the checkpoint's own."""

from __future__ import annotations

import argparse
import inspect
import json
from typing import Any

from deltaserve.assets import DEMO_DIR

DEMO_HELDOUT = DEMO_DIR / "heldout.jsonl"


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="measure a model's quality (perplexity)")
    evals = p.add_subparsers(dest="eval_command", required=True)
    ppl = evals.add_parser(
        "ppl", help="perplexity on a text file (default: the demo's held-out documents)",
        description="Each document is tokenized alone and cut into non-overlapping windows; every token "
                    "but a window's first is scored by the torch reference forward (the one prompt "
                    "logprobs use). Prints the perplexity overall and per source.",
    )
    ppl.add_argument("--model", default=None, help="checkpoint directory (default: the embedded demo model)")
    ppl.add_argument("--quantization", default=None,
                     help="weight format to load the checkpoint in (default: the checkpoint's own)")
    ppl.add_argument("--activation-quantization", default=None,
                     help="int8 / none: whether int8 / int4 weights quantize their inputs too (default: int8 "
                     "for those, deltaserve serve's default)")
    ppl.add_argument("--dtype", default="auto", help="activation dtype: auto (float32 on CPU), float32, "
                     "bfloat16, float16")
    ppl.add_argument("--threads", type=int, default=None, dest="num_threads",
                     help="compute threads (default: $OMP_NUM_THREADS, else one per physical core)")
    ppl.add_argument("--text", default=str(DEMO_HELDOUT),
                     help='.jsonl of {"text", "source"} objects, or a plain text file (one document)')
    ppl.add_argument("--window", type=int, default=1024, help="most tokens scored in one forward (default 1024)")
    ppl.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ppl.set_defaults(func=run_ppl)


def engine_for_scoring(args: argparse.Namespace) -> Any:
    """An LLM on the torch reference path (no fused-step build: scoring never runs it), one sequence."""
    from deltaserve.engine.llm import LLM

    kwargs: dict[str, Any] = dict(model=args.model, dtype=args.dtype, num_threads=args.num_threads,
                                  max_num_seqs=1, enforce_eager=True)
    if args.quantization is not None:
        if "quantization" not in inspect.signature(LLM).parameters:
            raise ValueError(f"--quantization {args.quantization}: this deltaserve has no compact weight "
                             "formats; drop --quantization to score the checkpoint's own")
        kwargs["quantization"] = args.quantization
    if args.activation_quantization is not None:
        if "activation_quantization" not in inspect.signature(LLM).parameters:
            raise ValueError(f"--activation-quantization {args.activation_quantization}: this deltaserve has no "
                             "activation quantization; drop the flag")
        kwargs["activation_quantization"] = args.activation_quantization
    return LLM(**kwargs)


def run_ppl(args: argparse.Namespace) -> int:
    from deltaserve.perplexity import load_documents, perplexity

    if args.window < 2:
        raise ValueError(f"--window must hold at least 2 tokens, got {args.window}")
    docs = load_documents(args.text)  # bad input fails before the model loads
    llm = engine_for_scoring(args)
    if args.window > llm.engine.max_model_len:
        raise ValueError(f"--window {args.window} is longer than the model's {llm.engine.max_model_len} tokens")
    result = perplexity(llm.engine.model, llm.get_tokenizer(), docs, args.window)
    if args.json:
        print(json.dumps(result.as_dict()))
        return 0
    print(f"{'source':<16} {'docs':>5} {'tokens':>7} {'nll/token':>10} {'perplexity':>11}")
    for s in [*result.sources, result.total]:
        print(f"{s.source:<16} {s.documents:>5} {s.tokens:>7} {s.nll / s.tokens:>10.4f} {s.perplexity:>11.4f}")
    return 0
