"""``benchmarks/hazards.py``: strict cpu-sim catches each known-bad synchronisation; the shipped runtimes are clean."""

import json
from pathlib import Path

import pytest

from tests.conftest import run_python

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hazards.py"


def test_every_known_bad_synchronisation_is_caught_and_the_shipped_runtimes_are_clean():
    result = run_python(str(SCRIPT), env_extra={"MEMFIT_CALIBRATE": "0"})  # never calibrates the user's cache
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["clean"] and all(s["exact"] and s["hazards"] == 0 for s in report["shipped"])
    assert {v["name"] for v in report["variants"]} >= {"swap_release_without_wait", "offload_store_source_dropped"}
    assert all(v["caught"] for v in report["variants"]), report["variants"]
