#!/usr/bin/env python3
"""Train the demo model's byte-level BPE tokenizer and write deltaserve/assets/demo/.

    .venv/bin/python scripts/train_tokenizer.py          # after scripts/build_corpus.py
    .venv/bin/python scripts/train_tokenizer.py --verify-only

Qwen2-style: NFC normalizer, Qwen2 split regex + ByteLevel(use_regex=False), ByteLevel
decoder.  8192 ids in total: 8174 BPE ids (0..8173), then the 18 added tokens in the
order below.  <tool_call>, </tool_call>, <think>, </think> are added with special=False
(as in Qwen3), so they survive skip_special_tokens decoding.  The script also measures
compression on the held-out split, records token counts in data/corpus/manifest.json,
and checks the chat template (transformers AutoTokenizer vs tokenizers + jinja2).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corpus import chat  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "deltaserve", "assets", "demo")
CORPUS = os.path.join(ROOT, "data", "corpus")
VOCAB_SIZE = 8192
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
            "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
NON_SPECIAL = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
ADDED = SPECIALS + NON_SPECIAL
MODEL_MAX_LENGTH = 4096
SAMPLE_BYTES = 12_000_000
GEN_DOWNWEIGHT = 0.4
MAX_TOKEN_LENGTH = 15  # byte-level chars: at most 5 CJK characters per token


def read_docs(split, name):
    with open(os.path.join(CORPUS, split, f"{name}.jsonl"), encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def training_sample(manifest, total=SAMPLE_BYTES, seed=0):
    """Weighted sample of the train split; chat markup strings are removed (they are added tokens)."""
    r = random.Random(seed)
    # templated generated text is down-weighted so the vocabulary is not spent on its stock phrases
    w = {n: s["weight"] * (GEN_DOWNWEIGHT if n.startswith("gen_") else 1.0) for n, s in manifest["sources"].items()}
    for name, s in manifest["sources"].items():
        budget = total * w[name] / sum(w.values())
        have = s["train"]["bytes"]
        keep = min(1.0, budget / max(have, 1))
        got = 0
        for d in read_docs("train", name):
            if r.random() > keep:
                continue
            for t in ADDED:
                d = d.replace(t, "\n" if t in ("<|im_end|>", "<|im_start|>") else "")
            got += len(d.encode())
            yield d
        # small sources get repeated up to their budget share (at most 3x)
        reps = 1
        while got < budget and reps < 3 and have > 0:
            for d in read_docs("train", name):
                for t in ADDED:
                    d = d.replace(t, "\n")
                got += len(d.encode())
                yield d
                if got >= budget:
                    break
            reps += 1


def train(manifest):
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(ADDED), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
                                  max_token_length=MAX_TOKEN_LENGTH)
    tok.train_from_iterator(training_sample(manifest), trainer=trainer)
    n = tok.get_vocab_size()
    assert n == VOCAB_SIZE - len(ADDED), n
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL])
    assert tok.get_vocab_size() == VOCAB_SIZE
    return tok


def write_config(tok):
    added = {}
    for t in ADDED:
        i = tok.token_to_id(t)
        added[str(i)] = {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": t in SPECIALS}
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIALS if t not in ("<|endoftext|>", "<|im_end|>")],
        "bos_token": None,
        "chat_template": chat.CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    with open(os.path.join(OUT, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=2)
        f.write("\n")
    stm = {"additional_special_tokens": cfg["additional_special_tokens"], "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>"}
    with open(os.path.join(OUT, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(stm, f, ensure_ascii=False, indent=2)
        f.write("\n")


def measure(tok, manifest):
    """Token counts per source (train+heldout) and held-out compression by language."""
    import unicodedata

    comp = {"en": [0, 0, 0], "zh": [0, 0, 0]}  # bytes, chars, tokens on held-out natural+generated text
    for name, s in manifest["sources"].items():
        ntok = 0
        for split in ("heldout", "train"):
            docs = list(read_docs(split, name))
            encs = tok.encode_batch(docs, add_special_tokens=False)
            n = sum(len(e.ids) for e in encs)
            s[split]["tokens"] = n
            ntok += n
            if split == "heldout" and s["format"] == "text":
                c = comp[s["lang"]]
                c[0] += sum(len(d.encode()) for d in docs)
                c[1] += sum(len(unicodedata.normalize("NFC", d)) for d in docs)
                c[2] += n
        s["tokens"] = ntok
        print(f"  {name:14s} {ntok:10,d} tokens  {s['train']['bytes'] / max(s['train']['tokens'], 1):.2f} B/tok "
              f"{s['train']['chars'] / max(s['train']['tokens'], 1):.2f} ch/tok",
              file=sys.stderr)
    res = {lang: {"bytes_per_token": round(b / t, 3), "chars_per_token": round(c / t, 3), "tokens": t}
           for lang, (b, c, t) in comp.items() if t}
    # Chinese-only characters per token on generated + poem held-out text, ignoring nothing
    manifest["tokenizer"] = {"vocab_size": VOCAB_SIZE, "heldout_compression_text_sources": res,
                             "added_token_ids": {t: tok.token_to_id(t) for t in ADDED}}
    tot = sum(s["tokens"] for s in manifest["sources"].values())
    manifest["total_tokens"] = tot
    for s in manifest["sources"].values():
        s["epochs_at_10M_tokens"] = round(1e7 * s["weight"] / max(s["train"]["tokens"], 1), 2)
    return res


def verify():
    """AutoTokenizer(apply_chat_template) == tokenizers + jinja2; expected strings for generation prompts."""
    import jinja2  # noqa: F401
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(OUT, local_files_only=True)
    raw = Tokenizer.from_file(os.path.join(OUT, "tokenizer.json"))
    cases = [
        [{"role": "user", "content": "What is 2 + 3?"}],
        [{"role": "system", "content": "你是一个乐于助人的助手。"}, {"role": "user", "content": "法国的首都是哪里？"}],
        [{"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "<think>\nGreeting.\n</think>\n\nHello! How can I help?"},
         {"role": "user", "content": "Count to 3."}],
        [{"role": "user", "content": "Count to 3."},
         {"role": "assistant", "content": "1, 2, 3.", "reasoning_content": "Start at 1 and add one."}],
    ]
    exp = {
        (0, True): "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n<think>\n",
        (0, False): "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        (2, True): "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
                   "<|im_start|>user\nCount to 3.<|im_end|>\n<|im_start|>assistant\n<think>\n",
    }
    ok = True
    for i, msgs in enumerate(cases):
        for think in (True, False):
            gen = msgs[-1]["role"] != "assistant"
            kw = {} if think else {"enable_thinking": False}
            s_hf = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kw)
            s_j2 = chat.render(msgs, add_generation_prompt=gen, **kw)
            ids_hf = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, **kw)
            if isinstance(ids_hf, dict) or hasattr(ids_hf, "keys"):
                ids_hf = ids_hf["input_ids"]
            ids_raw = raw.encode(s_j2, add_special_tokens=False).ids
            good = s_hf == s_j2 and list(ids_hf) == ids_raw and raw.decode(ids_raw, skip_special_tokens=False) == s_j2
            if (i, think) in exp:
                good = good and s_hf == exp[(i, think)]
            ok &= good
            print(f"  case {i} thinking={think}: {'OK' if good else 'MISMATCH'} ({len(ids_raw)} tokens)", file=sys.stderr)
            if not good:
                print(repr(s_hf), repr(s_j2), ids_hf, ids_raw, sep="\n", file=sys.stderr)
    want = ("<|im_start|>user\nCount to 3.<|im_end|>\n<|im_start|>assistant\n<think>\nStart at 1 and add one.\n"
            "</think>\n\n1, 2, 3.<|im_end|>\n")
    ok &= chat.render(cases[3]) == want
    # each added token is one id; <think> survives skip_special_tokens, <|im_end|> does not
    for t in ADDED:
        assert raw.encode(t, add_special_tokens=False).ids == [raw.token_to_id(t)], t
    ids = raw.encode("<think>\nx\n</think>\n\ny<|im_end|>", add_special_tokens=False).ids
    assert hf.decode(ids, skip_special_tokens=True) == "<think>\nx\n</think>\n\ny", hf.decode(ids, skip_special_tokens=True)
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>", (hf.eos_token, hf.pad_token)
    assert len(hf) == VOCAB_SIZE, len(hf)
    print(f"verify: {'all OK' if ok else 'FAILED'} ({type(hf).__name__})", file=sys.stderr)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verify-only", action="store_true")
    args = ap.parse_args()
    if not args.verify_only:
        man_path = os.path.join(CORPUS, "manifest.json")
        manifest = json.load(open(man_path, encoding="utf-8"))
        os.makedirs(OUT, exist_ok=True)
        tok = train(manifest)
        tok.save(os.path.join(OUT, "tokenizer.json"))
        write_config(tok)
        res = measure(tok, manifest)
        with open(man_path, "w", encoding="utf-8") as f:
            json.dump(manifest, f, ensure_ascii=False, indent=1)
        print(f"compression (held-out text sources): {json.dumps(res)}", file=sys.stderr)
        print("added token ids:", {t: tok.token_to_id(t) for t in ADDED}, file=sys.stderr)
    sys.exit(0 if verify() else 1)


if __name__ == "__main__":
    main()
