"""Server-side aggregation of client prune masks (FedPrLLM, Sec. 3.2): pure functions.

``counts = sum_i M_i`` (votes to prune each weight, an integer wide enough for the client count,
counted directly on the bit-packed masks, 64 weights per word operation);
the global prune mask takes the ``k`` *highest* counts within the server's comparison group
(``layer``/``row``/``column``, or N:M runs), and optional weight scaling multiplies each kept
weight by ``(m - count) / m``, the fraction of clients that kept it.

The compiled kernels (numba, :mod:`fedcompress.masks._kernels`) are imported on first use: a
site's ClientApp, which imports this module for its constants and codecs, never loads the
server's kernels (its own selection loads numba for :mod:`fedcompress.solver.radix` alone).

Tie-break among equal vote counts (``tie_break``):

* ``"magnitude"`` (default): the smaller ``|W|`` is pruned first (then the lower index);
* ``"random"``: a seeded random order (``seed``);
* ``"index"``: the lower index inside the group is pruned first (row-major for ``layer``).
"""

from __future__ import annotations

import functools
import sys
from typing import Iterable, Sequence

import numpy as np
import torch

from fedcompress.masks.codec import encode_mask
from fedcompress.models import CALC_DTYPE
from fedcompress.solver.select import check_group, check_sparsity

TIE_BREAKS = ("magnitude", "random", "index")


def count_dtype(n_clients: int) -> torch.dtype:
    """The narrowest integer dtype that holds a vote count of ``n_clients``."""
    if n_clients < 0:
        raise ValueError(f"number of clients {n_clients} is negative")
    if n_clients <= torch.iinfo(torch.uint8).max:
        return torch.uint8
    if n_clients <= torch.iinfo(torch.int16).max:
        return torch.int16
    if n_clients <= torch.iinfo(torch.int32).max:
        return torch.int32
    return torch.int64


_CHUNK_WORDS = 256  # words per client per counting step: the adder slots stay in L2


def _kernels():
    """The compiled kernels (:mod:`fedcompress.masks._kernels`, numba), imported on first use."""
    from fedcompress.masks import _kernels

    return _kernels


@functools.lru_cache(maxsize=1)
def _words_type():
    """The numba type of one client's words (read-only uint64, contiguous)."""
    import numba

    return numba.types.Array(numba.types.uint64, 1, "C", readonly=True)


def load_kernels(n_clients: int = 2) -> None:
    """Load (or, the first time on a machine, compile and cache) every compiled kernel of the
    aggregation for counts of ``n_clients`` sites, on a tiny input: a one-off cost of the server
    process (numba's import and its disk cache), which benchmarks time apart from the
    aggregation itself. The aggregation loads them on first use without this call."""
    rng = np.random.default_rng(0)
    masks = [np.packbits(rng.random(64) < 0.5) for _ in range(max(n_clients, 1))]
    counts = count_packed(masks, 64).reshape(8, 8)
    weight = torch.from_numpy(rng.standard_normal((8, 8)).astype(np.float32))
    for group in ("layer", "row", "column"):
        for tie_break in ("magnitude", "index"):
            mask = global_mask(counts, 0.5, group, tie_break, weight)
    global_mask(counts, 0.0, nm=(2, 4), weight=weight)
    for scale in (False, True):
        apply_global_mask(weight.clone(), mask, counts, max(n_clients, 1), scale)


def payload_words(payload: np.ndarray, nbytes: int) -> np.ndarray:
    """A bit-packed payload of ``nbytes`` bytes as read-only little-endian uint64 words, the
    input of :func:`count_words`: a view of the payload itself (no copy) when its length is a
    whole number of words and its buffer is 8-byte aligned (the usual case: a linear layer has a
    multiple of 64 weights), else a zero-padded copy."""
    if payload.shape != (nbytes,) or payload.dtype != np.uint8:
        raise ValueError(f"payload of shape {payload.shape} and dtype {payload.dtype}, expected "
                         f"uint8 ({nbytes},)")
    if nbytes % 8 == 0 and payload.flags.c_contiguous \
            and payload.ctypes.data % np.dtype(np.uint64).alignment == 0:
        words = payload.view(np.uint64)
    else:
        padded = np.zeros(-(-nbytes // 8) * 8, dtype=np.uint8)
        padded[:nbytes] = payload
        words = padded.view(np.uint64)
    if words.flags.writeable:
        words = words.view()
        words.flags.writeable = False  # one array type for the compiled kernel
    return words


def count_words(words: Sequence[np.ndarray], numel: int) -> torch.Tensor:
    """``sum_i M_i`` of the bit-packed masks given as :func:`payload_words` (one array per
    client, all of one length), without unpacking or stacking any mask: a Wallace tree of full
    adders counts 64 weights per word operation into a few binary count planes, chunk by chunk
    (compiled, :mod:`fedcompress.masks._kernels`), reading each client's words where they are;
    the planes are then expanded once into one count per weight. Returns counts of shape
    ``[numel]`` in :func:`count_dtype` of the number of masks.
    """
    m = len(words)
    if m == 0:
        raise ValueError("no masks to aggregate")
    nwords = -(-numel // 64)
    for i, w in enumerate(words):
        if not isinstance(w, np.ndarray) or w.dtype != np.uint64 or w.shape != (nwords,) \
                or w.flags.writeable or not w.flags.c_contiguous:
            raise ValueError(f"words of mask {i} are not payload_words() of {numel} weights "
                             f"({nwords} read-only uint64 words)")
    if sys.byteorder != "little":
        raise RuntimeError("vote counting reads the packed masks as little-endian 64-bit words")
    from numba.typed import List

    kernels = _kernels()
    typed = List.empty_list(_words_type())
    for w in words:
        typed.append(w)
    ops, planes, n_slots = kernels.count_schedule(m)
    wide = m > 255  # else one byte per count (at most 8 count planes)
    out = np.empty(nwords * 64, dtype=np.int32) if wide else np.empty(nwords * 8, dtype=np.uint64)
    kernels.count_words(typed, nwords, ops, planes, n_slots, _CHUNK_WORDS, out, wide)
    counts = out[:numel] if wide else out.view(np.uint8)[:numel]
    return torch.from_numpy(counts).to(count_dtype(m))


def count_packed(payloads: Sequence[np.ndarray], numel: int) -> torch.Tensor:
    """``sum_i M_i`` of bit-packed masks (the codec's format: ``numpy.packbits``, MSB first),
    counted on the packed bits (:func:`count_words`). The payloads must already be validated
    (``codec.check_packed``). Returns counts of shape ``[numel]`` in :func:`count_dtype` of
    the number of payloads."""
    if len(payloads) == 0:
        raise ValueError("no masks to aggregate")
    nbytes = (numel + 7) // 8
    return count_words([payload_words(p, nbytes) for p in payloads], numel)


def vote_counts(masks: Iterable[torch.Tensor], n_clients: int | None = None) -> torch.Tensor:
    """``sum_i M_i`` over the clients' bool prune masks (all of one shape), in
    :func:`count_dtype` of the number of masks; ``n_clients``, when given, must match it."""
    masks = list(masks)
    if not masks:
        raise ValueError("no masks to aggregate")
    shape = tuple(masks[0].shape)
    for i, mask in enumerate(masks):
        if mask.dtype != torch.bool:
            raise TypeError(f"mask {i}: a prune mask must be bool, got {mask.dtype}")
        if tuple(mask.shape) != shape:
            raise ValueError(f"mask {i} of shape {tuple(mask.shape)} does not match {shape}")
    if n_clients is not None and n_clients != len(masks):
        raise ValueError(f"{len(masks)} masks for {n_clients} announced clients")
    packed = [encode_mask(m) for m in masks]
    return count_packed(packed, int(np.prod(shape))).reshape(shape)


def _tie_key(counts: torch.Tensor, tie_break: str, weight: torch.Tensor | None,
             seed: int) -> np.ndarray | None:
    """Secondary key (numpy float32 of the counts' shape; its absolute value ascending = pruned
    first among equal counts); ``None`` for index order."""
    if tie_break == "magnitude":
        if weight is None:
            raise ValueError("tie_break='magnitude' needs the weight")
        if weight.shape != counts.shape:
            raise ValueError(f"weight shape {tuple(weight.shape)} != counts {tuple(counts.shape)}")
        return weight.detach().cpu().to(CALC_DTYPE).numpy()
    if tie_break == "random":
        gen = torch.Generator().manual_seed(seed)
        return torch.rand(counts.shape, generator=gen, dtype=CALC_DTYPE).numpy()
    if tie_break == "index":
        return None
    raise ValueError(f"unknown tie-break {tie_break!r}: expected one of {', '.join(TIE_BREAKS)}")


_NO_KEY = np.zeros((1, 1), dtype=np.float32)


def _top_counts_rows(counts: np.ndarray, key: np.ndarray | None, k: int,
                     by_column: bool = False) -> np.ndarray:
    """Bool mask of the ``k`` highest counts in every row of ``counts`` ``[rows, n]``.

    Ties among equal counts: the lower ``|key|`` first (``None``: no key), then the lower
    column index; the result equals a stable sort by (count descending, ``|key|`` ascending,
    index ascending), computed without sorting (a threshold count per row from a histogram,
    then a radix select of only the tied keys: :func:`fedcompress.masks._kernels.select_rows`).
    ``by_column``: the same for every *column*, on the row-major counts without a transposed
    copy (:func:`fedcompress.masks._kernels.select_columns`: vectorised row-major counting
    passes find each column's threshold count and the bucket of its tied keys' cut, then the
    mask; only the tied entries in each column's cut bucket are gathered).
    """
    rows, n = counts.shape[::-1] if by_column else counts.shape
    if not 0 <= k <= n:
        raise ValueError(f"cannot select {k} of {n} weights per group")
    mask = np.empty(counts.shape, dtype=np.uint8)
    if counts.size == 0:
        return mask.astype(bool)
    counts = np.ascontiguousarray(counts)
    if key is None:
        key_arr, use_key = _NO_KEY, False
    else:
        key_arr, use_key = np.ascontiguousarray(key, dtype=np.float32), True
    if np.issubdtype(counts.dtype, np.signedinteger) and counts.min() < 0:
        raise ValueError("vote counts must be non-negative")
    n_values = int(counts.max()) + 1
    if by_column:
        selected = _kernels().select_columns(counts, key_arr, use_key, k, n_values, mask)
    else:
        selected = _kernels().select_rows(counts, key_arr, use_key, k, n_values, mask)
    if selected == -1:
        raise ValueError("tie-break key has NaN or infinite entries (weights?)")
    assert selected == k * rows, (selected, k, rows)
    return mask.view(bool)


def global_mask(counts: torch.Tensor, sparsity: float, group: str = "layer",
                tie_break: str = "magnitude", weight: torch.Tensor | None = None, seed: int = 0,
                nm: tuple[int, int] | None = None) -> torch.Tensor:
    """The global prune mask: the highest vote counts within each comparison group."""
    if counts.dim() != 2:
        raise ValueError(f"counts must be a matrix [out, in], got shape {tuple(counts.shape)}")
    key = _tie_key(counts, tie_break, weight, seed)
    c = counts.detach().cpu().numpy()
    rows, cols = c.shape
    if nm is not None:
        n, m = nm
        if cols % m:
            raise ValueError(f"N:M {n}:{m} needs in_features divisible by {m}, got {cols}")
        mask = _top_counts_rows(c.reshape(-1, m), None if key is None else key.reshape(-1, m), n)
    else:
        check_sparsity(sparsity)
        check_group(group)
        if group == "layer":
            mask = _top_counts_rows(c.reshape(1, -1), None if key is None else key.reshape(1, -1),
                                    int(sparsity * c.size))
        elif group == "row":
            mask = _top_counts_rows(c, key, int(sparsity * cols))
        else:
            mask = _top_counts_rows(c, key, int(sparsity * rows), by_column=True)
    return torch.from_numpy(np.ascontiguousarray(mask).reshape(rows, cols))


def scale_weights(weight: torch.Tensor, counts: torch.Tensor, n_clients: int) -> torch.Tensor:
    """``W * (m - counts) / m`` computed in float32, returned in the weight's dtype."""
    if n_clients <= 0:
        raise ValueError(f"number of clients must be positive, got {n_clients}")
    factor = (n_clients - counts.to(CALC_DTYPE)) / n_clients
    return (weight.detach().to(CALC_DTYPE) * factor).to(weight.dtype)


@torch.no_grad()
def apply_global_mask(weight: torch.Tensor, mask: torch.Tensor, counts: torch.Tensor,
                      n_clients: int, scale: bool) -> None:
    """In place: with ``scale``, ``W *= (m - counts) / m`` (:func:`scale_weights`); then the
    masked weights are zeroed. One compiled pass for float32 CPU weights, torch otherwise."""
    if mask.shape != weight.shape or counts.shape != weight.shape:
        raise ValueError(f"mask {tuple(mask.shape)} / counts {tuple(counts.shape)} do not match "
                         f"the weight {tuple(weight.shape)}")
    if n_clients <= 0:
        raise ValueError(f"number of clients must be positive, got {n_clients}")
    if scale and counts.numel():
        # numpy's min/max (one thread, vectorised), not torch's: inside the aggregator's worker
        # threads, torch's parallel reductions cost more than the apply itself
        c = counts.detach().cpu().numpy()
        low = 0 if np.issubdtype(c.dtype, np.unsignedinteger) else int(c.min())
        if not 0 <= low or int(c.max()) > n_clients:
            raise ValueError(f"vote counts outside [0, {n_clients}] for {n_clients} clients")
    if weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous():
        _kernels().apply_mask(weight.detach().numpy(),
                              np.ascontiguousarray(mask.numpy()).view(np.uint8),
                              np.ascontiguousarray(counts.numpy()), n_clients, scale)
        return
    if scale:
        weight.copy_(scale_weights(weight, counts.to(weight.device), n_clients))
    weight.masked_fill_(mask.to(weight.device), 0)
