"""pytest's configuration for every test of the repository (``packages/*/tests`` and ``tests/``)."""

import os


def pytest_xdist_auto_num_workers(config):
    """Workers for ``-n auto`` (pyproject's addopts): one per core this process may use, at most 4.

    Each worker imports torch and many tests start processes of their own (``memfit run``, torchrun
    ranks), so more workers than that add memory, not speed. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` or
    ``-n N`` choose otherwise; ``-n 0`` runs the tests in this process.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores))
