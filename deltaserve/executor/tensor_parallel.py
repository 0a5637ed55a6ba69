"""Tensor parallelism: rank 0 of N runs in the engine's process (the driver), ranks 1..N-1 are worker
processes (executor/tp_worker.py) in one torch.distributed process group. Each call the driver broadcasts
the step (tp_protocol.py), then every rank runs its shard of the same forward with the executor
make_executor chose for it (the fused C++ step, which calls the all-reduces through a hook, or the torch
reference executor); the row-parallel all-reduces leave the hidden states replicated, so sampling happens
once, here. Logits are vocab-parallel and gathered; greedy tokens are the argmax of the gathered logits.
GDN states live per rank, so MTP passes and commit_verified run on every rank too. The vision tower is
not sharded: rank 0 runs it (encode_images), and each forward that reaches an image sends its merged tokens
to the workers with the step.

Failure is loud, never a hang: before each call the driver checks that its local workers live; a
collective that fails (a peer gone, or no answer within DELTASERVE_TP_TIMEOUT) marks the executor failed
with the rank it could name, and every later call (and the server's /health) raises that."""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from deltaserve.executor.base import Executor, Rows
from deltaserve.executor.tp_protocol import (
    BACKEND,
    Command,
    Message,
    cache_bytes,
    collective_timeout_s,
    pack_step,
    send,
)
from deltaserve.executor.tp_rank import DTYPE_NAMES, Rank, RankSpec, build_rank, gather_ints
from deltaserve.model.context import ForwardContext
from deltaserve.model.parallel import Shard

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0  # an idle driver's heartbeat, well inside the collective timeout


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank stopped or stopped answering; the message names it where it can."""


class TensorParallelExecutor(Executor):
    name = "torch-tp"  # or "fused-cpu-tp": the ranks' executor (all run the same one: build_rank)

    def __init__(self, rank: Rank, workers: list[subprocess.Popen] | None) -> None:
        """rank: rank 0's shard, cache and executor; workers: the local worker processes (None: launched
        elsewhere)."""
        self.model = rank.model
        self.cache = rank.cache
        self.snapshots = rank.snapshots  # rank 0's; it logs its copies, which each call takes to the others
        if self.snapshots is not None:
            self.snapshots.copies = []
        self.shard = rank.model.shard
        self.local = rank.executor
        self.name = f"{rank.executors[0]}-tp"  # what every rank runs (build_rank: all the same)
        self.workers = workers or []
        self.error: str | None = None
        self._lock = threading.Lock()
        self._last_call = time.monotonic()
        self._closed = False
        self._heartbeat = threading.Thread(target=self._beat, name="deltaserve-tp-heartbeat", daemon=True)
        self._heartbeat.start()

    # ---- the Executor interface: broadcast the call, then run rank 0's part of it ----------------------
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, output_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        embeds = None
        if ctx.mm_embeds is not None:  # every rank puts the same merged image tokens at the same rows
            rows, embeds = ctx.mm_embeds
            embeds = embeds.to(self.model.activation_dtype)  # what each executor reads them as; the workers too
            ctx.mm_embeds = (rows, embeds)
        ints = pack_step(input_ids, ctx, output_rows, None if embeds is None else ctx.mm_embeds[0])
        msg = Message(Command.FORWARD, ints, embeds)
        return self._call(msg, lambda: self.local.forward(input_ids, ctx, output_rows))

    def compute_logits(self, hidden: torch.Tensor, rows: Rows = None) -> torch.Tensor:
        hidden = hidden if rows is None else hidden[rows]
        msg = Message(Command.LOGITS, torch.zeros(0, dtype=torch.long), hidden)
        return self._call(msg, lambda: self.local.compute_logits(hidden))

    def greedy_tokens(self, hidden: torch.Tensor, rows: Rows = None) -> torch.Tensor:
        return self.compute_logits(hidden, rows).argmax(dim=-1)

    def mtp_hidden(self, next_token_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, step: int = 0
                   ) -> torch.Tensor:
        msg = Message(Command.MTP, pack_step(next_token_ids, ctx), hidden, step)
        return self._call(msg, lambda: self.local.mtp_hidden(next_token_ids, hidden, ctx, step))

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Rank 0 alone holds the (whole, unsharded) vision tower and runs it: no collective, nothing sent. The
        merged tokens travel with the forward that places them (ctx.mm_embeds), so the workers need neither the
        tower nor the encoder cache, and hold the same embeddings as rank 0 for every step."""
        self.check_health()
        return self.local.encode_images(pixels, grids)

    def commit_verified(self, ctx: ForwardContext, accepted: list[int]) -> None:
        msg = Message(Command.COMMIT, torch.tensor(accepted, dtype=torch.long))
        self._call(msg, lambda: self.local.commit_verified(ctx, accepted))

    def cache_bytes_per_rank(self) -> list[int]:
        """The bytes of the cache tensors each rank allocated, in rank order."""
        msg = Message(Command.CACHE_BYTES, torch.zeros(0, dtype=torch.long))
        return self._call(msg, lambda: gather_ints(cache_bytes(self.cache, self.snapshots)))

    # ---- control ---------------------------------------------------------------------------------------
    def check_health(self) -> None:
        if self.error is None:
            self._check_workers()
        if self.error is not None:
            raise TensorParallelError(self.error)

    def close(self) -> None:
        """Tell the workers to stop and wait for them (briefly); the process group goes with them."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            if self.error is None:
                try:
                    send(Message(Command.STOP, torch.zeros(0, dtype=torch.long)))
                except Exception:  # a rank already gone: nothing to stop there
                    pass
        for proc in self.workers:
            try:
                proc.wait(timeout=10 if self.error is None else 0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _call(self, msg: Message, run):
        with self._lock:
            self.check_health()
            self._last_call = time.monotonic()
            self.shard.in_step = True
            try:
                if self.snapshots is not None:  # rank 0 made them already; the others replay them first
                    msg.copies = self.snapshots.take_copies()
                send(msg)
                return run()
            except Exception as e:  # a collective that failed, or rank 0's own error: the ranks are out of step
                self._fail(f"a tensor-parallel {msg.command.name} call failed ({type(e).__name__}: {e})")
                raise TensorParallelError(self.error) from e
            finally:
                self.shard.in_step = False

    def _check_workers(self) -> None:
        for rank, proc in enumerate(self.workers, start=1):
            code = proc.poll()
            if code is not None and self.error is None:
                self.error = f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}"
                log.error("%s", self.error)
                self._kill_workers()

    def _fail(self, what: str) -> None:
        """A call failed: name the dead rank if a local one is (give it a moment to be reaped)."""
        deadline = time.monotonic() + 2.0
        while self.workers and self.error is None and time.monotonic() < deadline:
            self._check_workers()
            if self.error is None:
                time.sleep(0.05)
        if self.error is None:
            self.error = f"{what}; a rank stopped or stopped answering, or rank 0 failed"
            log.error("%s", self.error)
            self._kill_workers()

    def _kill_workers(self) -> None:
        """After one rank failed: the others cannot go on without it."""
        for proc in self.workers:
            if proc.poll() is None:
                proc.kill()

    def _beat(self) -> None:
        """While the engine is idle, keep the workers' wait for the next call inside the timeout, and
        notice a worker that died meanwhile (the server's /health reads self.error)."""
        while not self._closed:
            time.sleep(HEARTBEAT_S / 5)
            if self._closed or self.error is not None:
                continue
            self._check_workers()
            if time.monotonic() - self._last_call < HEARTBEAT_S or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._closed and self.error is None:
                    self._last_call = time.monotonic()
                    send(Message(Command.HEARTBEAT, torch.zeros(0, dtype=torch.long)))
            except RuntimeError as e:
                self._fail(f"a tensor-parallel heartbeat failed ({e})")
            finally:
                self._lock.release()


def start_tensor_parallel(
    model_path: str, dtype: str, tp: int, *, with_mtp: bool, num_blocks: int, block_size: int,
    num_slots: int, kv_dtype: torch.dtype, enforce_eager: bool = False, num_snapshots: int = 0,
    weight_options: dict | None = None,
) -> TensorParallelExecutor:
    """Join (or form) the process group of tp ranks as rank 0 and build every rank's shard and cache.

    With RANK set in the environment the other ranks are launched elsewhere (torchrun-style: MASTER_ADDR,
    MASTER_PORT, WORLD_SIZE=tp, RANK=0 here); otherwise ranks 1..tp-1 start here as local processes on a
    free loopback port. Each rank runs the executor make_executor's rule gives it (enforce_eager: torch) and
    holds num_snapshots GDN snapshot entries for prefix caching (the executor's `snapshots` are rank 0's)."""
    external = "RANK" in os.environ
    if external:
        rank, world = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "-1"))
        if rank != 0 or world != tp:
            raise ValueError(  # the user's launch, not a failure: the CLI prints it as one line
                f"the engine is rank 0 of tensor_parallel_size={tp}: set RANK=0 and WORLD_SIZE={tp} "
                f"(got RANK={rank}, WORLD_SIZE={world}); start ranks 1..{tp - 1} with `deltaserve worker`"
            )
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    else:
        addr, port = "127.0.0.1", _free_port()
    timeout = collective_timeout_s()
    workers: list[subprocess.Popen] = []
    if not external:
        # The ranks share this host's cores: tp ranks of the engine's thread count each would oversubscribe
        # them, and torch's spinning threads then make every step many times slower.
        torch.set_num_threads(max(1, torch.get_num_threads() // tp))
        for rank in range(1, tp):
            env = dict(os.environ, MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(tp))
            workers.append(subprocess.Popen([sys.executable, "-m", "deltaserve.executor.tp_worker"], env=env))
    log.info("tensor parallel: rank 0 of %d (%s, %s workers) at %s:%d", tp, BACKEND,
             "external" if external else "local", addr, port)
    spec = RankSpec(model=str(model_path), dtype=dtype, with_mtp=with_mtp, num_blocks=num_blocks,
                    block_size=block_size, num_slots=num_slots, kv_dtype=DTYPE_NAMES[kv_dtype],
                    threads=torch.get_num_threads(), enforce_eager=enforce_eager, num_snapshots=num_snapshots,
                    weight_options=dict(weight_options or {}))
    try:
        dist.init_process_group(BACKEND, init_method=f"tcp://{addr}:{port}", rank=0, world_size=tp,
                                timeout=timedelta(seconds=timeout))
        dist.broadcast_object_list([spec.to_dict()], src=0)
        rank0 = build_rank(spec, Shard(0, tp, dist.group.WORLD))
        dist.barrier()
    except BaseException as e:
        dead = [f"rank {r} exited with code {p.poll()}" for r, p in enumerate(workers, start=1)
                if p.poll() is not None]
        for proc in workers:
            proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        if isinstance(e, ValueError):  # rank 0's own checkpoint or config error says it best
            raise
        raise TensorParallelError(
            f"tensor-parallel startup failed ({'; '.join(dead) or e}); see the workers' log above"
        ) from e
    executor = TensorParallelExecutor(rank0, workers)
    log.info("executor: %s (each of %d ranks runs %s on its shard)", executor.name, tp, rank0.executors[0])
    atexit.register(executor.close)
    return executor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
