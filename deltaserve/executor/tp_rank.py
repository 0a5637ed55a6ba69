"""One tensor-parallel rank: what the driver tells every rank at startup (RankSpec), building the rank's
shard, cache and executor from it, and how a worker answers the driver's calls (RankWorker)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from deltaserve.cache.snapshots import SnapshotStore
from deltaserve.cache.tensors import allocate_cache
from deltaserve.executor.base import Executor
from deltaserve.executor.factory import make_executor
from deltaserve.executor.torch_executor import TorchExecutor
from deltaserve.executor.tp_protocol import Command, Message, cache_bytes, receive, unpack_step
from deltaserve.model.context import CacheTensors, ForwardContext
from deltaserve.model.decoder import Qwen3_5ForCausalLM
from deltaserve.model.loader import load_model
from deltaserve.model.parallel import Shard

log = logging.getLogger(__name__)

DTYPE_NAMES = {
    torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
    torch.float8_e4m3fn: "float8_e4m3fn",  # the fp8 KV cache
}


@dataclass(slots=True)
class RankSpec:
    """What every rank builds: the checkpoint, its dtype (load_model's: "auto" or a name) and weight options,
    the cache pools (sized by the driver from the per-rank config), the intra-op threads per rank, and
    whether the torch executor is forced."""

    model: str
    dtype: str
    with_mtp: bool
    num_blocks: int
    block_size: int
    num_slots: int
    kv_dtype: str
    threads: int
    enforce_eager: bool = False
    num_snapshots: int = 0  # GDN snapshot entries of prefix caching (0: off), the same on every rank
    weight_options: dict = field(default_factory=dict)  # load_model's quantization arguments

    def to_dict(self) -> dict:
        return asdict(self)


EXECUTOR_KINDS = ("torch", "fused-cpu")  # what a rank may run, by the executors' names


@dataclass(slots=True)
class Rank:
    """One rank's shard of the model, its cache (and GDN snapshots, with prefix caching), the executor that
    runs them, and every rank's executor name (in rank order, the same list on every rank)."""

    model: Qwen3_5ForCausalLM
    cache: CacheTensors
    snapshots: SnapshotStore | None
    executor: Executor
    executors: list[str]


def build_rank(spec: RankSpec, shard: Shard) -> Rank:
    """This rank's shard of the checkpoint, its cache (its KV heads, its GDN value heads; its GDN snapshot
    entries with prefix caching) and its executor,
    chosen by make_executor's rule (the fused step for fp32 unless enforce_eager; it logs why not). Every
    rank then learns what each runs (a collective: every rank calls this at startup). The ranks must all run
    the same one: their collectives pair up by order and shape, and the two executors differ there (the fused
    step's last layer all-reduces only output_rows), so where one rank could not build the fused step (its
    compiler failed, say) every rank runs the torch executor."""
    model = load_model(spec.model, spec.dtype, with_mtp=spec.with_mtp, shard=shard, **spec.weight_options)
    kv_dtype = getattr(torch, spec.kv_dtype)
    cache = allocate_cache(
        model.rank_config, spec.num_blocks, spec.block_size, spec.num_slots, kv_dtype, with_mtp=spec.with_mtp
    )
    snapshots = SnapshotStore(cache, spec.num_snapshots) if spec.num_snapshots else None
    executor = make_executor(model, cache, enforce_eager=spec.enforce_eager, with_mtp=spec.with_mtp)
    executors = [EXECUTOR_KINDS[i] for i in gather_ints(EXECUTOR_KINDS.index(executor.name))]
    if len(set(executors)) > 1:
        torch_ranks = [r for r, name in enumerate(executors) if name == "torch"]
        log.warning("executor on rank %d of %d: torch, since rank(s) %s run the torch executor (see their log)",
                    shard.rank, shard.size, torch_ranks)
        executor, executors = TorchExecutor(model, cache), ["torch"] * len(executors)
    return Rank(model, cache, snapshots, executor, executors)


class RankWorker:
    """A worker rank's loop: run each call the driver broadcasts on this rank's shard, until STOP."""

    def __init__(self, rank: Rank) -> None:
        self.model = rank.model
        self.cache = rank.cache
        self.snapshots = rank.snapshots
        self.executor = rank.executor
        self.last_step: ForwardContext | None = None  # the verify states commit_verified picks from

    @torch.inference_mode()
    def serve(self) -> None:
        cfg, dtype = self.model.config, self.model.model.norm.weight.dtype  # the activations' dtype
        self.model.shard.in_step = True  # a worker runs nothing but the driver's calls
        while True:
            msg = receive(cfg.hidden_size, dtype)
            if msg.command == Command.STOP:
                return
            self.handle(msg)

    def handle(self, msg: Message) -> None:
        if msg.copies.numel():  # the driver's prefix cache moved GDN states since its last call
            if self.snapshots is None:
                raise RuntimeError("GDN snapshot copies for a rank without a snapshot pool")
            self.snapshots.apply(msg.copies)
        if msg.command == Command.FORWARD:
            input_ids, ctx, rows = unpack_step(msg.ints, self.cache, msg.hidden)  # hidden: merged image tokens
            self.executor.forward(input_ids, ctx, rows)
            self.last_step = ctx
        elif msg.command == Command.LOGITS:
            self.executor.compute_logits(msg.hidden)
        elif msg.command == Command.MTP:
            next_ids, ctx, _ = unpack_step(msg.ints, self.cache)
            self.executor.mtp_hidden(next_ids, msg.hidden, ctx, msg.arg)
        elif msg.command == Command.COMMIT:
            if self.last_step is None or not self.last_step.spec_seqs:
                raise RuntimeError("commit_verified without a verify step before it")
            self.executor.commit_verified(self.last_step, msg.ints.tolist())
            self.last_step.spec_states.clear()
        elif msg.command == Command.CACHE_BYTES:
            gather_ints(cache_bytes(self.cache, self.snapshots))
        elif msg.command != Command.HEARTBEAT:
            raise RuntimeError(f"unknown tensor-parallel command {msg.command!r}")


def gather_ints(value: int) -> list[int]:
    """Every rank's value, in rank order."""
    world = dist.get_world_size()
    parts = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(parts, torch.tensor([value], dtype=torch.long))
    return [int(p) for p in parts]
