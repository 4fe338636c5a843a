"""Selecting which weights to prune from importance scores, within a comparison group.

Convention everywhere in fedcompress: a *prune mask* is a bool tensor shaped like the weight
``[out_features, in_features]``, True where the weight is pruned (the FedPrLLM paper's M).

Comparison groups (FedPrLLM, Sec. 3):

* ``layer``: the ``k = floor(sparsity * out * in)`` lowest scores of the whole matrix are pruned;
* ``row``: in each output row, the ``floor(sparsity * in)`` lowest scores (Wanda's default);
* ``column``: in each input column, the ``floor(sparsity * out)`` lowest scores.

N:M semi-structured sparsity: in every run of M consecutive input weights of a row, the N lowest
scores are pruned (``2:4`` prunes 2 of every 4).

Ties: scores are sorted with a *stable* sort, so among equal scores the weight with the lower
index inside the group (row-major flat index for ``layer``) is pruned first. This rule is
deterministic and tested.
"""

from __future__ import annotations

import torch

from fedcompress.models import CALC_DTYPE

GROUPS = ("layer", "row", "column")


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
    """Bool mask of the k lowest entries along ``dim`` (stable: lower index first on ties)."""
    mask = torch.zeros_like(scores, dtype=torch.bool)
    if k == 0:
        return mask
    order = torch.sort(scores, dim=dim, stable=True).indices
    idx = order.narrow(dim, 0, k)
    mask.scatter_(dim, idx, True)
    return mask


def select_prune_mask(scores: torch.Tensor, sparsity: float, group: str = "row",
                      nm: tuple[int, int] | None = None) -> torch.Tensor:
    """Prune mask of the lowest ``scores`` within each comparison group (or N:M runs)."""
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
    if group == "layer":
        flat = scores.reshape(1, -1)
        return _lowest_k_along(flat, int(sparsity * flat.shape[1]), dim=1).reshape(rows, cols)
    if group == "row":
        return _lowest_k_along(scores, int(sparsity * cols), dim=1)
    return _lowest_k_along(scores, int(sparsity * rows), dim=0)
