"""Zero-shot tasks by name: the bundled tasks, local ``.jsonl`` files and lm-eval's own tasks.

:func:`load_tasks` resolves every name once, before any model is pruned, so a bad name fails at
once; :meth:`TaskSuite.evaluate` then scores any number of models on the same tasks. A name is,
in this order:

* a task of :mod:`fedcompress.data.tasks` (offline: the bundled BIG-bench tasks and the derived
  ones; a local ``.jsonl`` file or folder of ``<split>.jsonl``; ``glue:<config>`` online), scored
  by :func:`fedcompress.eval.zeroshot.zero_shot` on ``split``;
* an lm-eval task name (``boolq``, ``rte``, ``hellaswag``, ``winogrande``, ``arc_easy``,
  ``arc_challenge``, ``openbookqa``, ...), or ``lm_eval:<name>`` to prefer lm-eval's task over a
  bundled one of the same name, resolved through lm-eval's ``TaskManager``: first in the extra
  YAML task folders (``tasks_path``, ``os.pathsep``- or comma-separated), then in lm-eval's
  built-in tasks (indexed once per process, a few seconds). Each task keeps its own split,
  prompt and metrics; its dataset comes from the Hugging Face hub or the local cache. When it
  cannot be loaded (offline, ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` set, and not cached)
  :class:`~fedcompress.data.errors.DataUnavailableError` names the task and says it needs the
  internet or a local YAML task.
"""

from __future__ import annotations

import difflib
import functools
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedcompress.data import tasks as task_data
from fedcompress.data.errors import (
    DataError,
    UnknownTaskError,
    data_unavailable,
    format_choices,
)
from fedcompress.eval.errors import EvalInputError
from fedcompress.eval.zeroshot import TaskResult, run_task_dict, zero_shot

__all__ = [
    "LM_EVAL_PREFIX",
    "STANDARD_TASKS",
    "TaskSuite",
    "load_tasks",
    "parse_names",
    "task_manager",
]

logger = logging.getLogger(__name__)

#: Prefix that sends a name to lm-eval even when a bundled task has that name.
LM_EVAL_PREFIX = "lm_eval:"
#: The seven zero-shot tasks of Wanda / FedPrLLM's tables (lm-eval names; online).
STANDARD_TASKS = ("boolq", "rte", "hellaswag", "winogrande", "arc_easy", "arc_challenge",
                  "openbookqa")


def parse_names(value: str | Sequence[str] | None) -> list[str]:
    """``"a,b"`` / ``["a", "b"]`` -> names; empty, ``"none"``: none; ``"standard"``: the
    seven standard lm-eval tasks; ``"bundled"``: every bundled task."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    names: list[str] = []
    for item in (str(i).strip() for i in items):
        if not item or item == "none":
            continue
        expanded = {"standard": STANDARD_TASKS, "bundled": task_data.BUNDLED_TASKS}.get(item,
                                                                                       (item,))
        names += [n for n in expanded if n not in names]
    return names


def _paths(tasks_path: str | Sequence[str] | None) -> tuple[str, ...]:
    if not tasks_path:
        return ()
    items = (tasks_path.replace(",", os.pathsep).split(os.pathsep)
             if isinstance(tasks_path, str) else list(tasks_path))
    paths = tuple(str(Path(p).expanduser().resolve()) for p in items if str(p).strip())
    missing = [p for p in paths if not Path(p).is_dir()]
    if missing:
        raise EvalInputError(f"tasks_path: {format_choices(missing)} is not a folder (expected "
                             "folders of lm-eval task YAML files)")
    return paths


@functools.lru_cache(maxsize=4)
def task_manager(paths: tuple[str, ...] = (), include_defaults: bool = True) -> Any:
    """lm-eval's ``TaskManager`` over the YAML folders ``paths`` (and its built-in tasks), built
    once per process (indexing the built-in tasks takes seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(paths) or None, include_defaults=include_defaults)


def _is_fedcompress_task(name: str) -> bool:
    return (name in task_data.BUNDLED_TASKS or name in task_data.DERIVED_TASKS
            or name.startswith(task_data.GLUE_PREFIX) or Path(name).exists()
            or name.endswith(".jsonl"))


@dataclass
class TaskSuite:
    """Resolved tasks: fedcompress records (scored on ``split``) and loaded lm-eval tasks.

    Attributes:
        names: The requested names, in order.
        split: Split of the fedcompress tasks.
        records: ``{name: {split: [record, ...]}}`` of the fedcompress tasks.
        lm_eval: ``{name: lm-eval's loaded task dict}`` (``manager.load([name])``).
    """

    names: list[str]
    split: str = "test"
    records: dict[str, dict[str, list]] = field(default_factory=dict)
    lm_eval: dict[str, Mapping[str, Any]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.names)

    def evaluate(self, model: torch.nn.Module, tokenizer: Any, *, limit: int | None = None,
                 batch_size: int = 8, seed: int = 1234, progress: bool = False
                 ) -> dict[str, TaskResult]:
        """Accuracy of ``model`` on every task, in the order of :attr:`names` (a group of
        lm-eval tasks gives one result per member task, ``"<name>/<member>"``). ``limit`` caps
        the examples per task."""
        scores: dict[str, TaskResult] = {}
        if self.records:
            scores.update(zero_shot(model, tokenizer, self.records, split=self.split,
                                    limit=limit, batch_size=batch_size, seed=seed,
                                    progress=progress))
        for name, loaded in self.lm_eval.items():
            raw = run_task_dict(model, tokenizer, loaded, batch_size=batch_size,
                                num_fewshot=None, seed=seed, progress=progress, limit=limit)
            members = list(loaded["tasks"])
            for member in members:
                key = name if len(members) == 1 else f"{name}/{member}"
                scores[key] = _lm_eval_result(key, raw["results"][member],
                                              raw["samples"].get(member, []))
        order = {n: i for i, n in enumerate(self.names)}
        return dict(sorted(scores.items(), key=lambda kv: order.get(kv[0].split("/")[0], 0)))


def _lm_eval_result(name: str, metrics: Mapping[str, Any], samples: Sequence[Any]
                    ) -> TaskResult:
    if "acc,none" not in metrics:
        raise EvalInputError(f"lm-eval task {name!r} reports no accuracy (metrics "
                             f"{sorted(k for k in metrics if ',' in k)}); only multiple-choice "
                             "tasks with an acc metric are supported")
    choices = [len(s.get("arguments", ())) for s in samples if isinstance(s, Mapping)]
    chance = (sum(1.0 / c for c in choices if c) / len(choices)
              if choices and all(choices) else math.nan)
    result = TaskResult(acc=float(metrics["acc,none"]),
                        acc_stderr=_float(metrics.get("acc_stderr,none")),
                        acc_norm=_float(metrics.get("acc_norm,none")),
                        acc_norm_stderr=_float(metrics.get("acc_norm_stderr,none")),
                        n=len(samples), chance=chance)
    logger.info("%s: acc=%.4f acc_norm=%.4f n=%d (lm-eval)", name, result.acc, result.acc_norm,
                result.n)
    return result


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def load_tasks(names: str | Sequence[str] | None, split: str = "test",
               tasks_path: str | Sequence[str] | None = None) -> TaskSuite:
    """Resolve and load every task of ``names`` (see the module docstring).

    Raises:
        UnknownTaskError: a name is neither a fedcompress task nor an lm-eval task (the message
            lists close lm-eval names).
        DataUnavailableError: a hub task cannot be loaded (offline and not cached, or the
            download failed); the message names it and says it needs the internet or a local
            YAML task (``tasks_path``).
        EvalInputError: a ``tasks_path`` entry is not a folder, or names repeat.
    """
    wanted = parse_names(names)
    paths = _paths(tasks_path)
    suite = TaskSuite(names=wanted, split=split)
    for name in wanted:
        if not name.startswith(LM_EVAL_PREFIX) and _is_fedcompress_task(name):
            suite.records[name] = {split: _load_fedcompress_task(name, split)}
        else:
            suite.lm_eval[name] = _load_lm_eval_task(name, paths)
    if wanted:
        logger.info("tasks: %s", ", ".join(
            f"{n} ({'lm-eval' if n in suite.lm_eval else 'fedcompress'})" for n in wanted))
    return suite


def _load_fedcompress_task(name: str, split: str) -> list:
    try:
        return task_data.load_task(name, split)
    except DataError:
        raise
    except Exception as err:  # a glue: task offline, not cached
        raise data_unavailable(f"task {name!r}", err, "a bundled task "
                               f"({format_choices(task_data.BUNDLED_TASKS)}) or a local .jsonl "
                               "file") from err


def _load_lm_eval_task(name: str, paths: tuple[str, ...]) -> Mapping[str, Any]:
    task_name = name.removeprefix(LM_EVAL_PREFIX)
    manager = task_manager(paths, include_defaults=False) if paths else None
    if manager is None or task_name not in manager.all_tasks:
        manager = task_manager(paths, include_defaults=True)
    if task_name not in manager.all_tasks:
        close = difflib.get_close_matches(task_name, manager.all_tasks, n=5)
        raise UnknownTaskError(
            f"unknown task {name!r}: not a bundled task ({format_choices(task_data.BUNDLED_TASKS)}"
            "), not a local .jsonl file, and not an lm-eval task"
            + (f" (close lm-eval names: {format_choices(close)})" if close else "")
            + (f" in lm-eval's tasks or {format_choices(paths)}" if paths else "")
            + "; extra lm-eval YAML tasks are read from --tasks-path DIR")
    try:
        loaded = manager.load([task_name])
    except Exception as err:  # the dataset download (offline, no cache) or the task's config
        raise data_unavailable(
            f"lm-eval task {name!r}", err,
            "a bundled task or a local YAML task (a folder given with --tasks-path whose "
            "dataset is local, e.g. dataset_path: json with dataset_kwargs: data_files)") from err
    if not loaded["tasks"]:
        raise UnknownTaskError(f"lm-eval name {name!r} holds no task")
    logger.info("lm-eval task %r: %s", name, ", ".join(loaded["tasks"]))
    return loaded
