"""Exact, hand-checked tests of mask aggregation and the mask codec."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcompress.masks.aggregate import (
    apply_global_mask,
    count_dtype,
    count_packed,
    count_words,
    global_mask,
    payload_words,
    scale_weights,
    vote_counts,
)
from fedcompress.masks.codec import MaskDecodeError, check_packed, decode_mask, encode_mask

B = torch.tensor  # shorthand


def test_count_dtype_is_wide_enough():
    assert count_dtype(1) == torch.uint8
    assert count_dtype(255) == torch.uint8
    assert count_dtype(256) == torch.int16
    assert count_dtype(40000) == torch.int32


def test_vote_counts_hand_checked():
    m1 = B([[1, 0, 1], [0, 0, 1]], dtype=torch.bool)
    m2 = B([[1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    m3 = B([[1, 0, 0], [1, 0, 1]], dtype=torch.bool)
    counts = vote_counts([m1, m2, m3], 3)
    assert counts.tolist() == [[3, 1, 1], [1, 0, 3]]
    assert counts.dtype == torch.uint8


def test_counts_do_not_overflow_with_300_clients():
    counts = vote_counts([torch.ones(2, 2, dtype=torch.bool)] * 300, 300)
    assert counts.tolist() == [[300, 300], [300, 300]]


def test_vote_counts_reject_bad_masks():
    with pytest.raises(ValueError, match="shape"):
        vote_counts([torch.zeros(2, 3, dtype=torch.bool), torch.zeros(3, 2, dtype=torch.bool)])
    with pytest.raises(TypeError, match="bool"):
        vote_counts([torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="announced"):
        vote_counts([torch.zeros(2, 3, dtype=torch.bool)] * 3, 2)
    with pytest.raises(ValueError, match="no masks"):
        vote_counts([])


@pytest.mark.parametrize("m", [1, 2, 3, 7, 64, 255, 256, 300])
def test_count_packed_equals_unpacked_sum(m):
    rng = np.random.default_rng(m)
    for numel in (1, 7, 8, 9, 63, 64, 65, 1000, 4099, 40_001):  # 40_001: several chunks
        masks = rng.random((m, numel)) < rng.random()
        counts = count_packed([np.packbits(x) for x in masks], numel)
        assert counts.dtype == count_dtype(m)
        assert counts.tolist() == masks.sum(0).tolist()


def test_payload_words_view_the_payload_without_copying():
    payload = np.packbits(np.random.default_rng(0).random(640) < 0.5)  # 80 bytes: 10 words
    words = payload_words(payload, 80)
    assert np.shares_memory(words, payload) and not words.flags.writeable
    received = np.frombuffer(payload.tobytes(), dtype=np.uint8)  # read-only, as Flower's
    assert np.shares_memory(payload_words(received, 80), received)


def test_payload_words_copy_odd_lengths_and_unaligned_buffers():
    rng = np.random.default_rng(1)
    masks = rng.random((3, 130)) < 0.5  # 17 bytes: not a whole number of words
    odd = [np.packbits(x) for x in masks]
    buffer = np.zeros(8 * 3 + 1, dtype=np.uint8)
    unaligned = buffer[1:].reshape(3, 8)  # 64 weights each, starting at an odd address
    unaligned[:] = np.packbits(rng.random((3, 64)) < 0.5, axis=1)
    for payloads, numel in ((odd, 130), (list(unaligned), 64)):
        words = [payload_words(p, len(p)) for p in payloads]
        assert not any(np.shares_memory(w, p) for w, p in zip(words, payloads))
        expected = np.unpackbits(np.stack(payloads), axis=1)[:, :numel].sum(0)
        assert count_words(words, numel).tolist() == expected.tolist()


def test_count_words_refuses_what_payload_words_did_not_make():
    good = payload_words(np.zeros(8, dtype=np.uint8), 8)
    with pytest.raises(ValueError, match="mask 1"):
        count_words([good, np.zeros(2, dtype=np.uint64)], 64)
    with pytest.raises(ValueError, match="shape"):
        payload_words(np.zeros(9, dtype=np.uint8), 8)


def _reference_top(counts, key, k, dim):
    """The obvious implementation: stable sort by key, then stable sort by count descending."""
    mask = torch.zeros_like(counts, dtype=torch.bool)
    if k == 0:
        return mask
    by_key = torch.sort(key, dim=dim, stable=True).indices
    ranked = torch.gather(counts.to(torch.int64), dim, by_key)
    order = torch.gather(by_key, dim, torch.sort(-ranked, dim=dim, stable=True).indices)
    mask.scatter_(dim, order.narrow(dim, 0, k), True)
    return mask


@pytest.mark.parametrize("tie_break", ["magnitude", "random", "index"])
@pytest.mark.parametrize("group", ["layer", "row", "column"])
@pytest.mark.parametrize("clients", [1, 3, 16])
@pytest.mark.parametrize("shape", [(24, 40), (30, 6), (5, 70)])  # (30, 6): rows shorter than
def test_global_mask_equals_sorting_reference(group, tie_break, clients, shape):  # the counts
    gen = torch.Generator().manual_seed(clients)
    rows, cols = shape
    weight = torch.randn(rows, cols, generator=gen).round(decimals=1)  # many |W| ties too
    counts = torch.randint(0, clients + 1, shape, generator=gen, dtype=torch.uint8)
    if tie_break == "magnitude":
        key = weight.abs()
    elif tie_break == "random":
        key = torch.rand(counts.shape, generator=torch.Generator().manual_seed(5))
    else:
        key = torch.zeros(counts.shape)
    for sparsity in (0.0, 0.1, 0.5, 0.9):
        got = global_mask(counts, sparsity, group, tie_break, weight, seed=5)
        if group == "layer":
            want = _reference_top(counts.reshape(1, -1), key.reshape(1, -1),
                                  int(sparsity * counts.numel()), 1).reshape(counts.shape)
        elif group == "row":
            want = _reference_top(counts, key, int(sparsity * cols), 1)
        else:
            want = _reference_top(counts, key, int(sparsity * rows), 0)
        assert torch.equal(got, want), (group, tie_break, sparsity)


def test_global_mask_refuses_nan_weights_at_ties():
    counts = torch.zeros(2, 4, dtype=torch.uint8)
    weight = torch.tensor([[0.1, float("nan"), 0.2, 0.3], [0.1, 0.2, 0.3, 0.4]])
    with pytest.raises(ValueError, match="NaN"):
        global_mask(counts, 0.5, "row", "magnitude", weight)


def test_check_packed_counts_bits_and_refuses_padding():
    mask = torch.tensor([[True, False, True], [True, True, False]])
    payload = encode_mask(mask)
    assert check_packed(payload, (2, 3)) == 4
    bad = payload.copy()
    bad[-1] |= 1
    with pytest.raises(MaskDecodeError, match="padding"):
        check_packed(bad, (2, 3))


COUNTS = B([[3, 1, 1, 0], [2, 2, 0, 3]])
WEIGHT = B([[0.5, -0.1, 0.2, 0.9], [0.3, -0.05, 0.7, 0.4]])


def test_global_mask_layer_group():
    # 50% of 8 = 4 highest counts: 3, 3, then the two 2s.
    mask = global_mask(COUNTS, 0.5, "layer", weight=WEIGHT)
    assert mask.tolist() == [[True, False, False, False], [True, True, False, True]]


def test_global_mask_row_group_tie_by_magnitude():
    # per row 2: row0 = 3 then a tie 1 vs 1 -> smaller |W| (0.1 at col 1) is pruned.
    mask = global_mask(COUNTS, 0.5, "row", tie_break="magnitude", weight=WEIGHT)
    assert mask.tolist() == [[True, True, False, False], [False, True, False, True]]
    # row1: 3, then tie 2 vs 2 -> |-0.05| < 0.3 -> col 1.


def test_global_mask_row_group_tie_by_index():
    mask = global_mask(COUNTS, 0.5, "row", tie_break="index")
    assert mask.tolist() == [[True, True, False, False], [True, False, False, True]]


def test_global_mask_column_group():
    mask = global_mask(COUNTS, 0.5, "column", weight=WEIGHT)
    # each column keeps one of two rows: col0 3>2, col1 2>1, col2 tie 1 vs 0 -> row0, col3 3>0
    assert mask.tolist() == [[True, False, True, False], [False, True, False, True]]


def test_global_mask_random_ties_are_seeded():
    counts = torch.zeros(8, 8, dtype=torch.uint8)  # all tied
    a = global_mask(counts, 0.5, "layer", tie_break="random", seed=1)
    b = global_mask(counts, 0.5, "layer", tie_break="random", seed=1)
    c = global_mask(counts, 0.5, "layer", tie_break="random", seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.sum()) == 32


def test_global_mask_nm():
    counts = B([[0, 3, 1, 2, 5, 5, 0, 1]])
    mask = global_mask(counts, 0.0, nm=(2, 4), tie_break="index")
    assert mask.tolist() == [[False, True, False, True, True, True, False, False]]


def test_one_client_global_mask_equals_its_mask():
    torch.manual_seed(0)
    w = torch.randn(16, 32)
    mine = torch.zeros_like(w, dtype=torch.bool)
    mine.view(-1)[torch.randperm(w.numel())[: w.numel() // 2]] = True
    for group in ("layer",):
        assert torch.equal(global_mask(vote_counts([mine], 1), 0.5, group, weight=w), mine)


def test_scale_weights():
    w = torch.tensor([[1.0, 2.0], [4.0, -8.0]], dtype=torch.bfloat16)
    counts = torch.tensor([[0, 1], [2, 3]], dtype=torch.uint8)
    scaled = scale_weights(w, counts, 4)
    assert scaled.dtype == torch.bfloat16
    assert scaled.float().tolist() == [[1.0, 1.5], [2.0, -2.0]]


@pytest.mark.parametrize("scale", [False, True])
def test_apply_global_mask_equals_scale_then_zero(scale):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 40, generator=gen)
    counts = torch.randint(0, 8, (24, 40), generator=gen, dtype=torch.uint8)
    mask = torch.rand(24, 40, generator=gen) < 0.5
    expected = (scale_weights(w, counts, 7) if scale else w.clone()).masked_fill(mask, 0)
    got = w.clone()
    apply_global_mask(got, mask, counts, 7, scale)  # the compiled float32 path
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match=r"outside \[0, 6\]"):
        apply_global_mask(w.clone(), mask, counts, 6, True)


def test_bad_sparsity_and_group_and_tie_break():
    with pytest.raises(ValueError, match=r"outside \[0, 1\)"):
        global_mask(COUNTS, 1.0, "layer", weight=WEIGHT)
    with pytest.raises(ValueError, match="comparison group"):
        global_mask(COUNTS, 0.5, "block", weight=WEIGHT)
    with pytest.raises(ValueError, match="tie-break"):
        global_mask(COUNTS, 0.5, "row", tie_break="coin")


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (64, 128), (7, 9)])
def test_codec_round_trip(shape):
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(shape, generator=gen) < 0.5
    payload = encode_mask(mask)
    assert payload.dtype == np.uint8 and payload.size == (mask.numel() + 7) // 8
    assert torch.equal(decode_mask(payload, shape), mask)


def test_codec_refuses_garbage():
    mask = torch.ones(3, 5, dtype=torch.bool)
    payload = encode_mask(mask)
    with pytest.raises(MaskDecodeError, match="expected 2 bytes"):
        decode_mask(payload[:1], (3, 5))
    with pytest.raises(MaskDecodeError, match="uint8"):
        decode_mask(payload.astype(np.float32), (3, 5))
    with pytest.raises(MaskDecodeError, match="padding"):
        decode_mask(np.array([255, 255], dtype=np.uint8), (3, 5))
    with pytest.raises(MaskDecodeError, match="expected 3 bytes"):
        decode_mask(payload, (4, 5))
