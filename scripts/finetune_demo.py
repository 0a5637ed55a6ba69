"""Fine-tune the embedded demo so that it calls tools and sees pictures (issues 17 and 19).

Starts from the trained text checkpoint in --base (its trunk, lm_head and MTP head), adds a small vision
tower (scripts/corpus/demo_vision_config.py) initialised at random, and trains everything on a mix of
- replayed pre-training text (data/corpus, scripts/build_corpus.py), so the demo keeps what it knew;
- tool-use conversations (scripts/corpus/gen_tools.py), loss on the assistant's own output only;
- questions about generated pictures (scripts/corpus/gen_vision.py), loss on the answer only.
The MTP head keeps training on the same tokens (its t+2 targets, under the same masks), so speculation
stays useful. Writes the checkpoint (official layout, model.visual.* included), config.json with
vision_config, preprocessor_config.json and training_summary.json into --out.

    python scripts/finetune_demo.py --minutes 40 --out deltaserve/assets/demo
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

from corpus import gen_tools, gen_vision  # noqa: E402
from corpus.demo_vision_config import (  # noqa: E402
    demo_config_with_vision,
    demo_preprocessor_config,
    init_vision_tower,
    vision_training_inputs,
    write_vision_checkpoint,
)
from train_demo import Corpus  # noqa: E402

from deltaserve.config import ModelConfig  # noqa: E402
from deltaserve.engine.image_processor import ImageProcessor  # noqa: E402
from deltaserve.model.context import ForwardContext  # noqa: E402
from deltaserve.model.decoder import Qwen3_5ForCausalLM  # noqa: E402
from deltaserve.tokenizer import Tokenizer as ChatTokenizer  # noqa: E402

ROOT = SCRIPTS.parent
CITY_TOOLS = ("get_weather", "get_time")  # the tools whose argument is a city named in the question


@dataclass(slots=True)
class Sequence:
    """One training sequence: its token ids, which of them the model is trained to produce, its [3, n]
    positions, and, for a picture question, the image's patches and grid and where its tokens sit."""

    ids: list[int]
    targets: list[bool]  # targets[t]: ids[t] is model output (its prediction from t - 1 is trained)
    positions: torch.Tensor  # [3, n] long
    pixels: torch.Tensor | None = None
    grid: tuple[int, int, int] | None = None
    image_rows: list[int] | None = None  # the rows of its merged visual tokens


def text_sequence(ids: list[int], targets: list[bool]) -> Sequence:
    return Sequence(ids, targets, torch.arange(len(ids)).expand(3, -1))


def segments_to_sequence(segments: list[tuple[str, bool]], tokenizer) -> Sequence:
    """Each piece tokenized alone, as the engine tokenizes a prompt and then generates the output token by
    token; the model-output pieces' tokens are the targets."""
    ids, targets = [], []
    for piece, is_output in segments:
        piece_ids = tokenizer.encode(piece)
        ids += piece_ids
        targets += [is_output] * len(piece_ids)
    return text_sequence(ids, targets)


def vision_sequence(example, tokenizer, processor, vision_cfg, thinking: bool) -> Sequence:
    inputs = vision_training_inputs(example, tokenizer, processor, vision_cfg, thinking)
    return Sequence(inputs.input_ids.tolist(), inputs.loss_mask.tolist(), inputs.positions, inputs.pixel_values,
                    inputs.grids[0], inputs.image_rows.tolist())


def pack(seqs: list[Sequence], pad_id: int) -> dict:
    """Inputs (each sequence but its last token), padded to one length so that the stateless forward runs
    them as one [B, L] batch (padding sits after each sequence, so causal layers never read it), with
    targets, the target mask and the images."""
    L = max(len(s.ids) for s in seqs) - 1
    inputs, targets, mask, positions = [], [], [], []
    pixels, grids, image_rows = [], [], []
    for b, s in enumerate(seqs):
        n, pad = len(s.ids) - 1, L - (len(s.ids) - 1)
        inputs += s.ids[:-1] + [pad_id] * pad
        targets += s.ids[1:] + [pad_id] * pad
        mask += s.targets[1:] + [False] * pad
        after = s.positions[:, n - 1 : n] + 1 + torch.arange(pad)  # padding continues the positions
        positions.append(torch.cat([s.positions[:, :-1], after], dim=1))
        if s.pixels is not None:
            pixels.append(s.pixels)
            grids.append(s.grid)
            image_rows += [b * L + r for r in s.image_rows]
    return {
        "inputs": torch.tensor(inputs), "targets": torch.tensor(targets), "mask": torch.tensor(mask),
        "positions": torch.cat(positions, dim=1), "lengths": [L] * len(seqs),
        "pixels": torch.cat(pixels) if pixels else None, "grids": grids, "image_rows": torch.tensor(image_rows),
    }


def masked_ce(model: Qwen3_5ForCausalLM, hidden: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor):
    """Mean cross-entropy over the target rows; logits only at those rows (most of a tool prompt is not)."""
    rows = mask.nonzero().squeeze(1)
    return F.cross_entropy(model.compute_logits(hidden, rows).float(), targets[rows])


def losses(model: Qwen3_5ForCausalLM, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Trunk CE for t+1 and MTP CE for t+2, both over the target tokens only."""
    lengths = batch["lengths"]
    ctx = ForwardContext.stateless(lengths)
    ctx.positions = batch["positions"]
    if batch["pixels"] is not None:
        ctx.mm_embeds = (batch["image_rows"], model.encode_images(batch["pixels"], batch["grids"]))
    hidden = model(batch["inputs"], ctx)
    trunk = masked_ce(model, hidden, batch["targets"], batch["mask"])
    # MTP at row t reads h_t and token t+1 (targets[t]) and predicts token t+2 (targets[t+1]): within each
    # sequence, every row but the last (as scripts/train_demo.py trains it, at the trunk row's position).
    B, L = len(lengths), lengths[0]
    index = torch.arange(B * L).view(B, L)
    keep, shifted = index[:, :-1].reshape(-1), index[:, 1:].reshape(-1)
    mtp_ctx = ForwardContext.stateless([L - 1] * B)
    mtp_ctx.positions = batch["positions"][:, keep]
    mtp_hidden = model.mtp_hidden(batch["targets"][keep], hidden[keep], mtp_ctx)
    mtp = masked_ce(model, mtp_hidden, batch["targets"][shifted], batch["mask"][shifted])
    return trunk, mtp


def build_model(base: Path, wrapper: dict) -> Qwen3_5ForCausalLM:
    cfg = ModelConfig.from_dict(wrapper)
    model = Qwen3_5ForCausalLM(cfg, with_mtp=True, with_vision=True)
    init_vision_tower(model.visual)
    state = load_file(str(base / "model.safetensors"))
    renamed = {}
    for k, v in state.items():
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        elif k.startswith("model.visual."):
            k = k[len("model."):]
        renamed[k] = v.float()
    missing, unexpected = model.load_state_dict(renamed, strict=False)
    if unexpected or any(not k.startswith("visual.") for k in missing):
        raise SystemExit(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")
    return model


def save(model: Qwen3_5ForCausalLM, base: Path, out: Path) -> None:
    """The trained tensors in the official names, through the vision writer (config, processor, tokenizer)."""
    text, visual = {}, {}
    for name, p in model.state_dict().items():
        if name.startswith("visual."):
            visual[name[len("visual."):]] = p.detach()
        else:
            text[("model.language_model." + name[len("model."):]) if name.startswith("model.") else name] = p.detach()
    write_vision_checkpoint(base, out, visual, text=text)


class Mix:
    """Draws each step's sequences: replayed corpus windows, tool conversations and picture questions."""

    def __init__(self, args, tok: Tokenizer, tokenizer, processor, vision_cfg, split: str) -> None:
        eot = tok.token_to_id("<|endoftext|>")
        self.corpus = Corpus(args.corpus, split, tok, eot)
        self.tok, self.tokenizer, self.processor, self.vision_cfg = tok, tokenizer, processor, vision_cfg
        self.split = split
        self.pad_id = eot
        self.args = args

    def tool(self, rng: random.Random) -> Sequence:
        example = gen_tools.sample(rng, self.split)
        segments = gen_tools.training_segments(example, self.tokenizer)
        if example.kind == "call" and not example.enable_thinking and rng.random() < 0.5:
            # The full render drops the empty think block of a thinking-off call turn that inference's
            # generation prompt has; half of these train that first turn as inference sees it.
            segments = gen_tools.first_turn_segments(example, self.tokenizer)
        return segments_to_sequence(segments, self.tokenizer)

    def city(self, rng: random.Random) -> Sequence:
        """A weather or time question's first turn: the call, whose city argument is the English name of the
        city the question names (in either language), so the model learns to copy or translate it."""
        example = gen_tools.sample(rng, self.split, max_tools=2, topics=CITY_TOOLS)
        return segments_to_sequence(gen_tools.first_turn_segments(example, self.tokenizer), self.tokenizer)

    def vision(self, rng: random.Random) -> Sequence:
        example = gen_vision.sample(rng, self.split)
        return vision_sequence(example, self.tokenizer, self.processor, self.vision_cfg, rng.random() < 0.5)

    def text(self, rng: random.Random) -> Sequence:
        window = self.corpus.sample(rng, 1, self.args.length)[0].tolist()
        return text_sequence(window, [True] * len(window))

    def groups(self, rng: random.Random) -> dict[str, dict]:
        """One step's packed groups, each its own forward (a tool prompt is ten times a question's length)."""
        a = self.args
        counts = {"text": a.text_per_step, "tool": a.tools_per_step, "vision": a.vision_per_step,
                  "city": a.city_calls_per_step}
        return {kind: pack([getattr(self, kind)(rng) for _ in range(n)], self.pad_id)
                for kind, n in counts.items() if n > 0}


@torch.no_grad()
def evaluate(model, mix: Mix, seed: int, draws: int) -> dict[str, float]:
    """Held-out trunk loss on each kind of data (target tokens only)."""
    model.eval()
    out = {}
    kinds = ("text", "tool", "vision") + (("city",) if mix.args.city_calls_per_step else ())
    for kind in kinds:
        rng = random.Random(seed)
        total = 0.0
        for _ in range(draws):
            trunk, _ = losses(model, pack([getattr(mix, kind)(rng) for _ in range(4)], mix.pad_id))
            total += trunk.item()
        out[kind] = round(total / draws, 4)
    model.train()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=ROOT / "deltaserve" / "assets" / "demo",
                    help="the trained text checkpoint to start from")
    ap.add_argument("--out", type=Path, default=ROOT / "deltaserve" / "assets" / "demo")
    ap.add_argument("--corpus", type=Path, default=ROOT / "data" / "corpus")
    ap.add_argument("--minutes", type=float, default=40.0, help="wall-clock training budget")
    ap.add_argument("--text-per-step", type=int, default=3)
    ap.add_argument("--length", type=int, default=256, help="tokens per replayed corpus window")
    ap.add_argument("--tools-per-step", type=int, default=4)
    ap.add_argument("--vision-per-step", type=int, default=32)
    ap.add_argument("--city-calls-per-step", type=int, default=0,
                    help="weather / time questions' calls (first turn only): the city argument drill")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of the pre-trained parts")
    ap.add_argument("--tower-lr", type=float, default=3e-3, help="peak learning rate of the new vision tower")
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--print-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", type=Path, default=None, help="also write progress lines as JSON here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tok = Tokenizer.from_file(str(args.base / "tokenizer.json"))
    tokenizer = ChatTokenizer.from_dir(args.base)
    base_config = json.loads((args.base / "config.json").read_text())
    wrapper = demo_config_with_vision(base_config, tokenizer)
    model = build_model(args.base, wrapper)
    vision_cfg = model.config.vision
    processor = ImageProcessor.from_dict(demo_preprocessor_config())
    train = Mix(args, tok, tokenizer, processor, vision_cfg, "train")
    heldout = Mix(args, tok, tokenizer, processor, vision_cfg, "heldout")
    n_params = sum(p.numel() for p in model.parameters())
    n_tower = sum(p.numel() for p in model.visual.parameters())
    print(f"parameters: {n_params / 1e6:.2f}M (vision tower {n_tower / 1e6:.2f}M)", flush=True)
    print("heldout before " + json.dumps(evaluate(model, heldout, 1, 4)), flush=True)

    groups = []
    for tower in (False, True):
        named = [(n, p) for n, p in model.named_parameters() if n.startswith("visual.") == tower]
        peak = args.tower_lr if tower else args.lr
        groups.append({"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.05, "peak": peak})
        groups.append({"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0, "peak": peak})
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    budget = args.minutes * 60
    log = args.log.open("w") if args.log else None
    start, step, seen = time.time(), 0, 0
    model.train()
    while time.time() - start < budget:
        progress = (time.time() - start) / budget
        scale = min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = group["peak"] * scale
        opt.zero_grad(set_to_none=True)
        step_losses = {}
        for kind, batch in train.groups(rng).items():  # each group's mean loss counts the same
            with torch.autocast("cpu", dtype=torch.bfloat16):
                trunk, mtp = losses(model, batch)
            (trunk + args.mtp_weight * mtp).backward()
            step_losses[kind] = round(trunk.item(), 4)
            seen += len(batch["inputs"])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.print_every == 0:
            elapsed = time.time() - start
            line = {"step": step, "minutes": round(elapsed / 60, 2), "tokens": seen,
                    "tok_per_s": round(seen / elapsed), "scale": round(scale, 4), "loss": step_losses}
            print(json.dumps(line), flush=True)
            if log:
                log.write(json.dumps(line) + "\n")
                log.flush()
        if step % args.eval_every == 0:
            print("heldout " + json.dumps(evaluate(model, heldout, 1, 2)), flush=True)

    elapsed = time.time() - start
    final = evaluate(model, heldout, 1, 8)
    print("heldout final " + json.dumps(final), flush=True)
    previous = json.loads((args.base / "training_summary.json").read_text())
    save(model, args.base, args.out)
    run = {"steps": step, "tokens_seen": seen, "train_minutes": round(elapsed / 60, 1), "threads": args.threads,
           "per_step": {"text": args.text_per_step, "tools": args.tools_per_step, "vision": args.vision_per_step,
                        "city_calls": args.city_calls_per_step},
           "text_window": args.length, "lr": args.lr, "tower_lr": args.tower_lr, "heldout_loss": final}
    # A --base that was fine-tuned already (a second run continues it): the runs are listed, their sums kept.
    runs = previous.get("finetune", {}).get("runs", []) + [run]
    finetune = {**run, "runs": runs, **{k: sum(r[k] for r in runs) for k in ("steps", "tokens_seen")},
                "train_minutes": round(sum(r["train_minutes"] for r in runs), 1)}
    summary = {**previous, "parameters": n_params, "vision_parameters": n_tower, "finetune": finetune}
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
