"""Exceptions raised by :mod:`fedcompress.eval`.

Every class subclasses :class:`ValueError`, so callers that only care about "bad input" can catch
that, while tests and the CLI can tell the causes apart.
"""

from __future__ import annotations

__all__ = [
    "EmptyTaskError",
    "EvalInputError",
    "MalformedRecordError",
    "SeqlenError",
    "TaskSpecError",
    "TextTooShortError",
    "UnknownSplitError",
    "UnknownTaskError",
]


class EvalInputError(ValueError):
    """Base class of every input error raised by the evaluation helpers."""


# --------------------------------------------------------------------------------- perplexity
class SeqlenError(EvalInputError):
    """The window length is unusable: shorter than 2 tokens or longer than the model context."""


class TextTooShortError(EvalInputError):
    """The evaluation text is empty or has fewer tokens than one window."""


# --------------------------------------------------------------------------------- zero-shot
class TaskSpecError(EvalInputError):
    """Base class of the errors about multiple-choice task records and task selection."""


class UnknownTaskError(TaskSpecError):
    """A requested task name is not among the tasks that were given."""


class UnknownSplitError(TaskSpecError):
    """A task has no records for the requested split."""


class EmptyTaskError(TaskSpecError):
    """A task split has no records (or none left after ``limit``)."""


class MalformedRecordError(TaskSpecError):
    """A record breaks ``{"id": str, "question": str, "choices": [str, ...], "label": int}``.

    Attributes:
        task: Name of the task the record belongs to.
        record_id: The record's ``id`` (or ``"#<index>"`` when the id itself is missing/invalid).
        field: Name of the offending field.
    """

    def __init__(self, message: str, *, task: str, record_id: str, field: str) -> None:
        super().__init__(message)
        self.task = task
        self.record_id = record_id
        self.field = field
