"""Running a user's training command in this process, so memfit can watch it unmodified.

A command is checked before anything runs (:meth:`PythonCommand.parse`), so a mistyped script
name is an error, not a run of nothing. After the script, memfit still reports what it saw,
whatever the script did: returned, called ``sys.exit``, raised (the script's traceback follows
the report, as Python would print it), or closed its standard output
(:func:`console_after_script`).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rich.console import Console

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


@dataclass(frozen=True)
class PythonCommand:
    """``python script.py args`` or ``python -m module args``, checked, ready to run in this process."""

    argv: tuple[str, ...]
    """What ``sys.argv`` is while it runs."""
    script: Path | None = None
    module: str | None = None

    @classmethod
    def parse(cls, command: tuple[str, ...] | list[str], cli_name: str = "memfit run") -> PythonCommand:
        """Check a command line before anything runs.

        Raises:
            MemfitError: no command, a script that does not exist or is not Python, ``-m`` without a module.
        """
        args = list(command)
        if args and Path(args[0]).name.startswith("python"):
            args = args[1:]
        if not args:
            raise MemfitError(f"give the training command after --, e.g. {cli_name} -- python train.py")
        if args[0] == "-m":
            if len(args) < 2:
                raise MemfitError(f"-m needs a module name, e.g. {cli_name} -- python -m mypkg.train")
            return cls(argv=tuple(args[1:]), module=args[1])
        script = Path(args[0])
        if script.suffix != ".py" or script.is_dir():
            raise MemfitError(
                f"{args[0]!r} is not a Python script; memfit runs training in this process: "
                f"{cli_name} -- python train.py ..."
            )
        if not script.is_file():
            raise MemfitError(f"{args[0]}: no such file (looked in {Path.cwd()})")
        return cls(argv=(str(script), *args[1:]), script=script)

    def run(self) -> int | str | None:
        """Run it; returns the code the script passed to ``sys.exit`` (``None`` when it simply returned).

        Whatever else the script raises propagates: see :func:`print_script_traceback`.
        """
        try:
            with script_argv(list(self.argv)):
                if self.module is not None:
                    runpy.run_module(self.module, run_name="__main__", alter_sys=True)
                    return None
                assert self.script is not None
                sys.path.insert(0, str(self.script.resolve().parent))
                try:
                    runpy.run_path(str(self.script), run_name="__main__")
                finally:
                    sys.path.pop(0)
        except SystemExit as exc:
            return exc.code
        return None


@contextlib.contextmanager
def _open_stream(current: IO[str] | None, fd: int) -> Iterator[IO[str] | None]:
    """``current`` if the script left it open, else a new file on the same descriptor (closed after), else ``None``."""
    if current is not None and not current.closed:
        yield current
        return
    try:
        reopened = os.fdopen(os.dup(fd), "w", closefd=True)
    except OSError:
        yield None
        return
    with reopened:
        yield reopened


@contextlib.contextmanager
def console_after_script() -> Iterator[Console]:
    """A console on standard output, even if the script closed ``sys.stdout``.

    Then it writes to file descriptor 1, or else to standard error, or else nowhere.
    """
    with _open_stream(sys.stdout, 1) as out, _open_stream(sys.stderr, 2) as err, open(os.devnull, "w") as null:
        yield Console(file=out or err or null)


def print_script_traceback(exc: BaseException) -> None:
    """Print the script's exception to standard error as Python would, from the script's own frames on.

    The frames of memfit, click and runpy that called the script are left out: they are not the user's.
    """
    tb = exc.__traceback__
    while tb is not None and _is_machinery(tb.tb_frame.f_globals):
        tb = tb.tb_next
    with _open_stream(sys.stderr, 2) as stream:
        if stream is not None:
            traceback.print_exception(type(exc), exc, tb, file=stream)
            stream.flush()


def _is_machinery(frame_globals: dict[str, Any]) -> bool:
    name = str(frame_globals.get("__name__", ""))
    return name == "runpy" or name.startswith(("memfit", "click"))
