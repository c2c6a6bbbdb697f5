"""The workload options of memfit's commands: ``--batch``, ``--seq`` and ``--layers``, one word and one meaning each.

Every command that builds a model or sizes a step takes them through :func:`workload_option`, so
the words, their meaning and their help text are written once (``tests/test_meta.py`` checks the
commands). A command gives its own default and, where it had one, the earlier name it still parses.

Example:
    ```python
    import click
    from memfit.cli.options import workload_option

    @click.command()
    @workload_option("batch", default=8)
    @workload_option("seq", "seq_len", default=128, old_name="--seq-len")
    def train(batch, seq_len):
        click.echo(f"{batch} x {seq_len}")
    ```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

__all__ = ["WORKLOAD_HELP", "workload_option"]

WORKLOAD_HELP = {
    "batch": "Global batch: sequences per optimizer step.",
    "seq": "Tokens per sequence.",
    "layers": "Transformer blocks of the model.",
}
"""What each workload word means, on every command."""


def workload_option(
    word: str,
    dest: str | None = None,
    *,
    default: int | None = None,
    required: bool = False,
    old_name: str | None = None,
    minimum: int = 1,
    default_text: str | None = None,
    prefix: str = "",
    note: str = "",
) -> Callable[[Any], Any]:
    """The click option ``--<word>`` (``batch``, ``seq`` or ``layers``), an integer of at least ``minimum``.

    Args:
        word: which option.
        dest: the parameter name the command receives (default: ``word``).
        default: the command's default (``None`` with ``required`` or when the command decides later).
        required: the command cannot run without it.
        old_name: an earlier name the command still parses (``--seq-len``).
        minimum: the smallest value accepted.
        default_text: how the help shows a default the command decides later ("the plan's, else 8").
        prefix: words before the meaning ("swap planner: ").
        note: words after it ("Overrides the preset's.").
    """
    if word not in WORKLOAD_HELP:
        raise ValueError(f"unknown workload option {word!r}: one of {', '.join(WORKLOAD_HELP)}")
    names = [f"--{word}", *([old_name] if old_name else []), dest or word]
    shown = default is not None and not required
    help_text = prefix + WORKLOAD_HELP[word] + (f" {note}" if note else "")
    help_text += f"  [default: {default_text}]" if default_text else ""
    return click.option(
        *names, type=click.IntRange(minimum), default=default, required=required, show_default=shown, help=help_text
    )
