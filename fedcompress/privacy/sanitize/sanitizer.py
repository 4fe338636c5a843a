"""The :class:`Sanitizer`: candidates, CusText groups, cached sampling tables, and the text
pipeline that draws every word.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fedcompress.data.embeddings import DTYPE, EmbeddingTable, load_glove, model_embedding_table
from fedcompress.data.errors import check_seed
from fedcompress.data.jsonl import dumps_line, read_jsonl
from fedcompress.privacy.sanitize.cache import _LRU, _RowPool
from fedcompress.privacy.sanitize.config import Mechanism, OOVPolicy, SanitizerConfig, Utility
from fedcompress.privacy.sanitize.errors import InputEncodingError, OOVError, SanitizeError
from fedcompress.privacy.sanitize.mechanism import (
    _TINY,
    BLOCK,
    DELTA_U,
    TABLE_BATCH,
    _exp_weights,
    _Table,
    _warn_underflow,
    check_eps,
)
from fedcompress.privacy.sanitize.report import SanitizedText, SanitizeReport, warn_clear
from fedcompress.privacy.sanitize.text import (
    _CLITIC,
    _IDENTIFIER,
    _NOT_CLITIC,
    _SEPARATOR,
    _WORD,
    WORD_PATTERN,
    _decode,
    _decode_stream,
    _encoding_message,
    _Run,
    word_key,
)

logger = logging.getLogger(__name__)


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
        return word_key(word, self.config.lowercase)

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
