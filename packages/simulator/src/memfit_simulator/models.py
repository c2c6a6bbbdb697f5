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
from memfit.workload import PRESETS

DTYPES = {name: getattr(torch, torch_name) for name, (torch_name, _) in WORKLOAD_DTYPES.items()}
"""Every dtype name memfit accepts (:data:`memfit.workload.DTYPES`) → its torch dtype."""
OPTIMIZERS = ("adamw", "adam", "sgd", "none")

Build = Callable[[], tuple[torch.nn.Module, "torch.optim.Optimizer | None", Any]]
Step = Callable[[torch.nn.Module, "torch.optim.Optimizer | None", Any], Any]


@dataclass(frozen=True)
class ModelSource:
    """A model and its step, ready for :func:`memfit_simulator.simulation.simulate`."""

    build: Build
    step: Step
    settings: dict[str, Any]
    """What was asked, for reports (``model``, ``batch``, ``seq``, ``dtype``, ``optimizer``, overrides)."""


def model_source(
    source: str,
    *,
    batch: int = 8,
    seq: int = 128,
    dtype: str = "float32",
    optimizer: str = "adamw",
    overrides: dict[str, Any] | None = None,
    step: str | Step | None = None,
) -> ModelSource:
    """Resolve a model source (module docs) to ``build`` and ``step``.

    ``batch``, ``seq``, ``dtype`` and ``optimizer`` shape the presets' and transformers models'
    steps; a user's function builds its own batch and optimizer, so they do not apply to it.
    ``step`` is a function or a ``package.module:function`` string (default: :func:`default_step`).

    Raises:
        MemfitError: an unknown preset, architecture, dtype, optimizer or config field; a function
            that cannot be imported; a non-positive size.
    """
    check_shape(batch, seq, dtype, optimizer)
    overrides = dict(overrides or {})
    step_fn = import_function(step, "step") if isinstance(step, str) else step
    common = {"batch": batch, "seq": seq, "dtype": str(DTYPES[dtype]).removeprefix("torch."), "optimizer": optimizer}
    if source.startswith("hf:"):
        build = _transformers_build(source[3:], batch, seq, DTYPES[dtype], optimizer, overrides)
        return ModelSource(build, step_fn or default_step, {"model": source, **common, **overrides})
    if ":" in source:
        if overrides:
            raise MemfitError(f"--set does not apply to {source}: the function builds its own model")
        build = import_function(source, "build")
        _takes_no_arguments(build, source)
        return ModelSource(build, step_fn or default_step, {"model": source})
    if source not in PRESETS:
        raise MemfitError(
            f"unknown model {source!r}: use a preset ({', '.join(PRESETS)}), hf:<model_type> (hf:gpt2, hf:llama) "
            "or package.module:function returning (model, optimizer, batch)"
        )
    config = _replace_fields(model_config(source, seq), overrides, source)
    build, preset_step = reference_step(config, batch, seq, DTYPES[dtype], optimizer)
    asked = {k: v for k, v in overrides.items() if k != "n_layers"}  # reported as "layers"
    settings = {"model": source, "layers": config.n_layers, **common, **asked}
    return ModelSource(build, step_fn or preset_step, settings)


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


def _replace_fields(config: Any, overrides: dict[str, Any], what: str) -> Any:
    fields = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise MemfitError(f"{what} has no field {', '.join(unknown)}; its fields: {', '.join(sorted(fields))}")
    return dataclasses.replace(config, **overrides)


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
    """The preset (or config) with ``layers`` and room for ``seq`` tokens."""
    from memfit.models import LlamaConfig

    config = LlamaConfig.preset(model) if isinstance(model, str) else model
    return dataclasses.replace(config, n_layers=layers or config.n_layers, max_seq_len=max(seq, config.max_seq_len))


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
