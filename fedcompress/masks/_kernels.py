"""Compiled kernels (numba) of the server's aggregation hot path: counting votes on bit-packed
masks, selecting the top counts per comparison group, and applying the global mask (the radix
select of tied keys is a site's, :mod:`fedcompress.solver.radix`).

Each kernel is one or two sequential passes over a layer, releases the GIL (``nogil``) so the
caller can run layers in parallel threads, and is compiled once per argument type (cached on
disk). The reference semantics are the pure-numpy definitions in the tests
(``tests/test_masks.py``: a stable sort by count descending, tie key ascending, index ascending).
"""

from __future__ import annotations

from functools import lru_cache

import numba
import numpy as np

from fedcompress.solver.radix import JIT as _JIT
from fedcompress.solver.radix import NON_FINITE as _NON_FINITE
from fedcompress.solver.radix import kth_smallest_radix as _kth_smallest_radix

# ---- vote counting -----------------------------------------------------------------------

# Operation kinds of a counting schedule: a full adder (3 -> sum, carry) and a half adder
# (2 -> sum, carry), on 64-bit words holding 64 weights each.
FULL, HALF = 0, 1


@lru_cache(maxsize=None)
def count_schedule(m: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A Wallace tree of full adders that counts ``m`` bit vectors into binary planes.

    Slots ``0..m-1`` are the inputs, the rest temporaries. Returns ``(ops, planes, n_slots)``:
    ``ops[i] = (kind, a, b, c, sum, carry)`` (``c`` unused by a half adder) and ``planes[j]``,
    the slot holding bit ``j`` of every count. About ``m`` full adders, 5 word operations each.
    The control flow depends only on ``m`` (not on the data), so it is planned here once.
    """
    if m < 1:
        raise ValueError(f"cannot count {m} masks")
    next_slot = m
    levels: list[list[int]] = [list(range(m))]
    ops: list[tuple[int, int, int, int, int, int]] = []
    planes: list[int] = []
    j = 0
    while j < len(levels):
        items = levels[j]
        while len(items) > 1:
            if len(levels) == j + 1:
                levels.append([])
            s, c = next_slot, next_slot + 1
            next_slot += 2
            if len(items) >= 3:
                a, b, cc = items.pop(), items.pop(), items.pop()
                ops.append((FULL, a, b, cc, s, c))
            else:
                a, b = items.pop(), items.pop()
                ops.append((HALF, a, b, 0, s, c))
            items.append(s)
            levels[j + 1].append(c)
        planes.append(items[0])
        j += 1
    return np.array(ops, dtype=np.int64).reshape(-1, 6), np.array(planes, dtype=np.int64), next_slot


@numba.njit(**_JIT)
def _add_chunk(words, start, n, ops, buf):
    """Run the adder schedule on words ``[start, start + n)`` of every input (copied into the
    first ``m`` rows of the slot buffer ``buf``)."""
    for i in range(len(words)):
        row = words[i]
        for w in range(n):
            buf[i, w] = row[start + w]
    for o in range(ops.shape[0]):
        kind, a, b, c, s, cy = ops[o, 0], ops[o, 1], ops[o, 2], ops[o, 3], ops[o, 4], ops[o, 5]
        if kind == 0:
            for w in range(n):
                x, y, z = buf[a, w], buf[b, w], buf[c, w]
                t = x ^ y
                buf[s, w] = t ^ z
                buf[cy, w] = (x & y) | (t & z)
        else:
            for w in range(n):
                x, y = buf[a, w], buf[b, w]
                buf[s, w] = x ^ y
                buf[cy, w] = x & y


@numba.njit(**_JIT)
def _planes_to_bytes(p0, p1, p2, p3, p4, p5, p6, p7, n, rows):
    """Byte counts from up to 8 count planes (``p0..p7``: word ``w`` of each, bit ``j`` of every
    count in plane ``j``; absent planes are zero rows), 64 weights per word: ``rows[b, w]``
    holds the counts of byte ``b`` of word ``w`` (its 8 weights, MSB first, one byte each).
    Per byte: the planes' bytes as the rows of an 8x8 bit matrix, transposed by three delta
    swaps, then byte-reversed (the packing is MSB first). Only shifts and masks, the same for
    every word: the loop over words is vectorised (a table lookup per byte and plane is not)."""
    m = np.uint64(255)
    for b in range(8):
        s = np.uint64(8 * b)
        row = rows[b]
        for w in range(n):
            x = ((p0[w] >> s) & m) | (((p1[w] >> s) & m) << np.uint64(8)) \
                | (((p2[w] >> s) & m) << np.uint64(16)) | (((p3[w] >> s) & m) << np.uint64(24)) \
                | (((p4[w] >> s) & m) << np.uint64(32)) | (((p5[w] >> s) & m) << np.uint64(40)) \
                | (((p6[w] >> s) & m) << np.uint64(48)) | (((p7[w] >> s) & m) << np.uint64(56))
            t = (x ^ (x >> np.uint64(7))) & np.uint64(0x00AA00AA00AA00AA)
            x = x ^ t ^ (t << np.uint64(7))
            t = (x ^ (x >> np.uint64(14))) & np.uint64(0x0000CCCC0000CCCC)
            x = x ^ t ^ (t << np.uint64(14))
            t = (x ^ (x >> np.uint64(28))) & np.uint64(0x00000000F0F0F0F0)
            x = x ^ t ^ (t << np.uint64(28))
            x = ((x >> np.uint64(8)) & np.uint64(0x00FF00FF00FF00FF)) \
                | ((x & np.uint64(0x00FF00FF00FF00FF)) << np.uint64(8))
            x = ((x >> np.uint64(16)) & np.uint64(0x0000FFFF0000FFFF)) \
                | ((x & np.uint64(0x0000FFFF0000FFFF)) << np.uint64(16))
            row[w] = (x >> np.uint64(32)) | (x << np.uint64(32))


@numba.njit(**_JIT)
def count_words(words, nwords, ops, planes, n_slots, chunk, out, wide):
    """Vote counts of the ``m`` packed masks ``words`` (a typed list of ``m`` uint64 arrays of
    ``nwords`` words each: the codec's bytes viewed as little-endian words, read where they are,
    never stacked into one array). Per chunk of words: the schedule's adders, then the count
    planes expanded into ``out``:

    * ``wide=False`` (``m <= 255``, at most 8 planes): ``out`` uint64 ``[nwords * 8]``; viewed
      as uint8 it holds one count per weight in weight order (:func:`_planes_to_bytes`);
    * ``wide=True``: ``out`` int32 ``[nwords * 64]``, one count per weight.
    """
    buf = np.zeros((n_slots + 1, chunk), dtype=np.uint64)  # the last row stays 0: no plane
    n_planes = planes.shape[0]
    if wide:
        plane_words = np.empty(n_planes, dtype=np.uint64)  # one word of every plane
        for start in range(0, nwords, chunk):
            n = min(chunk, nwords - start)
            _add_chunk(words, start, n, ops, buf)
            for w in range(n):
                for j in range(n_planes):
                    plane_words[j] = buf[planes[j], w]
                for bit in range(64):  # byte by byte, MSB first inside each byte
                    shift = np.uint64(8 * (bit // 8) + 7 - bit % 8)
                    total = 0
                    for j in range(n_planes):
                        total += np.int64((plane_words[j] >> shift) & np.uint64(1)) << j
                    out[(start + w) * 64 + bit] = total
        return
    rows = np.empty((8, chunk), dtype=np.uint64)
    pl = np.full(8, n_slots, dtype=np.int64)
    pl[:n_planes] = planes
    for start in range(0, nwords, chunk):
        n = min(chunk, nwords - start)
        _add_chunk(words, start, n, ops, buf)
        _planes_to_bytes(buf[pl[0]], buf[pl[1]], buf[pl[2]], buf[pl[3]], buf[pl[4]],
                         buf[pl[5]], buf[pl[6]], buf[pl[7]], n, rows)
        for w in range(n):  # the 8 rows interleaved into weight order
            base = (start + w) * 8
            for b in range(8):
                out[base + b] = rows[b, w]


# ---- selection of the top counts per comparison group ------------------------------------

@numba.njit(**_JIT)
def _pick_small_row(counts, key, use_key, r, k, mask):
    """Rows shorter than the count range (N:M groups): ``k`` picks by repeated maximum of
    (count, -|key|, -index)."""
    cols = counts.shape[1]
    for c in range(cols):
        mask[r, c] = 0
    for _ in range(k):
        best = -1
        for c in range(cols):
            if mask[r, c]:
                continue
            if best < 0 or counts[r, c] > counts[r, best]:
                best = c
            elif counts[r, c] == counts[r, best] and use_key and abs(key[r, c]) < abs(key[r, best]):
                best = c
        mask[r, best] = 1


_SMALL_TIES = 48  # up to this many tied entries, ranks by counting; above, a radix select


@numba.njit(**_JIT)
def _take_tied(keys, idx, need, use_key, out_mask_flat, stride, offset):
    """Of the tied entries ``idx`` (ascending) with keys ``keys`` (``|key|``, float32), mark
    the ``need`` first in (``|key|``, index) order at ``out_mask_flat[idx[i] * stride +
    offset]``: the ones below the ``need``-th smallest key (the cut: :func:`_kth_smallest_radix`),
    then the first ones at the cut, in index order (few entries: a branch rarely taken).
    Writes 0 or 1 at every tied entry. False when a key is not finite."""
    n = idx.shape[0]
    if not use_key:
        for i in range(need):
            out_mask_flat[idx[i] * stride + offset] = 1
        return True
    bits = keys.view(np.uint32)
    bad = False
    for i in range(n):
        bad |= bits[i] >= _NON_FINITE
    if bad:
        return False
    if n <= _SMALL_TIES:  # each entry's rank in (key, index) order, counted: n^2 compares
        for i in range(n):  # without a branch (vectorised), cheaper than 31 passes here
            a = bits[i]
            rank = 0
            for j in range(i):
                rank += bits[j] <= a
            for j in range(i + 1, n):
                rank += bits[j] < a
            out_mask_flat[idx[i] * stride + offset] = rank < need
        return True
    cut = _kth_smallest_radix(bits, need - 1)
    quota = need
    for i in range(n):
        quota -= bits[i] < cut
    for i in range(n):  # without a branch: the entries are tied, in random key order
        out_mask_flat[idx[i] * stride + offset] = bits[i] < cut
    for i in range(n):  # the first ``quota`` at the cut (few: a branch rarely taken)
        if quota == 0:
            break
        if bits[i] == cut:
            out_mask_flat[idx[i] * stride + offset] = 1
            quota -= 1
    return True


@numba.njit(**_JIT)
def _select_line(vals, keys, use_key, k, hist, tied_keys, tied_idx, out):
    """Mark in ``out`` the ``k`` highest of the counts ``vals`` (one comparison group, 1-D);
    ties among equal counts by ``|keys|`` (when ``use_key``) then index. A histogram of the
    counts (``hist``: ``[4, n_values]``, 4 interleaved so that no increment waits on the
    previous one) gives the threshold count ``t`` (the largest with ``#(count >= t) >= k``); the
    mask is ``count > t`` plus, of the entries tied at ``t``, all of them or the ``need`` first
    in (``|key|``, index) order, found by a radix select of the tied keys (not a sort). False
    when a tied key is NaN or infinite."""
    n = vals.shape[0]
    n_values = hist.shape[1]
    hist[:, :] = 0
    for i in range(n):
        hist[i & 3, vals[i]] += 1
    ge, t, at_t = 0, 0, 0
    for v in range(n_values - 1, -1, -1):
        h = hist[0, v] + hist[1, v] + hist[2, v] + hist[3, v]
        ge += h
        if ge >= k:
            t, at_t = v, h
            break
    need = k - (ge - at_t)  # tied entries (count == t) this group selects, 1..at_t
    if need == at_t:
        for i in range(n):
            out[i] = vals[i] >= t
        return True
    for i in range(n):  # vectorised
        out[i] = vals[i] > t
    tied = 0
    for i in range(n):  # without a branch: the tied indices compacted as they come
        tied_idx[tied] = i
        tied += vals[i] == t
    if use_key:
        for j in range(tied):
            tied_keys[j] = abs(keys[tied_idx[j]])
    return _take_tied(tied_keys[:tied], tied_idx[:tied], need, use_key, out, 1, 0)


@numba.njit(**_JIT)
def select_rows(counts, key, use_key, k, n_values, mask):
    """Mark in ``mask`` (uint8, shape of ``counts``) the ``k`` highest counts of every row of
    ``counts`` ``[rows, cols]`` (counts in ``0..n_values-1``).

    Ties among equal counts: the lower ``|key|`` first (``use_key``; ``key`` float32 of the
    counts' shape), then the lower column index; the result equals a stable sort of each row by
    (count descending, ``|key|`` ascending, index ascending), computed per row by
    :func:`_select_line` (a histogram threshold and a partition of the tied keys only).
    Returns the number of selected weights, or -1 when a tied key is NaN or infinite.
    """
    rows, cols = counts.shape
    if k < 0 or k > cols:
        return -2
    if k == 0:
        mask[:, :] = 0
        return 0
    hist = np.zeros((4, n_values), dtype=np.int64)
    tied_keys = np.empty(cols, dtype=np.float32)
    tied_idx = np.empty(cols + 1, dtype=np.int64)  # + 1: the branch-free compaction's slot
    for r in range(rows):
        if cols < n_values:
            _pick_small_row(counts, key, use_key, r, k, mask)
        elif not _select_line(counts[r], key[r if use_key else 0], use_key, k, hist, tied_keys,
                              tied_idx, mask[r]):
            return -1
    return k * rows


_COL_SHIFT = 18  # a tied key's bucket: its float32 bits >> 18 (32 buckets per binade)
_UNTIED = 255  # the bucket of an entry not tied at a partial threshold; tied ones are 0..254
_SAMPLE_ROWS = 64  # about this many rows' keys set the range of a column's buckets
_BLOCK_ROWS = 248  # rows counted into one-byte partial counts (8 at a time, at most 255)
# times 2 ** (8 j), its top byte is j: the byte index of a word's lowest set flag byte
_BYTE_INDEX = np.uint64(0x0001020304050607)


@numba.njit(**_JIT)
def _count_below(values, cand, out, acc):
    """``out[c] = #(values[:, c] < cand[c])`` for every column of ``values`` ``[rows, cols]``
    (C-contiguous): one row-major pass, 8 rows at a time into one-byte partial counts ``acc``
    (``[cols]`` uint8, flushed every ``_BLOCK_ROWS`` rows), which the compiler vectorises, 64
    one-byte values to an instruction. No branch, no scatter: cheaper than a histogram."""
    rows, cols = values.shape
    for c in range(cols):
        out[c] = 0
    r = 0
    while r < rows:
        stop = min(r + _BLOCK_ROWS, rows)
        for c in range(cols):
            acc[c] = 0
        while r + 8 <= stop:
            v0, v1, v2, v3 = values[r], values[r + 1], values[r + 2], values[r + 3]
            v4, v5, v6, v7 = values[r + 4], values[r + 5], values[r + 6], values[r + 7]
            for c in range(cols):
                x = cand[c]
                acc[c] += (np.uint8(v0[c] < x) + np.uint8(v1[c] < x) + np.uint8(v2[c] < x)
                           + np.uint8(v3[c] < x) + np.uint8(v4[c] < x) + np.uint8(v5[c] < x)
                           + np.uint8(v6[c] < x) + np.uint8(v7[c] < x))
            r += 8
        while r < stop:
            v0 = values[r]
            for c in range(cols):
                acc[c] += np.uint8(v0[c] < cand[c])
            r += 1
        for c in range(cols):
            out[c] += acc[c]


@numba.njit(**_JIT)
def _column_thresholds(counts, k, n_values, acc, below):
    """Every column's threshold count ``t`` (the largest with ``#(count >= t) >= k``, ``k >=
    1``), how many of its entries tied at ``t`` it selects (``need``) and whether that is all of
    them (``full``): a bitwise search of ``t`` from the top bit of ``n_values - 1`` down, one
    :func:`_count_below` pass per bit, then one for ``#(count > t)``."""
    rows, cols = counts.shape
    dt = counts.dtype.type
    t = np.zeros(cols, dtype=counts.dtype)
    at_least = np.full(cols, rows, dtype=np.int64)  # #(count >= t)
    cand = np.empty(cols, dtype=counts.dtype)
    nbits = 0
    while (1 << nbits) < n_values:
        nbits += 1
    for bit in range(nbits - 1, -1, -1):
        for c in range(cols):
            cand[c] = t[c] | dt(1 << bit)  # at most 2 ** nbits - 1: fits the counts' dtype
        _count_below(counts, cand, below, acc)
        for c in range(cols):
            if rows - below[c] >= k and cand[c] < n_values:
                t[c] = cand[c]
                at_least[c] = rows - below[c]
    top = dt(n_values - 1)
    for c in range(cols):
        cand[c] = t[c] + dt(1) if t[c] < top else t[c]
    _count_below(counts, cand, below, acc)
    need = np.empty(cols, dtype=np.int64)
    full = np.empty(cols, dtype=np.bool_)
    for c in range(cols):
        above = rows - below[c] if t[c] < top else 0
        need[c] = k - above
        full[c] = need[c] == at_least[c] - above
    return t, need, full


@numba.njit(**_JIT)
def _column_buckets(counts, kb, t, part, buckets):
    """Each entry's bucket into ``buckets`` (uint8, the counts' shape): ``_UNTIED`` unless it
    is tied at its column's partial threshold (``part``), else 0..254 by its ``|key|`` bits
    (``kb``: the keys as int32) >> ``_COL_SHIFT``, less the column's ``lo``, clamped (a
    monotone map, exact ties kept: an order on buckets that the keys refine). ``lo`` puts the
    column's largest finite tied key of about ``_SAMPLE_ROWS`` rows (any key when none ties
    there) at the top bucket: 8 binades of 32 buckets below it; the keys of the other rows only
    clamp. False when a tied key is NaN or infinite."""
    rows, cols = counts.shape
    finite = np.int32(_NON_FINITE)
    top = np.zeros(cols, dtype=np.int32)
    top_any = np.zeros(cols, dtype=np.int32)
    for r in range(0, rows, max(rows // _SAMPLE_ROWS, 1)):
        crow = counts[r]
        krow = kb[r]
        for c in range(cols):
            b = krow[c] & np.int32(0x7FFFFFFF)
            b = b if b < finite else np.int32(0)
            top_any[c] = max(top_any[c], b)
            top[c] = max(top[c], b if crow[c] == t[c] else np.int32(0))
    lo = np.empty(cols, dtype=np.int32)
    for c in range(cols):
        hi = top[c] if top[c] > 0 else top_any[c]
        lo[c] = max((hi >> np.int32(_COL_SHIFT)) - np.int32(_UNTIED - 1), np.int32(0))
    bad = np.zeros(cols, dtype=np.bool_)
    for r in range(rows):
        crow = counts[r]
        krow = kb[r]
        brow = buckets[r]
        for c in range(cols):  # vectorised
            tied = (crow[c] == t[c]) & part[c]
            b = krow[c] & np.int32(0x7FFFFFFF)
            bad[c] |= tied & (b >= finite)
            q = min(max((b >> np.int32(_COL_SHIFT)) - lo[c], np.int32(0)), np.int32(_UNTIED - 1))
            brow[c] = np.uint8(q) if tied else np.uint8(_UNTIED)
    return not bad.any()


@numba.njit(**_JIT)
def _cut_buckets(buckets, need, acc, below):
    """Per column, the bucket ``cut`` holding its ``need``-th smallest tied key (the largest
    with ``#(bucket < cut) < need``; ``need >= 1`` where a column ties, untied entries are in
    ``_UNTIED``, above every cut), ``lower = #(bucket < cut)`` and ``at = #(bucket == cut)``:
    a bitwise search, one :func:`_count_below` pass per bit, then one for ``at``."""
    cols = buckets.shape[1]
    cut = np.zeros(cols, dtype=np.uint8)
    lower = np.zeros(cols, dtype=np.int64)
    cand = np.empty(cols, dtype=np.uint8)
    for bit in range(7, -1, -1):
        for c in range(cols):
            cand[c] = cut[c] | np.uint8(1 << bit)
        _count_below(buckets, cand, below, acc)
        for c in range(cols):
            if cand[c] < _UNTIED and below[c] < need[c]:
                cut[c] = cand[c]
                lower[c] = below[c]
    for c in range(cols):
        cand[c] = cut[c] + np.uint8(1)  # at most _UNTIED
    _count_below(buckets, cand, below, acc)
    at = np.empty(cols, dtype=np.int64)
    for c in range(cols):
        at[c] = below[c] - lower[c]
    return cut, lower, at


@numba.njit(**_JIT)
def _mask_first_tied(counts, t, full, need, taken, mask):
    """The mask of every column that selects its counts above ``t`` and, of those equal to
    ``t``, all (``full``) or the first ``need`` in row order (``taken``: zeros, ``need``'s
    dtype), in one row-major pass, vectorised across the columns."""
    rows, cols = counts.shape
    for r in range(rows):
        crow = counts[r]
        mrow = mask[r]
        for c in range(cols):
            x = crow[c]
            tied = x == t[c]
            mrow[c] = (x > t[c]) | (tied & (full[c] | (taken[c] < need[c])))
            taken[c] += tied


@numba.njit(**_JIT)
def select_columns(counts, key, use_key, k, n_values, mask):
    """:func:`select_rows` for every *column* of the row-major ``counts`` ``[rows, cols]``
    (``k`` per column), without a transposed copy. Equal to a stable sort of each column by
    (count descending, ``|key|`` ascending, row ascending). Returns the number of selected
    weights, or -1 when a tied key is NaN or infinite.

    A column group ties on about half its entries (its threshold count is often 0 or the site
    count), so the tie-break is most of the work. Every step is a row-major pass over the
    whole layer, vectorised across the columns, without a histogram (a scatter of one
    increment per weight) and without a branch per weight:

    1. the threshold counts (:func:`_column_thresholds`): a bitwise search, a counting pass per
       bit of the largest count (5 for 16 sites) over the one-byte counts, which stay in cache;
    2. each tied entry's key bucket (:func:`_column_buckets`: the one pass over the keys);
    3. the bucket holding each column's cut (:func:`_cut_buckets`: 9 counting passes over the
       one-byte buckets): tied entries in a lower bucket are selected, in a higher one not;
    4. the mask, row by row, and the few tied entries in the cut bucket (about 1% of a
       column) gathered into per-column segments, where :func:`_take_tied` marks the first ones
       by (``|key|``, row).

    Without a key (index order), step 1 then the mask: a column's first ``need`` tied rows.
    """
    rows, cols = counts.shape
    if k < 0 or k > rows:
        return -2
    if k == 0:
        mask[:, :] = 0
        return 0
    acc = np.empty(cols, dtype=np.uint8)
    below = np.empty(cols, dtype=np.int64)
    t, need, full = _column_thresholds(counts, k, n_values, acc, below)
    part = ~full
    if not use_key or not part.any():  # index order: a column's first ``need`` tied rows
        if rows < 2 ** 31:  # int32 counters, 16 to a vector (int64: 8)
            _mask_first_tied(counts, t, full, need.astype(np.int32),
                             np.zeros(cols, dtype=np.int32), mask)
        else:
            _mask_first_tied(counts, t, full, need, np.zeros(cols, dtype=np.int64), mask)
        return k * cols
    buckets = np.empty((rows, cols), dtype=np.uint8)
    if not _column_buckets(counts, key.view(np.int32), t, part, buckets):
        return -1
    cut, lower, at = _cut_buckets(buckets, need, acc, below)
    start = np.zeros(cols + 1, dtype=np.int64)  # segments of the cut buckets' entries
    for c in range(cols):
        if part[c]:
            need[c] -= lower[c]  # of the cut bucket's entries
            start[c + 1] = start[c] + at[c]
        else:
            start[c + 1] = start[c]
            cut[c] = 0  # no entry below, none flagged (its entries are all _UNTIED)
    pos = start[:-1].copy()
    seg_keys = np.empty(start[cols], dtype=np.float32)
    seg_rows = np.empty(start[cols], dtype=np.int64)
    nwords = (cols + 7) // 8
    flag = np.zeros(nwords * 8, dtype=np.uint8)  # a row's cut-bucket entries, 8 to a word
    flag_words = flag.view(np.uint64)
    for r in range(rows):
        crow = counts[r]
        brow = buckets[r]
        mrow = mask[r]
        for c in range(cols):  # vectorised
            x = crow[c]
            q = brow[c]
            mrow[c] = (x > t[c]) | ((x == t[c]) & full[c]) | (q < cut[c])
            flag[c] = (q == cut[c]) & part[c]
        for w in range(nwords):  # a branch per word, then one per flagged entry: the flags
            x = flag_words[w]  # are bytes 0 or 1, so the lowest set bit of x is 8 * its byte
            while x:
                low = x & (~x + np.uint64(1))
                c = w * 8 + np.int64((low * _BYTE_INDEX) >> np.uint64(56))
                p = pos[c]
                seg_keys[p] = abs(key[r, c])
                seg_rows[p] = r
                pos[c] = p + 1
                x ^= low
    flat = mask.reshape(-1)
    for c in range(cols):
        if part[c] and not _take_tied(seg_keys[start[c]:start[c + 1]],
                                      seg_rows[start[c]:start[c + 1]], need[c], True,
                                      flat, cols, c):
            return -1
    return k * cols


# ---- applying the global mask ------------------------------------------------------------

@numba.njit(**_JIT)
def apply_mask(weight, mask, counts, n_clients, scale):
    """In place on float32 ``weight``: zero the masked weights; with ``scale``, multiply each
    kept weight by ``(n_clients - count) / n_clients`` (float32), in one pass. Counts must be
    in ``0..n_clients``, the mask 0 or 1. A pruned weight becomes +0.0 (as ``masked_fill``)."""
    flat_w = weight.reshape(-1)
    flat_m = mask.reshape(-1)
    flat_c = counts.reshape(-1)
    zero = np.float32(0)
    if scale:  # one pass, scale and zero together, vectorised: the factor computed per weight
        # (one division, exactly the factor of its count: no table gather) and a select, no
        # branch (masks are random bits)
        m = np.float32(n_clients)
        for i in range(flat_w.shape[0]):
            scaled = flat_w[i] * ((m - np.float32(flat_c[i])) / m)
            flat_w[i] = zero if flat_m[i] else scaled
        return
    for i in range(flat_w.shape[0]):
        flat_w[i] = zero if flat_m[i] else flat_w[i]
