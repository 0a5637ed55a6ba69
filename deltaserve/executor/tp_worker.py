"""A tensor-parallel worker rank: `deltaserve worker` / `python -m deltaserve.executor.tp_worker`.

Joins the driver's process group by the env:// rendezvous (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, as
torchrun sets them), receives what to build (RankSpec) from rank 0, loads only its shard of the checkpoint,
allocates its cache and then runs the driver's calls until it says stop. On one machine the engine starts
these itself; on another host, start one per rank (see the README)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from deltaserve.executor.tp_protocol import BACKEND, collective_timeout_s
from deltaserve.executor.tp_rank import RankSpec, RankWorker, build_rank
from deltaserve.model.parallel import Shard

log = logging.getLogger("deltaserve.worker")


MODEL_HELP = "checkpoint directory on this host (default: the path rank 0 loads from)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deltaserve.executor.tp_worker", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help=MODEL_HELP)
    try:
        return run(p.parse_args(argv).model)
    except ValueError as e:
        p.error(str(e))


def run(model_path: str | None) -> int:
    """Join the process group as RANK and serve the driver's calls; 0 when the driver says stop."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
    if missing:
        raise ValueError(f"set {', '.join(missing)} (the env:// rendezvous with rank 0)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 0 < rank < world:
        raise ValueError(f"RANK={rank} must be 1 .. WORLD_SIZE-1 ({world - 1}); rank 0 is the engine")
    dist.init_process_group(BACKEND, init_method="env://", timeout=timedelta(seconds=collective_timeout_s()))
    try:
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        spec = RankSpec(**box[0])
        if model_path is not None:
            spec.model = model_path
        torch.set_num_threads(spec.threads)
        built = build_rank(spec, Shard(rank, world, dist.group.WORLD))
        log.info("rank %d of %d: loaded its shard of %s (%s executor)", rank, world, spec.model, built.executor.name)
        dist.barrier()
        RankWorker(built).serve()
    except Exception:
        log.exception("tensor-parallel rank %d stopped", rank)
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
