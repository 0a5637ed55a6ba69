"""Builds and loads the fused step's C++ sources (every csrc/*.cpp, one translation unit each) with the system
C++ compiler, once per machine and source version (about 30 s), cached by torch under ~/.cache/torch_extensions."""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))

_lock = threading.Lock()
_module = None


class FusedBuildError(RuntimeError):
    """The C++ step could not be compiled or loaded (no compiler?); the Python model still works."""


def _cpu_tag() -> str:
    """Build directory key: the code is compiled with -march=native, so a cache must not cross CPUs."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name")):
                flags += line
    except OSError:
        flags = platform.processor()
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def load_extension():
    """Compile (once per machine and source version; about 30 s) and import the C++ step."""
    global _module
    with _lock:
        if _module is None:
            from torch.utils.cpp_extension import _get_build_directory, load

            name = f"deltaserve_fused_step_{_cpu_tag()}"
            build_dir = Path(_get_build_directory(name, verbose=False))
            if not any(build_dir.glob("*.so")):
                log.info("building the fused step (C++, once per machine; about 30 s)")
            try:
                # -fopenmp: at::parallel_for is inline OpenMP in ATen's headers; without it the step's loops
                # ran on one thread whatever torch.set_num_threads said. The process keeps one OpenMP
                # runtime: torch's own libgomp.so.1 is already loaded under that name.
                _module = load(
                    name=name, sources=[str(s) for s in SOURCES], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False,
                )
            except Exception as e:  # compiler missing or failing: say so, the caller falls back
                raise FusedBuildError(f"could not build the fused step from csrc/*.cpp: {e}") from e
        return _module
