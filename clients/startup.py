"""A site's start-up per message: what this ClientApp process spent importing and loading.

Flower 1.42's SuperNode starts a fresh ``flwr-clientapp`` process for every message, so every
message pays the imports and the loading again; under the Simulation Engine one process (a Ray
actor) serves many messages and pays them once. The ClientApp times its phases into this
process's account (:func:`timed`): ``import`` (its own module, the handler's module,
transformers and the model's architecture code) and ``load`` (the model, memory-mapped from the
site's safetensors cache, its tokenizer, the calibration windows). Each reply then carries
(:func:`message_metrics`) the seconds not reported yet, and the handler's own work:

* ``startup_import_seconds``, ``startup_load_seconds``, ``client_startup_seconds`` (their sum);
* ``compute_seconds``: the handler's time less the imports and loads within it;
* ``startup_runtime_seconds`` (the first reply of a ``flwr-clientapp`` process only): from the
  process's start to the ClientApp module (the interpreter, Flower's own imports, pulling the
  message and the FAB), Flower's share of the message's start-up.

The standard library only: the ClientApp module imports this first and times the rest.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator

IMPORT, LOAD = "import", "load"

#: this module's first import in this process: CLOCK_BOOTTIME, the clock of /proc's start times
_BOOT_AT_IMPORT = (time.clock_gettime(time.CLOCK_BOOTTIME)
                   if hasattr(time, "CLOCK_BOOTTIME") else None)
_spent = {IMPORT: 0.0, LOAD: 0.0}
_reported = {IMPORT: 0.0, LOAD: 0.0}
_runtime_reported = False


@contextlib.contextmanager
def timed(kind: str) -> Iterator[None]:
    """Add the block's wall time to this process's ``kind`` (:data:`IMPORT`, :data:`LOAD`)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _spent[kind] += time.perf_counter() - start


def runtime_seconds() -> float | None:
    """In a ``flwr-clientapp`` process (Linux): seconds from the process's start to the first
    import of this module; None elsewhere (a Ray actor or a test process serves many messages:
    its start is no message's)."""
    if _BOOT_AT_IMPORT is None or os.path.basename(sys.argv[0]) != "flwr-clientapp":
        return None
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22: starttime
        return max(_BOOT_AT_IMPORT - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def settle() -> None:
    """Count what this process spent so far as reported: a long-lived process's own start-up
    (the site agent's, :mod:`clients.site_agent`), which no message pays."""
    _reported.update(_spent)


def message_started() -> tuple[float, dict[str, float]]:
    """The clock at a handler's start, for :func:`message_metrics`."""
    return time.perf_counter(), dict(_spent)


def message_metrics(started: tuple[float, dict[str, float]]) -> dict[str, float]:
    """The start-up split of the reply to a message whose handler started at ``started``
    (:func:`message_started`): the import and load seconds this process has not reported yet
    (they are then reported), the handler's compute, and once per ``flwr-clientapp`` process
    its runtime seconds."""
    global _runtime_reported
    clock, before = started
    within = sum(_spent[k] - before[k] for k in _spent)
    split = {f"startup_{k}_seconds": _spent[k] - _reported[k] for k in (IMPORT, LOAD)}
    _reported.update(_spent)
    metrics = {**split,
               "client_startup_seconds": sum(split.values()),
               "compute_seconds": max(time.perf_counter() - clock - within, 0.0)}
    if not _runtime_reported:
        _runtime_reported = True
        runtime = runtime_seconds()
        if runtime is not None:
            metrics["startup_runtime_seconds"] = runtime
    return metrics
