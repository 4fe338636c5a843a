"""One base for every settings class: typed fields, declared validation, one ``from_dict``.

A method's settings (what its clients receive, how its server evaluates, how its ServerApp
runs) are frozen dataclasses derived from :class:`Settings`, each field declared with
:func:`setting`::

    @dataclass(frozen=True)
    class MySettings(Settings):
        label: ClassVar[str] = "my method"
        clients: int = setting(16, "Number of clients.", ge=1)
        method: str = setting("wanda", "Local pruning.", choices=("magnitude", "wanda"))

A method's settings may be composed of *pieces*: a class that declares no field of its own and
derives from two or more settings classes is their composition (the pieces keep their fields,
their checks and their help group; the composition takes every piece's flat keys and adds the
checks across pieces)::

    @dataclass(frozen=True)
    class RunConfig(FederationSettings, PruningSettings):   # the fields of both, flat
        label: ClassVar[str] = "my method"

        def validate(self) -> None:                         # checks across the pieces
            ...

    RunConfig(clients=8, sparsity=0.6).piece(PruningSettings)   # the pruning piece alone

The field's type, default, help text and checks live in that one place: the CLI options, the
ServerApp settings and the Flower run-config table are derived from it. :meth:`Settings.from_dict`
takes flat values from any source (CLI, TOML, a Flower run config or ``ConfigRecord``; keys
with ``-`` or ``_``), rejects unknown keys, and converts every value the same way
(:func:`convert`); then the declared checks run, then :meth:`Settings.validate` for checks
across fields. Every failure is a :class:`SettingsError` naming the setting, the value and what
was expected.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

__all__ = ["FederationBase", "ServerSettings", "Settings", "SettingsError", "Spec", "convert",
           "setting"]

S = TypeVar("S", bound="Settings")
P = TypeVar("P", bound="Settings")

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


class SettingsError(ValueError):
    """A setting is unknown or its value is invalid."""


@dataclass(frozen=True)
class Spec:
    """What a field accepts: help text, allowed values, bounds (``None``: unbounded)."""

    help: str = ""
    choices: tuple[Any, ...] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def expected(self, kind: type) -> str:
        """What a valid value is, in words (for error messages)."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        name = {int: "an integer", float: "a number", bool: "true or false",
                str: "a string"}.get(kind, kind.__name__)
        bounds = [f"{op} {_num(v)}" for op, v in ((">=", self.ge), (">", self.gt),
                                                  ("<=", self.le), ("<", self.lt))
                  if v is not None]
        if kind is float and self.ge is not None and self.lt is not None:
            return f"a number in [{_num(self.ge)}, {_num(self.lt)})"
        if kind is float and self.ge is not None and self.le is not None:
            return f"a number in [{_num(self.ge)}, {_num(self.le)}]"
        return f"{name} {' and '.join(bounds)}".strip() if bounds else name

    def ok(self, value: Any) -> bool:
        if self.choices is not None and value not in self.choices:
            return False
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                return False
            return not ((self.ge is not None and value < self.ge)
                        or (self.gt is not None and value <= self.gt)
                        or (self.le is not None and value > self.le)
                        or (self.lt is not None and value >= self.lt))
        return True


def _num(value: float) -> str:
    return f"{value:g}"


def setting(default: Any, help: str = "", *, choices: Sequence[Any] | None = None,
            ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None) -> Any:
    """A settings field: its default, its help text and its declared checks."""
    spec = Spec(help, None if choices is None else tuple(choices), ge, gt, le, lt)
    return dataclasses.field(default=default, metadata={"spec": spec})


def convert(kind: type, name: str, value: Any) -> Any:
    """``value`` as ``kind`` (int, float, bool or str), the same way for every source.

    * bool: a bool, or the strings true/false, 1/0, yes/no (any case);
    * int: an int, a float with an integer value, or a string of an integer (not a bool);
    * float: an int or float, or a string of a number (not a bool);
    * str: a string.
    """
    def bad() -> SettingsError:
        return SettingsError(f"{name}={value!r} is invalid: expected "
                             f"{Spec().expected(kind)}")

    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise bad()
    if isinstance(value, bool):
        raise bad()
    if kind is int:
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                raise bad() from None
        raise bad()
    if kind is float:
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                raise bad() from None
        raise bad()
    if kind is str:
        if isinstance(value, str):
            return value
        raise bad()
    raise TypeError(f"setting {name}: unsupported type {kind!r}")


@dataclass(frozen=True)
class Settings:
    """Base of every settings class (see the module docstring)."""

    label: ClassVar[str] = "settings"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            spec = f.metadata.get("spec")
            if spec is None:
                continue
            value = getattr(self, f.name)
            kind = self.types()[f.name]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)  # an int where a float is declared is that float
                object.__setattr__(self, f.name, value)
            typed = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
            if not (typed and spec.ok(value)):
                raise SettingsError(f"{f.name}={value!r} is invalid: expected "
                                    f"{spec.expected(kind)}")
        for piece in self.pieces():
            if piece is not type(self):
                piece.validate(self)  # each piece's own checks, then the composition's
        self.validate()

    def validate(self) -> None:
        """Checks across fields (override; raise :class:`SettingsError`). A piece checks its
        own fields; a composition, the fields of several pieces."""

    def invalid(self, name: str, expected: str) -> SettingsError:
        """The error for field ``name`` of this object: its value and what was expected."""
        return SettingsError(f"{name}={getattr(self, name)!r} is invalid: expected {expected}")

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def types(cls) -> dict[str, type]:
        """Field name -> its scalar type (int, float, bool, str)."""
        cached = cls.__dict__.get("_types")
        if cached is None:
            hints = typing.get_type_hints(cls)
            cached = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
            type.__setattr__(cls, "_types", cached)
        return cached

    @classmethod
    def pieces(cls) -> tuple[type[Settings], ...]:
        """The settings classes this one is composed of, in the order of its bases (``(cls,)``
        for a class that declares fields of its own: it is one piece)."""
        bases = tuple(b for b in cls.__bases__ if issubclass(b, Settings) and b is not Settings)
        if len(bases) < 2 or cls._declares_fields():
            return (cls,)
        return tuple(p for b in bases for p in b.pieces())

    @classmethod
    def _declares_fields(cls) -> bool:
        own = cls.__dict__.get("__annotations__", {})
        return any(f.name in own for f in dataclasses.fields(cls))

    @classmethod
    def owner(cls, name: str) -> type[Settings]:
        """The piece that declares setting ``name``."""
        for piece in cls.pieces():
            if name in piece.names():
                return piece
        raise KeyError(name)

    def piece(self, piece: type[P]) -> P:
        """This object's settings of ``piece`` (one of :meth:`pieces`), as that class."""
        if piece not in self.pieces():
            raise TypeError(f"{piece.__name__} is not a piece of {type(self).__name__}: "
                            f"expected one of {[p.__name__ for p in self.pieces()]}")
        return piece(**{name: getattr(self, name) for name in piece.names()})

    @classmethod
    def names(cls) -> list[str]:
        """The settings' names: each piece's in its declaration order."""
        if cls.pieces() == (cls,):
            return [f.name for f in dataclasses.fields(cls)]
        return [name for piece in cls.pieces() for name in piece.names()]

    @classmethod
    def from_dict(cls: type[S], values: Mapping[str, Any]) -> S:
        """From flat settings of any source; keys with ``-`` or ``_``; unknown keys are an
        error naming them and the known ones."""
        flat = {str(k).replace("-", "_"): v for k, v in values.items()}
        types = cls.types()
        unknown = sorted(set(flat) - set(types))
        if unknown:
            raise SettingsError(f"unknown {cls.label} setting(s) {unknown}: expected some of "
                                f"{sorted(types)}")
        return cls(**{k: convert(types[k], k, v) for k, v in flat.items()})

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.names()}

    def replace(self: S, **changes: Any) -> S:
        return dataclasses.replace(self, **changes)

    # -- description -------------------------------------------------------------------------
    @classmethod
    def defaults(cls) -> dict[str, Any]:
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        return {name: fields[name] for name in cls.names()}

    @classmethod
    def spec(cls, name: str) -> Spec:
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f.metadata.get("spec", Spec())
        raise KeyError(name)


@dataclass(frozen=True)
class ServerSettings(Settings):
    """How a method's ServerApp drives a run (server only): the fields every method shares.
    ``baselines``: comma-separated names among ``baseline_names`` (``none`` or empty: no
    baseline); a method redeclares a field to change its default."""

    label: ClassVar[str] = "server"
    baseline_names: ClassVar[tuple[str, ...]] = ()

    out: str = setting("", "Output folder (empty: runs/COMMAND-TIME).")
    device: str = setting("auto", "torch device of the server (auto: cuda if available, else "
                          "cpu).")
    baselines: str = setting("", "Comma-separated baselines (or none).")
    save_model: bool = setting(True, "Save the compressed model in OUT/model.")
    save_dtype: str = setting("auto", "dtype of the saved model: auto (the input model's dtype, "
                              "bfloat16 for the embedded models, or --dtype when that is "
                              "bfloat16 or float16), float32, bfloat16 or float16.",
                              choices=("auto", "float32", "bfloat16", "float16"))
    timeout: float = setting(3600.0, "Seconds to wait for the clients' replies of a round.",
                             gt=0.0)

    def validate(self) -> None:
        unknown = sorted(set(self.baseline_list()) - set(self.baseline_names))
        if unknown:
            raise self.invalid("baselines", f"some of {', '.join(self.baseline_names)} (or "
                                            f"none); unknown: {unknown}")

    def baseline_list(self) -> list[str]:
        """The baselines asked for, in order."""
        names = [b.strip() for b in self.baselines.split(",") if b.strip()]
        return [] if names == ["none"] else names


class FederationBase(Settings):
    """Base of a method's federation piece, which declares ``clients`` (the sites) and
    ``min_clients`` (the fewest valid sites to go on with; 0: all): the check between them and
    :attr:`required_clients`, once for every method. It declares no setting itself."""

    if TYPE_CHECKING:
        clients: int
        min_clients: int

    def validate(self) -> None:
        if self.min_clients > self.clients:
            raise self.invalid("min_clients", f"at most clients={self.clients} (0: all)")

    @property
    def required_clients(self) -> int:
        """Fewest valid client replies a round may go on with."""
        return self.min_clients or self.clients
