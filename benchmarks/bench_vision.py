"""Images: deltaserve vs transformers on one random checkpoint with the real Qwen3.5-0.8B vision tower (not a
test; timing decides nothing).

    .venv/bin/python benchmarks/bench_vision.py [--rounds 5] [--threads 2] [--dtype bfloat16 | --demo]
        [--quantization int8 | int4 | fp8] [--no-write]

The tower is the 0.8B's vision_config (deltaserve/engine/known_configs.py: depth 12, hidden 768, 12 heads,
MLP 3072, patch 16, merge 2), random; the text trunk is the ~60M random shape of bench_engine.py (hidden 512,
8 layers, the demo tokenizer's 8192 ids), projecting to it. Workloads, interleaved round by round (ours, then
theirs) in one process, torch.set_num_threads set explicitly for both:
- time to first token of one 448x448 picture (784 patches, 196 merged tokens) and a short question: PIL image
  in, one greedy token out (deltaserve LLM.generate with max_tokens 1; transformers' image processor and
  generate(max_new_tokens=1)), eager attention for transformers (its default SDPA is slower on this CPU);
- encoder tokens/s: the tower alone on that picture's pixels (merged tokens out per second); a round times
  enough calls back to back (the same number for both) to last about ENCODER_ROUND_S on transformers' side,
  so that a tower of a few ms (the demo's) is not timed one call at a time on a shared machine.
--dtype bfloat16 saves deltaserve's checkpoint in bf16, as the released ones are (its tower's projections run
bf16 dot products: deltaserve/executor/fused_cpu/vision.py); transformers runs the same (bf16-rounded) weights
in fp32, its first token is not required to match, and the towers' outputs agree to bf16's rounding.
--quantization has deltaserve quantize the (bf16) checkpoint at load, the tower's projections included
(fused_cpu/vision.py's fp32 scheme: int8 / int4 with int8 activations); transformers runs the bf16 weights in
fp32; the towers are compared by their relative RMS difference, reported, not asserted.
--demo runs the same workloads on the embedded demo checkpoint instead (its own 3-block tower, bf16 on disk, and
its processor, which shrinks the picture to 128x128: 64 patches, 16 merged tokens); transformers loads the same
files in fp32.
The median of the rounds goes into docs/benchmarks.md under "Vision vs transformers" (with --dtype bfloat16,
"Vision vs transformers, bf16 checkpoint"; with --demo, "Vision vs transformers, the demo")."""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_engine import RANDOM_SHAPE  # noqa: E402
from report import machine, write_section  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.assets import DEMO_DIR  # noqa: E402
from deltaserve.engine.known_configs import KNOWN_CONFIGS  # noqa: E402
from tests.checkpoints import mrope_section, randomize  # noqa: E402
from tests.vision_checkpoint import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, save_vision_checkpoint  # noqa: E402

SECTION = "## Vision vs transformers"
SIDE = 448
# The 0.8B's processor bounds (transformers' Qwen2-VL defaults): a 448x448 picture keeps its size.
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
}
ENCODER_ROUND_S = 0.1  # the least a round of encoder calls lasts (transformers'), seconds
QUESTION = [101, 102, 103, 104, 105, 106, 107, 108]  # "what colour is the square?"-sized: eight text tokens


def hf_model():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(RANDOM_SHAPE, vocab_size=8192)
    partial = text.pop("partial_rotary_factor")
    vision = {k: v for k, v in KNOWN_CONFIGS["qwen3.5-0.8b"]["vision_config"].items() if k != "model_type"}
    vision["out_hidden_size"] = text["hidden_size"]
    cfg = Qwen3_5Config(
        text_config=dict(
            **text, eos_token_id=8176, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                             "mrope_section": mrope_section(text["head_dim"], partial), "mrope_interleaved": True},
        ),
        vision_config=vision, image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
    )
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg).float().eval()
    randomize(model)
    with torch.no_grad():  # the tower's LayerNorm weights near 1
        for name, p in model.named_parameters():
            if name.startswith("model.visual.") and "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    return model


def picture() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8))


def clock(fn, calls: int = 1) -> float:
    """Seconds per call of fn, over `calls` calls back to back."""
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the dtype deltaserve's checkpoint is saved in (transformers runs fp32)")
    ap.add_argument("--demo", action="store_true", help="the embedded demo checkpoint instead of the random 0.8B tower")
    ap.add_argument("--quantization", choices=("int8", "int4", "fp8"), default=None,
                    help="deltaserve quantizes the bf16 checkpoint at load (implies --dtype bfloat16)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = picture()
    with tempfile.TemporaryDirectory() as tmp:
        bf16 = args.dtype == "bfloat16" or args.demo or args.quantization is not None
        if args.demo:  # bf16 on disk; transformers runs its numbers in fp32
            from transformers import Qwen3_5ForConditionalGeneration

            path = DEMO_DIR
            hf = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
        else:
            hf = hf_model()
            if bf16:  # transformers runs the bf16 checkpoint's own numbers, in fp32
                hf.to(torch.bfloat16).float()
            path = save_vision_checkpoint(copy.deepcopy(hf).to(torch.bfloat16) if bf16 else hf, Path(tmp) / "ck")
            (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
        preprocessor = json.loads((path / "preprocessor_config.json").read_text())
        preprocessor.pop("image_processor_type", None)
        llm = LLM(str(path), enable_prefix_caching=False, max_num_batched_tokens=1024, num_threads=args.threads,
                  quantization=args.quantization)
        executor = llm.engine.executor.name
        prompt = {"prompt_token_ids": [VISION_START, IMAGE_PAD, VISION_END, *QUESTION],
                  "multi_modal_data": {"image": [image]}}
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        processor = Qwen2VLImageProcessorPil(**preprocessor)

        def ours_ttft() -> list[int]:
            return llm.generate([prompt], one, use_tqdm=False)[0].outputs[0].token_ids

        def theirs_ttft() -> list[int]:
            proc = processor(images=[image], return_tensors="pt")
            n = int(proc["image_grid_thw"].prod()) // 4
            ids = torch.tensor([[VISION_START, *[IMAGE_PAD] * n, VISION_END, *QUESTION]])
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=proc["pixel_values"],
                              image_grid_thw=proc["image_grid_thw"], mm_token_type_ids=(ids == IMAGE_PAD).int(),
                              max_new_tokens=1, do_sample=False)
            return out[0, ids.shape[1]:].tolist()

        proc = processor(images=[image], return_tensors="pt")
        pixels, grid = proc["pixel_values"], proc["image_grid_thw"]
        merged = int(grid.prod()) // 4

        def ours_encode() -> torch.Tensor:
            return llm.engine.executor.encode_images(pixels, [tuple(grid[0].tolist())])

        def theirs_encode() -> torch.Tensor:
            return torch.cat(hf.model.get_image_features(pixels, grid).pooler_output)

        with torch.inference_mode():
            same = ours_ttft() == theirs_ttft()  # and a warm-up round
            assert same or bf16, "the first tokens differ"
            ours, theirs = ours_encode(), theirs_encode()
            rms = ((ours - theirs).pow(2).mean().sqrt() / theirs.pow(2).mean().sqrt()).item()
            if args.quantization is None:
                tol = 5e-2 * theirs.abs().max().item() if bf16 else 1e-3
                torch.testing.assert_close(ours, theirs, atol=tol, rtol=5e-2 if bf16 else 1e-3)
            print(f"first token {'the same' if same else 'differs'}; towers' max difference "
                  f"{(ours - theirs).abs().max().item():.2e}, relative RMS difference {rms:.3f}", flush=True)
            # encoder calls per round, from transformers' quickest of five calls (the load comes in bursts)
            calls = max(1, round(ENCODER_ROUND_S / min(clock(theirs_encode) for _ in range(5))))
            times: dict[str, list[float]] = {k: [] for k in ("ours_ttft", "theirs_ttft", "ours_enc", "theirs_enc")}
            for r in range(args.rounds):
                times["ours_ttft"].append(clock(ours_ttft))
                times["theirs_ttft"].append(clock(theirs_ttft))
                times["ours_enc"].append(clock(ours_encode, calls))
                times["theirs_enc"].append(clock(theirs_encode, calls))
                print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [
        ("time to first token, one 448x448 picture + 8 text tokens", f"{med['ours_ttft']:.3f} s",
         f"{med['theirs_ttft']:.3f} s", med["theirs_ttft"] / med["ours_ttft"]),
        (f"encoder tokens/s (the tower alone, {merged} merged tokens, {calls} call{'s' * (calls > 1)} a round)",
         f"{merged / med['ours_enc']:.0f}",
         f"{merged / med['theirs_enc']:.0f}", med["theirs_enc"] / med["ours_enc"]),
    ]
    table = "\n".join(f"| {w} | {o} | {t} | {x:.2f}x |" for w, o, t, x in rows)
    section = SECTION + (", the demo" if args.demo else f", {args.quantization} tower" if args.quantization
                         else ", bf16 checkpoint" if bf16 else "")
    checkpoint = ("deltaserve's checkpoint saved in bf16 (tower projections as bf16 dot products, or for a call of "
                  "at most 128x128 patch values in fp32 on the stored bf16 weights: fused_cpu/vision.py), "
                  "transformers fp32; towers agree to bf16 rounding" if bf16 else "same first token checked")
    if args.quantization:
        checkpoint = (f"deltaserve's checkpoint saved in bf16 and quantized to {args.quantization} at load (its "
                      "tower's projections too: the fp32 scheme of fused_cpu/vision.py, int8 activations for int8 / "
                      f"int4), transformers fp32 on the bf16 weights; the towers' outputs differ by {rms:.3f} "
                      f"relative RMS; first token {'the same' if same else 'differs'}")
    subject = ("The embedded demo checkpoint (3-block tower of width 128, bf16 on disk; its processor shrinks the "
               "picture to 128x128)" if args.demo else "A random checkpoint with the Qwen3.5-0.8B vision tower "
               "(depth 12, hidden 768, patch 16) in front of a ~60M random text trunk (bench_engine.py's shape)")
    flag = (" --demo" if args.demo else f" --quantization {args.quantization}" if args.quantization
            else " --dtype bfloat16" if bf16 else "")
    text = (
        f"{section}\n\n"
        f"`benchmarks/bench_vision.py --rounds {args.rounds} --threads {args.threads}"
        f"{flag}`, "
        f"{datetime.date.today().isoformat()}; {machine()}. {subject}; "
        f"deltaserve's {executor} executor, transformers {transformers.__version__} (eager attention, fp32), "
        f"`torch.set_num_threads({args.threads})` for both, rounds interleaved, medians; {checkpoint}. "
        "The machine is shared: read the ratios, not the absolute times.\n\n"
        "| workload | deltaserve | transformers | speed-up |\n|---|---|---|---|\n"
        f"{table}\n"
    )
    print(text)
    if not args.no_write:
        write_section(section, text)


if __name__ == "__main__":
    main()
