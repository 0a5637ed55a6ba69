"""Write the demo checkpoint's model card (deltaserve/assets/demo/README.md) from its training summary and
fresh samples generated with deltaserve itself.

    python scripts/demo_card.py
"""

from __future__ import annotations

import json

import torch

from deltaserve import LLM, SamplingParams
from deltaserve.assets import DEMO_DIR
from deltaserve.config import ModelConfig

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


def main() -> None:
    torch.set_num_threads(2)
    summary = json.loads((DEMO_DIR / "training_summary.json").read_text())
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
        "the MTP head); stored in bf16 (`model.safetensors`, official layout: `model.language_model.*`, "
        "`mtp.*`, `lm_head.weight`), run in fp32 by default.",
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
        "(bf16 autocast, AdamW, cosine schedule); trunk loss + 0.5 x MTP loss.",
        "",
        "## Held-out results",
        "",
        "Cross-entropy (nats/token) on held-out documents of each source; `MTP agreement` is how often the MTP "
        "head's greedy draft for token t+2 equals the trunk's greedy prediction at t+1 (the expected "
        "acceptance rate of a 1-token greedy draft).",
        "",
        "| source | trunk loss | MTP loss | MTP agreement |",
        "|---|---|---|---|",
    ]
    for name, r in summary["heldout"].items():
        lines.append(f"| {name} | {r['loss']:.3f} | {r['mtp_loss']:.3f} | {r['mtp_agreement']:.3f} |")
    lines += [f"| **mean** | | | **{summary['mtp_agreement_mean']:.3f}** |", "", "## Samples", ""]
    lines += ["Greedy continuations (`deltaserve generate`, temperature 0, 80 tokens):", ""]
    for prompt, out in zip(TEXT_PROMPTS, llm.generate(TEXT_PROMPTS, greedy, use_tqdm=False)):
        lines += [f"- **{prompt}** → {out.outputs[0].text.strip()!r}"]
    lines += ["", "Chat (temperature 0.7, top_p 0.9, seed 1), with and without thinking:", ""]
    for question, thinking in CHATS:
        out = llm.chat([{"role": "user", "content": question}], sampled,
                       chat_template_kwargs={"enable_thinking": thinking})[0].outputs[0].text
        lines += [f"- *{'thinking' if thinking else 'no thinking'}* **{question}** → {out.strip()!r}"]
    lines.append("")
    (DEMO_DIR / "README.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
