"""Settings as dataclass fields that carry their own documentation, command-line spelling and checks.

``option(default, help, check=..., flag=..., aliases=...)`` declares a field; a ``Section`` (a frozen dataclass)
converts every value to its declared type on construction (ints widen to float where float is declared, a list of
two numbers becomes a pair, ``str | None`` where declared) and runs each field's check, so a bad value is a
one-line ``ConfigError`` naming its flag. Checks are small functions returning the problem in words, or None.

Deliberately left out: coercing strings into numbers (``"1e-5"`` in JSON is an error; YAML reads 1e-5 as the
float it looks like) and checks across fields (``sao.core.config.Config`` states those).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar

from sao.core.errors import ConfigError

Check = Callable[[Any], "str | None"]  # value -> the problem in words, or None when it is fine


def option(
    default: Any, help: str, *, check: Check | None = None, flag: str | None = None, aliases: tuple[str, ...] = ()
) -> Any:
    """A field with a default, its doc (``metadata["help"]``), an optional check, its flat name when it is not
    the field's own (``flag``: ``--data`` sets ``data.dataset``) and other spellings still read (``aliases``)."""
    metadata = {"help": help, "check": check, "flag": flag, "aliases": aliases}
    if isinstance(default, list | dict | set):
        return dataclasses.field(default_factory=functools.partial(type(default), default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_of(f: dataclasses.Field) -> str:
    """A field's flat name: ``--flag-name`` on the command line, ``flag_name`` in a flat settings file."""
    return f.metadata.get("flag") or f.name


def help_of(f: dataclasses.Field) -> str:
    return " ".join(f.metadata.get("help", "").split())


class Section:
    """Base of a settings section: types converted and every field's check run when it is built."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):  # types first, so that the checks compare numbers
            value = getattr(self, f.name)
            ok, converted = _convert(hints[f.name], value)
            if not ok:
                raise ConfigError(f"setting {flag_of(f)!r} must be {_describe(hints[f.name])}, got {_short(value)}")
            object.__setattr__(self, f.name, converted)
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            problem = check(getattr(self, f.name)) if check is not None else None
            if problem:
                raise ConfigError(f"--{flag_of(f).replace('_', '-')} {problem}, got {_short(getattr(self, f.name))}")


class SourceSection(Section):
    """A rollout source's own settings section (``sao.rollout.registry``), chosen by ``--rollout NAME``.

    ``implementation`` names the source class (``"module:Class"``, built by ``Class.build(context)``);
    ``implied_by`` a setting every source shares that, given alone, picks this source (``--traces LOG``);
    ``full_weights`` whether its sampler can take a full-weight version (``--finetune full``). A section
    checks what it needs of the other sections (``check``) and says what the trainer adds beside the step for it
    (``needs``): "footing_audit" (the logged log-probs' footing checked once), "sampler_tolerance" (fresh rows must
    agree with the trainer within it, else the run stops), "summary" (its totals written at the end), "publish"
    (every update published for a server). ``draws_on_demand``: the source can roll out given prompts again when
    asked (``draw_more``), which the oracle baseline and the oracle ceiling need."""

    implementation: ClassVar[str] = ""
    implied_by: ClassVar[str | None] = None
    full_weights: ClassVar[bool] = False  # whether its sampler can take a full-weight version (--finetune full)
    draws_on_demand: ClassVar[bool] = False  # whether it rolls out given prompts again on request (draw_more)

    def check(self, config: Any) -> str | None:
        return None

    def needs(self) -> dict[str, Any]:
        return {}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_type(cls: type, name: str) -> Any:
    return _hints(cls)[name]


def convert(cls: type, name: str, value: Any, spelled: str | None = None) -> Any:
    """``value`` as field ``name`` of section ``cls`` declares it, or a ConfigError naming the setting as it was
    ``spelled`` (default: its flat name)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    ok, converted = _convert(_hints(cls)[name], value)
    if not ok:
        shown = spelled or flag_of(f)
        raise ConfigError(f"setting {shown!r} must be {_describe(_hints(cls)[name])}, got {_short(value)}")
    return converted


def _convert(hint: Any, value: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for member in typing.get_args(hint):
            ok, converted = _convert(member, value)
            if ok:
                return True, converted
        return False, value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is str:
        return isinstance(value, str), value
    if isinstance(value, bool):  # True is an int to Python, never a count or a rate here
        return False, value
    if hint is int:
        return (True, int(value)) if isinstance(value, numbers.Integral) else (False, value)
    if hint is float:
        return (True, float(value)) if isinstance(value, numbers.Real) else (False, value)
    if origin is tuple:
        members = typing.get_args(hint)
        if len(members) == 2 and members[1] is Ellipsis:  # tuple[X, ...]: one or more values of one type
            if not isinstance(value, list | tuple) or not value:
                return False, value
            items = [_convert(members[0], item) for item in value]
            return (True, tuple(c for _, c in items)) if all(ok for ok, _ in items) else (False, value)
        if not isinstance(value, list | tuple) or len(value) != len(members):
            return False, value
        items = [_convert(member, item) for member, item in zip(members, value, strict=True)]
        return (True, tuple(c for _, c in items)) if all(ok for ok, _ in items) else (False, value)
    raise TypeError(f"no type check for {hint!r}: add a rule to sao.core.settings._convert")  # a new field type


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(member) for member in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        members = typing.get_args(hint)
        if len(members) == 2 and members[1] is Ellipsis:
            return "a list of numbers" if members[0] is float else "a list of values"
        return "a pair of numbers [lo, hi]" if members == (float, float) else f"a list of {len(members)} values"
    names = {type(None): "null", bool: "true or false", str: "a string", int: "an integer", float: "a number"}
    return names[hint]


def _short(value: Any, width: int = 60) -> str:
    """``repr(value)`` cut to ``width`` characters: an error never formats a whole hostile value."""
    try:
        text = repr(value) if not isinstance(value, int) or abs(value) < 10**100 else "<a very long integer>"
    except ValueError:  # an integer past Python's digit limit
        text = "<a very long integer>"
    return text if len(text) <= width else text[: width - 1] + "…"


# --- checks --------------------------------------------------------------------------------------------------


def at_least(low: float, what: str = "") -> Check:
    """A whole number or a number ≥ ``low``."""
    return lambda value: None if value >= low else f"must be >= {low:g}{what}"


def positive(value: float) -> str | None:
    """A finite number > 0."""
    return None if math.isfinite(value) and value > 0 else "must be a finite number > 0"


def non_negative(value: float) -> str | None:
    return None if math.isfinite(value) and value >= 0 else "must be a finite number >= 0"


def between(low: float, high: float, what: str = "") -> Check:
    """A finite number in [low, high]."""
    return lambda value: None if math.isfinite(value) and low <= value <= high else f"must be {low:g} to {high:g}{what}"


def share(value: float) -> str | None:
    """A share in [0, 1)."""
    return None if math.isfinite(value) and 0 <= value < 1 else "must be a share in [0, 1)"


def one_of(*choices: Any) -> Check:
    return lambda value: None if value in choices else f"must be one of {', '.join(map(repr, choices))}"


def not_blank(value: str | None) -> str | None:
    return None if value is None or value.strip() else "must not be empty"


def all_of(*checks: Check) -> Check:
    """Every check in order; the first problem found."""

    def check(value: Any) -> str | None:
        for one in checks:
            problem = one(value)
            if problem:
                return problem
        return None

    return check
