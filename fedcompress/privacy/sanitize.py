"""Word-level text sanitizer with the exponential mechanism (PPC-GPT §3.2, SanText, CusText).

PPC-GPT's clients send their task text to the server only after perturbing it with the
exponential mechanism (McSherry and Talwar, 2007): every word ``x`` is replaced by a word ``y``
drawn from a candidate set ``Y`` with

    p(y | x) = exp(eps * u(x, y) / (2 * Δu)) / Σ_{y' ∈ Y} exp(eps * u(x, y') / (2 * Δu)),

where ``u`` is a utility (a similarity of word vectors) and ``Δu = max_{x, x', y}
|u(x, y) - u(x', y)|`` its sensitivity. For any two words ``x, x'`` and any output ``y`` this
gives ``p(y | x) / p(y | x') <= e^eps`` (the numerator factor is at most ``e^{eps/2}`` and the
normaliser ratio at most ``e^{eps/2}``): each perturbed word is ``eps``-differentially private
(local DP, neighbouring inputs = two different words). Words are perturbed independently, so
by sequential composition two texts that differ in ``k`` perturbed words are ``k * eps``
indistinguishable, and a document's ``n`` perturbed words together cost ``n * eps``;
:class:`SanitizeReport` gives ``eps`` per word and that total.

Utility (bounded, so the sensitivity is true)
--------------------------------------------
``s(x, y)`` is a base similarity of the word vectors ``e_x, e_y`` (float32):
``-||e_x - e_y||_2`` (:attr:`Utility.EUCLIDEAN`, the default, as SanText and CusText) or the
cosine similarity (:attr:`Utility.COSINE`). For each input ``x`` it is min-max normalised over
the candidates ``Y(x)`` the mechanism may output for ``x``:

    u(x, y) = (s(x, y) - lo(x)) / (hi(x) - lo(x)),
    lo(x) = min_{y' ∈ Y(x)} s(x, y'),   hi(x) = max_{y' ∈ Y(x)} s(x, y'),

so ``u ∈ [0, 1]`` (1: the candidate nearest to ``x``, 0: the farthest; ``u = 1`` everywhere if
all candidates are equally similar) and ``Δu = 1`` exactly, whatever the table:
``p(y | x) ∝ exp(eps * u(x, y) / 2)``. The normalisation uses only the public table, never the
text. (SanText's own code uses ``exp(-eps * ||e_x - e_y|| / 2)``, which is *metric* DP with a
guarantee that degrades with the distance of ``x`` and ``x'``; an ``eps`` here is a pure
``eps``-DP budget and is not comparable with SanText's numbers.)

Mechanisms (:class:`Mechanism`)
-------------------------------
* ``santext``: ``Y(x) = Y`` for every ``x``, the candidate vocabulary (the first
  :attr:`SanitizerConfig.candidates` words of the table that are single words, see below).
  The ``e^eps`` bound holds for every pair of input words. With a large vocabulary this
  guarantee is strong and the text is mostly lost: over GloVe's 20,000 most frequent words a
  word is kept with probability ~1e-4 at eps = 1..10 (e.g. ``boston``: 6e-5 at eps 1, 3e-4 at
  eps 10) and the 10 nearest candidates hold < 1% of the mass.
* ``custext``: CusText's customised output sets (Chen et al., ACL Findings 2023). Candidates
  are grouped greedily in table order (GloVe: most frequent first): the first ungrouped word and
  its ``top_k - 1`` nearest ungrouped words (by ``s``) form a group, until fewer than
  ``2 * top_k`` words are left, which form the last group (so every group has ``top_k`` to
  ``2 * top_k - 1`` words). ``Y(x)`` is the group of ``x``; a table word outside the candidate
  vocabulary uses the group of its nearest candidate. The ``e^eps`` bound holds for every pair
  of inputs *in the same group*; inputs of different groups have disjoint output sets (the group
  itself is released, as in CusText). With groups of 20 a word is kept with probability
  ~0.07 at eps 1, ~0.15 at eps 3 and ~0.5-0.85 at eps 10 (GloVe).

Options in the style of SanText+ / CusText+
-------------------------------------------
* ``keep_stopwords``: words of :data:`STOP_WORDS` (or :attr:`SanitizerConfig.stopwords`) are
  emitted unchanged and cost nothing.
* ``common_words`` / ``common_p`` (SanText+): the first ``common_words`` rows of the table (GloVe:
  the most frequent words) are non-sensitive; each occurrence is perturbed with probability
  ``common_p`` (costing ``eps``) and otherwise emitted unchanged. All other words are sensitive
  and always perturbed. ``common_words=0`` (default): every word is sensitive.

What is released in the clear
-----------------------------
The guarantee covers the words drawn from the mechanism, nothing else. What the output shows
as it was, and why each default is what it is (privacy first):

* **Out-of-vocabulary words** (names, surnames, codes, rare words: exactly what identifies a
  person): never, by default. They are replaced by a candidate drawn uniformly at random
  (``oov='random'``), independently of the word. This costs no budget and keeps the bound: the
  uniform distribution is the mechanism at ``eps = 0``, and for SanText every ``p(y | x)`` lies
  in ``[e^{-eps/2}, e^{eps/2}] / |Y|``, so an OOV word and any table word are ``eps``-
  indistinguishable. A fixed placeholder token was rejected: it would tell which words were
  out of vocabulary (an output that no table word can produce). ``oov='keep'`` copies them
  verbatim and is only used when asked for: the sanitizer logs a warning with the number of
  words released in the clear, and every report's ``eps_total`` is ``inf`` (the mechanism is
  not DP when a neighbouring text may carry an OOV word that comes out as it is), with the
  count of clear words in ``n_clear``.
* **Digits and identifiers**: a token with a digit, ``.``, ``:``, ``/``, ``@`` or ``+`` inside
  (account and phone numbers, dates, e-mail addresses, host names, version strings), and a URL,
  is ONE word: looked up whole (GloVe knows ``12:30``, ``1945-46``, ``google.com``) and
  perturbed, or else replaced whole as an OOV word; it is never split into pieces, so neither
  its inner punctuation nor the number of its groups is released. Only a trailing clitic is
  split off (``1990's`` -> ``1990`` + ``'s``).
* **Stop words**: perturbed like every word by default; ``keep_stopwords`` (opt-in, the
  SanText+/CusText+ setting) copies the words of a fixed public list of function words. They
  carry no name or number, but do carry pronoun gender and negation; counted in ``n_kept``.
* **SanText+ non-sensitive words**: opt-in (``common_words > 0``); each occurrence not drawn
  by the ``common_p`` coin is copied and counted in ``n_kept``.
* **Layout**: the number of words and their positions, the punctuation between words and the
  whitespace are copied, always. A word-level mechanism cannot hide how many words a text has;
  punctuation and whitespace come from a small public alphabet and carry no word (identifiers
  are consumed whole, above), but they do show the shape of a text (sentences, lists, a
  parenthesised number). Sanitise only the fields that need it and do not send raw layout that
  is itself sensitive.

Tokenisation
------------
A word is a maximal match of :data:`TOKEN_PATTERN`: a URL (``scheme://...`` or ``www....``,
up to whitespace, trailing punctuation left out), or letters, digits and ``_`` joined by inner
``-``, ``'``, ``’``, ``.``, ``:``, ``/``, ``@`` or ``+`` (so ``zk1977@mail.com`` and
``4417-1234-5678-9113`` are one word each); everything between words (whitespace,
punctuation) is copied unchanged, so the output keeps the layout of the input. A word is looked
up lower-cased (GloVe is lower-case; ``lowercase=False`` for cased tables) with ``’`` read as
``'``. A word not in the table is split, Penn-Treebank style, into stem + clitic (``don't`` ->
``do`` + ``n't``, ``john's`` -> ``john`` + ``'s``); an identifier (a digit, ``.``, ``:``,
``/``, ``@`` or ``+`` inside, or a URL) is otherwise kept whole; any other word is split at its
inner ``-``/``'`` (kept as punctuation: ``lion-xyzzy`` -> ``lion`` - ``xyzzy``), and each piece
is looked up. Outputs are table words (lower-case for GloVe); a perturbed clitic is written as
a separate word (``do n't`` -> ``did not``). Only table words matching :data:`WORD_PATTERN`
are candidates, so a word is never replaced by punctuation or an identifier-shaped string.
Tokenisation of a stream is decided at whitespace (no word spans whitespace), so the output
does not depend on how the text is cut into pieces.

Out-of-vocabulary words (:class:`OOVPolicy`): ``'random'`` (the default) replaces them by a
uniformly drawn candidate (independent of the word: costs nothing), ``'error'`` raises
:class:`OOVError` naming the word and its offset, ``'keep'`` (explicit opt-in) emits them
unchanged, logs a warning and makes ``eps_total`` infinite. No word is ever dropped; every
out-of-vocabulary word is counted in ``n_oov``.

Numerics and randomness
-----------------------
Vectors, similarities, utilities and the weights ``w(x, y) = exp(eps (u(x, y) - 1) / 2)``
(in ``[e^{-eps/2}, 1]``) are float32 (:data:`DTYPE`); ``p(y | x) = w(x, y) / Σ_y' w(x, y')``.
For ``eps`` above ~170, ``e^{-eps/2}`` leaves float32's range and the farthest candidates' weights
can round to 0, which breaks the ``e^eps`` bound for them (a warning is logged); any smaller
``eps`` keeps every candidate's probability positive. Sampling is an exact two-level inverse
CDF over those weights: float64 running sums of blocks of :data:`BLOCK` weights pick the block,
a float64 running sum inside the block picks the word, so ``P(y | x) = w(x, y) / Σ w`` up to
float64 rounding (the resolution of the uniforms is 2^-53). Each word uses two uniforms
(SanText+ coin, sample) drawn in text order from a seeded :class:`numpy.random.Generator`, so
the output depends only on the text, the seed and the config, not on how the text is chunked or
streamed. The table of each (input word, eps) is computed once, in batches of
:data:`TABLE_BATCH` words (one matrix product), and kept in an LRU cache
(:attr:`SanitizerConfig.cache_mb`; SanText: 4 bytes per candidate and word, 80 KB for 20,000
candidates, in memory maps populated in one system call and reused after eviction): sanitising
a word seen before is a dictionary lookup, a comparison with its block sums and a running sum
over one block. A SanText table costs ~0.2-0.3 ms per distinct word and eps at 20,000
candidates (``simulations/sanitizer_throughput.py`` measures it).
"""

from __future__ import annotations

import codecs
import itertools
import logging
import math
import mmap
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from fedcompress.data.embeddings import DTYPE, EmbeddingTable, load_glove, model_embedding_table
from fedcompress.data.errors import check_seed
from fedcompress.data.jsonl import dumps_line, read_jsonl

__all__ = [
    "DELTA_U",
    "DTYPE",
    "STOP_WORDS",
    "TOKEN_PATTERN",
    "WORD_PATTERN",
    "InputEncodingError",
    "Mechanism",
    "OOVError",
    "OOVPolicy",
    "SanitizeError",
    "SanitizeReport",
    "SanitizedText",
    "Sanitizer",
    "SanitizerConfig",
    "Utility",
    "check_eps",
    "json_budget",
    "release_notes",
    "sanitize_file",
]

logger = logging.getLogger(__name__)

DELTA_U = 1.0
"""Sensitivity of the utility: ``u(x, y) ∈ [0, 1]`` for every input and candidate."""

WORD_PATTERN = r"\w+(?:[-'’]\w+)*"
"""What a candidate looks like: letters, digits and ``_`` joined by inner ``-``, ``'``, ``’``
(table words of another shape, such as ``3.5`` or ``google.com``, are inputs, never outputs)."""

_URL_PATTERN = (r"(?:[A-Za-z][A-Za-z0-9+.-]*://|www\.)"
                r"[^\s<>\"'`()\[\]{}]*[^\s<>\"'`()\[\]{}.,;:!?]")
TOKEN_PATTERN = _URL_PATTERN + r"|\w+(?:[-'’.:/@+]\w+)*"
"""What counts as a word of the input: a URL, or letters, digits and ``_`` joined by inner
``-``, ``'``, ``’``, ``.``, ``:``, ``/``, ``@`` or ``+`` (everything else is copied unchanged).
No word contains whitespace."""

CHUNK_WORDS = 8192
"""Words sanitised per vectorised step (bounds the memory of a long text)."""

TABLE_BATCH = 256
"""Input words whose probability tables are computed together (one matrix product)."""

BLOCK = 128
"""Candidates per block of a sampling table (two-level inverse CDF)."""

EPS_UNDERFLOW = 170.0
"""Above this ``eps``, ``e^{-eps/2}`` underflows float32's normal range (see Numerics)."""

STOP_WORDS: frozenset[str] = frozenset("""
a about above after again against all am an and any are as at be because been before being
below between both but by can could did do does doing down during each few for from further had
has have having he her here hers herself him himself his how i if in into is it its itself just
me more most my myself no nor not now of off on once only or other our ours ourselves out over
own same she should so some such than that the their theirs them themselves then there these
they this those through to too under until up very was we were what when where which while who
whom why will with would you your yours yourself yourselves
's 're 've 'll 'd 'm n't
""".split())
"""Built-in English stop words (kept by ``keep_stopwords``): articles, pronouns, prepositions,
conjunctions, auxiliary verbs and common adverbs/determiners (close to NLTK's English list,
written out here so nothing is downloaded), plus the clitics the tokeniser splits off."""

_WORD = re.compile(WORD_PATTERN)
_TOKEN = re.compile(TOKEN_PATTERN)
_SEPARATOR = re.compile(r"([-'’])")
_IDENTIFIER = re.compile(r"[\d.:/@+]")  # a word with one of these inside is never split
_UP_TO_LAST_SPACE = re.compile(r".*\s", re.DOTALL)
_NOT_CLITIC = re.compile(r"n['’]t$", re.IGNORECASE)
_CLITIC = re.compile(r"['’](?:s|re|ve|ll|d|m)$", re.IGNORECASE)

# Kinds of word occurrences.
_SENSITIVE, _COMMON, _STOP, _OOV = 0, 1, 2, 3


class SanitizeError(ValueError):
    """Bad input or configuration of the sanitizer."""


class OOVError(SanitizeError):
    """A word is not in the embedding table and the policy is ``'error'``.

    Attributes:
        word: the word as written in the text.
        offset: its character offset in the text (or stream); ``None`` outside a text.
    """

    def __init__(self, word: str, offset: int | None = None) -> None:
        if offset is None:
            super().__init__(f"word {word!r} is not in the embedding table")
        else:
            super().__init__(f"word {word!r} at character {offset} is not in the embedding "
                             "table (out-of-vocabulary policy 'error'; use 'random' to replace "
                             "such words)")
        self.word = word
        self.offset = offset


class InputEncodingError(SanitizeError):
    """Bytes given to the sanitizer are not valid UTF-8."""


class Mechanism(StrEnum):
    """Which candidates a word may be replaced by (see the module docstring)."""

    SANTEXT = "santext"
    CUSTEXT = "custext"


class Utility(StrEnum):
    """Base similarity ``s(x, y)``, min-max normalised to ``u ∈ [0, 1]``."""

    EUCLIDEAN = "euclidean"
    COSINE = "cosine"


class OOVPolicy(StrEnum):
    """What happens to a word that is not in the table (see "What is released in the clear").

    ``random`` (the default) replaces it by a uniform candidate; ``error`` refuses the text;
    ``keep`` releases it verbatim (opt-in: a warning, and an infinite ``eps_total``)."""

    KEEP = "keep"
    ERROR = "error"
    RANDOM = "random"


def check_eps(eps: object) -> float:
    """``eps`` as a float if it is a finite number > 0, else :class:`SanitizeError`."""
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.number)):
        raise SanitizeError(f"eps must be a finite number > 0 (the privacy budget of one "
                            f"perturbed word), got {eps!r}")
    value = float(eps)
    if not math.isfinite(value) or value <= 0:
        raise SanitizeError(f"eps must be a finite number > 0 (the privacy budget of one "
                            f"perturbed word), got {eps!r}")
    return value


@dataclass(frozen=True)
class SanitizerConfig:
    """How the sanitizer chooses and draws candidates (``eps`` and the seed are per call).

    Attributes:
        mechanism: ``santext`` (every candidate) or ``custext`` (a group of ``top_k``).
        top_k: CusText group size ``K`` (>= 2; ignored by ``santext``).
        candidates: size of the candidate vocabulary: the first ``candidates`` table words that
            match :data:`WORD_PATTERN` (GloVe: the most frequent); ``None``: all of them. Every
            table word can be an *input* whatever this is. SanText caches a float32 table of
            this length per distinct (word, eps), so it sets memory and speed.
        utility: base similarity, ``euclidean`` or ``cosine``.
        keep_stopwords: emit stop words unchanged (not perturbed, no budget).
        stopwords: the stop-word list (lower-case).
        common_words: SanText+: the first ``common_words`` table rows are non-sensitive.
        common_p: SanText+: probability that a non-sensitive word is perturbed.
        oov: out-of-vocabulary policy: ``random`` (default: a uniform candidate, no budget),
            ``error``, or ``keep`` (opt-in: released in the clear, ``eps_total`` = inf).
        lowercase: look words up lower-cased (GloVe is lower-case).
        cache_mb: memory budget of the sampling-table cache (LRU), in MiB.
    """

    mechanism: Mechanism = Mechanism.SANTEXT
    top_k: int = 20
    candidates: int | None = 20_000
    utility: Utility = Utility.EUCLIDEAN
    keep_stopwords: bool = False
    stopwords: frozenset[str] = field(default=STOP_WORDS, repr=False)
    common_words: int = 0
    common_p: float = 1.0
    oov: OOVPolicy = OOVPolicy.RANDOM
    lowercase: bool = True
    cache_mb: float = 1024.0

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "mechanism", _enum(Mechanism, self.mechanism, "mechanism"))
        set_(self, "utility", _enum(Utility, self.utility, "utility"))
        set_(self, "oov", _enum(OOVPolicy, self.oov, "oov"))
        _check_int("top_k", self.top_k, minimum=2)
        if self.candidates is not None:
            _check_int("candidates", self.candidates, minimum=2)
        _check_int("common_words", self.common_words, minimum=0)
        if not (isinstance(self.common_p, (int, float)) and 0.0 <= self.common_p <= 1.0):
            raise SanitizeError(f"common_p must be a probability in [0, 1], got "
                                f"{self.common_p!r}")
        if not (isinstance(self.cache_mb, (int, float)) and self.cache_mb >= 0):
            raise SanitizeError(f"cache_mb must be a number >= 0, got {self.cache_mb!r}")
        set_(self, "stopwords", frozenset(self.stopwords))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready settings (the stop-word list by size)."""
        out = asdict(self)
        out["stopwords"] = len(self.stopwords)
        return {k: (str(v) if isinstance(v, StrEnum) else v) for k, v in out.items()}


@dataclass(frozen=True, slots=True)
class SanitizeReport:
    """Privacy budget and word counts of one sanitised document.

    ``n_words = n_perturbed + n_kept + n_oov``.

    Attributes:
        eps_per_word: budget of each perturbed word (``eps``).
        eps_total: ``eps_per_word * n_perturbed``: the document's budget by sequential
            composition over the perturbed words (out-of-vocabulary words replaced uniformly
            cost nothing; words released in the clear are not protected: see ``n_clear``).
            ``inf`` under the ``'keep'`` out-of-vocabulary policy: a release that copies
            out-of-vocabulary words verbatim honours no finite budget.
        n_words: words in the document (after clitic splitting).
        n_perturbed: words drawn from the mechanism (each costs ``eps``).
        n_kept: words emitted unchanged without a draw: stop words under ``keep_stopwords``
            and non-sensitive words the SanText+ coin left alone.
        n_oov: out-of-vocabulary words (replaced by a uniform candidate under ``'random'``,
            emitted unchanged under ``'keep'``).
        n_changed: perturbed words whose output differs from the input (utility diagnostic).
        mechanism: ``santext`` or ``custext``.
        oov_policy: the out-of-vocabulary policy applied.
        n_clear: words released in the clear (as written, without a draw): ``n_kept`` plus,
            under ``'keep'``, ``n_oov``.
    """

    eps_per_word: float
    eps_total: float
    n_words: int
    n_perturbed: int
    n_kept: int
    n_oov: int
    n_changed: int
    mechanism: str
    oov_policy: str
    n_clear: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields; an infinite ``eps_total`` is written as the string ``"inf"``
        (strict JSON has no infinity)."""
        out = asdict(self)
        out["eps_total"] = json_budget(self.eps_total)
        return out


def json_budget(eps: float) -> float | str:
    """A privacy budget for JSON: the number, or ``"inf"`` when it is unbounded."""
    return eps if math.isfinite(eps) else "inf"


@dataclass(frozen=True, slots=True)
class SanitizedText:
    """A sanitised document and its report."""

    text: str
    report: SanitizeReport


class Sanitizer:
    """Exponential-mechanism word sanitizer over an :class:`EmbeddingTable`.

    Build it once (the candidate matrix and, for CusText, the groups are precomputed) and call
    :meth:`sanitize` per document. Not thread-safe (the table cache is shared).

    Example::

        sanitizer = Sanitizer.glove(SanitizerConfig(mechanism="custext", top_k=20))
        result = sanitizer.sanitize("The patient lives in Boston.", eps=3.0, seed=0)
        result.text, result.report.eps_total
    """

    def __init__(self, table: EmbeddingTable, config: SanitizerConfig | None = None) -> None:
        self.table = table
        self.config = config or SanitizerConfig()
        cfg = self.config
        if cfg.oov is OOVPolicy.KEEP:
            logger.warning("out-of-vocabulary policy 'keep': words not in the table (names, "
                           "numbers, identifiers) are released in the clear and no finite "
                           "budget holds (eps_total is reported as inf)")
        word_ok = _WORD.fullmatch
        rows = list(itertools.islice((i for i, w in enumerate(table.words) if word_ok(w)),
                                     cfg.candidates))
        if len(rows) < 2:
            raise SanitizeError(f"embedding table {table.source!r} has {len(rows)} candidate "
                                f"word(s) matching {WORD_PATTERN!r}; at least 2 are needed")
        if cfg.mechanism is Mechanism.CUSTEXT and cfg.top_k > len(rows):
            raise SanitizeError(f"top_k={cfg.top_k} exceeds the {len(rows)} candidate words")
        self.candidate_rows = np.asarray(rows, dtype=np.int64)
        self.candidate_words: tuple[str, ...] = tuple(table.words[i] for i in rows)
        self._vectors = np.asarray(table.vectors)
        # candidate vectors, zero-padded to whole blocks (the padding never gets weight)
        self._n_cand = len(rows)
        self._cand = np.zeros((-(-len(rows) // BLOCK) * BLOCK, table.dim), dtype=DTYPE)
        self._cand[:len(rows)] = self._vectors[self.candidate_rows]
        self._cand_sq = np.einsum("ij,ij->i", self._cand, self._cand)
        self._cand_unit = self._cand / np.maximum(np.sqrt(self._cand_sq), _TINY)[:, None]
        # [-2 y, |y|^2, 1]: one product with [x, 1, |x|^2] gives |x - y|^2 (padding: |x|^2)
        self._cand_aug = np.concatenate([-2.0 * self._cand, self._cand_sq[:, None],
                                         np.ones((len(self._cand), 1), dtype=DTYPE)], axis=1)
        self._cand_aug[len(rows):, -2] = 0.0
        # words per table batch: TABLE_BATCH, fewer if a batch of SanText rows would pass 32 MiB
        self._batch = max(1, min(TABLE_BATCH, (32 << 20) // (4 * len(self._cand))))
        self._work: np.ndarray | None = None  # (batch, padded candidates) scratch
        self._row_to_cand = np.full(len(table), -1, dtype=np.int64)
        self._row_to_cand[self.candidate_rows] = np.arange(len(rows))
        # SanText tables live in pooled rows; rows of dropped tables are reused from the next
        # batch on (the current batch may still be sampling from them)
        self._pool = _RowPool(len(self._cand))
        self._dropped: list[np.ndarray] = []
        self._cache = _LRU(int(cfg.cache_mb * 2**20), self._drop)
        self._groups: list[np.ndarray] | None = None
        self._cand_group: np.ndarray | None = None
        self._extra_group: dict[int, int] = {}
        if cfg.mechanism is Mechanism.CUSTEXT:
            self._build_groups()

    # ----------------------------------------------------------------------------------------
    # constructors

    @classmethod
    def glove(cls, config: SanitizerConfig | None = None) -> Sanitizer:
        """A sanitizer over GloVe 6B 50d (:func:`fedcompress.data.embeddings.load_glove`)."""
        return cls(load_glove(), config)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any,
                   config: SanitizerConfig | None = None) -> Sanitizer:
        """A sanitizer over a model's own token embeddings (single-token words only; see
        :func:`fedcompress.data.embeddings.model_embedding_table`)."""
        return cls(model_embedding_table(model, tokenizer), config)

    # ----------------------------------------------------------------------------------------
    # public API

    def distribution(self, word: str, eps: float) -> tuple[tuple[str, ...], np.ndarray]:
        """The exact output distribution ``p(. | word)``: candidate words and float64
        probabilities (summing to 1). Raises :class:`OOVError` if ``word`` is not in the table.
        """
        eps = check_eps(eps)
        _warn_underflow(eps)
        key = self._key(word)
        row = self.table.index.get(key)
        if row is None:
            raise OOVError(word)
        members, weights, sizes = self._weights(np.array([row]), eps)
        w = weights[0, :sizes[0]].astype(np.float64)
        words = (self.candidate_words if members is None
                 else tuple(self.candidate_words[i] for i in members[0]))
        return words, w / w.sum()

    def group_of(self, word: str) -> tuple[str, ...]:
        """CusText: the output set of ``word`` (its group's candidate words)."""
        if self.config.mechanism is not Mechanism.CUSTEXT:
            raise SanitizeError("group_of() needs mechanism='custext'")
        row = self.table.index.get(self._key(word))
        if row is None:
            raise OOVError(word)
        return tuple(self.candidate_words[i] for i in self._members(np.array([row]))[0])

    def cache_info(self) -> dict[str, int]:
        """Sampling tables held in the cache: ``{"tables": n, "bytes": b, "max_bytes": m}``."""
        return {"tables": len(self._cache.data), "bytes": self._cache.bytes,
                "max_bytes": self._cache.max_bytes}

    def clear_cache(self) -> None:
        """Drop every cached sampling table (the CusText groups are kept)."""
        self._cache.clear()

    def _drop(self, table: _Table) -> None:
        if table.members is None:  # a SanText table: its row goes back to the pool
            self._dropped.append(table.weights.reshape(-1))

    def sanitize(self, text: str | bytes, *, eps: float, seed: int) -> SanitizedText:
        """Sanitise one document.

        Args:
            text: the document; ``bytes`` are decoded as UTF-8 (strictly). An empty or
                whitespace/punctuation-only text gives itself back with every count 0.
            eps: privacy budget per perturbed word (finite, > 0).
            seed: seed of the document's random choices (integer >= 0).

        Raises:
            ValueError: bad ``eps`` (:class:`SanitizeError`) or ``seed``;
                :class:`InputEncodingError` for bytes that are not UTF-8; :class:`OOVError`
                under the ``'error'`` policy. ``TypeError`` for anything but ``str``/``bytes``.
        """
        text = _decode(text)
        parts: list[str] = []
        report = self._run([text], parts.append, check_eps(eps),
                           np.random.default_rng(check_seed(seed)))
        return SanitizedText("".join(parts), report)

    def sanitize_many(self, texts: Iterable[str | bytes], *, eps: float,
                      seed: int) -> list[SanitizedText]:
        """Sanitise documents independently: document ``i`` draws from
        ``default_rng(SeedSequence(seed, spawn_key=(i,)))``, so its output does not depend on
        the other documents."""
        return list(self.iter_many(texts, eps=eps, seed=seed))

    def iter_many(self, texts: Iterable[str | bytes], *, eps: float,
                  seed: int) -> Iterator[SanitizedText]:
        """:meth:`sanitize_many`, one document at a time (``texts`` is read lazily)."""
        eps = check_eps(eps)
        seed = check_seed(seed)
        reports = []
        for i, text in enumerate(texts):
            rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(i,)))
            parts: list[str] = []
            report = self._run([_decode(text)], parts.append, eps, rng, warn=False)
            reports.append(report)
            yield SanitizedText("".join(parts), report)
        warn_clear(reports)  # once for all the documents

    def sanitize_stream(self, pieces: Iterable[str | bytes], write: Callable[[str], Any], *,
                        eps: float, seed: int) -> SanitizeReport:
        """Sanitise one long document given in pieces (e.g. the lines or blocks of a file),
        passing the output to ``write`` as it is produced; memory stays bounded. A piece may
        end inside a word. ``bytes`` pieces are decoded incrementally as UTF-8 (a multi-byte
        character may straddle pieces). The output equals ``sanitize("".join(pieces))``.
        """
        return self._run(_decode_stream(pieces), write, check_eps(eps),
                         np.random.default_rng(check_seed(seed)))

    # ----------------------------------------------------------------------------------------
    # the text pipeline

    def _run(self, pieces: Iterable[str], write: Callable[[str], Any], eps: float,
             rng: np.random.Generator, warn: bool = True) -> SanitizeReport:
        _warn_underflow(eps)
        run = _Run(self, write, eps, rng)
        for piece in pieces:
            run.feed(piece, final=False)
        run.feed("", final=True)
        cfg = self.config
        keep = cfg.oov is OOVPolicy.KEEP
        report = SanitizeReport(
            eps_per_word=eps, eps_total=math.inf if keep else eps * run.n_perturbed,
            n_words=run.n_words, n_perturbed=run.n_perturbed, n_kept=run.n_kept,
            n_oov=run.n_oov, n_changed=run.n_changed, mechanism=str(cfg.mechanism),
            oov_policy=str(cfg.oov), n_clear=run.n_kept + (run.n_oov if keep else 0))
        if warn:
            warn_clear([report])
        logger.debug("sanitised %d words: %d perturbed, %d kept, %d oov (eps %g, total %g)",
                     report.n_words, report.n_perturbed, report.n_kept, report.n_oov, eps,
                     report.eps_total)
        return report

    def _key(self, word: str) -> str:
        key = word.lower() if self.config.lowercase else word
        return key.replace("’", "'") if "’" in key else key

    def _split(self, word: str) -> list[tuple[str, bool, bool]]:
        """Pieces of an out-of-table word: (text, is_word, is_clitic). See the module doc:
        a trailing clitic is split off; an identifier (digit, ``.:/@+`` inside) stays whole;
        any other word is split at its inner ``-``/``'``."""
        if self._key(word) in self.table.index or not _SEPARATOR.search(word):
            return [(word, True, False)]
        clitic = _NOT_CLITIC.search(word) or _CLITIC.search(word)
        if clitic and clitic.start() > 0:
            return self._split(word[:clitic.start()]) + [(clitic.group(), True, True)]
        if _IDENTIFIER.search(word):
            return [(word, True, False)]
        return [(part, i % 2 == 0, False) for i, part in enumerate(_SEPARATOR.split(word))
                if part]

    # ----------------------------------------------------------------------------------------
    # the mechanism

    def _sample(self, rows: np.ndarray, uniforms: np.ndarray, eps: float) -> np.ndarray:
        """Candidate index drawn for each table row: inverse CDF of its cached table at the
        given uniforms, two-level (the block by the float64 running block sums, then the
        candidate by the float64 running sum inside the block), so that ``P(y) = w_y / Σ w``
        up to float64 rounding. Vectorised over the words of a batch of distinct rows."""
        out = np.empty(len(rows), dtype=np.int64)
        if not len(rows):
            return out
        unique, inverse = np.unique(rows, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        bounds = np.searchsorted(inverse[order], np.arange(len(unique) + 1))
        for first in range(0, len(unique), self._batch):
            tables = self._tables(unique[first:first + self._batch], eps)
            sel = order[bounds[first]:bounds[first + len(tables)]]  # words of these rows
            g = inverse[sel] - first
            blocks = np.array([len(t.block_cum) for t in tables])
            # running block sums, 0 in front, padded with the total
            cum = np.empty((len(tables), blocks.max() + 1))
            cum[:, 0] = 0.0
            for j, t in enumerate(tables):
                cum[j, 1:] = t.block_cum[-1]
                cum[j, 1:blocks[j] + 1] = t.block_cum
            word_cum = cum[g]
            target = uniforms[sel] * word_cum[:, -1]
            block = np.minimum(np.count_nonzero(word_cum[:, 1:] <= target[:, None], axis=1),
                               blocks[g] - 1)
            target -= word_cum[np.arange(len(sel)), block]
            weights = np.empty((len(sel), BLOCK), dtype=DTYPE)
            local = bounds[first:first + len(tables) + 1] - bounds[first]
            for j, t in enumerate(tables):
                at = slice(local[j], local[j + 1])  # g is sorted: row j's words are contiguous
                weights[at] = t.weights[block[at]]
            running = np.cumsum(weights, axis=1, dtype=np.float64)
            inside = np.minimum(np.count_nonzero(running <= target[:, None], axis=1), BLOCK - 1)
            sizes = np.array([t.n for t in tables])
            idx = np.minimum(block * BLOCK + inside, sizes[g] - 1)
            if tables[0].members is None:
                out[sel] = idx
            else:
                members = np.zeros((len(tables), sizes.max()), dtype=np.int64)
                for j, t in enumerate(tables):
                    members[j, :t.n] = t.members
                out[sel] = members[g, idx]
        return out

    def _tables(self, rows: np.ndarray, eps: float) -> list[_Table]:
        """Cached sampling tables of ``rows`` (the misses computed in one batch)."""
        self._pool.give(self._dropped)  # the previous batch is done with them
        self._dropped.clear()
        found = [self._cache.get((int(r), eps)) for r in rows]
        missing = [i for i, f in enumerate(found) if f is None]
        if missing:
            members, weights, sizes = self._weights(rows[missing], eps)
            if weights.shape[1] % BLOCK:  # CusText groups: pad to one block
                weights = np.pad(weights, ((0, 0), (0, -weights.shape[1] % BLOCK)))
            blocks = weights.reshape(len(missing), -1, BLOCK)
            block_cum = np.cumsum(blocks.sum(axis=2, dtype=np.float64), axis=1)
            for j, i in enumerate(missing):
                if members is None:
                    stored = self._pool.take().reshape(blocks.shape[1:])
                    stored[...] = blocks[j]
                else:
                    stored = blocks[j].copy()
                table = _Table(None if members is None else members[j], stored,
                               block_cum[j], int(sizes[j]))
                found[i] = table
                self._cache.put((int(rows[i]), eps), table,
                                table.weights.nbytes + table.block_cum.nbytes)
        return found  # type: ignore[return-value]

    def _weights(self, rows: np.ndarray,
                 eps: float) -> tuple[list[np.ndarray] | None, np.ndarray, np.ndarray]:
        """Unnormalised ``p(. | x)`` of the table rows ``x`` (at most ``self._batch``):
        the candidate indices of each row (``None``: all candidates, in order), a float32
        matrix of weights ``exp(eps (u - 1) / (2 Δu)) ∈ (0, 1]`` (row ``i`` valid up to
        ``sizes[i]``, then 0; for SanText a view of a scratch buffer that the next call
        overwrites) and ``sizes``."""
        x = np.asarray(self._vectors[rows], dtype=DTYPE)
        if self.config.mechanism is Mechanism.SANTEXT:
            if self._work is None:
                self._work = np.empty((self._batch, len(self._cand)), dtype=DTYPE)
            weights = self._santext_weights(x, eps, self._work[:len(rows)])
            return None, weights, np.full(len(rows), self._n_cand)
        members = self._members(rows)
        sizes = np.array([len(m) for m in members])
        padded = np.zeros((len(rows), sizes.max()), dtype=np.int64)
        valid = np.arange(padded.shape[1])[None, :] < sizes[:, None]
        padded[valid] = np.concatenate(members)
        if self.config.utility is Utility.COSINE:
            xn = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), _TINY)
            sim = np.einsum("bd,bkd->bk", xn, self._cand_unit[padded])
        else:
            sim = np.einsum("bd,bkd->bk", x, self._cand[padded])
            sim *= -2.0
            sim += self._cand_sq[padded]
            sim += np.einsum("ij,ij->i", x, x)[:, None]
            np.maximum(sim, 0.0, out=sim)
            np.sqrt(sim, out=sim)
            np.negative(sim, out=sim)
        return members, _exp_weights(sim, eps, valid=valid), sizes

    def _santext_weights(self, x: np.ndarray, eps: float, out: np.ndarray) -> np.ndarray:
        """:func:`_exp_weights` of ``x`` against every candidate, written into ``out`` (the hot
        path of SanText, in as few passes as possible). Euclidean: ``|x - y|^2`` comes from one
        matrix product; since ``sqrt`` is monotone, ``u - 1 = (d_min - d) / (d_max - d_min)``
        with ``d_min``, ``d_max`` taken on the squared distances."""
        n = self._n_cand
        if self.config.utility is Utility.COSINE:
            return _exp_weights(self._similarity(x, out=out), eps, n_valid=n)
        aug = np.concatenate([x, np.ones((len(x), 1), dtype=DTYPE),
                              np.einsum("ij,ij->i", x, x)[:, None]], axis=1)
        d = np.matmul(aug, self._cand_aug.T, out=out)
        body = d[:, :n]
        d_min = np.sqrt(np.maximum(body.min(axis=1, keepdims=True), 0.0))
        d_max = np.sqrt(np.maximum(body.max(axis=1, keepdims=True), 0.0))
        width = d_max - d_min
        np.maximum(d, 0.0, out=d)
        np.sqrt(d, out=d)
        np.subtract(d_min, d, out=d)                                       # (u - 1) * width
        d *= (eps / (2.0 * DELTA_U)) / np.where(width > 0, width, np.inf)  # flat row: u = 1
        with np.errstate(over="ignore"):  # only the padding can exceed 0
            np.exp(d, out=d)
        d[:, n:] = 0.0
        return d

    def _similarity(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Base similarity ``s(x, y)`` (float32) of rows ``x`` to every candidate, padding
        included (columns from ``self._n_cand`` on are meaningless)."""
        return self._similarity_to(x, self._cand, self._cand_sq, self._cand_unit, out)

    def _similarity_to(self, x: np.ndarray, cand: np.ndarray, sq: np.ndarray,
                       unit: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``s(x, y)`` for candidate vectors ``cand`` (squared norms ``sq``, unit rows
        ``unit``): ``-||x - y||`` from ``|x|^2 + |y|^2 - 2 x.y``, or the cosine."""
        if self.config.utility is Utility.COSINE:
            xn = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), _TINY)
            return np.matmul(xn, unit.T, out=out)
        d2 = np.matmul(x, cand.T, out=out)
        d2 *= -2.0
        d2 += sq[None, :]
        d2 += np.einsum("ij,ij->i", x, x)[:, None]
        np.maximum(d2, 0.0, out=d2)
        np.sqrt(d2, out=d2)
        np.negative(d2, out=d2)
        return d2

    # ----------------------------------------------------------------------------------------
    # CusText groups

    def _build_groups(self) -> None:
        """Greedy CusText grouping of the candidates (see the module docstring)."""
        start = time.perf_counter()
        k = self.config.top_k
        n = self._n_cand
        group = np.full(n, -1, dtype=np.int64)
        groups: list[np.ndarray] = []
        # ungrouped candidates (their indices and vectors), compacted as groups are formed
        pool, cand, sq, unit = np.arange(n), self._cand[:n], self._cand_sq[:n], self._cand_unit[:n]
        alive = np.ones(n, dtype=bool)
        left = n
        for anchor in range(n):
            if group[anchor] >= 0:
                continue
            if left < 2 * k:
                members = np.flatnonzero(group < 0)
            else:
                if left < len(pool) // 2:
                    pool, cand, sq, unit = pool[alive], cand[alive], sq[alive], unit[alive]
                    alive = np.ones(len(pool), dtype=bool)
                sim = self._similarity_to(self._cand[anchor:anchor + 1], cand, sq, unit)[0]
                sim[~alive] = -np.inf
                sim[np.searchsorted(pool, anchor)] = np.inf  # the anchor is in its own group
                chosen = np.argpartition(-sim, k - 1)[:k]
                alive[chosen] = False
                members = np.sort(pool[chosen])
            group[members] = len(groups)
            groups.append(members)
            left -= len(members)
            if left == 0:
                break
        self._groups, self._cand_group = groups, group
        logger.info("CusText: %d candidates in %d groups of %d-%d words (top_k %d) in %.1fs",
                    n, len(groups), min(map(len, groups)), max(map(len, groups)), k,
                    time.perf_counter() - start)

    def _members(self, rows: np.ndarray) -> list[np.ndarray]:
        """CusText output sets (candidate indices) of table rows; a row outside the candidates
        takes the group of its nearest candidate (computed once, in one batch)."""
        assert self._groups is not None and self._cand_group is not None
        cands = self._row_to_cand[rows]
        new = [int(r) for r, c in zip(rows, cands) if c < 0 and int(r) not in self._extra_group]
        for first in range(0, len(new), self._batch):
            batch = np.array(new[first:first + self._batch])
            x = np.asarray(self._vectors[batch], dtype=DTYPE)
            nearest = np.argmax(self._similarity(x)[:, :self._n_cand], axis=1)
            self._extra_group.update(zip(batch.tolist(), self._cand_group[nearest].tolist()))
        return [self._groups[int(self._cand_group[c]) if c >= 0 else self._extra_group[int(r)]]
                for r, c in zip(rows, cands)]


def warn_clear(reports: Iterable[SanitizeReport]) -> int:
    """Log a warning naming how many out-of-vocabulary words ``reports`` released in the clear
    (the ``'keep'`` policy); return that count."""
    reports = list(reports)
    clear = sum(r.n_oov for r in reports if r.oov_policy == OOVPolicy.KEEP)
    if clear:
        logger.warning("%d out-of-vocabulary word(s) in %d document(s) released in the clear "
                       "(out-of-vocabulary policy 'keep'): no finite budget holds "
                       "(eps_total = inf)", clear, len(reports))
    return clear


def release_notes(config: SanitizerConfig, *, eps: float, words: int, perturbed: int,
                  kept: int, oov: int, eps_document_max: float,
                  unit: str = "document") -> str:
    """Markdown for a report, next to the results: the guarantee of a release (``eps`` per
    perturbed word, the largest budget composed over one ``unit``) and every kind of thing the
    release shows in the clear, with its count here and why (see the module docstring)."""
    keep_oov = config.oov is OOVPolicy.KEEP
    bound = (f"**none**: {oov} out-of-vocabulary word(s) released verbatim (`oov = keep`)"
             if keep_oov else f"{eps_document_max:g} at most per {unit}")
    oov_row = (f"{oov} (**released verbatim**: `oov = keep`, no finite budget)" if keep_oov
               else f"none ({oov} replaced by a uniformly drawn candidate, no budget)"
               if config.oov is OOVPolicy.RANDOM else "none (`oov = error`)")
    rows = [
        ["out-of-vocabulary words (names, numbers, codes, rare words)", oov_row,
         "the default replaces them: a uniform draw is the mechanism at eps 0"],
        ["digits and identifiers (account/phone numbers, e-mails, URLs, codes)",
         "none: each is one word, perturbed or replaced whole",
         "never split, so neither inner punctuation nor group count shows"],
        ["stop words", f"{kept} (`keep_stopwords`)" if config.keep_stopwords
         else "none (perturbed)", "opt-in: function words carry no name or number, but do "
         "carry pronoun gender and negation"],
        ["SanText+ non-sensitive words not drawn",
         "counted with stop words" if config.common_words and config.keep_stopwords
         else f"{kept} (`common_words = {config.common_words}`)" if config.common_words
         else "none", "opt-in (`common_words`)"],
        ["number and positions of words", f"yes ({words} words)",
         "inherent to a word-level mechanism"],
        ["punctuation and whitespace", "yes",
         "a small public alphabet carrying no word; it shows the shape of the text"],
    ]
    return "\n".join([
        f"Exponential mechanism ({config.mechanism}, {config.utility} utility): each perturbed "
        f"word is {eps:g}-DP; {perturbed} of {words} words perturbed; composed budget: {bound}. "
        "The guarantee covers the perturbed words only. Released in the clear:",
        "",
        "| what | here | why |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
    ])


def sanitize_file(sanitizer: Sanitizer, source: str | Path, target: str | Path, *, eps: float,
                  seed: int, field: str = "text") -> list[SanitizeReport]:
    """Sanitise a file into ``target``; return one report per document.

    * ``.jsonl``: every record (a JSON object per line) is a document: its string ``field`` is
      replaced by the sanitised text, the other fields are copied. Record ``i`` draws from
      ``default_rng(SeedSequence(seed, spawn_key=(i,)))``, as in :meth:`Sanitizer.sanitize_many`.
    * anything else: the whole file is one document, read as UTF-8 in blocks of 1 MiB and
      written as it is sanitised (memory stays bounded; line endings are kept).

    Raises:
        SanitizeError: a record is not an object or lacks a string ``field`` (file and line
            named); :class:`InputEncodingError` if the file is not UTF-8.
    """
    source, target = Path(source), Path(target)
    eps, seed = check_eps(eps), check_seed(seed)
    if source.suffix != ".jsonl":
        with source.open("rb") as src, target.open("w", encoding="utf-8", newline="") as dst:
            blocks = iter(lambda: src.read(1 << 20), b"")
            return [sanitizer.sanitize_stream(blocks, dst.write, eps=eps, seed=seed)]

    def checked() -> Iterator[tuple[dict[str, Any], str]]:
        try:
            for line, record in read_jsonl(source, SanitizeError):
                text = record.get(field)
                if not isinstance(text, str):
                    raise SanitizeError(f"{source}:{line}: field {field!r} must be a string, "
                                        f"got {text!r:.80}")
                yield record, text
        except UnicodeDecodeError:
            data = source.read_bytes()  # decode the whole file again for the exact offset
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as err:
                raise InputEncodingError(f"{source}: {_encoding_message(data, err, 0)}") from None
            raise  # pragma: no cover - the second decode fails like the first

    records, texts = itertools.tee(checked())
    reports = []
    with target.open("w", encoding="utf-8", newline="\n") as dst:
        results = sanitizer.iter_many((text for _, text in texts), eps=eps, seed=seed)
        for (record, _), result in zip(records, results):
            dst.write(dumps_line({**record, field: result.text}) + "\n")
            reports.append(result.report)
    return reports


class _Run:
    """State of one sanitised document: buffered words of the current chunk and counts."""

    def __init__(self, sanitizer: Sanitizer, write: Callable[[str], Any], eps: float,
                 rng: np.random.Generator) -> None:
        self.s = sanitizer
        self.cfg = sanitizer.config
        self.write = write
        self.eps = eps
        self.rng = rng
        self.index = sanitizer.table.index
        self.stop = self.cfg.stopwords if self.cfg.keep_stopwords else frozenset()
        self.carry = ""      # the tail of the stream not yet tokenised (may continue a word)
        self.offset = 0      # characters of the stream before ``carry``
        self.parts: list[str] = []
        self.slots: list[int] = []   # index in parts of each word
        self.rows: list[int] = []    # table row (-1: out of vocabulary)
        self.kinds: list[int] = []
        self.clitic: list[bool] = []
        self.n_words = self.n_perturbed = self.n_kept = self.n_oov = self.n_changed = 0

    def feed(self, text: str, final: bool) -> None:
        buf = self.carry + text if self.carry else text
        if final:
            cut = len(buf)
        else:
            # no word spans whitespace, so everything up to the last whitespace tokenises the
            # same whatever follows; the rest waits for the next piece
            space = _UP_TO_LAST_SPACE.match(buf)
            cut = space.end() if space is not None else 0
        pos = 0
        for match in _TOKEN.finditer(buf, 0, cut):
            self._word(buf, pos, match)
            pos = match.end()
        self.parts.append(buf[pos:cut])
        self.carry = buf[cut:]
        self.offset += cut
        if final:
            self._flush()
        elif len(self.rows) >= CHUNK_WORDS:
            self._flush()

    def _word(self, buf: str, pos: int, match: re.Match[str]) -> None:
        parts = self.parts
        parts.append(buf[pos:match.start()])
        word = match.group()
        key = word.lower() if self.cfg.lowercase else word
        if "’" in key:
            key = key.replace("’", "'")
        if key in self.stop:
            self._add(word, -1, _STOP, False)
        elif (row := self.index.get(key)) is not None:
            self._add(word, row, _COMMON if row < self.cfg.common_words else _SENSITIVE, False)
        else:
            at = self.offset + match.start()  # stream offset of the piece
            for piece, is_word, is_clitic in self.s._split(word):
                at += len(piece)
                if not is_word:
                    parts.append(piece)
                    continue
                key = self.s._key(piece)
                row = self.index.get(key)
                if key in self.stop:
                    self._add(piece, -1, _STOP, is_clitic)
                elif row is None:
                    if self.cfg.oov is OOVPolicy.ERROR:
                        raise OOVError(piece, at - len(piece))
                    self._add(piece, -1, _OOV, is_clitic)
                else:
                    kind = _COMMON if row < self.cfg.common_words else _SENSITIVE
                    self._add(piece, row, kind, is_clitic)
        if len(self.rows) >= CHUNK_WORDS:
            self._flush()

    def _add(self, word: str, row: int, kind: int, clitic: bool) -> None:
        self.slots.append(len(self.parts))
        self.parts.append(word)
        self.rows.append(row)
        self.kinds.append(kind)
        self.clitic.append(clitic)

    def _flush(self) -> None:
        """Draw the outputs of the buffered words (vectorised) and write the text so far."""
        n = len(self.rows)
        if n:
            rows = np.asarray(self.rows, dtype=np.int64)
            kinds = np.asarray(self.kinds, dtype=np.int8)
            uniforms = self.rng.random((n, 2))  # (SanText+ coin, sample) per word, text order
            perturb = (kinds == _SENSITIVE) | ((kinds == _COMMON)
                                               & (uniforms[:, 0] < self.cfg.common_p))
            where = np.flatnonzero(perturb)
            chosen = self.s._sample(rows[where], uniforms[where, 1], self.eps)
            self.n_changed += int(np.count_nonzero(self.s.candidate_rows[chosen] != rows[where]))
            oov = np.flatnonzero(kinds == _OOV)
            if self.cfg.oov is OOVPolicy.RANDOM and len(oov):
                n_cand = len(self.s.candidate_rows)
                where = np.r_[where, oov]
                chosen = np.r_[chosen, np.minimum((uniforms[oov, 1] * n_cand).astype(np.int64),
                                                  n_cand - 1)]
            words = self.s.candidate_words
            same = self.s.candidate_rows[chosen] == rows[where]
            for i, c, unchanged in zip(where.tolist(), chosen.tolist(), same.tolist()):
                # a clitic replaced by another word becomes a word of its own
                spaced = self.clitic[i] and not unchanged
                self.parts[self.slots[i]] = (" " + words[c]) if spaced else words[c]
            n_perturbed = int(np.count_nonzero(perturb))
            self.n_words += n
            self.n_perturbed += n_perturbed
            self.n_oov += len(oov)
            self.n_kept += n - n_perturbed - len(oov)
        self.write("".join(self.parts))
        self.parts.clear()
        self.slots.clear()
        self.rows.clear()
        self.kinds.clear()
        self.clitic.clear()


# --------------------------------------------------------------------------------------------
# helpers

_TINY = np.finfo(DTYPE).tiny


class _Table(NamedTuple):
    """Sampling table of one (input word, eps): weights in blocks and their running sums."""

    members: np.ndarray | None  # candidate index of each weight (None: all candidates)
    weights: np.ndarray         # (blocks, BLOCK) float32, zero-padded
    block_cum: np.ndarray       # (blocks,) float64 running sum of the block sums
    n: int                      # weights before the padding


def _exp_weights(similarity: np.ndarray, eps: float, *, valid: np.ndarray | None = None,
                 n_valid: int | None = None) -> np.ndarray:
    """``w(x, y) = exp(eps * (u(x, y) - 1) / (2 Δu))`` row by row, in place (float32), where
    ``u = (s - min s) / (max s - min s)`` over the row's valid candidates (the mask ``valid``,
    or the first ``n_valid`` columns), so ``u ∈ [0, 1]``, ``Δu = 1`` and
    ``w ∈ [e^{-eps/2}, 1]``; ``u = 1`` for every candidate of a row whose similarities are all
    equal. ``p(y | x) = w(x, y) / Σ_y' w(x, y')`` is the exponential mechanism (the constant
    factor ``e^{-eps/2}`` cancels). Invalid entries get weight 0."""
    if valid is not None:
        hi = np.where(valid, similarity, -np.inf).max(axis=1, keepdims=True)
        lo = np.where(valid, similarity, np.inf).min(axis=1, keepdims=True)
        similarity[~valid] = np.broadcast_to(lo, similarity.shape)[~valid]
    else:
        body = similarity if n_valid is None else similarity[:, :n_valid]
        hi = body.max(axis=1, keepdims=True)
        lo = body.min(axis=1, keepdims=True)
        if n_valid is not None:
            similarity[:, n_valid:] = lo  # keeps the padding's exponent finite
    width = hi - lo
    scale = (eps / (2.0 * DELTA_U)) / np.where(width > 0, width, np.inf)  # flat row: u = 1
    similarity -= hi        # = (u - 1) * width
    similarity *= scale     # = eps (u - 1) / 2, in [-eps/2, 0]
    np.exp(similarity, out=similarity)
    if valid is not None:
        similarity[~valid] = 0.0
    elif n_valid is not None:
        similarity[:, n_valid:] = 0.0
    return similarity


class _LRU:
    """Least-recently-used cache with a byte budget; ``on_drop(value)`` is called for every
    value evicted, cleared or refused (larger than the budget)."""

    def __init__(self, max_bytes: int, on_drop: Callable[[Any], None]) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.data: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self.on_drop = on_drop

    def get(self, key: Any) -> Any:
        item = self.data.get(key)
        if item is None:
            return None
        self.data.move_to_end(key)
        return item[0]

    def put(self, key: Any, value: Any, nbytes: int) -> None:
        if nbytes > self.max_bytes:
            self.on_drop(value)
            return
        self.data[key] = (value, nbytes)
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            _, (dropped, freed) = self.data.popitem(last=False)
            self.bytes -= freed
            self.on_drop(dropped)

    def clear(self) -> None:
        for value, _ in self.data.values():
            self.on_drop(value)
        self.data.clear()
        self.bytes = 0


class _RowPool:
    """Fixed-length float32 rows carved from anonymous memory maps populated in one system call
    (``MAP_POPULATE``, Linux): writing a table into fresh memory otherwise page-faults 4 KiB at a
    time, which costs about as much as computing it. Rows given back are reused."""

    MAP_BYTES = 16 * 2**20

    def __init__(self, length: int) -> None:
        self.length = length
        self.free: list[np.ndarray] = []

    def take(self) -> np.ndarray:
        if not self.free:
            row_bytes = self.length * np.dtype(DTYPE).itemsize
            count = max(1, self.MAP_BYTES // row_bytes)
            size = count * row_bytes
            if hasattr(mmap, "MAP_POPULATE"):
                buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                   | mmap.MAP_POPULATE)
                rows = np.frombuffer(buffer, dtype=DTYPE).reshape(count, self.length)
            else:  # pragma: no cover - not Linux
                rows = np.empty((count, self.length), dtype=DTYPE)
            self.free.extend(rows)
        return self.free.pop()

    def give(self, rows: Iterable[np.ndarray]) -> None:
        self.free.extend(rows)


_WARNED_EPS: set[float] = set()


def _warn_underflow(eps: float) -> None:
    if eps > EPS_UNDERFLOW and eps not in _WARNED_EPS:
        _WARNED_EPS.add(eps)
        logger.warning("eps=%g > %g: the weights of the farthest candidates, e^(-eps/2), may "
                       "underflow float32 to 0 and lose the e^eps guarantee", eps,
                       EPS_UNDERFLOW)


def _decode(text: object) -> str:
    if isinstance(text, str):
        return text
    if isinstance(text, (bytes, bytearray, memoryview)):
        data = bytes(text)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InputEncodingError(_encoding_message(data, err, 0)) from err
    raise TypeError(f"text must be str or UTF-8 bytes, got {type(text).__name__}")


def _decode_stream(pieces: Iterable[str | bytes]) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    consumed = 0  # bytes given to the decoder before the current piece
    for piece in pieces:
        if isinstance(piece, str):
            yield piece
            continue
        data = bytes(_check_bytes(piece))
        pending = len(decoder.getstate()[0])
        try:
            yield decoder.decode(data)
        except UnicodeDecodeError as err:
            raise InputEncodingError(_encoding_message(err.object, err,
                                                       consumed - pending)) from err
        consumed += len(data)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:
        raise InputEncodingError(_encoding_message(err.object, err,
                                                   consumed - len(err.object))) from err


def _check_bytes(piece: object) -> bytes | bytearray | memoryview:
    if not isinstance(piece, (bytes, bytearray, memoryview)):
        raise TypeError(f"pieces must be str or UTF-8 bytes, got {type(piece).__name__}")
    return piece


def _encoding_message(data: bytes, err: UnicodeDecodeError, base: int) -> str:
    bad = data[err.start:err.end]
    return (f"text is not valid UTF-8: byte(s) {bad.hex(' ')} at byte offset {base + err.start} "
            f"({err.reason}); decode it with its real encoding and pass a str")


def _enum(cls: type[StrEnum], value: object, name: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)  # type: ignore[attr-defined]
        raise SanitizeError(f"{name} must be one of {choices}, got {value!r}") from None


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise SanitizeError(f"{name} must be an integer >= {minimum}, got {value!r}")
