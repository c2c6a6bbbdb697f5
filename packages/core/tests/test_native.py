import json
import os
import subprocess
import sys
import textwrap

import pytest
from memfit import native
from memfit.errors import NativeBuildError


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    source = tmp_path / "x.cpp"
    source.write_text("// nothing\n")
    expected = "no C\\+\\+ compiler found .* install one, e.g. 'apt-get install g\\+\\+'"
    with pytest.raises(NativeBuildError, match=expected):
        native.load_extension("memfit_test_ext", (source,))


def test_missing_ninja_is_a_clear_error(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def no_ninja():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", no_ninja)
    source = tmp_path / "y.cpp"
    source.write_text("// nothing\n")
    with pytest.raises(NativeBuildError, match="ninja is not installed; 'pip install ninja'"):
        native.load_extension("memfit_test_ext2", (source,))


def test_environments_with_the_same_torch_build_share_one_build_and_another_torch_gets_its_own(monkeypatch, tmp_path):
    # a machine builds once: CI's per-package virtualenvs each built the allocator (a minute each)
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    import torch

    here = native.cache_dir()
    assert here.parent == tmp_path / "native"
    assert torch.__version__.replace("+", "_") in here.name
    monkeypatch.setattr(native.sys, "prefix", str(tmp_path / "another-venv"))  # another virtualenv, same torch
    assert native.cache_dir() == here
    monkeypatch.setattr(torch.version, "git_version", "0" * 40)  # another build of torch
    assert native.cache_dir() != here
    assert native.cache_dir().parent == here.parent


def test_a_build_is_imported_without_building_again(monkeypatch):
    from torch.utils import cpp_extension

    native.cpu_sim_allocator()  # built for this torch build (once)

    def no_build(**kwargs):
        raise AssertionError("rebuilt a library already built for this torch build")

    monkeypatch.setattr(cpp_extension, "load", no_build)
    source = native.NATIVE_SOURCE_DIR / "cpu_sim_allocator.cpp"
    module = native.load_extension.__wrapped__("memfit_cpu_sim_allocator", (source,))
    assert hasattr(module, "set_record_function_enabled")


def test_a_build_stamped_for_another_torch_build_is_not_loaded(monkeypatch):
    native.cpu_sim_allocator()
    source = native.NATIVE_SOURCE_DIR / "cpu_sim_allocator.cpp"
    build_dir = native.build_directory("memfit_cpu_sim_allocator", (source,))
    assert native._built_for_here(build_dir) is not None
    other = {**native.environment_identity(), "torch_git": "0" * 40}
    monkeypatch.setattr(native, "environment_identity", lambda: other)
    assert native._built_for_here(build_dir) is None


def test_native_code_is_not_loaded_from_a_folder_others_can_write(monkeypatch, tmp_path):
    # a MEMFIT_CACHE_DIR in a shared place must not let another user plant a library
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    shared = tmp_path / "native"
    shared.mkdir()
    shared.chmod(0o777)
    source = native.NATIVE_SOURCE_DIR / "cpu_sim_allocator.cpp"
    expected = "writable by other users .* MEMFIT_CACHE_DIR to a folder only you can write"
    with pytest.raises(NativeBuildError, match=expected):
        native.load_extension.__wrapped__("memfit_cpu_sim_allocator", (source,))


def test_a_planted_library_is_not_loaded(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    source = native.NATIVE_SOURCE_DIR / "cpu_sim_allocator.cpp"
    build_dir = native.build_directory("memfit_cpu_sim_allocator", (source,))
    build_dir.mkdir(parents=True, mode=0o700)
    (build_dir / native.STAMP).write_text(json.dumps(native.environment_identity(), sort_keys=True))
    planted = build_dir / f"{build_dir.name}.so"
    planted.write_bytes(b"not a library")
    planted.chmod(0o666)
    with pytest.raises(NativeBuildError, match="writable by other users"):
        native.load_extension.__wrapped__("memfit_cpu_sim_allocator", (source,))


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load():
    # torch's build lock is a file; a build killed while it held it used to make every later
    # process wait forever. The oracle is torch's own file: present before, gone after, no hang.
    # Without its stamp the library is built again (ninja finds the objects up to date: a relink at most).
    import threading

    native.cpu_sim_allocator()
    name = "memfit_cpu_sim_allocator"
    source = native.NATIVE_SOURCE_DIR / "cpu_sim_allocator.cpp"
    build_dir = native.build_directory(name, (source,))
    (build_dir / native.STAMP).unlink()
    stale = build_dir / "lock"
    stale.write_text("")
    loaded = []
    worker = threading.Thread(
        target=lambda: loaded.append(native.load_extension.__wrapped__(name, (source,))), daemon=True
    )
    try:
        worker.start()
        worker.join(timeout=300)
        assert loaded, "load_extension still waits on a stale torch build lock"
        assert not stale.exists()
        assert native._built_for_here(build_dir) is not None  # stamped again
    finally:
        stale.unlink(missing_ok=True)  # never leave the shared cache locked
        worker.join(timeout=30)


@pytest.mark.slow
def test_concurrent_processes_build_once(tmp_path):
    # four torchrun ranks starting together in a new environment: one compiles, the others wait and import
    source = tmp_path / "tiny.cpp"
    source.write_text(
        "#include <torch/extension.h>\nint answer() { return 42; }\n"
        'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }\n'
    )
    script = textwrap.dedent(f"""
        from memfit import native
        print(native.load_extension("memfit_test_tiny", ({str(source)!r},)).answer())
    """)
    env = {**os.environ, "MEMFIT_CACHE_DIR": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    results = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    assert [out.strip() for out, _ in results] == ["42"] * 3
    assert sum("compiling the native extension" in err for _, err in results) == 1, results
