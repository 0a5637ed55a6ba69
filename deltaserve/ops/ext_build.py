"""Compiles and imports a torch C++ extension from a folder of sources, once per build key, safely across
processes.

The key hashes everything the binary depends on: every *.cpp and *.h in the folder, torch's version and
install path, the Python ABI, the compiler (`$CXX --version`), the flags and the machine. Its build folder,
<TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions>/deltaserve/<name>_<key>, holds a copy of the sources, so
two checkouts with the same sources (and one torch) share one build: ninja sees the same paths and commands
and compiles nothing. The sources may include only each other and system or torch headers.

One process builds at a time, under an flock on build.lock (the kernel drops it when its holder dies, so it
can never be stale); the holder's pid, written into it, names whom a second process waits for and tells the
next holder that a build was killed midway. torch's own `lock` file in the folder can then only be left over
from such a build (torch would wait for it forever) and is removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_DONE = "built"  # marker written once a build has been imported: its absence means a (re)compile


class BuildError(RuntimeError):
    """The extension could not be compiled or imported; the message names the cause."""


@dataclass(frozen=True, slots=True)
class ExtensionSpec:
    name: str  # module name prefix; the key is appended
    source_dir: Path  # every *.cpp here is compiled; every *.cpp and *.h is part of the key
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ()
    compile_estimate: str = "about 30 s"  # said before a compile starts


def build_root() -> Path:
    """Where torch puts JIT extensions: $TORCH_EXTENSIONS_DIR, else its per-user cache folder."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def source_files(source_dir: Path) -> list[Path]:
    files = sorted(p for p in source_dir.iterdir() if p.suffix in (".cpp", ".h") and p.is_file())
    if not any(p.suffix == ".cpp" for p in files):
        raise BuildError(f"no *.cpp sources in {source_dir}")
    return files


def compiler() -> str:
    """The compiler torch's build runs: $CXX, else c++."""
    return os.environ.get("CXX") or "c++"


def compiler_identity() -> str:
    """The compiler's resolved path and `--version` text: another compiler or version is another key."""
    cxx = compiler()
    path = shutil.which(cxx)
    if path is None:
        raise BuildError(f"the C++ compiler {cxx!r} ($CXX, else c++) was not found")
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"the C++ compiler {cxx!r} does not run: {e}") from e
    if done.returncode != 0:
        raise BuildError(f"the C++ compiler {cxx!r} does not run: `{cxx} --version` exited with {done.returncode}")
    return f"{os.path.realpath(path)}\n{done.stdout.strip()}"


def machine_tag() -> str:
    """The architecture and CPU (model and flags): -march=native code must not move to another CPU."""
    cpu = ""
    try:
        cpu = "".join(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "model name"))
        )
    except OSError:
        cpu = platform.processor()
    return f"{platform.machine()} {hashlib.sha1(cpu.encode()).hexdigest()[:10]}"


def key_inputs(spec: ExtensionSpec) -> dict[str, object]:
    """Everything the key hashes, by name (shown in tests and when debugging a rebuild)."""
    import torch

    sources = hashlib.sha256()
    for path in source_files(spec.source_dir):
        content = path.read_bytes()
        sources.update(f"{path.name}\0{len(content)}\0".encode() + content)
    return {
        "sources": sources.hexdigest(),
        "torch": [torch.__version__, torch.version.git_version, os.path.realpath(Path(torch.__file__).parent)],
        "python": [sys.implementation.cache_tag, sysconfig.get_paths()["include"]],
        "compiler": compiler_identity(),
        "cflags": list(spec.cflags),
        "ldflags": list(spec.ldflags),
        "machine": machine_tag(),
    }


def build_key(spec: ExtensionSpec) -> str:
    return hashlib.sha256(json.dumps(key_inputs(spec), sort_keys=True).encode()).hexdigest()[:16]


def build_dir_for(spec: ExtensionSpec) -> Path:
    return build_root() / "deltaserve" / f"{spec.name}_{build_key(spec)}"


class BuildLock:
    """An exclusive flock on `path`, which holds "<pid> <what it does>" while held: says whom a second
    process waits for, and which process ended without letting go (killed) when the next one takes it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1

    def _read(self) -> str:
        return os.pread(self._fd, 200, 0).decode(errors="replace").strip()

    def state(self, doing: str) -> None:
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()} {doing}".encode(), 0)

    def __enter__(self) -> BuildLock:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, _, doing = self._read().partition(" ")
            report = log.warning if doing == "compiling" else log.info
            report("waiting for process %s, %s in %s", pid or "?", doing or "starting", self.path.parent)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        left = self._read()
        if left:  # a holder clears the file when it lets go: this one ended without doing so
            pid, _, doing = left.partition(" ")
            log.warning("took over the build lock %s from process %s, which ended while %s (killed?)",
                        self.path, pid, doing or "holding it")
        self.state("loading")
        return self

    def __exit__(self, *exc: object) -> None:
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def _copy_sources(spec: ExtensionSpec, build_dir: Path) -> list[Path]:
    """The sources as compiled: a copy in the build folder (whose key is their hash), made once, atomically."""
    src = build_dir / "src"
    if not src.is_dir():
        staging = build_dir / "src.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        for path in source_files(spec.source_dir):
            shutil.copyfile(path, staging / path.name)
        staging.rename(src)
    return sorted(src.glob("*.cpp"))


def _compile_error(e: Exception, build_dir: Path) -> BuildError:
    """The compiler's error lines (torch's message holds its whole output, which goes to a log file)."""
    text = str(e)
    errors = [line.strip() for line in text.splitlines() if " error:" in line or line.startswith("error:")]
    summary = "; ".join(line[:300] for line in errors[:3]) or text.strip().splitlines()[-1][:300]
    log_path = build_dir / "build-error.log"
    try:
        log_path.write_text(text)
    except OSError:
        return BuildError(summary)
    return BuildError(f"{summary} (compiler output: {log_path})")


def load(spec: ExtensionSpec) -> ModuleType:
    """Import the extension, compiling it first if this key has no finished build (saying so, with an
    estimate, before and how long it took after)."""
    from torch.utils.cpp_extension import load as torch_load

    build_dir = build_dir_for(spec)
    name = build_dir.name
    build_dir.mkdir(parents=True, exist_ok=True)
    with BuildLock(build_dir / "build.lock") as lock:
        torch_lock = build_dir / "lock"
        if torch_lock.exists():  # only a build under our lock makes it: that build was killed
            torch_lock.unlink()
            log.warning("removed torch's lock %s, left by a build that ended midway", torch_lock)
        done, so = build_dir / _DONE, build_dir / f"{name}.so"
        compiling = not (done.exists() and so.exists())
        built_at = None if compiling else so.stat().st_mtime_ns
        if compiling:
            log.warning("compiling %s (C++, once per source, flags, torch and compiler; %s) in %s", spec.name,
                        spec.compile_estimate, build_dir)
            done.unlink(missing_ok=True)
            lock.state("compiling")
        start = time.monotonic()
        try:
            module = torch_load(name=name, sources=[str(p) for p in _copy_sources(spec, build_dir)],
                                extra_cflags=list(spec.cflags), extra_ldflags=list(spec.ldflags),
                                build_directory=str(build_dir), verbose=False)
        except Exception as e:
            raise _compile_error(e, build_dir) from e
        if compiling:
            done.touch()
            log.warning("compiled %s in %.1f s", spec.name, time.monotonic() - start)
        elif so.stat().st_mtime_ns != built_at:  # ninja found the build files out of date: say so, if late
            log.warning("recompiled %s in %.1f s: its files in %s were out of date", spec.name,
                        time.monotonic() - start, build_dir)
    return module
