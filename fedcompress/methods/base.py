"""The contract every method exports (``METHOD``): see :mod:`fedcompress.methods`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedcompress.config import Settings, SettingsError

__all__ = ["Method", "MethodError", "RunConfigError"]


class MethodError(ValueError):
    """An unknown method, or a method whose declaration is inconsistent."""


class RunConfigError(SettingsError):
    """A Flower run config that names no method, an unknown key or another method's setting."""


@dataclass(frozen=True)
class Method:
    """One method of fedcompress: what the CLI, the simulation and the Flower apps need.

    Attributes:
        name: registry name, the run config's ``method`` value and its key namespace.
        command: the ``fedcompress`` command that runs it on the Simulation Engine.
        help: one paragraph for ``fedcompress COMMAND --help``.
        settings: the settings classes of a run, the clients' first (their flat key sets are
            disjoint; together they hold every default of the method).
        actions: Flower message type (``train.masks``) -> handler function in
            ``client_module`` (a ClientApp serves every method: types are unique).
        message_keys: the record keys its messages carry, by role (``config``, ``metrics``,
            ...), for the Flower files and tests to share.
        client_module / server_module: the thin Flower files (``server_module`` defines
            ``run(grid, settings) -> RunReport`` and ``check_settings(settings)``).
        summary: ``report dict -> (title, columns, rows, notes)`` for the CLI's table.
        aliases: deprecated option name -> current setting name.
        clear_releases: action -> what it releases of a site in the clear (its masks, its
            statistics): a site whose policy requires SecAgg+ (``require-secagg``) refuses it.
        expand: ``(flat settings, defaults) -> flat settings``, applied by :meth:`parse`
            first: settings that stand for others (FedPrLLM's ``recipe``).
    """

    name: str
    command: str
    help: str
    settings: tuple[type[Settings], ...]
    actions: Mapping[str, str]
    message_keys: Mapping[str, str]
    client_module: str
    server_module: str
    summary: Callable[[dict], tuple[str, list[str], list[list[str]], list[str]]] | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)
    clear_releases: Mapping[str, str] = field(default_factory=dict)
    expand: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for cls in self.settings:
            if "__dataclass_fields__" not in cls.__dict__:
                raise MethodError(f"method {self.name!r}: {cls.__name__} is not decorated with "
                                  "@dataclass(frozen=True): its settings would be ignored")
            for key in cls.names():
                if key in seen:
                    raise MethodError(f"method {self.name!r}: setting {key!r} is declared by "
                                      f"both {seen[key]} and {cls.__name__}")
                seen[key] = cls.__name__
        unknown = sorted(set(self.clear_releases) - set(self.actions))
        if unknown:
            raise MethodError(f"method {self.name!r}: clear_releases names {unknown}, which are "
                              "not among its actions")
        for action in self.actions:
            kind, _, name = action.partition(".")
            if kind not in ("train", "evaluate", "query") or not name.isidentifier():
                raise MethodError(f"method {self.name!r}: action {action!r} is not "
                                  "'train|evaluate|query.<name>'")

    @property
    def client_settings(self) -> type[Settings]:
        """The settings the clients receive with every message."""
        return self.settings[0]

    def defaults(self) -> dict[str, Any]:
        """Every setting's default, flat (``snake_case`` keys)."""
        out: dict[str, Any] = {}
        for cls in self.settings:
            out.update(cls.defaults())
        return out

    def owner(self, key: str) -> type[Settings]:
        for cls in self.settings:
            if key in cls.names():
                return cls
        raise KeyError(key)

    def parse(self, values: Mapping[str, Any]) -> tuple[Settings, ...]:
        """Flat settings (any source, keys with ``-`` or ``_``) -> one object per settings
        class, in order; an unknown key is an error naming this method's settings."""
        flat = {str(k).replace("-", "_"): v for k, v in values.items()}
        for old, new in self.aliases.items():
            if old in flat:
                flat.setdefault(new, flat.pop(old))
        if self.expand is not None:
            flat = self.expand(flat, self.defaults())
        known = {k for cls in self.settings for k in cls.names()}
        unknown = sorted(set(flat) - known)
        if unknown:
            raise SettingsError(f"unknown {self.name} setting(s) {unknown}: expected some of "
                                f"{sorted(known)}")
        return tuple(cls.from_dict({k: v for k, v in flat.items() if k in cls.names()})
                     for cls in self.settings)

    def run_config_defaults(self) -> dict[str, Any]:
        """This method's table of ``[tool.flwr.app.config]``: keys with ``-``."""
        return {k.replace("_", "-"): v for k, v in self.defaults().items()}
