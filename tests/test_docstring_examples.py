"""Every public class carries a runnable example (issue 32 item 6), and every example runs.

The examples are the fenced ```python blocks of the class docstrings (a Google-style "Example:"
section). Each runs on its own, in fresh globals, as a reader would paste it; a block whose first line
is ``# needs: <something>`` (``# needs: npu``) runs only where that is available. The classes are every
public class of every package: defined in a module whose dotted path has no part starting with an
underscore, under a name without one; exceptions need no example.
"""

import importlib
import inspect
import linecache
import pkgutil
import re
import textwrap

import pytest

PACKAGES = (
    "memfit", "memfit_profiler", "memfit_simulator", "memfit_policies", "memfit_executor", "memfit_npu",
    "memfit_offload", "memfit_parallel", "memfit_faulttol",
)  # fmt: skip
"""Packages whose exported classes need an example: all of them."""
FENCE = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```[ \t]*$", re.S | re.M)
NEEDS = re.compile(r"#\s*needs:\s*(\S+)")


def _npu() -> bool:
    from memfit_npu import npu_available

    return npu_available()


AVAILABLE = {"npu": _npu}
"""What a ``# needs:`` line may name, and how to tell whether this machine has it."""


def documented_classes():
    """``{module.Class: class}``: the public non-exception classes of ``PACKAGES``, package by package."""
    found = {}
    for package in PACKAGES:
        root = importlib.import_module(package)
        modules = [
            root,
            *(importlib.import_module(m.name) for m in pkgutil.walk_packages(root.__path__, f"{package}.")),
        ]
        for module in modules:
            if any(part.startswith("_") for part in module.__name__.split(".")):
                continue
            for name, value in sorted(vars(module).items()):
                if name.startswith("_") or not inspect.isclass(value) or value.__module__ != module.__name__:
                    continue
                if not issubclass(value, BaseException):
                    found[f"{module.__name__}.{name}"] = value
    return found


def examples(cls):
    """The dedented ```python blocks of ``cls``'s own docstring."""
    return [textwrap.dedent(block) for _, block in FENCE.findall(inspect.getdoc(cls) or "")]


def example_params(classes):
    """One ``pytest.param`` per block, named by its class (``memfit_profiler.OnlineProfiler``; ``-2`` for a second)."""
    params = []
    for name, cls in classes.items():
        blocks = examples(cls)
        for i, block in enumerate(blocks):
            params.append(pytest.param(block, id=name if len(blocks) == 1 else f"{name}-{i + 1}"))
    return params


CLASSES = documented_classes()
BLOCKS = example_params(CLASSES)


def test_every_public_class_has_an_example():
    missing = [name for name, cls in CLASSES.items() if not examples(cls)]
    assert not missing, (
        f"these classes have no ```python block in their docstring: {', '.join(missing)}; give each an 'Example:' "
        "section with a short runnable example whose results are trailing comments"
    )


@pytest.mark.parametrize("block", BLOCKS)
def test_docstring_example_runs(block, request):
    first = block.lstrip().splitlines()[0] if block.strip() else ""
    if needs := NEEDS.fullmatch(first.strip()):
        need = needs.group(1)
        if need not in AVAILABLE:
            pytest.skip(f"the example needs {need!r}, which this test cannot check for")
        if not AVAILABLE[need]():
            pytest.skip(f"the example needs {need!r}, which this machine does not have")
    # a failing example's traceback shows its lines under the class's name (pytest reads them after the test)
    filename = f"<docstring example of {request.node.callspec.id}>"
    linecache.cache[filename] = (len(block), None, block.splitlines(keepends=True), filename)
    exec(compile(block, filename, "exec"), {"__name__": "__docstring_example__"})
