"""What a release cost and what it showed: per-document reports, the clear-release warning,
and the report section that lists the guarantee next to everything released in the clear.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from fedcompress.privacy.sanitize.config import OOVPolicy, SanitizerConfig

logger = logging.getLogger(__name__)


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
