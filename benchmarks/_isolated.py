"""Run one benchmark trial in a process of its own and read back the JSON object it prints last.

A fresh process per trial means one trial's memory (caches, the allocator's count, the peak
resident size) never shows up in the next one's figures.
"""

from __future__ import annotations

import json
import subprocess
import sys


def run_trial(script: str, args: list[str], what: str, timeout_s: int = 1800) -> dict:
    """``python script *args`` in a new process; its last line starting with ``{`` as a dict."""
    out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])
