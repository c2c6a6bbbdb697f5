"""Build and load memfit's small native (C++) extensions, in one place for every package.

Extensions are compiled on first use with :func:`torch.utils.cpp_extension.load` into a folder
under ``$MEMFIT_CACHE_DIR/native`` (default ``~/.cache/memfit``) keyed by **the torch build**
(its version and git commit, its C++ ABI and CUDA version), the Python version and extension
suffix, the compiler and a hash of the sources. Later processes import the built library
directly, in well under a second, without ninja. Building needs a C++ compiler and ``ninja``
(``pip install ninja``).

Why keyed by the torch build and not by the environment: a library built against one copy of a
torch build runs against any other copy of it (it names torch's libraries by their sonames, which
the process has loaded with ``import torch``), so every virtualenv with the same torch shares one
build: a machine builds once (CI's per-package environments used to build once each, a minute a
time). Why the library is imported directly once built: torch's builder (a ninja file) names the
include folders of the torch that runs it, so two virtualenvs that both called it on one folder
rewrote each other's ninja file and rebuilt on every switch (about 10 rebuilds in 12 minutes with
two venvs in use). The builder runs only where no build is stamped for this torch build, once,
under a lock; a stamp written after a successful build records what it was built for, and only a
build whose stamp matches is loaded.

Why the ownership checks: a native library runs with the user's rights. memfit loads one only from
folders and files owned by the user (or root) that no one else can write, so a cache in a shared
place (``MEMFIT_CACHE_DIR=/tmp/...``) cannot be used to plant a library.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from memfit.errors import NativeBuildError

NATIVE_SOURCE_DIR = Path(__file__).parent
STAMP = "memfit-build.json"
"""Written into a build folder after a successful build: what the library was built for."""


def cache_root() -> Path:
    """``$MEMFIT_CACHE_DIR`` (default ``~/.cache/memfit``)."""
    return Path(os.environ.get("MEMFIT_CACHE_DIR", Path.home() / ".cache" / "memfit"))


def environment_identity() -> dict[str, str]:
    """What a build is valid for: the torch build, the Python ABI and the compiler (not where they are installed)."""
    import torch

    return {
        "torch_version": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", "") or "",
        "torch_cuda": str(torch.version.cuda),
        "cxx11_abi": str(bool(torch._C._GLIBCXX_USE_CXX11_ABI)),
        "python": sys.version.split()[0],
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX") or "",
        "cxx": os.environ.get("CXX", "c++"),
    }


def cache_dir() -> Path:
    """Where the extensions built for this torch build and Python live (shared by every environment that has them)."""
    import torch

    identity = environment_identity()
    env = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:10]
    tag = f"torch-{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}".replace("+", "_")
    return cache_root() / "native" / f"{tag}-{env}"


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


def _check_private(path: Path) -> None:
    """Refuse ``path`` unless it is owned by this user (or root) and writable by no one else."""
    if not hasattr(os, "getuid"):  # not POSIX: no owners to check
        return
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif info.st_uid not in (os.getuid(), 0):
        problem = f"is owned by another user (uid {info.st_uid})"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is writable by other users (mode {stat.filemode(info.st_mode)})"
    else:
        return
    raise NativeBuildError(
        f"memfit does not load native code from {path}: it {problem}, so someone else could replace the library. "
        "Set MEMFIT_CACHE_DIR to a folder only you can write (the default is ~/.cache/memfit), or fix its "
        "owner and permissions (chmod go-w)."
    )


def _private_dirs(build_dir: Path) -> None:
    """Make the folders from ``native/`` down to ``build_dir`` (mode 0700) and check each is private."""
    native_root = cache_root() / "native"
    native_root.parent.mkdir(parents=True, exist_ok=True)
    for folder in (native_root, build_dir.parent, build_dir):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        _check_private(folder)


def _library(build_dir: Path) -> Path:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for candidate in (build_dir / f"{build_dir.name}{suffix}", build_dir / f"{build_dir.name}.so"):
        if candidate.exists():
            return candidate
    return build_dir / f"{build_dir.name}.so"


def _built_for_here(build_dir: Path) -> Path | None:
    """The library in ``build_dir`` if a stamp says it was built for this torch build and Python, else None."""
    try:
        stamp = json.loads((build_dir / STAMP).read_text())
    except (OSError, ValueError):
        return None
    library = _library(build_dir)
    if stamp != environment_identity() or not library.exists():
        return None
    _check_private(build_dir / STAMP)
    _check_private(library)
    return library


def _import_library(module_name: str, library: Path) -> ModuleType:
    """Import a built extension module from its file (what torch's ``load`` does after its build)."""
    spec = importlib.util.spec_from_file_location(module_name, library)
    if spec is None or spec.loader is None:
        raise NativeBuildError(f"cannot import memfit's native extension from {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load_extension(name: str, sources: tuple[str | os.PathLike[str], ...]) -> ModuleType:
    """Import a C++ torch extension built for this torch build, compiling it first if there is none.

    The module name carries a hash of the sources, so an edited source is rebuilt instead of
    loading a stale cached build. Concurrent processes (torchrun ranks) build once: the others wait
    for the first and then import its library.

    Args:
        name: base name of the extension module.
        sources: C++ source files.

    Raises:
        NativeBuildError: no compiler or ninja, the compilation failed, or the cache is not private to
            this user; the message says which and what to do.
    """
    import torch  # noqa: F401  (the library links against the torch loaded in this process)

    build_dir = build_directory(name, sources)
    module_name = build_dir.name
    _private_dirs(build_dir)
    library = _built_for_here(build_dir)
    if library is None:
        with _build_lock(build_dir):
            library = _built_for_here(build_dir)  # another process may have built it while this one waited
            if library is None:
                return _build(name, sources, build_dir)
    return _import_library(module_name, library)


def _build(name: str, sources: tuple[str | os.PathLike[str], ...], build_dir: Path) -> ModuleType:
    """Compile ``sources`` into ``build_dir`` with torch's builder and stamp the result; the module."""
    from torch.utils import cpp_extension

    problem = _missing_toolchain()
    if problem:
        raise NativeBuildError(f"cannot build memfit's native extension {name!r}: {problem}")
    (build_dir / STAMP).unlink(missing_ok=True)
    # a first build takes about a minute on a 2-core machine: say why the process waits
    print(f"memfit: compiling the native extension {name!r} for this torch build (once) ...", file=sys.stderr)
    try:
        module = cpp_extension.load(
            name=build_dir.name,
            sources=[str(Path(s)) for s in sources],
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
    for path in build_dir.iterdir():  # what the compiler wrote follows the umask: keep it private
        with contextlib.suppress(OSError):
            path.chmod(path.stat().st_mode & ~(stat.S_IWGRP | stat.S_IWOTH))
    tmp = build_dir / f"{STAMP}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(environment_identity(), sort_keys=True))
    os.replace(tmp, build_dir / STAMP)  # the stamp appears only once the library is complete
    return module


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
    fd = os.open(build_dir / "memfit-build.lock", os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as handle:
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
