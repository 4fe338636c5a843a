"""Evaluation: perplexity in non-overlapping windows, and multiple-choice accuracy via lm-eval.

``import fedcompress.eval`` is cheap: lm-eval is imported only when :func:`zero_shot` runs.
"""

from fedcompress.eval.errors import (
    EmptyTaskError,
    EvalInputError,
    MalformedRecordError,
    SeqlenError,
    TaskSpecError,
    TextTooShortError,
    UnknownSplitError,
    UnknownTaskError,
)
from fedcompress.eval.perplexity import CALC_DTYPE, PerplexityResult, perplexity, tokenize_text
from fedcompress.eval.zeroshot import (
    DEFAULT_PROMPT,
    TaskResult,
    load_task_dir,
    validate_records,
    zero_shot,
)

__all__ = [
    "CALC_DTYPE",
    "DEFAULT_PROMPT",
    "EmptyTaskError",
    "EvalInputError",
    "MalformedRecordError",
    "PerplexityResult",
    "SeqlenError",
    "TaskResult",
    "TaskSpecError",
    "TextTooShortError",
    "UnknownSplitError",
    "UnknownTaskError",
    "load_task_dir",
    "perplexity",
    "tokenize_text",
    "validate_records",
    "zero_shot",
]
