"""Zero-shot (or few-shot) multiple-choice accuracy through lm-eval, on an in-memory model.

Tasks are plain records, ``{"id": str, "question": str, "choices": [str, ...], "label": int}``,
grouped by task name and split (e.g. read by :func:`fedcompress.data.tasks.load_task`), and
checked by the data layer's validator, :func:`fedcompress.data.tasks.validate_examples`.
:func:`zero_shot` writes them to a temporary directory as JSONL, generates one lm-eval task YAML
per task there, and runs ``lm_eval.evaluator.evaluate`` on an ``HFLM`` wrapping the model object,
with a ``TaskManager`` that only indexes that directory (the hundreds of built-in lm-eval tasks
are never scanned). Hugging Face hub access is forced off for the whole call, so nothing is ever
fetched from the network.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import logging
import math
import re
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from fedcompress.data.errors import EmptyTaskError, UnknownSplitError, UnknownTaskError
from fedcompress.data.jsonl import write_jsonl
from fedcompress.data.tasks import TaskExample, validate_examples
from fedcompress.eval.common import eval_mode, hub_offline
from fedcompress.eval.errors import EvalInputError
from fedcompress.eval.perplexity import CALC_DTYPE

__all__ = [
    "DEFAULT_PROMPT",
    "Record",
    "TaskRecords",
    "TaskResult",
    "zero_shot",
]

logger = logging.getLogger(__name__)

#: One multiple-choice example:
#: ``{"id": str, "question": str, "choices": [str, ...], "label": int}``.
Record = Mapping[str, Any]
#: ``{task_name: {split_name: [record, ...]}}``.
TaskRecords = Mapping[str, Mapping[str, Sequence[Record]]]

#: Jinja template of the context; lm-eval appends ``" " + choice`` and scores the choice tokens.
DEFAULT_PROMPT = "Question: {{question}}\nAnswer:"

# Split names used inside the generated lm-eval configs (independent of the caller's names).
_EVAL_SPLIT = "eval"
_FEWSHOT_SPLIT = "fewshot"
# lm-eval log messages that are expected when passing a model object, and only noise here.
_NOISE = (
    "`pretrained` model kwarg is not of type `str`",
    "Passed an already-initialized model through `pretrained`",
)


@dataclass(frozen=True)
class TaskResult:
    """Accuracy of one task.

    Attributes:
        acc: Fraction of examples whose highest total log-likelihood choice is the label.
        acc_stderr: Standard error of ``acc`` (sample standard deviation / sqrt(n), lm-eval's).
        acc_norm: Same with the log-likelihood divided by the choice's length in characters.
        acc_norm_stderr: Standard error of ``acc_norm``.
        n: Number of examples evaluated.
        chance: Expected accuracy of a uniform random guess, ``mean(1 / len(choices))``.
    """

    acc: float
    acc_stderr: float
    acc_norm: float
    acc_norm_stderr: float
    n: int
    chance: float


# ------------------------------------------------------------------------------------ lm-eval
def _slug(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]+", "_", name).strip("_")[:40] or "task"


def _task_config(
    task_id: str,
    data_files: dict[str, str],
    cache_dir: str,
    prompt: str,
) -> dict[str, Any]:
    """lm-eval YAML config of one multiple-choice task over local JSONL files."""
    config: dict[str, Any] = {
        "task": task_id,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": data_files, "cache_dir": cache_dir},
        "output_type": "multiple_choice",
        "test_split": _EVAL_SPLIT,
        "doc_to_text": prompt,
        # Feature names (not Jinja): lm-eval then returns doc["choices"] / doc["label"] as is.
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": " ",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0},
    }
    if _FEWSHOT_SPLIT in data_files:
        config["fewshot_split"] = _FEWSHOT_SPLIT
        config["fewshot_config"] = {"sampler": "default"}
    return config


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(n in msg for n in _NOISE)


@contextlib.contextmanager
def _quiet_lm_eval(progress: bool) -> Iterator[None]:
    """Drop lm-eval's expected warnings about model objects; optionally silence its bars."""
    import datasets

    noise_filter = _DropNoise()
    hf_logger = logging.getLogger("lm_eval.models.huggingface")
    hf_logger.addFilter(noise_filter)
    bars_were_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # "Generating eval split" bars of the tiny JSONL loads
    # lm-eval's "Building contexts" bar has no switch; swap its module's tqdm while we run.
    task_module = importlib.import_module("lm_eval.api.task")
    saved_tqdm = getattr(task_module, "tqdm", None)
    if not progress and saved_tqdm is not None:
        task_module.tqdm = functools.partial(saved_tqdm, disable=True)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        hf_logger.removeFilter(noise_filter)
        if saved_tqdm is not None:
            task_module.tqdm = saved_tqdm  # type: ignore[attr-defined]
        if bars_were_enabled:
            datasets.enable_progress_bars()


def _select(
    tasks: TaskRecords,
    names: Sequence[str] | None,
    split: str,
    fewshot_split: str | None,
    num_fewshot: int,
) -> tuple[dict[str, Sequence[Record]], dict[str, Sequence[Record] | None]]:
    """Pick the evaluation split (and the few-shot split) of each requested task."""
    if isinstance(names, str):
        names = [names]
    if not isinstance(tasks, Mapping):
        raise EvalInputError(
            f"tasks must be {{task: {{split: [records]}}}}, got {type(tasks).__name__}"
        )
    if not tasks:
        raise EmptyTaskError("no tasks given")
    selected = list(tasks) if names is None else list(names)
    if not selected:
        raise EmptyTaskError("names is empty: no task to evaluate")
    unknown = [n for n in selected if n not in tasks]
    if unknown:
        raise UnknownTaskError(f"unknown task name(s) {unknown}; available: {sorted(tasks)}")
    if len(set(selected)) != len(selected):
        raise EvalInputError(f"task names are repeated in {selected}")

    eval_sets: dict[str, Sequence[Record]] = {}
    shot_sets: dict[str, Sequence[Record] | None] = {}
    for name in selected:
        splits = tasks[name]
        if not isinstance(splits, Mapping):
            raise EvalInputError(
                f"task {name!r}: expected {{split: [records]}}, got {type(splits).__name__}"
            )
        if split not in splits:
            raise UnknownSplitError(
                f"task {name!r} has no split {split!r}; available: {sorted(splits)}"
            )
        eval_sets[name] = splits[split]
        shot_sets[name] = None
        if num_fewshot > 0:
            shot_name = fewshot_split
            if shot_name is None:
                shot_name = next(
                    (s for s in ("train", "validation") if s in splits and s != split), None
                )
            if shot_name is None or shot_name not in splits or shot_name == split:
                raise UnknownSplitError(
                    f"task {name!r}: num_fewshot={num_fewshot} needs a few-shot split other than "
                    f"the evaluated split {split!r} (fewshot_split={fewshot_split!r}); "
                    f"available: {sorted(splits)}"
                )
            shot_sets[name] = splits[shot_name]
    return eval_sets, shot_sets


def zero_shot(
    model: torch.nn.Module,
    tokenizer: Any,
    tasks: TaskRecords,
    names: Sequence[str] | None = None,
    split: str = "test",
    limit: int | None = None,
    batch_size: int = 8,
    num_fewshot: int = 0,
    fewshot_split: str | None = None,
    seed: int = 1234,
    prompt: str = DEFAULT_PROMPT,
    progress: bool = True,
) -> dict[str, TaskResult]:
    """Multiple-choice accuracy of an in-memory causal LM, scored by lm-eval's log-likelihoods.

    For every example, lm-eval builds the context ``prompt`` rendered with the record's
    ``question`` (default ``"Question: {question}\\nAnswer:"``), scores each continuation
    ``" " + choice`` by the sum of its tokens' log-probabilities, and counts the example correct
    when the best-scoring choice is ``label`` (``acc``; ties go to the first choice) or when the
    best choice by score divided by the choice's character length is ``label`` (``acc_norm``).
    Prompts are encoded the way lm-eval does it (the tokenizer's default special tokens), with
    the log-softmax in ``CALC_DTYPE`` (float32).

    Args:
        model: A transformers causal LM (``PreTrainedModel``). It is evaluated on the device it is
            on, in eval mode (its training flags are restored afterwards). lm-eval's ``HFLM``
            also calls ``model.tie_weights()``, a no-op for models whose tied weights are tied.
        tokenizer: The model's (fast or slow) transformers tokenizer. It is not modified: if it
            has no pad token, lm-eval works on a copy.
        tasks: ``{task_name: {split_name: [record, ...]}}``. Records follow ``{"id": str,
            "question": str, "choices": [str, ...], "label": int}`` (as returned by
            :func:`fedcompress.data.tasks.load_task`, which also reads task directories).
        names: Tasks to evaluate (default: all of ``tasks``).
        split: Split to evaluate.
        limit: Evaluate only the first ``limit`` records of the split (file/list order).
        batch_size: Requests (context + one choice) per forward pass.
        num_fewshot: In-context examples per prompt, drawn from ``fewshot_split``.
        fewshot_split: Split the few-shot examples come from (default: ``"train"``, else
            ``"validation"``); must differ from ``split``.
        seed: Seed of lm-eval's few-shot sampler (global RNGs are left alone).
        prompt: Jinja template of the context; it may use ``{{question}}`` and ``{{id}}``.
        progress: Show lm-eval's progress bars.

    Returns:
        ``{task_name: TaskResult}``, in the order of ``names`` (or of ``tasks``).

    Raises:
        UnknownTaskError: a name in ``names`` is not in ``tasks``.
        UnknownSplitError: a task lacks ``split`` (or a usable few-shot split).
        EmptyTaskError: no tasks, or a task split with no records (or too few for the shots).
        TaskFormatError: a record breaks the schema (see
            :func:`fedcompress.data.tasks.validate_examples`; names the task, record id, field).
        EvalInputError: ``tasks`` is not ``{task: {split: [records]}}`` or repeats a name.
        ValueError: ``limit``, ``batch_size`` or ``num_fewshot`` out of range.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or num_fewshot < 0:
        raise ValueError(f"num_fewshot must be an int >= 0, got {num_fewshot!r}")

    prepared = _prepare(tasks, names, split, fewshot_split, num_fewshot, limit)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedcompress-lmeval-") as tmp:
        root = Path(tmp)
        task_ids = _write_tasks(root, prepared, prompt)
        logger.info(
            "zero-shot: %d task(s) (%s), split=%r, %d-shot, batch_size=%d",
            len(task_ids),
            ", ".join(f"{n}: {len(prepared[n][0])}" for n in task_ids),
            split,
            num_fewshot,
            batch_size,
        )
        raw = _run_lm_eval(
            model,
            tokenizer,
            root / "tasks",
            list(task_ids.values()),
            batch_size=batch_size,
            num_fewshot=num_fewshot,
            seed=seed,
            progress=progress,
        )

    results = _task_results(raw, prepared, task_ids)
    logger.info("zero-shot evaluation took %.1fs", time.perf_counter() - t0)
    return results


def _prepare(tasks, names, split, fewshot_split, num_fewshot: int, limit: int | None
             ) -> dict[str, tuple[list[TaskExample], list[TaskExample] | None]]:
    """Each selected task's validated evaluation records (cut to ``limit``) and few-shot
    records."""
    eval_sets, shot_sets = _select(tasks, names, split, fewshot_split, num_fewshot)
    prepared: dict[str, tuple[list[TaskExample], list[TaskExample] | None]] = {}
    for name, records in eval_sets.items():
        clean = validate_examples(name, records)
        if limit is not None:
            clean = clean[:limit]
        shots = shot_sets[name]
        clean_shots = validate_examples(name, shots) if shots is not None else None
        if clean_shots is not None and len(clean_shots) < num_fewshot:
            raise EmptyTaskError(
                f"task {name!r}: num_fewshot={num_fewshot} but the few-shot split has only "
                f"{len(clean_shots)} records"
            )
        prepared[name] = (clean, clean_shots)
    return prepared


def _write_tasks(root: Path, prepared: dict, prompt) -> dict[str, str]:
    """One lm-eval task folder per task under ``root/tasks`` (data as JSONL, config as YAML);
    returns task name -> lm-eval task id."""
    task_ids: dict[str, str] = {}
    for i, (name, (records, shots)) in enumerate(prepared.items()):
        task_id = f"fedcompress_{i}_{_slug(name)}"
        task_ids[name] = task_id
        task_dir = root / "tasks" / task_id
        task_dir.mkdir(parents=True)
        data_files = {_EVAL_SPLIT: str(task_dir / f"{_EVAL_SPLIT}.jsonl")}
        write_jsonl(Path(data_files[_EVAL_SPLIT]), records)
        if shots is not None:
            data_files[_FEWSHOT_SPLIT] = str(task_dir / f"{_FEWSHOT_SPLIT}.jsonl")
            write_jsonl(Path(data_files[_FEWSHOT_SPLIT]), shots)
        config = _task_config(task_id, data_files, str(root / "hf_cache"), prompt)
        (task_dir / f"{task_id}.yaml").write_text(
            yaml.safe_dump(config, sort_keys=False, allow_unicode=True), encoding="utf-8"
        )
    return task_ids


def _task_results(raw: dict, prepared: dict, task_ids: dict[str, str]
                  ) -> dict[str, TaskResult]:
    """lm-eval's output -> one :class:`TaskResult` per task (logged)."""
    results: dict[str, TaskResult] = {}
    for name, task_id in task_ids.items():
        records = prepared[name][0]
        metrics = raw["results"][task_id]
        samples = raw["samples"][task_id]
        n = len(samples)
        if n != len(records):  # pragma: no cover - would be an lm-eval behaviour change
            raise RuntimeError(f"lm-eval evaluated {n} of {len(records)} records of {name!r}")
        results[name] = TaskResult(
            acc=float(metrics["acc,none"]),
            acc_stderr=_float_or_nan(metrics.get("acc_stderr,none")),
            acc_norm=float(metrics["acc_norm,none"]),
            acc_norm_stderr=_float_or_nan(metrics.get("acc_norm_stderr,none")),
            n=n,
            chance=sum(1.0 / len(r["choices"]) for r in records) / len(records),
        )
        logger.info(
            "%s: acc=%.4f (+-%.4f) acc_norm=%.4f n=%d chance=%.4f",
            name,
            results[name].acc,
            results[name].acc_stderr,
            results[name].acc_norm,
            n,
            results[name].chance,
        )
    return results


def _float_or_nan(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):  # lm-eval reports "N/A" when it cannot compute a stderr
        return math.nan


def _run_lm_eval(
    model: torch.nn.Module,
    tokenizer: Any,
    include_path: Path,
    task_ids: list[str],
    *,
    batch_size: int,
    num_fewshot: int,
    seed: int,
    progress: bool,
) -> Mapping[str, Any]:
    """Run lm-eval's ``evaluate`` on generated tasks, offline, without touching global RNGs."""
    with hub_offline():
        from lm_eval.tasks import TaskManager

        manager = TaskManager(include_path=str(include_path), include_defaults=False)
        loaded = manager.load(task_ids)
        missing = [t for t in task_ids if t not in loaded["tasks"]]
        if missing:  # pragma: no cover - the configs are generated above
            raise RuntimeError(f"lm-eval did not load the generated task(s) {missing}")
        return run_task_dict(model, tokenizer, loaded, batch_size=batch_size,
                             num_fewshot=num_fewshot, seed=seed, progress=progress)


def run_task_dict(
    model: torch.nn.Module,
    tokenizer: Any,
    loaded: Mapping[str, Any],
    *,
    batch_size: int,
    num_fewshot: int | None,
    seed: int,
    progress: bool,
    limit: int | None = None,
) -> Mapping[str, Any]:
    """lm-eval's ``evaluate`` on tasks already loaded by a ``TaskManager`` (``manager.load``),
    with an ``HFLM`` wrapping the model object; ``num_fewshot=None`` keeps each task's own
    setting; ``limit`` caps the documents per task. Global RNGs are left alone."""
    with _quiet_lm_eval(progress), eval_mode(model):
        from lm_eval.evaluator import evaluate
        from lm_eval.models.huggingface import HFLM

        if getattr(tokenizer, "pad_token_id", None) is None:
            tokenizer = copy.deepcopy(tokenizer)  # HFLM would set a pad token on the original
        lm = HFLM(
            pretrained=model,
            tokenizer=tokenizer,
            backend="causal",
            batch_size=batch_size,
            softmax_dtype=CALC_DTYPE,
        )
        if not progress:
            # evaluate() calls lm.loglikelihood(requests) with its bar enabled; turn it off.
            loglikelihood = lm.loglikelihood

            def _quiet_loglikelihood(requests: Any, disable_tqdm: bool = True) -> Any:
                return loglikelihood(requests, disable_tqdm=True)

            lm.loglikelihood = _quiet_loglikelihood  # type: ignore[method-assign]

        for task in loaded["tasks"].values():
            if num_fewshot is not None:
                task.set_config(key="num_fewshot", value=num_fewshot)
            task.set_fewshot_seed(seed=seed)
        out = evaluate(
            lm=lm,
            task_dict=loaded,
            limit=limit,
            bootstrap_iters=1000,  # acc/acc_norm use the closed-form stderr; no bootstrap runs
            log_samples=True,
        )
    if out is None:  # pragma: no cover - only non-zero ranks get None
        raise RuntimeError("lm-eval returned no results")
    return out
