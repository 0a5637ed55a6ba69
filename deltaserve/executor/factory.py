"""The one place that decides how steps run: the fused CPU executor where it can, the torch reference
executor otherwise, and a log line that says which and why."""

from __future__ import annotations

import logging

from deltaserve.executor.base import Executor
from deltaserve.executor.torch_executor import TorchExecutor
from deltaserve.model.context import CacheTensors
from deltaserve.model.decoder import Qwen3_5ForCausalLM
from deltaserve.ops.fused_ext import FusedBuildError

log = logging.getLogger(__name__)


def make_executor(
    model: Qwen3_5ForCausalLM, cache: CacheTensors, *, enforce_eager: bool = False, with_mtp: bool = False
) -> Executor:
    """with_mtp: speculative decoding will call mtp_hidden. A tensor-parallel rank's shard (model.shard) gets
    the same choice: the fused step then all-reduces through the rank's group."""
    from deltaserve.executor.fused_cpu import FusedCPUExecutor, supported

    shard = model.shard
    rank = f" on rank {shard.rank} of {shard.size}" if shard.size > 1 else ""
    if enforce_eager:
        log.info("executor%s: torch (enforce_eager)", rank)
        return TorchExecutor(model, cache)
    reason = supported(model, cache)
    if reason is not None:
        log.info("executor%s: torch, since %s (the fused step takes weights in any stored format, float32 "
                 "activations and GDN states, and a float32 or fp8 KV cache)", rank, reason)
        return TorchExecutor(model, cache)
    try:
        executor = FusedCPUExecutor(model, cache, with_mtp=with_mtp)
    except FusedBuildError as e:
        log.warning("executor%s: torch, since %s", rank, e)  # the error says what that costs
        return TorchExecutor(model, cache)
    if shard.size > 1:
        log.info("executor%s: fused-cpu (one C++ call per step on the rank's shard, all-reduces through gloo)",
                 rank)
    else:
        log.info("executor: fused-cpu (one C++ call per step)")
    return executor
