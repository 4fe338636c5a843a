"""Assigning items (calibration windows, examples) to federated clients.

Every function returns one sorted ``int64`` index array per client; together they cover
``range(n_items)`` exactly once (no item dropped, none duplicated). All randomness comes from
``numpy.random.default_rng(seed)``.

* :func:`iid_partition`: a seeded permutation cut into ``n_clients`` nearly equal parts.
* :func:`dirichlet_partition` without labels: *quantity skew*, client sizes follow
  ``Dirichlet(alpha)``.
* :func:`dirichlet_partition` with labels: *label skew*, for every label the share of its items
  given to each client follows ``Dirichlet(alpha)`` (e.g. labels = the source corpus of each
  window, as in FedPrLLM's non-IID setup over WikiText2 / C4 / PTB).

Small ``alpha`` gives very uneven clients; large ``alpha`` approaches the balanced split.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from fedcompress.data.errors import (
    InvalidParameterError,
    PartitionError,
    check_positive_int,
    check_seed,
)

__all__ = ["dirichlet_partition", "iid_partition"]

logger = logging.getLogger(__name__)


def iid_partition(n_items: int, n_clients: int, seed: int) -> list[np.ndarray]:
    """Split ``range(n_items)`` into ``n_clients`` random parts whose sizes differ by at most 1.

    Raises:
        InvalidParameterError: a count is not a positive integer or ``seed`` is invalid.
        PartitionError: more clients than items.
    """
    n_items, n_clients = _check_counts(n_items, n_clients)
    rng = np.random.default_rng(check_seed(seed))
    permutation = rng.permutation(n_items)
    return [np.sort(part).astype(np.int64) for part in np.array_split(permutation, n_clients)]


def dirichlet_partition(
    n_items: int,
    n_clients: int,
    alpha: float,
    seed: int,
    labels: Sequence[object] | np.ndarray | None = None,
    min_per_client: int = 1,
) -> list[np.ndarray]:
    """Non-IID split of ``range(n_items)`` driven by ``Dirichlet(alpha)``.

    Without ``labels`` (quantity skew): proportions ``p ~ Dirichlet(alpha * 1)`` over clients are
    drawn once; every client first receives ``min_per_client`` items and the remaining
    ``n_items - n_clients * min_per_client`` are shared in proportion to ``p`` (largest-remainder
    rounding, ties to the lower client index). Items are dealt from a seeded permutation.

    With ``labels`` (label skew): for each distinct label (in sorted order) its items are
    shuffled and shared among clients in proportion to a fresh ``q ~ Dirichlet(alpha * 1)``
    (largest-remainder rounding). Clients left with fewer than ``min_per_client`` items are then
    repaired deterministically: one item at a time moves from the currently largest client
    (lowest index on ties) to the smallest deficient client (lowest index first); the moved item
    is the one the donor received last. The number of moved items is logged. The repair always
    succeeds because ``n_items >= n_clients * min_per_client`` is checked first, and it changes
    nothing when every client already has enough.

    Args:
        n_items: number of items to assign.
        n_clients: number of clients.
        alpha: Dirichlet concentration, > 0 and finite.
        seed: seed of ``numpy.random.default_rng``.
        labels: optional label of every item (any comparable values, e.g. source names).
        min_per_client: minimum items per client, >= 0.

    Returns:
        One sorted ``int64`` index array per client, covering every item exactly once.

    Raises:
        InvalidParameterError: bad counts, ``alpha <= 0``, non-finite ``alpha``, negative
            ``min_per_client``, or ``labels`` of the wrong length.
        PartitionError: more clients than items, or ``n_clients * min_per_client > n_items``.
    """
    n_items, n_clients = _check_counts(n_items, n_clients)
    alpha = _check_alpha(alpha)
    if isinstance(min_per_client, bool) or not isinstance(min_per_client, (int, np.integer)):
        raise InvalidParameterError(
            f"min_per_client must be a non-negative integer, got {min_per_client!r}"
        )
    min_per_client = int(min_per_client)
    if min_per_client < 0:
        raise InvalidParameterError(
            f"min_per_client must be a non-negative integer, got {min_per_client}"
        )
    if n_clients * min_per_client > n_items:
        raise PartitionError(
            f"cannot give each of {n_clients} clients at least {min_per_client} items out of "
            f"{n_items}; need n_items >= n_clients * min_per_client = "
            f"{n_clients * min_per_client}"
        )
    rng = np.random.default_rng(check_seed(seed))

    parts: list[np.ndarray]
    if labels is None:
        parts = _quantity_skew(n_items, n_clients, alpha, min_per_client, rng)
    else:
        label_array = np.asarray(labels)
        if label_array.ndim != 1 or label_array.shape[0] != n_items:
            raise InvalidParameterError(
                f"labels must be a 1-D sequence of length n_items={n_items}, got shape "
                f"{label_array.shape}"
            )
        parts = _label_skew(label_array, n_clients, alpha, min_per_client, rng)
    return [np.sort(part.astype(np.int64)) for part in parts]


# --------------------------------------------------------------------------------------------


def _check_counts(n_items: int, n_clients: int) -> tuple[int, int]:
    n_items = check_positive_int("n_items", n_items)
    n_clients = check_positive_int("n_clients", n_clients)
    if n_clients > n_items:
        raise PartitionError(
            f"more clients than windows: n_clients={n_clients} > n_items={n_items}; every "
            "client needs at least one item"
        )
    return n_items, n_clients


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.integer, np.floating)):
        raise InvalidParameterError(f"alpha must be a positive number, got {alpha!r}")
    value = float(alpha)
    if not np.isfinite(value) or value <= 0:
        raise InvalidParameterError(f"alpha must be a positive finite number, got {value}")
    return value


def _dirichlet(rng: np.random.Generator, alpha: float, n_clients: int) -> np.ndarray:
    proportions = rng.dirichlet(np.full(n_clients, alpha))
    if not np.all(np.isfinite(proportions)):
        raise InvalidParameterError(
            f"Dirichlet({alpha}) over {n_clients} clients produced non-finite proportions; "
            "use a larger alpha"
        )
    return proportions


def _largest_remainder(proportions: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to ``total``, as close as possible to ``proportions * total``."""
    raw = proportions / proportions.sum() * total
    counts = np.floor(raw).astype(np.int64)
    shortfall = total - int(counts.sum())
    order = np.argsort(-(raw - counts), kind="stable")  # ties: lower client index first
    counts[order[:shortfall]] += 1
    result: np.ndarray = counts
    return result


def _quantity_skew(
    n_items: int, n_clients: int, alpha: float, min_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    proportions = _dirichlet(rng, alpha, n_clients)
    sizes = min_per_client + _largest_remainder(proportions, n_items - n_clients * min_per_client)
    permutation = rng.permutation(n_items)
    return np.split(permutation, np.cumsum(sizes)[:-1])


def _label_skew(
    labels: np.ndarray, n_clients: int, alpha: float, min_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    parts: list[list[int]] = [[] for _ in range(n_clients)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        counts = _largest_remainder(_dirichlet(rng, alpha, n_clients), members.size)
        for client, chunk in enumerate(np.split(members, np.cumsum(counts)[:-1])):
            parts[client].extend(int(i) for i in chunk)

    moved = 0
    while True:
        sizes = np.array([len(p) for p in parts])
        deficient = np.flatnonzero(sizes < min_per_client)
        if deficient.size == 0:
            break
        receiver = int(deficient[np.argmin(sizes[deficient])])  # first minimum
        donor = int(np.argmax(sizes))  # first maximum: lowest index on ties
        parts[receiver].append(parts[donor].pop())
        moved += 1
    if moved:
        logger.info(
            "dirichlet_partition: moved %d items to give every client at least %d", moved,
            min_per_client,
        )
    return [np.asarray(part, dtype=np.int64) for part in parts]
