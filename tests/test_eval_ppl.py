"""`deltaserve eval ppl`: the demo's held-out perplexity, held to a direct computation with transformers on the
same checkpoint and the tokenizer's own encoding; bad input gets a clear error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from deltaserve.assets import DEMO_DIR
from deltaserve.cli import main
from deltaserve.cli_eval import DEMO_HELDOUT

pytestmark = pytest.mark.skipif(
    not (DEMO_DIR / "model.safetensors").exists(), reason="demo checkpoint not built (scripts/train_demo.py)"
)
WINDOW = 64  # shorter than most held-out documents, so the windowing is exercised


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(["eval", "ppl", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@torch.inference_mode()
def reference(window: int) -> dict[str, tuple[int, float]]:
    """{source: (scored tokens, summed NLL)} from transformers' forward, each window alone."""
    from tokenizers import Tokenizer
    from transformers import AutoConfig, Qwen3_5ForCausalLM

    tok = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    cfg = AutoConfig.from_pretrained(DEMO_DIR)
    model = Qwen3_5ForCausalLM.from_pretrained(DEMO_DIR, config=cfg.text_config, dtype=torch.float32).eval()
    sums: dict[str, tuple[int, float]] = {}
    for line in DEMO_HELDOUT.read_text(encoding="utf-8").splitlines():
        doc = json.loads(line)
        ids = tok.encode(doc["text"], add_special_tokens=False).ids
        for start in range(0, len(ids), window):
            piece = torch.tensor(ids[start : start + window])
            if len(piece) < 2:
                continue
            logits = model(piece[None]).logits[0].float()
            nll = torch.nn.functional.cross_entropy(logits[:-1], piece[1:], reduction="sum").item()
            n, total = sums.get(doc["source"], (0, 0.0))
            sums[doc["source"]] = (n + len(piece) - 1, total + nll)
    return sums


def test_demo_heldout_perplexity_equals_a_direct_torch_computation(capsys: pytest.CaptureFixture) -> None:
    rc, out, _ = run_cli(capsys, "--window", str(WINDOW), "--json")
    assert rc == 0
    result = json.loads(out)
    ref = reference(WINDOW)
    assert math.isfinite(result["perplexity"]) and result["perplexity"] > 1
    assert result["tokens"] == sum(n for n, _ in ref.values())
    assert result["windows"] > result["documents"] == 96  # 16 documents of each of 6 generated sources
    ref_ppl = math.exp(sum(s for _, s in ref.values()) / result["tokens"])
    assert result["perplexity"] == pytest.approx(ref_ppl, rel=1e-4)
    for s in result["sources"]:
        n, total = ref[s["source"]]
        assert s["tokens"] == n
        assert s["perplexity"] == pytest.approx(math.exp(total / n), rel=1e-4)


def test_table_output_and_a_plain_text_file(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    text = tmp_path / "story.txt"
    text.write_text("Once upon a time, a little fox named Oliver woke up early and walked to the lake.")
    rc, out, _ = run_cli(capsys, "--text", str(text))
    assert rc == 0
    rows = out.splitlines()
    assert rows[0].split() == ["source", "docs", "tokens", "nll/token", "perplexity"]
    assert rows[1].split()[:2] == ["story.txt", "1"] and rows[-1].split()[:2] == ["all", "1"]
    assert math.isfinite(float(rows[-1].split()[-1]))


@pytest.mark.parametrize(
    ("content", "argv", "message"),
    [
        (None, (), "text file not found"),
        ('{"text": "fine"}\nnot json\n', (), "line 2 is not JSON"),
        ('{"source": "x"}\n', (), 'line 1 has no "text" string'),
        ('{"text": "a short story"}\n', ("--window", "1"), "at least 2 tokens"),
        ('{"text": "a short story"}\n', ("--window", "100000"), "--window 100000 is longer than the model's"),
        ('{"text": "a short story"}\n', ("--quantization", "int3"), "int3"),
    ],
)
def test_bad_input_is_a_clear_error(capsys: pytest.CaptureFixture, tmp_path: Path, content: str | None,
                                    argv: tuple[str, ...], message: str) -> None:
    path = tmp_path / "docs.jsonl"
    if content is not None:
        path.write_text(content)
    rc, out, err = run_cli(capsys, "--text", str(path), *argv)
    assert rc == 2 and out == ""
    assert message in err and err.splitlines()[-1].split("\r")[-1].startswith("deltaserve eval: error:")
