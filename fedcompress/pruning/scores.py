"""Stateless pruning math: importance scores (magnitude, Wanda, RIA, first-order Taylor) and
SparseGPT's OBS update.

All arithmetic runs in :data:`~fedcompress.models.common.CALC_DTYPE` (float32) whatever the
model dtype, except SparseGPT's Hessian, its dampening and its inverse, in
:data:`~fedcompress.models.common.HESSIAN_DTYPE` (float64).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from fedcompress.models import CALC_DTYPE, HESSIAN_DTYPE
from fedcompress.pruning.select import block_prune_count, select_prune_mask

logger = logging.getLogger(__name__)

#: RIA's exponent of the input norm (Zhang et al., ICLR 2024: ``a = 0.5``).
RIA_ALPHA = 0.5
#: SparseGPT defaults from Frantar & Alistarh (2023).
SPARSEGPT_BLOCKSIZE = 128
SPARSEGPT_PERCDAMP = 0.01
#: How many times the dampening is multiplied by 10 before a failing Cholesky is an error.
SPARSEGPT_MAX_DAMP_RETRIES = 6


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


class CholeskyError(RuntimeError):
    """The dampened Hessian stayed non positive-definite after every retry."""


def _inverse_hessian_cholesky(hessian: torch.Tensor, percdamp: float,
                              name: str = "") -> torch.Tensor:
    """Upper Cholesky factor of the inverse of the dampened Hessian, computed in
    :data:`~fedcompress.models.common.HESSIAN_DTYPE` and returned in float32 for the OBS loop (the
    same Hessian gives bit-identical factors; Hessians that differ by float64 rounding almost
    always round to the same float32 factor).

    Dampening: ``percdamp * mean(diag(H))`` added to the diagonal. When the Cholesky
    factorisation fails, the dampening is raised tenfold (logged), up to
    :data:`SPARSEGPT_MAX_DAMP_RETRIES` times; then :class:`CholeskyError`.
    """
    hessian = hessian.to(HESSIAN_DTYPE)
    eye = torch.eye(hessian.shape[0], dtype=HESSIAN_DTYPE, device=hessian.device)
    mean_diag = torch.mean(torch.diag(hessian))
    damp_frac = percdamp
    for attempt in range(SPARSEGPT_MAX_DAMP_RETRIES + 1):
        try:
            chol = torch.linalg.cholesky(hessian + damp_frac * mean_diag * eye)
            hinv = torch.cholesky_inverse(chol)
            return torch.linalg.cholesky(hinv, upper=True).to(CALC_DTYPE)
        except torch.linalg.LinAlgError:
            if attempt == SPARSEGPT_MAX_DAMP_RETRIES:
                break
            logger.warning("SparseGPT %s: Cholesky failed with dampening %.3g x mean diag; "
                           "raising it to %.3g", name, damp_frac, damp_frac * 10)
            damp_frac *= 10
    raise CholeskyError(f"SparseGPT {name}: the Hessian is not positive definite even with "
                        f"dampening {damp_frac:.3g} x mean(diag(H))")


#: A quantizer of the OBS sweep: ``(column, index) -> dequantized column`` (float32, the
#: column's values as the runtime computes them from the integers it records); ``index`` is the
#: column's position in the sweep's order. See :func:`fedcompress.quant.solver.gptq_quantize`.
ColumnQuantizer = Callable[[torch.Tensor, int], torch.Tensor]


@torch.no_grad()
def obs_sweep(W: torch.Tensor, hinv: torch.Tensor, blocksize: int, *,
              sparsity: float | None = None, group: str = "layer",
              nm: tuple[int, int] | None = None, mask: torch.Tensor | None = None,
              quantize: ColumnQuantizer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal-brain-surgeon sweep of SparseGPT and GPTQ over the columns of ``W``.

    ``W`` (float32 ``[rows, cols]``, updated in place) is processed column by column, in
    blocks of ``blocksize`` with lazy batch updates of the later blocks; ``hinv`` is the upper
    Cholesky factor of the dampened inverse Hessian (float32, :func:`_inverse_hessian_cholesky`),
    in the sweep's column order. Each column is replaced by its pruned and/or quantized value
    and the error, divided by the factor's diagonal, is compensated on the not-yet-processed
    columns of the row.

    Pruning (at most one rule): ``sparsity`` selects the mask of each block from the OBS
    saliency ``w^2 / [H^-1]_jj^2`` *within the block* (``group``: ``layer`` the whole block,
    SparseGPT's adaptive mask selection; ``row`` each row; ``column`` each column; each block
    prunes its share of the running total, :func:`~fedcompress.pruning.select.block_prune_count`,
    so that a row or the matrix ends at exactly ``floor(sparsity * size)``); ``nm`` the N
    lowest of every M consecutive columns when the sweep reaches them; ``mask`` a fixed prune
    mask (True = pruned). ``quantize``: the quantizer of the kept weights (the SparseGPT paper's
    joint pruning and quantization: a pruned weight is set to 0 and stays 0, a kept one is
    quantized, the error of both is compensated). No rule and no quantizer: nothing changes.

    Returns ``(prune_mask, W)``: pruned entries are exactly 0.
    """
    rows, cols = W.shape
    rule = sum(x is not None for x in (sparsity, nm, mask))
    if rule > 1:
        raise ValueError("one pruning rule at a time: expected a sparsity, an N:M pattern or a "
                         "fixed mask")
    if mask is not None and mask.shape != W.shape:
        raise ValueError(f"fixed prune mask of shape {tuple(mask.shape)} for a weight of shape "
                         f"{tuple(W.shape)}")
    pruning = rule == 1
    out_mask = (mask.to(device=W.device, dtype=torch.bool).clone() if mask is not None
                else torch.zeros_like(W, dtype=torch.bool))
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        count = i2 - i1
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = hinv[i1:i2, i1:i2]
        diag = torch.diag(Hinv1).unsqueeze(0)
        if sparsity is not None:
            mask1 = select_prune_mask(W1.pow(2) / diag.pow(2), sparsity, group,
                                      count=block_prune_count(sparsity, group, rows, i1, i2))
        elif mask is not None:
            mask1 = out_mask[:, i1:i2]
        else:
            mask1 = torch.zeros_like(W1, dtype=torch.bool)
        for i in range(count):
            if nm is not None and i % nm[1] == 0:
                run = slice(i, i + nm[1])
                mask1[:, run] = select_prune_mask(W1[:, run].pow(2) / diag[:, run].pow(2),
                                                  0.0, nm=nm)
            w = W1[:, i]
            d = Hinv1[i, i]
            q = w.clone()
            if pruning:
                q[mask1[:, i]] = 0
            if quantize is not None:
                q = quantize(q, i1 + i)
                if pruning:
                    q[mask1[:, i]] = 0  # already exactly 0: quantizers represent 0 exactly
            Q1[:, i] = q
            err = (w - q) / d
            W1[:, i:] -= err.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err
        W[:, i1:i2] = Q1
        out_mask[:, i1:i2] = mask1
        W[:, i2:] -= Err1.matmul(hinv[i1:i2, i2:])
    if pruning:
        W[out_mask] = 0
    return out_mask, W


def prepare_obs(weight: torch.Tensor, hessian: torch.Tensor, percdamp: float, name: str = "",
                perm: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(W, hinv, dead)`` for :func:`obs_sweep`: the weight as a float32 copy whose dead
    columns (``H_jj = 0``: inputs that were always 0) are zeroed, the upper Cholesky factor of
    the dampened inverse Hessian (those columns' diagonal set to 1 first) and the dead columns'
    mask. ``hessian`` is used in :data:`~fedcompress.models.common.HESSIAN_DTYPE`. ``perm``: the
    sweep's column order (activation order): ``W``'s columns and both axes of the Hessian are
    permuted before the factorisation (``dead`` stays in the weight's own order)."""
    W = weight.detach().to(CALC_DTYPE).clone()
    H = hessian.to(HESSIAN_DTYPE).clone()
    rows, cols = W.shape
    if H.shape != (cols, cols):
        raise ValueError(f"Hessian of shape {tuple(H.shape)} does not match {cols} input features")
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    if perm is not None:
        if sorted(perm.tolist()) != list(range(cols)):
            raise ValueError(f"column order of {perm.numel()} entries is not a permutation of "
                             f"{cols} columns")
        W = W[:, perm.to(W.device)]
        index = perm.to(H.device)
        H = H[index][:, index]
    return W, _inverse_hessian_cholesky(H, percdamp, name), dead


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
