"""Sparse-MoE decode: deltaserve (torch executor, the reference MoE block) vs transformers, batch 1, one
thread (not a test; timing decides nothing).

    .venv/bin/python benchmarks/bench_moe.py [--layers 8] [--tokens 48] [--rounds 2] [--keep DIR]

The checkpoint is random, with the Qwen3.5-35B-A3B's ratios scaled down (hidden 1024 instead of 2048,
128 experts instead of 256, top-8, expert and shared-expert width hidden/4, 8 / 2 attention heads, GDN
8 key and 16 value heads): with 8 layers about 0.9 B parameters (1.8 GB in bf16), of which about 0.1 B are
active per token. Both sides load it in fp32 and run one after the other (so only one copy is resident).
Prints decode tokens/s of each and their ratio."""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
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


def best_rate(run, tokens: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        gc.collect()
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return tokens / best


def ours(path: Path, tokens: int, rounds: int) -> tuple[float, str]:
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, max_num_seqs=1, kv_cache_memory=1 << 28)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def generate(p: SamplingParams) -> None:
        llm.generate({"prompt_token_ids": PROMPT}, p, use_tqdm=False)

    generate(prefill)  # warm-up
    # decode time = generating `tokens` minus the prefill (and first token) alone
    with_decode = 1 / best_rate(lambda: generate(params), 1, rounds)
    alone = 1 / best_rate(lambda: generate(prefill), 1, rounds)
    return (tokens - 1) / (with_decode - alone), llm.engine.executor.name


def theirs(path: Path, tokens: int, rounds: int) -> tuple[float, str]:
    from transformers import Qwen3_5MoeForCausalLM

    model = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([PROMPT])

    def generate(n: int) -> None:
        with torch.inference_mode():
            model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)

    generate(1)
    with_decode = 1 / best_rate(lambda: generate(tokens), 1, rounds)
    alone = 1 / best_rate(lambda: generate(1), 1, rounds)
    return (tokens - 1) / (with_decode - alone), str(model.config._experts_implementation)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keep", type=Path, default=None, help="build the checkpoint here (reused if present)")
    args = ap.parse_args()
    torch.set_num_threads(1)
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
        rate, name = ours(path, args.tokens, args.rounds)
        gc.collect()
        print(f"deltaserve ({name} executor): {rate:.2f} decode tok/s")
        hf_rate, impl = theirs(path, args.tokens, args.rounds)
        print(f"transformers (experts {impl}): {hf_rate:.2f} decode tok/s")
        print(f"ratio: {rate / hf_rate:.2f}x at batch 1, 1 thread")


if __name__ == "__main__":
    main()
