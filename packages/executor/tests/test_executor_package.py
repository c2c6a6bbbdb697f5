import importlib.metadata

import memfit_executor
from memfit.plugins import Hooks, build_plugin_manager


def test_registers_through_the_memfit_entry_point_group():
    hooks = Hooks(build_plugin_manager())
    info = next(i for i in hooks.plugin_infos() if i.name == "executor")
    assert info.distribution == "memfit-executor"
    assert info.version == memfit_executor.__version__ == importlib.metadata.version("memfit-executor")
