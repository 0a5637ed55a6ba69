"""Write the demo checkpoint's model card (deltaserve/assets/demo/README.md) from its training summary and
fresh samples generated with deltaserve itself.

    python scripts/demo_card.py [--tool-eval tools.json] [--vision-eval vision.json] [--ppl-base base.json
                                 --ppl-tuned tuned.json]

The optional files (scripts/eval_demo_tools.py --json, scripts/eval_demo_vision.py --json, and
`deltaserve eval ppl --json` before and after the fine-tune) are kept in training_summary.json's "finetune"
entry, so a later run without them writes the same tables.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from deltaserve import LLM, SamplingParams
from deltaserve.assets import DEMO_DIR
from deltaserve.config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import gen_tools, gen_vision  # noqa: E402

TEXT_PROMPTS = [
    "Once upon a time, a little fox",
    "The old man looked at the sea and",
    "To be, or not to be:",
    "从前有一只小猫，",
    "春天来了，",
    "床前明月光，",
]
CHATS = [
    ("What is 12 + 7?", True),
    ("Tell me a short story about a brave rabbit.", True),
    ("What is the capital of Japan?", False),
    ("小明有5个苹果，又买了3个，一共有几个？", True),
    ("请讲一个关于小狗的故事。", True),
    ("中国的首都是哪里？", False),
]


TOOL_ROWS = ["all", "lang=en", "lang=zh", "thinking=off", "thinking=on", "tool=get_weather", "tool=calculate",
             "tool=get_time", "tool=convert_units", "tool=none"]
TOOL_METRICS = ["call_made", "right_name", "right_args", "answer_ok", "no_call_ok"]
PICTURE_QUESTIONS = [("colour", "en"), ("shape", "zh"), ("count", "en"), ("digit", "zh"), ("position", "en")]


def keep_evals(summary: dict, args: argparse.Namespace) -> None:
    """Stores the given evaluation files' results in the summary (and so in training_summary.json)."""
    evals = summary.setdefault("finetune", {}).setdefault("evals", {})
    if args.tool_eval:
        evals["tools"] = json.loads(Path(args.tool_eval).read_text())["summary"]
    if args.vision_eval:
        result = json.loads(Path(args.vision_eval).read_text())
        evals["vision"] = {mode: {"accuracy": r["accuracy"], "by_kind": r["by_kind"]}
                           for mode, r in result["modes"].items()}
    for key, path in (("ppl_base", args.ppl_base), ("ppl_tuned", args.ppl_tuned)):
        if path:
            evals[key] = json.loads(Path(path).read_text())


def finetune_lines(summary: dict, cfg: ModelConfig) -> list[str]:
    ft = summary.get("finetune")
    if not ft:
        return []
    v = cfg.vision
    lines = [
        "",
        "## Fine-tune: tools and pictures",
        "",
        f"`scripts/finetune_demo.py`: {ft['train_minutes']} minutes on {ft['threads']} threads, {ft['steps']} "
        f"steps, {ft['tokens_seen'] / 1e6:.1f}M tokens, from the text checkpoint above, with a new vision tower "
        f"({summary['vision_parameters'] / 1e6:.2f}M parameters: {v.depth} blocks of width {v.hidden_size}, "
        f"{v.num_heads} heads, {v.patch_size}x{v.patch_size} patches over {v.temporal_patch_size} frames, "
        f"{v.spatial_merge_size}x{v.spatial_merge_size} merge; any picture is shrunk to at most 128x128 pixels, "
        "16 merged tokens). Each step draws replayed corpus windows, tool-use conversations "
        "(`scripts/corpus/gen_tools.py`) and picture questions (`scripts/corpus/gen_vision.py`), each group's "
        "mean loss weighted the same; the loss counts the assistant's output only in conversations and pictures; "
        "the MTP head trains on the same targets. AdamW, bf16 autocast, cosine to a tenth of the peak, in "
        f"{len(ft.get('runs', [ft]))} run(s), the later ones continuing the earlier:",
        "",
    ]
    for r in ft.get("runs", [ft]):
        p, loss = r["per_step"], r["heldout_loss"]
        # the city drill (--city-calls-per-step): weather / time questions' first turns, the call alone
        drill = f" + {p['city_calls']} city-argument calls" if p.get("city_calls") else ""
        drill_loss = f", city-argument calls {loss['city']}" if drill else ""
        lines.append(f"- {r['train_minutes']} minutes, {r['steps']} steps of {p['text']} windows of "
                     f"{r['text_window']} tokens + {p['tools']} conversations + {p['vision']} pictures{drill}; "
                     f"peak learning rate {r['lr']} ({r['tower_lr']} for the tower); held-out loss of the targets "
                     f"at the end: text {loss['text']}, tools {loss['tool']}, pictures {loss['vision']}{drill_loss}.")
    evals = ft.get("evals", {})
    if "tools" in evals:
        t = evals["tools"]
        lines += [
            "",
            "### Tool calls (held out)",
            "",
            "`scripts/eval_demo_tools.py`: held-out questions (a tenth of the generator's questions never trained "
            "on), greedy, through the engine and the server's `qwen3_coder` parser. *call made*, *right name*, "
            "*right arguments* (every argument, typed): questions whose tool is offered among 1-4 tools; *answer* "
            "(after the right call and the tool's result, the answer repeats the result's values); *no call*: "
            "questions no offered tool fits.",
            "",
            "| questions | call made | right name | right arguments | answer from the result | no call |",
            "|---|---|---|---|---|---|",
        ]
        for row in TOOL_ROWS:
            if row in t:
                cells = [f"{t[row][m]['rate']:.2f} ({t[row][m]['n']})" if m in t[row] else "-" for m in TOOL_METRICS]
                lines.append(f"| {row} | " + " | ".join(cells) + " |")
    if "vision" in evals:
        lines += [
            "",
            "### Pictures (held out)",
            "",
            "`scripts/eval_demo_vision.py`: held-out scenes (their rounded parameters never drawn in training), "
            "greedy; an answer is right when it names the expected value and no other.",
            "",
            "| thinking | all | " + " | ".join(f"{k} en / zh" for k in gen_vision.KINDS) + " |",
            "|---|---|" + "---|" * len(gen_vision.KINDS),
        ]
        for mode, r in evals["vision"].items():
            cells = [" / ".join("-" if r["by_kind"][k][lang] is None else f"{r['by_kind'][k][lang]:.2f}"
                                for lang in gen_vision.LANGS) for k in gen_vision.KINDS]
            lines.append(f"| {mode} | {r['accuracy']:.2f} | " + " | ".join(cells) + " |")
    if "ppl_base" in evals and "ppl_tuned" in evals:
        base, tuned = evals["ppl_base"], evals["ppl_tuned"]
        lines += [
            "",
            "### What the text model kept",
            "",
            "`deltaserve eval ppl` on the demo's held-out text (`heldout.jsonl`), before and after the fine-tune:",
            "",
            "| source | perplexity before | after |",
            "|---|---|---|",
        ]
        after = {s["source"]: s for s in tuned["sources"]}
        for s in base["sources"]:
            lines.append(f"| {s['source']} | {s['perplexity']:.2f} | {after[s['source']]['perplexity']:.2f} |")
        lines.append(f"| **all** | **{base['perplexity']:.2f}** | **{tuned['perplexity']:.2f}** |")
    return lines


def sample_lines(llm: LLM) -> list[str]:
    """A tool call and its answer, and questions about generated pictures (greedy)."""
    greedy = SamplingParams(max_tokens=80, temperature=0)
    lines = ["", "Tools (greedy, thinking off, a get_weather tool offered):", ""]
    for question in ["What's the weather like in Paris?", "东京天气怎么样？"]:
        messages = [{"role": "user", "content": question}]
        out = llm.chat(messages, greedy, tools=[gen_tools.TOOLS["get_weather"]], use_tqdm=False,
                       chat_template_kwargs={"enable_thinking": False})[0].outputs[0].text
        lines.append(f"- **{question}** → {out.strip()!r}")
    lines += ["", "Pictures (held-out scenes, greedy, thinking off):", ""]
    for i, (kind, lang) in enumerate(PICTURE_QUESTIONS):
        ex = gen_vision.sample(random.Random(i), "heldout", kind, lang)
        messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": ex.image},
                                                 {"type": "text", "text": ex.question}]}]
        out = llm.chat(messages, greedy, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
        lines.append(f"- ({kind}, expected {ex.expected!r}) **{ex.question}** → {out[0].outputs[0].text.strip()!r}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool-eval", help="scripts/eval_demo_tools.py --json output")
    ap.add_argument("--vision-eval", help="scripts/eval_demo_vision.py --json output")
    ap.add_argument("--ppl-base", help="`deltaserve eval ppl --json` of the text checkpoint before the fine-tune")
    ap.add_argument("--ppl-tuned", help="the same of the fine-tuned checkpoint")
    args = ap.parse_args()
    torch.set_num_threads(2)
    summary = json.loads((DEMO_DIR / "training_summary.json").read_text())
    keep_evals(summary, args)
    (DEMO_DIR / "training_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    cfg = ModelConfig.from_file(DEMO_DIR)
    llm = LLM(max_model_len=1024)
    greedy = SamplingParams(max_tokens=80, temperature=0)
    sampled = SamplingParams(max_tokens=80, temperature=0.7, top_p=0.9, seed=1)
    lines = [
        "# deltaserve demo checkpoint",
        "",
        "A small bilingual (English / Chinese) model with the Qwen3.5-27B structure scaled down, trained on "
        "2 CPU cores by `scripts/train_demo.py` on the corpus of `scripts/build_corpus.py` "
        "(sources and licences: `docs/data_card.md`). It exists so that every deltaserve command works with "
        "no download; it is a toy, not a useful assistant: expect fluent-looking but often wrong text.",
        "",
        "## Shape",
        "",
        f"- {summary['parameters'] / 1e6:.2f}M parameters ({summary['mtp_parameters'] / 1e6:.2f}M of them "
        "the MTP head" + (f", {summary['vision_parameters'] / 1e6:.2f}M the vision tower" if cfg.vision else "")
        + "); stored in bf16 (`model.safetensors`, official layout: `model.language_model.*`, "
        + ("`model.visual.*`, " if cfg.vision else "") + "`mtp.*`, `lm_head.weight`), run in fp32 by default.",
        f"- hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, {cfg.num_hidden_layers} layers "
        f"`{'/'.join('GDN' if t == 'linear_attention' else 'ATT' for t in cfg.layer_types)}`; "
        f"attention {cfg.num_attention_heads} query heads / {cfg.num_key_value_heads} KV head of "
        f"{cfg.head_dim}, partial rotary {cfg.partial_rotary_factor}; GDN {cfg.linear_num_key_heads} key / "
        f"{cfg.linear_num_value_heads} value heads of {cfg.linear_key_head_dim}/{cfg.linear_value_head_dim}; "
        f"vocabulary {cfg.vocab_size} (byte-level BPE); untied lm_head; one MTP layer.",
        "",
        "## Training",
        "",
        f"- {summary['train_minutes']} minutes on {summary['threads']} threads, {summary['steps']} steps of "
        f"{summary['batch']}x{summary['length']} tokens = {summary['tokens_seen'] / 1e6:.1f}M tokens "
        "(bf16 autocast, AdamW, cosine schedule); trunk loss + 0.5 x MTP loss"
        + (" (the text model; then the fine-tune below)." if summary.get("finetune") else "."),
        "",
        "## Held-out results",
        "",
        ("Of the text model before the fine-tune (its effect on the text is measured below). " if
         summary.get("finetune") else "")
        + "Cross-entropy (nats/token) on held-out documents of each source; `MTP agreement` is how often the MTP "
        "head's greedy draft for token t+2 equals the trunk's greedy prediction at t+1 (the expected "
        "acceptance rate of a 1-token greedy draft).",
        "",
        "| source | trunk loss | MTP loss | MTP agreement |",
        "|---|---|---|---|",
    ]
    for name, r in summary["heldout"].items():
        lines.append(f"| {name} | {r['loss']:.3f} | {r['mtp_loss']:.3f} | {r['mtp_agreement']:.3f} |")
    lines += [f"| **mean** | | | **{summary['mtp_agreement_mean']:.3f}** |"]
    lines += finetune_lines(summary, cfg)
    lines += ["", "## Samples", ""]
    lines += ["Greedy continuations (`deltaserve generate`, temperature 0, 80 tokens):", ""]
    for prompt, out in zip(TEXT_PROMPTS, llm.generate(TEXT_PROMPTS, greedy, use_tqdm=False)):
        lines += [f"- **{prompt}** → {out.outputs[0].text.strip()!r}"]
    lines += ["", "Chat (temperature 0.7, top_p 0.9, seed 1), with and without thinking:", ""]
    for question, thinking in CHATS:
        out = llm.chat([{"role": "user", "content": question}], sampled,
                       chat_template_kwargs={"enable_thinking": thinking})[0].outputs[0].text
        lines += [f"- *{'thinking' if thinking else 'no thinking'}* **{question}** → {out.strip()!r}"]
    if cfg.vision is not None:
        lines += sample_lines(llm)
    lines.append("")
    (DEMO_DIR / "README.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
