"""What to simulate: a model and its training step, from a preset, a transformers config or the user's code.

A **model source** is a string, the same on the command line and in Python:

* a preset of the reference Llama: ``tiny``, ``small``, ``medium``, ``llama2-7b``, ``llama3-8b``;
* ``hf:<model_type>``: a HuggingFace transformers architecture built from its config class with
  random weights (nothing is downloaded): ``hf:gpt2``, ``hf:llama``, ``hf:mistral``, ...;
* ``package.module:function``: any importable function that returns ``(model, optimizer, batch)``
  (the ``build`` of :func:`memfit_simulator.capture.capture_step`). It runs under fake tensors,
  so it may build a 70B model on a laptop.

``overrides`` (``--set key=value``) replace fields of the preset's ``LlamaConfig`` or of the
transformers config (``num_hidden_layers=32``); an unknown field is an error, never ignored.

The step is ``step(model, optimizer, batch)``; :func:`default_step` calls the model on the batch
(``model(**batch)`` for a dict, ``model(*batch)`` for a tuple), takes the loss from what it returns
(a scalar tensor, ``.loss`` as transformers returns it, ``["loss"]``, or the first element of a
tuple), drops the rest of the output (the logits) before backward, runs backward, the optimizer
step and ``zero_grad``.

Example:
    ```python
    from memfit_simulator.models import model_source

    source = model_source("hf:gpt2", batch=4, seq=256, overrides={"n_layer": 4})
    source.build, source.step, source.settings
    ```
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from memfit.errors import MemfitError
from memfit.workload import DTYPES as WORKLOAD_DTYPES
from memfit.workload import PRESETS, Workload

DTYPES = {name: getattr(torch, torch_name) for name, (torch_name, _) in WORKLOAD_DTYPES.items()}
"""Every dtype name memfit accepts (:data:`memfit.workload.DTYPES`) → its torch dtype."""
OPTIMIZERS = ("adamw", "adam", "sgd", "none")

Build = Callable[[], tuple[torch.nn.Module, "torch.optim.Optimizer | None", Any]]
Step = Callable[[torch.nn.Module, "torch.optim.Optimizer | None", Any], Any]


@dataclass(frozen=True)
class ModelSource:
    """A model and its step, ready for :func:`memfit_simulator.simulation.simulate`.

    Example:
        ```python
        import torch
        from memfit_simulator.models import ModelSource, model_source
        from memfit_simulator.simulation import simulate

        preset = model_source("tiny", batch=2, seq=16, overrides={"n_layers": 1})
        print(preset.settings)   # {'model': 'tiny', 'layers': 1, 'batch': 2, 'seq': 16, 'dtype': 'float32', ...}

        def build():   # a model of your own: (model, optimizer, batch), built under fake tensors
            model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512))
            return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(32, 512)

        def step(model, optimizer, batch):
            model(batch).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        mine = ModelSource(build, step, {"model": "mlp", "batch": 32})
        for source in (preset, mine):
            result = simulate(source.build, source.step, device="h100", settings=source.settings)
            print(result.settings["model"], result.memory.peak_bytes)   # tiny 1410560, then mlp 17126400
        ```
    """

    build: Build
    step: Step
    settings: dict[str, Any]
    """What was asked, for reports (``model``, ``batch``, ``seq``, ``dtype``, ``optimizer``, overrides)."""


def model_source(
    source: str | Workload,
    *,
    batch: int | None = None,
    seq: int | None = None,
    dtype: str | None = None,
    optimizer: str = "adamw",
    overrides: dict[str, Any] | None = None,
    step: str | Step | None = None,
) -> ModelSource:
    """Resolve a model source (module docs) or a :class:`memfit.workload.Workload` to ``build`` and ``step``.

    ``batch``, ``seq``, ``dtype`` and ``overrides`` are the workload's fields (:func:`as_workload`);
    they and ``optimizer`` shape the presets' and transformers models' steps; a user's function builds
    its own batch and optimizer, so they do not apply to it. ``step`` is a function or a
    ``package.module:function`` string (default: :func:`default_step`).

    Raises:
        MemfitError: an unknown preset, architecture, dtype, optimizer or config field; a function
            that cannot be imported; a non-positive size.
    """
    workload = as_workload(source, batch=batch, seq=seq, dtype=dtype, overrides=overrides)
    check_shape(workload.batch, workload.seq, workload.dtype, optimizer)
    batch, seq, model = workload.batch, workload.seq, workload.model
    overrides = dict(workload.overrides)
    step_fn = import_function(step, "step") if isinstance(step, str) else step
    common = {"batch": batch, "seq": seq, "dtype": workload.dtype, "optimizer": optimizer}
    if workload.kind == "hf":
        if workload.layers:  # transformers' configs map it to their own name (n_layer for gpt2)
            named = sorted({"num_hidden_layers", "n_layer", "n_layers", "num_layers"} & set(overrides))
            if named:
                raise MemfitError(f"give the layers once: --layers or --set {named[0]}, not both")
            overrides["num_hidden_layers"] = workload.layers
        build = _transformers_build(model[3:], batch, seq, DTYPES[workload.dtype], optimizer, overrides)
        return ModelSource(build, step_fn or default_step, {"model": model, **common, **overrides})
    if workload.kind == "function":
        if overrides or workload.layers:
            raise MemfitError(f"--set and --layers do not apply to {model}: the function builds its own model")
        build = import_function(model, "build")
        _takes_no_arguments(build, model)
        return ModelSource(build, step_fn or default_step, {"model": model})
    if model not in PRESETS:
        raise MemfitError(
            f"unknown model {model!r}: use a preset ({', '.join(PRESETS)}), hf:<model_type> (hf:gpt2, hf:llama) "
            "or package.module:function returning (model, optimizer, batch)"
        )
    config = workload.llama_config()
    build, preset_step = reference_step(config, batch, seq, DTYPES[workload.dtype], optimizer)
    asked = {k: v for k, v in overrides.items() if k != "n_layers"}  # reported as "layers"
    settings = {"model": model, "layers": config.n_layers, **common, **asked}
    return ModelSource(build, step_fn or preset_step, settings)


def as_workload(
    source: str | Workload,
    *,
    batch: int | None = None,
    seq: int | None = None,
    dtype: str | None = None,
    layers: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> Workload:
    """``source`` itself if it is a :class:`~memfit.workload.Workload`, else the workload the fields name.

    A field left ``None`` takes the workload's default (batch 8, seq 128, float32).

    Raises:
        MemfitError: a workload and fields both (which would win?), or a field out of range.
    """
    fields = {"batch": batch, "seq": seq, "dtype": dtype, "layers": layers, "overrides": overrides}
    given = {name: value for name, value in fields.items() if value is not None}
    if isinstance(source, Workload):
        if given:
            raise MemfitError(f"give a Workload or {', '.join(given)}, not both: the workload already names them")
        return source
    check_shape(given.get("batch", 1), given.get("seq", 1), given.get("dtype", "float32"), "adamw")
    return Workload.checked(model=source, **given)


def check_shape(batch: int, seq: int, dtype: str, optimizer: str) -> None:
    """Raise a :class:`MemfitError` naming the first of these a step cannot take."""
    if dtype not in DTYPES:
        raise MemfitError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if optimizer not in OPTIMIZERS:
        raise MemfitError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    if batch < 1 or seq < 1:
        raise MemfitError(f"batch and seq must be positive, got {batch} and {seq}")


def import_function(spec: str, what: str) -> Callable[..., Any]:
    """``package.module:function`` imported (dots after the colon walk attributes)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise MemfitError(f"{spec!r} is not package.module:function (the {what} function to import)")
    if "" not in sys.path and os.getcwd() not in sys.path:  # a console script does not see the working directory
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise MemfitError(
            f"cannot import {module_name!r} for {spec}: {exc}. Run from the directory that holds it, or add it to "
            "PYTHONPATH"
        ) from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise MemfitError(f"{module_name} has no {attribute!r} (from {spec})")
        target = getattr(target, part)
    if not callable(target):
        raise MemfitError(f"{spec} is a {type(target).__name__}, not a function")
    return target


def _takes_no_arguments(function: Callable[..., Any], spec: str) -> None:
    try:
        inspect.signature(function).bind()
    except TypeError as exc:
        raise MemfitError(
            f"{spec} cannot be called without arguments ({exc}); the build function takes none and returns "
            "(model, optimizer, batch)"
        ) from None
    except ValueError:  # a builtin without a signature: let the call decide
        pass


def default_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, batch: Any) -> None:
    """Forward on the batch, backward of the loss it returns, optimizer step, ``zero_grad`` (module docs)."""
    if isinstance(batch, dict):
        output = model(**batch)
    elif isinstance(batch, tuple | list):
        output = model(*batch)
    else:
        output = model(batch)
    loss = loss_of(output)
    del output  # a well-behaved loop does not hold the logits through the update
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)


def loss_of(output: Any) -> torch.Tensor:
    """The scalar loss in a model's output, or a :class:`MemfitError` that says what to do."""
    candidates = [output]
    if getattr(output, "loss", None) is not None:
        candidates.insert(0, output.loss)
    if isinstance(output, dict) and "loss" in output:
        candidates.insert(0, output["loss"])
    if isinstance(output, tuple | list) and output:
        candidates.append(output[0])
    for c in candidates:
        if isinstance(c, torch.Tensor) and c.numel() == 1 and c.requires_grad:
            return c
    raise MemfitError(
        f"the model returned {type(output).__name__}, not a scalar loss. Give the batch what the model needs to "
        "compute its loss (transformers: labels=input_ids), return the loss from forward, or pass a step function "
        "(--step package.module:function taking model, optimizer, batch)"
    )


def parse_overrides(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``["n_layer=4", "use_cache=false"]`` as ``{"n_layer": 4, "use_cache": False}`` (numbers, booleans, strings)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise MemfitError(f"--set {pair!r} is not key=value (e.g. --set num_hidden_layers=4)")
        lowered = text.strip().lower()
        if lowered in ("true", "false", "none", "null"):
            value: Any = {"true": True, "false": False}.get(lowered)
        else:
            try:
                value = ast.literal_eval(text.strip())
            except (ValueError, SyntaxError):
                value = text.strip()
        out[key.strip()] = value
    return out


def _transformers_build(
    model_type: str, batch: int, seq: int, dtype: torch.dtype, optimizer: str, overrides: dict[str, Any]
) -> Build:
    """A causal LM of ``model_type`` from its config class (random weights), a batch of token ids and labels."""
    try:
        import transformers
    except ImportError:
        raise MemfitError(f"hf:{model_type} needs transformers: pip install transformers") from None
    try:
        config = transformers.AutoConfig.for_model(model_type)
    except ValueError:
        common = ("gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt_neox", "opt")
        known = ", ".join(name for name in common if name in transformers.CONFIG_MAPPING)
        raise MemfitError(
            f"transformers {transformers.__version__} has no architecture {model_type!r}; hf:<model_type> takes a "
            f"model_type of its config classes, e.g. {known}"
        ) from None
    unknown = sorted(k for k in overrides if not hasattr(config, k))
    if unknown:
        raise MemfitError(
            f"the {type(config).__name__} of hf:{model_type} has no field {', '.join(unknown)}; see "
            f"transformers' {type(config).__name__} for its fields"
        )
    for key, value in overrides.items():
        setattr(config, key, value)
    limit = next((getattr(config, k) for k in ("max_position_embeddings", "n_positions") if hasattr(config, k)), None)
    if isinstance(limit, int) and seq > limit:
        raise MemfitError(
            f"seq {seq} exceeds hf:{model_type}'s {limit} positions; lower --seq or --set max_position_embeddings"
            f" (n_positions for gpt2) to at least {seq}"
        )
    config.use_cache = False  # training: no key/value cache
    vocab = int(config.vocab_size)

    def build():
        previous, verbosity = torch.get_default_dtype(), transformers.logging.get_verbosity()
        torch.set_default_dtype(dtype)  # parameters in the training dtype (Module.to swaps fake parameters)
        transformers.logging.set_verbosity_error()  # its notes about config defaults are not the user's concern
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        finally:
            torch.set_default_dtype(previous)
            transformers.logging.set_verbosity(verbosity)
        model.train()
        if getattr(model, "loss_type", "") is None:  # GPT2LMHeadModel's name does not say ForCausalLM:
            model.loss_type = "ForCausalLM"  # the loss it falls back to anyway, without the warning
        tokens = torch.randint(0, vocab, (batch, seq))
        opt = None if optimizer == "none" else make_optimizer(optimizer, list(model.parameters()))
        return model, opt, {"input_ids": tokens, "labels": tokens}

    return build


def model_config(model: str | Any, seq: int, layers: int | None = None) -> Any:
    """The preset (or config) with ``layers`` and room for ``seq`` tokens (as :meth:`Workload.llama_config`)."""
    if isinstance(model, str):
        return Workload.checked(model=model, seq=seq, layers=layers).llama_config()
    return dataclasses.replace(model, n_layers=layers or model.n_layers).with_room_for(seq)


def make_optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizers ``simulate_training`` knows, with the settings :func:`memfit.models.build_training` uses."""
    if name not in OPTIMIZERS:
        raise MemfitError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")
    return {
        "adamw": lambda: torch.optim.AdamW(params, lr=3e-3, foreach=False),
        "adam": lambda: torch.optim.Adam(params, lr=3e-3, foreach=False),
        "sgd": lambda: torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=False),
        "none": lambda: torch.optim.SGD(params, lr=0.0),
    }[name]()


def reference_step(config: Any, batch: int, seq: int, dtype: torch.dtype, optimizer: str) -> tuple[Any, Any]:
    """``(build, step)`` for :func:`memfit_simulator.capture.capture_step`: the reference Llama's training step."""
    from memfit.models import Llama

    def build():
        # Created in the training dtype directly: Module.to() swaps fake parameters, which
        # FakeTensorMode's weak references forbid. (The model has no buffers to convert.)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            net = Llama(config)
        finally:
            torch.set_default_dtype(previous)
        tokens = torch.randint(0, config.vocab_size, (batch, seq + 1))
        return (
            net,
            make_optimizer(optimizer, list(net.parameters())),
            (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()),
        )

    def step(net, opt, data):
        loss = net.loss(*data)
        loss.backward()
        if optimizer != "none":
            opt.step()
        opt.zero_grad(set_to_none=True)

    return build, step
