"""Sparse-MoE decode: deltaserve (the fused C++ step, and the torch executor's reference MoE block) vs
transformers, batch 1, one thread unless --threads (not a test; timing decides nothing).

    .venv/bin/python benchmarks/bench_moe.py [--layers 8] [--tokens 48] [--rounds 3] [--threads 1] [--dense]
        [--keep DIR]

The checkpoint is random, with the Qwen3.5-35B-A3B's ratios scaled down (hidden 1024 instead of 2048,
128 experts instead of 256, top-8, expert and shared-expert width hidden/4, 8 / 2 attention heads, GDN
8 key and 16 value heads): with 8 layers about 0.9 B parameters (1.8 GB in bf16), of which about 0.1 B are
active per token. Every side loads it in fp32 and all stay resident (about 4 GB each; the fused step reads
the weights as loaded) while their rounds alternate: --layers 4 halves that. Prints each side's decode tokens/s
and the fused MoE's ratio to it; --dense adds a dense checkpoint of the same active parameters (MLP width
top_k * expert width + shared width) on both of deltaserve's executors."""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from deltaserve import LLM, SamplingParams  # noqa: E402

HIDDEN = 1024
SHAPE = dict(
    vocab_size=32000, hidden_size=HIDDEN, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
    head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4, partial_rotary_factor=0.25, max_position_embeddings=4096,
)
EXPERTS = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=HIDDEN // 4,
               shared_expert_intermediate_size=HIDDEN // 4)
PROMPT = [(7 * i + 11) % 1000 + 2 for i in range(16)]


def build(path: Path, layers: int) -> Path:
    from tests.checkpoints import random_hf_moe_model, save_causal_lm_layout

    torch.manual_seed(0)
    hf = random_hf_moe_model("qwen3_5_moe", {**SHAPE, "num_hidden_layers": layers}, **EXPERTS)
    # bf16 on disk like the releases; transformers' own save (one tensor per expert, as the FP8 releases).
    save_causal_lm_layout(hf.to(torch.bfloat16), path)
    return path


def build_dense(path: Path, layers: int) -> Path:
    """Same shape, one dense MLP as wide as what a token reads of the MoE block (router aside)."""
    from tests.checkpoints import random_hf_model, save_causal_lm_layout

    e = EXPERTS
    width = e["num_experts_per_tok"] * e["moe_intermediate_size"] + e["shared_expert_intermediate_size"]
    hf = random_hf_model({**SHAPE, "num_hidden_layers": layers, "intermediate_size": width}, seed=0)
    save_causal_lm_layout(hf.to(torch.bfloat16), path)
    return path


@dataclass(slots=True)
class Side:
    """One engine on one checkpoint: generate(n) makes n tokens after PROMPT; best = fastest seconds seen."""

    name: str
    generate: Callable[[int], None]
    best: dict[int, float] = field(default_factory=dict)

    def run(self, n: int) -> None:
        gc.collect()
        t = time.perf_counter()
        self.generate(n)
        self.best[n] = min(self.best.get(n, float("inf")), time.perf_counter() - t)

    def decode_rate(self, n: int) -> float:
        """Tokens/s of the n - 1 decode steps: n tokens minus the prefill and first token alone."""
        return (n - 1) / (self.best[n] - self.best[1])


def ours(path: Path, label: str, eager: bool = False) -> Side:
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, max_num_seqs=1, kv_cache_memory=1 << 28,
              enforce_eager=eager)

    def generate(n: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)

    return Side(f"deltaserve, {label} ({llm.engine.executor.name} executor)", generate)


def theirs(path: Path) -> Side:
    from transformers import Qwen3_5MoeForCausalLM

    model = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([PROMPT])

    def generate(n: int) -> None:
        with torch.inference_mode():
            model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)

    return Side(f"transformers, MoE (experts {model.config._experts_implementation})", generate)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep", type=Path, default=None, help="build the checkpoint here (reused if present)")
    ap.add_argument("--dense", action="store_true", help="also a dense checkpoint of the same active parameters")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "moe"
        if not (path / "config.json").exists():
            path.mkdir(parents=True, exist_ok=True)
            t = time.perf_counter()
            build(path, args.layers)
            print(f"built {path} in {time.perf_counter() - t:.0f} s")
        from deltaserve.config import ModelConfig
        from deltaserve.engine.planner import plan_memory

        plan = plan_memory(ModelConfig.from_file(path), 512, 1, dtype="float32")
        print(f"{plan.text_params / 1e9:.3f} B parameters, {plan.active_params / 1e9:.3f} B active per token; "
              f"fp32 reads {plan.active_weight_bytes / 2**20:.0f} of {plan.weight_bytes / 2**20:.0f} MiB per token")
        sides = [ours(path, "MoE"), ours(path, "MoE", eager=True), theirs(path)]
        if args.dense:
            dense = build_dense(Path(tmp) / "dense", args.layers)
            sides += [ours(dense, "dense, same active parameters", eager=True), ours(dense, "dense, same active "
                                                                                       "parameters")]
        for side in sides:  # warm-up
            side.generate(1)
        # Rounds in turn (each side's decode run, then its prefill-only run), so a burst of load on this
        # shared machine hits all sides alike and the best of the rounds drops it.
        for _ in range(args.rounds):
            for side in sides:
                side.run(args.tokens)
                side.run(1)
        moe = sides[0].decode_rate(args.tokens)
        for side in sides:
            rate = side.decode_rate(args.tokens)
            print(f"{side.name}: {rate:.2f} decode tok/s (deltaserve MoE: {moe / rate:.2f}x of it)")
        print(f"batch 1, {args.threads} thread(s), {args.tokens} tokens after a {len(PROMPT)}-token prompt, "
              f"best of {args.rounds}")


if __name__ == "__main__":
    main()
