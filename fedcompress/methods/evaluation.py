"""Zero-shot evaluation every method shares: its settings, the record fields, the CLI columns.

:class:`TaskEvalSettings` holds the four settings of ``--tasks`` (server only; fedprllm's
``EvalConfig`` extends it, the other methods list it among their settings classes).
:meth:`TaskEvalSettings.load_tasks` resolves and loads the tasks (before any model is loaded:
an unknown name, or one that cannot be loaded offline, fails there with the
:class:`~fedcompress.data.errors.UnknownTaskError` / ``DataUnavailableError`` naming it);
:func:`task_fields` scores one model on them and returns what its result record gets;
:func:`accuracy_columns` / :func:`accuracy_cells` put those fields in a method's CLI table.

No module here imports Flower.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fedcompress.config import Settings, setting

if TYPE_CHECKING:
    from torch import nn

    from fedcompress.eval.tasks import TaskSuite

__all__ = ["TaskEvalSettings", "accuracy_cells", "accuracy_columns", "task_fields"]


@dataclass(frozen=True)
class TaskEvalSettings(Settings):
    """Zero-shot tasks the server scores its models on (server only; empty ``tasks``: none)."""

    label: ClassVar[str] = "zero-shot evaluation"

    tasks: str = setting("", "Zero-shot tasks each model is scored on, comma-separated: "
                         "bundled tasks, .jsonl files, or lm-eval task names (online or "
                         "cached: boolq, rte, hellaswag, winogrande, arc_easy, arc_challenge, "
                         "openbookqa; 'standard' names these seven); empty: none.")
    tasks_path: str = setting("", "Extra lm-eval YAML task folders (comma-separated) whose "
                              "tasks --tasks may name.")
    task_split: str = setting("test", "Split of the bundled / .jsonl tasks (lm-eval tasks "
                              "keep their own).")
    task_limit: int = setting(0, "Score the first N examples of each task (0: all).", ge=0)

    @property
    def task_names(self) -> list[str]:
        """The tasks asked for, in order (``standard`` / ``bundled`` expanded)."""
        from fedcompress.eval.tasks import parse_names

        return parse_names(self.tasks)

    def load_tasks(self) -> TaskSuite:
        """Resolve and load every task (an empty suite without ``tasks``); see
        :func:`fedcompress.eval.tasks.load_tasks` for the names and errors."""
        from fedcompress.eval.tasks import load_tasks

        return load_tasks(self.tasks, self.task_split, self.tasks_path)


def task_fields(suite: TaskSuite | None, settings: TaskEvalSettings, model: nn.Module,
                tokenizer: Any, *, batch_size: int = 8, seed: int = 0) -> dict[str, Any]:
    """What a result record gets from scoring ``model`` on ``suite``: ``acc_<task>`` per task,
    ``mean_acc`` over them and ``zero_shot`` (every task's acc, acc_norm, stderr, examples and
    chance). Empty without tasks. ``settings.task_limit`` caps the examples per task."""
    if not suite:
        return {}
    scores = suite.evaluate(model, tokenizer, limit=settings.task_limit or None,
                            batch_size=batch_size, seed=seed, progress=False)
    fields: dict[str, Any] = {f"acc_{task}": score.acc for task, score in scores.items()}
    fields["mean_acc"] = sum(s.acc for s in scores.values()) / len(scores)
    fields["zero_shot"] = {task: asdict(score) for task, score in scores.items()}
    return fields


def accuracy_columns(results: Sequence[dict]) -> list[str]:
    """The tasks any record was scored on, in first-seen order (a CLI table's extra columns,
    headed ``acc <task>``)."""
    tasks: list[str] = []
    for record in results:
        tasks += [t for t in record.get("zero_shot", {}) if t not in tasks]
    return tasks


def accuracy_cells(record: dict, tasks: Sequence[str]) -> list[str]:
    """``record``'s accuracy on each of ``tasks`` for a CLI table (``-``: not scored)."""
    scores = record.get("zero_shot", {})
    return [f"{scores[t]['acc']:.4f}" if t in scores else "-" for t in tasks]
