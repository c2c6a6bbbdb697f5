"""Running a user's training command in this process, so memfit can watch it unmodified.

A command is checked before anything runs (:meth:`PythonCommand.parse`), so a mistyped script
name is an error, not a run of nothing; so is a file the run would write at its end
(:func:`check_writable`). After the script, memfit still reports what it saw, whatever the script
did: returned, called ``sys.exit``, raised (the script's traceback follows the report, as Python
would print it), was sent SIGTERM (:class:`Termination`), or closed its standard output
(:func:`console_after_script`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import runpy
import shutil
import signal
import sys
import threading
import traceback
import zipfile
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
    """``python script.py args`` or ``python -m module args``, checked, ready to run in this process.

    Example:
        ```python
        import os
        import tempfile
        from memfit.cli.scripts import PythonCommand
        from memfit.errors import MemfitError

        with tempfile.TemporaryDirectory() as folder:
            script = os.path.join(folder, "train.py")
            with open(script, "w") as file:
                file.write("import sys; print('training', sys.argv[1:]); sys.exit(3)")
            command = PythonCommand.parse(["python", script, "--steps", "2"])   # checked before anything runs
            command.argv[1:]                    # ('--steps', '2')
            command.run()                       # 3, the script's exit code (it printed: training ['--steps', '2'])
        PythonCommand.parse(["python", "-m", "json.tool", "data.json"]).module   # 'json.tool'
        try:
            PythonCommand.parse(["python", "no_such_script.py"])
        except MemfitError as exc:
            print(exc)                          # no_such_script.py: no such file (looked in ...)
        ```
    """

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
        if args[0].startswith("-"):  # python's own options: this process's interpreter is already running
            raise MemfitError(
                f"python option {args[0]} cannot be given: memfit runs the script in this process. "
                f"Give the script, or -m and a module: {cli_name} -- python train.py ..."
            )
        script = Path(args[0])
        if not script.exists():
            program = shutil.which(args[0]) if os.sep not in args[0] else None
            if program is not None:  # bash, torchrun, ...: not something to run in this Python process
                raise MemfitError(
                    f"{args[0]!r} is not a Python script but a program ({program}); memfit runs Python training "
                    f"in this process: {cli_name} -- python train.py ..."
                )
            raise MemfitError(f"{args[0]}: no such file (looked in {Path.cwd()})")
        _check_runnable(script, cli_name)
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
                if self.script.is_file() and not zipfile.is_zipfile(self.script):
                    # as python does for a script; run_path puts a directory or a zip archive there itself
                    sys.path.insert(0, str(self.script.resolve().parent))
                    try:
                        runpy.run_path(str(self.script), run_name="__main__")
                    finally:
                        sys.path.pop(0)
                else:
                    runpy.run_path(str(self.script), run_name="__main__")
        except SystemExit as exc:
            return exc.code
        return None


_HEAD_BYTES = 8192


def _check_runnable(script: Path, cli_name: str) -> None:
    """Refuse what ``python SCRIPT`` could not run: any file Python can (with or without ``.py``) passes.

    That is Python source, compiled bytecode, a zip archive or a directory with ``__main__.py``.
    """
    usage = f"{cli_name} -- python train.py ..."
    if script.is_dir():
        if not (script / "__main__.py").is_file():
            raise MemfitError(f"{script} is a directory without a __main__.py; give the script to run: {usage}")
        return
    with script.open("rb") as file:
        head = file.read(_HEAD_BYTES)
    if head.startswith(importlib.util.MAGIC_NUMBER) or zipfile.is_zipfile(script):
        return
    if head.startswith(b"#!") and b"python" not in head.split(b"\n", 1)[0]:
        interpreter = head.split(b"\n", 1)[0][2:].decode(errors="replace").strip()
        raise MemfitError(
            f"{script} is a script for {interpreter}, not Python; memfit runs Python training in this process: {usage}"
        )
    if b"\0" in head:
        raise MemfitError(
            f"{script} is a binary file, not a Python script; memfit runs Python training in this process: {usage}"
        )


def check_writable(path: Path) -> None:
    """Refuse a file a run would write at its end (a report) but could not: checked before the run, not after it.

    Raises:
        MemfitError: the path is a directory, its folder is missing or not a folder, or it cannot be written.
    """
    folder = path.parent
    if path.is_dir():
        raise MemfitError(f"{path} is a directory; give a file name in it, e.g. {path / 'report.json'}")
    if not folder.exists():
        raise MemfitError(f"{folder} does not exist; create it first (mkdir -p {folder}) or give another path")
    if not folder.is_dir():
        raise MemfitError(f"{folder} is not a directory")
    writable = os.access(path, os.W_OK) if path.exists() else os.access(folder, os.W_OK | os.X_OK)
    if not writable:
        raise MemfitError(f"cannot write {path}: permission denied; give a path you can write")


class Termination:
    """SIGTERM (what batch schedulers send before SIGKILL) handled as Python handles Ctrl-C.

    Python's default for SIGTERM ends the process at once: no summary, no report. Here, until
    :meth:`script_finished`, SIGTERM raises ``SystemExit(143)`` in the main thread, so the script
    stops as at a ``sys.exit`` (its ``finally`` blocks run) and memfit reports what it measured;
    after, while memfit writes its summary and report, it is only remembered (:attr:`received`),
    so the report is not cut short. 143 is 128 + 15, as a shell reports SIGTERM.
    The previous handler is restored on exit. Outside the main thread (signals cannot be
    handled there) it does nothing.

    Example:
        ```python
        import signal
        import threading
        from memfit.cli.scripts import Termination

        if threading.current_thread() is threading.main_thread():   # where Python handles signals
            with Termination() as termination:
                try:
                    signal.raise_signal(signal.SIGTERM)   # the scheduler's SIGTERM while the script runs ...
                except SystemExit as exc:
                    print(exc.code)                       # 143: ... stops it as sys.exit(143) would
                termination.script_finished()
                signal.raise_signal(signal.SIGTERM)       # while memfit writes its report: only remembered
                print(termination.received)               # True
        ```
    """

    exit_code = 128 + signal.SIGTERM

    def __init__(self) -> None:
        self.received = False
        self._raising = True
        self._installed = False
        self._previous: Any = None

    def __enter__(self) -> Termination:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:  # the previous handler may be None (set outside Python): restored all the same
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def script_finished(self) -> None:
        """From now on SIGTERM is only remembered: memfit is writing what the run measured."""
        self._raising = False

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True
        if self._raising:
            raise SystemExit(self.exit_code)


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
