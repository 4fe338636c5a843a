"""Compiled kernels (numba) of the server's aggregation hot path: counting votes on bit-packed
masks, selecting the top counts per comparison group, and applying the global mask.

Each kernel is one or two sequential passes over a layer, releases the GIL (``nogil``) so the
caller can run layers in parallel threads, and is compiled once per argument type (cached on
disk). The reference semantics are the pure-numpy definitions in the tests
(``tests/test_masks.py``: a stable sort by count descending, tie key ascending, index ascending).
"""

from __future__ import annotations

from functools import lru_cache

import numba
import numpy as np

_JIT = dict(nogil=True, cache=True)

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


_NON_FINITE = np.uint32(0x7F800000)  # |x|'s float32 bits at or above this: infinite or NaN
_SMALL_TIES = 48  # up to this many tied entries, ranks by counting; above, a radix select


@numba.njit(**_JIT)
def _kth_smallest_bits(bits, kth, prefix, top):
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


_RADIX_BUCKETS = 256  # most buckets of the histogram of :func:`_kth_smallest_radix`


@numba.njit(**_JIT)
def _kth_smallest_radix(bits, kth):
    """:func:`_kth_smallest_bits` of many keys in one radix step: a histogram of the keys' top
    bits (at most ``_RADIX_BUCKETS`` buckets between the lowest and highest key, 4 interleaved
    so that no increment waits on the previous one) gives the bucket holding the ``kth``
    smallest, and the bitwise search then runs on that bucket's keys only, over the bits below
    the bucket's. A column group ties on about half its entries (its threshold count is often
    0 or the site count): 31 counting passes over all of them took half its selection."""
    n = bits.shape[0]
    lo, hi = bits[0], bits[0]
    for i in range(n):  # vectorised
        lo = min(lo, bits[i])
        hi = max(hi, bits[i])
    shift = np.uint64(0)
    while (np.uint64(hi) >> shift) - (np.uint64(lo) >> shift) >= _RADIX_BUCKETS:
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
    for i in range(n):  # the bucket's keys (few: a branch rarely taken)
        if (np.uint64(bits[i]) >> shift) - base == star:
            cand[m] = bits[i]
            m += 1
    prefix = np.uint32((base + star) << shift)
    return _kth_smallest_bits(cand[:m], kth - below, prefix, np.int64(shift) - 1)


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


_KEY_SHIFT = 20  # a tied key's bucket: its float32 bits >> 20 (8 buckets per binade)
_KEY_BUCKETS = 256  # buckets per column: 32 binades below the column's largest |key|


@numba.njit(**_JIT)
def _key_buckets(counts, kb, tie, lo, bkt, khist):
    """Every weight's key bucket into ``bkt`` (uint8: ``(|key| bits >> _KEY_SHIFT) - lo[c]``,
    clamped to ``0.._KEY_BUCKETS-1``, a monotone map of ``|key|``), and the histogram
    ``khist[bucket, c]`` of the entries tied at their column's threshold (``count == tie[c]``).
    Row by row: the buckets without a branch (vectorised) into a row of flat indices, then one
    increment per weight (0 for an untied one: a branch per weight would mispredict)."""
    rows, cols = counts.shape
    flat = khist.reshape(-1)
    idx = np.empty(cols, dtype=np.int64)
    inc = np.empty(cols, dtype=khist.dtype)
    top = np.int32(_KEY_BUCKETS - 1)
    for r in range(rows):
        crow = counts[r]
        krow = kb[r]
        brow = bkt[r]
        for c in range(cols):
            b = krow[c] & np.int32(0x7FFFFFFF)
            bk = min(max((b >> np.int32(_KEY_SHIFT)) - lo[c], np.int32(0)), top)
            brow[c] = bk
            idx[c] = bk * cols + c
            inc[c] = crow[c] == tie[c]
        for c in range(cols):
            flat[idx[c]] += inc[c]


@numba.njit(**_JIT)
def _cut_buckets(khist, tie, need, cut, start):
    """Per column with a tie: the bucket ``cut[c]`` of ``khist`` ``[buckets, cols]`` holding its
    ``need[c]``-th smallest tied key; ``need[c]`` becomes the number the column takes of that
    bucket's entries, ``start`` the per-column segments (prefix sums) of those entries."""
    for c in range(tie.shape[0]):
        start[c + 1] = start[c]
        if tie[c] >= 0:
            below = 0
            for b in range(khist.shape[0]):
                h = np.int64(khist[b, c])
                if below + h >= need[c]:
                    cut[c] = b
                    need[c] -= below
                    start[c + 1] += h
                    break
                below += h


@numba.njit(**_JIT)
def select_columns(counts, key, use_key, k, n_values, mask):
    """:func:`select_rows` for every *column* of the row-major ``counts`` ``[rows, cols]``
    (``k`` per column), without a transposed copy. Equal to a stable sort of each column by
    (count descending, ``|key|`` ascending, row ascending). Returns the number of selected
    weights, or -1 when a tied key is NaN or infinite.

    A column group ties on about half its entries (its threshold count is often 0 or the site
    count), so the tie-break is most of the work; it runs on row-major passes, none of them
    gathering the tied entries:

    1. every column's count histogram (``[n_values, cols]``, in cache) and largest ``|key|``,
       which give its threshold count (``count >= thr``: selected outright), the count tied at
       the threshold and how many of the tied entries it takes (``need``);
    2. each tied entry's key bucket (:func:`_key_buckets`: 8 per binade, the column's 32
       binades below its largest key) and every column's histogram of its tied entries'
       buckets, which gives the bucket holding the ``need``-th smallest tied key: tied entries
       in a lower bucket are selected, in a higher one not;
    3. the mask, row by row, and the few tied entries in the cut bucket (about 1% of a column)
       gathered into per-column segments, where a radix select (:func:`_take_tied`) marks the
       first ones by (``|key|``, row).
    """
    rows, cols = counts.shape
    if k < 0 or k > rows:
        return -2
    if k == 0:
        mask[:, :] = 0
        return 0
    hist = np.zeros((n_values, cols), dtype=np.int32)
    kb = key.view(np.int32)
    top = np.zeros(cols, dtype=np.int32)  # the column's largest |key| bits
    for r in range(rows):
        crow = counts[r]
        for c in range(cols):
            hist[crow[c], c] += 1
        if use_key:
            krow = kb[r]
            for c in range(cols):
                top[c] = max(top[c], krow[c] & np.int32(0x7FFFFFFF))
    thr = np.empty(cols, dtype=np.int32)  # count >= thr[c]: selected outright
    tie = np.full(cols, -1, dtype=np.int32)  # the count tied at the threshold (-1: none)
    need = np.zeros(cols, dtype=np.int64)
    for c in range(cols):
        ge = 0
        for v in range(n_values - 1, -1, -1):
            h = hist[v, c]
            ge += h
            if ge >= k:
                nd = k - (ge - h)
                if nd == h:
                    thr[c] = v
                else:
                    thr[c] = v + 1
                    tie[c] = v
                    need[c] = nd
                break
    if not use_key:  # index order: a column's first ``need`` tied rows, as they come
        taken = np.zeros(cols, dtype=np.int64)
        for r in range(rows):
            for c in range(cols):
                x = counts[r, c]
                sel = x >= thr[c]
                if x == tie[c] and taken[c] < need[c]:
                    sel = True
                    taken[c] += 1
                mask[r, c] = sel
        return k * cols
    finite = np.int32(_NON_FINITE)
    for c in range(cols):
        if top[c] >= finite:  # a NaN or infinite key in the column (rare): an error when tied,
            top[c] = 0  # else the column's largest finite key sets its buckets
            for r in range(rows):
                b = kb[r, c] & np.int32(0x7FFFFFFF)
                if b >= finite:
                    if counts[r, c] == tie[c]:
                        return -1
                else:
                    top[c] = max(top[c], b)
    lo = np.empty(cols, dtype=np.int32)
    for c in range(cols):
        lo[c] = max((top[c] >> np.int32(_KEY_SHIFT)) - np.int32(_KEY_BUCKETS - 1), np.int32(0))
    bkt = np.empty((rows, cols), dtype=np.uint8)
    cut = np.full(cols, -1, dtype=np.int32)  # the bucket holding the need-th smallest tied key
    start = np.zeros(cols + 1, dtype=np.int64)  # segments of the cut buckets' entries
    if rows < 65536:  # a bucket's count fits 16 bits: half the histogram's cache
        khist16 = np.zeros((_KEY_BUCKETS, cols), dtype=np.uint16)
        _key_buckets(counts, kb, tie, lo, bkt, khist16)
        _cut_buckets(khist16, tie, need, cut, start)
    else:
        khist = np.zeros((_KEY_BUCKETS, cols), dtype=np.int64)
        _key_buckets(counts, kb, tie, lo, bkt, khist)
        _cut_buckets(khist, tie, need, cut, start)
    pos = start[:-1].copy()
    seg_keys = np.empty(start[cols], dtype=np.float32)
    seg_rows = np.empty(start[cols], dtype=np.int64)
    nwords = (cols + 7) // 8
    flag = np.zeros(nwords * 8, dtype=np.uint8)  # a row's cut-bucket entries, 8 to a word
    flag_words = flag.view(np.uint64)
    for r in range(rows):
        crow = counts[r]
        brow = bkt[r]
        mrow = mask[r]
        for c in range(cols):  # vectorised
            x = crow[c]
            bk = np.int32(brow[c])
            t = x == tie[c]
            mrow[c] = (x >= thr[c]) | (t & (bk < cut[c]))
            flag[c] = t & (bk == cut[c])
        for q in range(nwords):  # a branch per word; one per entry only where a word has one
            if flag_words[q]:
                for c in range(q * 8, q * 8 + 8):
                    if flag[c]:
                        p = pos[c]
                        seg_keys[p] = abs(key[r, c])
                        seg_rows[p] = r
                        pos[c] = p + 1
    flat = mask.reshape(-1)
    for c in range(cols):
        if tie[c] >= 0 and not _take_tied(seg_keys[start[c]:start[c + 1]],
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
