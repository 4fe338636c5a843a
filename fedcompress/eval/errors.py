"""Exceptions raised by :mod:`fedcompress.eval`.

Every class subclasses :class:`ValueError`, so callers that only care about "bad input" can catch
that, while tests and the CLI can tell the causes apart.

The errors about multiple-choice tasks (unknown task or split, empty task, malformed record) are
the data layer's own classes (:mod:`fedcompress.data.errors`), re-exported here: the records are
validated by :func:`fedcompress.data.tasks.validate_examples`.
"""

from __future__ import annotations

from fedcompress.data.errors import (
    EmptyTaskError,
    TaskFormatError,
    UnknownSplitError,
    UnknownTaskError,
)

__all__ = [
    "EmptyTaskError",
    "EvalInputError",
    "SeqlenError",
    "TaskFormatError",
    "TextTooShortError",
    "UnknownSplitError",
    "UnknownTaskError",
]


class EvalInputError(ValueError):
    """Base class of the input errors raised by the evaluation helpers themselves."""


# --------------------------------------------------------------------------------- perplexity
class SeqlenError(EvalInputError):
    """The window length is unusable: shorter than 2 tokens or longer than the model context."""


class TextTooShortError(EvalInputError):
    """The evaluation text is empty or has fewer tokens than one window."""
