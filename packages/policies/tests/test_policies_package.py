import importlib.metadata

import memfit_policies
from memfit.plugins import Hooks, build_plugin_manager


def test_registers_through_the_memfit_entry_point_group():
    hooks = Hooks(build_plugin_manager())
    info = next(i for i in hooks.plugin_infos() if i.name == "policies")
    assert info.distribution == "memfit-policies"
    assert info.version == memfit_policies.__version__ == importlib.metadata.version("memfit-policies")


def test_imports_and_reads_traces_without_torch():
    import subprocess
    import sys

    code = (
        "import sys, memfit_policies, memfit.plan, memfit.trace, memfit.plugins\n"
        "memfit.plugins.get_hooks().plugin_infos()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
