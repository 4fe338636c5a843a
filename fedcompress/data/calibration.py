"""Calibration windows for pruning, Wanda / SparseGPT style.

A split's documents are joined with :func:`~fedcompress.data.corpora.corpus_text`, the joined
text is tokenized ONCE, and ``n`` windows of ``seqlen`` consecutive tokens are cut at independent
uniform random starts (windows may overlap, as in Wanda).

Choices, and why:

* **No special tokens.** The text is tokenized with ``add_special_tokens=False`` and no BOS is
  prepended to the windows. A window is a slice of one long token stream; a BOS added to the
  stream would only land in a window that happens to start at position 0, making that one window
  different in a tokenizer-dependent way. Wanda's windows likewise start mid-stream without BOS.
  The same rule (raw slices, no BOS) should be used by the perplexity evaluation.
* **Start positions** are drawn uniformly from ``[0, len(tokens) - seqlen - 1]`` (Wanda's
  ``random.randint(0, len - seqlen - 1)``), so the stream needs at least ``seqlen + 1`` tokens.
* **Randomness** comes only from ``numpy.random.default_rng(seed)`` (or a generator derived
  from ``(seed, source name)`` in the mixed variant); the global RNGs are never touched.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedcompress.data.corpora import Document, corpus_text
from fedcompress.data.errors import (
    EmptyCorpusError,
    InvalidParameterError,
    NotEnoughTokensError,
    check_positive_int,
    check_seed,
)
from fedcompress.data.seeding import derived_rng

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "calibration_windows",
    "mixed_calibration_windows",
    "sample_windows",
    "tokenize_corpus",
]

logger = logging.getLogger(__name__)


def tokenize_corpus(tokenizer: PreTrainedTokenizerBase, docs: Sequence[Document]) -> torch.Tensor:
    """Token ids of ``corpus_text(docs)`` as a 1-D ``torch.long`` tensor, without special tokens.

    Raises:
        EmptyCorpusError: ``docs`` is empty or tokenizes to no tokens.
    """
    text = corpus_text(docs)
    # verbose=False: the stream is longer than model_max_length on purpose; no warning needed.
    encoded = tokenizer(
        text, add_special_tokens=False, return_attention_mask=False, verbose=False
    )
    ids = torch.tensor(encoded["input_ids"], dtype=torch.long)
    if ids.ndim != 1:
        raise InvalidParameterError(
            f"tokenizer returned input_ids of shape {tuple(ids.shape)}; expected a flat list"
        )
    if ids.numel() == 0:
        raise EmptyCorpusError(
            f"{len(docs)} documents ({len(text)} characters) tokenized to zero tokens"
        )
    return ids


def sample_windows(
    token_ids: torch.Tensor, n: int, seqlen: int, rng: np.random.Generator
) -> torch.Tensor:
    """Cut ``n`` windows of ``seqlen`` tokens from the 1-D stream ``token_ids``.

    Starts are drawn (with replacement) uniformly from ``[0, len - seqlen - 1]`` with ``rng``.

    Returns:
        A ``torch.long`` tensor of shape ``[n, seqlen]``.

    Raises:
        InvalidParameterError: ``n`` or ``seqlen`` is not a positive integer, or ``token_ids``
            is not 1-D.
        NotEnoughTokensError: the stream has fewer than ``seqlen + 1`` tokens.
    """
    n = check_positive_int("n", n)
    seqlen = check_positive_int("seqlen", seqlen)
    if token_ids.ndim != 1:
        raise InvalidParameterError(
            f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}"
        )
    total = int(token_ids.numel())
    if total < seqlen + 1:
        raise NotEnoughTokensError(
            f"the corpus has {total} tokens; windows of seqlen={seqlen} need at least "
            f"{seqlen + 1} (use a shorter seqlen or a larger split)"
        )
    starts = rng.integers(0, total - seqlen, size=n)  # high is exclusive: max start total-seqlen-1
    offsets = torch.arange(seqlen, dtype=torch.long)
    index = torch.from_numpy(starts.astype(np.int64)).unsqueeze(1) + offsets
    return token_ids.to(torch.long)[index]


def calibration_windows(
    tokenizer: PreTrainedTokenizerBase,
    docs: Sequence[Document],
    n: int,
    seqlen: int,
    seed: int,
) -> torch.Tensor:
    """``n`` random windows of ``seqlen`` tokens from ``docs`` (Wanda-style calibration data).

    Args:
        tokenizer: a Hugging Face tokenizer.
        docs: the documents of one split (see :func:`~fedcompress.data.corpora.load_corpus`).
        n: number of windows, >= 1.
        seqlen: tokens per window, >= 1.
        seed: seed of ``numpy.random.default_rng``; the same seed gives the same windows.

    Returns:
        A ``torch.long`` tensor of shape ``[n, seqlen]``.

    Raises:
        InvalidParameterError: ``n``, ``seqlen`` or ``seed`` is invalid.
        EmptyCorpusError: ``docs`` is empty.
        NotEnoughTokensError: the corpus has fewer than ``seqlen + 1`` tokens.
    """
    n = check_positive_int("n", n)
    seqlen = check_positive_int("seqlen", seqlen)
    rng = np.random.default_rng(check_seed(seed))
    ids = tokenize_corpus(tokenizer, docs)
    logger.debug("calibration stream: %d tokens; cutting %d x %d", ids.numel(), n, seqlen)
    return sample_windows(ids, n, seqlen, rng)


def mixed_calibration_windows(
    tokenizer: PreTrainedTokenizerBase,
    sources: Mapping[str, Sequence[Document]],
    n_per_source: int | Mapping[str, int],
    seqlen: int,
    seed: int,
) -> tuple[torch.Tensor, list[str]]:
    """Windows from several corpora, each labelled with the corpus it came from.

    Each source is tokenized separately (windows never straddle two corpora) and sampled with its
    own generator derived from ``(seed, source name)``, so a source's windows do not change when
    other sources are added, removed or reordered. The result lists the windows source by source,
    in the mapping's order; feed ``sources`` to
    :func:`~fedcompress.data.partition.dirichlet_partition` as ``labels`` for label skew.

    Args:
        tokenizer: a Hugging Face tokenizer.
        sources: source name -> documents, e.g. ``{"wiki": docs, "shakespeare": docs}``.
        n_per_source: windows per source, one number for all or a mapping with every source.
        seqlen: tokens per window.
        seed: base seed.

    Returns:
        ``(windows, labels)``: a ``[total, seqlen]`` long tensor and the source name of each row.

    Raises:
        InvalidParameterError: no sources, a bad count, or ``n_per_source`` not covering exactly
            the sources.
        EmptyCorpusError, NotEnoughTokensError: as :func:`calibration_windows`, per source.
    """
    if not sources:
        raise InvalidParameterError("sources must name at least one corpus, got an empty mapping")
    seqlen = check_positive_int("seqlen", seqlen)
    seed = check_seed(seed)
    if isinstance(n_per_source, Mapping):
        if set(n_per_source) != set(sources):
            raise InvalidParameterError(
                f"n_per_source has keys {sorted(n_per_source)}; expected exactly the sources "
                f"{sorted(sources)}"
            )
        counts = {name: check_positive_int(f"n_per_source[{name!r}]", n_per_source[name])
                  for name in sources}
    else:
        count = check_positive_int("n_per_source", n_per_source)
        counts = {name: count for name in sources}

    blocks: list[torch.Tensor] = []
    labels: list[str] = []
    for name, docs in sources.items():
        try:
            ids = tokenize_corpus(tokenizer, docs)
            windows = sample_windows(ids, counts[name], seqlen, derived_rng(seed, name))
        except (EmptyCorpusError, NotEnoughTokensError) as exc:
            raise type(exc)(f"source {name!r}: {exc}") from exc
        blocks.append(windows)
        labels.extend([name] * counts[name])
    return torch.cat(blocks, dim=0), labels
