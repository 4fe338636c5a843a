"""Multiple-choice QA tasks stored as JSON Lines, and their classification view.

Every line of a task file is one example::

    {"id": "<task>-<n>", "question": str, "choices": [str, ...], "label": int}

``question`` is the task input (with the task's prefix, if it has one), ``choices`` the candidate
answers in source order, and ``label`` the index of the correct choice. Files are validated when
loaded, by :func:`validate_examples` (also used by :mod:`fedcompress.eval` on in-memory records).

Task names accepted by :func:`load_task`:

* bundled (:data:`BUNDLED_TASKS`), from BIG-bench, splits ``train``, ``validation``, ``test``
  (see ``bundled/SOURCES.md`` for how they were made);
* derived from a bundled task (:data:`DERIVED_TASKS`): ``"hyperbaton_acceptability"``, each
  ``hyperbaton`` example turned into its two adjective phrases, labelled acceptable or
  unacceptable (see :func:`hyperbaton_acceptability`);
* GLUE, online only (:data:`GLUE_TASKS`): ``"glue:sst2"``, ``"glue:rte"``, ``"glue:mrpc"``,
  ``"glue:cola"``, ``"glue:qnli"``, downloaded with ``datasets.load_dataset("nyu-mll/glue",
  config)``; splits ``train`` and ``validation`` only, as GLUE's test labels are not public (see
  :func:`load_glue`). :data:`GLUE_STAND_INS` names the offline stand-in of each;
* a local ``.jsonl`` file (it serves whichever split is asked for), or a directory holding
  ``<split>.jsonl`` files.

:func:`task_files` resolves the names that are stored in files (bundled and local ones).

:func:`classification_data` views a task whose examples all have the same choices as a text
classification data set: texts, integer labels and the label names (the choices).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from fedcompress.data.corpora import BUNDLED_DIR, _load_dataset
from fedcompress.data.errors import (
    EmptyTaskError,
    NotClassificationTaskError,
    TaskFormatError,
    UnknownSplitError,
    UnknownTaskError,
    format_choices,
)
from fedcompress.data.jsonl import read_jsonl

__all__ = [
    "ACCEPTABILITY_LABELS",
    "BUNDLED_TASKS",
    "DERIVED_TASKS",
    "GLUE_DATASET",
    "GLUE_SPLITS",
    "GLUE_STAND_INS",
    "GLUE_TASKS",
    "TASK_SPLITS",
    "ClassificationData",
    "GlueTask",
    "TaskExample",
    "classification_data",
    "hyperbaton_acceptability",
    "load_glue",
    "load_task",
    "task_files",
    "validate_examples",
]

logger = logging.getLogger(__name__)

TASK_SPLITS: tuple[str, ...] = ("train", "validation", "test")
"""Splits of every bundled task."""

BUNDLED_TASKS: tuple[str, ...] = (
    "epistemic_reasoning",
    "hyperbaton",
    "movie_dialog_same_or_different",
    "multiemo_all_sentence_en",
    "presuppositions_as_nli",
    "social_iqa",
    "strategyqa",
)
"""Names of the multiple-choice tasks shipped with the package (BIG-bench)."""

DERIVED_TASKS: tuple[str, ...] = ("hyperbaton_acceptability",)
"""Tasks computed from a bundled task when loaded (no files of their own)."""

ACCEPTABILITY_LABELS: tuple[str, ...] = ("unacceptable", "acceptable")
"""The choices of ``hyperbaton_acceptability``, in GLUE CoLA's label order."""

GLUE_DATASET = "nyu-mll/glue"
GLUE_PREFIX = "glue:"
GLUE_SPLITS: tuple[str, ...] = ("train", "validation")
"""The GLUE splits with public labels."""


@dataclass(frozen=True)
class GlueTask:
    """How one GLUE configuration becomes multiple-choice examples.

    Attributes:
        columns: ``(dataset column, name shown in the question)`` of each input text, in order;
            the question is one ``"<name>: <text>"`` line per column.
        label_names: the names of GLUE's labels 0, 1, ... (the dataset's ``ClassLabel`` names),
            used as the choices.
    """

    columns: tuple[tuple[str, str], ...]
    label_names: tuple[str, ...]


GLUE_TASKS: dict[str, GlueTask] = {
    "cola": GlueTask((("sentence", "Sentence"),), ("unacceptable", "acceptable")),
    "mrpc": GlueTask((("sentence1", "Sentence 1"), ("sentence2", "Sentence 2")),
                     ("not_equivalent", "equivalent")),
    "qnli": GlueTask((("question", "Question"), ("sentence", "Sentence")),
                     ("entailment", "not_entailment")),
    "rte": GlueTask((("sentence1", "Sentence 1"), ("sentence2", "Sentence 2")),
                    ("entailment", "not_entailment")),
    "sst2": GlueTask((("sentence", "Sentence"),), ("negative", "positive")),
}
"""GLUE configurations loadable as ``"glue:<config>"`` (network needed)."""

GLUE_STAND_INS: dict[str, str] = {
    "cola": "hyperbaton_acceptability",
    "mrpc": "movie_dialog_same_or_different",
    "qnli": "epistemic_reasoning",
    "rte": "epistemic_reasoning",
    "sst2": "multiemo_all_sentence_en",
}
"""The offline task that stands in for each GLUE task (README: "Stand-ins for GLUE")."""

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
            directory holding ``<split>.jsonl`` files (derived and GLUE tasks have no files).
    """
    if name in DERIVED_TASKS or name.startswith(GLUE_PREFIX):
        kind = "derived from a bundled task" if name in DERIVED_TASKS else "loaded from the hub"
        raise UnknownTaskError(f"task {name!r} has no files of its own ({kind}); use load_task")
    if name in BUNDLED_TASKS:
        folder = BUNDLED_DIR / "tasks" / name
        files = {split: folder / f"{split}.jsonl" for split in TASK_SPLITS}
        missing = [str(p) for p in files.values() if not p.is_file()]
        if missing:
            raise UnknownTaskError(
                f"bundled task {name!r} is missing {format_choices(missing)}; regenerate the "
                "bundled data with `python tools/build_data.py --archives DIR`"
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
        f"({format_choices(BUNDLED_TASKS)}), a derived task ({format_choices(DERIVED_TASKS)}), "
        f"a GLUE task ({format_choices(GLUE_PREFIX + c for c in GLUE_TASKS)}), a path to an "
        "existing .jsonl file, or a directory holding <split>.jsonl files"
    )


def load_task(name: str, split: str) -> list[TaskExample]:
    """Load and validate the ``split`` of task ``name`` (see :func:`validate_examples`).

    ``name`` is a bundled, derived, GLUE (``"glue:<config>"``, network needed) or local task;
    see the module docstring.

    Raises:
        UnknownTaskError: see :func:`task_files`; or an unknown ``glue:`` configuration.
        UnknownSplitError: the task has no such split (GLUE: ``test``, whose labels are hidden).
        TaskFormatError: a line is not a JSON object or breaks the schema, or ids repeat.
        EmptyTaskError: the file has no examples.
    """
    if name.startswith(GLUE_PREFIX):
        return load_glue(name[len(GLUE_PREFIX):], split)
    if name == "hyperbaton_acceptability":
        return hyperbaton_acceptability(split)
    files = task_files(name)
    if split not in files:
        raise UnknownSplitError(
            f"task {name!r} has no split {split!r}; expected one of {format_choices(files)}"
        )
    path = files[split]
    if name not in BUNDLED_TASKS and Path(name).is_file():
        logger.info("local task file %s is used as split %r", path, split)
    rows = list(read_jsonl(path, lambda msg: TaskFormatError(f"task {name!r}: {msg}", task=name)))
    return validate_examples(
        name, [record for _, record in rows], source=path, lines=[n for n, _ in rows]
    )


def validate_examples(
    task: str,
    records: Sequence[Mapping[str, Any]],
    *,
    source: str | Path | None = None,
    lines: Sequence[int] | None = None,
) -> list[TaskExample]:
    """Check the records of one task split and return their four fields as
    :class:`TaskExample` objects.

    This is the one validator of task records: :func:`load_task` runs it on files, and
    :func:`fedcompress.eval.zero_shot` on in-memory records. Extra fields are allowed (and
    dropped from the returned examples).

    Args:
        task: Task name, used in error messages.
        records: The split's records, in order.
        source: File the records were read from; messages then also give ``<source>:<line>``.
        lines: Line number of each record in ``source`` (default: position + 1).

    Raises:
        EmptyTaskError: ``records`` is empty.
        TaskFormatError: ``records`` is not a list, or a record is not a mapping, misses a field,
            has an empty or non-string ``id`` or ``question``, fewer than 2 choices, a choice that
            is not a non-empty string, a ``label`` that is not a valid choice index, or an id
            already used by an earlier record. The message names the task, the record id (or
            ``#<index>`` when the id is unusable), the field and, for files, the line; the
            error carries them as ``task``, ``record_id`` and ``field``.
    """
    if isinstance(records, (str, bytes)) or not isinstance(records, Sequence):
        raise TaskFormatError(
            f"task {task!r}: records must be a list of dicts, got {type(records).__name__}",
            task=task,
        )
    if len(records) == 0:
        where = f" in {source}" if source is not None else ""
        raise EmptyTaskError(f"task {task!r} has no records{where}")
    seen: set[str] = set()
    examples: list[TaskExample] = []
    for i, record in enumerate(records):
        line = lines[i] if lines is not None else i + 1
        location = None if source is None else f"{source}:{line}"
        examples.append(_validate_example(task, i, record, location, seen))
    return examples


def _validate_example(
    task: str, index: int, record: Any, location: str | None, seen: set[str]
) -> TaskExample:
    """One record of :func:`validate_examples`; its id is added to ``seen`` (ids used so far)."""
    rid = record.get("id") if isinstance(record, Mapping) else None
    rid = rid if isinstance(rid, str) and rid else f"#{index}"

    def bad(field: str, what: str) -> TaskFormatError:
        at = f" at {location}" if location else ""
        return TaskFormatError(
            f"task {task!r}, record id={rid!r}{at}: field {field!r} {what}",
            task=task,
            record_id=rid,
            field=field,
        )

    if not isinstance(record, Mapping):
        raise bad("<record>", f"must be a dict, got {type(record).__name__}")
    missing = [field for field in _REQUIRED_FIELDS if field not in record]
    if missing:
        more = f" (and {format_choices(missing[1:])})" if len(missing) > 1 else ""
        raise bad(missing[0], f"is missing{more}; expected {format_choices(_REQUIRED_FIELDS)}")
    example_id, question, choices, label = (record[f] for f in _REQUIRED_FIELDS)
    if not isinstance(example_id, str) or not example_id:
        raise bad("id", f"must be a non-empty string, got {example_id!r}")
    if example_id in seen:
        raise bad("id", "is a duplicate of an earlier record's id")
    seen.add(example_id)
    if not isinstance(question, str) or not question.strip():
        raise bad("question", f"must be a non-empty string, got {question!r:.80}")
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or len(choices) < 2:
        raise bad("choices", f"must be a list of at least 2 strings, got {choices!r:.120}")
    for j, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice.strip():
            raise bad("choices", f"entry {j} must be a non-empty string, got {choice!r}")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise bad("label", f"must be an integer index in [0, {len(choices) - 1}], got {label!r}")
    return TaskExample(id=example_id, question=question, choices=list(choices), label=label)


# --------------------------------------------------------------------------------------------
# derived tasks

_HYPERBATON_QUESTION = re.compile(
    r'\AWhich sentence has the correct adjective order: a " (.+) " b " (.+) " \?\Z'
)


def hyperbaton_acceptability(split: str) -> list[TaskExample]:
    """The ``split`` of ``hyperbaton`` as single phrases labelled acceptable or unacceptable.

    Each ``hyperbaton`` example asks which of two phrases, ``a`` and ``b``, orders its
    adjectives correctly (``Which sentence has the correct adjective order: a " <phrase> " b "
    <phrase> " ?``); both phrases have the same words. It becomes two examples: id
    ``hyperbaton_acceptability-<n>a`` with ``question`` the ``a`` phrase, and ``...-<n>b`` with
    the ``b`` phrase (``<n>`` as in ``hyperbaton-<n>``); ``choices`` are
    :data:`ACCEPTABILITY_LABELS` and ``label`` is 1 (acceptable) for the phrase the source marks
    correct, 0 for the other. So the labels are balanced exactly, each split has twice the
    examples of ``hyperbaton``'s, and the two phrases of an example stay in one split.

    It is an acceptability judgement about one phenomenon only, English adjective order
    (opinion, size, age, shape, colour, origin, material, purpose): the phrases are generated
    noun phrases (``"old-fashioned circular green cardboard exercise computer"``), not CoLA's
    sentences from linguistics publications with their many kinds of violations. Every wrong
    order is labelled unacceptable, though a native speaker may accept some (e.g. with
    contrastive stress).

    Raises:
        TaskFormatError: a ``hyperbaton`` example does not have that question form or the
            choices ``["a", "b"]``.
    """
    name = "hyperbaton_acceptability"
    records: list[dict[str, Any]] = []
    for example in load_task("hyperbaton", split):
        match = _HYPERBATON_QUESTION.match(example["question"])
        if match is None or example["choices"] != ["a", "b"]:
            raise TaskFormatError(
                f"task {name!r}: hyperbaton example {example['id']!r} does not have the form "
                f"{_HYPERBATON_QUESTION.pattern!r} with choices ['a', 'b']",
                task=name, record_id=example["id"], field="question",
            )
        number = example["id"].rsplit("-", 1)[-1]
        for index, (letter, phrase) in enumerate(zip("ab", match.groups(), strict=True)):
            records.append({
                "id": f"{name}-{number}{letter}",
                "question": phrase,
                "choices": list(ACCEPTABILITY_LABELS),
                "label": int(example["label"] == index),
            })
    return validate_examples(name, records)


# --------------------------------------------------------------------------------------------
# GLUE (network; never called by the tests, which patch datasets.load_dataset)


def load_glue(config: str, split: str) -> list[TaskExample]:
    """GLUE task ``config`` (a key of :data:`GLUE_TASKS`) as multiple-choice examples.

    Downloads ``datasets.load_dataset("nyu-mll/glue", config, split=split)``. Each row becomes
    ``{"id": "glue:<config>-<split>-<row>", "question": ..., "choices": [...], "label": ...}``:
    the question is one ``"<name>: <text>"`` line per input column (``"Sentence: ..."`` for
    SST-2 and CoLA; ``"Sentence 1: ..."`` and ``"Sentence 2: ..."`` for RTE and MRPC;
    ``"Question: ..."`` and ``"Sentence: ..."`` for QNLI), the choices are GLUE's label names
    and the label is GLUE's label.

    Splits: ``train`` and ``validation`` map to GLUE's. GLUE's ``test`` split has no public
    labels (the dataset gives -1 for each), so ``test`` is an error, not silently another
    split: evaluate on ``validation``, and hold part of ``train`` out for model selection.

    Raises:
        UnknownTaskError: ``config`` is not in :data:`GLUE_TASKS`.
        UnknownSplitError: ``split`` is ``test`` or not a split name.
        TaskFormatError: the dataset's label names differ from the expected ones, or a row has
            a hidden (-1) or out-of-range label.
    """
    name = GLUE_PREFIX + config
    if config not in GLUE_TASKS:
        raise UnknownTaskError(
            f"unknown GLUE task {name!r}; expected one of "
            f"{format_choices(GLUE_PREFIX + c for c in GLUE_TASKS)}"
        )
    if split == "test":
        raise UnknownSplitError(
            f"task {name!r} has no usable split 'test': GLUE's test labels are not public "
            "(every test label is -1); evaluate on 'validation'"
        )
    if split not in GLUE_SPLITS:
        raise UnknownSplitError(
            f"task {name!r} has no split {split!r}; expected one of {format_choices(GLUE_SPLITS)}"
        )
    spec = GLUE_TASKS[config]
    dataset = _load_dataset(GLUE_DATASET, config, split=split)
    features = getattr(dataset, "features", None)
    label_feature = features.get("label") if isinstance(features, Mapping) else None
    names = getattr(label_feature, "names", None)
    if names is not None and tuple(names) != spec.label_names:
        raise TaskFormatError(
            f"task {name!r}: the dataset's label names are {list(names)}, expected "
            f"{list(spec.label_names)}",
            task=name, field="label",
        )
    columns = [list(dataset[column]) for column, _ in spec.columns]
    labels = list(dataset["label"])
    records: list[dict[str, Any]] = []
    for row, label in enumerate(labels):
        record_id = f"{name}-{split}-{row}"
        if isinstance(label, bool) or not isinstance(label, int) or not (
            0 <= label < len(spec.label_names)
        ):
            raise TaskFormatError(
                f"task {name!r}, record id={record_id!r}: label {label!r} is not one of GLUE's "
                f"labels 0..{len(spec.label_names) - 1} (-1 marks a hidden test label)",
                task=name, record_id=record_id, field="label",
            )
        question = "\n".join(
            f"{shown}: {values[row]}" for (_, shown), values in zip(spec.columns, columns,
                                                                     strict=True)
        )
        records.append({"id": record_id, "question": question,
                        "choices": list(spec.label_names), "label": label})
    return validate_examples(name, records)


# --------------------------------------------------------------------------------------------
# classification view


@dataclass(frozen=True)
class ClassificationData:
    """A task split as a text classification data set.

    Attributes:
        task: the task name (or the ``name`` given for in-memory examples).
        split: the split, or ``None`` for in-memory examples.
        ids: the example ids.
        texts: each example's ``question``, verbatim (with the task's prefix, if it has one).
        labels: each example's ``label``, an index into ``label_names``.
        label_names: the choices every example shares, in order.
    """

    task: str
    split: str | None
    ids: list[str]
    texts: list[str]
    labels: list[int]
    label_names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.texts)


def classification_data(
    name_or_examples: str | Sequence[Mapping[str, Any]],
    split: str | None = None,
    *,
    name: str = "examples",
    label_subset: Sequence[str] | None = None,
) -> ClassificationData:
    """View a task whose examples all have the same choices as texts, labels and label names.

    Args:
        name_or_examples: a task name for :func:`load_task`, or the records of one split
            (validated with :func:`validate_examples`).
        split: the split to load; required with a task name, ignored with records.
        name: the task name used in messages for in-memory records.
        label_subset: keep only the examples whose label is one of these choices, relabelled
            in this order (e.g. ``("negative", "positive")`` makes the 4-way
            ``multiemo_all_sentence_en`` binary like SST-2). The texts are unchanged, so a task
            prefix that lists every choice still does.

    Raises:
        UnknownSplitError: a task name without ``split``.
        TaskFormatError: ``label_subset`` names a label the task does not have, repeats one,
            or keeps no example.
        NotClassificationTaskError: the examples do not all have the same choices (e.g. a QA
            task such as ``social_iqa``); the message names the task, two examples and their
            choices.
        DataError: any error of :func:`load_task` or :func:`validate_examples`.
    """
    if isinstance(name_or_examples, str):
        task = name_or_examples
        if split is None:
            raise UnknownSplitError(f"classification_data({task!r}) needs a split")
        examples = load_task(task, split)
    else:
        task, split = name, None
        examples = validate_examples(task, name_or_examples)
    first = examples[0]
    for example in examples:
        if example["choices"] != first["choices"]:
            distinct = len({tuple(e["choices"]) for e in examples})
            where = f" split {split!r}" if split is not None else ""
            raise NotClassificationTaskError(
                f"task {task!r}{where} is not a classification task: its examples do not all "
                f"have the same choices (the label set); {example['id']!r} has "
                f"{example['choices']} but {first['id']!r} has {first['choices']} ({distinct} "
                f"different choice lists in {len(examples)} examples)",
                task=task, record_id=example["id"], field="choices",
            )
    label_names = tuple(first["choices"])
    labels = [e["label"] for e in examples]
    if label_subset is not None:
        subset = tuple(label_subset)
        unknown = [label for label in subset if label not in label_names]
        if unknown or len(set(subset)) != len(subset) or not subset:
            raise TaskFormatError(
                f"task {task!r}: label_subset {list(subset)} must name distinct labels among "
                f"{list(label_names)}" + (f"; unknown: {format_choices(unknown)}" if unknown
                                          else ""),
                task=task, field="label",
            )
        new_index = {label_names.index(label): i for i, label in enumerate(subset)}
        kept = [i for i, label in enumerate(labels) if label in new_index]
        if not kept:
            raise TaskFormatError(
                f"task {task!r}: no example has a label in {list(subset)}", task=task,
                field="label",
            )
        examples = [examples[i] for i in kept]
        labels = [new_index[labels[i]] for i in kept]
        label_names = subset
    return ClassificationData(
        task=task,
        split=split,
        ids=[e["id"] for e in examples],
        texts=[e["question"] for e in examples],
        labels=labels,
        label_names=label_names,
    )
