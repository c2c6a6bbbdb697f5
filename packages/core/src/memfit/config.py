"""Validated configuration: the base model every config section uses, and human-readable sizes.

Sizes accept what people write: ``"12GiB"``, ``"512MB"``, ``"1.5 GiB"``, or a plain integer of
bytes. Decimal units are powers of 1000 (``MB``), binary units powers of 1024 (``MiB``), as in
pydantic's :class:`pydantic.ByteSize`, which does the parsing. A size is a whole number of bytes:
one written in a larger unit is rounded down to whole bytes (``"3.3GiB"`` is 3543348019), but a
count of bytes with a fraction (``"0.5B"``, ``10.5``), a size under one byte, or ``True`` is an error,
not a silent 0 or 1.

Example:
    ```python
    from memfit.config import MemfitConfig, parse_size

    parse_size("12GiB")                     # 12884901888
    config = MemfitConfig.model_validate({"budget": "512MB", "backend": {"name": "cpu-sim"}})
    config.budget                           # 512000000
    ```
"""

from __future__ import annotations

import difflib
from decimal import Decimal
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ByteSize, ConfigDict, Field, TypeAdapter, ValidationError

from memfit.errors import MemfitError


class MemfitModel(BaseModel):
    """Base of every memfit config section and plan: strict, immutable, documented fields.

    Example:
        ```python
        from memfit.config import MemfitModel, Size, validate_model
        from memfit.errors import MemfitError


        class CacheOptions(MemfitModel):
            size: Size = "1GiB"
            '''Bytes to keep.'''
            ratio: float = 0.5


        options = CacheOptions(size="512MiB")
        options.size, options.ratio                           # (536870912, 0.5)
        options.model_dump()                                  # {'size': 536870912, 'ratio': 0.5}
        try:
            validate_model(CacheOptions, {"sise": "2GiB"}, what="cache options")
        except MemfitError as exc:
            print(exc)   # invalid cache options: sise: Extra inputs are not permitted ...; did you mean 'size'?
        ```
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, use_attribute_docstrings=True)


_NOT_WHOLE = "not a whole number of bytes (give e.g. 1, '1KiB' or '1.5GiB')"


def _whole_bytes(value: Any) -> Any:
    """Refuse what :class:`pydantic.ByteSize` would turn into a count of bytes nobody meant.

    ``ByteSize`` takes ``True`` for 1 and truncates ``"0.5B"`` to 0. Rounding a size written in a
    larger unit to whole bytes is harmless (``"3.3GiB"`` is 3543348019.2 bytes), so only a fraction
    of a byte given in bytes (or bits), or a nonzero size under one byte, is refused.
    """
    if isinstance(value, bool):
        raise ValueError("a size is a byte count such as 1073741824, '512MB' or '12GiB', not a bool")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{value} bytes is {_NOT_WHOLE}")
    if isinstance(value, str) and (found := ByteSize.byte_string_re.match(value)) is not None:
        scalar, unit = found.groups()
        per_unit = ByteSize.byte_sizes.get((unit or "b").lower())
        if per_unit is not None:
            exact = Decimal(scalar) * Decimal(per_unit)
            if exact != exact.to_integral_value() and (per_unit <= 1 or exact < 1):
                raise ValueError(f"that is {exact.normalize():f} bytes, {_NOT_WHOLE}")
    return value


Size = Annotated[ByteSize, BeforeValidator(_whole_bytes), Field(ge=0)]
"""A non-negative whole byte count that accepts human sizes such as ``"12GiB"``."""

_size_adapter: TypeAdapter[ByteSize] = TypeAdapter(Size)


def parse_size(value: str | int, *, what: str = "size") -> int:
    """Parse a human size (``"12GiB"``, ``"512MB"``, ``1024``) into bytes.

    Raises:
        MemfitError: the value is not a size, or not a whole number of bytes (``"0.5B"``, ``True``);
            the message shows what was given and why, or examples.
    """
    try:
        return int(_size_adapter.validate_python(value))
    except ValidationError as exc:
        reasons = [str(err["ctx"]["error"]) for err in exc.errors() if err["type"] == "value_error"]
        why = reasons[0] if reasons else "expected a byte count such as 1073741824, '512MB' or '12GiB'"
        raise MemfitError(f"invalid {what} {value!r}: {why}") from exc


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def size_unit(nbytes: float) -> tuple[str, int]:
    """The binary unit :func:`format_size` writes ``nbytes`` in, and its bytes.

    ``size_unit(3 * 2**30) == ("GiB", 2**30)``
    """
    for power, unit in enumerate(_BINARY_UNITS):
        if abs(nbytes) < 1024 ** (power + 1) or unit == _BINARY_UNITS[-1]:
            return unit, 1024**power
    raise AssertionError("unreachable")


def format_size(nbytes: float, unit: str | None = None) -> str:
    """Binary human size, e.g. ``format_size(3 * 2**30) == '3.00 GiB'``.

    ``unit`` (``"MiB"``, ...) writes it in that unit instead, so that sizes shown together compare
    at a glance: ``format_size(2**29, unit="GiB") == '0.50 GiB'``.
    """
    name, scale = size_unit(nbytes) if unit is None else (unit, 1024 ** _BINARY_UNITS.index(unit))
    return f"{int(nbytes)} B" if name == "B" else f"{nbytes / scale:.2f} {name}"


class BackendConfig(MemfitModel):
    """Which device backend to use, and its options.

    Example:
        ```python
        from memfit.config import BackendConfig
        from memfit.plugins import get_hooks

        config = BackendConfig(name="cpu-sim", capacity="64MiB")
        config.capacity                                     # 67108864
        options = config.model_dump(exclude={"name"}, exclude_none=True)   # {'capacity': 67108864}
        backend = get_hooks().create_backend(config.name, **options)
        backend.capacity_bytes                              # 67108864
        backend.close()
        ```
    """

    name: str | None = None
    """Backend name (``cpu-sim``, ``cuda``, ``npu``); ``None`` picks the best available one."""
    capacity: Size | None = None
    """Device capacity to enforce or emulate; ``None`` means the device's own (cpu-sim: 16 GiB)."""
    copy_bandwidth: Size | None = None
    """cpu-sim only: host-device copy bandwidth in bytes per second; ``None`` means the default."""


class MemfitConfig(MemfitModel):
    """The root configuration.

    Example:
        ```python
        import tomllib
        from memfit.config import MemfitConfig
        from memfit.errors import MemfitError

        text = '''
        budget = "12GiB"
        [backend]
        name = "cpu-sim"
        capacity = "16GiB"
        '''
        config = MemfitConfig.from_mapping(tomllib.loads(text))
        config.budget, config.backend.name, config.backend.capacity   # (12884901888, 'cpu-sim', 17179869184)
        try:
            MemfitConfig.from_mapping({"budgett": "1GiB"})
        except MemfitError as exc:
            print(exc)   # invalid memfit config: budgett: Extra inputs are not permitted ...; did you mean 'budget'?
        ```
    """

    budget: Size | None = None
    """Device bytes training must stay under; ``None`` means the device capacity."""
    backend: BackendConfig = BackendConfig()
    """Backend selection and options."""

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> MemfitConfig:
        """Validate a mapping (e.g. loaded from TOML), turning errors into one readable message.

        Raises:
            MemfitError: naming every offending field by its dotted path.
        """
        return validate_model(cls, data, what="memfit config")


Model = TypeVar("Model", bound=MemfitModel)


def validate_model(model: type[Model], data: Any, *, what: str) -> Model:
    """Validate ``data`` as ``model``, turning errors into one :class:`MemfitError` that names each field.

    A misspelt field also gets the field it probably meant (``margn: ...; did you mean 'margin'?``).

    Raises:
        MemfitError: ``invalid <what>:`` then one line per problem.
    """
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise MemfitError(f"invalid {what}:\n{describe_validation_error(exc, model)}") from exc


def describe_validation_error(exc: ValidationError, model: type[MemfitModel] | None = None) -> str:
    """One line per problem: ``field.path: message (got value)``.

    With ``model``, an unknown top-level field also gets the closest known one, or the list of them.
    """
    lines = []
    for err in exc.errors():
        path = ".".join(str(part) for part in err["loc"]) or "<root>"
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        hint = ""
        if model is not None and err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            known = list(model.model_fields)
            close = difflib.get_close_matches(str(err["loc"][0]), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(known)}"
        lines.append(f"  {path}: {err['msg']}{got}{hint}")
    return "\n".join(lines)
