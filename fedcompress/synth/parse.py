"""Parsing generator output: a new question with its choices, an answer, a rationale.

Generator models rarely follow an output format to the letter, small ones least of all, so the
parsers accept the usual variants (markdown bold, headings, missing colons, choices as a Python or
JSON list, as lettered lines or inline ``(A) ... (B) ...``, answers as ``FINAL ANSWER: B``,
``the answer is (B)``, ``Answer: B) text``, or the text of a choice) and reject everything else
with a reason. Every parser either returns a value or raises :class:`Rejected` carrying a
:class:`Rejection`; none raises anything else on any input string, so one bad sample never stops
a run. :mod:`fedcompress.synth.generate` counts the rejections by reason.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from fedcompress.synth.prompts import LETTERS

__all__ = [
    "ParsedQuestion",
    "Rejected",
    "Rejection",
    "normalize",
    "parse_answer",
    "parse_question",
    "parse_rationale",
]

#: Longest choice list a question may have (one letter per choice).
MAX_CHOICES = len(LETTERS)


class Rejection(StrEnum):
    """Why a synthetic sample was dropped (each attempt is accepted or has exactly one reason)."""

    EMPTY = "empty"
    """The generator returned nothing but whitespace (at any stage)."""
    NO_QUESTION = "no_question"
    """No question could be found in the question-generation output."""
    BAD_OPTIONS = "bad_options"
    """No choice list, fewer than 2 or more than 26 choices, empty or repeated choices."""
    COPY = "copy"
    """The new question repeats the (perturbed) source question."""
    DUPLICATE = "duplicate"
    """The new question and choices repeat an earlier synthetic sample."""
    TOO_LONG = "too_long"
    """A question (with its choices), a rationale or a prompt is longer than allowed."""
    NO_ANSWER = "no_answer"
    """An answer sample names no choice (no final-answer marker, letter or choice text)."""
    ANSWER_NOT_IN_OPTIONS = "answer_not_in_options"
    """An answer sample names a letter or a text that is not one of the choices."""
    DISAGREEMENT = "disagreement"
    """The answer samples do not all name the same choice."""
    NO_RATIONALE = "no_rationale"
    """The rationale output holds no explanation (only markers, or nothing before ``<end>``)."""
    TIMEOUT = "timeout"
    """The backend gave up on the request after its time limit."""
    BACKEND_ERROR = "backend_error"
    """The backend failed (HTTP error, malformed response, exception while generating)."""
    PARSER_ERROR = "parser_error"
    """A parser raised an unexpected exception (a bug, logged with its traceback)."""


class Rejected(Exception):
    """A generator output that cannot be used.

    Attributes:
        reason: The :class:`Rejection`.
        detail: A short human-readable explanation.
    """

    def __init__(self, reason: Rejection, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class ParsedQuestion:
    """A generated question and its choices (in the generator's order)."""

    question: str
    choices: list[str]


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------

_MARKDOWN = re.compile(r"\*\*|__|`+|^[ \t]*#{1,6}[ \t]*", re.M)
_SPACES = re.compile(r"\s+")
_QUOTES = "'\"`‘’“”«»"


def _clean_markup(text: str) -> str:
    """Drop markdown emphasis/heading markers and normalise line endings."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _MARKDOWN.sub("", text)


def normalize(text: str) -> str:
    """Lower case, quotes and surrounding punctuation removed, whitespace collapsed.

    Used to compare choices with each other and answer texts with choices.
    """
    text = _SPACES.sub(" ", str(text)).strip().lower()
    text = text.strip(_QUOTES + " .,;:!?()[]{}")
    return _SPACES.sub(" ", text)


def _one_line(text: str) -> str:
    return _SPACES.sub(" ", text).strip()


def _strip_quotes(text: str) -> str:
    text = text.strip()
    while len(text) >= 2 and text[0] in _QUOTES and text[-1] in _QUOTES:
        text = text[1:-1].strip()
    return text


# ---------------------------------------------------------------------------------------------
# Questions
# ---------------------------------------------------------------------------------------------

# The prompt's "Given Question and Multiple Choices: ..." line, echoed by the model.
_ECHO = re.compile(r"(?im)^[ \t>*\-]*given\s+question\b[^\n]*(?:\n|$)")
# Pieces of the prompt's output format: a "question" holding them is an echo, not a question.
_TEMPLATE_ECHO = re.compile(
    r"(?i)created\s+question|<\s*your\s+created|your\s+output\s+should\s+be|"
    r"given\s+question\s+and")
_HEADER = re.compile(
    r"(?i)created[ \t]+question[ \t]+and[ \t]+(?:multiple[ \t]+)?choices[ \t]*[:：]?")
_LINE_LEAD = r"(?:^|\n)[ \t>*\-•]*(?:\d+[.)][ \t]*)?"
_QUESTION_MARK = re.compile(
    _LINE_LEAD + r"(?i:(?:new|created|synthetic|generated)\s+)?(?i:question\s*\d*|q)\s*[:：]")
_CHOICES_MARK = re.compile(
    _LINE_LEAD + r"(?i:(?:multiple|answer|possible)\s+)?(?i:choices|options)\b[ \t]*[:：]?"
    r"|(?i:\b(?:choices|options)\s*[:：])")
# A line that starts another part of the output (ends the choice block).
_STOP_LINE = re.compile(
    r"(?im)^[ \t>*\-]*(?:correct\s+|right\s+|final\s+)?(?:answer|solution|explanation|rationale|"
    r"reasoning|check|note|step\s*\d*|question|given\s+question)\b[^\n]*[:：]")
# One option line: "A) x", "(A) x", "A. x", "a: x", "- x", "1. x".
_OPTION_LINE = re.compile(
    r"^[ \t>]*(?:\(([A-Za-z])\)|\[([A-Za-z])\]|([A-Za-z])[.):](?=\s)|[-*•]|\d+[.)])[ \t]*(\S.*)$")
# Inline lettered options: "(A) x (B) y" or "A) x B) y"; on a choices line also "A. x, B. y".
_INLINE_LETTER = re.compile(r"(?:^|(?<=\s)|(?<=[,;]))\(?([A-Z])\)[ \t]*")
_INLINE_LETTER_DOT = re.compile(r"(?:^|(?<=\s)|(?<=[,;]))\(?([A-Z])[.)][ \t]+")
_LABEL_PREFIX = re.compile(r"^\s*(?:\(([A-Za-z])\)|([A-Za-z])[.):])\s+")
_QUOTED_ITEM = re.compile(r"""(['"“‘])(.*?)(?:\1|[’”])(?=\s*(?:,|\]|$))""", re.S)


def parse_question(text: str, *, max_chars: int | None = None,
                   fallback_choices: Sequence[str] | None = None) -> ParsedQuestion:
    """Find the created question and its choices in a question-generation output.

    The expected output (paper, App. B) is::

        CREATED QUESTION AND CHOICES:
        Question: <question>
        Choices: ['first', 'second', ...]

    Also accepted: text before the header is ignored; markdown; ``Q:`` or ``New question:``;
    the question on the line after its marker; no ``Question:`` marker (the text just before the
    choices is the question); choices as a Python/JSON list, a list with bad quoting, comma
    separated in brackets, lettered or bulleted lines, or inline ``(A) x (B) y`` (also inside the
    question line when there is no ``Choices`` marker). Only the first created question is used.
    Letter labels (``A. x``) inside list items are removed when every item has one. A
    "question" that repeats pieces of the prompt's format (``CREATED QUESTION AND``, ``<your
    created question>``, ``Your output should be``) is rejected as ``NO_QUESTION``.

    Args:
        text: The generator's output.
        max_chars: Longest accepted question plus choices, in characters (``None``: no limit).
        fallback_choices: Choices to use when the output has a question but no choices at all
            (for tasks with one closed label set, e.g. ``['Yes', 'No']``).

    Raises:
        Rejected: ``EMPTY``, ``NO_QUESTION``, ``BAD_OPTIONS`` or ``TOO_LONG``.
    """
    if not isinstance(text, str) or not text.strip():
        raise Rejected(Rejection.EMPTY, "no output")
    body = _ECHO.sub("", _clean_markup(text))
    header = _HEADER.search(body)
    if header:
        body = body[header.end():]
    q_mark = _QUESTION_MARK.search(body)
    start = q_mark.end() if q_mark else 0
    c_mark = _CHOICES_MARK.search(body, start)
    next_q = _QUESTION_MARK.search(body, start)
    if c_mark and next_q and next_q.start() < c_mark.start():
        c_mark = None  # the choices found belong to a later question
    if c_mark:
        question, choices = body[start:c_mark.start()], _choice_block(body[c_mark.end():])
    elif q_mark or header:
        end = next_q.start() if next_q else len(body)
        question, choices = _split_question_and_options(body[start:end])
    else:
        raise Rejected(Rejection.NO_QUESTION, "no 'Question:' or 'Choices:' marker")
    if not q_mark:
        question = _last_paragraph(question)
    if choices is None and c_mark is None:
        question = _first_paragraph(question)
    question = _strip_quotes(_one_line(question))
    if not re.search(r"[^\W\d_]{2}", question):
        raise Rejected(Rejection.NO_QUESTION, f"no question text in {question!r:.80}")
    if _TEMPLATE_ECHO.search(question):
        raise Rejected(Rejection.NO_QUESTION, f"the prompt's format echoed: {question!r:.80}")
    if not choices:
        if fallback_choices is None:
            raise Rejected(Rejection.BAD_OPTIONS, "no choices found")
        choices = [str(c) for c in fallback_choices]
    choices = _check_choices(choices)
    if max_chars is not None and len(question) + sum(len(c) for c in choices) > max_chars:
        raise Rejected(Rejection.TOO_LONG, f"question and choices exceed {max_chars} characters")
    return ParsedQuestion(question, choices)


def _first_paragraph(text: str) -> str:
    """Text up to the first blank line (the question alone, without trailing chatter)."""
    text = text.strip()
    return re.split(r"\n\s*\n", text, maxsplit=1)[0] if text else text


def _last_paragraph(text: str) -> str:
    """The last paragraph before the choices (when there is no ``Question:`` marker)."""
    parts = [p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    return parts[-1] if parts else ""


def _split_question_and_options(text: str) -> tuple[str, list[str] | None]:
    """A question without a ``Choices`` marker: options on lines of their own, or inline."""
    lines = text.strip().split("\n")
    for i, line in enumerate(lines):
        if i and _OPTION_LINE.match(line):
            options = _option_lines(lines[i:])
            if options:
                return "\n".join(lines[:i]), options
    first = _first_paragraph(text)
    inline = _inline_letters(first)
    if inline:
        return inline
    return text, None


def _inline_letters(text: str, dots: bool = False) -> tuple[str, list[str]] | None:
    """Split ``question (A) x (B) y`` into the question and its options (A, B, ... in order).

    ``dots``: also accept ``A. x B. y`` (only on a choices line: in a question, ``B.`` may be an
    initial).
    """
    marks = list((_INLINE_LETTER_DOT if dots else _INLINE_LETTER).finditer(text))
    seq: list[re.Match[str]] = []
    for m in marks:
        if m.group(1) == LETTERS[len(seq)]:
            seq.append(m)
        elif m.group(1) == "A":
            seq = [m]
    if len(seq) < 2:
        return None
    options = [text[a.end():b.start()] for a, b in zip(seq, seq[1:])] + [text[seq[-1].end():]]
    options = [o.strip().rstrip(",;").strip() for o in options]
    return text[:seq[0].start()], options


def _choice_block(text: str) -> list[str] | None:
    """The choices after a ``Choices`` marker, in any of the accepted forms."""
    stop = _STOP_LINE.search(text)
    region = text[:stop.start()] if stop else text
    stripped = region.lstrip(" \t")
    if stripped.startswith("\n"):
        stripped = stripped.lstrip()
    if not stripped:
        return None
    if stripped[0] in "[(" and (stripped[0] == "[" or not _LABEL_PREFIX.match(stripped)):
        items = _bracketed(stripped)
        if items is not None:
            return items
    first_line, _, rest = stripped.partition("\n")
    lines = stripped.split("\n")
    inline = _inline_letters(" " + first_line, dots=True)
    if inline and not inline[0].strip():
        return inline[1]
    if _OPTION_LINE.match(first_line):
        return _option_lines(lines)
    if rest.strip() and _OPTION_LINE.match(rest.strip().split("\n")[0]) and not first_line.strip():
        return _option_lines(rest.strip().split("\n"))
    # A bare comma-separated line.
    items = [i for i in (_strip_quotes(p) for p in first_line.split(",")) if i]
    return items if len(items) >= 2 else None


def _bracketed(text: str) -> list[str] | None:
    """Items of a list written in brackets (possibly spanning lines, possibly badly quoted)."""
    opener = text[0]
    closer = "]" if opener == "[" else ")"
    end = _matching(text, opener, closer)
    inner_text = text[: end + 1] if end is not None else text.split("\n\n")[0]
    for loader in (ast.literal_eval, json.loads):
        try:
            value = loader(inner_text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(value, (list, tuple)) and all(
                isinstance(v, (str, int, float)) for v in value):
            return [str(v) for v in value]
    inner = inner_text[1:-1] if end is not None else inner_text[1:]
    quoted = [m.group(2) for m in _QUOTED_ITEM.finditer(inner)]
    if len(quoted) >= 2:
        return quoted
    inline = _inline_letters(" " + _one_line(inner), dots=True)
    if inline and not inline[0].strip():
        return inline[1]
    items = [_strip_quotes(p) for p in re.split(r",|\n", inner)]
    return [i for i in items if i] or None


def _matching(text: str, opener: str, closer: str) -> int | None:
    """Index of the bracket closing ``text[0]``, skipping quoted text where quoting is sane."""
    depth, quote = 0, None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote and (i + 1 == len(text) or text[i + 1] in ",]) \n\t"):
                quote = None
            continue
        if ch in "'\"" and (i == 0 or text[i - 1] in "[(, \n\t"):
            quote = ch
        elif ch == opener:
            depth += 1
        elif ch == closer:
            depth -= 1
            if depth == 0:
                return i
    # Quoting may have been broken (apostrophes): fall back to the last closer on the block.
    block = text.split("\n\n")[0]
    last = block.rfind(closer)
    return last if last > 0 else None


def _option_lines(lines: Sequence[str]) -> list[str] | None:
    """Consecutive option lines (blank lines between them allowed) at the start of ``lines``."""
    options: list[str] = []
    for line in lines:
        if not line.strip():
            continue
        m = _OPTION_LINE.match(line)
        if not m:
            break
        options.append(m.group(4).strip())
    return options or None


def _check_choices(choices: Sequence[str]) -> list[str]:
    """Clean the choices (quotes, whitespace, common letter labels) and validate them."""
    cleaned = [_strip_quotes(_one_line(str(c))).rstrip(",;").strip() for c in choices]
    labels = [_LABEL_PREFIX.match(c) for c in cleaned]
    if cleaned and all(labels) and [(m.group(1) or m.group(2)).upper() for m in labels] == list(
            LETTERS[:len(cleaned)]):
        cleaned = [_strip_quotes(c[m.end():]) for c, m in zip(cleaned, labels)]
    if len(cleaned) < 2:
        raise Rejected(Rejection.BAD_OPTIONS, f"{len(cleaned)} choice(s), at least 2 needed")
    if len(cleaned) > MAX_CHOICES:
        raise Rejected(Rejection.BAD_OPTIONS, f"{len(cleaned)} choices, at most {MAX_CHOICES}")
    if any(not c for c in cleaned):
        raise Rejected(Rejection.BAD_OPTIONS, "an empty choice")
    keys = [normalize(c) for c in cleaned]
    if len(set(keys)) < len(keys):
        raise Rejected(Rejection.BAD_OPTIONS, "repeated choices")
    return cleaned


# ---------------------------------------------------------------------------------------------
# Answers
# ---------------------------------------------------------------------------------------------

# "final answer" needs a connector: "Your final answer must be ..." names no answer.
_FINAL = re.compile(
    r"(?i)final\s+(?:answer|choice)\s*(?:is|would\s+be|will\s+be|should\s+be|:|：|=|-)"
    r"[ \t]*([^\n]*)")
_ANSWER = re.compile(
    r"(?i)(?:\b(?:correct|right|best)\s+)?\b(?:answer|choice|option)\s*"
    r"(?:is|would\s+be|should\s+be|will\s+be|:|：|=)[ \t]*([^\n]*)")
_LETTER_IS_CORRECT = re.compile(
    r"(?:option|choice|answer)?\s*\(?\b([A-Z])\b\)?\s+is\s+(?:the\s+)?(?:correct|right|best)")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_SEGMENT_LEAD = re.compile(
    r"(?i)^(?:[\s:：=\-]|is\b|the\b|would\s+be\b|should\s+be\b|correct\b|letter\b|option\b|"
    r"choice\b|answer\b)+")
_LETTER_AT_START = re.compile(r"^(?:\(([A-Za-z])\)|\[([A-Za-z])\]|([A-Za-z]))(?=$|[\s).:,;\]!'\"])")


def parse_answer(text: str, choices: Sequence[str]) -> int:
    """The index of the choice a chain-of-thought answer ends on.

    Looks, in this order, at the last ``FINAL ANSWER: ...``, the last ``answer/choice/option
    is ...`` or ``Answer: ...``, ``(B) is correct``, and a short whole output (``B``, ``(B)``,
    ``Yes``). Each candidate is read as a letter (``B``, ``(B)``, ``[B]``, ``B)``, ``B.``,
    ``\\boxed{B}``; lower case only inside brackets or alone) or as the text of a choice (exact,
    as a prefix, or the only choice it contains). A bare ``A`` or ``I`` followed by a word that
    does not start its choice is English, not a letter.

    Raises:
        Rejected: ``EMPTY``; ``ANSWER_NOT_IN_OPTIONS`` when a marked answer names a letter past
            the choices or a text that is no choice; ``NO_ANSWER`` otherwise.
    """
    if not isinstance(text, str) or not text.strip():
        raise Rejected(Rejection.EMPTY, "no output")
    body = _BOXED.sub(r"(\1)", _clean_markup(text))
    candidates: list[str] = []
    candidates += [m.group(1) for m in reversed(list(_FINAL.finditer(body)))]
    candidates += [m.group(1) for m in reversed(list(_ANSWER.finditer(body)))]
    candidates += [f"({m.group(1)})" for m in reversed(list(_LETTER_IS_CORRECT.finditer(body)))]
    marked = len(candidates)
    if len(_one_line(body)) <= 60:
        candidates.append(_one_line(body))
    not_in_options: str | None = None
    for i, candidate in enumerate(candidates):
        try:
            index = _read_answer(candidate, choices)
        except Rejected as err:
            not_in_options = not_in_options or err.detail
            continue
        if index is not None:
            return index
        if i < marked and normalize(candidate) and not_in_options is None:
            not_in_options = f"{_one_line(candidate)!r:.80} is not a choice"
    if not_in_options is not None:
        raise Rejected(Rejection.ANSWER_NOT_IN_OPTIONS, not_in_options)
    raise Rejected(Rejection.NO_ANSWER, "no final answer found")


def _read_answer(segment: str, choices: Sequence[str]) -> int | None:
    """A letter or a choice text at the start of ``segment`` (``None``: neither)."""
    segment = _SEGMENT_LEAD.sub("", segment.strip()).strip().strip(_QUOTES).strip()
    if not segment:
        return None
    by_text = _match_text(segment, choices)
    m = _LETTER_AT_START.match(segment)
    if m:
        letter = m.group(1) or m.group(2) or m.group(3)
        bare = m.group(3) is not None
        rest = segment[m.end():].strip()
        if bare and letter.islower() and rest and not rest.startswith((")", ".", ":")):
            letter = ""  # a lower-case word such as "a" in "a cat": not a letter
        elif bare and letter in "AI" and rest[:1].isalpha():
            index = LETTERS.index(letter)
            if not (index < len(choices) and normalize(rest).startswith(normalize(choices[index]))):
                letter = ""  # English "A ..." / "I ...": not a letter
        if letter:
            index = LETTERS.index(letter.upper())
            if by_text is not None and len(segment.strip()) == len(m.group(0)):
                return by_text  # the whole answer is a one-letter choice such as "a" or "b"
            if index >= len(choices):
                raise Rejected(Rejection.ANSWER_NOT_IN_OPTIONS,
                               f"letter {letter.upper()} with {len(choices)} choices")
            return index
    return by_text


def _match_text(segment: str, choices: Sequence[str]) -> int | None:
    """The choice that ``segment`` is, starts with, or (uniquely) contains."""
    seg = normalize(segment)
    keys = [normalize(c) for c in choices]
    for i, key in enumerate(keys):
        if seg == key:
            return i
    prefixes = [i for i, key in enumerate(keys)
                if key and re.match(re.escape(key) + r"(?:\W|$)", seg)]
    if prefixes:
        return max(prefixes, key=lambda i: len(keys[i]))
    contained = [i for i, key in enumerate(keys)
                 if len(key) > 1 and re.search(r"(?:^|\W)" + re.escape(key) + r"(?:\W|$)", seg)]
    if len(contained) == 1:
        return contained[0]
    return None


# ---------------------------------------------------------------------------------------------
# Rationales
# ---------------------------------------------------------------------------------------------

_END = re.compile(r"(?i)<\s*/?\s*end\s*>|\[end\]|<\|?end")
_RATIONALE_MARK = re.compile(r"(?i)^\s*(?:rationale|explanation|reason)\s*[:：]\s*")
_NEXT_EXAMPLE = re.compile(
    r"(?im)^[ \t]*(?:question|choices|answer|example(?:\(s\))?|please explain)\s*[:：]")


def parse_rationale(text: str, *, max_chars: int | None = None) -> str:
    """The rationale in a rationale-generation output.

    Cut at ``<end>`` (also ``</end>``, ``[end]``, or a cut-off ``<end``), a leading
    ``Rationale:`` removed, cut before a following ``Question:``/``Choices:``/``Answer:`` line (a
    model that goes on writing examples), whitespace collapsed, surrounding quotes removed.

    Raises:
        Rejected: ``EMPTY`` (no output), ``NO_RATIONALE`` (nothing left, or no word in it) or
            ``TOO_LONG`` (more than ``max_chars`` characters).
    """
    if not isinstance(text, str) or not text.strip():
        raise Rejected(Rejection.EMPTY, "no output")
    body = _clean_markup(text)
    end = _END.search(body)
    if end:
        body = body[:end.start()]
    body = _RATIONALE_MARK.sub("", body.strip())
    nxt = _NEXT_EXAMPLE.search(body)
    if nxt:
        body = body[:nxt.start()]
    rationale = _strip_quotes(_one_line(body))
    if not re.search(r"[^\W\d_]{2}", rationale):
        raise Rejected(Rejection.NO_RATIONALE, f"no explanation in {text.strip()!r:.80}")
    if max_chars is not None and len(rationale) > max_chars:
        raise Rejected(Rejection.TOO_LONG, f"rationale of {len(rationale)} > {max_chars} chars")
    return rationale
