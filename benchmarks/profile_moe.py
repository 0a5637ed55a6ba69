"""Where a MoE decode step's MLP time goes (not a test): one layer of bench_moe's shape (hidden 1024, 128 experts
of width 256, top-8, shared expert 256) at one row, in each weight format, through the fused step's kernels
alone (the extension's moe_mlp and linear): the whole block, then its parts one by one, beside the dense MLP of
the same active width (8 x 256 + 256 = 2304).

    .venv/bin/python benchmarks/profile_moe.py [--formats bf16,int8,int4] [--threads 1] [--repeats 200]
        [--checkout DIR] [--json]

int8 and int4 read int8 activations (the engine's default for them: activation_quantization "int8").
--checkout DIR profiles another checkout's extension (DIR's deltaserve; give it its own TORCH_EXTENSIONS_DIR),
--json prints the medians as one JSON line: benchmarks/ab_moe.py alternates two checkouts this way.

Parts: the router with the shared expert's gate / up and its gate (one fused projection, as the stack holds
them), the shared expert's down projection, and the 8 chosen experts' gate|up and down projections called one
by one (the experts a row picks; their outputs not combined). The block's time minus its parts is what the
block adds around them: routing (softmax, top-k), the gather of rows, per-expert allocations, the SwiGLU and
the weighted sum. Median microseconds of --repeats calls each, the parts interleaved."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
if "--checkout" in sys.argv:  # (before the imports below: they take deltaserve from there)
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--checkout") + 1]).resolve()))
else:
    sys.path.insert(0, str(ROOT))

from bench_moe import DENSE_WIDTH, EXPERTS, HIDDEN  # noqa: E402

from deltaserve.ops.formats import WeightFormat, quantize  # noqa: E402
from deltaserve.ops.fused_ext import load_extension  # noqa: E402

STORED = {"bf16": "bfloat16", "int8": "int8", "int4": "int4"}
ACTIVATIONS = {"bf16": "none", "int8": "int8", "int4": "int8"}


def stored(w: torch.Tensor, fmt: WeightFormat) -> tuple:
    data, scale = quantize(w, fmt)
    return data, scale, fmt.name, fmt.group


def part(spec: tuple, e: int) -> tuple:
    """Expert e's 2-D slice of a 3-D stored tensor."""
    data, scale, name, group = spec
    return data[e], None if scale is None else scale[e], name, group


def profile(ext, fmt_name: str, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    H, E, k = HIDDEN, EXPERTS["num_experts"], EXPERTS["num_experts_per_tok"]
    I, Is = EXPERTS["moe_intermediate_size"], EXPERTS["shared_expert_intermediate_size"]
    fmt = WeightFormat.of(STORED[fmt_name])
    aq = ACTIVATIONS[fmt_name]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    router = (rand(E, H) * 8, None, "float32", 0)  # kept in the activation dtype, as the loader does
    router_shared = [router, stored(rand(Is, H), fmt), stored(rand(Is, H), fmt), (rand(1, H), None, "float32", 0)]
    shared_down = stored(rand(H, Is), fmt)
    gate_up, down = stored(rand(E, 2 * I, H), fmt), stored(rand(E, H, I), fmt)
    dense_gate_up, dense_down = stored(rand(2 * DENSE_WIDTH, H), fmt), stored(rand(H, DENSE_WIDTH), fmt)
    x = torch.randn(1, H, generator=g)
    act, shared_act = torch.randn(1, I, generator=g), torch.randn(1, Is, generator=g)
    chosen = torch.topk(x @ router[0].T, k).indices[0].tolist()
    dense_act = torch.randn(1, DENSE_WIDTH, generator=g)

    def dense() -> None:
        ext.linear(x, [dense_gate_up], aq)
        ext.linear(dense_act, [dense_down], aq)

    calls: dict[str, Callable[[], object]] = {
        "MoE block (moe_mlp)": lambda: ext.moe_mlp(x, router_shared, shared_down, gate_up, down, k, True, aq),
        # The binding wraps all E experts' weights on every call (the stack does it once, at load): the same
        # call on 0 rows is that, and is taken out of the block below.
        "binding's setup (moe_mlp on 0 rows)": lambda: ext.moe_mlp(x[:0], router_shared, shared_down, gate_up, down,
                                                                  k, True, aq),
        "router + shared gate/up projection": lambda: ext.linear(x, router_shared, aq),
        "shared down projection": lambda: ext.linear(shared_act, [shared_down], aq),
        f"{k} experts' gate|up projections": lambda: [ext.linear(x, [part(gate_up, e)], aq) for e in chosen],
        f"{k} experts' down projections": lambda: [ext.linear(act, [part(down, e)], aq) for e in chosen],
        f"dense MLP (width {DENSE_WIDTH}): gate|up + down": dense,
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in calls.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    out = {name: 1e6 * statistics.median(ts) for name, ts in times.items()}
    parts = [n for n in calls if not n.startswith(("MoE block", "dense"))]
    out["block minus its parts (routing, gather, per-expert overhead, SwiGLU, sum)"] = (
        out["MoE block (moe_mlp)"] - sum(out[n] for n in parts))
    out["MoE block without the binding's setup"] = out["MoE block (moe_mlp)"] - out[parts[0]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", type=lambda s: s.split(","), default=list(STORED))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--checkout", help="profile this checkout's extension (see above)")
    ap.add_argument("--json", action="store_true", help="print {format: {part: median us}} as one JSON line")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = load_extension()
    columns = {fmt: profile(ext, fmt, args.repeats) for fmt in args.formats}
    if args.json:
        print(json.dumps(columns))
        return
    rows = list(next(iter(columns.values())))
    print(f"median microseconds per call, 1 row, {args.threads} thread(s)\n")
    print("| part | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for row in rows:
        print(f"| {row} | " + " | ".join(f"{col[row]:.1f}" for col in columns.values()) + " |")


if __name__ == "__main__":
    main()
