"""The statistics mode's wire, shared by the sites' and the server's code and by its DP: the
keys of a layer's statistics, the widths of its linear layers' inputs and which of them read
the same tensor (:func:`layer_sharing`: sent once), the Hessian's upper triangle in wire order,
and SecAgg+'s fixed-point lanes (:func:`encode_fixed`, :func:`decode_fixed`).

:mod:`fedcompress.methods.fedprllm.stats` (the mode: encoding, validation, the server's step)
and :mod:`fedcompress.methods.fedprllm.dp` (its differential privacy) both build on it, and
``stats`` re-exports every public name here, its import path before this module.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from fedcompress.models import ModelAdapter, weight_matrix
from fedcompress.pruning.walker import observed_input_owners

#: the fixed-point refusals are logged under the statistics mode's name, as before the split
logger = logging.getLogger("fedcompress.methods.fedprllm.stats")


class InvalidStatsError(ValueError):
    """A site's statistics are unusable (missing or extra layer, shape, dtype, values)."""


def stat_key(layer: int, name: str, part: str) -> str:
    """The wire key of linear ``name``'s statistic ``part`` (``sq`` or ``h``) of ``layer``."""
    return f"stats.{layer}.{name}.{part}"


def tokens_key(layer: int) -> str:
    return f"stats.{layer}.tokens"


def layer_in_features(model: nn.Module, layer: int) -> dict[str, int]:
    """Input features of every prunable linear layer of decoder layer ``layer``."""
    adapter = ModelAdapter(model)
    if not 0 <= layer < len(adapter):
        raise ValueError(f"layer {layer} out of range: the model has {len(adapter)} layers")
    return {name: int(weight_matrix(m).shape[1])
            for name, m in ModelAdapter.linear_layers(adapter.layers[layer]).items()}


@functools.lru_cache(maxsize=32)
def triu_indices(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each entry of an ``n x n`` upper triangle in wire order (row-major);
    cached (a model has a handful of widths): callers index with them and never write them."""
    rows, cols = torch.triu_indices(n, n)
    return rows, cols


#: Fractional bits of the fixed-point statistics summed by SecAgg+ (``--secagg-frac-bits``
#: default): a site's value ``v`` travels as ``q = round(v * 2^f)`` in a 64-bit lane, so each
#: site's rounding error is at most ``2^-(f+1)`` (1.5e-8 at f = 25) and a sum of ``n`` sites'
#: at most ``n 2^-(f+1)``; a site refuses to send a value unless ``n |q| <= 2^63 - 1``
#: (:func:`fixed_point_limit`; ``|v|`` below about 1.7e10 for 16 sites at f = 25), so that
#: neither its own lane nor the sum of all ``n`` sites' lanes can wrap.
FRAC_BITS = 25
_INT64_MAX = 2**63 - 1


def fixed_point_layout(arrays: Mapping[str, np.ndarray]) -> list[tuple[str, int]]:
    """``(key, size)`` of each statistic in the order of a fixed-point vector (sorted keys)."""
    return [(key, int(np.asarray(arrays[key]).size)) for key in sorted(arrays)]


def _check_fixed_args(frac_bits: int, n_sites: int) -> None:
    if isinstance(frac_bits, bool) or not isinstance(frac_bits, (int, np.integer)) \
            or not 0 <= frac_bits <= 52:
        raise ValueError(f"frac_bits={frac_bits!r}: expected an integer 0..52")
    if isinstance(n_sites, bool) or not isinstance(n_sites, (int, np.integer)) or n_sites < 1:
        raise ValueError(f"n_sites={n_sites!r}: expected an integer >= 1 (the number of sites "
                         "whose fixed-point vectors are summed)")


def fixed_point_limit(n_sites: int) -> int:
    """The largest magnitude of one site's fixed-point integer ``q`` (a lane): ``n_sites``
    such lanes sum to at most ``2^63 - 1`` in magnitude, so no sum wraps (negative ones
    included: the sum stays above ``-2^63``)."""
    _check_fixed_args(0, n_sites)
    return _INT64_MAX // int(n_sites)


def fixed_point_range(frac_bits: int, n_sites: int) -> float:
    """The largest magnitude a site's float statistic may have (:data:`FRAC_BITS`), as a float
    (rounded down): :func:`fixed_point_limit` ``/ 2^frac_bits``, less half a unit of the last
    place for the rounding to the integer lane. The check itself is exact, on the integers."""
    _check_fixed_args(frac_bits, n_sites)
    limit = fixed_point_limit(n_sites)
    value = float(limit)
    while int(value) > limit:  # float(limit) may round up
        value = float(np.nextafter(value, 0.0))
    return float(np.ldexp(value - 0.5, -frac_bits))


def _check_lanes(key: str, lanes: list[int], limit: int, frac_bits: int, n_sites: int,
                 integer: bool) -> None:
    for lane in lanes:
        if abs(lane) > limit:
            # The value itself is private (a site's exact statistic, which the server would
            # read in the error reply, outside SecAgg+): logged here only, never raised.
            shown = str(lane) if integer else f"{np.ldexp(float(lane), -frac_bits):.6g}"
            logger.error("%s: a value of %s (%d in its 64-bit lane) exceeds the fixed-point "
                         "range", key, shown, lane)
            raise ValueError(
                f"{key}: a value exceeds the fixed-point range of {frac_bits} fractional "
                f"bits for {n_sites} sites: |lane| <= {limit} = (2^63 - 1) // {n_sites}, "
                f"|value| <= {fixed_point_range(frac_bits, n_sites):.6g} (a sum could "
                "overflow 64 bits): lower secagg-frac-bits (the value is in this site's "
                "log, not in this message)")


def encode_fixed(arrays: Mapping[str, np.ndarray], frac_bits: int, n_sites: int,
                 noise: Mapping[str, np.ndarray] | None = None,
                 sq_from_diag: Mapping[str, str] | None = None) -> np.ndarray:
    """One site's statistics (:func:`~fedcompress.methods.fedprllm.stats.encode_stats`) as
    one fixed-point vector for SecAgg+'s 64-bit lanes: token counts as integers, float values
    as ``round(v * 2^frac_bits)``, both in two's complement (uint64), in
    :func:`fixed_point_layout` order. A lane whose magnitude exceeds :func:`fixed_point_limit`
    (``n_sites`` of them could sum past 64 bits) is refused, never clipped: the check is on the
    rounded integers, exactly, for the largest positive and the most negative value of each
    statistic.

    DP (:func:`fedcompress.methods.fedprllm.dp.noisy_fixed`): ``noise`` (int64 per key) is
    added to the rounded lanes before the check; ``sq_from_diag`` (``{square-sum key: Hessian
    key}``) replaces those square-sum lanes by half the (noisy) Hessian's diagonal lanes."""
    _check_fixed_args(frac_bits, n_sites)
    limit = fixed_point_limit(n_sites)
    lanes: dict[str, np.ndarray] = {}
    integers: dict[str, bool] = {}
    for key, _ in fixed_point_layout(arrays):
        value = np.asarray(arrays[key]).reshape(-1)
        if value.dtype.kind in "iu":
            integer = True
        elif value.dtype.kind == "f":
            value = value.astype(np.float64)
            if not np.isfinite(value).all():
                raise ValueError(f"{key}: not finite")
            value = np.rint(np.ldexp(value, frac_bits))  # exact integers in float64
            integer = False
        else:
            raise ValueError(f"{key}: dtype {value.dtype} is neither integer nor float")
        ends = [int(value.max()), int(value.min())] if value.size else []
        _check_lanes(key, ends, limit, frac_bits, n_sites, integer)
        lanes[key], integers[key] = value.astype(np.int64), integer
    for key, extra in (noise or {}).items():
        extra = np.asarray(extra).reshape(-1)
        if key not in lanes or extra.dtype != np.int64 or extra.shape != lanes[key].shape:
            raise ValueError(f"noise for {key}: expected int64 of the statistic's shape")
        if np.abs(extra).max(initial=0) > limit:
            raise ValueError(f"noise for {key} exceeds the fixed-point range")
        lanes[key] = lanes[key] + extra  # both within (2^63 - 1) / n: no wrap
    for sq_key, h_key in (sq_from_diag or {}).items():
        n = lanes[sq_key].shape[0]
        rows, cols = triu_indices(n)
        diag = lanes[h_key][(rows == cols).numpy()]
        lanes[sq_key] = np.floor_divide(diag, 2)
    parts = []
    for key, _ in fixed_point_layout(arrays):
        value = lanes[key]
        if noise and key in noise:
            ends = [int(value.max()), int(value.min())] if value.size else []
            _check_lanes(key, ends, limit, frac_bits, n_sites, integers[key])
        parts.append(value)
    return np.concatenate(parts).view(np.uint64) if parts else np.zeros(0, np.uint64)


def decode_fixed(total: np.ndarray, layout: list[tuple[str, int]], frac_bits: int,
                 dtypes: Mapping[str, np.dtype]) -> dict[str, np.ndarray]:
    """The summed statistics from the sum of the sites' :func:`encode_fixed` vectors (int64,
    as SecAgg+ returns it): integer statistics as int64, float ones as float64."""
    total = np.asarray(total)
    if total.dtype != np.int64 or total.shape != (sum(size for _, size in layout),):
        raise InvalidStatsError(f"a fixed-point sum of {total.dtype} {total.shape}: expected "
                                f"int64 ({sum(size for _, size in layout)},)")
    out, offset = {}, 0
    for key, size in layout:
        chunk = total[offset:offset + size]
        offset += size
        out[key] = (chunk.copy() if np.dtype(dtypes[key]).kind in "iu"
                    else np.ldexp(chunk.astype(np.float64), -frac_bits))
    return out


@torch.no_grad()
def layer_sharing(model: nn.Module, layer: int) -> dict[str, str]:
    """Which linear layers of decoder layer ``layer`` read the very same input tensor (q/k/v,
    gate/up): ``{name: owner}``, the owner the first such name in sorted order, as
    :func:`~fedcompress.methods.fedprllm.stats.encode_stats` names it. Found from the
    architecture, by one forward of four tokens with a pre-hook on each linear layer (what the
    statistics of any data would show)."""
    adapter = ModelAdapter(model)
    device = next(model.parameters()).device
    owners = observed_input_owners(
        ModelAdapter.linear_layers(adapter.layers[layer]),
        lambda: model(torch.zeros(1, 4, dtype=torch.long, device=device), use_cache=False),
        f"layer {layer}: ")
    return {name: owner for name, owner in owners.items() if owner != name}
