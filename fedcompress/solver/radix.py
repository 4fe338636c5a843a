"""Compiled radix select (numba): a site's choice of the lowest scores of every row, and the
k-th smallest of many keys that the server's aggregation kernels
(:mod:`fedcompress.masks._kernels`) use for tied counts.

Keys are the float32 bits of non-negative scores, whose order is the bits' order as unsigned
integers. Each kernel releases the GIL (``nogil``) so callers run blocks of rows on threads,
and is compiled once per argument type (cached on disk).
"""

from __future__ import annotations

import numba
import numpy as np

JIT = dict(nogil=True, cache=True)
NON_FINITE = np.uint32(0x7F800000)  # |x|'s float32 bits at or above this: infinite or NaN


@numba.njit(**JIT)
def kth_smallest_bits(bits, kth, prefix, top):
    """The ``kth`` smallest (0-based) of ``bits``, the float32 bits of non-negative finite keys
    (whose order is their bits' order as unsigned integers) that all share their bits above
    ``top`` with ``prefix`` (whose bits from ``top`` down are 0): the largest ``v`` with
    ``#(bits < v) <= kth``, built bit by bit from ``top`` down (counting passes without a
    branch, which the compiler vectorises). A quickselect's comparisons mispredict half the
    time on random keys."""
    for b in range(top, -1, -1):
        cand = prefix | np.uint32(1 << b)
        below = 0
        for i in range(bits.shape[0]):
            below += bits[i] < cand
        if below <= kth:
            prefix = cand
    return prefix


RADIX_BUCKETS = 256  # most buckets of a histogram step of :func:`kth_smallest_radix`
RADIX_DIRECT = 64  # at most this many keys left: the bitwise search finishes


@numba.njit(**JIT)
def radix_step(bits, kth):
    """One histogram step of :func:`kth_smallest_radix`: the keys of the bucket holding the
    ``kth`` smallest (at most ``RADIX_BUCKETS`` buckets between the lowest and highest key, 4
    interleaved histograms so that no increment waits on the previous one). Returns ``(keys,
    kth within them, the bucket's lowest possible key, the bucket's width in bits)``; width 0
    when every key is the same."""
    n = bits.shape[0]
    lo, hi = bits[0], bits[0]
    for i in range(n):  # vectorised
        lo = min(lo, bits[i])
        hi = max(hi, bits[i])
    shift = np.uint64(0)
    while (np.uint64(hi) >> shift) - (np.uint64(lo) >> shift) >= RADIX_BUCKETS:
        shift += np.uint64(1)
    base = np.uint64(lo) >> shift
    width = (np.uint64(hi) >> shift) - base + np.uint64(1)
    hist = np.zeros(4 * width, dtype=np.int32)  # unsigned indices: no wraparound check
    for i in range(n):
        hist[np.uint64(i & 3) * width + (np.uint64(bits[i]) >> shift) - base] += 1
    below, star, size = 0, np.uint64(0), 0
    for b in range(width):
        h = hist[b] + hist[width + b] + hist[2 * width + b] + hist[3 * width + b]
        if below + h > kth:
            star, size = np.uint64(b), h
            break
        below += h
    cand = np.empty(size, dtype=np.uint32)
    m = 0
    for i in range(n):  # the bucket's keys (a branch taken for a bucket's share of keys)
        if (np.uint64(bits[i]) >> shift) - base == star:
            cand[m] = bits[i]
            m += 1
    return cand, kth - below, np.uint32((base + star) << shift), np.int64(shift)


@numba.njit(**JIT)
def kth_smallest_radix(bits, kth):
    """:func:`kth_smallest_bits` of many keys by radix steps (:func:`radix_step`): each
    keeps the one bucket of a histogram of the keys' top bits that holds the ``kth`` smallest,
    until at most ``RADIX_DIRECT`` keys or a one-value bucket are left, and the bitwise
    search runs on those, over the bits below the bucket's. A column group ties on about half
    its entries (its threshold count is often 0 or the site count): 31 counting passes over
    all of them took half its selection; a site's row of Wanda scores keeps a fifth of its
    keys in the median's bucket of the first step, whose 20-odd counting passes cost 4 rows'
    worth: the steps go on while they shrink the keys."""
    cand, kth, prefix, shift = radix_step(bits, kth)
    while shift > 0 and cand.shape[0] > RADIX_DIRECT:
        cand, kth, prefix, shift = radix_step(cand, kth)
    if shift == 0:
        return prefix
    return kth_smallest_bits(cand, kth, prefix, shift - 1)


@numba.njit(**JIT)
def lowest_k_rows(bits, k, out):
    """Mark in ``out`` (bool, shape of ``bits``) the ``k`` lowest keys of every row of ``bits``
    (``[rows, cols]``, the float32 bits of non-negative scores, whose order is the bits' order
    as unsigned integers) and, of the keys equal to a row's ``k``-th lowest, the first ones in
    index order: the set a stable ascending sort puts first (a site's selection,
    :func:`fedcompress.solver.select.select_prune_mask`). The ``k``-th lowest by
    :func:`kth_smallest_radix`, a few passes over a row and no sort. Returns False at the
    first row holding a negative score, ``-0.0`` or a NaN (bits above ``+inf``'s): the caller
    selects those rows otherwise; ``+inf`` orders last, as it should."""
    rows, cols = bits.shape
    for r in range(rows):
        row = bits[r]
        bad = False
        for i in range(cols):  # vectorised
            bad |= row[i] > NON_FINITE
        if bad:
            return False
        kth = kth_smallest_radix(row, k - 1)
        below = 0
        for i in range(cols):  # vectorised
            lower = row[i] < kth
            out[r, i] = lower
            below += lower
        need = k - below
        for i in range(cols):  # the first ties at the k-th key (few: a branch rarely taken)
            if need == 0:
                break
            if row[i] == kth:
                out[r, i] = True
                need -= 1
    return True
