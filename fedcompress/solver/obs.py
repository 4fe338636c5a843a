"""The optimal-brain-surgeon (OBS) sweep that SparseGPT and GPTQ share, and its inputs.

One sweep over a weight's columns compensates the error of each pruned and/or quantized column
on the columns not yet processed (Frantar & Alistarh, "SparseGPT", 2023; Frantar et al.,
"GPTQ", 2023). Pruning (:mod:`fedcompress.pruning.scores`' ``sparsegpt_prune``) calls it with a
mask rule, quantization (:mod:`fedcompress.quant.solver`) with a column quantizer, the joint
recipe with both: the solver sits below both, so neither imports the other for it.

Precision: the Hessian, its dampening and its inverse in
:data:`~fedcompress.models.common.HESSIAN_DTYPE` (float64), the sweep in
:data:`~fedcompress.models.common.CALC_DTYPE` (float32).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from fedcompress.models import CALC_DTYPE, HESSIAN_DTYPE
from fedcompress.solver.select import block_prune_count, select_prune_mask

logger = logging.getLogger(__name__)

#: How many times the dampening is multiplied by 10 before a failing Cholesky is an error.
MAX_DAMP_RETRIES = 6


class CholeskyError(RuntimeError):
    """The dampened Hessian stayed non positive-definite after every retry."""


def inverse_hessian_cholesky(hessian: torch.Tensor, percdamp: float,
                              name: str = "") -> torch.Tensor:
    """Upper Cholesky factor of the inverse of the dampened Hessian, computed in
    :data:`~fedcompress.models.common.HESSIAN_DTYPE` and returned in float32 for the OBS loop (the
    same Hessian gives bit-identical factors; Hessians that differ by float64 rounding almost
    always round to the same float32 factor).

    Dampening: ``percdamp * mean(diag(H))`` added to the diagonal. When the Cholesky
    factorisation fails, the dampening is raised tenfold (logged), up to
    :data:`MAX_DAMP_RETRIES` times; then :class:`CholeskyError`.
    """
    hessian = hessian.to(HESSIAN_DTYPE)
    eye = torch.eye(hessian.shape[0], dtype=HESSIAN_DTYPE, device=hessian.device)
    mean_diag = torch.mean(torch.diag(hessian))
    damp_frac = percdamp
    for attempt in range(MAX_DAMP_RETRIES + 1):
        try:
            chol = torch.linalg.cholesky(hessian + damp_frac * mean_diag * eye)
            hinv = torch.cholesky_inverse(chol)
            return torch.linalg.cholesky(hinv, upper=True).to(CALC_DTYPE)
        except torch.linalg.LinAlgError:
            if attempt == MAX_DAMP_RETRIES:
                break
            logger.warning("OBS sweep of %s: Cholesky failed with dampening %.3g x mean diag; "
                           "raising it to %.3g", name, damp_frac, damp_frac * 10)
            damp_frac *= 10
    raise CholeskyError(f"{name or 'this weight'}: the Hessian is not positive definite even with "
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
    Cholesky factor of the dampened inverse Hessian (float32, :func:`inverse_hessian_cholesky`),
    in the sweep's column order. Each column is replaced by its pruned and/or quantized value
    and the error, divided by the factor's diagonal, is compensated on the not-yet-processed
    columns of the row.

    Pruning (at most one rule): ``sparsity`` selects the mask of each block from the OBS
    saliency ``w^2 / [H^-1]_jj^2`` *within the block* (``group``: ``layer`` the whole block,
    SparseGPT's adaptive mask selection; ``row`` each row; ``column`` each column; each block
    prunes its share of the running total, :func:`~fedcompress.solver.select.block_prune_count`,
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
    return W, inverse_hessian_cholesky(H, percdamp, name), dead
