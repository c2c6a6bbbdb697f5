import pytest
from memfit import native
from memfit.errors import NativeBuildError


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
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

    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", no_ninja)
    source = tmp_path / "y.cpp"
    source.write_text("// nothing\n")
    with pytest.raises(NativeBuildError, match="ninja is not installed; 'pip install ninja'"):
        native.load_extension("memfit_test_ext2", (source,))


def test_build_is_cached_per_torch_version(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    import torch

    assert native.cache_dir().parent == tmp_path / "native"
    assert torch.__version__.replace("+", "_") in native.cache_dir().name


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load():
    # torch's build lock is a file; a build killed while it held it used to make every later
    # process wait forever. The oracle is torch's own file: present before, gone after, no hang.
    import threading

    native.cpu_sim_allocator()  # built (cached) first: this test is about the lock, not the build
    name = "memfit_cpu_sim_allocator"
    source = native.NATIVE_SOURCE_DIR / "cpu_sim_allocator.cpp"
    stale = native.build_directory(name, (source,)) / "lock"
    stale.write_text("")
    loaded = []
    worker = threading.Thread(
        target=lambda: loaded.append(native.load_extension.__wrapped__(name, (source,))), daemon=True
    )
    try:
        worker.start()
        worker.join(timeout=120)
        assert loaded, "load_extension still waits on a stale torch build lock"
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)  # never leave the shared cache locked
        worker.join(timeout=30)
