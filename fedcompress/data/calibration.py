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
* **A cache of token streams** (``cache``, e.g. a site's cache folder): tokenizing a corpus is
  the slow part (seconds for the bundled wiki split), cutting windows is not. A stream is kept
  as ``<key>.npy``, the key a sha256 of the exact text tokenized and of the tokenizer (its class,
  settings and serialized vocabulary and rules), so an edited data file or another tokenizer
  never meets a stale stream; the windows are cut from it as without the cache.
* **Streams in memory**: the last :data:`MEMORY_STREAMS` streams a process tokenized (or read
  from its cache), under the same key, so that a process that cuts windows from one corpus many
  times (a bench's cells, a site's messages, a test suite) tokenizes it once. A stream stays in
  the process that read the text (a site's own), and a caller gets its own copy.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
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
    "tokenizer_fingerprint",
]

logger = logging.getLogger(__name__)


#: Part of every cache key: bump it when the tokenization call below changes.
_TOKENS_FORMAT = "tokenize_corpus v1: add_special_tokens=False"


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """A sha256 of everything that decides how ``tokenizer`` splits text: its class, its
    settings and its serialized backend (vocabulary, merges, normalizer, pre-tokenizer, added
    tokens), with the transformers and tokenizers versions; None for a tokenizer without a
    serializable backend (never cached)."""
    import importlib.metadata

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    digest = hashlib.sha256()
    settings = {k: v for k, v in getattr(tokenizer, "init_kwargs", {}).items()
                if isinstance(v, (str, int, float, bool, type(None)))}
    for part in (_TOKENS_FORMAT, type(tokenizer).__module__, type(tokenizer).__qualname__,
                 repr(sorted(settings.items())),
                 repr(getattr(tokenizer, "split_special_tokens", None)),
                 importlib.metadata.version("transformers"),
                 importlib.metadata.version("tokenizers"), backend.to_str()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


#: Token streams a process keeps in memory, the most recently used (see the module's notes).
MEMORY_STREAMS = 4
_streams: OrderedDict[str, torch.Tensor] = OrderedDict()
_streams_lock = threading.Lock()


def _remember(key: str, ids: torch.Tensor) -> torch.Tensor:
    """Keep ``ids`` under ``key`` (dropping the least recently used beyond
    :data:`MEMORY_STREAMS`); returns a copy for the caller."""
    with _streams_lock:
        _streams[key] = ids
        _streams.move_to_end(key)
        while len(_streams) > MEMORY_STREAMS:
            _streams.popitem(last=False)
    return ids.clone()


def _recalled(key: str) -> torch.Tensor | None:
    """A copy of the stream kept under ``key``; None if none is."""
    with _streams_lock:
        ids = _streams.get(key)
        if ids is not None:
            _streams.move_to_end(key)
    return None if ids is None else ids.clone()


def _cached_stream(path: Path) -> torch.Tensor | None:
    """The token stream saved at ``path``; None when missing or unreadable."""
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if ids.ndim != 1 or ids.dtype != np.int64 or ids.size == 0:
        logger.warning("token cache %s holds no token stream: tokenizing again", path)
        return None
    return torch.from_numpy(ids)


def _save_stream(path: Path, ids: torch.Tensor) -> None:
    """Write ``ids`` to ``path`` atomically (a private temporary file, then renamed), readable
    by this user only: the stream is the site's data."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, ids.numpy(), allow_pickle=False)
        os.replace(tmp, path)
    except OSError as err:
        logger.warning("could not keep the token stream in %s: %s", path.parent, err)
        Path(tmp).unlink(missing_ok=True)


def tokenize_corpus(tokenizer: PreTrainedTokenizerBase, docs: Sequence[Document],
                    cache: str | Path | None = None) -> torch.Tensor:
    """Token ids of ``corpus_text(docs)`` as a 1-D ``torch.long`` tensor, without special tokens.

    ``cache``: a folder where the stream is kept and found again (see the module's notes); the
    same ids as without it. The process also keeps the last :data:`MEMORY_STREAMS` streams in
    memory (a tokenizer without a serializable backend: never).

    Raises:
        EmptyCorpusError: ``docs`` is empty or tokenizes to no tokens.
    """
    text = corpus_text(docs)
    fingerprint = tokenizer_fingerprint(tokenizer) if text else None
    key = path = None
    if fingerprint is not None:
        key = hashlib.sha256(f"{fingerprint}\0".encode() + text.encode()).hexdigest()
        path = None if cache is None else Path(cache) / f"{key}.npy"
        recalled = _recalled(key)
        if recalled is not None:
            if path is not None and not path.is_file():  # a damaged file: the next process
                _save_stream(path, recalled)             # that reads it tokenizes again
            return recalled
        cached = None if path is None else _cached_stream(path)
        if cached is not None:
            return _remember(key, cached)
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
    if path is not None:
        _save_stream(path, ids)
    return ids if key is None else _remember(key, ids)


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
    cache: str | Path | None = None,
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
        cache: a folder of token streams (:func:`tokenize_corpus`), or None.

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
            ids = tokenize_corpus(tokenizer, docs, cache)
            windows = sample_windows(ids, counts[name], seqlen, derived_rng(seed, name))
        except (EmptyCorpusError, NotEnoughTokensError) as exc:
            raise type(exc)(f"source {name!r}: {exc}") from exc
        blocks.append(windows)
        labels.extend([name] * counts[name])
    return torch.cat(blocks, dim=0), labels
