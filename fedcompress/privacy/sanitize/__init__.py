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
---------------------------------------------
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
up to whitespace, trailing punctuation left out), or letters, digits, ``_`` and combining marks
joined by inner ``-``, ``'``, ``’``, ``.``, ``:``, ``/``, ``@`` or ``+`` (so
``zk1977@mail.com`` and ``4417-1234-5678-9113`` are one word each); everything between words
(whitespace, punctuation) is copied unchanged, so the output keeps the layout of the input. A
combining mark (a Devanagari or Thai vowel sign, a virama, a decomposed accent such as U+0301,
a zero-width joiner) is always part of the word it follows, so it goes through the mechanism
with that word and is never copied to the output; a mark with no letter before it is a word of
its own (out of vocabulary). A word is looked up in NFC (a decomposed ``e`` + U+0301 is the
table's ``é``), lower-cased (GloVe is lower-case; ``lowercase=False`` for cased tables) with
``’`` read as ``'``. A word not in the table is split, Penn-Treebank style, into stem +
clitic (``don't`` -> ``do`` + ``n't``, ``john's`` -> ``john`` + ``'s``); an identifier (a
digit, ``.``, ``:``, ``/``, ``@`` or ``+`` inside, or a URL) is otherwise kept whole; any
other word is split at its inner ``-``/``'`` (kept as punctuation: ``lion-xyzzy`` ->
``lion`` - ``xyzzy``), and each piece is looked up. Outputs are table words (lower-case for
GloVe); a perturbed clitic is written as a separate word (``do n't`` -> ``did not``). Only
table words matching :data:`WORD_PATTERN` are candidates, so a word is never replaced by
punctuation or an identifier-shaped string.
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

from fedcompress.data.embeddings import DTYPE
from fedcompress.privacy.sanitize.config import STOP_WORDS, OOVPolicy, SanitizerConfig
from fedcompress.privacy.sanitize.errors import InputEncodingError, OOVError, SanitizeError
from fedcompress.privacy.sanitize.mechanism import DELTA_U, Mechanism, Utility, check_eps
from fedcompress.privacy.sanitize.report import (
    SanitizedText,
    SanitizeReport,
    json_budget,
    release_notes,
    warn_clear,
)
from fedcompress.privacy.sanitize.sanitizer import Sanitizer, sanitize_file
from fedcompress.privacy.sanitize.text import TOKEN_PATTERN, WORD_PATTERN

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
    "warn_clear",
]
