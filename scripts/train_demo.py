"""Train the embedded demo checkpoint: a small bilingual Qwen3.5-architecture model with its MTP head.

Uses deltaserve's own model code with autograd. Trunk and MTP head train jointly: the trunk predicts
token t+1, the MTP head predicts token t+2 from the trunk's final-normed hidden at t and the embedding
of token t+1. Reads the corpus that scripts/build_corpus.py writes (data/corpus) and the tokenizer in
the output directory; writes model.safetensors (official layout), config.json, generation_config.json.

    python scripts/train_demo.py --minutes 60 --out deltaserve/assets/demo
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from deltaserve.config import ModelConfig
from deltaserve.model.context import ForwardContext
from deltaserve.model.decoder import Qwen3_5ForCausalLM

ROOT = Path(__file__).resolve().parent.parent


def demo_text_config(vocab_size: int, eos_ids: list[int]) -> dict:
    """The 27B's structure scaled down: [lin, lin, lin, full] x 2, Hv = 3 Hk, nh = 6 nkv, rotary 0.25."""
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": 192,
        "intermediate_size": 512,
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
        "full_attention_interval": 4,
        "num_attention_heads": 6,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 6,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2], "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "mamba_ssm_dtype": "float32",
        "eos_token_id": eos_ids[0],
        "pad_token_id": None,
        "bos_token_id": None,
        "initializer_range": 0.02,
        "dtype": "bfloat16",
    }


def init_weights(model: Qwen3_5ForCausalLM, std: float = 0.02) -> None:
    """Hugging Face's conventions: normal(0, std) linears and embeddings, zero-centred norms at 0, the GDN
    norm at 1, A_log = log U(1, 16), dt_bias = 1; output projections scaled down by depth (GPT-2)."""
    depth = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()
            elif name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                p.normal_(0, std / math.sqrt(2 * depth))
            else:
                p.normal_(0, std)


class Corpus:
    """Token streams per source, sampled by weight; windows start at a document start half of the time."""

    def __init__(self, corpus_dir: Path, split: str, tokenizer: Tokenizer, eot: int) -> None:
        manifest = json.loads((corpus_dir / "manifest.json").read_text())
        self.names, self.weights, self.streams, self.doc_starts = [], [], {}, {}
        for name, info in manifest["sources"].items():
            if not info.get("used_for_training", True) or info.get("weight", 0) <= 0:
                continue
            path = corpus_dir / info[split]["file"]
            texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
            encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
            ids, starts = [], []
            for enc in encoded:
                starts.append(len(ids))
                ids.extend(enc.ids)
                ids.append(eot)
            self.names.append(name)
            self.weights.append(float(info["weight"]))
            self.streams[name] = np.asarray(ids, dtype=np.int64)
            self.doc_starts[name] = np.asarray(starts, dtype=np.int64)
        total = sum(self.weights)
        self.weights = [w / total for w in self.weights]

    def sample(self, rng: random.Random, batch: int, length: int, source: str | None = None) -> torch.Tensor:
        rows = []
        for _ in range(batch):
            name = source or rng.choices(self.names, self.weights)[0]
            stream = self.streams[name]
            limit = len(stream) - length - 1
            if rng.random() < 0.5:
                start = int(self.doc_starts[name][rng.randrange(len(self.doc_starts[name]))])
            else:
                start = rng.randrange(max(limit, 1))
            start = max(0, min(start, limit))
            window = stream[start : start + length + 1]
            if len(window) < length + 1:  # a source shorter than one window: repeat it
                window = np.resize(stream, length + 1)
            rows.append(torch.from_numpy(window.copy()))
        return torch.stack(rows)


def losses(model: Qwen3_5ForCausalLM, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trunk CE for t+1, MTP CE for t+2, and the MTP's greedy agreement with the trunk's next prediction."""
    B, L1 = batch.shape
    L = L1 - 1
    inputs, targets = batch[:, :-1], batch[:, 1:]
    hidden = model(inputs.reshape(-1), ForwardContext.stateless([L] * B))  # [B*L, H]
    logits = model.compute_logits(hidden).view(B, L, -1)
    trunk = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    # MTP at t reads h_t and token t+1 (= targets[t]) and predicts token t+2 (= targets[t+1]).
    h = hidden.view(B, L, -1)[:, :-1].reshape(-1, hidden.shape[-1])
    mtp_hidden = model.mtp_hidden(targets[:, :-1].reshape(-1), h, ForwardContext.stateless([L - 1] * B))
    mtp_logits = model.compute_logits(mtp_hidden).view(B, L - 1, -1)
    mtp = F.cross_entropy(mtp_logits.reshape(-1, mtp_logits.shape[-1]), targets[:, 1:].reshape(-1))
    agree = (mtp_logits.argmax(-1) == logits[:, 1:].argmax(-1)).float().mean()
    return trunk, mtp, agree


@torch.no_grad()
def evaluate(model, corpus: Corpus, rng_seed: int, batches: int, batch: int, length: int) -> dict[str, dict]:
    model.eval()
    results = {}
    for name in corpus.names:
        rng = random.Random(rng_seed)
        t = m = a = 0.0
        for _ in range(batches):
            lt, lm, ag = losses(model, corpus.sample(rng, batch, length, name))
            t, m, a = t + lt.item(), m + lm.item(), a + ag.item()
        results[name] = {"loss": t / batches, "mtp_loss": m / batches, "mtp_agreement": a / batches}
    model.train()
    return results


def save_checkpoint(model: Qwen3_5ForCausalLM, text_config: dict, out: Path, eos_ids: list[int]) -> None:
    tensors = {}
    for name, p in model.state_dict().items():
        if name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        tensors[name] = p.detach().to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text_config,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": eos_ids, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "do_sample": True}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=ROOT / "data" / "corpus")
    ap.add_argument("--out", type=Path, default=ROOT / "deltaserve" / "assets" / "demo")
    ap.add_argument("--minutes", type=float, default=60.0, help="wall-clock training budget")
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--length", type=int, default=384)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", type=Path, default=None, help="also write progress lines as JSON here")
    ap.add_argument("--resume", action="store_true", help="continue training the checkpoint in --out")
    ap.add_argument("--warmup", type=int, default=100)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    eot, im_end = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    eos_ids = [im_end, eot]
    t0 = time.time()
    train = Corpus(args.corpus, "train", tokenizer, eot)
    heldout = Corpus(args.corpus, "heldout", tokenizer, eot)
    print(f"tokenized corpus in {time.time() - t0:.0f}s: "
          + ", ".join(f"{n} {len(train.streams[n]) / 1e6:.2f}M" for n in train.names), flush=True)

    text_config = demo_text_config(tokenizer.get_vocab_size(), eos_ids)
    previous = None
    if args.resume:
        # Continue from the checkpoint in --out (a fresh optimizer; the schedule restarts at --lr).
        text_config = json.loads((args.out / "config.json").read_text())["text_config"]
        previous = json.loads((args.out / "training_summary.json").read_text())
    cfg = ModelConfig.from_dict(text_config)
    model = Qwen3_5ForCausalLM(cfg, with_mtp=True)
    init_weights(model)
    if args.resume:
        state = load_file(str(args.out / "model.safetensors"))
        renamed = {k.replace("model.language_model.", "model.", 1): v.float() for k, v in state.items()}
        model.load_state_dict(renamed, strict=True)
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in model.mtp.parameters())
    print(f"parameters: {n_params / 1e6:.2f}M (MTP head {n_mtp / 1e6:.2f}M)", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    budget = args.minutes * 60
    warmup = args.warmup
    log = args.log.open("w") if args.log else None
    start, step, seen = time.time(), 0, 0
    model.train()
    while time.time() - start < budget:
        progress = (time.time() - start) / budget
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = train.sample(rng, args.batch, args.length)
        # bf16 matmuls run about twice as fast as fp32 on these CPUs; the delta rule stays fp32 inside.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            trunk, mtp, agree = losses(model, batch)
        loss = trunk + args.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += batch.numel()
        if step % 20 == 0:
            elapsed = time.time() - start
            line = {"step": step, "minutes": round(elapsed / 60, 2), "tokens": seen,
                    "tok_per_s": round(seen / elapsed), "lr": round(lr, 6), "loss": round(trunk.item(), 4),
                    "mtp_loss": round(mtp.item(), 4), "mtp_agreement": round(agree.item(), 3)}
            print(json.dumps(line), flush=True)
            if log:
                log.write(json.dumps(line) + "\n")
                log.flush()
        if step % args.eval_every == 0:
            ev = evaluate(model, heldout, 1, 1, 4, args.length)
            print("heldout " + json.dumps({n: round(v["loss"], 3) for n, v in ev.items()}), flush=True)

    elapsed = time.time() - start
    final = evaluate(model, heldout, 1, 4, 4, args.length)
    summary = {
        "parameters": n_params, "mtp_parameters": n_mtp, "steps": step, "tokens_seen": seen,
        "train_minutes": round(elapsed / 60, 1), "threads": args.threads, "batch": args.batch,
        "length": args.length, "heldout": final,
        "mtp_agreement_mean": sum(v["mtp_agreement"] for v in final.values()) / len(final),
    }
    if previous is not None:
        summary["runs"] = previous.get("runs", [
            {k: previous[k] for k in ("steps", "tokens_seen", "train_minutes")}
        ]) + [{"steps": step, "tokens_seen": seen, "train_minutes": summary["train_minutes"], "lr": args.lr}]
        for key in ("steps", "tokens_seen"):
            summary[key] += previous[key]
        summary["train_minutes"] = round(summary["train_minutes"] + previous["train_minutes"], 1)
    print(json.dumps(summary, indent=1), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, text_config, args.out, eos_ids)
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
