"""Server-side aggregation of client prune masks (FedPrLLM, Sec. 3.2): pure functions.

``counts = sum_i M_i`` (votes to prune each weight, an integer wide enough for the client count);
the global prune mask takes the ``k`` *highest* counts within the server's comparison group
(``layer``/``row``/``column``, or N:M runs), and optional weight scaling multiplies each kept
weight by ``(m - count) / m``, the fraction of clients that kept it.

Tie-break among equal vote counts (``tie_break``):

* ``"magnitude"`` (default): the smaller ``|W|`` is pruned first (then the lower index);
* ``"random"``: a seeded random order (``seed``);
* ``"index"``: the lower index inside the group is pruned first (row-major for ``layer``).
"""

from __future__ import annotations

from typing import Iterable

import torch

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


class VoteCounter:
    """Streaming sum of prune masks of one weight matrix (memory: one count tensor)."""

    def __init__(self, shape: tuple[int, ...], max_clients: int):
        self.counts = torch.zeros(shape, dtype=count_dtype(max_clients))
        self.max_clients = max_clients
        self.clients = 0

    def add(self, mask: torch.Tensor) -> None:
        if mask.dtype != torch.bool:
            raise TypeError(f"a prune mask must be bool, got {mask.dtype}")
        if tuple(mask.shape) != tuple(self.counts.shape):
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not match "
                             f"{tuple(self.counts.shape)}")
        if self.clients >= self.max_clients:
            raise ValueError(f"more than the announced {self.max_clients} masks")
        self.counts += mask.to(self.counts.dtype)
        self.clients += 1


def vote_counts(masks: Iterable[torch.Tensor], n_clients: int) -> torch.Tensor:
    """``sum_i M_i`` over the clients' bool prune masks."""
    counter = None
    for mask in masks:
        counter = counter or VoteCounter(tuple(mask.shape), n_clients)
        counter.add(mask)
    if counter is None:
        raise ValueError("no masks to aggregate")
    return counter.counts


def _tie_key(counts: torch.Tensor, tie_break: str, weight: torch.Tensor | None,
             seed: int) -> torch.Tensor:
    """Secondary key, ascending = pruned first among equal counts."""
    if tie_break == "magnitude":
        if weight is None:
            raise ValueError("tie_break='magnitude' needs the weight")
        if weight.shape != counts.shape:
            raise ValueError(f"weight shape {tuple(weight.shape)} != counts {tuple(counts.shape)}")
        return weight.detach().to(CALC_DTYPE).abs()
    if tie_break == "random":
        gen = torch.Generator().manual_seed(seed)
        return torch.rand(counts.shape, generator=gen, dtype=CALC_DTYPE)
    if tie_break == "index":
        return torch.zeros(counts.shape, dtype=CALC_DTYPE)
    raise ValueError(f"unknown tie-break {tie_break!r}: expected one of {', '.join(TIE_BREAKS)}")


def _top_counts_along(counts: torch.Tensor, key: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    """Bool mask of the k highest counts along ``dim``; ties: lowest ``key``, then lowest index."""
    mask = torch.zeros_like(counts, dtype=torch.bool)
    if k == 0:
        return mask
    by_key = torch.sort(key, dim=dim, stable=True).indices
    ranked = torch.gather(counts.to(torch.int64), dim, by_key)
    order = torch.gather(by_key, dim, torch.sort(-ranked, dim=dim, stable=True).indices)
    mask.scatter_(dim, order.narrow(dim, 0, k), True)
    return mask


def global_mask(counts: torch.Tensor, sparsity: float, group: str = "layer",
                tie_break: str = "magnitude", weight: torch.Tensor | None = None, seed: int = 0,
                nm: tuple[int, int] | None = None) -> torch.Tensor:
    """The global prune mask: the highest vote counts within each comparison group."""
    if counts.dim() != 2:
        raise ValueError(f"counts must be a matrix [out, in], got shape {tuple(counts.shape)}")
    key = _tie_key(counts, tie_break, weight, seed)
    rows, cols = counts.shape
    if nm is not None:
        n, m = nm
        if cols % m:
            raise ValueError(f"N:M {n}:{m} needs in_features divisible by {m}, got {cols}")
        shape3 = (rows, cols // m, m)
        return _top_counts_along(counts.reshape(shape3), key.reshape(shape3), n, 2).reshape(
            rows, cols)
    check_sparsity(sparsity)
    check_group(group)
    if group == "layer":
        return _top_counts_along(counts.reshape(1, -1), key.reshape(1, -1),
                                 int(sparsity * counts.numel()), 1).reshape(rows, cols)
    if group == "row":
        return _top_counts_along(counts, key, int(sparsity * cols), 1)
    return _top_counts_along(counts, key, int(sparsity * rows), 0)


def scale_weights(weight: torch.Tensor, counts: torch.Tensor, n_clients: int) -> torch.Tensor:
    """``W * (m - counts) / m`` computed in float32, returned in the weight's dtype."""
    if n_clients <= 0:
        raise ValueError(f"number of clients must be positive, got {n_clients}")
    factor = (n_clients - counts.to(CALC_DTYPE)) / n_clients
    return (weight.detach().to(CALC_DTYPE) * factor).to(weight.dtype)
