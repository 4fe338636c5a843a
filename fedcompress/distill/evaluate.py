"""Accuracy of a (distilled) model on a multiple-choice task, in its training prompt format.

Reuses :func:`fedcompress.eval.zero_shot` (lm-eval's log-likelihood scorer: the option whose
continuation has the highest summed log-probability given the prompt wins). The prompt is the
label task's prompt of :class:`~fedcompress.distill.data.PromptFormat` (with the ``[label]``
prefix and the listed options), rendered here in Python and passed to lm-eval verbatim, and the
scored continuations are ``" " + option`` (the option's text, or its letter with
``label_target="letter"``): exactly the label targets the model was trained on, without the EOS.
Works on plain ``transformers`` models and on ``peft`` models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from fedcompress.distill.data import LABEL_TASK, PromptFormat, normalize_samples
from fedcompress.eval.zeroshot import TaskResult, zero_shot

__all__ = ["EvalFn", "accuracy_hook", "mc_records", "task_accuracy"]

#: An evaluation hook: model -> named numbers (called by the training loop).
EvalFn = Callable[[nn.Module], dict[str, float]]


def mc_records(samples: Iterable[Any], fmt: PromptFormat | None = None) -> list[dict[str, Any]]:
    """Task records whose ``question`` is the full label-task prompt and ``choices`` the
    candidate targets (without the leading separator, which lm-eval adds).

    Raises:
        ValueError: a format whose ``target_separator`` is not the single space lm-eval puts
            between context and continuation; the errors of
            :func:`~fedcompress.distill.data.normalize_samples`.
    """
    fmt = fmt or PromptFormat()
    if fmt.target_separator != " ":
        raise ValueError(f"the accuracy hook scores ' ' + option (lm-eval's target delimiter); "
                         f"target_separator={fmt.target_separator!r} is not supported")
    return [{"id": s.id, "question": fmt.prompt(LABEL_TASK, s.question, s.choices),
             "choices": fmt.options(s.choices), "label": s.label}
            for s in normalize_samples(samples)]


def task_accuracy(model: nn.Module, tokenizer: Any, samples: Iterable[Any],
                  fmt: PromptFormat | None = None, name: str = "task", batch_size: int = 8,
                  limit: int | None = None, progress: bool = False) -> TaskResult:
    """Multiple-choice accuracy of ``model`` on ``samples`` in the label-task prompt format."""
    records = mc_records(samples, fmt)
    return zero_shot(model, tokenizer, {name: {"eval": records}}, split="eval", limit=limit,
                     batch_size=batch_size, prompt="{{question}}", progress=progress)[name]


def accuracy_hook(tokenizer: Any, samples: Iterable[Any], fmt: PromptFormat | None = None,
                  name: str = "task", batch_size: int = 8, limit: int | None = None) -> EvalFn:
    """An evaluation hook for the training loop: ``model -> {"acc", "acc_norm", "n", ...}``."""
    samples = list(samples)
    mc_records(samples, fmt)  # validate now, not at the first evaluation

    def hook(model: nn.Module) -> dict[str, float]:
        res = task_accuracy(model, tokenizer, samples, fmt, name, batch_size, limit)
        return {"acc": res.acc, "acc_stderr": res.acc_stderr, "acc_norm": res.acc_norm,
                "n": res.n, "chance": res.chance}

    return hook
