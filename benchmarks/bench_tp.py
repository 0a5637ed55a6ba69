"""Tensor parallelism on this machine (not a test): prefill and decode tok/s and each rank's resident memory
for TP = 2 (1 thread per rank), TP = 1 with 2 threads and TP = 1 with 1 thread, every rank on the fused C++
step (or with --executor torch on the torch reference executor), and the time rank 0 spends in collectives
per step.

    .venv/bin/python benchmarks/bench_tp.py [--dir /tmp/bench_tp_ckpt] [--layers 24] [--prompt 128] [--decode 32]
                                            [--executor fused|torch]

The checkpoint is random at the Qwen3.5-0.8B shape (REFERENCE.md "Released shapes": hidden 1024, 24
layers, MLP 3584, 8 / 2 attention heads of 256, 16 / 16 GDN heads of 128, vocab 248320, tied), written
once as bf16 safetensors and run in float32. Each configuration runs in its own process, so the resident
memory (VmRSS) is that configuration's alone."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = dict(
    vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, partial_rotary_factor=0.25, max_position_embeddings=4096,
)


def write_checkpoint(path: Path, layers: int, shape: dict = SHAPE, experts: dict | None = None) -> None:
    """Random bf16 tensors of every parameter, in the official layout, without building the model. With
    `experts` (num_experts, num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size) a
    Qwen3.5-MoE checkpoint: the experts fused into 3-D tensors as in the bf16 releases, and the router 8x
    larger than the rest, so routing is decisive (engines that differ by rounding pick the same experts)."""
    import torch
    from safetensors.torch import save_file

    from deltaserve.config import ModelConfig
    from deltaserve.model.decoder import Qwen3_5ForCausalLM
    from tests.checkpoints import hf_config, hf_moe_config

    if (path / "config.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    shape = dict(shape, num_hidden_layers=layers)
    if experts:
        text = hf_moe_config("qwen3_5_moe", shape, **experts, tie_word_embeddings=True).to_dict()
        text["model_type"], model_type, arch = "qwen3_5_moe_text", "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"
    else:
        text = hf_config(shape, tie=True).to_dict()
        text["model_type"], model_type, arch = "qwen3_5_text", "qwen3_5", "Qwen3_5ForConditionalGeneration"
    text["torch_dtype"] = "bfloat16"
    config = {"model_type": model_type, "architectures": [arch], "text_config": text, "tie_word_embeddings": True}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    with torch.device("meta"):
        meta = Qwen3_5ForCausalLM(ModelConfig.from_file(path))
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, p in meta.named_parameters():
        if name.endswith("A_log"):
            t = torch.empty(p.shape).uniform_(0.5, 8, generator=g).log()
        elif name.endswith("linear_attn.norm.weight"):
            t = torch.ones(p.shape)
        elif "norm" in name or name.endswith("dt_bias"):
            t = torch.zeros(p.shape)
        else:
            t = torch.randn(p.shape, generator=g) * (0.16 if name.endswith("mlp.gate.weight") else 0.02)
        tensors["model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name] = (
            t.bfloat16()
        )
    save_file(tensors, str(path / "model.safetensors"))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_one(path: Path, tp: int, threads: int, prompt: int, decode: int, executor: str) -> dict:
    """One configuration in this process: its numbers as a dict."""
    import torch

    torch.set_num_threads(threads * tp)  # the engine gives each of its tp local ranks threads of these
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.llm_engine import LLMEngine
    from deltaserve.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(
        model=str(path), tensor_parallel_size=tp, enforce_eager=executor == "torch", max_num_seqs=1,
        max_model_len=512,
        max_num_batched_tokens=prompt,
        enable_prefix_caching=False,  # it would end the first step at the prompt's last block boundary
    ))
    shard = engine.model.shard
    ids = [(7 * i + 3) % 240000 for i in range(prompt)]
    engine.add_request("r", ids, SamplingParams(max_tokens=decode + 1, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()  # the whole prompt in one step, and its first token
    prefill_s = time.perf_counter() - t0
    c0, t1, steps = shard.collective_seconds, time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    decode_s = time.perf_counter() - t1
    pids = [("rank 0", __import__("os").getpid())] + [
        (f"rank {r}", p.pid) for r, p in enumerate(getattr(engine.executor, "workers", []), start=1)
    ]
    out = dict(
        tp=tp, threads_per_rank=threads, executor=engine.executor.name, prompt=prompt, decode_steps=steps,
        prefill_tok_s=prompt / prefill_s, decode_tok_s=steps / decode_s,
        collective_ms_per_decode_step=(shard.collective_seconds - c0) / steps * 1e3,
        rss_mib={name: round(rss_mib(pid)) for name, pid in pids},
    )
    engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/bench_tp_ckpt"))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--executor", choices=("fused", "torch"), default="fused")
    p.add_argument("--one", nargs=2, type=int, metavar=("TP", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args.dir, *args.one, args.prompt, args.decode, args.executor)))
        return
    write_checkpoint(args.dir, args.layers)
    for tp, threads in ((2, 1), (1, 2), (1, 1)):
        cmd = [sys.executable, __file__, "--dir", str(args.dir), "--prompt", str(args.prompt),
               "--decode", str(args.decode), "--executor", args.executor, "--one", str(tp), str(threads)]
        env = dict(__import__("os").environ, OMP_NUM_THREADS=str(threads))
        line = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.strip()
        r = json.loads(line.splitlines()[-1])
        print(f"TP={r['tp']} x {r['threads_per_rank']} thread(s), {r['executor']}: "
              f"prefill {r['prefill_tok_s']:.1f} tok/s, "
              f"decode {r['decode_tok_s']:.2f} tok/s, collectives {r['collective_ms_per_decode_step']:.2f} "
              f"ms/decode step, RSS {r['rss_mib']} MiB", flush=True)


if __name__ == "__main__":
    main()
