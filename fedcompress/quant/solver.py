"""Weight quantization of one linear layer: the scale observer, round-to-nearest and GPTQ.

The math is llm-compressor 0.14's (``GPTQModifier``, ``quantize_weight``) and
compressed-tensors 0.19's (``calculate_qparams``, the quantize-dequantize of the integer
schemes), written here in plain torch:

* **Observer** (:func:`observe`, the ``minmax`` observer of a weight): per group of
  ``group_size`` input columns (or per output channel), ``min`` and ``max`` of the DENSE weights,
  widened to include 0 (``min <= 0 <= max``, so that 0 is representable). Symmetric:
  ``scale = max(|min|, |max|) / ((qmax - qmin) / 2)`` (``/ 7.5`` for 4 bits, ``/ 127.5`` for 8),
  zero point 0. Asymmetric: ``scale = (max - min) / (qmax - qmin)``, zero point
  ``round(clamp(qmin - min / scale, qmin, qmax))`` (half to even), an int8. A zero scale (an
  all-zero group) becomes the scale dtype's machine epsilon. The integers lie in ``[-8, 7]``
  (4 bits) or ``[-128, 127]`` (8 bits). The observer computes in the scale dtype, which is the
  weight's dtype by default, as llm-compressor's observer does (it reads the module's weight;
  the scales it saves have the model's dtype).
* **Quantize-dequantize** of a value ``w`` with scale ``s`` and zero point ``z``:
  ``q = round(clamp(w / s + z, qmin, qmax))`` (``w / s`` in float32, a division, not a product
  with ``1 / s``), and its value ``(q - z) * s`` in the dtype of the model's weights
  (:func:`dequantize`: what compressed-tensors' ``_dequantize`` computes for the model loaded
  in that dtype: exact in float32, rounded once in bfloat16); the GPTQ sweep compensates the
  error of that value.
* **GPTQ** (:func:`gptq_quantize`): the scales come from the dense weights up front (a server
  that holds the model computes them without any data); then the optimal-brain-surgeon sweep
  that SparseGPT uses (:func:`~fedcompress.solver.obs.obs_sweep`) with this quantizer:
  dampening ``dampening * mean(diag H)``, dead columns (``H_jj = 0``: weights zeroed, diagonal
  set to 1), activation order, blocks of ``block_size`` columns with lazy batch updates, the
  upper Cholesky factor of the inverse Hessian. With a pruning rule the same sweep prunes and
  quantizes jointly (:func:`sparsegpt_quantize`, as in the SparseGPT paper: a pruned weight is
  0, exactly, and stays 0; a kept one is quantized; the error of both is compensated).

Activation order (``QuantConfig.actorder``): the columns are swept by decreasing Hessian
diagonal (a stable sort: equal diagonals keep their column order; llm-compressor's
``torch.argsort`` is not stable, so ties may be swept in another order there). ``static``: each
column keeps the scale of its own group of consecutive columns (llm-compressor's
``weight``/``static``; the saved model has no ``g_idx``). ``group``: groups are formed in the
sweep's order, so group ``k`` holds the ``k``-th ``group_size`` columns by decreasing Hessian
diagonal and the saved model needs ``g_idx`` (column -> group; GPTQ's original ``act_order``
with ``desc_act``; llm-compressor 0.14 removed it, vLLM and ``transformers`` still load it).

Where this differs from llm-compressor (see :data:`HESSIAN_DTYPE` and :data:`SWEEP_DTYPE`):

* the Hessian is accumulated, summed over sites, dampened and inverted in float64 up to the
  Cholesky factor of its inverse, which is cast to float32 for the sweep (llm-compressor:
  float32 throughout). Its Hessian is ``2 X X^T`` over the number of *samples*, ours over the
  number of *tokens*: a common factor, which changes neither the dampening (relative) nor the
  sweep (the ratio ``[H^-1]_ij / [H^-1]_ii``) beyond float rounding;
* a Hessian that is not positive definite even dampened: llm-compressor quantizes that layer
  by round-to-nearest (a logged fallback); here, as for SparseGPT, the dampening is raised
  tenfold (logged) up to six times, then :class:`~fedcompress.solver.obs.CholeskyError`;
* the all-zero groups of an asymmetric scheme: compressed-tensors computes their zero point as
  ``qmin - 0 / 0`` (NaN cast to int8); here it is ``qmin`` (after the epsilon scale), and any
  zero point represents the group's zeros exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fedcompress.models import CALC_DTYPE
from fedcompress.models import HESSIAN_DTYPE as _HESSIAN_DTYPE
from fedcompress.quant.config import QuantConfig
from fedcompress.solver.obs import obs_sweep, prepare_obs

logger = logging.getLogger(__name__)

#: Precision of the GPTQ sweep over the columns (llm-compressor's ``GPTQ_PRECISION``).
SWEEP_DTYPE = CALC_DTYPE
#: Precision of the Hessian up to the Cholesky factor of its inverse (then :data:`SWEEP_DTYPE`):
#: float64, as statistics mode sums it over sites (llm-compressor: float32).
HESSIAN_DTYPE = _HESSIAN_DTYPE
#: dtype of the integers and of the zero points (compressed-tensors' ``zp_dtype`` for integer
#: schemes of at most 8 bits).
INT_DTYPE = torch.int8
#: dtype of ``g_idx`` (compressed-tensors' ``weight_g_idx``).
G_IDX_DTYPE = torch.int32


def quant_range(bits: int) -> tuple[int, int]:
    """``(qmin, qmax)`` of signed ``bits``-bit integers: ``(-8, 7)``, ``(-128, 127)``."""
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit integers: expected 4 or 8")
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


@dataclass(frozen=True, eq=False)
class QuantResult:
    """A quantized weight ``[out, in]`` as a runtime loads it.

    ``q``: the integers (int8, in :func:`quant_range`); ``scale``: ``[out, groups]`` in the
    scale dtype (the dtype the model saves it in); ``zero_point``: ``[out, groups]`` int8
    (zeros when symmetric); ``g_idx``: int32 ``[in]``, the group of every input column, only
    with activation order ``group`` (otherwise column ``j`` is in group ``j // group_size``);
    ``group_size``: columns per group (0: one group per output channel); ``dtype``: the dtype
    of the model's weights, in which the runtime holds the dequantized weight. :attr:`weight`
    is ``(q - zero_point[g]) * scale[g]`` in that dtype, as float32: the exact product for a
    float32 model, rounded once for a 16-bit one (:func:`dequantize`).
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    g_idx: torch.Tensor | None
    group_size: int
    symmetric: bool
    dtype: torch.dtype = CALC_DTYPE

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.zero_point, self.group_size, self.g_idx,
                          self.dtype)

    def to(self, device: torch.device | str) -> QuantResult:
        """A copy on ``device``."""
        return QuantResult(self.q.to(device), self.scale.to(device), self.zero_point.to(device),
                           None if self.g_idx is None else self.g_idx.to(device),
                           self.group_size, self.symmetric, self.dtype)

    def column_groups(self) -> torch.Tensor:
        """The group of every input column (int64 ``[in]``)."""
        return _column_groups(self.q.shape[1], self.group_size, self.g_idx)


def _column_groups(cols: int, group_size: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.long()
    if not group_size:
        return torch.zeros(cols, dtype=torch.long)
    return torch.arange(cols) // group_size


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
               group_size: int, g_idx: torch.Tensor | None = None,
               dtype: torch.dtype = CALC_DTYPE) -> torch.Tensor:
    """``(q - zero_point[:, g]) * scale[:, g]`` as a model of ``dtype`` holds it, returned as
    float32 (``g`` the group of each column: ``g_idx``, else ``j // group_size``;
    ``group_size`` 0: one group). compressed-tensors dequantizes in the scales' dtype, which
    ``from_pretrained`` makes the model's: in a float32 model the product of a 16-bit scale and
    an integer of at most 9 bits is exact (``tests/test_quant_federated.py`` loads a saved run
    so), in a bfloat16 model it is that product rounded once to bfloat16 (float32 computes it
    exactly, then one rounding: the correctly rounded bfloat16 product)."""
    groups = _column_groups(q.shape[1], group_size, g_idx).to(q.device)
    if scale.shape != zero_point.shape or scale.shape[0] != q.shape[0] \
            or int(groups.max()) >= scale.shape[1]:
        raise ValueError(f"scales {tuple(scale.shape)} and zero points "
                         f"{tuple(zero_point.shape)} do not fit integers {tuple(q.shape)} with "
                         f"{int(groups.max()) + 1} groups")
    s = scale[:, groups].to(CALC_DTYPE)
    out = q.to(CALC_DTYPE) - zero_point[:, groups].to(CALC_DTYPE)
    return _in_dtype(out * s, dtype)


def _in_dtype(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The exact float32 product as a model of ``dtype`` holds it (rounded once for a 16-bit
    model), as float32."""
    return exact if dtype == CALC_DTYPE else exact.to(dtype).to(CALC_DTYPE)


def _scale_dtype(weight: torch.Tensor, scale_dtype: torch.dtype | None) -> torch.dtype:
    dtype = weight.dtype if scale_dtype is None else scale_dtype
    if not dtype.is_floating_point:
        raise ValueError(f"scale dtype {dtype}: expected a floating-point dtype (the weight's "
                         "by default)")
    return dtype


@torch.no_grad()
def observe(weight: torch.Tensor, config: QuantConfig, scale_dtype: torch.dtype | None = None,
            perm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zero points ``[out, groups]`` of a dense weight ``[out, in]`` (the ``minmax``
    observer, module docstring), computed in ``scale_dtype`` (default: the weight's dtype).
    ``perm``: the groups are formed over the columns in that order (activation order
    ``group``)."""
    if weight.dim() != 2:
        raise ValueError(f"weight of shape {tuple(weight.shape)}: expected [out, in]")
    dtype = _scale_dtype(weight, scale_dtype)
    rows, cols = weight.shape
    size = config.group_size or cols
    if cols % size:
        config.check_width("this weight", cols)
    w = weight.detach().to(dtype)
    if perm is not None:
        w = w[:, perm]
    grouped = w.reshape(rows, cols // size, size)
    min_vals = torch.amin(grouped, dim=-1)
    max_vals = torch.amax(grouped, dim=-1)
    min_vals = torch.min(min_vals, torch.zeros_like(min_vals))
    max_vals = torch.max(max_vals, torch.zeros_like(max_vals))
    qmin, qmax = quant_range(config.bits)
    bit_min = torch.tensor(float(qmin), device=w.device)
    bit_max = torch.tensor(float(qmax), device=w.device)
    bit_range = bit_max - bit_min
    eps = torch.tensor(torch.finfo(dtype).eps, dtype=dtype, device=w.device)
    if config.symmetric:
        max_pos = torch.max(torch.abs(min_vals), torch.abs(max_vals))
        scales = max_pos / (bit_range.to(dtype) / 2)
        scales = torch.where(scales == 0, eps, scales)
        zero_points = torch.zeros(scales.shape, dtype=INT_DTYPE, device=w.device)
        return scales, zero_points
    scales = (max_vals - min_vals) / bit_range.to(dtype)
    scales = torch.where(scales == 0, eps, scales)
    zero_points = bit_min - (min_vals / scales)
    zero_points = torch.clamp(zero_points, bit_min, bit_max)
    zero_points = torch.round(zero_points).to(INT_DTYPE)
    return scales, zero_points


def _qdq(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, qmin: float, qmax: float,
         dtype: torch.dtype = CALC_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(integers, dequantized)`` of ``w`` (float32) with scales ``s`` and zero points ``z``
    (None: symmetric) broadcast to ``w``; the dequantized value as a model of ``dtype`` holds
    it, as float32."""
    scaled = w / s
    if z is not None:
        scaled = scaled + z.to(scaled.dtype)
    qf = torch.round(torch.clamp(scaled, qmin, qmax))
    deq = qf.to(CALC_DTYPE)
    if z is not None:
        deq = deq - z.to(CALC_DTYPE)
    return qf.to(INT_DTYPE), _in_dtype(deq * s.to(CALC_DTYPE), dtype)


@torch.no_grad()
def rtn_quantize(weight: torch.Tensor, config: QuantConfig, *,
                 scale_dtype: torch.dtype | None = None, mask: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None, name: str = "") -> QuantResult:
    """Round-to-nearest: every weight quantized with its group's scale and zero point from the
    dense weights (:func:`observe`), no data. ``mask`` (True = pruned): those weights are
    quantized as 0, exactly (their integer is the zero point). ``dense``: the weights the scales
    are observed on, when ``weight`` is already pruned (default: ``weight``).

    Activation order ``static`` does not change round-to-nearest (each weight is rounded on its
    own); ``group`` needs a Hessian and is refused."""
    config.check_width(name or "this weight", weight.shape[1])
    if config.actorder == "group":
        raise ValueError("activation order 'group' forms groups by the Hessian's diagonal: "
                         "round-to-nearest has no Hessian; expected actorder none or static "
                         "(which does not change round-to-nearest)")
    dtype = _scale_dtype(weight if dense is None else dense, scale_dtype)
    reference = weight if dense is None else dense
    if reference.shape != weight.shape:
        raise ValueError(f"dense weight of shape {tuple(reference.shape)} for a weight of "
                         f"shape {tuple(weight.shape)}")
    scale, zero_point = observe(reference, config, dtype)
    W = weight.detach().to(SWEEP_DTYPE).clone()
    if mask is not None:
        if mask.shape != W.shape:
            raise ValueError(f"prune mask of shape {tuple(mask.shape)} for a weight of shape "
                             f"{tuple(W.shape)}")
        W[mask.to(W.device)] = 0
    groups = _column_groups(W.shape[1], config.group_size, None).to(W.device)
    qmin, qmax = quant_range(config.bits)
    q, _ = _qdq(W, scale[:, groups], None if config.symmetric else zero_point[:, groups],
                qmin, qmax)
    return QuantResult(q, scale, zero_point, None, config.group_size, config.symmetric,
                       weight.dtype)


class _ColumnQuantizer:
    """The quantizer :func:`~fedcompress.solver.obs.obs_sweep` calls on each column (in the
    sweep's order): records the integers, returns the dequantized column."""

    def __init__(self, scale: torch.Tensor, zero_point: torch.Tensor, groups: torch.Tensor,
                 config: QuantConfig, rows: int, cols: int, dtype: torch.dtype):
        self.scale = scale
        self.dtype = dtype
        self.zero_point = None if config.symmetric else zero_point
        self.groups = groups.tolist()
        self.qmin, self.qmax = quant_range(config.bits)
        self.q = torch.zeros(rows, cols, dtype=INT_DTYPE, device=scale.device)

    def __call__(self, column: torch.Tensor, index: int) -> torch.Tensor:
        g = self.groups[index]
        z = None if self.zero_point is None else self.zero_point[:, g]
        q, deq = _qdq(column, self.scale[:, g], z, self.qmin, self.qmax, self.dtype)
        self.q[:, index] = q
        return deq


def activation_order(hessian: torch.Tensor) -> torch.Tensor:
    """The columns by decreasing Hessian diagonal (a stable sort: ties keep column order)."""
    return torch.argsort(torch.diagonal(hessian), descending=True, stable=True)


@torch.no_grad()
def _obs_quantize(weight: torch.Tensor, hessian: torch.Tensor, config: QuantConfig,
                  scale_dtype: torch.dtype | None, name: str, sparsity: float | None = None,
                  group: str = "layer", nm: tuple[int, int] | None = None,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, QuantResult,
                                                             torch.Tensor]:
    if weight.dim() != 2:
        raise ValueError(f"weight of shape {tuple(weight.shape)}: expected [out, in]")
    rows, cols = weight.shape
    config.check_width(name or "this weight", cols)
    if nm is not None and config.actorder != "none":
        raise ValueError(f"N:M {nm[0]}:{nm[1]} pruning with activation order "
                         f"{config.actorder!r}: the sweep would visit the columns of an N:M run "
                         "out of order; expected actorder none")
    dtype = _scale_dtype(weight, scale_dtype)
    H = hessian.to(HESSIAN_DTYPE)
    if H.shape != (cols, cols):
        raise ValueError(f"Hessian of shape {tuple(H.shape)} does not match {cols} input features")
    perm = activation_order(H) if config.actorder != "none" else None
    size = config.group_size or cols
    natural = torch.arange(cols, device=weight.device) // size
    g_idx = None
    if config.actorder == "group":
        assert perm is not None
        scale, zero_point = observe(weight, config, dtype, perm=perm.to(weight.device))
        working = natural  # groups formed in the sweep's order
        if config.group_size:
            g_idx = torch.empty(cols, dtype=G_IDX_DTYPE, device=weight.device)
            g_idx[perm.to(weight.device)] = natural.to(G_IDX_DTYPE)
    else:
        scale, zero_point = observe(weight, config, dtype)
        working = natural if perm is None else natural[perm.to(weight.device)]
    W, hinv, _ = prepare_obs(weight, H, config.dampening, name, perm=perm)
    quantizer = _ColumnQuantizer(scale, zero_point, working, config, rows, cols, weight.dtype)
    if mask is not None and perm is not None:
        mask = mask[:, perm.to(mask.device)]
    prune_mask, W = obs_sweep(W, hinv, config.block_size, sparsity=sparsity, group=group, nm=nm,
                              mask=mask, quantize=quantizer)
    q = quantizer.q
    if perm is not None:
        inverse = torch.argsort(perm).to(W.device)
        W, q, prune_mask = W[:, inverse], q[:, inverse], prune_mask[:, inverse]
    if g_idx is None and config.actorder == "group" and config.group_size:
        raise AssertionError("activation order 'group' lost its g_idx")
    result = QuantResult(q.contiguous(), scale, zero_point, g_idx, config.group_size,
                         config.symmetric, weight.dtype)
    return prune_mask, result, W


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, config: QuantConfig, *,
                  scale_dtype: torch.dtype | None = None, mask: torch.Tensor | None = None,
                  name: str = "") -> QuantResult:
    """GPTQ (Frantar et al., 2023) of a weight ``[out, in]`` with the Hessian ``2/N X^T X``
    of its inputs (module docstring). ``mask`` (True = pruned): a fixed prune mask whose
    weights are set to 0 (and stay 0) in the same sweep, their error compensated like the
    quantization error. ``scale_dtype``: that of the scales (default: the weight's). The
    sweep's dequantized weights are :attr:`QuantResult.weight` exactly."""
    return _obs_quantize(weight, hessian, config, scale_dtype, name, mask=mask)[1]


def sparsegpt_quantize(weight: torch.Tensor, hessian: torch.Tensor, config: QuantConfig,
                       sparsity: float, group: str = "layer", nm: tuple[int, int] | None = None,
                       *, scale_dtype: torch.dtype | None = None, name: str = ""
                       ) -> tuple[torch.Tensor, QuantResult]:
    """SparseGPT and GPTQ in one sweep (the SparseGPT paper's joint pruning and quantization):
    in each block the mask is chosen as :func:`~fedcompress.pruning.scores.sparsegpt_prune`
    chooses it (``sparsity`` and ``group``, or ``nm``), each pruned weight is set to 0 and each
    kept one quantized, and the error of both is compensated on the later columns. Blocks of
    ``config.block_size`` columns, dampening ``config.dampening``. Returns ``(prune_mask,
    QuantResult)``: every pruned weight's integer is its zero point (dequantized: exactly 0)."""
    if nm is None:
        mask, result, _ = _obs_quantize(weight, hessian, config, scale_dtype, name,
                                        sparsity=sparsity, group=group)
    else:
        mask, result, _ = _obs_quantize(weight, hessian, config, scale_dtype, name, nm=nm)
    return mask, result
