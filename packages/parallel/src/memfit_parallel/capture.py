"""Capture one rank of a parallel training step: the real FSDP2 / TP / pipeline-stage code under fake tensors.

What runs is what a job runs: the model (or the pipeline stage this rank holds) is built under
:class:`~torch._subclasses.fake_tensor.FakeTensorMode` and parallelized outside it by
:func:`memfit_parallel.apply.parallelize` — the function ``memfit parallel run`` trains with;
DeviceMesh computes coordinates with real tensors — under torch's fake process group
(:mod:`memfit_parallel.fakepg`), then one step runs under the mode.
Collectives return at once with the right shapes, so the rank's memory and every collective it
issues come from the parallel code itself.

The simulator's recorder (:mod:`memfit_simulator.capture`) follows every storage's life and
attributes operators to modules; here it is taught three more things:

* **DTensor**: an operator on DTensors is let through (the recorder returns ``NotImplemented``), so
  the recorder sees the local operators DTensor runs on each shard: local shapes, local FLOPs, local
  bytes. Parameters, gradients and optimizer states are tracked by their local shards.
* **storage resizes**: FSDP2 allocates and frees unsharded parameters by resizing their storage
  (``untyped_storage().resize_``); a resize to zero frees the storage at that operator, a resize up
  allocates it anew, as the caching allocator sees it. Such storages are counted as ``parameter``
  (the unsharded parameters), never as activations, though they may live from forward into backward.
* **collectives**: each ``c10d`` / ``_c10d_functional`` operator is recorded with its kind, the bytes
  the comm model takes (all-gather: output; reduce-scatter: input; all-reduce: the buffer), its group
  size and the mesh dimension of its group.
* **gloo's scratch buffers** (``collective_scratch=True``, the capture of a CPU run): gloo, which
  memfit trains with on the CPU, does not gather or reduce-scatter in place. Its all-gather receives
  into a flat tensor of the whole output and copies it out; its reduce-scatter all-reduces a clone of
  the whole input and copies the rank's chunk out (``ProcessGroupGloo``; measured with cpu-sim: one
  output's, one input's bytes more at the peak of the call, none for an all-reduce). Each is recorded
  as a temporary of that size, live at its collective. NCCL and HCCL work in place: not recorded.

Operators run inside activation-checkpoint recomputation are flagged (a block's forward running
during backward), so recomputation is timed apart.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from memfit.errors import MemfitError
from memfit.types import Phase
from memfit_simulator.capture import CapturedStep, _ModuleAttribution, _Recorder, optimizer_hooks
from memfit_simulator.memory import MemoryBreakdown, memory_breakdown
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

COLLECTIVE_KINDS = {
    "all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "all_reduce": "all_reduce", "allreduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_to_all_single": "all_to_all",
    "alltoall_base_": "all_to_all", "broadcast_": "broadcast", "broadcast": "broadcast",
}  # fmt: skip
"""Collective operators (``c10d::`` and ``_c10d_functional::`` names without namespace) by kind."""
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective a rank issued: what the comm model needs to time it.

    The capture records one per collective operator (:attr:`RankCapture.collectives`); the prediction
    times each on the links its group spans (:func:`memfit_parallel.stages.collective_seconds`).

    Example:
        ```python
        from memfit_parallel.capture import Collective
        from memfit_parallel.config import ParallelConfig
        from memfit_parallel.stages import collective_seconds
        from memfit_simulator.hardware import get_spec

        h100 = get_spec("h100")
        for ranks in (8, 64):  # one node of 8 H100s; 8 nodes
            # FSDP's all-gather of a Llama 3 8B block's bfloat16 weights (436 MB) in forward (phase 0)
            gather = Collective("all_gather", 436_224_000, ranks, "dp_shard", phase=0, op_index=212, module="layers.3")
            config = ParallelConfig(dp_shard=ranks)
            seconds = collective_seconds(gather.kind, gather.nbytes, gather.group_size, gather.dim, config, h100)
            print(f"{ranks} ranks: {seconds * 1e3:.2f} ms")  # 8 ranks: 0.87 ms, then 64 ranks: 8.65 ms
        ```
    """

    kind: str
    """``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all`` or ``broadcast``."""
    nbytes: int
    """Bytes per device as the comm model takes them (all-gather: output; reduce-scatter: input; all-reduce: buffer)."""
    group_size: int
    dim: str
    """The mesh dimension(s) of its group (``dp_shard``, ``tp``, ``dp_replicate+dp_shard``...)."""
    phase: int
    op_index: int
    """The operator index in the captured step (the collective itself)."""
    module: str


@dataclass
class RankCapture:
    """One rank's captured step: operators, storages, memory and collectives.

    Example:
        ```python
        from collections import Counter

        import torch
        from memfit_parallel.apply import parallelize
        from memfit_parallel.capture import capture_parallel_step
        from memfit_parallel.config import ParallelConfig
        from memfit_parallel.recipe import llama_recipe
        from memfit_simulator.models import make_optimizer

        recipe, config, held = llama_recipe("tiny"), ParallelConfig(dp_shard=2), {}

        def setup(mesh, fake):  # rank 0's model, applied as the trainer applies it, and a batch: fake tensors
            held["model"] = parallelize(recipe, config, mesh=mesh, init=lambda: fake)
            with fake:
                tokens = torch.randint(0, 256, (4, 129))
            return held["model"].parts[0], (tokens[:, :-1], tokens[:, 1:])

        def step(net, optimizer, batch):  # one iteration
            recipe.loss_fn(net(batch[0]), batch[1]).backward()
            optimizer.step()
            optimizer.zero_grad()

        rank = capture_parallel_step(  # a RankCapture
            setup, step, mesh_names=("dp_shard",), mesh_sizes=(2,), make_optimizer=lambda p: make_optimizer("adamw", p)
        )
        print(rank.world_size, rank.memory.peak_bytes)  # 2, and the rank's peak in bytes
        print(rank.memory.peak_by_category["optimizer_state"])  # 500992: AdamW's two states of half the weights
        print(Counter((c.kind, c.dim) for c in rank.collectives))  # 5 all-gathers and 3 reduce-scatters over dp_shard
        print(int(rank.communication.sum()), int(rank.recompute.sum()))  # 8 collective operators; 0 recomputed
        ```
    """

    step: CapturedStep
    memory: MemoryBreakdown
    collectives: list[Collective]
    recompute: np.ndarray
    """Per operator: ran in activation-checkpoint recomputation."""
    communication: np.ndarray
    """Per operator: a collective or a wait on one (timed by the comm model, not the compute model)."""
    world_size: int
    mesh: dict[str, int] = field(default_factory=dict)


def _leaves(tree: Any) -> list[Any]:
    return tree_flatten(tree)[0]


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _unboxed_group_name(boxed: Any) -> str:
    """The name of the process group a ``c10d::`` operator received as a ``ScriptObject`` ("" when unknown)."""
    import torch.distributed as dist

    unbox = getattr(dist.ProcessGroup, "unbox", None)
    try:
        return str(unbox(boxed).group_name) if unbox is not None else ""
    except (RuntimeError, TypeError):  # not a process group
        return ""


class _ParallelRecorder(_Recorder):
    """The simulator's recorder, seeing through DTensor, storage resizes and collectives (module docs)."""

    def __init__(self, groups: dict[str, str], collective_scratch: bool = False) -> None:
        super().__init__(keep_args=True)
        self.groups = groups  # group name -> mesh dimension
        self.collective_scratch = collective_scratch  # gloo's whole-size buffers (module docs)
        self.collectives: list[Collective] = []
        self.communication: list[bool] = []
        self.recompute: list[bool] = []
        self.recomputing = 0
        self.resized_away: set[int] = set()
        self.mesh: dict[str, int] = {}
        self.suspended = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass(x) for x in _leaves((args, kwargs))):
            return NotImplemented  # DTensor runs its local operators, which come back here
        if func.namespace == "prim":
            return func(*args, **kwargs)
        if self.suspended:  # DTensor's sharding propagation: global-shape fake operators, not the rank's work
            return func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        kind = COLLECTIVE_KINDS.get(name) if func.namespace in COLLECTIVE_NAMESPACES else None
        if kind is not None:
            self._collective(kind, func, args, kwargs)
        communication = kind is not None or name in ("wait_tensor", "wait")
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.communication.append(communication)
        self.recompute.append(self.recomputing > 0)
        return out

    def _collective(self, kind: str, func: Any, args: tuple, kwargs: dict) -> None:
        tensors = [x for x in _leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        group_name, group_size = "", 1
        for x in _leaves((args, kwargs)):
            if isinstance(x, str) and x in self.groups:
                group_name = x
            elif isinstance(x, torch.ScriptObject):
                # c10d operators take the group boxed: unbox it for its name (the boxed object has no attributes)
                group_name = _unboxed_group_name(x) or group_name
        if group_name:
            import torch.distributed as dist
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(group_name)
            group_size = dist.get_world_size(group)
            if group_name not in self.groups:  # e.g. a flattened mesh's: name it by the dimensions its ranks span
                self.groups[group_name] = self.dims_of_ranks(dist.get_process_group_ranks(group))
        nbytes = [t.numel() * t.element_size() for t in tensors]
        if group_size == 1 and kind in ("all_gather", "reduce_scatter") and len(nbytes) >= 2 and min(nbytes):
            group_size = max(nbytes) // min(nbytes)  # c10d ops: output and input sizes say the group's
        if kind == "all_gather" and func.namespace == "_c10d_functional":
            size = nbytes[0] * group_size  # functional: the input; the model takes the gathered output
        elif kind == "all_reduce":
            size = sum(nbytes)
        else:  # c10d all-gather: (output, input); reduce-scatter: the input, the larger
            size = max(nbytes, default=0)
        dim = self.groups.get(group_name) or self.dim_of_size(group_size)
        if dim == "dp_shard+cp" or (dim == "cp" and func.namespace == "c10d"):
            # FSDP's flattened dp_shard × cp group; over CP alone it is the cp group itself (a flattened 1-D mesh is
            # the same group), on which CP's own K/V collectives are the functional ones
            dim = "dp_shard_cp"
        self.collectives.append(
            Collective(kind, int(size), group_size, dim, self._phase(), len(self.names), self._op_module or "")
        )
        if self.collective_scratch and kind in ("all_gather", "reduce_scatter") and group_size > 1 and size:
            from memfit_simulator.capture import _Storage

            # the collective's own operator (recorded next) is where the buffer lives: allocated and freed inside it
            scratch = _Storage(int(size), "uint8", (int(size),), len(self.names), self._phase(), self._op_module)
            scratch.freed = scratch.created
            scratch.category = "temporary"
            self.storages.append(scratch)

    def dims_of_ranks(self, ranks: list[int]) -> str:
        """The mesh dimension(s) along which a group's ranks differ (``init_device_mesh`` numbers ranks row-major)."""
        if not self.mesh or not ranks:
            return "world"
        sizes = tuple(self.mesh.values())
        coords = np.array(np.unravel_index(np.asarray(ranks), sizes)).T
        spanned = [name for i, name in enumerate(self.mesh) if len(set(coords[:, i].tolist())) > 1]
        return "+".join(spanned) or "world"

    def dim_of_size(self, size: int) -> str:
        """The mesh dimension(s) a group of ``size`` ranks spans when its name is not known (outer to inner)."""
        names, sizes = list(self.mesh), list(self.mesh.values())
        for i in range(len(names)):
            for j in range(i + 1, len(names) + 1):
                if int(np.prod(sizes[i:j])) == size:
                    return "+".join(names[i:j])
        return "world"

    # -- storage resizes (FSDP2 unsharded parameters) -------------------------------------------------
    def resized(self, storage: Any, nbytes: int) -> None:
        key = id(storage)
        row = self._row.get(key)
        if row is not None and nbytes < self.storages[row].nbytes:
            self.storages[row].category = "parameter"  # an unsharded parameter FSDP2 frees (module docs)
            self.storages[row].freed = max(len(self.names) - 1, self.storages[row].created)
            self.resized_away.add(row)
            del self._row[key]
        elif nbytes > 0 and (row is None or nbytes > self.storages[row].nbytes):
            if row is not None:  # grown: the old block is freed, a larger one allocated
                self.storages[row].category = "parameter"
                self.storages[row].freed = max(len(self.names) - 1, self.storages[row].created)
                self.resized_away.add(row)
                del self._row[key]
            from memfit_simulator.capture import _Storage

            new = len(self.storages)
            self.storages.append(
                _Storage(int(nbytes), "uint8", (int(nbytes),), len(self.names) - 1, self._phase(), self._op_module)
            )
            # FSDP2 allocates unsharded parameters this way: they are parameters (TorchSim's UNSHARDED_PARAM),
            # not activations, even when they live from forward into backward (ZeRO-2, the last block)
            self.storages[new].category = "parameter"
            self._row[key] = new
            weakref.finalize(storage, self._freed, key, new)

    def _freed(self, key: int, row: int) -> None:
        if row in self.resized_away:
            return
        super()._freed(key, row)


def _patch_resize(recorder: _ParallelRecorder) -> Callable[[], None]:
    original = torch.UntypedStorage.resize_

    def resize_(self, size):
        out = original(self, size)
        recorder.resized(self, int(size))
        return out

    torch.UntypedStorage.resize_ = resize_

    def restore() -> None:
        torch.UntypedStorage.resize_ = original

    return restore


def _label_accumulated_gradients(recorder: _ParallelRecorder, grads: list[int]) -> Callable[[], None]:
    """Record FSDP2's unsharded accumulated gradients as gradients.

    While gradients are not reduced (every pipeline microbatch's backward but the last), FSDP2 keeps
    each parameter's unsharded gradient outside ``.grad`` — ``unsharded_accumulated_grad`` in the
    reduce dtype, or the unsharded parameter's own ``.grad`` when no cast is needed — and adds every
    microbatch into it. The optimizer never sees them (they are reduce-scattered into the sharded
    ``.grad`` and freed), so its hooks cannot label them: without this they would count as
    temporaries, though they live from the first microbatch's backward to the last.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    # called after each backward that does not reduce; the tensors it leaves are added to in place by the next ones
    original = FSDPParam.to_accumulated_grad_if_needed

    def to_accumulated_grad_if_needed(self) -> None:
        original(self)
        for grad in (self.unsharded_accumulated_grad, self._unsharded_param.grad):
            if grad is not None and not recorder.closed:
                grads.append(recorder.track(local(grad), -1, int(Phase.BWD)))

    FSDPParam.to_accumulated_grad_if_needed = to_accumulated_grad_if_needed

    def restore() -> None:
        FSDPParam.to_accumulated_grad_if_needed = original

    return restore


def _skip_sharding_propagation(recorder: _ParallelRecorder) -> Callable[[], None]:
    """Do not record DTensor's sharding propagation.

    DTensor derives an operator's output metadata by running it on global-shape fake tensors the first time it
    meets a sharding; those operators are not the rank's work.
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        recorder.suspended += 1
        try:
            return original(self, op_schema)
        finally:
            recorder.suspended -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate

    def restore() -> None:
        ShardingPropagator._propagate_tensor_meta_non_cached = original

    return restore


def _mark_recompute(model: torch.nn.Module, recorder: _ParallelRecorder) -> list[Any]:
    """Flag operators a checkpointed block runs during backward (its recomputation)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    handles = []
    for module in model.modules():
        if isinstance(module, CheckpointWrapper):
            inner = module._checkpoint_wrapped_module

            def pre(mod, args):
                if torch._C._current_graph_task_id() >= 0:
                    recorder.recomputing += 1
                    mod._memfit_recomputing = True

            def post(mod, args, out):
                if getattr(mod, "_memfit_recomputing", False):
                    recorder.recomputing -= 1
                    mod._memfit_recomputing = False

            # always_call: non-reentrant checkpointing stops a recomputation early by raising through the forward
            handles += [inner.register_forward_pre_hook(pre), inner.register_forward_hook(post, always_call=True)]
    # a memfit SAC plan (memfit-executor's apply_recompute): its recomputation runs the module's original
    # forward inside torch's checkpoint, past the module's hooks; the application enters a context around it
    checkpointed_by = _memfit_checkpointed_by()
    for applied in {id(a): a for m in model.modules() if (a := checkpointed_by(m)) is not None}.values():
        applied.recompute_context = functools.partial(_recomputing, recorder)
    return handles


def _memfit_checkpointed_by() -> Callable[[torch.nn.Module], Any]:
    try:
        from memfit_executor.recompute import checkpointed_by
    except ImportError:  # without memfit-executor nothing is checkpointed by a memfit plan
        return lambda module: None
    return checkpointed_by


@contextlib.contextmanager
def _recomputing(recorder: _ParallelRecorder) -> Iterator[None]:
    """Operators run inside it are recomputation (a memfit-checkpointed module's forward replayed in backward)."""
    recorder.recomputing += 1
    try:
        yield
    finally:
        recorder.recomputing -= 1


def capture_parallel_step(
    setup: Callable[[Any, Any], tuple[torch.nn.Module, Any]],
    step: Callable[[torch.nn.Module, torch.optim.Optimizer, Any], Any],
    *,
    mesh_names: tuple[str, ...],
    mesh_sizes: tuple[int, ...],
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    granularity: int = 1,
    collective_scratch: bool = False,
) -> RankCapture:
    """Capture rank 0 of a ``prod(mesh_sizes)``-rank job (module docs).

    Args:
        setup: ``setup(mesh, fake_mode) -> (model, batch)``: builds the model and batch under ``fake_mode`` and
            applies the parallelism outside it (:func:`memfit_parallel.apply.parallelize` with ``init``);
            ``mesh`` is a 1-D mesh of one rank when ``mesh_sizes`` is empty.
        step: one iteration (forward, backward, optimizer step, ``zero_grad``); runs under fake tensors.
        mesh_names: the device mesh's dimension names, outer to inner (empty for one rank).
        mesh_sizes: the size of each dimension.
        make_optimizer: builds the optimizer over the parallelized parameters.
        granularity: the device allocator's block size (memory is rounded up to it).
        collective_scratch: record gloo's whole-size all-gather and reduce-scatter buffers (module docs): the
            capture of a run on the CPU, which trains with gloo.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from memfit_parallel.fakepg import fake_process_group

    started = time.perf_counter()
    world = int(np.prod(mesh_sizes)) if mesh_sizes else 1
    with fake_process_group(world):
        if mesh_sizes:
            mesh = init_device_mesh("cpu", mesh_sizes, mesh_dim_names=mesh_names)
        else:
            mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
        groups: dict[str, str] = {}
        if mesh_sizes:
            for name in mesh_names:
                groups[mesh[name].get_group().group_name] = name
            if len(mesh_names) > 1:
                for i in range(len(mesh_names)):
                    for j in range(i + 1, len(mesh_names)):
                        try:
                            sub = mesh[mesh_names[i], mesh_names[j]]
                            for g in sub.get_all_groups():
                                groups.setdefault(g.group_name, f"{mesh_names[i]}+{mesh_names[j]}")
                        except Exception:  # noqa: BLE001 - only names groups; an unnamed one says "world"
                            pass
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        model, batch = setup(mesh, fake)
        recorder = _ParallelRecorder(groups, collective_scratch)
        recorder.mesh = dict(zip(mesh_names, mesh_sizes, strict=True))
        try:
            with fake:
                optimizer = make_optimizer(list(model.parameters()))
                _track_static(recorder, model, batch)
                grads: list[int] = []
                hooks = optimizer_hooks(recorder, grads, local)
                handles = _mark_recompute(model, recorder)
                restores = []
                try:
                    for patch in (_patch_resize, _skip_sharding_propagation):
                        restores.append(patch(recorder))
                    restores.append(_label_accumulated_gradients(recorder, grads))
                    with _ModuleAttribution(model) as recorder.modules, recorder:
                        step(model, optimizer, batch)
                    recorder.closed = True
                except NotImplementedError as exc:
                    raise MemfitError(f"the parallel step cannot run under fake tensors: {exc}") from exc
                finally:
                    for restore in restores:
                        restore()
                    for h in hooks + handles:
                        h.remove()
                _categorise(recorder, grads)
                del model, optimizer, batch
        finally:
            recorder.closed = True
    captured = CapturedStep(
        op_names=recorder.names, phases=np.array(recorder.phases, dtype=np.int8), inputs=recorder.inputs,
        outputs=recorder.outputs, op_modules=[m or "" for m in recorder.op_modules], storages=recorder.storages,
        capture_seconds=time.perf_counter() - started, op_args=recorder.op_args, op_flops=recorder.op_flops,
    )  # fmt: skip
    return RankCapture(
        step=captured,
        memory=memory_breakdown(captured, granularity),
        collectives=recorder.collectives,
        recompute=np.array(recorder.recompute, dtype=bool),
        communication=np.array(recorder.communication, dtype=bool),
        world_size=world,
        mesh=dict(zip(mesh_names, mesh_sizes, strict=True)),
    )


def _track_static(recorder: _ParallelRecorder, model: torch.nn.Module, batch: Any) -> None:
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            row = recorder.track(local(p), -1, int(Phase.FWD), "parameter")
            recorder.storages[row].module = recorder.owner.setdefault(row, name)
        for b in module.buffers(recurse=False):
            recorder.storages[recorder.track(local(b), -1, int(Phase.FWD), "buffer")].module = name
    for t in _leaves(batch):
        if isinstance(t, torch.Tensor):
            recorder.track(local(t), -1, int(Phase.FWD), "input")


def _categorise(recorder: _ParallelRecorder, grads: list[int]) -> None:
    """The simulator's categories (see :mod:`memfit_simulator.capture`)."""
    for row in grads:
        if not recorder.storages[row].category:
            recorder.storages[row].category = "gradient"
    phases = recorder.phases
    end_of_forward = next((i for i, p in enumerate(phases) if p != int(Phase.FWD)), len(phases))
    for s in recorder.storages:
        if s.module is None:
            s.module = ""
        if s.category:
            continue
        alive_into_backward = s.freed == -1 or s.freed >= end_of_forward
        s.category = (
            "activation" if s.phase == int(Phase.FWD) and s.created < end_of_forward and alive_into_backward
            else "temporary"
        )  # fmt: skip
