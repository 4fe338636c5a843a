"""Stateless pruning math: importance scores (magnitude, Wanda, RIA, first-order Taylor) and
SparseGPT's OBS update.

All arithmetic runs in :data:`~fedcompress.models.common.CALC_DTYPE` (float32) whatever the
model dtype, except SparseGPT's Hessian, its dampening and its inverse, in
:data:`~fedcompress.models.common.HESSIAN_DTYPE` (float64).
"""

from __future__ import annotations

import logging

import torch

from fedcompress.models import CALC_DTYPE
from fedcompress.solver.obs import (  # noqa: F401  (CholeskyError, ColumnQuantizer: old imports)
    MAX_DAMP_RETRIES,
    CholeskyError,
    ColumnQuantizer,
    obs_sweep,
    prepare_obs,
)

logger = logging.getLogger(__name__)

#: RIA's exponent of the input norm (Zhang et al., ICLR 2024: ``a = 0.5``).
RIA_ALPHA = 0.5
#: SparseGPT defaults from Frantar & Alistarh (2023).
SPARSEGPT_BLOCKSIZE = 128
SPARSEGPT_PERCDAMP = 0.01
#: How many times the dampening is multiplied by 10 before a failing Cholesky is an error
#: (the OBS solver's, :data:`fedcompress.solver.obs.MAX_DAMP_RETRIES`).
SPARSEGPT_MAX_DAMP_RETRIES = MAX_DAMP_RETRIES


def magnitude_scores(weight: torch.Tensor) -> torch.Tensor:
    """``|W|``."""
    return weight.detach().to(CALC_DTYPE).abs()


def wanda_scores(weight: torch.Tensor, sq_norm: torch.Tensor) -> torch.Tensor:
    """Wanda: ``|W_ij| * ||X_j||_2`` (up to a per-layer constant: ``sq_norm`` is the mean of
    ``x_j^2`` over tokens, so its square root is ``||X_j||_2 / sqrt(tokens)``)."""
    if sq_norm.shape != (weight.shape[1],):
        raise ValueError(f"input statistics of length {tuple(sq_norm.shape)} do not match a "
                         f"weight with {weight.shape[1]} input features")
    # abs() is a new tensor (to() may return the weight itself): scaled in place, one
    # allocation of the matrix's size, the same products.
    return weight.detach().to(CALC_DTYPE).abs().mul_(sq_norm.to(CALC_DTYPE).sqrt().unsqueeze(0))


def ria_scores(weight: torch.Tensor, sq_norm: torch.Tensor, alpha: float = RIA_ALPHA
               ) -> torch.Tensor:
    """RIA (Relative Importance and Activations, Zhang et al., ICLR 2024):
    ``(|W_ij| / sum_k |W_ik| + |W_ij| / sum_k |W_kj|) * ||X_j||_2 ** alpha``, each weight's
    magnitude relative to its output row's and its input column's total, times the input's norm
    to the power ``alpha`` (:data:`RIA_ALPHA`). ``sq_norm`` is the mean of ``x_j^2`` over
    tokens, as for :func:`wanda_scores` (``||X_j||_2`` up to a per-layer constant, which ranks
    nothing). A row or column of zeros scores 0 (never 0/0)."""
    if sq_norm.shape != (weight.shape[1],):
        raise ValueError(f"input statistics of length {tuple(sq_norm.shape)} do not match a "
                         f"weight with {weight.shape[1]} input features")
    if not alpha >= 0:
        raise ValueError(f"RIA exponent {alpha!r}: expected a number >= 0")
    w = weight.detach().to(CALC_DTYPE).abs()
    rows = w.sum(1, keepdim=True)
    cols = w.sum(0, keepdim=True)
    relative = w / torch.where(rows > 0, rows, 1.0) + w / torch.where(cols > 0, cols, 1.0)
    return relative * sq_norm.to(CALC_DTYPE).pow(alpha / 2).unsqueeze(0)


def taylor_scores(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """First-order Taylor importance ``|W_ij * dL/dW_ij|`` (the loss change to first order when
    the weight is removed; LLM-Pruner's element-wise first-order score; the "gradient" pruning
    of seed 004's Table V). ``grad`` is the gradient of the calibration loss, float32."""
    if grad.shape != weight.shape:
        raise ValueError(f"gradient of shape {tuple(grad.shape)} for a weight of shape "
                         f"{tuple(weight.shape)}")
    return (weight.detach().to(CALC_DTYPE) * grad.to(CALC_DTYPE)).abs()


@torch.no_grad()
def sparsegpt_prune(weight: torch.Tensor, hessian: torch.Tensor, sparsity: float,
                    group: str = "layer", nm: tuple[int, int] | None = None,
                    blocksize: int = SPARSEGPT_BLOCKSIZE, percdamp: float = SPARSEGPT_PERCDAMP,
                    name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT (Frantar & Alistarh, 2023): prune mask and OBS-updated weights.

    Columns are processed in blocks of ``blocksize``; in each block the mask is chosen from the
    OBS saliency ``w^2 / [H^-1]_jj^2`` *within the block*: ``group="layer"`` compares the whole
    block (SparseGPT's own adaptive mask selection), ``"row"`` each row of the block, ``"column"``
    each column; with N:M the N lowest of every M columns. Each pruned weight's error is
    compensated on the not-yet-processed weights of its row (:func:`obs_sweep` without a
    quantizer; with one it is GPTQ, :func:`fedcompress.quant.solver.gptq_quantize`).

    ``hessian`` (``2/N X^T X``) is used in float64
    (:data:`~fedcompress.models.common.HESSIAN_DTYPE`) up to its inverse's Cholesky factor; the
    block loop runs in float32.

    Returns ``(prune_mask, new_weight)`` with ``new_weight`` in float32 (pruned entries are 0).
    """
    W, hinv, _ = prepare_obs(weight, hessian, percdamp, name)
    if nm is None:
        return obs_sweep(W, hinv, blocksize, sparsity=sparsity, group=group)
    return obs_sweep(W, hinv, blocksize, nm=nm)
