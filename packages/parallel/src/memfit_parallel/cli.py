"""``memfit parallel``: choose a parallel configuration by simulation (``plan``) and train with it (``run``)."""

from __future__ import annotations

import click


@click.group()
def parallel():
    """Choose N-D parallelism by simulation (plan) and train the reference model with it (run)."""


from memfit_parallel.launch import run  # noqa: E402

parallel.add_command(run)
