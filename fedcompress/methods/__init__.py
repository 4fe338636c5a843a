"""The methods of fedcompress, one home each, found by name in one registry.

A method is a module (or package) of this folder that exports ``METHOD``, a :class:`Method`:
its settings classes (on the shared base :class:`fedcompress.config.Settings`, which hold every
default), its ClientApp actions and message keys, and the names of its three thin Flower
modules (``clients/<name>.py``, ``strategies/<name>.py``, ``server/<name>.py``). The CLI builds
a command per method from it, the Simulation Engine runner its apps, and the one Flower app
(``server/app.py``, ``clients/app.py``) its dispatch, so adding a method touches its own module
and its three Flower files, nothing else. Methods of other packages register through the
``fedcompress.methods`` entry-point group (each entry point names a :class:`Method`).

No module here imports Flower.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from collections.abc import Mapping
from typing import Any

from fedcompress.methods.base import Method, MethodError, RunConfigError

__all__ = ["Method", "MethodError", "RunConfigError", "get_method", "methods",
           "run_config_table", "settings_from_run_config"]

_REGISTRY: dict[str, Method] = {}
_LOADED = False


def _register(method: Method, origin: str) -> None:
    if not isinstance(method, Method):
        raise MethodError(f"{origin}: METHOD must be a fedcompress.methods.Method, got "
                          f"{type(method).__name__}")
    if method.name in _REGISTRY and _REGISTRY[method.name] is not method:
        raise MethodError(f"{origin}: method {method.name!r} is registered twice")
    for other in _REGISTRY.values():
        if other is method:
            continue
        if other.command == method.command:
            raise MethodError(f"{origin}: command {method.command!r} of method "
                              f"{method.name!r} is already method {other.name!r}'s")
        shared = sorted(set(other.actions) & set(method.actions))
        if shared:
            raise MethodError(f"{origin}: action(s) {shared} of method {method.name!r} are "
                              f"already method {other.name!r}'s (one ClientApp serves all)")
    _REGISTRY[method.name] = method


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "METHOD"):
            _register(module.METHOD, module.__name__)
    for entry in importlib.metadata.entry_points(group="fedcompress.methods"):
        _register(entry.load(), f"entry point {entry.name}")
    _LOADED = True


def methods() -> dict[str, Method]:
    """Every registered method by name (sorted)."""
    _load()
    return dict(sorted(_REGISTRY.items()))


def get_method(name: str) -> Method:
    """The method called ``name``; a clear error naming the known ones otherwise."""
    known = methods()
    if name not in known:
        raise MethodError(f"unknown method {name!r}: expected one of {', '.join(known)}")
    return known[name]


def run_config_table(default: str = "fedprllm") -> dict[str, Any]:
    """The ``[tool.flwr.app.config]`` table: ``method`` and one sub-table of defaults per
    method (``[tool.flwr.app.config.<name>]``)."""
    table: dict[str, Any] = {"method": default}
    for name, method in methods().items():
        table[name] = method.run_config_defaults()
    return table


def settings_from_run_config(run_config: Mapping[str, Any]) -> tuple[Method, dict[str, Any]]:
    """A Flower run config (flattened: ``method``, ``<method>.<key>``) -> the method and its
    flat settings. Another method's setting changed from its default is an error (it would be
    silently ignored), as is a key no method knows."""
    if "method" not in run_config:
        raise RunConfigError("the run config has no 'method' key: expected one of "
                             f"{', '.join(methods())}")
    method = get_method(str(run_config["method"]))
    settings: dict[str, Any] = {}
    for key, value in run_config.items():
        if key == "method":
            continue
        owner, _, name = str(key).partition(".")
        if owner not in _REGISTRY or not name:
            raise RunConfigError(f"run config key {key!r}: expected 'method' or "
                                 f"'<method>.<setting>' with a method among "
                                 f"{', '.join(methods())}")
        other = _REGISTRY[owner]
        if other is method:
            settings[name] = value
            continue
        defaults = other.run_config_defaults()
        if name not in defaults:
            raise RunConfigError(f"run config key {key!r}: method {owner!r} has no setting "
                                 f"{name!r}")
        if value != defaults[name]:
            raise RunConfigError(
                f"run config {key}={value!r} is a setting of method {owner!r}, but this run's "
                f"method is {method.name!r}: set {method.name}.{name} instead (if it exists) or "
                f"method={owner!r}")
    return method, settings
