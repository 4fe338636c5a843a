"""Client partitions: coverage, determinism, skew, and errors."""

from __future__ import annotations

import numpy as np
import pytest

from fedcompress.data import (
    InvalidParameterError,
    PartitionError,
    dirichlet_partition,
    iid_partition,
)


def assert_exact_cover(parts: list[np.ndarray], n_items: int) -> None:
    """Every item in exactly one part; parts sorted int64."""
    for part in parts:
        assert part.dtype == np.int64
        assert np.all(np.diff(part) > 0)
    joined = np.concatenate(parts)
    assert joined.size == n_items
    assert np.array_equal(np.sort(joined), np.arange(n_items))


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("n_items", "n_clients"), [(10, 3), (128, 8), (7, 7), (1, 1)])
def test_iid_is_balanced_exact_and_seeded(n_items: int, n_clients: int) -> None:
    parts = iid_partition(n_items, n_clients, seed=0)
    assert len(parts) == n_clients
    assert_exact_cover(parts, n_items)
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert same(parts, iid_partition(n_items, n_clients, seed=0))


def test_iid_differs_across_seeds() -> None:
    assert not same(iid_partition(100, 4, seed=0), iid_partition(100, 4, seed=1))


@pytest.mark.parametrize("labels", [None, np.repeat(["wiki", "c4", "ptb"], 100)])
@pytest.mark.parametrize("alpha", [0.01, 0.5, 100.0])
def test_dirichlet_covers_every_item_once(labels, alpha: float) -> None:
    parts = dirichlet_partition(300, 10, alpha, seed=7, labels=labels, min_per_client=2)
    assert len(parts) == 10
    assert_exact_cover(parts, 300)
    assert min(p.size for p in parts) >= 2
    assert same(parts, dirichlet_partition(300, 10, alpha, seed=7, labels=labels,
                                           min_per_client=2))


def test_dirichlet_differs_across_seeds() -> None:
    assert not same(dirichlet_partition(200, 5, 0.5, seed=0),
                    dirichlet_partition(200, 5, 0.5, seed=1))


def test_quantity_skew_small_alpha_is_skewed_large_alpha_balanced() -> None:
    n, k = 1000, 10
    skewed = [
        max(p.size for p in dirichlet_partition(n, k, 0.05, seed=s)) / n for s in range(10)
    ]
    assert np.mean(skewed) > 0.5  # one client usually holds most items
    balanced = dirichlet_partition(n, k, 1e6, seed=0)
    assert all(abs(p.size - n / k) <= 3 for p in balanced)


def test_label_skew_small_alpha_is_skewed_large_alpha_balanced() -> None:
    labels = np.repeat(np.array(["wiki", "c4", "ptb"]), 200)
    n, k = labels.size, 6

    def dominant_share(parts: list[np.ndarray]) -> float:
        shares = []
        for part in parts:
            _, counts = np.unique(labels[part], return_counts=True)
            shares.append(counts.max() / part.size)
        return float(np.mean(shares))

    skewed = dirichlet_partition(n, k, 0.01, seed=0, labels=labels)
    assert dominant_share(skewed) > 0.9  # each client essentially holds one source
    balanced = dirichlet_partition(n, k, 1e6, seed=0, labels=labels)
    assert dominant_share(balanced) < 0.4  # every client holds about 1/3 of each
    for part in balanced:
        assert abs(part.size - n / k) <= 3


def test_label_skew_repairs_clients_left_empty() -> None:
    labels = np.repeat(np.array([0, 1]), 50)
    # two labels, tiny alpha, 8 clients: most clients get nothing before the repair
    parts = dirichlet_partition(100, 8, 0.001, seed=0, labels=labels, min_per_client=3)
    assert_exact_cover(parts, 100)
    assert min(p.size for p in parts) >= 3


def test_min_per_client_zero_allows_empty_clients() -> None:
    parts = dirichlet_partition(20, 10, 0.001, seed=0, min_per_client=0)
    assert_exact_cover(parts, 20)
    assert any(p.size == 0 for p in parts)


@pytest.mark.parametrize(
    ("call", "error", "pattern"),
    [
        (lambda: iid_partition(10, 0, 0), InvalidParameterError, "n_clients must be a positive"),
        (lambda: iid_partition(0, 1, 0), InvalidParameterError, "n_items must be a positive"),
        (lambda: iid_partition(3, 4, 0), PartitionError, "more clients than windows"),
        (lambda: dirichlet_partition(3, 4, 1.0, 0), PartitionError, "more clients than windows"),
        (lambda: dirichlet_partition(10, 0, 1.0, 0), InvalidParameterError, "n_clients"),
        (lambda: dirichlet_partition(10, 2, 0.0, 0), InvalidParameterError, "alpha must be a"),
        (lambda: dirichlet_partition(10, 2, -1.0, 0), InvalidParameterError, "got -1.0"),
        (lambda: dirichlet_partition(10, 2, float("inf"), 0), InvalidParameterError, "finite"),
        (lambda: dirichlet_partition(10, 2, 1.0, -5), InvalidParameterError, "seed"),
        (lambda: dirichlet_partition(10, 3, 1.0, 0, min_per_client=4), PartitionError,
         r"at least 4 items out of 10"),
        (lambda: dirichlet_partition(10, 3, 1.0, 0, min_per_client=-1), InvalidParameterError,
         "min_per_client"),
        (lambda: dirichlet_partition(10, 3, 1.0, 0, labels=[0] * 9), InvalidParameterError,
         "length n_items=10"),
    ],
)
def test_errors(call, error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        call()
    assert issubclass(error, ValueError)
