"""PPC-GPT's synthetic data pipeline (paper §3.3, App. B): question -> agreed answer -> rationale.

For each (perturbed) client example, :func:`generate_synthetic` asks the generator for

1. a new question with its choices (:data:`~fedcompress.synth.prompts.QUESTION_PROMPT`, one
   sample at ``question_temperature``), parsed by :func:`~fedcompress.synth.parse.parse_question`;
   copies of the source question and repeats of an earlier synthetic question are dropped;
2. a chain-of-thought answer, sampled ``answer_samples`` times (3 in the paper) at
   ``answer_temperature``; each is parsed by :func:`~fedcompress.synth.parse.parse_answer` and the
   question is kept only when *all* samples name the same choice, which becomes its label (with
   ``answer_temperature=0`` the samples are identical and the filter keeps every parsable one);
3. a rationale for that label (one sample at ``rationale_temperature``), parsed by
   :func:`~fedcompress.synth.parse.parse_rationale`.

Only the examples' ``question`` and ``choices`` are used: the server never sees client labels
(the paper's ``D_p = {x_i^p}``).

Synthetic-data ratio: ``ratio`` synthetic samples are wanted per client example, ``ratio * N``
(rounded half up) in all, spread evenly by :func:`attempts_per_example` (``ratio`` 0.5: every
second example gets one attempt, 2: every example two). With ``max_rounds > 1`` the examples whose
attempts were rejected get new attempts (as many as they still miss) in further rounds, up to
``max_rounds``. ``time_limit`` stops issuing new work after that many seconds (the samples
accepted so far are returned).

Work goes to the backend in chunks of ``batch_size`` attempts (one call per stage per chunk).
Every call gets its own seed derived from ``(seed, stage, round, chunk)``, so the same config,
examples and backend give the same samples.

Each attempt ends accepted or rejected with exactly one :class:`~fedcompress.synth.parse.Rejection`
(``accepted + sum(rejections) == attempts``); :class:`SynthStats` counts them per reason and per
stage. Nothing a generator outputs, and no backend failure, stops a run.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from fedcompress.data.jsonl import read_jsonl, write_jsonl
from fedcompress.data.seeding import derived_rng
from fedcompress.synth.backends import Backend, Failed
from fedcompress.synth.parse import (
    ParsedQuestion,
    Rejected,
    Rejection,
    normalize,
    parse_answer,
    parse_question,
    parse_rationale,
)
from fedcompress.synth.prompts import (
    PPC_GPT_PROMPTS,
    PromptSet,
    answer_prompt,
    question_prompt,
    rationale_prompt,
)

__all__ = [
    "STAGES",
    "SynthConfig",
    "SynthResult",
    "SynthStats",
    "SyntheticSample",
    "attempts_per_example",
    "generate_synthetic",
    "load_jsonl",
    "save_jsonl",
]

logger = logging.getLogger(__name__)

#: The pipeline's stages, in order.
STAGES: tuple[str, ...] = ("question", "answer", "rationale")

#: Characters of raw generator output kept per rejected attempt (for inspection).
_RAW_CHARS = 1500


@dataclass(frozen=True)
class SynthConfig:
    """Settings of :func:`generate_synthetic` (see the module docstring).

    Attributes:
        ratio: Synthetic samples wanted per client example (> 0).
        answer_samples: Chain-of-thought answers sampled per question; all must agree (paper: 3).
        question_temperature, answer_temperature, rationale_temperature: Sampling temperature
            of each stage (0: greedy).
        question_max_new_tokens, answer_max_new_tokens, rationale_max_new_tokens: Generation
            budget of each stage, in tokens.
        max_question_chars: Longest question plus choices accepted (``too_long`` beyond).
        max_rationale_chars: Longest rationale accepted (``too_long`` beyond).
        max_rounds: Rounds of attempts (1: every wanted sample is attempted once).
        batch_size: Attempts per chunk (prompts per backend call).
        seed: Seed of every random choice.
        reject_copies: Drop questions equal to their source question (``copy``).
        reject_duplicates: Drop questions (with the same choices) already generated
            (``duplicate``).
        closed_choices: Use the source's choices when a generated question comes without any,
            if every client example has the same choices (a closed label set such as Yes/No).
            ``None``: on exactly when the examples share one choice list.
        time_limit: Seconds after which no new chunk is started (``None``: no limit). It is
            checked between chunks only: a chunk that has started runs to its end.
        keep_rejected: How many rejected attempts to keep (with the raw output of the stage
            that rejected them, and the raw question output for later stages) in
            :attr:`SynthResult.rejected`, for inspection.
        prompts: The three templates.
    """

    ratio: float = 1.0
    answer_samples: int = 3
    question_temperature: float = 0.7
    answer_temperature: float = 0.7
    rationale_temperature: float = 0.0
    question_max_new_tokens: int = 256
    answer_max_new_tokens: int = 512
    rationale_max_new_tokens: int = 128
    max_question_chars: int = 2000
    max_rationale_chars: int = 1000
    max_rounds: int = 1
    batch_size: int = 16
    seed: int = 0
    reject_copies: bool = True
    reject_duplicates: bool = True
    closed_choices: bool | None = None
    time_limit: float | None = None
    keep_rejected: int = 100
    prompts: PromptSet = PPC_GPT_PROMPTS

    def __post_init__(self) -> None:
        if not (isinstance(self.ratio, (int, float)) and math.isfinite(self.ratio)
                and self.ratio > 0):
            raise ValueError(f"ratio must be a positive number, got {self.ratio!r}")
        for name in ("answer_samples", "question_max_new_tokens", "answer_max_new_tokens",
                     "rationale_max_new_tokens", "max_question_chars", "max_rationale_chars",
                     "max_rounds", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("question_temperature", "answer_temperature", "rationale_temperature"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if self.time_limit is not None and not self.time_limit > 0:
            raise ValueError(f"time_limit must be > 0 or None, got {self.time_limit!r}")
        if self.keep_rejected < 0:
            raise ValueError(f"keep_rejected must be >= 0, got {self.keep_rejected!r}")

    def to_dict(self) -> dict[str, Any]:
        values = {k: v for k, v in asdict(self).items() if k != "prompts"}
        values["prompts"] = ("ppc-gpt" if self.prompts == PPC_GPT_PROMPTS
                             else self.prompts.to_dict())
        return values


@dataclass(frozen=True)
class SyntheticSample:
    """One accepted synthetic example.

    Its JSONL record, ``{"id", "question", "choices", "label", "rationale", "source_id"}``, is
    also a valid task record (:func:`fedcompress.data.tasks.validate_examples`), so a saved file
    can be loaded with :func:`fedcompress.data.tasks.load_task` too.
    """

    id: str
    question: str
    choices: list[str]
    label: int
    rationale: str
    source_id: str

    @property
    def options(self) -> list[str]:
        """Alias of :attr:`choices`."""
        return self.choices

    @property
    def answer(self) -> str:
        """The text of the right choice."""
        return self.choices[self.label]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "question": self.question, "choices": list(self.choices),
                "label": self.label, "rationale": self.rationale, "source_id": self.source_id}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> SyntheticSample:
        """Build a sample from its record.

        Raises:
            ValueError: a field is missing or has the wrong type, or ``label`` is out of range.
        """
        try:
            sample = cls(id=str(record["id"]), question=record["question"],
                         choices=list(record["choices"]), label=record["label"],
                         rationale=record["rationale"], source_id=str(record["source_id"]))
        except (KeyError, TypeError) as err:
            raise ValueError(
                f"not a synthetic sample record ({err}): {str(record)[:120]}") from None
        if (not isinstance(sample.question, str) or not isinstance(sample.rationale, str)
                or not all(isinstance(c, str) for c in sample.choices)
                or isinstance(sample.label, bool) or not isinstance(sample.label, int)
                or not 0 <= sample.label < len(sample.choices)):
            raise ValueError(f"invalid synthetic sample record: {str(record)[:120]}")
        return sample


@dataclass
class SynthStats:
    """Counts and timings of one :func:`generate_synthetic` run.

    Attributes:
        examples: Client examples given.
        target: Synthetic samples wanted (``ratio * examples``, rounded half up).
        attempts: Question-generation attempts made (each accepted or rejected once).
        accepted: Samples kept.
        rejections: Rejected attempts per :class:`Rejection` (every reason listed, zeros too).
        rejections_by_stage: The same per stage (``question``, ``answer``, ``rationale``), only
            reasons that occurred.
        answer_votes: Of the answer samples of questions that reached the answer stage: how many
            parsed to a choice (``parsed``) out of how many were generated (``total``).
        rounds: Rounds run.
        prompts: Prompts sent to the backend per stage.
        stage_seconds: Wall time in each stage's backend calls.
        wall_seconds: Wall time of the whole run.
        stopped_early: The time limit stopped the run before every attempt was made.
    """

    examples: int = 0
    target: int = 0
    attempts: int = 0
    accepted: int = 0
    rejections: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in Rejection})
    rejections_by_stage: dict[str, dict[str, int]] = field(
        default_factory=lambda: {s: {} for s in STAGES})
    answer_votes: dict[str, int] = field(default_factory=lambda: {"parsed": 0, "total": 0})
    rounds: int = 0
    prompts: dict[str, int] = field(default_factory=lambda: {s: 0 for s in STAGES})
    stage_seconds: dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    wall_seconds: float = 0.0
    stopped_early: bool = False

    @property
    def rejected(self) -> int:
        return sum(self.rejections.values())

    @property
    def acceptance_rate(self) -> float:
        """``accepted / attempts`` (0 when nothing was attempted)."""
        return self.accepted / self.attempts if self.attempts else 0.0

    def reject(self, stage: str, reason: Rejection) -> None:
        self.rejections[reason.value] += 1
        per_stage = self.rejections_by_stage[stage]
        per_stage[reason.value] = per_stage.get(reason.value, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"rejected": self.rejected, "acceptance_rate": self.acceptance_rate}


@dataclass
class SynthResult:
    """Samples, statistics and (a few) rejected attempts of one run."""

    samples: list[SyntheticSample]
    stats: SynthStats
    config: SynthConfig
    backend: str = ""
    rejected: list[dict[str, Any]] = field(default_factory=list)

    def save(self, directory: str | Path) -> Path:
        """Write ``samples.jsonl``, ``stats.json`` and ``rejected.jsonl`` to ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_jsonl(self.samples, directory / "samples.jsonl")
        stats = {"backend": self.backend, "config": self.config.to_dict(),
                 "stats": self.stats.to_dict()}
        (directory / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        write_jsonl(directory / "rejected.jsonl", self.rejected)
        return directory


def save_jsonl(samples: Sequence[SyntheticSample], path: str | Path) -> int:
    """Write samples as JSON Lines (one :meth:`SyntheticSample.to_dict` per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_jsonl(path, (s.to_dict() for s in samples))


def load_jsonl(path: str | Path) -> list[SyntheticSample]:
    """Read samples written by :func:`save_jsonl`.

    Raises:
        ValueError: a line is not JSON or not a valid sample (the message names the line).
    """
    samples = []
    for line, record in read_jsonl(Path(path), ValueError):
        try:
            samples.append(SyntheticSample.from_dict(record))
        except ValueError as err:
            raise ValueError(f"{path}:{line}: {err}") from None
    return samples


def attempts_per_example(n_examples: int, ratio: float) -> list[int]:
    """Attempts of each example for ``ratio`` samples per example (sum: ``ratio * n`` rounded).

    Example ``i`` gets ``floor((i + 1) * ratio + 0.5) - floor(i * ratio + 0.5)``, which spreads
    a fractional ratio evenly over the examples.
    """
    bounds = [math.floor(i * ratio + 0.5) for i in range(n_examples + 1)]
    return [b - a for a, b in zip(bounds, bounds[1:])]


# ---------------------------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------------------------


@dataclass
class _Attempt:
    id: str
    example: int
    question: ParsedQuestion | None = None
    raw_question: str = ""
    label: int | None = None


def _check_examples(examples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The examples' ids, questions and choices (labels are never read)."""
    if isinstance(examples, (str, bytes)) or not isinstance(examples, Sequence):
        raise ValueError(f"examples must be a list of records, got {type(examples).__name__}")
    checked, seen = [], set()
    for i, record in enumerate(examples):
        if not isinstance(record, Mapping):
            raise ValueError(f"example #{i} is not a mapping: {record!r:.80}")
        question, choices = record.get("question"), record.get("choices", [])
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"example #{i} has no question text")
        if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or not all(
                isinstance(c, str) for c in choices):
            raise ValueError(f"example #{i}: choices must be a list of strings")
        rid = str(record.get("id", f"example-{i}"))
        if rid in seen:
            raise ValueError(f"example #{i}: duplicate id {rid!r}")
        seen.add(rid)
        checked.append({"id": rid, "question": question, "choices": list(choices)})
    return checked


def _call_seed(seed: int, *names: str) -> int:
    return int(derived_rng(seed, *names).integers(0, 2**31 - 1))


class _Run:
    """State of one :func:`generate_synthetic` call."""

    def __init__(self, examples: list[dict[str, Any]], backend: Backend, config: SynthConfig,
                 progress: bool) -> None:
        self.examples = examples
        self.backend = backend
        self.config = config
        self.stats = SynthStats(examples=len(examples))
        self.samples: list[SyntheticSample] = []
        self.rejected: list[dict[str, Any]] = []
        self.seen: set[str] = set()
        self.sources = {normalize(e["question"]) for e in examples}
        shared = {tuple(e["choices"]) for e in examples}
        closed = config.closed_choices
        if closed is None:
            closed = len(shared) == 1 and len(next(iter(shared))) >= 2
        self.fallback = list(next(iter(shared))) if closed and len(shared) == 1 else None
        self.progress = progress
        self._index = {e["id"]: i for i, e in enumerate(examples)}
        self.start = time.perf_counter()

    # -- bookkeeping ------------------------------------------------------------------------

    def reject(self, attempt: _Attempt, stage: str, reason: Rejection, detail: str = "",
               raw: Sequence[str] = ()) -> None:
        self.stats.reject(stage, reason)
        if len(self.rejected) < self.config.keep_rejected:
            self.rejected.append({
                "id": attempt.id, "source_id": self.examples[attempt.example]["id"],
                "stage": stage, "reason": reason.value, "detail": detail,
                "question": None if attempt.question is None else attempt.question.question,
                "choices": None if attempt.question is None else attempt.question.choices,
                "raw_question": attempt.raw_question[:_RAW_CHARS] if stage != "question" else "",
                "raw": [str(r)[:_RAW_CHARS] for r in raw]})

    def call(self, stage: str, prompts: list[Any], n: int, temperature: float,
             max_new_tokens: int, seed: int) -> list[list[str]]:
        """One backend call; an exception or a malformed result fails its prompts only."""
        start = time.perf_counter()
        try:
            out = self.backend.generate(prompts, n=n, temperature=temperature,
                                        max_new_tokens=max_new_tokens, seed=seed)
            if not isinstance(out, list) or len(out) != len(prompts):
                raise TypeError(f"backend returned {type(out).__name__} of "
                                f"{len(out) if isinstance(out, list) else '?'} rows for "
                                f"{len(prompts)} prompts")
        except Exception as err:  # a backend must not stop the run
            logger.warning("%s stage: backend call failed: %s", stage, err)
            out = [[Failed(Rejection.BACKEND_ERROR, f"{type(err).__name__}: {err}")] * n
                   for _ in prompts]
        fixed = []
        for row in out:
            if not isinstance(row, list) or len(row) != n or not all(isinstance(t, str)
                                                                    for t in row):
                row = [Failed(Rejection.BACKEND_ERROR, f"malformed completions {row!r:.80}")] * n
            fixed.append(row)
        self.stats.prompts[stage] += len(prompts)
        self.stats.stage_seconds[stage] += time.perf_counter() - start
        return fixed

    def out_of_time(self) -> bool:
        limit = self.config.time_limit
        return limit is not None and time.perf_counter() - self.start >= limit

    # -- stages -----------------------------------------------------------------------------

    def questions(self, chunk: list[_Attempt], seed: int) -> list[_Attempt]:
        cfg = self.config
        prompts = [question_prompt(self.examples[a.example]["question"],
                                   self.examples[a.example]["choices"], cfg.prompts)
                   for a in chunk]
        outputs = self.call("question", prompts, 1, cfg.question_temperature,
                            cfg.question_max_new_tokens, seed)
        survivors = []
        for attempt, (text,) in zip(chunk, outputs):
            if isinstance(text, Failed):
                self.reject(attempt, "question", text.reason, text.detail)
                continue
            try:
                parsed = parse_question(text, max_chars=cfg.max_question_chars,
                                        fallback_choices=self.fallback)
            except Rejected as err:
                self.reject(attempt, "question", err.reason, err.detail, [text])
                continue
            except Exception as err:  # a parser bug must not stop the run
                logger.exception("parse_question failed on %r", text[:200])
                self.reject(attempt, "question", Rejection.PARSER_ERROR, repr(err), [text])
                continue
            attempt.question, attempt.raw_question = parsed, text
            key = normalize(parsed.question)
            full_key = key + "\x00" + "\x00".join(sorted(normalize(c) for c in parsed.choices))
            if cfg.reject_copies and key in self.sources:
                self.reject(attempt, "question", Rejection.COPY, "repeats a source question",
                            [text])
            elif cfg.reject_duplicates and full_key in self.seen:
                self.reject(attempt, "question", Rejection.DUPLICATE,
                            "repeats an earlier synthetic question", [text])
            else:
                self.seen.add(full_key)
                survivors.append(attempt)
        return survivors

    def answers(self, chunk: list[_Attempt], seed: int) -> list[_Attempt]:
        cfg = self.config
        if not chunk:
            return []
        prompts = [answer_prompt(a.question.question, a.question.choices, cfg.prompts)
                   for a in chunk]
        outputs = self.call("answer", prompts, cfg.answer_samples, cfg.answer_temperature,
                            cfg.answer_max_new_tokens, seed)
        survivors = []
        for attempt, texts in zip(chunk, outputs):
            failed = next((t for t in texts if isinstance(t, Failed)), None)
            if failed is not None:
                self.reject(attempt, "answer", failed.reason, failed.detail)
                continue
            votes: list[int] = []
            first_error: Rejected | None = None
            for text in texts:
                try:
                    votes.append(parse_answer(text, attempt.question.choices))
                except Rejected as err:
                    first_error = first_error or err
                except Exception as err:  # a parser bug must not stop the run
                    logger.exception("parse_answer failed on %r", text[:200])
                    first_error = first_error or Rejected(Rejection.PARSER_ERROR, repr(err))
            self.stats.answer_votes["parsed"] += len(votes)
            self.stats.answer_votes["total"] += len(texts)
            if first_error is not None:
                self.reject(attempt, "answer", first_error.reason, first_error.detail, texts)
            elif len(set(votes)) > 1:
                self.reject(attempt, "answer", Rejection.DISAGREEMENT, f"votes {votes}", texts)
            else:
                attempt.label = votes[0]
                survivors.append(attempt)
        return survivors

    def rationales(self, chunk: list[_Attempt], seed: int) -> None:
        cfg = self.config
        if not chunk:
            return
        prompts = [rationale_prompt(a.question.question, a.question.choices, a.label,
                                    cfg.prompts) for a in chunk]
        outputs = self.call("rationale", prompts, 1, cfg.rationale_temperature,
                            cfg.rationale_max_new_tokens, seed)
        for attempt, (text,) in zip(chunk, outputs):
            if isinstance(text, Failed):
                self.reject(attempt, "rationale", text.reason, text.detail)
                continue
            try:
                rationale = parse_rationale(text, max_chars=cfg.max_rationale_chars)
            except Rejected as err:
                self.reject(attempt, "rationale", err.reason, err.detail, [text])
                continue
            except Exception as err:  # a parser bug must not stop the run
                logger.exception("parse_rationale failed on %r", text[:200])
                self.reject(attempt, "rationale", Rejection.PARSER_ERROR, repr(err), [text])
                continue
            self.samples.append(SyntheticSample(
                id=attempt.id, question=attempt.question.question,
                choices=list(attempt.question.choices), label=attempt.label,
                rationale=rationale, source_id=self.examples[attempt.example]["id"]))
            self.stats.accepted += 1

    # -- driver -----------------------------------------------------------------------------

    def run(self) -> None:
        cfg = self.config
        wanted = attempts_per_example(len(self.examples), cfg.ratio)
        self.stats.target = sum(wanted)
        made = [0] * len(self.examples)
        bar = tqdm(total=self.stats.target, desc=f"synthetic QA ({self.backend.name})",
                   unit="sample", disable=not self.progress, dynamic_ncols=True)
        try:
            for rnd in range(cfg.max_rounds):
                accepted = [0] * len(self.examples)
                for s in self.samples:
                    accepted[self._index[s.source_id]] += 1
                todo: list[_Attempt] = []
                for i, example in enumerate(self.examples):
                    for _ in range(wanted[i] - accepted[i]):
                        todo.append(_Attempt(f"{example['id']}-s{made[i]}", i))
                        made[i] += 1
                if not todo:
                    break
                self.stats.rounds += 1
                if rnd:
                    bar.total += len(todo)
                    bar.refresh()
                for c in range(0, len(todo), cfg.batch_size):
                    if self.out_of_time():
                        self.stats.stopped_early = True
                        logger.warning("time limit of %gs reached: %d samples accepted",
                                       cfg.time_limit, self.stats.accepted)
                        return
                    chunk = todo[c:c + cfg.batch_size]
                    self.stats.attempts += len(chunk)
                    names = (str(rnd), str(c // cfg.batch_size))
                    chunk = self.questions(chunk, _call_seed(cfg.seed, "question", *names))
                    chunk = self.answers(chunk, _call_seed(cfg.seed, "answer", *names))
                    self.rationales(chunk, _call_seed(cfg.seed, "rationale", *names))
                    bar.update(len(todo[c:c + cfg.batch_size]))
                    bar.set_postfix(accepted=self.stats.accepted)
        finally:
            bar.close()
            self.stats.wall_seconds = time.perf_counter() - self.start


def generate_synthetic(examples: Sequence[Mapping[str, Any]], backend: Backend,
                       config: SynthConfig | None = None, *,
                       progress: bool = True) -> SynthResult:
    """Run the PPC-GPT synthetic data pipeline on client examples (see the module docstring).

    Args:
        examples: Records with ``question`` and ``choices`` (perturbed client text) and an
            ``id`` (default ``example-<i>``); ``label`` and other fields are ignored.
        backend: The generator (:class:`~fedcompress.synth.backends.Backend`).
        config: Settings (default :class:`SynthConfig`).
        progress: Show a progress bar.

    Returns:
        The accepted samples (ordered by chunk, then by attempt), the statistics and up to
        ``config.keep_rejected`` rejected attempts with their raw outputs.

    Raises:
        ValueError: an example has no question text, choices that are not strings, or an id
            used twice (before anything is generated).
    """
    config = config or SynthConfig()
    checked = _check_examples(examples)
    run = _Run(checked, backend, config, progress)
    run.run()
    stats = run.stats
    logger.info("synthetic QA with %s: %d/%d attempts accepted (%.1f%%) in %.1fs; rejections %s",
                backend.name, stats.accepted, stats.attempts, 100 * stats.acceptance_rate,
                stats.wall_seconds, {k: v for k, v in stats.rejections.items() if v})
    return SynthResult(samples=run.samples, stats=stats, config=config, backend=backend.name,
                       rejected=run.rejected)
