"""Every recipe script in docs/recipes runs as a user would run it."""

import pytest

from .conftest import REPO, run_python

RECIPES = sorted((REPO / "docs" / "recipes").glob("*.py"))
EXPECTED_OUTPUT = {
    "write_a_plugin.py": ["allocated 32 MiB after the plugin dropped the cache; cache entries left: 0"],
    "profile_a_run.py": ["-> GenPolicy", "-> Stable", "Stable     sequence 2 (new)", "trace saved and reloaded"],
    "plan_swaps.py": ["activations swapped", "plan saved and reloaded"],
    "plan_from_a_simulation.py": ["llama2-7b on h100", "(within budget: True)", "plan was bound: 0"],
    "recompute_under_a_budget.py": [
        "(within budget: True)",
        "bit-identical to training without memfit: True",
        "sac plan: checkpoint",
    ],
    "offload_a_training_step.py": ["(within budget: True)", "losses and parameters bit-identical to eager: True"],
    "offload_a_kv_cache.py": ["with KVOffload", "decoded: True"],
    "train_under_a_budget.py": ["(within budget: True)", "bit-identical to training without memfit: True"],
    "choose_a_parallel_configuration.py": [
        "prediction off by",
        "fits in 95 GiB: True",
        "FSDP 8, bfloat16: 160.1 GiB per GPU (fits: False)",
        "FSDP 8, swap, bfloat16: 93.0 GiB per GPU (fits: True)",
        "FSDP 8, Auto-SAC 50%, bfloat16: 101.6 GiB per GPU (fits: False)",
        "ParallelConfig.load reads back: True",
    ],
    "simulate_fault_tolerance.py": [
        "fault-free plan: dp=4 pp=[4, 4, 4, 4]",
        "decision: reparallelize",
        "adaptive vs always-reconfigure",
    ],
    "recover_a_live_run.py": [
        "ledger: every sample trained exactly once: True",
        "losses match the one-process oracle: True",
        "decision at step 2: reparallelize by memfit-faulttol",
    ],
    "simulate_your_model.py": ["prediction off by", "does NOT fit in 80 GiB", "1436 of 1436 operators attributed"],
}


def test_every_recipe_is_checked():
    assert RECIPES, "no recipe scripts found"
    assert {r.name for r in RECIPES} == set(EXPECTED_OUTPUT)


@pytest.mark.parametrize("script", RECIPES, ids=lambda p: p.name)
def test_recipe_runs(script):
    result = run_python(str(script))
    assert result.returncode == 0, result.stderr
    for line in EXPECTED_OUTPUT[script.name]:
        assert line in result.stdout


@pytest.mark.parametrize("script", RECIPES, ids=lambda p: p.name)
def test_recipe_page_includes_its_script(script):
    pages = "\n".join(p.read_text() for p in (REPO / "docs" / "recipes").glob("*.md"))
    assert f'--8<-- "docs/recipes/{script.name}"' in pages
