"""Stored weights of 2 MiB or more on transparent huge pages (deltaserve/model/huge_pages.py), where Linux has
them: a weight starts on a 2 MiB boundary and its whole 2 MiB pages are advised huge, its partial tail is not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltaserve.model.huge_pages import HUGE_PAGE, weight_memory
from deltaserve.model.linear import Linear, store
from deltaserve.ops.formats import WeightFormat

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _THP.exists() or "[never]" in _THP.read_text(),
    reason="transparent huge pages are a Linux feature, here absent or off")


def mapping_of(address: int) -> tuple[int, int, dict[str, str]]:
    """(start, end, fields) of the mapping in /proc/self/smaps that holds address."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head[0].endswith(":"):  # a field of the mapping above
            if found is not None:
                found[2][head[0].rstrip(":")] = head[1]
        elif found is not None:  # the next mapping's header
            break
        else:
            start, end = (int(x, 16) for x in head[0].split("-"))
            found = (start, end, {}) if start <= address < end else None
    assert found is not None, f"no mapping holds {address:#x}"
    return found


def test_a_large_weight_starts_on_a_huge_page_and_is_advised():
    weight = weight_memory((3000, 1024), torch.bfloat16)  # 5.9 MiB: two whole huge pages and a tail
    assert weight.shape == (3000, 1024) and weight.dtype == torch.bfloat16 and weight.is_contiguous()
    assert weight.data_ptr() % HUGE_PAGE == 0
    weight.fill_(1.0)
    start, end, fields = mapping_of(weight.data_ptr())
    if "THPeligible" not in fields:
        pytest.skip("this kernel's smaps has no THPeligible field")
    assert fields["THPeligible"] == "1" and end >= weight.data_ptr() + 2 * HUGE_PAGE


# A fresh process: in this one, the memory may come from a block that an earlier weight's advice covered
# already, or from the fused step's pool (csrc/step_memory.h), once a test has built a stack.
TAIL_PROBE = """
import sys
sys.path.insert(0, {tests!r})
import torch
from test_huge_pages import HUGE_PAGE, mapping_of, weight_memory
weight = weight_memory((3000, 1024), torch.bfloat16)
weight.fill_(1.0)
tail = mapping_of(weight.data_ptr() + 2 * HUGE_PAGE)
print(tail[0] - weight.data_ptr(), tail[2].get("THPeligible"))
"""


def test_only_whole_huge_pages_are_advised_not_the_tail():
    """The partial last 2 MiB stays on small pages: a huge page there would hold bytes that are not the weight's."""
    probe = TAIL_PROBE.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    offset, eligible = done.stdout.split()
    assert int(offset) == 2 * HUGE_PAGE  # the tail's mapping is another one, after the advised pages
    if "[always]" not in _THP.read_text() and eligible != "None":
        assert eligible == "0"


def test_the_loader_stores_a_projection_on_huge_pages():
    layer = Linear(1024, 4096)
    store(layer, WeightFormat("int8", 32))  # 4 MiB of int8 data, 256 KiB of scales
    assert layer.weight.data_ptr() % HUGE_PAGE == 0
    layer.weight.fill_(1)
    fields = mapping_of(layer.weight.data_ptr())[2]
    if "THPeligible" in fields:
        assert fields["THPeligible"] == "1"


def test_small_tensors_and_other_devices_are_plain():
    small = weight_memory((16, 1024), torch.int8)
    assert small.shape == (16, 1024) and small.untyped_storage().nbytes() == 16 * 1024
    meta = weight_memory((4096, 1024), torch.int8, "meta")
    assert meta.is_meta and meta.shape == (4096, 1024)
