"""Exceptions raised by :mod:`fedcompress.data`.

Every error is a :class:`ValueError` subclass whose message names the offending value and what
was expected, so a bad configuration fails loudly at the point where it is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, TypeGuard

import numpy as np

__all__ = [
    "CorpusFormatError",
    "DataError",
    "DataUnavailableError",
    "EmptyCorpusError",
    "EmptyTaskError",
    "InvalidParameterError",
    "NotClassificationTaskError",
    "NotEnoughTokensError",
    "PartitionError",
    "TaskFormatError",
    "UnknownCorpusError",
    "UnknownSplitError",
    "UnknownTaskError",
    "check_positive_int",
    "data_unavailable",
    "check_seed",
    "format_choices",
]


class DataError(ValueError):
    """Base class of every error raised by :mod:`fedcompress.data`."""


class InvalidParameterError(DataError):
    """A numeric argument (count, length, seed, concentration) is out of its valid range."""


class UnknownCorpusError(DataError):
    """A corpus name is neither bundled, a known hub corpus, nor an existing local path."""


class UnknownSplitError(DataError):
    """A split name is not one the corpus or task provides."""


class EmptyCorpusError(DataError):
    """A corpus, split or file holds no text."""


class CorpusFormatError(DataError):
    """A local or bundled corpus file does not follow the documented format."""


class UnknownTaskError(DataError):
    """A task name is neither bundled nor an existing local ``.jsonl`` file or directory."""


class DataUnavailableError(DataError):
    """A hub corpus or task named by the user whose data cannot be loaded here: offline
    (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``) and not in the local cache, or unreachable."""


#: Environment variables that keep Hugging Face hub / datasets offline.
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def data_unavailable(what: str, err: BaseException, alternative: str) -> DataUnavailableError:
    """The error of a named hub corpus or task (``what``) whose data could not be loaded:
    why (offline and not cached, or the download failed), what to do instead, and the cause in
    one line (never its traceback)."""
    offline = [v for v in OFFLINE_VARIABLES
               if os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")]
    if offline:
        why = (f"it needs the internet, and {' / '.join(offline)} is set and its dataset is not in "
               "the local Hugging Face cache")
    else:
        why = ("it needs the internet (or its dataset in the local Hugging Face cache) and "
               "loading it failed")
    cause = (str(err).strip().splitlines() or [""])[0][:300]
    return DataUnavailableError(
        f"{what} cannot be loaded offline: {why}. Run once online (the cache then serves it "
        f"offline), or use {alternative}. Cause: {type(err).__name__}: {cause}")


class TaskFormatError(DataError):
    """A task record (or a task file line) does not follow the multiple-choice schema.

    Attributes:
        task: Name of the task the record belongs to (``None`` if not known).
        record_id: The record's ``id``, or ``"#<index>"`` when the id itself is missing/invalid
            (``None`` for errors that are not about one record, e.g. invalid JSON).
        field: Name of the offending field (``None`` for errors not about one field).
    """

    def __init__(
        self,
        message: str,
        *,
        task: str | None = None,
        record_id: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.task = task
        self.record_id = record_id
        self.field = field


class NotClassificationTaskError(TaskFormatError):
    """A task's examples do not all have the same choices, so they have no one label set."""


class EmptyTaskError(DataError):
    """A task split, or the set of tasks to evaluate, holds no examples."""


class NotEnoughTokensError(DataError):
    """A corpus is too short to cut a calibration window of the requested length."""


class PartitionError(DataError):
    """A partition request cannot be satisfied (e.g. more clients than items)."""


def format_choices(values: Iterable[str]) -> str:
    """Render a list of valid names for an error message: ``'a', 'b', 'c'``."""
    return ", ".join(repr(v) for v in values)


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` as an ``int`` if it is an integer >= 1, else raise.

    Booleans are rejected even though ``bool`` subclasses ``int``: ``n=True`` is always a bug.
    """
    if not _is_integer(value):
        raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}")
    as_int = int(value)
    if as_int <= 0:
        raise InvalidParameterError(f"{name} must be a positive integer, got {as_int}")
    return as_int


def check_seed(value: object) -> int:
    """Return ``value`` as an ``int`` if it is a valid seed (an integer >= 0), else raise."""
    if not _is_integer(value):
        raise InvalidParameterError(f"seed must be a non-negative integer, got {value!r}")
    as_int = int(value)
    if as_int < 0:
        raise InvalidParameterError(f"seed must be a non-negative integer, got {as_int}")
    return as_int


def _is_integer(value: object) -> TypeGuard[int | np.integer[Any]]:
    """True for Python and NumPy integers, False for booleans and everything else."""
    if isinstance(value, (bool, np.bool_)):
        return False
    return isinstance(value, (int, np.integer))
