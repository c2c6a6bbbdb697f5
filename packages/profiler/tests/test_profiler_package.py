import importlib.metadata

import memfit_profiler
from memfit.plugins import Hooks, build_plugin_manager


def test_registers_through_the_memfit_entry_point_group():
    hooks = Hooks(build_plugin_manager())
    info = next(i for i in hooks.plugin_infos() if i.name == "profiler")
    assert info.distribution == "memfit-profiler"
    assert info.version == memfit_profiler.__version__ == importlib.metadata.version("memfit-profiler")
