"""Running a user's training command in this process, so memfit can watch it unmodified."""

from __future__ import annotations

import contextlib
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path

from memfit.errors import MemfitError


@contextlib.contextmanager
def script_argv(argv: list[str]) -> Iterator[None]:
    """Give the script the ``sys.argv`` it expects, and restore ours after."""
    saved = sys.argv[:]
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


def run_python_command(command: tuple[str, ...], cli_name: str = "memfit run") -> None:
    """Run ``python script.py args`` or ``python -m module args`` in this process.

    Raises:
        MemfitError: the command is not a Python script or module invocation.
    """
    args = list(command)
    if args and Path(args[0]).name.startswith("python"):
        args = args[1:]
    if not args:
        raise MemfitError(f"give the training command after --, e.g. {cli_name} -- python train.py")
    if args[0] == "-m":
        if len(args) < 2:
            raise MemfitError(f"-m needs a module name, e.g. {cli_name} -- python -m mypkg.train")
        with script_argv(args[1:]):
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    script = Path(args[0])
    if script.suffix != ".py" or not script.is_file():
        raise MemfitError(
            f"{args[0]!r} is not a Python script; memfit runs training in-process: {cli_name} -- python train.py ..."
        )
    with script_argv([str(script), *args[1:]]):
        sys.path.insert(0, str(script.resolve().parent))
        try:
            runpy.run_path(str(script), run_name="__main__")
        finally:
            sys.path.pop(0)
