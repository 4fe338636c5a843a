"""The sanitizer's settings (mechanism, candidates, utility, out-of-vocabulary policy, ...)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from fedcompress.privacy.sanitize.errors import SanitizeError, _check_int, _enum
from fedcompress.privacy.sanitize.mechanism import Mechanism, Utility

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


class OOVPolicy(StrEnum):
    """What happens to a word that is not in the table (see "What is released in the clear").

    ``random`` (the default) replaces it by a uniform candidate; ``error`` refuses the text;
    ``keep`` releases it verbatim (opt-in: a warning, and an infinite ``eps_total``)."""

    KEEP = "keep"
    ERROR = "error"
    RANDOM = "random"


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
