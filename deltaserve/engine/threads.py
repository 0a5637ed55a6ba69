"""How many compute threads the engine's kernels use: --threads / num_threads; else what the process set
(torch.set_num_threads, OMP_NUM_THREADS), but no more than one per physical core this process may run on:
hyper-threads share a core's vector units, which the kernels already keep busy."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def physical_cores() -> int:
    """Physical cores among the CPUs this process may use (Linux topology; the CPU count elsewhere)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topo / "physical_package_id").read_text().strip() + ":" + (topo / "core_id").read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(len(cores), 1)


def set_compute_threads(num_threads: int | None) -> int:
    """Apply the rule above (process-wide, as torch's setting is); returns the thread count."""
    if num_threads:
        torch.set_num_threads(num_threads)
        source = "num_threads"
    elif os.environ.get("OMP_NUM_THREADS"):
        source = "OMP_NUM_THREADS"
    else:
        cores = physical_cores()
        if torch.get_num_threads() > cores:
            torch.set_num_threads(cores)
        source = f"{cores} physical cores"
    log.info("compute threads: %d (%s)", torch.get_num_threads(), source)
    return torch.get_num_threads()
