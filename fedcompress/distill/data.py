"""Training examples for PPC-GPT's chain-of-thought distillation (paper Sec. 3.5, Eq. 8-11).

Each multiple-choice sample ``(x, y, r)`` (question with its options, label, rationale; e.g. a
:class:`fedcompress.synth.SyntheticSample` or a task record) gives up to two examples, one per
task of the multi-task objective (Hsieh et al. 2023, "distilling step by step"): the same input
``x`` behind a task prefix, and the task's target:

* **label** task: ``"[label] Question: {question}\\nChoices: (A) ... (B) ...\\nAnswer:"`` ->
  ``" " + answer`` (the right option's text, or with ``label_target="letter"`` its letter);
* **rationale** task: the same prompt with the ``"[rationale]"`` prefix -> ``" " + rationale``.

Both prompts use one template (:class:`PromptFormat`): only the prefix tells the tasks apart, as
in the paper's multi-task formulation ``f(x) -> (y, r)``.

**Tokens and loss mask.** The prompt is tokenized with the tokenizer's default special tokens
(e.g. a BOS), the target without, and an EOS is appended to the target (``append_eos``, default
on: the model learns where to stop). ``input_ids = prompt + target`` and ``labels`` copies the
target tokens and holds :data:`IGNORE_INDEX` (-100) on every prompt token, so the loss counts
target tokens only. Splitting prompt and target this way is the same as the layer-importance code
(:func:`fedcompress.layers.influence.encode_pairs`) and as lm-eval's context/continuation, so the
accuracy hook scores the very continuations the model was trained on.

**Length.** ``max_length`` bounds prompt + target in tokens. ``overflow="error"`` (default)
raises :class:`SequenceTooLongError` naming the sample; ``overflow="truncate"`` cuts the target on
the right (the prompt is never cut: a prompt that leaves no room for one target token is always an
error), and every cut is counted in :attr:`DistillData.stats` and logged as a warning.

**Padding** (:func:`collate`): on the right, so every real token keeps its position;
``attention_mask`` is 0 and ``labels`` is -100 on padding.
"""

from __future__ import annotations

import logging
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = [
    "IGNORE_INDEX",
    "LABEL_TARGETS",
    "LABEL_TASK",
    "OVERFLOW",
    "RATIONALE_TASK",
    "TASKS",
    "DistillData",
    "DistillDataError",
    "EmptyDataError",
    "EncodedExample",
    "LabelError",
    "MissingRationaleError",
    "PromptFormat",
    "Sample",
    "SequenceTooLongError",
    "build_examples",
    "collate",
    "encode_example",
    "normalize_samples",
    "pad_token_id",
]

logger = logging.getLogger(__name__)

#: ``labels`` value of the tokens that do not count in the loss (PyTorch's ignore index).
IGNORE_INDEX = -100
LABEL_TASK = "label"
RATIONALE_TASK = "rationale"
#: The tasks of the multi-task objective, in the order they are built and reported.
TASKS: tuple[str, ...] = (LABEL_TASK, RATIONALE_TASK)
#: What a sequence longer than ``max_length`` does.
OVERFLOW: tuple[str, ...] = ("error", "truncate")
#: What the label task's target is: the right option's text or its letter.
LABEL_TARGETS: tuple[str, ...] = ("text", "letter")

_LETTERS = string.ascii_uppercase


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class DistillDataError(ValueError):
    """Base class of the input errors of :mod:`fedcompress.distill.data`."""


class EmptyDataError(DistillDataError):
    """No samples (or no examples) to train on."""


class LabelError(DistillDataError):
    """A sample's label is not one of its options (index out of range, or unknown text)."""


class MissingRationaleError(DistillDataError):
    """The rationale task is asked for but a sample has no (non-empty) rationale."""


class SequenceTooLongError(DistillDataError):
    """Prompt + target exceed ``max_length`` (``overflow="error"``), or the prompt alone does."""


# --------------------------------------------------------------------------------------------
# Samples and prompts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """A validated multiple-choice sample: ``choices[label]`` is the answer."""

    id: str
    question: str
    choices: tuple[str, ...]
    label: int
    rationale: str | None = None


def _field(sample: Any, name: str, default: Any = None) -> Any:
    if isinstance(sample, Mapping):
        return sample.get(name, default)
    return getattr(sample, name, default)


def normalize_samples(samples: Iterable[Any], require_rationale: bool = False) -> list[Sample]:
    """Validate samples and return them as :class:`Sample`.

    A sample is a mapping or an object (e.g. :class:`fedcompress.synth.SyntheticSample`) with
    ``question`` (non-empty string), ``choices`` (or ``options``; at least 2 non-empty strings),
    ``label`` (an index into the choices, or the text of one of them) and optionally ``id`` and
    ``rationale``.

    Raises:
        EmptyDataError: no samples.
        LabelError: a label that is not an index of, or the text of, one of the sample's options.
        MissingRationaleError: ``require_rationale`` and a sample without a non-empty rationale.
        DistillDataError: any other malformed field (the message names the sample).
    """
    if isinstance(samples, (str, bytes, Mapping)):
        raise DistillDataError(f"samples must be a sequence of samples, got "
                               f"{type(samples).__name__}")
    out: list[Sample] = []
    for k, sample in enumerate(samples):
        sid = _field(sample, "id")
        sid = sid if isinstance(sid, str) and sid else f"#{k}"
        where = f"sample {sid!r} (index {k})"
        question = _field(sample, "question")
        if not isinstance(question, str) or not question.strip():
            raise DistillDataError(f"{where}: question must be a non-empty string, got "
                                   f"{question!r:.80}")
        choices = _field(sample, "choices")
        if choices is None:
            choices = _field(sample, "options")
        if (isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence)
                or len(choices) < 2
                or not all(isinstance(c, str) and c.strip() for c in choices)):
            raise DistillDataError(f"{where}: choices must be a list of at least 2 non-empty "
                                   f"strings, got {choices!r:.120}")
        label = _field(sample, "label")
        if isinstance(label, str):
            if label not in choices:
                raise LabelError(f"{where}: label {label!r} is not one of its options "
                                 f"{list(choices)}")
            label = list(choices).index(label)
        elif isinstance(label, bool) or not isinstance(label, int):
            raise LabelError(f"{where}: label must be an option index or option text, got "
                             f"{label!r}")
        elif not 0 <= label < len(choices):
            raise LabelError(f"{where}: label {label} is not one of its {len(choices)} options "
                             f"(valid indices 0..{len(choices) - 1})")
        rationale = _field(sample, "rationale")
        if rationale is not None and not isinstance(rationale, str):
            raise DistillDataError(f"{where}: rationale must be a string, got "
                                   f"{type(rationale).__name__}")
        if require_rationale and (rationale is None or not rationale.strip()):
            raise MissingRationaleError(f"{where} has no rationale, but the rationale task "
                                        "needs one for every sample (use rationale_weight=0 to "
                                        "train on labels only)")
        out.append(Sample(sid, question, tuple(choices), label, rationale))
    if not out:
        raise EmptyDataError("no samples: expected at least one sample to train on")
    return out


@dataclass(frozen=True)
class PromptFormat:
    """How a sample becomes prompts and targets (module docstring).

    Attributes:
        label_prefix, rationale_prefix: Task prefixes (paper / Hsieh et al.: ``[label]``,
            ``[rationale]``).
        template: Prompt of both tasks; ``{prefix}``, ``{question}``, ``{choices}`` are filled.
        choice_format: One option in the prompt's choice list (``{letter}``, ``{text}``).
        choice_separator: Between the options of the choice list.
        label_target: ``"text"``: the label target is the right option's text; ``"letter"``: its
            letter (A, B, ...).
        target_separator: Put before every target (a space: ``"Answer:" + " Paris"``).
        append_eos: End every training target with the tokenizer's EOS token (not part of the
            options scored by the accuracy hook).
    """

    label_prefix: str = "[label]"
    rationale_prefix: str = "[rationale]"
    template: str = "{prefix} Question: {question}\nChoices: {choices}\nAnswer:"
    choice_format: str = "({letter}) {text}"
    choice_separator: str = " "
    label_target: str = "text"
    target_separator: str = " "
    append_eos: bool = True

    def __post_init__(self) -> None:
        if self.label_target not in LABEL_TARGETS:
            raise ValueError(f"label_target={self.label_target!r} is invalid: expected one of "
                             f"{LABEL_TARGETS}")
        if self.label_prefix == self.rationale_prefix:
            raise ValueError("label_prefix and rationale_prefix are equal: the tasks would be "
                             "indistinguishable")
        for key in ("{prefix}", "{question}"):
            if key not in self.template:
                raise ValueError(f"template must contain {key}, got {self.template!r}")

    def prefix(self, task: str) -> str:
        if task == LABEL_TASK:
            return self.label_prefix
        if task == RATIONALE_TASK:
            return self.rationale_prefix
        raise ValueError(f"task={task!r} is invalid: expected one of {TASKS}")

    def prompt(self, task: str, question: str, choices: Sequence[str]) -> str:
        """The prompt of ``task`` for a question and its options."""
        if len(choices) > len(_LETTERS):
            raise DistillDataError(f"at most {len(_LETTERS)} options are supported, got "
                                   f"{len(choices)}")
        listed = self.choice_separator.join(
            self.choice_format.format(letter=_LETTERS[i], text=c) for i, c in enumerate(choices))
        return self.template.format(prefix=self.prefix(task), question=question, choices=listed)

    def options(self, choices: Sequence[str]) -> list[str]:
        """The label task's candidate targets, without separator or EOS (what is scored)."""
        if self.label_target == "letter":
            return [_LETTERS[i] for i in range(len(choices))]
        return list(choices)

    def target(self, task: str, sample: Sample) -> str:
        """The target text of ``task`` (with the separator, without EOS)."""
        if task == LABEL_TASK:
            return self.target_separator + self.options(sample.choices)[sample.label]
        if task == RATIONALE_TASK:
            if sample.rationale is None or not sample.rationale.strip():
                raise MissingRationaleError(f"sample {sample.id!r} has no rationale")
            return self.target_separator + sample.rationale.strip()
        raise ValueError(f"task={task!r} is invalid: expected one of {TASKS}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodedExample:
    """One tokenized training example.

    Attributes:
        id: The sample's id.
        task: ``"label"`` or ``"rationale"``.
        input_ids: Prompt then target tokens.
        labels: ``IGNORE_INDEX`` on the prompt's tokens, the target's tokens after.
        prompt_tokens: Tokens of the prompt (all masked).
        cut_tokens: Target tokens removed by ``overflow="truncate"`` (0: complete).
    """

    id: str
    task: str
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    prompt_tokens: int
    cut_tokens: int = 0

    @property
    def target_tokens(self) -> int:
        """Tokens that count in the loss."""
        return len(self.input_ids) - self.prompt_tokens

    def __len__(self) -> int:
        return len(self.input_ids)


def _ids(tokenizer: Any, text: str, special: bool) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=special)["input_ids"]]


def encode_example(tokenizer: Any, sample_id: str, task: str, prompt: str, target: str,
                   max_length: int, overflow: str = "error", append_eos: bool = True
                   ) -> EncodedExample:
    """Tokenize one ``(prompt, target)`` pair with the loss on the target only.

    Raises:
        SequenceTooLongError: prompt + target longer than ``max_length`` with
            ``overflow="error"``; or a prompt with ``max_length`` tokens or more.
        DistillDataError: a target that tokenizes to nothing; ``append_eos`` with a tokenizer
            without an EOS token.
    """
    prompt_ids = _ids(tokenizer, prompt, special=True)
    target_ids = _ids(tokenizer, target, special=False)
    if not target_ids:
        raise DistillDataError(f"sample {sample_id!r} ({task}): the target {target!r:.60} "
                               "tokenizes to no token")
    if append_eos:
        eos = getattr(tokenizer, "eos_token_id", None)
        if not isinstance(eos, int):
            raise DistillDataError("append_eos=True but the tokenizer has no EOS token; use "
                                   "PromptFormat(append_eos=False)")
        target_ids.append(eos)
    total = len(prompt_ids) + len(target_ids)
    cut = 0
    if total > max_length:
        if len(prompt_ids) >= max_length:
            raise SequenceTooLongError(
                f"sample {sample_id!r} ({task}): the prompt alone has {len(prompt_ids)} tokens, "
                f"leaving no room for the target within max_length={max_length}; raise "
                "max_length or shorten the question")
        if overflow == "error":
            raise SequenceTooLongError(
                f"sample {sample_id!r} ({task}): prompt ({len(prompt_ids)} tokens) + target "
                f"({len(target_ids)} tokens) = {total} tokens > max_length={max_length}; raise "
                "max_length or pass overflow='truncate' to cut targets (counted)")
        cut = total - max_length
        target_ids = target_ids[:len(target_ids) - cut]
    return EncodedExample(
        id=sample_id, task=task, input_ids=tuple(prompt_ids + target_ids),
        labels=tuple([IGNORE_INDEX] * len(prompt_ids) + target_ids),
        prompt_tokens=len(prompt_ids), cut_tokens=cut)


@dataclass
class DistillData:
    """The encoded examples of one training set.

    Attributes:
        samples: The validated samples, in input order.
        examples: ``{task: [EncodedExample, ...]}``, one per sample and task, aligned with
            ``samples`` (``examples[task][i]`` comes from ``samples[i]``).
        format: The prompt format used.
        max_length: The length bound used.
        stats: Per task: examples, target tokens, truncated examples and target tokens cut,
            longest sequence.
    """

    samples: list[Sample]
    examples: dict[str, list[EncodedExample]]
    format: PromptFormat
    max_length: int
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(self.examples)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def longest(self) -> int:
        return max(len(e) for exs in self.examples.values() for e in exs)


def build_examples(samples: Iterable[Any], tokenizer: Any,
                   tasks: Sequence[str] = TASKS, fmt: PromptFormat | None = None,
                   max_length: int = 256, overflow: str = "error") -> DistillData:
    """Validate samples and encode one example per sample and task (module docstring).

    Args:
        samples: See :func:`normalize_samples`; a rationale is needed only for the rationale
            task.
        tokenizer: The student model's tokenizer.
        tasks: Subset of :data:`TASKS`, e.g. ``("label",)`` for client-side retraining.
        fmt: Prompt format (default :class:`PromptFormat`).
        max_length: Longest prompt + target, in tokens.
        overflow: ``"error"`` or ``"truncate"`` (the target; counted in ``stats``).

    Raises:
        EmptyDataError, LabelError, MissingRationaleError, DistillDataError: see
            :func:`normalize_samples`; SequenceTooLongError: see :func:`encode_example`;
        ValueError: unknown task or overflow, ``max_length < 2``.
    """
    fmt = fmt or PromptFormat()
    tasks = tuple(tasks)
    if not tasks or any(t not in TASKS for t in tasks) or len(set(tasks)) != len(tasks):
        raise ValueError(f"tasks={tasks!r} is invalid: expected distinct tasks among {TASKS}")
    if overflow not in OVERFLOW:
        raise ValueError(f"overflow={overflow!r} is invalid: expected one of {OVERFLOW}")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length={max_length!r} is invalid: expected an int >= 2")
    clean = normalize_samples(samples, require_rationale=RATIONALE_TASK in tasks)
    examples: dict[str, list[EncodedExample]] = {}
    stats: dict[str, Any] = {"samples": len(clean), "max_length": max_length,
                             "overflow": overflow, "tasks": {}}
    for task in tasks:
        encoded = [encode_example(tokenizer, s.id, task,
                                  fmt.prompt(task, s.question, s.choices), fmt.target(task, s),
                                  max_length, overflow, fmt.append_eos) for s in clean]
        examples[task] = encoded
        truncated = [e for e in encoded if e.cut_tokens]
        stats["tasks"][task] = {
            "examples": len(encoded),
            "prompt_tokens": sum(e.prompt_tokens for e in encoded),
            "target_tokens": sum(e.target_tokens for e in encoded),
            "truncated_examples": len(truncated),
            "cut_target_tokens": sum(e.cut_tokens for e in truncated),
            "longest": max(len(e) for e in encoded),
        }
        if truncated:
            logger.warning("%s task: %d of %d targets truncated to max_length=%d (%d target "
                           "tokens cut)", task, len(truncated), len(encoded), max_length,
                           stats["tasks"][task]["cut_target_tokens"])
    return DistillData(clean, examples, fmt, max_length, stats)


def pad_token_id(tokenizer: Any) -> int:
    """The id used for padding: the pad token, else EOS, else UNK, else 0.

    Its value never matters for the result: padded positions are masked out of attention and
    loss.
    """
    for attr in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    return 0


def collate(examples: Sequence[EncodedExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""
    if not examples:
        raise EmptyDataError("cannot collate an empty batch")
    width = max(len(e) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e)
        input_ids[row, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        attention[row, :n] = 1
        labels[row, :n] = torch.tensor(e.labels, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}
