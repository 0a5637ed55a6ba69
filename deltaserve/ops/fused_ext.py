"""Builds and loads the fused step's C++ sources (every *.cpp in csrc/, one translation unit each) with the
system C++ compiler: once per source, flags, torch, compiler and machine (about 30 s, said on stderr),
cached under TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions (ext_build.py). A failed build is
remembered: the process does not try again.

The native build is compiled for this CPU (-march=native); the portable one for any x86-64 since about 2009
(-march=x86-64-v2: no AVX, so the C++'s non-AVX-512 branches), which the tests run as well."""

from __future__ import annotations

import platform
import threading
from pathlib import Path
from types import ModuleType

from deltaserve.ops.ext_build import ExtensionSpec
from deltaserve.ops.ext_build import load as build_and_load

SOURCE_DIR = Path(__file__).parent / "csrc"
# What a failed build costs, for its warning (docs/benchmarks.md: the fused step vs op-by-op torch models).
FALLBACK_COST = (
    "the Python model runs every step op by op instead, several times slower on a CPU (see docs/benchmarks.md)"
)

_lock = threading.Lock()
_modules: dict[bool, ModuleType] = {}
_failures: dict[bool, str] = {}


class FusedBuildError(RuntimeError):
    """The C++ step could not be compiled or loaded (no compiler?); the Python model still works."""


def extension_spec(portable: bool = False) -> ExtensionSpec:
    # -fopenmp: at::parallel_for is inline OpenMP in ATen's headers; without it the step's loops ran on one
    # thread whatever torch.set_num_threads said. The process keeps one OpenMP runtime: torch's own
    # libgomp.so.1 is already loaded under that name.
    # -fno-trapping-math: the step never reads the floating-point exception flags. Without it GCC keeps a
    # comparison that may raise one (the clamps of simd.h's vexp) as a branch and leaves every loop over exp,
    # silu and sigmoid scalar (the GDN conv, the MLP's SiLU, the softmaxes). It reorders no arithmetic.
    if not portable:
        arch = ["-march=native"]
    else:  # elsewhere the compiler's default target is the portable one
        arch = ["-march=x86-64-v2"] if platform.machine() in ("x86_64", "AMD64") else []
    name = "deltaserve_fused_step_portable" if portable else "deltaserve_fused_step"
    cflags = ("-O3", *arch, "-fopenmp", "-fno-trapping-math")
    return ExtensionSpec(name, SOURCE_DIR, cflags=cflags, ldflags=("-fopenmp",))


def load_extension(portable: bool = False) -> ModuleType:
    """The C++ step's module, compiled first if this machine has no build of these sources (about 30 s).
    Raises FusedBuildError naming the cause, at once if the build already failed in this process."""
    with _lock:
        if portable in _modules:
            return _modules[portable]
        if portable in _failures:
            raise FusedBuildError(f"{_failures[portable]}. Not retried: it failed earlier in this process")
        try:
            _modules[portable] = build_and_load(extension_spec(portable))
        except Exception as e:  # no compiler, a compile error, an unwritable cache, ...: the caller falls back
            _failures[portable] = f"could not build the fused C++ step: {e}; {FALLBACK_COST}"
            raise FusedBuildError(_failures[portable]) from e
        return _modules[portable]


def release_step_memory() -> None:
    """Hand the free pages of the loaded builds' activation pools back to the system (csrc/step_memory.h): the
    engine calls it when it goes idle, as it returns glibc's free heap (model/loader.py release_idle_heap)."""
    with _lock:
        modules = list(_modules.values())
    for module in modules:
        module.release_step_memory()
