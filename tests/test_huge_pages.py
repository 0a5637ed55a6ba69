"""Stored weights of 2 MiB or more on transparent huge pages (deltaserve/model/huge_pages.py), where Linux has
them: a weight starts on a 2 MiB boundary and its whole 2 MiB pages are advised huge, its partial tail is not."""

from __future__ import annotations

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


def test_a_large_weight_starts_on_a_huge_page_and_its_whole_huge_pages_are_advised():
    weight = weight_memory((3000, 1024), torch.bfloat16)  # 5.9 MiB: two whole huge pages and a tail
    assert weight.shape == (3000, 1024) and weight.dtype == torch.bfloat16 and weight.is_contiguous()
    assert weight.data_ptr() % HUGE_PAGE == 0
    weight.fill_(1.0)
    start, end, fields = mapping_of(weight.data_ptr())
    if "THPeligible" not in fields:
        pytest.skip("this kernel's smaps has no THPeligible field")
    assert fields["THPeligible"] == "1"
    # the advice covers the whole huge pages only (its mapping may have merged with a neighbour's advised one):
    # the tail's mapping is another, not advised
    assert start <= weight.data_ptr() and end >= weight.data_ptr() + 2 * HUGE_PAGE
    tail = mapping_of(weight.data_ptr() + 2 * HUGE_PAGE)
    assert tail[0] == weight.data_ptr() + 2 * HUGE_PAGE
    if "[always]" not in _THP.read_text():
        assert tail[2]["THPeligible"] == "0"


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
