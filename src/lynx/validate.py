"""Typed validation at the edges, driven by dataclass field types and per-field ranges in field metadata.

Every spec, option set and file record lynx reads is a frozen dataclass; `build(cls, data, where)` checks a
mapping against `cls` before constructing it: unknown and missing fields, the type of every value (`4.5`
is not an `int`, `true` is not an `int`, `"8"` is not a number), finiteness (no NaN or inf anywhere) and
the field's range. A numeric field without a declared range must be >= 0 (nothing lynx reads is
negative); declare `field(metadata=rng(gt=0))` for stricter bounds, or `rng()` for any sign. New fields are
covered by their type alone, so a field added to ModelSpec is checked without touching this module.

Messages name the place (`where`: a file, `plan: model`, an option) and the field and say what is valid.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from lynx.errors import LynxError, PlanFormatError, SpecError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Range:
    """Bounds of a number: `gt`/`ge` below, `lt`/`le` above; None is unbounded."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def holds(self, x: float) -> bool:
        return ((self.gt is None or x > self.gt) and (self.ge is None or x >= self.ge)
                and (self.lt is None or x < self.lt) and (self.le is None or x <= self.le))

    def describe(self) -> str:
        lo = f"> {self.gt:g}" if self.gt is not None else (f">= {self.ge:g}" if self.ge is not None else "")
        hi = f"< {self.lt:g}" if self.lt is not None else (f"<= {self.le:g}" if self.le is not None else "")
        if lo and hi:
            return f"{lo} and {hi}"
        return lo or hi or "finite"


NON_NEGATIVE = Range(ge=0)
POSITIVE = Range(gt=0)
FRACTION = Range(gt=0, le=1)
"""In (0, 1]: efficiencies."""


def rng(gt: float | None = None, ge: float | None = None, lt: float | None = None,
        le: float | None = None) -> dict[str, Range]:
    """Field metadata declaring a range: `x: int = field(default=1, metadata=rng(gt=0))`."""
    return {"range": Range(gt, ge, lt, le)}


class _Invalid(Exception):
    """One field's problem, before the place is known."""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _type_name(tp: Any) -> str:
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    return getattr(tp, "__name__", str(tp))


def _number(value: Any, tp: type, rng_: Range) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float) or (tp is int and not isinstance(value, int)):
        raise _Invalid(f"must be {_type_name(tp)}, got {value!r}")
    if not math.isfinite(value):
        raise _Invalid(f"must be a finite number, got {value!r}")
    if not rng_.holds(value):
        raise _Invalid(f"must be {rng_.describe()}, got {value!r}")
    return float(value) if tp is float else value


def check_value(value: Any, tp: Any, rng_: Range = NON_NEGATIVE) -> Any:
    """`value` checked against the type `tp`; returns it converted (lists to tuples, strings to enums,
    mappings to nested dataclasses). Raises _Invalid with what is wrong."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        first: _Invalid | None = None
        for a in args:
            if a is type(None):
                continue
            try:
                return check_value(value, a, rng_)
            except _Invalid as e:
                first = first or e
        raise first or _Invalid(f"must not be {value!r}")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed or isinstance(value, bool) != any(isinstance(a, bool) for a in allowed):
            raise _Invalid(f"must be one of {', '.join(map(str, allowed))}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _Invalid(f"must be a list, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(check_value(v, args[0], rng_) for v in value)
        if len(args) != len(value):
            raise _Invalid(f"must have {len(args)} entries, got {len(value)}")
        return tuple(check_value(v, a, rng_) for v, a in zip(value, args, strict=True))
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _Invalid(f"must be a mapping, got {value!r}")
        return value
    if tp in (int, float):
        return _number(value, tp, rng_)
    if tp is bool or tp is str:
        if not isinstance(value, tp):
            raise _Invalid(f"must be {_type_name(tp)}, got {value!r}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        try:
            return tp(value)
        except ValueError:
            raise _Invalid(f"must be one of {', '.join(str(m.value) for m in tp)}, got {value!r}") from None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise _Invalid(f"must be a mapping of {tp.__name__} fields, got {value!r}")
        return _Nested(tp, value)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise _Invalid(f"must be {_type_name(tp)}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class _Nested:
    """A mapping for a nested dataclass field, built by `build` with the nested place in messages."""

    cls: type
    data: Mapping[str, Any]


def field_range(f: dataclasses.Field[Any]) -> Range:
    r = f.metadata.get("range")
    return r if isinstance(r, Range) else NON_NEGATIVE


def check_mapping(cls: type, data: Any, where: str, error: type[LynxError] = SpecError) -> dict[str, Any]:
    """The keyword arguments for `cls(**...)` from `data`, every field checked; raises `error` naming
    `where` and the field."""
    if not isinstance(data, Mapping):
        raise error(f"{where}: expected a mapping of fields, got {type(data).__name__}")
    fields = _fields(cls)
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise error(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise error(f"{where}: missing required field(s) {', '.join(missing)}")
    hints = _hints(cls)
    out: dict[str, Any] = {}
    for name, value in data.items():
        try:
            v = check_value(value, hints.get(name, Any), field_range(fields[name]))
        except _Invalid as e:
            raise error(f"{where}: {name} {e}") from None
        out[name] = build(v.cls, v.data, f"{where}: {name}", error) if isinstance(v, _Nested) else v
    return out


def build(cls: type[T], data: Any, where: str, error: type[LynxError] = SpecError) -> T:
    """`cls` from a mapping, validated field by field; the class's own cross-field checks (its
    `__post_init__`) report with `where` in front."""
    kwargs = check_mapping(cls, data, where, error)
    try:
        return cls(**kwargs)
    except LynxError as e:
        msg = str(e)
        raise error(msg if msg.startswith(where) else f"{where}: {msg}") from None
    except (TypeError, ValueError) as e:
        raise error(f"{where}: {e}") from None


_CHECKED: dict[Any, None] = {}
"""Frozen instances already found valid (by value): a search builds the same model, hardware, options and layouts
tens of thousands of times, and a valid value stays valid. Bounded; cleared when full."""
_CHECKED_MAX = 1 << 14


def check_instance(obj: Any, where: str, error: type[LynxError] = SpecError) -> None:
    """Check a constructed dataclass's own field values (for objects built in code, not from files)."""
    cls: type = type(obj)
    params = getattr(cls, "__dataclass_params__", None)
    key = None
    if params is not None and params.frozen:
        try:
            key = (cls, obj)
            if key in _CHECKED:
                return
        except TypeError:  # a field holds an unhashable value (a list): check it every time
            key = None
    fields = _fields(cls)
    hints = _hints(cls)
    for name, f in fields.items():
        try:
            check_value(getattr(obj, name), hints.get(name, Any), field_range(f))
        except _Invalid as e:
            raise error(f"{where}: {name} {e}") from None
    if key is not None:
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED[key] = None


def check_option(option: str, value: T, rng_: Range = POSITIVE, integer: bool = False) -> T:
    """A numeric command-line option: finite and in range, or one line naming the option."""
    if value is None:
        return value
    try:
        check_value(value, int if integer else float, rng_)
    except _Invalid as e:
        raise SpecError(f"{option} {e}") from None
    return value


def check_field(value: Any, tp: Any, where: str, rng_: Range = POSITIVE,
                error: type[LynxError] = PlanFormatError) -> Any:
    """One value read from a file that is not a dataclass field (e.g. a list in a plan)."""
    try:
        return check_value(value, tp, rng_)
    except _Invalid as e:
        raise error(f"{where} {e}") from None
