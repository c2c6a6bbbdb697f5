"""The ``torch.compile`` backend: AOTAutograd, memfit's offload pass, and the graphs run as FX code.

:func:`backend` returns an :class:`OffloadBackend`, a callable ``torch.compile`` accepts as
``backend=``. It is built on AOTAutograd (``aot_autograd``) with PyTorch's default partitioner
and no decompositions (ATen-level graphs compute exactly what eager computes; the core-ATen
decomposition of CPU attention gives wrong gradients) and no Inductor: the partitioner is
wrapped so that the offload pass (:mod:`memfit_offload.graph_pass`) sees the forward and
backward graphs together, and each graph runs as FX-generated Python with the boxed calling
convention (inputs are dropped as soon as they are read, so saved activations free as the
backward consumes them, as in eager).

Example:
    ```python
    import torch
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit.models import build_training
    import memfit_offload

    sim = CpuSimBackend(capacity="1GiB")
    with sim.activate():
        run = build_training("tiny", batch=4, seq=64)
        offload = memfit_offload.backend(budget="2MiB", device_backend=sim, min_bytes="16KiB")
        run.model.compile(backend=offload)
        run.step()
        print(offload.plan().to_json())
    ```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from memfit.config import parse_size
from memfit.errors import MemfitError
from torch.fx import GraphModule, Interpreter
from torch.fx.graph import _BoxedCodeGen

from memfit_offload.costs import DeviceSpeed, measure_cpu_speed
from memfit_offload.graph_pass import OffloadDecision, apply, decide
from memfit_offload.ops import CACHE_OPS, LOWERED, WAIT, OffloadRuntime

__all__ = ["OffloadBackend", "backend"]

Order = Literal["none", "jit", "refined"]
_ORDERS = ("none", "jit", "refined")


def _size(value: int | str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise MemfitError(
            f"invalid {what} {value!r}: expected a byte count such as 1073741824, or a size such as '512MB' or '12GiB'"
        )
    nbytes = parse_size(value, what=what)
    if nbytes <= 0:
        raise MemfitError(f"invalid {what} {value!r}: it must be positive, e.g. '12GiB'")
    return nbytes


def _active_device_backend() -> Any:
    from memfit.backends import cpu_sim
    from memfit.plugins import get_hooks

    active = cpu_sim._active  # the cpu-sim device the program runs on, if any
    return active if active is not None else get_hooks().create_backend()


class OffloadBackend:
    """A ``torch.compile`` backend that offloads saved activations to host memory (see :func:`backend`).

    Attributes:
        decisions: one :class:`~memfit_offload.graph_pass.OffloadDecision` per compiled
            forward/backward pair, in compilation order.
        runtime: the :class:`~memfit_offload.ops.OffloadRuntime` the compiled graphs run with
            (its ``stats`` count the bytes moved and the exposed transfer time).

    Example:
        ```python
        import memfit_offload
        import torch
        from memfit.plugins import get_hooks

        sim = get_hooks().create_backend("cpu-sim", capacity="1GiB")
        with sim.activate():
            model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
            offload = memfit_offload.backend(device_backend=sim)   # an OffloadBackend, no budget: offload all it can
            torch.compile(model, backend=offload)(torch.randn(64, 256)).square().mean().backward()
        [candidate.name for candidate in offload.decisions[0].chosen]   # ['gelu', 'addmm']: stored in forward
        offload.runtime.stats.stores, offload.runtime.stats.prefetches  # (2, 2): back to the device in backward
        sorted({action.kind for action in offload.plan().actions})      # ['prefetch', 'release', 'store']
        ```
    """

    def __init__(
        self,
        budget_bytes: int | None,
        *,
        device_backend: Any = None,
        order: Order = "refined",
        min_bytes: int = 64 * 2**10,
        kappa: float = 1.2,
        residency_weight: float = 0.05,
        speed: DeviceSpeed | None = None,
        debug: bool = False,
        wait_for_stores: bool = False,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.wait_for_stores = wait_for_stores
        self.order = order
        self.min_bytes = min_bytes
        self.kappa = kappa
        self.residency_weight = residency_weight
        self.debug = debug
        self._device_backend = device_backend
        self._speed = speed
        self._runtime: OffloadRuntime | None = None
        self.decisions: list[OffloadDecision] = []
        self.graphs: list[tuple[GraphModule, GraphModule]] = []
        self._compiled: Callable[..., Any] | None = None

    # -- resolved lazily: the device may be activated after the backend is made ----------------------
    @property
    def device_backend(self) -> Any:
        if self._device_backend is None:
            self._device_backend = _active_device_backend()
        return self._device_backend

    @property
    def runtime(self) -> OffloadRuntime:
        if self._runtime is None:
            self._runtime = OffloadRuntime(self.device_backend, debug=self.debug, wait_for_stores=self.wait_for_stores)
        return self._runtime

    @property
    def speed(self) -> DeviceSpeed:
        if self._speed is None:
            device = self.device_backend
            copy = float(device.copy_bandwidth())
            if device.device.type == "cpu":
                flops, memory, overhead = measure_cpu_speed()
                self._speed = DeviceSpeed(flops, memory, overhead, copy_bytes_per_s=copy)
            else:
                self._speed = DeviceSpeed(copy_bytes_per_s=copy)
        return self._speed

    # -- torch.compile entry ------------------------------------------------------------------------
    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if self._compiled is None:
            from torch._dynamo.backends.common import aot_autograd

            self._compiled = aot_autograd(
                fw_compiler=self._compile_graph, bw_compiler=self._compile_graph, partition_fn=self._partition
            )
        return self._compiled(gm, example_inputs)

    def _partition(self, joint: GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any):
        from torch._functorch.partitioners import default_partition

        fw, bw = default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        if self.order != "none":
            decision = decide(
                fw, bw, num_fwd_outputs, speed=self.speed, budget_bytes=self.budget_bytes, min_bytes=self.min_bytes,
                order=self.order, kappa=self.kappa, residency_weight=self.residency_weight,
            )  # fmt: skip
            apply(fw, bw, num_fwd_outputs, decision)
            self.decisions.append(decision)
            self.graphs.append((fw, bw))
        return fw, bw

    def _compile_graph(self, gm: GraphModule, example_inputs: Sequence[Any]) -> Callable[[list[Any]], Any]:
        runtime = self.runtime
        if self.debug:
            checker = _ResidencyChecker(gm, runtime)

            def run_checked(args: list[Any]) -> Any:
                inputs = list(args)
                args.clear()
                with runtime.installed():
                    return checker.run(*inputs)

            run_checked._boxed_call = True  # type: ignore[attr-defined]
            return run_checked
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in LOWERED:
                node.target = LOWERED[node.target]
        gm.graph.set_codegen(_BoxedCodeGen())
        gm.recompile()

        def run(args: list[Any]) -> Any:
            with runtime.installed():
                return gm(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    # -- results --------------------------------------------------------------------------------------
    def plan(self):  # -> memfit.plan.MemoryPlan
        """The decisions so far as a :class:`memfit.plan.MemoryPlan` (see :mod:`memfit_offload.plan`)."""
        from memfit_offload.plan import plan_from_decisions

        return plan_from_decisions(self.decisions, budget_bytes=self.budget_bytes, speed=self.speed)

    def with_options(self, **changes: Any) -> OffloadBackend:
        """A new backend with some options changed (no compiled state shared)."""
        options = {
            "device_backend": self._device_backend, "order": self.order, "min_bytes": self.min_bytes,
            "kappa": self.kappa, "residency_weight": self.residency_weight, "speed": self._speed, "debug": self.debug,
        }  # fmt: skip
        budget = changes.pop("budget_bytes", self.budget_bytes)
        return OffloadBackend(budget, **{**options, **changes})


class _ResidencyChecker(Interpreter):
    """Runs a graph node by node and checks, before each, that it reads no released or unwaited tensor."""

    def __init__(self, gm: GraphModule, runtime: OffloadRuntime) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.memfit_runtime = runtime

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op == "call_function" and n.target not in CACHE_OPS:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            for value in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(value, torch.Tensor):
                    self.memfit_runtime.check_readable(value, f"{n.name} ({n.target})")
        elif n.op == "call_function" and n.target is WAIT:
            pass
        return super().run_node(n)


def backend(
    budget: int | str | None = None,
    *,
    device_backend: Any = None,
    order: Order = "refined",
    min_bytes: int | str = "64KiB",
    kappa: float = 1.2,
    residency_weight: float = 0.05,
    speed: DeviceSpeed | None = None,
    debug: bool = False,
    wait_for_stores: bool = False,
) -> OffloadBackend:
    """A ``torch.compile`` backend that offloads saved activations to host memory.

    ``torch.compile(model, backend=memfit_offload.backend(budget="12GiB"))``.

    Args:
        budget: device bytes the compiled step's graphs may hold (parameters and saved activations
            included), as an int or a size string (``"12GiB"``, ``"512MB"``). The pass offloads
            the largest eligible activations until the predicted peak fits; ``None`` offloads every
            eligible activation.
        device_backend: the memfit backend whose copy stream the transfers use; default: the
            active cpu-sim device, else the best available backend.
        order: where prefetches go: ``"refined"`` (Algorithm 1), ``"jit"`` (right before their
            first reader) or ``"none"`` (no offload: the baseline).
        min_bytes: activations smaller than this stay on the device.
        kappa: margin (≥ 1) on transfer times: an activation is offloaded only when the compute
            between its uses is at least ``kappa`` times its round trip; the refinement plans
            transfers ``kappa`` times longer than estimated.
        residency_weight: seconds of exposed transfer that holding the whole budget for one second
            is worth, in the refinement's cost (:mod:`memfit_offload.schedule`).
        speed: the compute and copy rates the cost model times operators and transfers with
            (:class:`~memfit_offload.costs.DeviceSpeed`). Default: on a CPU device, rates measured
            once per process (milliseconds) with the backend's copy bandwidth; on an accelerator,
            :class:`DeviceSpeed`'s defaults with the backend's copy bandwidth. Give it to make the
            decisions independent of how busy the machine was when they were measured.
        debug: run graphs node by node and raise :class:`~memfit_offload.ops.ResidencyError` when
            an operator reads a released tensor, or a prefetched one before its wait.
        wait_for_stores: a release waits for its store to finish, so the measured peak is the
            schedule's whatever the machine's load (see :class:`~memfit_offload.ops.OffloadRuntime`).

    Raises:
        MemfitError: an invalid budget, size, order or margin; the message says what is expected.
    """
    budget_bytes = None if budget is None else _size(budget, "offload budget")
    if order not in _ORDERS:
        raise MemfitError(f"invalid offload order {order!r}: choose one of {', '.join(_ORDERS)}")
    if not kappa >= 1.0:
        raise MemfitError(f"invalid kappa {kappa!r}: a margin on transfer times must be at least 1.0")
    if not residency_weight >= 0:
        raise MemfitError(f"invalid residency_weight {residency_weight!r}: it must be zero or positive")
    if speed is not None and not isinstance(speed, DeviceSpeed):
        raise MemfitError(f"invalid speed {speed!r}: expected a memfit_offload.costs.DeviceSpeed")
    return OffloadBackend(
        budget_bytes,
        device_backend=device_backend,
        order=order,
        min_bytes=_size(min_bytes, "min_bytes") if min_bytes != 0 else 0,
        kappa=kappa,
        residency_weight=residency_weight,
        speed=speed,
        debug=debug,
        wait_for_stores=wait_for_stores,
    )
