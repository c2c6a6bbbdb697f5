"""Apply a plan's recomputation: checkpoint modules, keeping the operator outputs the plan saves.

A :class:`~memfit.plan.Recompute` action names a module (relative to the model, as
``model.named_modules()`` does) and, per call of each operator of its forward, whether to keep the
output for backward or recompute it there. :func:`apply_recompute` replaces each named module's
``forward`` with one that runs the original under ``torch.utils.checkpoint.checkpoint``
(non-reentrant, RNG state preserved) and torch's selective activation checkpointing (SAC):
``create_selective_checkpoint_contexts`` with a policy made fresh for every call. The instance
attribute is replaced, not the class's method, so ``Module.__call__`` and the module's hooks run
as before; :meth:`AppliedRecompute.remove` puts the module back exactly.

How a policy decides, for the ``k``-th call of an operator named ``n`` (``func._schema.name``,
e.g. ``aten::mm``; overloads share the name) in one forward call of the module:

* the plan's decision for the ``k``-th entry named ``n`` in ``Recompute.ops``: ``MUST_SAVE`` when
  its ``save`` is true, ``PREFER_RECOMPUTE`` otherwise. Calls are counted **per name**, so an
  operator torch's SAC never shows a policy (``aten::detach``, metadata queries), or one the plan's
  trace had and this run lacks, does not shift the decisions for the others;
* an operator the plan does not list, or a call beyond the plan's count: recomputed;
* always recomputed, whatever the plan says:

  - operators whose output **aliases an input**: views (free to recompute; torch's cache would
    keep a view whose base the forward may still modify) and operators that mutate an argument
    (``add_``, ``bernoulli_``: SAC caches their output before autograd bumps its version, so
    backward would fail with "Tensor cached during selective activation checkpoint has been
    mutated");
  - **random** operators (tag ``nondeterministic_seeded``): recomputation replays the RNG from the
    start of the module, so a random operator recomputed after a saved one would draw the saved
    one's numbers: silently wrong gradients (the fused attentions, tagged because they may drop
    out, only when their ``dropout_p`` is not 0);
  - operators returning **uninitialised memory** (``aten::empty_like``, ...), which a program only
    makes to fill in place (dropout's mask);
  - operators reading a **collective's output** (a functional collective's
    ``AsyncCollectiveTensor``, alone or as a DTensor's shard: tensor parallelism's reduce-scatter
    feeding the residual add). Recomputation runs the collective again; when the op that would wait
    for its output replays a kept output instead, nothing waits for it and c10d's registry of
    in-flight work keeps the output alive for good (measured: the attention's residual add kept under
    FSDP 2 x TP 2 leaked 96 KiB per block per step, and the memory stayed after the model was gone).

Forward and recomputation count separately (``ctx.is_recompute``): torch 2.13 asks the policy in
forward only and replays the decisions by call index, older torch (≥ 2.6) asks in both and needs
the same answers, which counting per phase gives. An empty ``save`` means full activation
checkpointing (so does a ``save`` with no true entry): plain non-reentrant checkpoint, no policy.

A saved output that the forward later modifies in place cannot be kept (torch's cache would be
stale); the forward raises :class:`RecomputePlanError` naming the module, the operator and its
call, instead of backward failing inside torch. When the operators named in ``save`` are called a
different number of times than the plan lists (the program changed since it was planned), a
:class:`RecomputePlanWarning` says so once per module: decisions still apply by call index.

Under ``torch.no_grad()`` (or inference mode) a checkpointed module runs its original forward
directly; so does a call with inputs of other shapes than the plan's own iterations had, once the
swap session has told the application which iterations those were
(:meth:`AppliedRecompute.end_iteration`). Modules must not nest (one checkpointed inside another's
checkpointed forward): it is an error naming both.

Finding the model in a script that does not hand it over: :class:`memfit_executor.finder.ModelFinder`.

Example:
    ```python
    from memfit.models import build_training
    from memfit.plan import Recompute
    from memfit_executor.recompute import apply_recompute

    run = build_training("tiny", batch=4, seq=32)
    actions = [Recompute(module=f"layers.{i}") for i in range(len(run.model.layers))]  # full AC
    with apply_recompute(run.model, actions):
        run.step()
    ```
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import threading
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from memfit.errors import MemfitError
from memfit.plan import Recompute
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = [
    "AppliedRecompute",
    "RecomputePlanError",
    "RecomputePlanWarning",
    "apply_recompute",
]

_MARK = "_memfit_recompute"
"""Attribute set on the replacement ``forward``: which :class:`AppliedRecompute` installed it."""


class RecomputePlanError(MemfitError, ValueError):
    """A recomputation plan does not fit the model, or the forward cannot keep what the plan saves.

    Unknown or nested modules, a module checkpointed twice; a saved output modified in place.
    """


class RecomputePlanWarning(UserWarning):
    """The program calls the operators a plan saves a different number of times than it planned for."""


def _op_name(op: Any) -> str:
    schema = getattr(op, "_schema", None)
    return decision_name(schema.name if schema is not None else op.name())


SDPA_KERNELS = frozenset({
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",
})  # fmt: skip
"""The kernels ``scaled_dot_product_attention`` dispatches to, one per device and backend."""
SDPA = "aten::scaled_dot_product_attention"


def decision_name(name: str) -> str:
    """The name a plan's decision is made under: ``name``, or :data:`SDPA` for any attention kernel.

    A plan made from a trace of one device (a simulated one runs on CPU fake tensors:
    ``_scaled_dot_product_flash_attention_for_cpu``) must keep attention on another (CUDA's flash,
    efficient or cuDNN kernel): the kernels are one operator to a plan.
    """
    return SDPA if name in SDPA_KERNELS else name


_UNINITIALISED = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                            "aten::new_empty_strided"})  # fmt: skip
"""Operators returning uninitialised memory: a program makes them to fill in place (dropout's mask)."""


@functools.cache
def _always_recomputed(op: Any) -> bool:
    """Never saved, whatever a plan says (see the module docs)."""
    schema = getattr(op, "_schema", None)
    if schema is None:  # a higher-order operator: torch.compile's business, not eager SAC's
        return False
    aliases = schema.is_mutable or any(r.alias_info is not None for r in schema.returns)
    random = torch.Tag.nondeterministic_seeded in op.tags and _dropout_argument(op) is None
    return aliases or random or schema.name in _UNINITIALISED


@functools.cache
def _dropout_argument(op: Any) -> int | None:
    """Position of ``dropout_p`` in a random-tagged operator (the fused attentions), else None.

    They are tagged random because they may drop out; without dropout they are deterministic
    and may be kept (as upstream's SAC estimator counts them).
    """
    schema = getattr(op, "_schema", None)
    if schema is None or torch.Tag.nondeterministic_seeded not in op.tags:
        return None
    names = [a.name for a in schema.arguments]
    return names.index("dropout_p") if "dropout_p" in names else None


@functools.cache
def _async_collective_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return AsyncCollectiveTensor


def _reads_collective_output(args: tuple, kwargs: dict) -> bool:
    """Whether an argument is a functional collective's output (itself, or a DTensor's shard).

    Whether it was waited for yet does not matter: the policy is asked after the operator ran (and
    waited), and recomputation makes a new one that only a recomputed consumer waits for.
    """
    collective = _async_collective_type()
    if collective is None:
        return False
    from torch.utils._pytree import tree_leaves

    return any(isinstance(getattr(x, "_local_tensor", x), collective) for x in tree_leaves((args, kwargs)))


def _drops_out(op: Any, args: tuple, kwargs: dict) -> bool:
    index = _dropout_argument(op)
    if index is None:
        return False
    p = kwargs.get("dropout_p", args[index] if len(args) > index else 0.0)
    return bool(p)


@functools.cache
def _sac_ignored_names() -> frozenset[str]:
    ignored = getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", ())  # private; absent on some versions
    return frozenset(_op_name(op) for op in ignored)


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


class _Decisions:
    """One action's plan, indexed for the policy: per operator name, save or not per call."""

    __slots__ = ("by_name", "planned_counts")

    def __init__(self, action: Recompute) -> None:
        by_name: dict[str, list[bool]] = {}
        for name, save in zip(action.ops, action.save, strict=True):
            by_name.setdefault(decision_name(name), []).append(save)
        self.by_name = {name: tuple(saves) for name, saves in by_name.items() if any(saves)}
        ignored = _sac_ignored_names()
        self.planned_counts = {name: len(saves) for name, saves in self.by_name.items() if name not in ignored}


class _CallPolicy:
    """The SAC policy of one checkpointed call: counts operator calls by name, per phase."""

    __slots__ = ("decisions", "forward_counts", "recompute_counts", "saved")

    def __init__(self, decisions: _Decisions) -> None:
        self.decisions = decisions
        self.forward_counts: dict[str, int] = {}
        self.recompute_counts: dict[str, int] = {}
        self.saved: list[tuple[str, int, torch.Tensor, int]] = []
        """Outputs kept in forward, with their version then: a later in-place change is an error."""

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        name = _op_name(op)
        recompute = getattr(ctx, "is_recompute", False)
        counts = self.recompute_counts if recompute else self.forward_counts
        k = counts.get(name, 0)
        counts[name] = k + 1
        saves = self.decisions.by_name.get(name)
        if saves is None or k >= len(saves) or not saves[k] or _always_recomputed(op) or _drops_out(op, args, kwargs):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if _reads_collective_output(args, kwargs):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if not recompute:
            output = getattr(ctx, "op_output", None)  # torch ≥ 2.7
            if output is not None:
                for tensor in output if isinstance(output, tuple | list) else (output,):
                    if isinstance(tensor, torch.Tensor):
                        self.saved.append((name, k, tensor, tensor._version))
        return CheckpointPolicy.MUST_SAVE


class _RecomputeSide:
    """What checkpoint enters around recomputation.

    Counts it, enters the caller's context (outermost) and, for selective checkpointing, torch's
    replaying dispatch mode.
    """

    __slots__ = ("applied", "inner", "stack")

    def __init__(self, applied: AppliedRecompute, inner: AbstractContextManager | None) -> None:
        self.applied = applied
        self.inner = inner
        self.stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        self.applied.recomputations += 1
        stack = contextlib.ExitStack()
        try:
            if self.applied.recompute_context is not None:
                stack.enter_context(self.applied.recompute_context())
            if self.inner is not None:
                stack.enter_context(self.inner)
        except BaseException:
            stack.close()
            raise
        self.stack = stack

    def __exit__(self, *exc_info) -> bool:
        stack, self.stack = self.stack, None
        return stack.__exit__(*exc_info) if stack is not None else False


class _CheckpointedForward:
    """The replacement ``forward`` of one module (an instance attribute; ``Module.__call__`` calls it)."""

    def __init__(self, applied: AppliedRecompute, name: str, original: Callable, action: Recompute) -> None:
        self.applied = applied
        self.name = name
        self.original = original
        self.decisions = _Decisions(action) if any(action.save) else None  # nothing kept: full checkpointing
        self.warned = False
        self.cache_turned_off = False
        """A KV cache was turned off (see :meth:`_without_cache`): the plan's trace ran its operators."""
        self.cache_keywords = _cache_keywords(getattr(original, "__self__", None))
        self.signature = inspect.signature(original) if self.cache_keywords else None
        functools.update_wrapper(self, original)  # inspect.signature(module.forward) still sees the original's
        setattr(self, _MARK, applied)

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled() or not self.applied._like_planned(self.name, (args, kwargs)):
            return self.original(*args, **kwargs)
        if self.cache_keywords:
            args, kwargs = self._without_cache(args, kwargs)
        # kwargs travel as positional inputs: checkpoint infers the device whose RNG state it
        # preserves from those, and its own keywords (debug, early_stop, ...) cannot collide.
        keys = tuple(kwargs)
        inputs = args + tuple(kwargs.values())
        n_args = len(args)
        original = self.original

        def run(*flat):
            return original(*flat[:n_args], **dict(zip(keys, flat[n_args:], strict=True)))

        options = {"use_reentrant": False, "preserve_rng_state": True}
        observing = self.applied.on_saved is not None and _SAVED_OBSERVER is not None
        if observing:
            options["determinism_check"] = _SAVED_OBSERVER
        previous = _saved.callback
        _saved.callback = self.applied.on_saved if observing else None
        try:
            if self.decisions is None:
                applied = self.applied
                contexts = lambda: (contextlib.nullcontext(), _RecomputeSide(applied, None))  # noqa: E731
                return checkpoint(run, *inputs, context_fn=contexts, **options)
            policy = _CallPolicy(self.decisions)
            out = checkpoint(run, *inputs, context_fn=self._contexts(policy), **options)
        finally:
            _saved.callback = previous
        self._check(policy)
        return out

    def _without_cache(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A transformers layer's KV-cache arguments, turned off as transformers' own checkpointing does.

        Recomputation re-runs the layer's forward; a layer that writes its cache would append its
        keys and values a second time (the next attention then reads twice the keys, and torch's
        selective checkpointing fails on operators forward did not run).
        """
        assert self.signature is not None
        try:  # the cache may come by position (GPT-2's blocks take ``past_key_values`` second)
            bound = self.signature.bind_partial(*args, **kwargs)
        except TypeError:
            return args, kwargs  # the call itself is wrong: let the forward say so
        given = bound.arguments
        on = [k for k in self.cache_keywords if k in given and given[k] is not None and given[k] is not False]
        off = {
            k: None if self.cache_keywords[k] is _KV_CACHE_ONLY else self.cache_keywords[k]
            for k in on
            if self.cache_keywords[k] is not _KV_CACHE_ONLY or _is_kv_cache(given[k])
        }
        if not off:
            return args, kwargs
        self.cache_turned_off = True
        if not self.applied.warned_cache:
            self.applied.warned_cache = True
            warnings.warn(
                f"{self.name!r} is checkpointed: its KV cache is turned off in training ({', '.join(off)}), "
                "as transformers' gradient checkpointing does (the recomputation would write the cache twice)",
                RecomputePlanWarning,
                stacklevel=3,
            )
        given.update(off)
        return bound.args, bound.kwargs

    def _contexts(self, policy: _CallPolicy) -> Callable[[], tuple[Any, Any]]:
        def context_fn():
            caching, replaying = create_selective_checkpoint_contexts(policy)
            return caching, _RecomputeSide(self.applied, replaying)

        return context_fn

    def _check(self, policy: _CallPolicy) -> None:
        for op, k, tensor, version in policy.saved:
            if tensor._version != version:
                raise RecomputePlanError(
                    f"the recomputation plan saves the {_ordinal(k + 1)} call of {op} in {self.name!r}, "
                    "but the forward then modifies its output in place, so torch's selective checkpointing "
                    "cannot keep it (backward would fail). Plan it recomputed (save=False)."
                )
        policy.saved.clear()
        if self.warned:
            return
        decisions = self.decisions
        assert decisions is not None
        seen = policy.forward_counts
        planned_counts = decisions.planned_counts
        # a name never called here is one the plan's recorder saw and the dispatcher does not (a plan
        # from a record_function trace lists kernels' inner operators): nothing to keep, nothing wrong
        differ = {n: (c, seen[n]) for n, c in planned_counts.items() if seen.get(n, 0) not in (0, c)}
        if self.cache_turned_off:  # the traced forward wrote its cache (a cat per key and value): fewer calls now
            differ = {n: (c, called) for n, (c, called) in differ.items() if called > c}
        if differ:
            self.warned = True
            detail = ", ".join(f"{n}: planned {planned}, called {called}" for n, (planned, called) in differ.items())
            warnings.warn(
                f"{self.name!r} calls the operators its recomputation plan saves a different number of times than "
                f"planned ({detail}); decisions apply by call index: plan again from a trace of this program",
                RecomputePlanWarning,
                stacklevel=2,
            )


CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""The names transformers' layers and attention modules have given their KV cache (``cache`` since 5.x)."""


def _cache_keywords(module: Any) -> dict[str, Any]:
    """The cache arguments to turn off when ``module`` is recomputed, with their off values.

    transformers marks its decoder layers by subclassing ``GradientCheckpointingLayer``, whose
    ``_can_checkpoint_with_cache`` says whether the layer only reads its cache (then it may keep it).
    Below a layer, an attention module a plan checkpoints writes the cache it is handed just the same
    (``cache.update`` appends its keys and values: recomputed, the keys are twice as long as the mask);
    its cache arguments are turned off when they hold a transformers ``Cache`` (:func:`_is_kv_cache`).
    """
    if module is None:
        return {}
    if hasattr(type(module), "_can_checkpoint_with_cache"):
        off: dict[str, Any] = {"use_cache": False}
        if not type(module)._can_checkpoint_with_cache:
            off.update(dict.fromkeys(CACHE_ARGUMENTS))
        return off
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {name: _KV_CACHE_ONLY for name in CACHE_ARGUMENTS if name in parameters}


_KV_CACHE_ONLY = object()
"""Off value of a module's cache argument that is turned off (to None) only when it holds a transformers Cache."""


def _is_kv_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers KV cache (by its classes, so transformers need not be imported)."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


class AppliedRecompute:
    """Recomputation applied to a model's modules (from :func:`apply_recompute`).

    :meth:`remove` restores every module's ``forward`` as it was; so does leaving a ``with`` block.

    Attributes:
        modules: The checkpointed modules' names, in the order of the actions.
        recomputations: How many times a checkpointed module call was recomputed in backward.
        recompute_context: The context entered around each recomputation, if any.

    Example:
        ```python
        from memfit.models import build_training
        from memfit.plan import Recompute
        from memfit_executor.recompute import apply_recompute

        run = build_training("tiny", batch=2, seq=16)
        actions = [Recompute(module="layers.0"), Recompute(module="layers.1")]   # a plan's actions: full checkpointing
        with apply_recompute(run.model, actions) as applied:   # leaving the block restores the model
            run.step()
        applied.modules, applied.recomputations     # (('layers.0', 'layers.1'), 2): each recomputed once in backward
        "forward" in vars(run.model.layers[0])      # False: the module's own forward is back
        ```
    """

    def __init__(
        self,
        recompute_context: Callable[[], AbstractContextManager] | None,
        on_saved: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.modules: tuple[str, ...] = ()
        self.recomputations = 0
        self.recompute_context = recompute_context
        self.on_saved = on_saved
        self.warned_cache = False
        """Whether turning a transformers layer's KV cache off was said (once per application)."""
        self.unlike_calls = 0
        """Calls run without checkpointing: their inputs' shapes unlike any of the plan's own iterations."""
        self._unlike_now = 0  # unlike_calls in the current iteration
        self._installed: list[tuple[nn.Module, _CheckpointedForward, Any]] = []
        self._planned_shapes: dict[str, set[tuple]] | None = None  # per module, from end_iteration(True)
        self._shapes: dict[str, set[tuple]] = {}  # this iteration's, per module

    def end_iteration(self, of_the_plan: bool) -> None:
        """Close an iteration; ``of_the_plan``: it was of the sequence the plan was made for.

        The shapes of the checkpointed calls' tensor inputs in such iterations become the plan's.
        From the first one on, a call whose inputs have shapes no call of that module had there (a
        longer batch, before the session can tell that this is another sequence) runs unchanged:
        the plan's peak is a prediction for its own shapes, and inside a checkpointed module the
        tensors are checkpoint's, which memfit's OOM handler cannot swap out. Unchanged, the call
        saves through memfit's hooks like any unplanned one. Never called (``apply_recompute`` used
        directly): every call is checkpointed.
        """
        # an iteration that called none of the modules (a record of a pass without the model, several
        # records at one step) teaches nothing: an empty set would leave every later call unchecked
        self._unlike_now = 0
        if of_the_plan and self._shapes:
            planned = self._planned_shapes if self._planned_shapes is not None else {}  # a seeded dict: in place
            for name, shapes in self._shapes.items():
                planned.setdefault(name, set()).update(shapes)
            self._planned_shapes = planned
        self._shapes = {}

    def _like_planned(self, name: str, inputs: tuple[tuple, dict]) -> bool:
        args, kwargs = inputs
        shapes = _tensor_shapes((*args, *kwargs.values()))
        self._shapes.setdefault(name, set()).add(shapes)
        known = self._planned_shapes.get(name) if self._planned_shapes is not None else None
        if not known or shapes in known:  # nothing learnt for this module yet: its shapes are the plan's
            return True
        self.unlike_calls += 1
        self._unlike_now += 1
        return False

    def seed_shapes(self, shapes: dict[str, set[tuple]]) -> None:
        """Start from shapes learnt before (per module), and learn into the same dict.

        The session keeps one dict per sequence, so that each new plan of a sequence (a GenPolicy
        trial, the chosen plan) compares its calls with the shapes of that sequence's earlier
        iterations on a recompute plan, not with nothing.
        """
        self._planned_shapes = shapes

    def ran_as_planned(self) -> bool:
        """Whether the current iteration ran the plan: it called checkpointed modules, each on the plan's shapes.

        Before the plan's first own iteration (:meth:`end_iteration`), any shapes are the plan's.
        The session tells the profiler so (``set_recomputed_source``): checkpointing changes what a
        forward pass runs and saves, and the iteration is still of the sequence the plan was made for.
        """
        return bool(self._shapes) and self._unlike_now == 0 and not any(f.warned for _, f, _ in self._installed)

    def _install(self, name: str, module: nn.Module, action: Recompute) -> None:
        previous = module.__dict__.get("forward", _NO_INSTANCE_FORWARD)
        replacement = _CheckpointedForward(self, name, module.forward, action)
        module.forward = replacement  # type: ignore[method-assign]
        self._installed.append((module, replacement, previous))

    def remove(self) -> None:
        """Restore the modules (idempotent). A forward replaced again since is left as found, with a warning."""
        installed, self._installed = self._installed, []
        for module, replacement, previous in reversed(installed):
            if module.__dict__.get("forward") is not replacement:
                warnings.warn(
                    f"{replacement.name!r}: its forward was replaced after recomputation was applied; left as found",
                    RecomputePlanWarning,
                    stacklevel=2,
                )
                continue
            if previous is _NO_INSTANCE_FORWARD:
                del module.forward
            else:
                module.forward = previous  # type: ignore[method-assign]

    @property
    def active(self) -> bool:
        """Whether the modules are still checkpointed (not removed)."""
        return bool(self._installed)

    def __enter__(self) -> AppliedRecompute:
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"AppliedRecompute({len(self.modules)} modules, {state}, {self.recomputations} recomputations)"


_NO_INSTANCE_FORWARD = object()


def _tensor_shapes(values: tuple) -> tuple:
    """The shapes and dtypes of the tensors among ``values`` and in their tuples and lists (one level)."""
    found = []
    for value in values:
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, torch.Tensor):
                found.append((tuple(item.shape), item.dtype))
    return tuple(found)


def checkpointed_by(module: nn.Module) -> AppliedRecompute | None:
    """The application that checkpoints ``module`` (its ``forward`` replaced by :func:`apply_recompute`), if any."""
    forward = module.__dict__.get("forward")
    return getattr(forward, _MARK, None) if forward is not None else None


def apply_recompute(
    model: nn.Module,
    actions: Sequence[Recompute],
    *,
    recompute_context: Callable[[], AbstractContextManager] | None = None,
    on_saved: Callable[[torch.Tensor], None] | None = None,
) -> AppliedRecompute:
    """Checkpoint the modules the actions name, saving what they say to save.

    Args:
        model: The model the action names are relative to (``""`` is the model itself).
        actions: The plan's :class:`~memfit.plan.Recompute` actions.
        recompute_context: A zero-argument callable returning a context manager, entered around
            each recomputation in backward (never in forward): e.g. to pause an operator recorder
            so that recomputed operators do not look like a changed program.
        on_saved: Called with each tensor autograd saves inside a checkpointed module in forward
            (checkpoint's own hooks take those, so a caller's ``saved_tensors_hooks`` never see
            them): the swap session counts their bytes as it counts every other save. Needs
            ``torch.utils.checkpoint``'s determinism-check table (present since torch 2.1); without
            it the callback is never called.

    Returns:
        The handle; :meth:`AppliedRecompute.remove` (or leaving its ``with`` block) undoes it.

    Raises:
        RecomputePlanError: an action names a module the model does not have (with the closest
            names), two actions name the same module or one applies again to a module already
            checkpointed, or a checkpointed module would nest inside another (both named).
            Nothing is applied then.
    """
    names = [name for name, _ in model.named_modules()]
    resolved: list[tuple[str, nn.Module, Recompute]] = []
    for action in actions:
        if not isinstance(action, Recompute):
            raise RecomputePlanError(f"apply_recompute takes Recompute actions, got {type(action).__name__}")
        try:
            module = model.get_submodule(action.module)
        except AttributeError:
            close = difflib.get_close_matches(action.module, names, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise RecomputePlanError(
                f"the recomputation plan names module {action.module!r}, which {type(model).__name__} does not "
                f"have{hint} (names are relative to the model, as in model.named_modules())"
            ) from None
        resolved.append((action.module, module, action))

    # Modules of this model already checkpointed (other handles still in place), then the new ones.
    taken: dict[int, tuple[str, nn.Module, str]] = {}
    for name, module in model.named_modules():
        if checkpointed_by(module) is not None:
            taken[id(module)] = (name, module, "already checkpointed by a recomputation still applied")
    for name, module, _ in resolved:
        if id(module) in taken:
            other, _, why = taken[id(module)]
            alias = "" if other == name else f" (as {other!r})"
            raise RecomputePlanError(
                f"module {name!r}{alias} is {why}: a module is checkpointed once "
                "(remove() the earlier one first, or drop the duplicate action)"
            )
        taken[id(module)] = (name, module, "named by another action of this plan")
    for outer_name, outer, _ in taken.values():
        for inner_path, inner in outer.named_modules(prefix=outer_name):
            if inner is not outer and id(inner) in taken:
                inner_name = taken[id(inner)][0]
                via = "" if inner_path == inner_name else f" (reached as {inner_path!r})"
                raise RecomputePlanError(
                    f"module {inner_name!r}{via} is inside {outer_name!r}, and both would be checkpointed: "
                    "nested checkpointing is not supported; keep one of the two actions"
                )

    applied = AppliedRecompute(recompute_context, on_saved)
    applied.modules = tuple(name for name, _, _ in resolved)
    for name, module, action in resolved:
        applied._install(name, module, action)
    return applied


class _SavedCallback(threading.local):
    callback: Callable[[torch.Tensor], None] | None = None


_saved = _SavedCallback()


def _observe_saved(x: torch.Tensor) -> Any:
    """The metadata function checkpoint calls for each tensor it packs: tell the observer, then the default."""
    callback = _saved.callback
    if callback is not None and torch._C._current_graph_task_id() == -1:  # forward, not backward's check
        callback(x)
    return _default_metadata(x)


def _register_saved_observer() -> str | None:
    # checkpoint calls a "determinism check" metadata function on every tensor it packs, the only
    # public-facing way to see the saves of a checkpointed region; the table is private, so fail soft
    import torch.utils.checkpoint as checkpointing

    table = getattr(checkpointing, "_allowed_determinism_checks_to_fns", None)
    if not isinstance(table, dict) or "default" not in table:
        return None
    global _default_metadata
    _default_metadata = table["default"]
    table.setdefault("memfit_saved_bytes", _observe_saved)
    return "memfit_saved_bytes"


_default_metadata: Callable[[torch.Tensor], Any] = lambda x: None  # noqa: E731
_SAVED_OBSERVER = _register_saved_observer()
