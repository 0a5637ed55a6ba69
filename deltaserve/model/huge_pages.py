"""Weight memory on transparent huge pages (Linux).

Decode streams every weight once per token. On 4 KiB pages that is a TLB miss, and a page-table walk, every
4 KiB: 44,000 of them per token for bench_moe's int8 checkpoint (181 MB). With 2 MiB pages there are 512
times fewer. Measured on an AMD EPYC Zen 4 (decode at batch 1, 1 thread, without and with, alternating
processes, 3 pairs each): bench_moe's MoE int8 1.03x / 1.09x / 1.05x, int4 0.99x / 1.07x / 1.04x; the
Qwen3.5-0.8B shape int8 1.04x / 0.98x; resident memory unchanged (VmHWM within 0.2%).

Most distributions set /sys/kernel/mm/transparent_hugepage/enabled to "madvise": memory gets huge pages
only where the program asks for them with madvise(MADV_HUGEPAGE) before it first touches the memory. So
`weight_memory` allocates a stored weight of 2 MiB or more with room to start it on a 2 MiB boundary, and
advises its whole 2 MiB pages. The last, partial 2 MiB stays on small pages: a huge page there would hold up
to 2 MiB that is not the weight's. Pages the loader never writes (the alignment slack) are never resident.

A bf16 checkpoint's weights kept as read are the safetensors file's mapped pages, not allocated here; they
keep the page size of the file's mapping.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux's madvise advice
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def weight_memory(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An empty tensor for a stored weight: on the CPU, of 2 MiB or more, where the kernel has transparent
    huge pages, it starts on a 2 MiB boundary and its whole 2 MiB pages are advised huge; else torch.empty."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or _libc() is None:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    start = raw.data_ptr() + offset
    _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(nbytes // HUGE_PAGE * HUGE_PAGE), _MADV_HUGEPAGE)
    return raw[offset:offset + nbytes].view(dtype).view(shape)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, where huge pages can be asked for: Linux with transparent huge pages not "never"."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        if "[never]" in _THP_SETTING.read_text():
            return None
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
