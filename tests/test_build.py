"""The C++ step's build (deltaserve/ops/ext_build.py, fused_ext.py): one key for everything the binary depends
on, one compile per key across processes and checkouts, a killed build's locks taken over, and a failed build
falling back to the Python model with a warning that names the cause.

Processes that compile get a fresh TORCH_EXTENSIONS_DIR and, except the engine's, a one-function extension
(3 s to compile); the others reuse the suite's build of the real step."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from deltaserve.ops import ext_build
from deltaserve.ops.ext_build import BuildError, BuildLock, ExtensionSpec, build_dir_for, build_key, key_inputs
from deltaserve.ops.fused_ext import SOURCE_DIR, extension_spec, load_extension
from tests.checkpoints import TINY, random_hf_model, save_official_layout

ROOT = Path(__file__).resolve().parent.parent
ENGINE_IS_FUSED = 'llm.engine.executor.name == "fused-cpu"'  # in the processes below: whether `llm` runs the C++ step
TINY_SOURCE = """#include <pybind11/pybind11.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return 42; }); }
"""


def tiny_spec(tmp_path: Path) -> ExtensionSpec:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "tiny.cpp").write_text(TINY_SOURCE)
    return ExtensionSpec("tiny", src, cflags=("-O0",), compile_estimate="about 3 s")


def python(code: str, stderr=subprocess.PIPE, **env: str) -> subprocess.Popen:
    """A Python process running `code` from the repository root, with `env` added to this one's."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the process did not finish in {timeout} s (a lock it waits for forever?):\n{err}")
    assert proc.returncode == 0, err
    return out, err or ""


def load_tiny(spec: ExtensionSpec) -> str:
    return f"""
        from pathlib import Path
        from deltaserve.ops.ext_build import ExtensionSpec, load
        print(load(ExtensionSpec({spec.name!r}, Path({str(spec.source_dir)!r}), {spec.cflags!r})).answer())
    """


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty where there is no /proc/cpuinfo)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the vector kernels are x86's")
def test_the_native_build_has_the_vector_kernels_of_this_cpu() -> None:
    """A CPU with AVX2 but not AVX-512 (most desktops and laptops) gets the AVX2 kernels, not the plain loops
    (10-17x slower decode on the 0.8B); the portable build keeps the plain ones."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags")
    want = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma", "f16c"} <= flags else "plain"
    assert load_extension().VECTOR_KERNELS == want
    assert load_extension(portable=True).VECTOR_KERNELS == "plain"


def test_a_second_engine_compiles_nothing_even_from_another_checkout(tmp_path) -> None:
    so = Path(load_extension().__file__)  # the suite's build: made now if no earlier test made it
    built_at = so.stat().st_mtime_ns
    checkout = tmp_path / "other-checkout-csrc"
    shutil.copytree(SOURCE_DIR, checkout)
    model = save_official_layout(random_hf_model(TINY, seed=0), tmp_path / "model")
    out, engine_err = finish(python(f"""
        import json
        from deltaserve import LLM, SamplingParams
        llm = LLM(model={str(model)!r}, max_model_len=64, kv_cache_memory=1 << 22)
        out = llm.generate([{{"prompt_token_ids": [3, 4, 5]}}], SamplingParams(max_tokens=4, ignore_eos=True))
        print(json.dumps([{ENGINE_IS_FUSED}, len(out[0].outputs[0].token_ids)]))
    """))
    assert json.loads(out.splitlines()[-1]) == [True, 4]
    # Another process's first load, from the other checkout's sources (torch skips ninja on later loads).
    out, other_err = finish(python(f"""
        from dataclasses import replace
        from pathlib import Path
        from deltaserve.ops import ext_build
        from deltaserve.ops.fused_ext import extension_spec
        print(ext_build.load(replace(extension_spec(), source_dir=Path({str(checkout)!r}))).__file__)
    """))
    assert out.strip() == str(so)
    assert "compil" not in engine_err + other_err  # neither "compiling" nor a late "recompiled"
    assert so.stat().st_mtime_ns == built_at
    assert str(checkout) not in (so.parent / "build.ninja").read_text()  # the copy in the build folder is built


def test_a_changed_source_header_flag_or_compiler_gets_a_new_key(tmp_path, monkeypatch) -> None:
    shutil.copytree(SOURCE_DIR, tmp_path / "csrc")
    spec = replace(extension_spec(), source_dir=tmp_path / "csrc")
    key = build_key(spec)
    assert key == build_key(extension_spec())  # same sources elsewhere: same key
    cpp = next((tmp_path / "csrc").glob("*.cpp"))
    original = cpp.read_text()
    cpp.write_text(original + "// one more line\n")
    assert build_key(spec) != key
    cpp.write_text(original)
    assert build_key(spec) == key
    (tmp_path / "csrc" / "new_helpers.h").write_text("#pragma once\n")
    assert build_key(spec) != key
    (tmp_path / "csrc" / "new_helpers.h").unlink()
    assert build_key(replace(spec, cflags=(*spec.cflags, "-DNDEBUG"))) != key
    assert build_key(extension_spec(portable=True)) != build_key(extension_spec())
    other_compiler = tmp_path / "bin" / "g++"  # the same g++ reporting another version
    other_compiler.parent.mkdir()
    other_compiler.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "g++ (Other) 99.1.0" && exit 0\nexec g++ "$@"\n')
    other_compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(other_compiler))
    assert build_key(spec) != key
    inputs = key_inputs(spec)
    assert "99.1.0" in inputs["compiler"] and torch.__version__ in inputs["torch"]
    assert os.path.realpath(Path(torch.__file__).parent) in inputs["torch"]


def test_a_missing_or_broken_compiler_is_named(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "root"))
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(BuildError, match=r"compiler '/nonexistent/g\+\+' .* was not found"):
        ext_build.load(tiny_spec(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(BuildError, match="does not run: `/bin/false --version` exited with 1"):
        ext_build.load(tiny_spec(tmp_path))


def test_concurrent_starts_build_once_and_both_load(tmp_path, monkeypatch) -> None:
    spec, root = tiny_spec(tmp_path), tmp_path / "root"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    build_dir = build_dir_for(spec)
    build_dir.mkdir(parents=True)
    logs = [tmp_path / f"stderr{i}" for i in range(2)]
    # Both processes start while this one holds the lock, so both find no build and queue for it.
    with BuildLock(build_dir / "build.lock") as held:
        held.state("compiling")
        procs = [python(load_tiny(spec), stderr=log.open("w")) for log in logs]
        deadline = time.monotonic() + 60
        while not all("waiting for process" in log.read_text() for log in logs):
            assert time.monotonic() < deadline, [log.read_text() for log in logs]
            time.sleep(0.05)
    outs = [finish(p)[0] for p in procs]
    assert outs == ["42\n", "42\n"]
    assert sum("compiling tiny" in log.read_text() for log in logs) == 1


def test_a_killed_build_leaves_locks_that_the_next_start_takes_over(tmp_path) -> None:
    spec, root = tiny_spec(tmp_path), tmp_path / "root"
    env = {"TORCH_EXTENSIONS_DIR": str(root)}
    first = python(load_tiny(spec), **env)
    torch_lock = None
    deadline = time.monotonic() + 60
    while torch_lock is None and time.monotonic() < deadline:  # torch's lock exists while ninja compiles
        torch_lock = next(iter(root.glob("deltaserve/*/lock")), None)
        time.sleep(0.02)
    assert torch_lock is not None, "the first process never started compiling"
    os.killpg(first.pid, signal.SIGKILL)  # the process and its compiler, mid-build
    first.communicate()
    assert torch_lock.exists() and f"{first.pid} compiling" in (torch_lock.parent / "build.lock").read_text()
    out, err = finish(python(load_tiny(spec), **env))
    assert out.strip() == "42"
    assert f"took over the build lock {torch_lock.parent / 'build.lock'} from process {first.pid}" in err
    assert f"removed torch's lock {torch_lock}" in err
    assert "compiling tiny" in err and not torch_lock.exists()


def test_a_failed_build_falls_back_to_the_python_model_once_per_process(tmp_path) -> None:
    compiler = tmp_path / "bin" / "g++"  # answers torch's version checks, fails every compile
    compiler.parent.mkdir()
    compiler.write_text(
        '#!/bin/sh\ncase "$1" in --version|-dumpfullversion|-v) exec g++ "$@";; esac\n'
        'echo "g++: fatal error: forced failure for the test" >&2\nexit 1\n'
    )
    compiler.chmod(0o755)
    model = save_official_layout(random_hf_model(TINY, seed=0), tmp_path / "model")
    out, err = finish(python(f"""
        import json
        from deltaserve import LLM, SamplingParams
        runs = []
        for _ in range(2):
            llm = LLM(model={str(model)!r}, max_model_len=64, kv_cache_memory=1 << 22)
            out = llm.generate([{{"prompt_token_ids": [3, 4, 5]}}], SamplingParams(max_tokens=4, ignore_eos=True))
            runs.append([{ENGINE_IS_FUSED}, len(out[0].outputs[0].token_ids)])
        print(json.dumps(runs))
    """, CXX=str(compiler), TORCH_EXTENSIONS_DIR=str(tmp_path / "root")))
    assert json.loads(out.splitlines()[-1]) == [[False, 4], [False, 4]]  # both engines generate, unfused
    assert err.count("compiling deltaserve_fused_step") == 1  # the second engine does not try again
    warnings = [line for line in err.splitlines() if "could not build the fused C++ step" in line]
    assert len(warnings) == 2 and "Not retried: it failed earlier in this process" in warnings[1]
    assert "fatal error: forced failure for the test" in warnings[0]  # the cause
    assert "several times slower" in warnings[0] and "build-error.log" in warnings[0]
