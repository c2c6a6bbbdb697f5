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
