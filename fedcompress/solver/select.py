"""Selecting which weights to prune from importance scores, within a comparison group.

Convention everywhere in fedcompress: a *prune mask* is a bool tensor shaped like the weight
``[out_features, in_features]``, True where the weight is pruned (the FedPrLLM paper's M).

Comparison groups (FedPrLLM, Sec. 3):

* ``layer``: the ``k = floor(sparsity * out * in)`` lowest scores of the whole matrix are pruned;
* ``row``: in each output row, the ``floor(sparsity * in)`` lowest scores (Wanda's default);
* ``column``: in each input column, the ``floor(sparsity * out)`` lowest scores.

N:M semi-structured sparsity: in every run of M consecutive input weights of a row, the N lowest
scores are pruned (``2:4`` prunes 2 of every 4).

Ties: among equal scores the weight with the lower index inside the group (row-major flat
index for ``layer``) is pruned first, as a stable ascending sort orders them; the selection
itself is linear-time (:func:`_lowest_k_along`). This rule is deterministic and tested.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from fedcompress.models import CALC_DTYPE

GROUPS = ("layer", "row", "column")
#: A CPU selection of at least this many scores runs in blocks of groups on torch's threads
#: (numpy's partition and comparisons release the GIL); each group's choice is its own, so
#: the mask is the same however the groups are split.
PARALLEL_MIN = 1 << 18
NAN_SCORES = "scores contain NaN: pruning needs finite or infinite scores"
#: Groups of float32 scores at least this long are selected by the compiled radix select
#: (:func:`fedcompress.solver.radix.lowest_k_rows`), shorter ones (N:M runs) by numpy's
#: partition, whose per-group cost is lower there.
KERNEL_MIN = 64


def check_sparsity(sparsity: float) -> float:
    """A sparsity must lie in [0, 1)."""
    if not isinstance(sparsity, (int, float)) or not 0.0 <= float(sparsity) < 1.0:
        raise ValueError(f"sparsity {sparsity!r} is outside [0, 1)")
    return float(sparsity)


def check_group(group: str) -> str:
    if group not in GROUPS:
        raise ValueError(f"unknown comparison group {group!r}: expected one of {', '.join(GROUPS)}")
    return group


def parse_nm(nm: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """``"2:4"`` -> ``(2, 4)``; None stays None. N must be in [1, M)."""
    if nm is None or nm == "" or nm == "none":
        return None
    if isinstance(nm, str):
        try:
            n, m = (int(v) for v in nm.split(":"))
        except ValueError as err:
            raise ValueError(f"N:M pattern {nm!r}: expected two integers like '2:4'") from err
    else:
        n, m = nm
    if not 0 < n < m:
        raise ValueError(f"N:M pattern {n}:{m}: expected 0 < N < M (N pruned out of every M)")
    return n, m


def _lowest_k_along(scores: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    """Bool mask of the k lowest entries along ``dim`` (lower index first on ties).

    Linear-time selection instead of a sort: the k-th smallest value ``t`` of each group
    (introselect: numpy's ``partition`` on the CPU, ``torch.kthvalue`` elsewhere), then every
    entry below ``t`` and, of the entries equal to ``t``, the first ones in index order until
    the group holds k. That is exactly the set a stable ascending sort puts first (tested
    against it), at a fraction of its cost (a stable sort of every row took about half of a
    site's Wanda pass). NaN scores have no order: a clear error.
    """
    if k == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    size = scores.shape[dim]
    if k >= size:
        return torch.ones_like(scores, dtype=torch.bool)
    if scores.device.type == "cpu":  # refuses NaN itself
        return torch.from_numpy(_lowest_k_numpy(scores.detach().numpy(), k, dim))
    if torch.isnan(scores).any():
        raise ValueError(NAN_SCORES)
    kth = torch.kthvalue(scores, k, dim=dim, keepdim=True).values
    below = scores < kth
    equal = scores == kth
    need = k - below.sum(dim, keepdim=True)
    return below | (equal & (equal.cumsum(dim) <= need))


def _lowest_k_numpy(scores: np.ndarray, k: int, dim: int) -> np.ndarray:
    """:func:`_lowest_k_along` of a CPU array, groups along the last axis of a contiguous copy,
    in blocks of groups on torch's threads when there are at least :data:`PARALLEL_MIN`
    scores."""
    a = np.ascontiguousarray(np.moveaxis(scores, dim, -1))
    groups = a.reshape(-1, a.shape[-1])
    out = np.empty(groups.shape, dtype=bool)
    workers = min(torch.get_num_threads(), len(groups)) if a.size >= PARALLEL_MIN else 1
    bounds = [len(groups) * i // workers for i in range(workers + 1)]
    blocks = [slice(start, stop) for start, stop in zip(bounds, bounds[1:])]
    if workers > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(lambda b: _lowest_k_groups(groups[b], k, out[b]), blocks))
    else:
        _lowest_k_groups(groups, k, out)
    return np.ascontiguousarray(np.moveaxis(out.reshape(a.shape), -1, dim))


def _lowest_k_groups(a: np.ndarray, k: int, out: np.ndarray) -> None:
    """The k lowest entries of each row of ``a`` (lower index first on ties) into ``out``:
    non-negative float32 scores in rows of at least :data:`KERNEL_MIN` by the compiled radix
    select (a fifth of the time of numpy's partition on a site's Wanda scores), any other
    block by the partition, which also puts each row's largest entry last, where numpy orders
    a NaN: the check for NaN reads one entry per row, not a second pass over the scores."""
    if a.dtype == np.float32 and a.shape[-1] >= KERNEL_MIN and a.flags.c_contiguous:
        from fedcompress.solver import radix  # numba: loaded by the first large selection

        if radix.lowest_k_rows(a.view(np.uint32), k, out):
            return
    last = a.shape[-1] - 1
    part = np.partition(a, (k - 1, last) if k - 1 < last else k - 1, axis=-1)
    if part.dtype.kind == "f" and np.isnan(part[..., last]).any():
        raise ValueError(NAN_SCORES)
    kth = part[..., k - 1:k]
    del part
    np.less(a, kth, out=out)
    equal = a == kth
    ties = np.count_nonzero(equal, axis=-1) > 1
    if ties.any():  # take the first (k - below) of the entries equal to kth, in index order
        need = k - np.count_nonzero(out, axis=-1)[..., None]
        equal &= np.cumsum(equal, axis=-1, dtype=np.int64) <= need
    out |= equal


def select_prune_mask(scores: torch.Tensor, sparsity: float, group: str = "row",
                      nm: tuple[int, int] | None = None, count: int | None = None
                      ) -> torch.Tensor:
    """Prune mask of the lowest ``scores`` within each comparison group (or N:M runs):
    ``floor(sparsity * group size)`` of each group, or ``count`` of each when given (a part of
    a larger group, :func:`block_prune_count`)."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be a matrix [out, in], got shape {tuple(scores.shape)}")
    scores = scores.to(CALC_DTYPE)
    rows, cols = scores.shape
    if nm is not None:
        n, m = nm
        if cols % m:
            raise ValueError(f"N:M {n}:{m} needs in_features divisible by {m}, got {cols}")
        runs = scores.reshape(rows, cols // m, m)
        return _lowest_k_along(runs, n, dim=2).reshape(rows, cols)
    check_sparsity(sparsity)
    check_group(group)
    size = {"layer": rows * cols, "row": cols, "column": rows}[group]
    k = int(sparsity * size) if count is None else count
    if not 0 <= k <= size:
        raise ValueError(f"count={count}: expected 0..{size} weights of a {group} group of "
                         f"{size}")
    if group == "layer":
        return _lowest_k_along(scores.reshape(1, -1), k, dim=1).reshape(rows, cols)
    if group == "row":
        return _lowest_k_along(scores, k, dim=1)
    return _lowest_k_along(scores, k, dim=0)


def block_prune_count(sparsity: float, group: str, rows: int, start: int, stop: int
                      ) -> int | None:
    """Weights to prune per comparison group in columns ``[start, stop)`` of a matrix whose
    mask is chosen block by block (SparseGPT's sweep): the running total ``floor(sparsity *
    size so far)`` minus the blocks' before, so that the blocks of a row (``row``) or of the
    matrix (``layer``) together prune exactly what one choice over the whole group would,
    ``floor(sparsity * group size)``, where flooring each block alone would fall short (at
    60% and 128 columns a block, 76 of 128 each: 59.4%). ``column``: None (a column lies in
    one block, :func:`select_prune_mask`'s own count is exact)."""
    check_sparsity(sparsity)
    check_group(group)
    if group == "column":
        return None
    per = rows if group == "layer" else 1
    return int(sparsity * (per * stop)) - int(sparsity * (per * start))
