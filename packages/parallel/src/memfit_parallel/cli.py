"""``memfit parallel``: choose a parallel configuration by simulation (``plan``) and train with it (``run``)."""

from __future__ import annotations

import click

from memfit_parallel.launch import run


@click.group()
def parallel():
    """Choose N-D parallelism by simulation (plan) and train the reference model with it (run)."""


parallel.add_command(run)
