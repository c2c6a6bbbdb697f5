"""Meta-tests: every hookspec is documented and tested; the README and CI agree; collecting tests measures nothing."""

import os
import re
import subprocess
import sys

import pytest
from memfit.hookspecs import HOOKSPEC_CLASSES, hook_names

from .conftest import REPO

HOOKS_PAGE = REPO / "docs" / "plugins" / "hooks.md"


def all_test_sources():
    return "\n".join(p.read_text() for p in REPO.glob("**/test_*.py") if ".venv" not in p.parts)


@pytest.mark.parametrize("hook", hook_names())
def test_hookspec_is_documented(hook):
    page = HOOKS_PAGE.read_text()
    assert re.search(rf"^### `{hook}\(", page, re.M), f"docs/plugins/hooks.md needs a '### `{hook}(...)`' heading"
    spec = next(getattr(cls, hook) for cls in HOOKSPEC_CLASSES if hasattr(cls, hook))
    assert "@hookimpl" in spec.__doc__, f"{hook}'s docstring must carry a complete example plugin"


@pytest.mark.parametrize("hook", hook_names())
def test_hookspec_has_a_test(hook):
    assert re.search(rf"def test_hook_{hook}\b", all_test_sources()), f"write a test named test_hook_{hook}"


def test_ci_runs_the_readme_test_command_verbatim():
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)```", readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0], re.S)
    lines = [line for block in commands for line in block.strip().splitlines() if not line.startswith("#")]
    assert len(lines) == 2, f"the quickstart must be exactly two commands, found {lines}"
    ci = (REPO / ".ci" / "run").read_text()
    assert lines[1] in ci.splitlines(), "the README's test command must appear verbatim as a line of .ci/run"


def test_no_merge_conflict_is_left_in_the_tracked_files():
    """A conflict resolved in the wrong file once landed in docs/benchmarks.md; mkdocs renders it without a word."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=False).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)
    left = []
    for name in tracked:
        path = REPO / name
        if path.suffix in {".py", ".md", ".toml", ".yml", ".yaml", ".txt", ".cfg", ".sh"} and path.is_file():
            if marker.search(path.read_text(errors="replace")):
                left.append(name)
    assert not left, f"merge conflict markers in {left}: resolve them"


@pytest.mark.slow
def test_collecting_the_tests_measures_nothing_and_writes_nothing_to_the_memfit_cache(tmp_path):
    """Importing a test module never measures the machine or writes the user's cache.

    The conftests' ``MEMFIT_CALIBRATE=0`` reaches tests, not module import: a configuration planned at
    module level (``auto_sac`` in the parallel launch tests) once calibrated the CPU's time model during
    collection, wrote the calibration and ``cpu_spec.json`` into the cache, and on a busy machine its
    warning became a collection error. Whatever a module measures or builds (a calibration, the CPU spec,
    the copy bandwidth, a native extension) lands in the cache: collecting into an empty one leaves it empty.
    """
    cache = tmp_path / "memfit-cache"
    cache.mkdir()
    env = {**os.environ, "MEMFIT_CACHE_DIR": str(cache)}
    env.pop("MEMFIT_CALIBRATE", None)  # what a user has: the CPU is calibrated on first use
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert collected.returncode == 0, f"collection failed:\n{collected.stdout[-4000:]}\n{collected.stderr[-2000:]}"
    assert re.search(r"^\d+ tests collected", collected.stdout, re.M), collected.stdout[-2000:]
    written = sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))
    assert written == [], f"collecting the tests wrote {written} into the memfit cache: measure in a fixture or test"


def _declared_memfit_distributions(pyproject):
    """The memfit distributions a package's metadata names: its dependencies and every extra's."""
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {re.match(r"[A-Za-z0-9_.-]+", r).group().lower().replace("_", "-") for r in requirements}


def _imported_memfit_distributions(src):
    """``{distribution: [file:line, ...]}`` for every import of another memfit package under ``src``, guarded or not."""
    import ast

    found = {}
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top == "memfit" or top.startswith("memfit_"):
                    dist = "memfit" if top == "memfit" else top.replace("_", "-")
                    found.setdefault(dist, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


@pytest.mark.parametrize("package", sorted(p.name for p in (REPO / "packages").iterdir() if p.is_dir()))
def test_every_import_of_another_memfit_package_is_declared(package):
    """A package that imports another memfit package names it in its dependencies or in an extra (with the
    error that says which extra to install where the import is guarded): the metadata is the package graph."""
    root = REPO / "packages" / package
    own = "memfit" if package == "core" else f"memfit-{package}"
    declared = _declared_memfit_distributions(root / "pyproject.toml") | {own}
    undeclared = {
        dist: where for dist, where in _imported_memfit_distributions(root / "src").items() if dist not in declared
    }
    assert not undeclared, f"{own} imports {sorted(undeclared)} without declaring them (at {undeclared})"


def test_core_imports_no_other_memfit_package():
    """Core is the base every package stands on: what it offers from another package (``memfit.swap``) comes
    through a hook, so no arrow runs back up and core installs and works alone."""
    imported = _imported_memfit_distributions(REPO / "packages" / "core" / "src")
    assert set(imported) <= {"memfit"}, {d: w for d, w in imported.items() if d != "memfit"}


def _runtime_imports(tree):
    """The modules a file imports when it runs (at its top or in a function), leaving out ``if TYPE_CHECKING:``."""
    import ast

    found = []

    def visit(node):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)  # a submodule taken by name
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _import_circles(src, top):
    """Sets of two or more modules of one package that import each other, directly or around a loop (Tarjan)."""
    import ast

    modules = {}
    for path in src.rglob("*.py"):
        parts = [top, *path.relative_to(src).with_suffix("").parts]
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {
        name: {m for m in _runtime_imports(ast.parse(path.read_text())) if m in modules and m not in (name, top)}
        for name, path in modules.items()
    }
    assert top in graph and len(graph) > 1, f"no modules of {top} found under {src}"
    index, low, stack, circles = {}, {}, [], []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                circles.append(sorted([v, *component]))

    for name in graph:
        if name not in index:
            connect(name)
    return circles


@pytest.mark.parametrize("package", sorted(p.name for p in (REPO / "packages").iterdir() if p.is_dir()))
def test_no_modules_of_a_package_import_each_other(package):
    """No import circles, not even through imports inside functions (how circles are usually papered over): each
    module can be read, and moved, knowing only what it imports. A package's ``__init__`` may gather its modules."""
    top = "memfit" if package == "core" else f"memfit_{package}"
    circles = _import_circles(REPO / "packages" / package / "src" / top, top)
    assert not circles, f"modules of {package} that import each other: {circles}; move what both need to one of them"


def _package_page(package):
    page = REPO / "docs" / "packages" / f"{package}.md"
    text = page.read_text()
    for included in re.findall(r'^--8<-- "([^"]+)"', text, re.M):  # a page that includes the package README
        text += (REPO / included).read_text()
    return page, text


def _page_opening(text):
    """A package page before its first ``## `` section: what the package is for, when to use it, its example."""
    return re.split(r"^## ", text, maxsplit=1, flags=re.M)[0]


@pytest.mark.parametrize("package", sorted(p.name for p in (REPO / "packages").iterdir() if p.is_dir()))
def test_every_package_has_a_page_the_index_links_with_its_known_limitations(package):
    """Issue 32: a package page opens with what the package is for, when to use it and one runnable example, before
    any ``## `` section (its known limitations among them). The example is a recipe the page includes, which
    tests/test_recipes.py runs, or, where the page includes none (a README on PyPI cannot include a file), its
    first ```python block, which this test runs as a script: a fragment using a ``model`` of the reader's fails."""
    page, text = _package_page(package)
    name = page.relative_to(REPO)
    assert re.search(r"^## Known limitations$", text, re.M), f"{name} needs a '## Known limitations'"
    index = (REPO / "docs" / "index.md").read_text()
    assert f"(packages/{package}.md)" in index, f"docs/index.md does not link docs/packages/{package}.md"

    opening = _page_opening(text)
    assert "**When to use it" in opening, f"{name} needs a '**When to use it.**' paragraph before its first '## '"
    recipes = [r for r in re.findall(r'^--8<-- "(docs/recipes/[^"]+\.py)"', opening, re.M) if (REPO / r).is_file()]
    blocks = re.findall(r"^```python\n(.*?)^```", opening, re.M | re.S)
    assert recipes or blocks, (
        f"{name} needs a runnable example before its first '## ' section: a recipe included with "
        f'--8<-- "docs/recipes/<name>.py", or a self-contained ```python block'
    )
    if not recipes:
        result = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"the example at the top of {name} does not run:\n{result.stderr}"


def test_presets_and_dtype_names_are_defined_once_in_core():
    """The reference model's presets and the dtype names live in ``memfit.workload``; a second list of them (four
    preset lists and three dtype tables once) drifts: faulttol's accepted five presets of seven."""
    import ast

    presets = {"tiny", "small", "medium", "llama2-7b", "llama3-8b", "llama3-70b", "llama3-405b"}
    dtypes = {"fp32", "bf16", "fp16"}
    found = []
    for path in sorted((REPO / "packages").glob("*/src/**/*.py")):
        if path.name == "workload.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                strings = {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
                if len(strings & presets) >= 3 or len(strings & dtypes) >= 2:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"a second list of presets or dtype names (use memfit.workload): {found}"


def test_a_workload_is_described_once_in_core():
    """What a training step trains (model, batch, sequence) is ``memfit.workload.Workload``: no other class of the
    packages holds a batch and a sequence length beside each other (six shapes once: ``Workload(global_batch,
    seq_len)``, ``RunRequest``, ``LiveOptions(batch, seq)``, ...), and no second "preset with room for a sequence"."""
    import ast

    batch_names, seq_names = {"batch", "global_batch", "batch_size"}, {"seq", "seq_len", "sequence_length"}
    token_stream = {"packages/core/src/memfit/models/data.py:SyntheticTokens"}  # the tokens a workload trains on
    shapes, widened = [], []
    for path in sorted((REPO / "packages").glob("*/src/**/*.py")):
        name = path.relative_to(REPO).as_posix()
        if name.endswith("memfit/workload.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and f"{name}:{node.name}" not in token_stream:
                annotated = [s.target for s in node.body if isinstance(s, ast.AnnAssign)]
                fields = {target.id for target in annotated if isinstance(target, ast.Name)}
                if fields & batch_names and fields & seq_names:
                    shapes.append(f"{name}:{node.lineno} class {node.name}")
            if isinstance(node, ast.Call) and any(k.arg == "max_seq_len" for k in node.keywords):
                if "max(" in ast.unparse(node):
                    widened.append(f"{name}:{node.lineno}")
    assert not shapes, f"a second description of a workload (hold a memfit.workload.Workload instead): {shapes}"
    assert not widened, f"a preset widened to a sequence outside memfit.workload (use Workload.llama_config): {widened}"


def _command_paths():
    """Every command path of the installed ``memfit`` CLI: ``[]`` (memfit itself), ``["demo"]`` and so on."""
    import click
    from memfit.cli.main import cli

    def walk(group, path):
        yield path
        if isinstance(group, click.Group):
            ctx = click.Context(group)
            for name in group.list_commands(ctx):
                yield from walk(group.get_command(ctx, name), [*path, name])

    return list(walk(cli, []))


def test_no_command_help_prints_a_literal_backslash_b():
    """click keeps the lines after a backspace as written; a raw docstring showed users its ``\\b``."""
    from click.testing import CliRunner
    from memfit.cli.main import cli

    shown = []
    for path in _command_paths():
        result = CliRunner().invoke(cli, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        if "\\b" in result.output:
            shown.append(" ".join(["memfit", *path]))
    assert not shown, f"--help prints a literal \\b: {shown}"


def test_the_cli_page_names_every_command():
    """docs/cli.md once lacked memfit parallel plan and both faulttol commands: every command the installed packages
    add is named there (as ``memfit <command> ...`` in code)."""
    page = (REPO / "docs" / "cli.md").read_text()
    names = [" ".join(["memfit", *path]) for path in _command_paths() if path]
    missing = [name for name in names if f"`{name}" not in page]
    assert not missing, f"docs/cli.md does not name {missing}"


def test_batch_seq_and_layers_are_one_word_each_on_the_command_line_and_the_earlier_names_still_parse():
    """``--batch``, ``--seq`` and ``--layers`` wherever a command takes them; ``--batch-size``, ``--seq-len``,
    ``--n-layers`` and ``--model-layers`` stay as second names, so the commands users wrote keep working."""
    import click
    from memfit.cli.main import cli

    def parsed(path, args):
        command = cli
        for name in path:
            command = command.get_command(click.Context(command), name)
        return command.make_context(path[-1], list(args)).params

    new = parsed(["demo"], ["--batch", "4", "--seq", "64", "--layers", "2"])
    assert (new["batch_size"], new["seq_len"], new["layers"]) == (4, 64, 2)
    old = parsed(["demo"], ["--batch-size", "4", "--seq-len", "64"])
    assert (old["batch_size"], old["seq_len"]) == (4, 64)
    assert parsed(["plan"], ["--budget", "1GiB", "--layers", "32"])["model_layers"] == 32
    assert parsed(["plan"], ["--budget", "1GiB", "--model-layers", "32"])["model_layers"] == 32
    assert parsed(["parallel", "run"], ["--nproc", "2", "--layers", "4"])["n_layers"] == 4
    assert parsed(["faulttol", "run"], ["--n-layers", "3"])["n_layers"] == 3


def test_every_commands_batch_seq_and_layers_come_from_the_shared_workload_options():
    """One meaning and one help text per word (``memfit.cli.options``), on every command that takes it."""
    import click
    from memfit.cli.main import cli
    from memfit.cli.options import WORKLOAD_HELP

    def commands(group, path):
        for name in group.list_commands(click.Context(group)):
            command = group.get_command(click.Context(group), name)
            if isinstance(command, click.Group):
                yield from commands(command, [*path, name])
            else:
                yield [*path, name], command

    seen, wrong = set(), []
    for path, command in commands(cli, []):
        for param in command.params:
            for word, meaning in WORKLOAD_HELP.items():
                if f"--{word}" in getattr(param, "opts", ()):
                    seen.add(word)
                    if meaning not in (param.help or ""):
                        wrong.append(f"memfit {' '.join(path)} --{word}: {param.help!r}")
    assert not wrong, wrong
    assert seen == set(WORKLOAD_HELP)  # the walk found the commands


def test_every_command_says_out_set_json_and_devices_with_one_meaning_and_the_earlier_names_still_parse():
    """``--out`` for what a command writes, ``--set`` for a KEY=VALUE override, ``--json`` wherever a command reports,
    ``--devices`` as COUNTxDEVICE; ``--report`` and ``--option`` stay second names of ``--out`` and ``--set``."""
    import click
    from memfit.cli.main import cli

    def command(path):
        found = cli
        for name in path:
            found = found.get_command(click.Context(found), name)
        return found

    shows_only: set[tuple[str, ...]] = set()  # a command that reports and has no --json: none
    wrong, no_json = [], []
    for path in _command_paths():
        found = command(path)
        if isinstance(found, click.Group):
            continue
        options = [param for param in found.params if isinstance(param, click.Option)]
        for option in options:
            first = option.opts[0]
            if first in ("--report", "--option") or ("--devices" in option.opts and "COUNT" not in option.metavar):
                wrong.append(f"memfit {' '.join(path)} {first}")
        if tuple(path) not in shows_only and not any("--json" in option.opts for option in options):
            no_json.append("memfit " + " ".join(path))
    assert not wrong, f"options under another word than the shared one: {wrong}"
    assert not no_json, f"commands that report without --json: {no_json}"
    run = command(["run"]).make_context("run", ["--report", "r.json", "--", "python", "t.py"]).params
    assert run["report_path"].name == "r.json"
    plan = command(["plan"]).make_context("plan", ["--budget", "1GiB", "--option", "sac.local=ilp"]).params
    assert plan["planner_options"] == ("sac.local=ilp",)


def test_no_source_file_is_over_800_lines():
    """Files a newcomer can hold in mind: split a module along its seams before it passes 800 lines."""
    long = {
        str(path.relative_to(REPO)): n
        for path in REPO.glob("packages/*/src/**/*.py")
        if (n := len(path.read_text().splitlines())) > 800
    }
    assert not long, f"source files over 800 lines: {long}"
