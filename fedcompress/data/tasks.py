"""Multiple-choice QA tasks stored as JSON Lines.

Every line of a task file is one example::

    {"id": "<task>-<n>", "question": str, "choices": [str, ...], "label": int}

``question`` is the task input (with the task's prefix, if it has one), ``choices`` the candidate
answers in source order, and ``label`` the index of the correct choice. Files are validated when
loaded.

Task names accepted by :func:`load_task` and :func:`task_files`:

* bundled (:data:`BUNDLED_TASKS`), from BIG-bench, splits ``train``, ``validation``, ``test``
  (see ``bundled/SOURCES.md`` for how they were made);
* a local ``.jsonl`` file (it serves whichever split is asked for), or a directory holding
  ``<split>.jsonl`` files.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, TypedDict

from fedcompress.data._jsonl import read_jsonl
from fedcompress.data.corpora import BUNDLED_DIR
from fedcompress.data.errors import (
    TaskFormatError,
    UnknownSplitError,
    UnknownTaskError,
    format_choices,
)

__all__ = [
    "BUNDLED_TASKS",
    "TASK_SPLITS",
    "TaskExample",
    "load_task",
    "task_files",
    "validate_example",
]

logger = logging.getLogger(__name__)

TASK_SPLITS: tuple[str, ...] = ("train", "validation", "test")
"""Splits of every bundled task."""

BUNDLED_TASKS: tuple[str, ...] = (
    "hyperbaton",
    "presuppositions_as_nli",
    "social_iqa",
    "strategyqa",
)
"""Names of the multiple-choice tasks shipped with the package (BIG-bench)."""

_REQUIRED_FIELDS = ("id", "question", "choices", "label")


class TaskExample(TypedDict):
    """One multiple-choice example."""

    id: str
    question: str
    choices: list[str]
    label: int


def task_files(name: str) -> dict[str, Path]:
    """The file of each split of task ``name``.

    For a bundled task or a directory: the ``<split>.jsonl`` files that exist (every split for a
    bundled task). For a single ``.jsonl`` file: that file for every split.

    Raises:
        UnknownTaskError: ``name`` is not bundled and not an existing ``.jsonl`` file or a
            directory holding ``<split>.jsonl`` files.
    """
    if name in BUNDLED_TASKS:
        folder = BUNDLED_DIR / "tasks" / name
        files = {split: folder / f"{split}.jsonl" for split in TASK_SPLITS}
        missing = [str(p) for p in files.values() if not p.is_file()]
        if missing:
            raise UnknownTaskError(
                f"bundled task {name!r} is missing {format_choices(missing)}; regenerate the "
                "bundled data with `python -m fedcompress.data.build --archives DIR`"
            )
        return files
    path = Path(name)
    if path.is_file() and path.suffix == ".jsonl":
        return {split: path for split in TASK_SPLITS}
    if path.is_dir():
        files = {s: path / f"{s}.jsonl" for s in TASK_SPLITS if (path / f"{s}.jsonl").is_file()}
        if files:
            return files
    raise UnknownTaskError(
        f"unknown task {name!r}; expected one of the bundled tasks "
        f"({format_choices(BUNDLED_TASKS)}), a path to an existing .jsonl file, or a directory "
        "holding <split>.jsonl files"
    )


def load_task(name: str, split: str) -> list[TaskExample]:
    """Load and validate the ``split`` of task ``name``.

    Raises:
        UnknownTaskError: see :func:`task_files`.
        UnknownSplitError: the task has no such split.
        TaskFormatError: a line breaks the schema, ids repeat, or the file has no examples.
    """
    files = task_files(name)
    if split not in files:
        raise UnknownSplitError(
            f"task {name!r} has no split {split!r}; expected one of {format_choices(files)}"
        )
    path = files[split]
    if name not in BUNDLED_TASKS and Path(name).is_file():
        logger.info("local task file %s is used as split %r", path, split)
    examples: list[TaskExample] = []
    seen: set[str] = set()
    for line_number, record in read_jsonl(path, TaskFormatError):
        example = validate_example(record, where=f"{path}:{line_number}")
        if example["id"] in seen:
            raise TaskFormatError(f"{path}:{line_number}: duplicate example id {example['id']!r}")
        seen.add(example["id"])
        examples.append(example)
    if not examples:
        raise TaskFormatError(f"task {name!r} split {split!r}: {path} holds no examples")
    return examples


def validate_example(record: dict[str, Any], where: str = "example") -> TaskExample:
    """Check ``record`` against the schema and return its four fields as a :class:`TaskExample`.

    Extra fields are allowed (and dropped from the returned example).

    Raises:
        TaskFormatError: a field is missing or has the wrong type, there are fewer than two
            choices, a choice is not a string, or ``label`` is not a valid choice index.
    """
    missing = [field for field in _REQUIRED_FIELDS if field not in record]
    if missing:
        raise TaskFormatError(
            f"{where}: missing field(s) {format_choices(missing)}; expected "
            f"{format_choices(_REQUIRED_FIELDS)}"
        )
    example_id, question, choices, label = (record[f] for f in _REQUIRED_FIELDS)
    if not isinstance(example_id, str) or not example_id:
        raise TaskFormatError(f"{where}: 'id' must be a non-empty string, got {example_id!r}")
    if not isinstance(question, str) or not question.strip():
        raise TaskFormatError(
            f"{where}: 'question' must be a non-empty string, got {question!r:.80}"
        )
    if not isinstance(choices, list) or len(choices) < 2:
        raise TaskFormatError(
            f"{where}: 'choices' must be a list of at least 2 strings, got {choices!r:.120}"
        )
    for i, choice in enumerate(choices):
        if not isinstance(choice, str):
            raise TaskFormatError(f"{where}: choice {i} must be a string, got {choice!r}")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise TaskFormatError(
            f"{where}: 'label' must be an integer index in [0, {len(choices) - 1}], got {label!r}"
        )
    return TaskExample(id=example_id, question=question, choices=list(choices), label=label)
