"""deltaserve vs transformers on the same checkpoint, one thread each (not a test; timing decides nothing).

    .venv/bin/python benchmarks/bench_engine.py [--requests 64] [--rounds 3] [--skip-demo] [--no-write]

Workloads: (a) batch-1 decode of 128 new tokens; (b) N requests, prompt and output lengths uniform in
16..256 (ignore_eos): deltaserve gets them all at once, transformers one left-padded batched generate
that runs to the longest output; (c) prefill of a 2k-token prompt (time to the first token).
Checkpoints: the embedded demo (when present) and a ~60M-parameter random one built here. The table goes
into docs/benchmarks.md under "Engine vs transformers" (that section is replaced, others are kept)."""

from __future__ import annotations

import argparse
import datetime
import gc
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import machine, write_section  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.assets import DEMO_DIR  # noqa: E402

SECTION = "## Engine vs transformers"
RANDOM_SHAPE = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    partial_rotary_factor=0.25,
    max_position_embeddings=4096,
)


@dataclass(slots=True)
class Row:
    checkpoint: str
    workload: str
    ours: float
    theirs: float
    unit: str
    higher_is_better: bool

    @property
    def speedup(self) -> float:
        return self.ours / self.theirs if self.higher_is_better else self.theirs / self.ours


def build_random(dirpath: Path) -> Path:
    from tests.checkpoints import random_hf_model, save_official_layout

    # Stored in bf16 like released Qwen3.5 checkpoints (and the demo); both engines load it as fp32.
    return save_official_layout(random_hf_model(RANDOM_SHAPE, seed=0).to(torch.bfloat16), dirpath)


def load_hf(path: Path):
    """transformers' model on the same weights (the official layout loads as the text model)."""
    from transformers import AutoConfig, Qwen3_5ForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    text_cfg = getattr(cfg, "text_config", cfg)
    model = Qwen3_5ForCausalLM.from_pretrained(path, config=text_cfg, dtype=torch.float32).eval()
    return model


def timed(fn) -> float:
    gc.collect()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def best_of(ours, theirs, rounds: int) -> tuple[float, float]:
    """Seconds of each side, the best of `rounds` runs taken in turn (ours, theirs, ours, ...), so a burst of
    load on this shared machine hits both sides alike and the minimum drops it."""
    times = [(timed(ours), timed(theirs)) for _ in range(rounds)]
    return min(t[0] for t in times), min(t[1] for t in times)


def workload_lengths(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randint(16, 256))] for _ in range(n)]
    outs = [rng.randint(16, 256) for _ in range(n)]
    return prompts, outs


def bench(name: str, path: Path, n_requests: int, rounds: int) -> list[Row]:
    rows: list[Row] = []
    llm = LLM(
        model=str(path),
        max_num_seqs=max(n_requests, 1),
        max_model_len=4096,
        max_num_batched_tokens=2048,
        kv_cache_memory=1 << 30,
    )
    hf = load_hf(path)
    vocab = llm.engine.model_config.vocab_size
    eos = hf.generation_config.eos_token_id
    hf.generation_config.pad_token_id = hf.generation_config.pad_token_id or 0
    prompt = [(7 * i + 11) % vocab for i in range(16)]

    # warm-up both (first calls allocate and pick kernels)
    llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    with torch.no_grad():
        hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8)

    # (a) batch-1 decode
    new = 128
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    with torch.no_grad():
        t_ours, t_hf = best_of(
            lambda: llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False),
            lambda: hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=new),
            rounds,
        )
    rows.append(Row(name, f"decode, batch 1, {new} new tokens", new / t_ours, new / t_hf, "tok/s", True))

    # (b) N requests of mixed lengths
    prompts, outs = workload_lengths(n_requests)
    total_out = sum(outs)
    plist = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        t_ours, t_hf = best_of(
            lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], plist, use_tqdm=False),
            lambda: hf.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=max(outs), min_new_tokens=max(outs)
            ),
            rounds,
        )
    rows.append(
        Row(
            name,
            f"{n_requests} requests, prompt/output 16-256 (useful output tok/s)",
            total_out / t_ours,
            total_out / t_hf,
            "tok/s",
            True,
        )
    )

    # (c) prefill 2k
    long = [(13 * i + 5) % vocab for i in range(2048)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with torch.no_grad():
        t_ours, t_hf = best_of(
            lambda: llm.generate({"prompt_token_ids": long}, one, use_tqdm=False),
            lambda: hf.generate(torch.tensor([long]), do_sample=False, max_new_tokens=1),
            rounds,
        )
    rows.append(Row(name, "prefill 2048-token prompt (time to first token)", t_ours, t_hf, "s", False))
    del eos
    return rows




def table(rows: list[Row], n_cpus: int, rounds: int) -> str:
    import transformers

    lines = [
        SECTION,
        "",
        f"Run {datetime.date.today().isoformat()} on {machine()}; "
        f"`torch.set_num_threads(1)` for both engines; transformers {transformers.__version__} "
        "(its pure-torch GDN fallbacks); both checkpoints store bf16 weights, as released Qwen3.5 checkpoints "
        f"do, and both engines compute in fp32; greedy, ignore_eos; each cell the best of {rounds} runs, the two "
        "engines taking turns. Produced by `benchmarks/bench_engine.py`.",
        "",
        "| checkpoint | workload | deltaserve | transformers | speedup |",
        "|---|---|---|---|---|",
    ]
    for r in rows:

        def fmt(v: float, unit: str = r.unit) -> str:
            return f"{v:.3f} s" if unit == "s" else f"{v:.1f} {unit}"

        lines.append(
            f"| {r.checkpoint} | {r.workload} | {fmt(r.ours)} | {fmt(r.theirs)} | {r.speedup:.1f}x |"
        )
    return "\n".join(lines) + "\n"




def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="best of this many runs of each side")
    # a partial table must not replace the recorded one
    ap.add_argument("--skip-demo", action="store_true", help="only the random checkpoint (implies --no-write)")
    ap.add_argument("--skip-random", action="store_true", help="only the demo checkpoint (implies --no-write)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    n_cpus = torch.get_num_threads()
    torch.set_num_threads(1)
    rows: list[Row] = []
    if not args.skip_demo and (DEMO_DIR / "model.safetensors").exists():
        rows += bench("demo", DEMO_DIR, args.requests, args.rounds)
    elif not args.skip_demo:
        print(f"skipping the demo checkpoint: no model.safetensors in {DEMO_DIR}")
    if not args.skip_random:
        with tempfile.TemporaryDirectory() as d:
            path = build_random(Path(d))
            n = sum(
                t.numel()
                for t in __import__("safetensors.torch").torch.load_file(str(path / "model.safetensors")).values()
            )
            rows += bench(f"random {n / 1e6:.0f}M", path, args.requests, args.rounds)
    text = table(rows, n_cpus, args.rounds)
    print(text)
    if not (args.no_write or args.skip_random or args.skip_demo):
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
