"""Which parameter (or part of one) each checkpoint tensor fills, for the layouts that do not map one tensor
to one parameter:

- MoE experts, one tensor per expert (`<mlp>.experts.N.gate_proj.weight`, `up_proj`, `down_proj`): expert
  N's gate rows [:I] or up rows [I:] of `<mlp>.experts.gate_up_proj` [E, 2I, H], or `down_proj[N]`.
  The fused 3-D tensors of the bf16 releases are those parameters themselves.
- Qwen3-Next's fused GDN projections. transformers' Qwen3NextGatedDeltaNet.fix_query_key_value_ordering
  reads in_proj_qkvz's rows as [Hk, 2*dk + 2*r*dv] (r = Hv / Hk): per key head g its query, its key, then
  the values and the z gates of its r value heads; in_proj_ba's rows as [Hk, 2r]: the r betas, then the r
  a's. Value head j = g*r + i, so regrouping per kind gives in_proj_qkv (all q | all k | all v, head
  major), in_proj_z, in_proj_b and in_proj_a exactly as Qwen3.5 stores them, and the conv1d channels
  (q | k | v, the order both models convolve) need no change.

Names here are parameter names (after loader.map_name removed the wrapper prefix)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from deltaserve.config import Architecture, ModelConfig

PER_EXPERT = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
EXPERT_PARAMS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
QKVZ, BA = ".linear_attn.in_proj_qkvz.weight", ".linear_attn.in_proj_ba.weight"
HALVES = ("gate", "up")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: names the tensor or file at fault."""


@dataclass(frozen=True, slots=True)
class Target:
    """A parameter, or one expert of a 3-D expert parameter (and for gate_up_proj its gate or up half)."""

    param: str
    expert: int | None = None
    half: int | None = None  # 0 gate rows, 1 up rows of gate_up_proj

    def describe(self) -> str:
        if self.expert is None:
            return self.param
        return f"{self.param}[{self.expert}]" + ("" if self.half is None else f" ({HALVES[self.half]} rows)")

    def checkpoint_name(self) -> str:
        """The per-expert checkpoint name that fills this part (for naming what is missing)."""
        if self.expert is None:
            return self.param
        experts = self.param.rsplit(".", 1)[0]
        proj = "down" if self.half is None else HALVES[self.half]
        return f"{experts}.{self.expert}.{proj}_proj.weight"


def targets(name: str, arch: Architecture | None) -> list[Target]:
    """What the checkpoint tensor `name` (a parameter-space name) fills, in the order split() gives."""
    m = PER_EXPERT.match(name)
    if m:
        e = int(m["e"])
        if m["proj"] == "down":
            return [Target(f"{m['experts']}.down_proj", e)]
        return [Target(f"{m['experts']}.gate_up_proj", e, HALVES.index(m["proj"]))]
    fused_gdn = arch is not None and arch.fused_gdn_projections
    if fused_gdn and name.endswith(QKVZ):
        base = name.removesuffix("qkvz.weight")
        return [Target(base + "qkv.weight"), Target(base + "z.weight")]
    if fused_gdn and name.endswith(BA):
        base = name.removesuffix("ba.weight")
        return [Target(base + "b.weight"), Target(base + "a.weight")]
    return [Target(name)]


def exists(t: Target, params: dict[str, torch.Tensor]) -> bool:
    """Whether the model has what t names (an expert index past num_experts does not)."""
    return t.param in params and (t.expert is None or t.expert < params[t.param].shape[0])


def split(name: str, tensor: torch.Tensor, cfg: ModelConfig, found: list[Target]) -> list[torch.Tensor]:
    """The checkpoint tensor cut into the pieces for `found` (= targets(name)), in that order."""
    if len(found) == 1:
        return [tensor]
    Hk, Hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    r = Hv // Hk
    widths = [dk, dk, r * dv, r * dv] if name.endswith(QKVZ) else [r, r]
    want = (Hk * sum(widths), cfg.hidden_size)
    if tuple(tensor.shape) != want:
        raise CheckpointError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want} from config.json "
            f"({Hk} key-head groups of {' + '.join(map(str, widths))} rows)"
        )
    parts = [p.reshape(-1, cfg.hidden_size) for p in tensor.view(Hk, sum(widths), -1).split(widths, dim=1)]
    if name.endswith(QKVZ):
        q, k, v, z = parts
        return [torch.cat([q, k, v]), z]
    return parts  # b, a


def view(param: torch.Tensor, t: Target) -> torch.Tensor:
    """The part of `param` that `t` names (a view to copy into)."""
    if t.expert is None:
        return param
    if t.half is None:
        return param[t.expert]
    inter = param.shape[1] // 2
    return param[t.expert, t.half * inter : (t.half + 1) * inter]


def coverage_problems(params: dict[str, torch.Tensor], found: Iterable[list[Target]]) -> list[str]:
    """What the checkpoint leaves unfilled (or fills in both expert layouts), as names to report."""
    filled: dict[str, set[Target]] = {}
    for ts in found:
        for t in ts:
            filled.setdefault(t.param, set()).add(t)
    problems = []
    for name, p in params.items():
        got = filled.get(name, set())
        if not name.endswith(EXPERT_PARAMS):
            if not got:
                problems.append(name)
            continue
        whole = Target(name)
        if whole in got:
            if len(got) > 1:
                problems.append(f"{name} (given both fused and per expert; use one layout)")
            continue
        if not got:
            problems.append(f"{name} (or per-expert {name.rsplit('.', 1)[0]}.N.*_proj.weight)")
            continue
        halves = (0, 1) if name.endswith("gate_up_proj") else (None,)
        need = [Target(name, e, h) for e in range(p.shape[0]) for h in halves]
        problems += [t.checkpoint_name() for t in need if t not in got]
    return problems
