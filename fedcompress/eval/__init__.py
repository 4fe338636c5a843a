"""Evaluation: perplexity in non-overlapping windows, and multiple-choice accuracy via lm-eval.

``import fedcompress.eval`` is cheap: lm-eval is imported only when :func:`zero_shot` runs. Task
records are read and validated by :mod:`fedcompress.data.tasks`; the task errors re-exported
here are that module's classes.
"""

from fedcompress.eval.errors import (
    EmptyTaskError,
    EvalInputError,
    SeqlenError,
    TaskFormatError,
    TextTooShortError,
    UnknownSplitError,
    UnknownTaskError,
)
from fedcompress.eval.perplexity import CALC_DTYPE, PerplexityResult, perplexity, tokenize_text
from fedcompress.eval.zeroshot import DEFAULT_PROMPT, TaskResult, zero_shot

__all__ = [
    "CALC_DTYPE",
    "DEFAULT_PROMPT",
    "EmptyTaskError",
    "EvalInputError",
    "PerplexityResult",
    "SeqlenError",
    "TaskFormatError",
    "TaskResult",
    "TextTooShortError",
    "UnknownSplitError",
    "UnknownTaskError",
    "perplexity",
    "tokenize_text",
    "zero_shot",
]
