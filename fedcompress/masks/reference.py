"""The public reference of the compressed mask format: reference scores, and the reference
norms' broadcast form.

The server measures per-input-column activation norms on PUBLIC text
(:func:`fedcompress.pruning.local.column_norms`), broadcasts them once (:func:`reference_to_wire`)
and both sides rank the weights of every linear layer by ``|W_ij| * norm_j``
(:func:`reference_scores`, bit-exact float32). The codec that uses them is
:mod:`fedcompress.masks.compress`.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from fedcompress.models import CALC_DTYPE

__all__ = ["linear_weights", "reference_from_wire", "reference_nbytes", "reference_scores",
           "reference_to_wire"]


def reference_scores(weight: torch.Tensor | Sequence[torch.Tensor],
                     col_norm: torch.Tensor | None) -> torch.Tensor:
    """``|W_ij| * norm_j`` in float32 (``|W|`` without a reference). Bit-exact everywhere.

    ``weight`` may be a sequence of matrices with the same input size: they are stacked row-wise
    (layers reading the same input, coded together).
    """
    parts = [weight] if isinstance(weight, torch.Tensor) else list(weight)
    if not parts or any(p.dim() != 2 for p in parts):
        raise ValueError(f"weight must be a matrix [out, in] or a list of them, got shapes "
                         f"{[tuple(p.shape) for p in parts]}")
    cols = parts[0].shape[1]
    if any(p.shape[1] != cols for p in parts):
        raise ValueError(f"stacked weights have different input sizes "
                         f"{[tuple(p.shape) for p in parts]}")
    norm = None
    if col_norm is not None:
        norm = col_norm.detach().cpu()
        if norm.shape != (cols,):
            raise ValueError(f"reference norms of shape {tuple(norm.shape)} do not match a "
                             f"weight with {cols} input features")
        norm = norm.to(CALC_DTYPE)
        if not bool(torch.isfinite(norm).all()) or bool((norm < 0).any()):
            raise ValueError("reference norms must be finite and non-negative")
    # numpy: single-threaded elementwise IEEE float32 (the same bits as torch, without thread
    # start-up costs on busy machines)
    out = np.empty((sum(p.shape[0] for p in parts), cols), dtype=np.float32)
    row = 0
    for part in parts:
        block = out[row:row + part.shape[0]]
        np.abs(part.detach().cpu().to(CALC_DTYPE).numpy(), out=block)
        if norm is not None:
            np.multiply(block, norm.numpy()[None, :], out=block)
        row += part.shape[0]
    return torch.from_numpy(out)


def linear_weights(model: nn.Module, layers: Iterable[int] | None = None
                   ) -> dict[str, torch.Tensor]:
    """Wire key (``layers.{i}.{name}``) -> ``[out, in]`` weight of every prunable linear layer."""
    from fedcompress.masks.codec import mask_key
    from fedcompress.models import ModelAdapter, weight_matrix

    adapter = ModelAdapter(model)
    indices = range(len(adapter)) if layers is None else layers
    return {mask_key(i, name): weight_matrix(m).detach()
            for i in indices for name, m in ModelAdapter.linear_layers(adapter.layers[i]).items()}


def reference_to_wire(reference: Mapping[str, torch.Tensor], dtype: str = "float16"
                      ) -> dict[str, np.ndarray]:
    """The broadcast form of a reference: each layer's norms divided by their maximum (a scale
    that changes no rank) and rounded to ``dtype`` (``float16`` or ``float32``). Both sides must
    use :func:`reference_from_wire` of the SAME arrays."""
    if dtype not in ("float16", "float32"):
        raise ValueError(f"reference dtype {dtype!r}: expected float16 or float32")
    out = {}
    for key, norm in reference.items():
        norm = norm.detach().cpu().to(torch.float64)
        top = float(norm.max()) if norm.numel() else 0.0
        out[key] = (norm / top if top > 0 else norm).numpy().astype(dtype)
    return out


def reference_from_wire(arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """float32 reference norms from their broadcast form (exact widening)."""
    out = {}
    for key, arr in arrays.items():
        arr = np.asarray(arr)
        if arr.dtype not in (np.float16, np.float32) or arr.ndim != 1:
            raise ValueError(f"reference {key}: expected a 1-D float16/float32 array, got "
                             f"{arr.dtype} {arr.shape}")
        out[key] = torch.from_numpy(arr.astype(np.float32))
    return out


def reference_nbytes(arrays: Mapping[str, np.ndarray]) -> int:
    """Downlink bytes of a broadcast reference (values only)."""
    return int(sum(np.asarray(a).nbytes for a in arrays.values()))
