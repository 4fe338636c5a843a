"""The exponential mechanism's math: utility weights, sampling tables, the budget check.

See :mod:`fedcompress.privacy.sanitize` for the definitions and the guarantee.
"""

from __future__ import annotations

import logging
import math
from enum import StrEnum
from typing import NamedTuple

import numpy as np

from fedcompress.data.embeddings import DTYPE
from fedcompress.privacy.sanitize.errors import SanitizeError

logger = logging.getLogger(__name__)

DELTA_U = 1.0
"""Sensitivity of the utility: ``u(x, y) ∈ [0, 1]`` for every input and candidate."""

TABLE_BATCH = 256
"""Input words whose probability tables are computed together (one matrix product)."""

BLOCK = 128
"""Candidates per block of a sampling table (two-level inverse CDF)."""

EPS_UNDERFLOW = 170.0
"""Above this ``eps``, ``e^{-eps/2}`` underflows float32's normal range (see Numerics)."""


class Mechanism(StrEnum):
    """Which candidates a word may be replaced by (see the module docstring)."""

    SANTEXT = "santext"
    CUSTEXT = "custext"


class Utility(StrEnum):
    """Base similarity ``s(x, y)``, min-max normalised to ``u ∈ [0, 1]``."""

    EUCLIDEAN = "euclidean"
    COSINE = "cosine"


def check_eps(eps: object) -> float:
    """``eps`` as a float if it is a finite number > 0, else :class:`SanitizeError`."""
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.number)):
        raise SanitizeError(f"eps must be a finite number > 0 (the privacy budget of one "
                            f"perturbed word), got {eps!r}")
    value = float(eps)
    if not math.isfinite(value) or value <= 0:
        raise SanitizeError(f"eps must be a finite number > 0 (the privacy budget of one "
                            f"perturbed word), got {eps!r}")
    return value


_TINY = np.finfo(DTYPE).tiny


class _Table(NamedTuple):
    """Sampling table of one (input word, eps): weights in blocks and their running sums."""

    members: np.ndarray | None  # candidate index of each weight (None: all candidates)
    weights: np.ndarray         # (blocks, BLOCK) float32, zero-padded
    block_cum: np.ndarray       # (blocks,) float64 running sum of the block sums
    n: int                      # weights before the padding


def _exp_weights(similarity: np.ndarray, eps: float, *, valid: np.ndarray | None = None,
                 n_valid: int | None = None) -> np.ndarray:
    """``w(x, y) = exp(eps * (u(x, y) - 1) / (2 Δu))`` row by row, in place (float32), where
    ``u = (s - min s) / (max s - min s)`` over the row's valid candidates (the mask ``valid``,
    or the first ``n_valid`` columns), so ``u ∈ [0, 1]``, ``Δu = 1`` and
    ``w ∈ [e^{-eps/2}, 1]``; ``u = 1`` for every candidate of a row whose similarities are all
    equal. ``p(y | x) = w(x, y) / Σ_y' w(x, y')`` is the exponential mechanism (the constant
    factor ``e^{-eps/2}`` cancels). Invalid entries get weight 0."""
    if valid is not None:
        hi = np.where(valid, similarity, -np.inf).max(axis=1, keepdims=True)
        lo = np.where(valid, similarity, np.inf).min(axis=1, keepdims=True)
        similarity[~valid] = np.broadcast_to(lo, similarity.shape)[~valid]
    else:
        body = similarity if n_valid is None else similarity[:, :n_valid]
        hi = body.max(axis=1, keepdims=True)
        lo = body.min(axis=1, keepdims=True)
        if n_valid is not None:
            similarity[:, n_valid:] = lo  # keeps the padding's exponent finite
    width = hi - lo
    scale = (eps / (2.0 * DELTA_U)) / np.where(width > 0, width, np.inf)  # flat row: u = 1
    similarity -= hi        # = (u - 1) * width
    similarity *= scale     # = eps (u - 1) / 2, in [-eps/2, 0]
    np.exp(similarity, out=similarity)
    if valid is not None:
        similarity[~valid] = 0.0
    elif n_valid is not None:
        similarity[:, n_valid:] = 0.0
    return similarity


_WARNED_EPS: set[float] = set()


def _warn_underflow(eps: float) -> None:
    if eps > EPS_UNDERFLOW and eps not in _WARNED_EPS:
        _WARNED_EPS.add(eps)
        logger.warning("eps=%g > %g: the weights of the farthest candidates, e^(-eps/2), may "
                       "underflow float32 to 0 and lose the e^eps guarantee", eps,
                       EPS_UNDERFLOW)
