"""Build and load memfit's small native (C++) extensions, in one place for every package.

Extensions are compiled on first use with :func:`torch.utils.cpp_extension.load` and cached per
torch version under ``$MEMFIT_CACHE_DIR`` (default ``~/.cache/memfit``), so later processes load
them in well under a second. Building needs a C++ compiler and ``ninja`` (``pip install ninja``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from memfit.errors import NativeBuildError

NATIVE_SOURCE_DIR = Path(__file__).parent


def cache_dir() -> Path:
    """Where built extensions live; one folder per torch version and Python version."""
    import torch

    root = Path(os.environ.get("MEMFIT_CACHE_DIR", Path.home() / ".cache" / "memfit"))
    tag = f"torch-{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}".replace("+", "_")
    return root / "native" / tag


def _missing_toolchain() -> str | None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None and shutil.which("g++") is None:
        return f"no C++ compiler found ({compiler!r} or 'g++' on PATH); install one, e.g. 'apt-get install g++'"
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed; 'pip install ninja'"
    return None


def build_directory(name: str, sources: tuple[str | os.PathLike[str], ...]) -> Path:
    """Where ``name`` built from ``sources`` lives in the cache (its folder is also its module name)."""
    digest = hashlib.sha256(b"".join(Path(s).read_bytes() for s in sources)).hexdigest()[:12]
    return cache_dir() / f"{name}_{digest}"


@functools.cache
def load_extension(name: str, sources: tuple[str | os.PathLike[str], ...]) -> ModuleType:
    """Compile (once, cached) and import a C++ torch extension.

    The module name carries a hash of the sources, so an edited source is rebuilt instead of
    loading a stale cached build.

    Args:
        name: base name of the extension module.
        sources: C++ source files.

    Raises:
        NativeBuildError: no compiler or ninja, or the compilation failed; the message says which and what to install.
    """
    from torch.utils import cpp_extension

    paths = [Path(s) for s in sources]
    problem = _missing_toolchain()
    if problem:
        raise NativeBuildError(f"cannot build memfit's native extension {name!r}: {problem}")
    build_dir = build_directory(name, sources)
    module_name = build_dir.name
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(build_dir):
            return cpp_extension.load(
                name=module_name,
                sources=[str(p) for p in paths],
                build_directory=str(build_dir),
                # NDEBUG as in torch's own release build: its headers hold debug-only checks of state
                # that only a debug build of torch maintains.
                extra_cflags=["-O2", "-DNDEBUG"],
                verbose=os.environ.get("MEMFIT_NATIVE_VERBOSE") == "1",
            )
    except Exception as exc:  # compilation errors surface as RuntimeError/CalledProcessError
        raise NativeBuildError(
            f"building memfit's native extension {name!r} failed: {exc}. "
            f"Set MEMFIT_NATIVE_VERBOSE=1 to see the compiler output; the build folder is {build_dir}."
        ) from exc


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an OS file lock around torch's build, and clear a ``lock`` file a killed build left.

    torch's own build lock is a file whose existence is the lock: a process killed while it
    builds leaves it behind, and every later process then waits for it forever. An ``flock``
    is released by the kernel when its holder dies, so whoever holds ours knows that no build
    is running and that a torch ``lock`` file is stale.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock alone
        yield
        return
    with open(build_dir / "memfit-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cpu_sim_allocator() -> ModuleType:
    """The counting CPU allocator behind the cpu-sim backend."""
    return load_extension("memfit_cpu_sim_allocator", (NATIVE_SOURCE_DIR / "cpu_sim_allocator.cpp",))


def device_stats() -> ModuleType:
    """Reads an accelerator's live bytes without building the statistics dict (``allocated(index)``)."""
    return load_extension("memfit_device_stats", (NATIVE_SOURCE_DIR / "device_stats.cpp",))


@contextlib.contextmanager
def hidden_from_profilers() -> Iterator[None]:
    """Operators the calling thread runs inside the block are invisible to ``RecordFunction`` observers.

    memfit's own copies and views (swap traffic, the copy stream's worker) are not the program's
    operators; hiding them keeps the profiler's operator sequence the same with and without swaps.
    """
    switch = record_function_switch()
    previous = switch.set_record_function_enabled(False)
    try:
        yield
    finally:
        switch.set_record_function_enabled(previous)


class _NoSwitch:
    """Without a compiler there is no native recorder either (the profiler falls back to Python)."""

    @staticmethod
    def set_record_function_enabled(on: bool) -> bool:
        return True


@functools.cache
def record_function_switch() -> ModuleType | _NoSwitch:
    """What turns ``RecordFunction`` off and on for the calling thread (``set_record_function_enabled``).

    The cpu-sim extension when it can be built; otherwise a no-op, since then no native observer
    (the profiler's recorder) can be installed either.
    """
    try:
        return cpu_sim_allocator()
    except NativeBuildError:
        return _NoSwitch()
