"""The workload options of memfit's commands: ``--model``, ``--batch``, ``--seq``, ``--dtype`` and ``--layers``.

One word and one meaning each, the fields of :class:`memfit.workload.Workload`.

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

from memfit.workload import DTYPES, PRESETS

__all__ = ["WORKLOAD_HELP", "workload_option"]

WORKLOAD_HELP = {
    "model": f"The model: a reference Llama preset ({', '.join(PRESETS)}).",
    "batch": "Global batch: sequences per optimizer step.",
    "seq": "Tokens per sequence.",
    "dtype": "Training dtype of the parameters and activations.",
    "layers": "Transformer blocks of the model.",
}
"""What each workload word means, on every command."""


def workload_option(
    word: str,
    dest: str | None = None,
    *,
    default: int | str | None = None,
    required: bool = False,
    old_name: str | None = None,
    minimum: int = 1,
    default_text: str | None = None,
    prefix: str = "",
    note: str = "",
    dtypes: tuple[str, ...] | None = None,
) -> Callable[[Any], Any]:
    """The click option ``--<word>``: a ``model`` or ``dtype`` name, or an integer ``batch``, ``seq`` or ``layers``.

    A dtype is one of :data:`memfit.workload.DTYPES`' names; an integer is at least ``minimum``.

    Args:
        word: which option.
        dest: the parameter name the command receives (default: ``word``).
        default: the command's default (``None`` with ``required`` or when the command decides later).
        required: the command cannot run without it.
        old_name: an earlier name the command still parses (``--seq-len``).
        minimum: the smallest value accepted.
        default_text: how the help shows a default the command decides later ("the plan's, else 8").
        prefix: words before the meaning ("swap planner: ").
        note: words after it ("Overrides the preset's.", or the other models a command takes).
        dtypes: ``dtype`` only: the torch dtypes the command takes (``("bfloat16", "float32")``), under any of
            their names; default all.
    """
    if word not in WORKLOAD_HELP:
        raise ValueError(f"unknown workload option {word!r}: one of {', '.join(WORKLOAD_HELP)}")
    names = [f"--{word}", *([old_name] if old_name else []), dest or word]
    shown = default is not None and not required
    help_text = prefix + WORKLOAD_HELP[word] + (f" {note}" if note else "")
    help_text += f"  [default: {default_text}]" if default_text else ""
    if word == "model":
        kind: Any = str
    elif word == "dtype":
        kind = click.Choice(
            [name for name, (torch_name, _) in DTYPES.items() if dtypes is None or torch_name in dtypes]
        )
    else:
        kind = click.IntRange(minimum)
    return click.option(*names, type=kind, default=default, required=required, show_default=shown, help=help_text)
