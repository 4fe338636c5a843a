"""Mask statistics: exact, hand-checked values on tiny masks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcompress.masks import stats


def b(*rows):
    return torch.tensor(rows, dtype=torch.bool)


# Three clients, two layers ("a": 1x4, "b": 1x2). Vote counts: a = [3, 2, 1, 0], b = [1, 0].
M1 = {"a": b([1, 1, 0, 0]), "b": b([0, 0])}
M2 = {"a": b([1, 0, 1, 0]), "b": b([0, 0])}
M3 = {"a": b([1, 1, 0, 0]), "b": b([1, 0])}
CLIENTS = [M1, M2, M3]


def test_hamming_per_layer_and_overall():
    a = {"x": b([1, 0, 0], [1, 1, 0]), "y": b([1, 0, 1, 0])}
    c = {"x": b([1, 1, 0], [0, 1, 0]), "y": b([1, 0, 1, 0])}
    h = stats.hamming(a, c)
    assert h.num == {"x": 2, "y": 0} and h.den == {"x": 6, "y": 4}
    assert h.per_layer == {"x": 2 / 6, "y": 0.0}
    assert h.overall == 0.2  # 2 / 10, not the mean of the per-layer ratios (1/6)
    assert stats.hamming_distance(a["x"], c["x"]) == 2 / 6
    assert stats.hamming_distance(a, a) == 0.0


def test_hamming_rejects_mismatches():
    with pytest.raises(ValueError, match="different layers"):
        stats.hamming({"a": b([1])}, {"b": b([1])})
    with pytest.raises(ValueError, match="shapes"):
        stats.hamming(b([1, 0]), b([1, 0, 0]))
    with pytest.raises(TypeError, match="bool"):
        stats.hamming(torch.tensor([1, 0]), torch.tensor([1, 0]))


def test_flatten_walker_list_uses_wire_keys():
    from fedcompress.methods.fedprllm.federated import mask_key

    flat = stats.flatten_masks([{"q": b([1])}, {"q": b([0]), "k": b([1])}], first_layer=2)
    assert list(flat) == [mask_key(2, "q"), mask_key(3, "q"), mask_key(3, "k")]
    assert list(stats.flatten_masks(b([1]))) == ["mask"]


def test_ratio_regrouping():
    a = [{"q": b([1, 1]), "k": b([1, 0, 0, 0])}, {"q": b([0, 0])}]
    c = [{"q": b([0, 1]), "k": b([0, 0, 0, 1])}, {"q": b([1, 1])}]
    h = stats.hamming(a, c)
    assert h.per_layer == {"layers.0.q": 0.5, "layers.0.k": 0.5, "layers.1.q": 1.0}
    by_layer = h.by_decoder_layer()
    assert by_layer.num == {"layers.0": 3, "layers.1": 2}
    assert by_layer.den == {"layers.0": 6, "layers.1": 2}
    by_linear = h.by_linear()
    assert by_linear.per_layer == {"q": 3 / 4, "k": 2 / 4}
    assert by_layer.overall == h.overall == by_linear.overall == 5 / 8


def test_pairwise_hamming_matrix():
    d = stats.pairwise_hamming_matrix(CLIENTS)
    expected = np.array([[0, 2, 1], [2, 0, 3], [1, 3, 0]]) / 6
    np.testing.assert_array_equal(d, expected)
    assert d.dtype == np.float64


def test_mean_pairwise_hamming_from_counts_matches_pairs():
    counts = stats.vote_counts_of(CLIENTS)
    assert counts["a"].tolist() == [[3, 2, 1, 0]] and counts["b"].tolist() == [[1, 0]]
    mean = stats.mean_pairwise_hamming(counts, 3)
    assert mean.num == {"a": 4, "b": 2}  # sum c(m-c): a 0+2+2+0, b 2+0
    assert mean.den == {"a": 12, "b": 6}  # numel * 3 pairs
    assert mean.per_layer == {"a": 1 / 3, "b": 1 / 3}
    assert mean.overall == 1 / 3
    # the same as averaging the pairwise matrix
    d = stats.pairwise_hamming_matrix(CLIENTS)
    assert math.isclose(mean.overall, d[np.triu_indices(3, 1)].mean(), rel_tol=0, abs_tol=1e-15)


def test_counts_of_narrow_dtype_are_exact():
    # uint8 counts of 255 clients: c(m-c) overflows uint8 unless widened
    counts = {"a": torch.tensor([100, 255, 0], dtype=torch.uint8)}
    mean = stats.mean_pairwise_hamming(counts, 255)
    assert mean.num == {"a": 100 * 155}
    assert mean.den == {"a": 3 * 255 * 254 // 2}


def test_counts_validation():
    with pytest.raises(ValueError, match="outside"):
        stats.unanimity({"a": torch.tensor([4])}, 3)
    with pytest.raises(TypeError, match="integer"):
        stats.unanimity({"a": torch.tensor([1.0])}, 3)
    with pytest.raises(ValueError, match="at least 2"):
        stats.mean_pairwise_hamming({"a": torch.tensor([1])}, 1)
    with pytest.raises(ValueError, match="at least 2"):
        stats.pairwise_hamming_matrix([M1])


def test_unanimity():
    u = stats.unanimity(stats.vote_counts_of(CLIENTS), 3)
    assert u.per_layer == {"a": 0.5, "b": 0.5}
    assert u.overall == 0.5


def test_mean_pairwise_jaccard():
    j = stats.mean_pairwise_jaccard(CLIENTS)
    # a: J12 = 1/3, J13 = 1, J23 = 1/3; b: J12 = 1 (both empty), J13 = 0, J23 = 0
    assert math.isclose(j.per_layer["a"], 5 / 9, abs_tol=1e-15)
    assert math.isclose(j.per_layer["b"], 1 / 3, abs_tol=1e-15)
    # overall per pair over both layers: 1/3, 2/3, 1/4
    assert math.isclose(j.overall, (1 / 3 + 2 / 3 + 1 / 4) / 3, abs_tol=1e-15)


def test_vote_histogram():
    h = stats.vote_histogram(stats.vote_counts_of(CLIENTS), 3)
    assert h.per_layer["a"].tolist() == [1, 1, 1, 1]
    assert h.per_layer["b"].tolist() == [1, 1, 0, 0]
    assert h.overall.tolist() == [2, 2, 1, 1]
    assert h.overall.dtype == np.int64
    np.testing.assert_array_equal(h.fractions(), np.array([2, 2, 1, 1]) / 6)
    assert h.to_dict()["overall"] == [2, 2, 1, 1]
    with pytest.raises(ValueError):
        stats.vote_histogram({"a": torch.tensor([1])}, 0)


def test_vote_histogram_of_aggregator_counts():
    from fedcompress.masks.aggregate import vote_counts

    counts = vote_counts([M["a"] for M in CLIENTS], 3)  # uint8
    assert stats.vote_histogram(counts, 3).overall.tolist() == [1, 1, 1, 1]


def test_binary_entropy():
    assert stats.binary_entropy(0.5) == 1.0
    assert stats.binary_entropy(0.0) == stats.binary_entropy(1.0) == 0.0
    assert math.isclose(stats.binary_entropy(0.25), 0.5 + 0.75 * math.log2(4 / 3), abs_tol=1e-15)
    with pytest.raises(ValueError):
        stats.binary_entropy(1.5)


def test_mask_entropy():
    e = stats.mask_entropy(M1)
    assert e.per_layer == {"a": 1.0, "b": 0.0}
    assert e.overall == 4 / 6  # 4 bits for layer a, 0 for b, over 6 weights


def test_joint_counts_and_conditional_entropy():
    x, y = b([1, 1, 1, 0]), b([1, 1, 0, 0])
    assert stats.joint_counts(x, y).tolist() == [[1, 0], [1, 2]]
    # given y = 1: x = 1, 1 (0 bits); given y = 0: x = 1, 0 (1 bit); each half of the positions
    assert stats.conditional_entropy(x, y).overall == 0.5
    assert stats.conditional_entropy(y, y).overall == 0.0
    assert stats.conditional_entropy(b([1, 1, 0, 0]), b([1, 0, 1, 0])).overall == 1.0
    # per layer vs pooled tables
    c = stats.conditional_entropy({"p": x, "q": b([1, 0])}, {"p": y, "q": b([1, 1])})
    assert c.per_layer == {"p": 0.5, "q": 1.0}
    # pooled: y=1 on 4 positions with x = 1,1,1,0 -> H(3/4); y=0 on 2 with x = 1,0 -> 1
    assert math.isclose(c.overall, 4 / 6 * stats.binary_entropy(0.75) + 2 / 6 * 1.0,
                        abs_tol=1e-15)


def test_on_walker_masks_of_a_tiny_model(tiny_model):
    from fedcompress.methods.fedprllm.federated import expected_shapes
    from fedcompress.pruning.local import PruneConfig, local_masks

    model = tiny_model("llama", n_layers=2)
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randint(0, 128, (2, 16), generator=gen)
    w2 = torch.randint(0, 128, (2, 16), generator=gen)
    config = PruneConfig("wanda", 0.5, "row")
    m1 = local_masks(model, w1, config).masks
    m1_again = local_masks(model, w1, config).masks
    m2 = local_masks(model, w2, config).masks
    h = stats.hamming(m1, m2)
    assert set(h.num) == set(expected_shapes(model))
    assert stats.hamming(m1, m1_again).overall == 0.0
    assert 0.0 <= h.overall <= 1.0
    assert stats.mask_entropy(m1).overall == 1.0  # exactly half of every row pruned
