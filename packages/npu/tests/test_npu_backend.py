"""Detection and registration of the npu backend, against a mocked torch_npu (no hardware here)."""

import importlib.machinery
import sys
import types

import memfit_npu.plugin as npu_plugin
import pytest
import torch
from memfit.plugins import Hooks, build_plugin_manager
from memfit.testing import BackendContract


@pytest.fixture(autouse=True)
def fresh_detection():
    npu_plugin.npu_available.cache_clear()
    yield
    npu_plugin.npu_available.cache_clear()


def fake_torch_npu(monkeypatch, *, devices: bool, import_error: Exception | None = None):
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    if import_error is not None:

        def broken(name, *args, **kwargs):
            if name == "torch_npu":
                raise import_error
            return real_import(name, *args, **kwargs)

        real_import = npu_plugin.importlib.import_module
        monkeypatch.setattr(npu_plugin.importlib, "import_module", broken)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: devices), raising=False)
    return module


def test_not_available_without_torch_npu(monkeypatch):
    monkeypatch.setattr(npu_plugin.importlib.util, "find_spec", lambda name: None)
    assert npu_plugin.npu_available() is False


def test_available_when_torch_npu_reports_a_device(monkeypatch):
    fake_torch_npu(monkeypatch, devices=True)
    assert npu_plugin.npu_available() is True


def test_not_available_without_devices(monkeypatch):
    fake_torch_npu(monkeypatch, devices=False)
    assert npu_plugin.npu_available() is False


def test_broken_torch_npu_does_not_break_selection(monkeypatch):
    fake_torch_npu(monkeypatch, devices=True, import_error=OSError("libascendcl.so: cannot open shared object"))
    assert npu_plugin.npu_available() is False
    hooks = Hooks(build_plugin_manager())
    assert "npu" in hooks.backends()
    assert hooks.backends()["npu"].is_available() is False


def test_registered_through_entry_points_and_preferred_over_cuda(monkeypatch):
    fake_torch_npu(monkeypatch, devices=True)
    hooks = Hooks(build_plugin_manager())
    specs = hooks.backends()
    info = next(i for i in hooks.plugin_infos() if i.name == "npu")
    assert (info.distribution, info.kind) == ("memfit-npu", "backend:npu")
    assert specs["npu"].priority > specs["cuda"].priority > specs["cpu-sim"].priority
    monkeypatch.setattr(npu_plugin, "NPUBackend", None)  # the spec keeps the real factory; replace it
    chosen = []
    for name, spec in list(specs.items()):
        object.__setattr__(spec, "factory", lambda _name=name, **kw: chosen.append(_name) or _name)
        object.__setattr__(spec, "is_available", lambda: True)
    monkeypatch.setattr(Hooks, "backends", lambda self: specs)
    assert hooks.create_backend() == "npu" and chosen == ["npu"]


def test_backend_facts_and_oom_classification(monkeypatch):
    fake_torch_npu(monkeypatch, devices=True)
    props = types.SimpleNamespace(total_memory=64 * 2**30)
    device_module = types.SimpleNamespace(get_device_properties=lambda device: props)
    monkeypatch.setattr(torch, "get_device_module", lambda device_type: device_module)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch, "device", lambda *args: types.SimpleNamespace(type=args[0], index=args[1]))
    backend = npu_plugin.NPUBackend()
    assert (backend.name, backend.device_type, backend.comm_backend) == ("npu", "npu", "hccl")
    assert backend.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert backend.capacity_bytes == 64 * 2**30
    assert backend.round_size(1) == 512
    assert backend.is_oom(RuntimeError("NPU out of memory. Tried to allocate 2.00 GiB"))
    assert backend.is_oom(torch.OutOfMemoryError("NPU out of memory"))
    assert not backend.is_oom(RuntimeError("shape mismatch"))
    # no observer binding in this torch_npu: the request size comes from the message
    assert backend.oom_request_bytes(RuntimeError("NPU out of memory. Tried to allocate 2.00 GiB")) == 2 * 2**30


@pytest.mark.npu
class TestNPUBackendContract(BackendContract):
    """Runs only where torch_npu and an NPU exist."""

    def make_backend(self, capacity):
        return npu_plugin.NPUBackend(capacity=capacity)
