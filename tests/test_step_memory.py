"""The fused step's pool for large activations (deltaserve/ops/csrc/step_memory.h): torch's CPU tensors of 1 to
32 MiB come from it once a stack is built, best fit among themselves, freed blocks merged with their free
neighbours and kept for reuse, their pages handed back on release. Run in a fresh process: the pool is
process-wide, and the addresses and counts below are those of a pool no other test has used."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deltaserve.ops.fused_ext import FusedBuildError, load_extension

PROBE = r"""
import json
import torch
from deltaserve.ops.fused_ext import load_extension

ext = load_extension()
MiB = 1 << 20
out = {"before": ext.step_memory_stats()}
ext.use_step_memory_pool()
blocks = [torch.empty(2 * MiB, dtype=torch.uint8) for _ in range(3)]
out["three"] = ext.step_memory_stats()
out["three_at"] = [b.data_ptr() for b in blocks]
small, large = torch.empty(MiB - 1, dtype=torch.uint8), torch.empty(33 * MiB, dtype=torch.uint8)
out["outside"] = ext.step_memory_stats()
odd = torch.empty(MiB + 1, dtype=torch.uint8)
out["odd"] = ext.step_memory_stats()
del blocks
six = torch.empty(6 * MiB, dtype=torch.uint8)
out["six_at"], out["six"] = six.data_ptr(), ext.step_memory_stats()
del six, odd
for _ in range(5):  # the same sizes again, 75 MiB a round: the free blocks, no new mapping
    again = [torch.ones(n * MiB, dtype=torch.uint8) for n in (20, 30, 25)]
    del again
out["reused"] = ext.step_memory_stats()


def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024


touched = torch.ones(16 * MiB, dtype=torch.uint8)  # its pages resident
del touched
out["rss_freed"], out["released"] = rss(), ext.release_step_memory()
out["rss_released"] = rss()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe():
    try:
        load_extension()
    except FusedBuildError as e:
        pytest.skip(str(e))
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


MiB = 1 << 20


def test_the_pool_serves_blocks_of_1_to_32_mib_only(probe) -> None:
    assert probe["before"] == [0, 0]  # nothing before a stack (or the call a stack makes) installs it
    mapped, used = probe["three"]
    assert used == 6 * MiB and mapped >= 6 * MiB
    assert probe["outside"] == probe["three"]  # 1 MiB - 1 byte and 33 MiB: the allocator it replaced
    assert probe["odd"][1] == 6 * MiB + MiB + 64 * 1024  # sizes rounded up to 64 KiB


def test_freed_blocks_merge_and_are_reused_lowest_address_first(probe) -> None:
    first, second, third = sorted(probe["three_at"])
    assert (second - first, third - second) == (2 * MiB, 2 * MiB)  # a fresh mapping, carved from its start
    assert probe["six_at"] == first  # the three freed blocks merged into one range
    assert probe["reused"][0] == probe["six"][0]  # five rounds of 75 MiB: no new mapping
    assert probe["reused"][1] == 0


def test_release_hands_free_pages_back(probe) -> None:
    assert probe["released"] >= 16 * MiB
    assert probe["rss_freed"] - probe["rss_released"] >= 15 * MiB
