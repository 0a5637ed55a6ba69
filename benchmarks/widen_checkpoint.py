"""Widen a checkpoint into a larger one that computes the same function: a memory-bound model for measuring
speculative decoding (and weight formats) honestly, without a training run (not a test).

    .venv/bin/python benchmarks/widen_checkpoint.py OUT_DIR [--model DIR] [--hidden 1024]
        [--intermediate 3584] [--layers 24] [--seed 0] [--check 8]

The construction, for a source of hidden size H, MLP width I and L layers:
- the hidden size is padded to H' with dimensions that stay zero: they are zero in the embedding and in
  every projection that writes the residual (o_proj, out_proj, down_proj, mtp.fc); the projections that
  read the residual hold random values in the new columns, since they only ever read zeros there;
- every RMSNorm of the residual (layer norms, the final norm, the MTP head's) has its factor (1 + w)
  multiplied by sqrt(H / H'): the mean of squares over H' is H / H' times the one over H;
- when c = sqrt(H' / H) is a power of two (H' = 4H, 16H, ...), the residual stream is also scaled by c
  (the embedding and the writers' rows times c, exact in any float format): then every norm's mean of
  squares, and so its epsilon's weight, is the source's, and the widened model computes the source's
  logits within fp32 rounding. For other widths the epsilon weighs H' / H times more (a relative change
  of eps * (H' / H - 1) / mean(x^2) in each norm), and only the greedy agreement says how close it is.
  The norm scales are stored in float32, the projections in the source's dtype;
- the MLP is widened to I' with units whose down_proj columns are zero (their gate/up rows random);
- a vision tower keeps its width; its mergers' output projections (which write text embeddings) get zero
  rows for the new dimensions, scaled as the embedding is;
- [GDN, GDN, GDN, attention] blocks are appended, up to `--layers`, whose writers (out_proj, o_proj,
  down_proj) are zero: identity layers that still read their weights and keep their caches.
The MTP head is widened the same way, so its drafts (and the acceptance) stay the source's own.

With --check N the widened model's greedy tokens are compared with the source's on N prompts (64 new
tokens each, through the engine) and the agreement is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from deltaserve.assets import DEMO_DIR  # noqa: E402

# Projections that write the residual stream: their new output rows stay zero.
WRITERS = ("self_attn.o_proj", "linear_attn.out_proj", "mlp.down_proj")
# RMSNorms over the residual stream: (1 + w) takes the factor sqrt(H / H').
RESIDUAL_NORMS = ("input_layernorm", "post_attention_layernorm", "norm", "pre_fc_norm_embedding",
                  "pre_fc_norm_hidden")
READ_SCALE = 0.02  # the std of the random values placed where only zeros are read


class Widener:
    def __init__(self, H: int, H2: int, I: int, I2: int, dtype: torch.dtype, seed: int) -> None:
        self.H, self.H2, self.I, self.I2 = H, H2, I, I2
        self.dtype = dtype
        c = math.sqrt(H2 / H)
        self.stream = c if c == 2 ** round(math.log2(c)) else 1.0  # the residual stream's scale
        self.gen = torch.Generator().manual_seed(seed)

    def random(self, *shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=self.gen) * READ_SCALE).to(self.dtype)

    def pad_cols(self, w: torch.Tensor, width: int) -> torch.Tensor:
        """Columns past w's own get random values (they multiply zeros)."""
        return torch.cat([w, self.random(w.shape[0], width - w.shape[1])], dim=1)

    def pad_rows_zero(self, w: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])

    def norm(self, w: torch.Tensor) -> torch.Tensor:
        """A zero-centred RMSNorm weight of the residual: (1 + w') = (1 + w) sqrt(H / H') on the old dims;
        the new dims (which normalise zeros) keep w' = 0."""
        scale = (1.0 + w.float()) * math.sqrt(self.H / self.H2)
        out = torch.zeros(self.H2)
        out[: self.H] = scale - 1.0
        return out

    def tensor(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """The widened form of one source tensor (official names, `model.language_model.` or `mtp.`)."""
        H2, I2 = self.H2, self.I2
        if name.startswith("model.visual."):
            # The vision tower keeps its own width; its mergers' last projection writes text embeddings.
            if ".linear_fc2." in name and ("merger." in name or "merger_list." in name):
                return self.pad_rows_zero(w * self.stream, H2)
            return w
        leaf = name.removesuffix(".weight")
        if leaf.endswith("embed_tokens"):
            return torch.cat([w * self.stream, w.new_zeros(w.shape[0], H2 - self.H)], dim=1)
        if leaf == "lm_head":
            return self.pad_cols(w, H2)
        *owner, last = leaf.split(".")
        if last in RESIDUAL_NORMS and owner[-1:] != ["linear_attn"]:  # not the GDN's own (head-sized) norm
            return self.norm(w)
        if leaf.endswith("mlp.down_proj"):  # [H, I] -> [H', I']: new rows and columns zero
            out = w.new_zeros(H2, I2)
            out[: self.H, : self.I] = w * self.stream
            return out
        if leaf.endswith(("mlp.gate_proj", "mlp.up_proj")):  # [I, H] -> [I', H']
            return torch.cat([self.pad_cols(w, H2), self.random(I2 - self.I, H2)])
        if leaf.endswith(WRITERS):  # [H, in] -> [H', in]
            return self.pad_rows_zero(w * self.stream, H2)
        if leaf == "mtp.fc":  # [H, 2H] over cat[norm(embedding), norm(hidden)] -> [H', 2H']
            H = self.H
            emb, hid = self.pad_cols(w[:, :H], H2), self.pad_cols(w[:, H:], H2)
            return self.pad_rows_zero(torch.cat([emb, hid], dim=1) * self.stream, H2)
        if w.dim() == 2 and w.shape[1] == self.H:  # every other reader of the residual
            return self.pad_cols(w, H2)
        return w  # conv, A_log, dt_bias, the GDN and q/k norms: no residual dimension

    def identity_layer(self, template: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        """A widened layer like `template` (its tensors, names relative to the layer) whose writers are zero:
        random readers and norms, so that it reads as much memory as a real layer."""
        out = {}
        for rel, w in template.items():
            leaf = rel.removesuffix(".weight")
            if leaf.endswith(WRITERS) or leaf.endswith("mlp.down_proj"):
                out[prefix + rel] = torch.zeros_like(w)
            elif w.is_floating_point() and w.dim() == 2:
                out[prefix + rel] = self.random(*w.shape)
            else:
                out[prefix + rel] = w.clone()
        return out


def widen(src: Path, out: Path, hidden: int | None, intermediate: int, layers: int, seed: int = 0) -> Path:
    config = json.loads((src / "config.json").read_text())
    text = config.get("text_config", config)
    H, I, L = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    hidden = hidden or 4 * H
    if hidden < H or intermediate < I or layers < L:
        raise SystemExit(f"widening only grows: source hidden {H}, intermediate {I}, layers {L}")
    pattern = ["linear_attention"] * 3 + ["full_attention"]
    if (layers - L) % len(pattern):
        raise SystemExit(f"--layers {layers}: the source's {L} plus whole [GDN, GDN, GDN, attention] blocks")
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    dtype = tensors["lm_head.weight"].dtype if "lm_head.weight" in tensors else torch.bfloat16
    wd = Widener(H, hidden, I, intermediate, dtype, seed)
    wide = {name: wd.tensor(name, w) for name, w in tensors.items()}
    if wd.stream == 1.0:
        print(f"note: sqrt({hidden} / {H}) is not a power of two, so the norms' epsilon weighs {hidden / H:.2f}x "
              "more than in the source (see the module docstring)")

    prefix = "model.language_model.layers."
    types = list(text["layer_types"])
    templates = {}  # layer type -> a widened layer's tensors, names relative to the layer
    for t in ("linear_attention", "full_attention"):
        i = types.index(t)
        templates[t] = {n[len(f"{prefix}{i}."):]: w for n, w in wide.items() if n.startswith(f"{prefix}{i}.")}
    for li in range(L, layers):
        kind = pattern[(li - L) % len(pattern)]
        wide.update(wd.identity_layer(templates[kind], f"{prefix}{li}."))
        types.append(kind)

    text.update(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, layer_types=types)
    if "vision_config" in config:
        config["vision_config"]["out_hidden_size"] = hidden
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in wide.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)
    return out


def agreement(src: Path, wide: Path, prompts: list[str], tokens: int = 64) -> float:
    """The fraction of greedy tokens the widened model shares with the source, position by position."""
    from deltaserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outs = []
    for path in (src, wide):
        llm = LLM(model=str(path), max_model_len=512, max_num_seqs=len(prompts))
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    same = sum(a == b for x, y in zip(*outs, strict=True) for a, b in zip(x, y, strict=True))
    return same / (len(prompts) * tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", type=Path, default=DEMO_DIR)
    ap.add_argument("--hidden", type=int, default=None, help="default 4x the source's (exact)")
    ap.add_argument("--intermediate", type=int, default=3584)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", type=int, default=8, help="prompts for the greedy agreement check (0: none)")
    args = ap.parse_args()
    widen(args.model, args.out, args.hidden, args.intermediate, args.layers, args.seed)
    n = sum(t.numel() for t in load_file(str(args.out / "model.safetensors")).values())
    print(f"wrote {args.out}: {n / 1e6:.1f}M parameters")
    if args.check:
        from bench_spec import PROMPTS

        share = agreement(args.model, args.out, PROMPTS[: args.check])
        print(f"greedy agreement with {args.model.name}: {share:.1%} of {args.check} x 64 tokens")


if __name__ == "__main__":
    main()
