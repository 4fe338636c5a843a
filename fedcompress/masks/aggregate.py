"""Server-side aggregation of client prune masks (FedPrLLM, Sec. 3.2): pure functions.

``counts = sum_i M_i`` (votes to prune each weight, an integer wide enough for the client count,
counted directly on the bit-packed masks, 64 weights per word operation);
the global prune mask takes the ``k`` *highest* counts within the server's comparison group
(``layer``/``row``/``column``, or N:M runs), and optional weight scaling multiplies each kept
weight by ``(m - count) / m``, the fraction of clients that kept it.

Tie-break among equal vote counts (``tie_break``):

* ``"magnitude"`` (default): the smaller ``|W|`` is pruned first (then the lower index);
* ``"random"``: a seeded random order (``seed``);
* ``"index"``: the lower index inside the group is pruned first (row-major for ``layer``).
"""

from __future__ import annotations

import sys
from typing import Iterable, Sequence

import numpy as np
import torch

from fedcompress.masks.codec import encode_mask
from fedcompress.models import CALC_DTYPE
from fedcompress.pruning.select import check_group, check_sparsity

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


_LANES = np.zeros(256, dtype=np.uint64)  # byte -> its 8 bits (MSB first) as 8 byte lanes
for _byte in range(256):
    for _bit in range(8):
        if _byte >> (7 - _bit) & 1:
            _LANES[_byte] |= np.uint64(1 << (8 * _bit))
if sys.byteorder != "little":  # lane b must be byte b of the uint64 in memory
    _LANES = _LANES.byteswap()


def _bit_planes(words: list[np.ndarray]) -> list[np.ndarray]:
    """Bit-sliced population count of equal-length uint64 vectors (a Wallace tree of full
    adders, 5 word operations per input word): returns planes ``p_j`` with
    ``sum_j 2**j * bit(p_j) == number of inputs with that bit set``, per bit position."""
    levels = [list(words)]
    planes = []
    j = 0
    while j < len(levels):
        items = levels[j]
        while len(items) > 1:
            if len(levels) == j + 1:
                levels.append([])
            if len(items) >= 3:
                a, b, c = items.pop(), items.pop(), items.pop()
                t = a ^ b
                items.append(t ^ c)
                levels[j + 1].append((a & b) | (t & c))
            else:
                a, b = items.pop(), items.pop()
                items.append(a ^ b)
                levels[j + 1].append(a & b)
        planes.append(items[0])
        j += 1
    return planes


def count_packed(payloads: Sequence[np.ndarray], numel: int, chunk_words: int = 8192
                 ) -> torch.Tensor:
    """``sum_i M_i`` of bit-packed masks (the codec's format: ``numpy.packbits``, MSB first),
    without unpacking each client's mask: the bits are counted 64 at a time in bit-sliced
    form (chunks small enough to stay in cache), then the few count planes are expanded once.
    The payloads must already be validated (``codec.check_packed``). Returns counts of shape
    ``[numel]`` in :func:`count_dtype` of the number of payloads.
    """
    m = len(payloads)
    if m == 0:
        raise ValueError("no masks to aggregate")
    nbytes = (numel + 7) // 8
    nwords = (nbytes + 7) // 8
    stacked = np.zeros((m, nwords * 8), dtype=np.uint8)
    for i, payload in enumerate(payloads):
        if payload.shape != (nbytes,):
            raise ValueError(f"payload {i} has shape {payload.shape}, expected ({nbytes},)")
        stacked[i, :nbytes] = payload
    words = stacked.view(np.uint64)
    planes = np.zeros((max(m.bit_length(), 1), nwords), dtype=np.uint64)
    for start in range(0, nwords, chunk_words):
        chunk = _bit_planes([words[i, start:start + chunk_words] for i in range(m)])
        for j, plane in enumerate(chunk):
            planes[j, start:start + chunk_words] = plane
    plane_bytes = planes.view(np.uint8)[:, :nbytes]
    if m <= 255:  # every count fits a byte lane: expand the planes 8 bits at a time
        lanes = np.zeros(nbytes, dtype=np.uint64)
        for j in range(plane_bytes.shape[0]):
            lanes += _LANES[plane_bytes[j]] << np.uint64(j)
        counts = lanes.view(np.uint8)[:numel]
    else:
        counts = np.zeros(numel, dtype=np.int64)
        for j in range(plane_bytes.shape[0]):
            counts += np.unpackbits(plane_bytes[j])[:numel].astype(np.int64) << j
    return torch.from_numpy(np.ascontiguousarray(counts)).to(count_dtype(m))


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
    """Secondary key (numpy float32; its absolute value ascending = pruned first among equal
    counts); ``None`` for index order."""
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


def _row_popcount(bits: np.ndarray) -> np.ndarray:
    """Number of True entries in every row of a bool matrix (bit-packed, then popcount)."""
    return np.bitwise_count(np.packbits(bits, axis=1)).sum(axis=1, dtype=np.int64)


def _top_counts_rows(counts: np.ndarray, key: np.ndarray | None, k: int) -> np.ndarray:
    """Bool mask of the ``k`` highest counts in every row of ``counts`` ``[rows, n]``.

    Ties among equal counts: the lower ``|key|`` first (``None``: no key), then the lower
    column index. The result equals a stable sort by (count descending, key ascending, index
    ascending), computed without sorting whole rows: a per-row threshold count by bisection over
    the small integer range of the counts, then an exact ranking of only the tied weights at the
    threshold, in the rows where some but not all of them are selected. (numpy: its integer
    comparisons and bit counts are many times faster than torch's on the CPU.)
    """
    c = counts
    rows, n = c.shape
    if k == 0 or rows == 0:
        return np.zeros(c.shape, dtype=bool)
    # Bisection: ge(t) = #(c >= t) does not increase with t; find the largest t with ge(t) >= k.
    lo = np.zeros(rows, dtype=np.int64)  # ge(0) = n >= k
    hi = np.full(rows, int(c.max()) + 1, dtype=np.int64)  # ge(max + 1) = 0 < k
    while (hi - lo > 1).any():
        mid = (lo + hi) // 2
        ok = _row_popcount(c >= mid.astype(c.dtype)[:, None]) >= k
        lo = np.where(ok, mid, lo)
        hi = np.where(ok, hi, mid)
    threshold = lo.astype(c.dtype)[:, None]
    mask = c > threshold
    need = k - _row_popcount(mask)  # how many of the tied weights each row still prunes
    tied = c == threshold
    n_tied = _row_popcount(tied)
    mask |= tied & (need == n_tied)[:, None]  # rows that prune every tied weight
    partial = (need > 0) & (need < n_tied)
    if partial.any():
        row, col = np.nonzero(tied & partial[:, None])
        if key is None:
            bits = np.zeros(row.size, dtype=np.int64)
        else:
            tie_keys = np.abs(key[row, col]).astype(np.float32)
            if not np.isfinite(tie_keys).all():
                raise ValueError("tie-break key has NaN or infinite entries (weights?)")
            # Non-negative float32 values order like their IEEE bit patterns (< 2**31).
            bits = tie_keys.view(np.int32).astype(np.int64)
        col_bits = max(int(n - 1).bit_length(), 1)
        row_bits = max(int(rows - 1).bit_length(), 1)
        if row_bits + 31 + col_bits <= 63:  # one int64 sort key: (row, key, index)
            packed = (row << (31 + col_bits)) | (bits << col_bits) | col
            packed.sort()
            row, col = packed >> (31 + col_bits), packed & ((1 << col_bits) - 1)
        else:  # matrices of more than 2**32 weights
            order = np.lexsort((col, bits, row))
            row, col = row[order], col[order]
        starts = np.zeros(rows + 1, dtype=np.int64)
        starts[1:] = np.cumsum(np.bincount(row, minlength=rows))
        chosen = np.arange(row.size) - starts[row] < need[row]
        mask[row[chosen], col[chosen]] = True
    return mask


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
            mask = _top_counts_rows(np.ascontiguousarray(c.T), None if key is None else key.T,
                                    int(sparsity * rows)).T
    return torch.from_numpy(np.ascontiguousarray(mask).reshape(rows, cols))


def scale_weights(weight: torch.Tensor, counts: torch.Tensor, n_clients: int) -> torch.Tensor:
    """``W * (m - counts) / m`` computed in float32, returned in the weight's dtype."""
    if n_clients <= 0:
        raise ValueError(f"number of clients must be positive, got {n_clients}")
    factor = (n_clients - counts.to(CALC_DTYPE)) / n_clients
    return (weight.detach().to(CALC_DTYPE) * factor).to(weight.dtype)
