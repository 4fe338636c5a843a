"""Post-processing of a differentially private statistics release
(:mod:`fedcompress.privacy.dp_stats`): what the server does with the noisy sum of a layer
before it prunes (a positive-definite Hessian, shrinkage toward a public prior, the map back to
the inputs' units). Post-processing of a DP release costs no privacy. Plain torch, no Flower."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _distinct(stats: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(owner name, statistics)`` once per distinct object of ``stats`` (sharers hold their
    owner's object; the first name in sorted order is the owner)."""
    done: set[int] = set()
    for name in sorted(stats):
        st = stats[name]
        if id(st) not in done:
            done.add(id(st))
            yield name, st



def make_positive_definite(h: torch.Tensor, noise_std: float) -> torch.Tensor:
    """A symmetric positive-definite version of a noisy Hessian (post-processing): eigenvalues
    floored at ``2 sqrt(d) noise_std`` (the spectral norm a symmetric Gaussian noise matrix of
    entry std ``noise_std`` stays below with high probability), and at least ``1e-8`` of the
    largest eigenvalue's magnitude."""
    if h.dim() != 2 or h.shape[0] != h.shape[1]:
        raise ValueError(f"a Hessian of shape {tuple(h.shape)}: expected a square matrix")
    sym = (h.double() + h.double().T) / 2
    vals, vecs = torch.linalg.eigh(sym)
    top = float(vals.abs().max()) if vals.numel() else 0.0
    floor = max(2.0 * math.sqrt(h.shape[0]) * float(noise_std), 1e-8 * top, 1e-12)
    vals = torch.clamp(vals, min=floor)
    out = (vecs * vals) @ vecs.T
    return ((out + out.T) / 2).to(h.dtype)


def _block_scales(scales: Mapping[str, torch.Tensor], name: str, dim: int) -> torch.Tensor:
    """Block ``name``'s public scales (float64), checked against its ``dim`` coordinates."""
    if name not in scales:
        raise ValueError(f"no public scales for {name}: expected one per block")
    c = torch.as_tensor(scales[name], dtype=torch.float64)
    if c.shape[0] != dim:
        raise ValueError(f"public scales of {name}: {c.shape[0]} coordinates, its "
                         f"statistics have {dim}")
    return c


def denormalize(stats: Mapping[str, Any], scales: Mapping[str, torch.Tensor],
                hessian: bool) -> None:
    """Map a sum of normalized statistics back to the inputs' units (post-processing with public
    values, free): square sums times ``c``; a Hessian ``R H R`` with ``R = diag(sqrt(c))`` (its
    square sums ``diag / 2``). In place, once per distinct statistics object (``scales`` by its
    owner's name)."""
    for name, st in _distinct(stats):
        c = _block_scales(scales, name, st.in_features)
        if hessian:
            r = c.sqrt().to(st.hessian_sum)
            st.hessian_sum = st.hessian_sum * r[:, None] * r[None, :]
            st.sq_sum = torch.diagonal(st.hessian_sum).double().clone() / 2
        else:
            st.sq_sum = st.sq_sum * c.to(st.sq_sum)


#: Standard errors of the noise's sample variance that the coordinates' spread must pass before
#: the shrinkage credits any of it to the signal (pure noise passes 2 about 2% of the time).
SPREAD_Z = 2.0


#: Chance that any block of a run releases pure noise as signal under ``prior="public"``
#: (:func:`spread_z`).
FALSE_SIGNAL_RATE = 0.01


def spread_z(tests: int, rate: float = FALSE_SIGNAL_RATE) -> float:
    """The standard errors a noise-only spread must pass in ``tests`` tests (a run's blocks
    times its releases, diagonal and off-diagonal apart) for the chance that any one passes to
    be at most ``rate`` (Bonferroni, normal approximation of the sample variance)."""
    from statistics import NormalDist

    if tests < 1 or not 0 < rate < 1:
        raise ValueError(f"tests={tests}, rate={rate}: expected tests >= 1 and 0 < rate < 1")
    return NormalDist().inv_cdf(1.0 - rate / tests)


def _js_weight(residual: torch.Tensor, noise_std: float, square: float | None = None,
               z: float = SPREAD_Z) -> float:
    """The James-Stein weight ``w = tau^2 / (tau^2 + s^2)`` of residuals from a prior under
    noise ``s = noise_std``: the signal's spread ``tau^2`` is what the residuals' mean square
    (over ``n - 1``; ``square`` when already computed) has beyond the noise's ``s^2`` and
    beyond ``z`` standard errors of a noise-only sample variance (``s^2 sqrt(2 / (n - 1))``):
    a spread the noise alone could give is not credited to the signal."""
    n = residual.numel()
    if square is None:
        square = float(residual.pow(2).sum()) / (n - 1)
    noise = float(noise_std) ** 2
    spread = square - noise * (1.0 + z * math.sqrt(2.0 / (n - 1)))
    return spread / (spread + noise) if spread > 0 else 0.0


def _js(values: torch.Tensor, noise_std: float) -> tuple[torch.Tensor, float]:
    """``values`` shrunk toward their mean with the James-Stein weight (:func:`_js_weight`)
    for noise ``noise_std``; and that weight."""
    if values.numel() < 2:
        return values, 1.0
    mean = values.mean()
    weight = _js_weight(values - mean, noise_std, float(values.var()))
    return mean + weight * (values - mean), weight


def _level(values: torch.Tensor, prior: torch.Tensor, tokens: int) -> float:
    """The least-squares level ``a`` of ``values ~ a * prior``; where the noise makes it not
    positive, ``tokens`` (the release's public token count: the level of a per-token prior
    without clipping)."""
    norm = float(prior.pow(2).sum())
    if not (math.isfinite(norm) and norm > 0):
        raise ValueError(f"a prior of squared norm {norm}: expected a finite number > 0")
    level = float((values * prior).sum()) / norm
    if level > 0:
        return level
    logger.warning("the noisy release's level toward the public prior is %.3g: taking its "
                   "token count %d instead", level, tokens)
    return float(tokens)


def normalized_prior(stats: Mapping[str, Any], scales: Mapping[str, torch.Tensor],
                     hessian: bool) -> dict[str, torch.Tensor]:
    """Public text's own statistics of a layer as a prior of :func:`shrink`: per block (the
    owners of ``scales``; ``stats`` by linear name, as the walker gives them), the square sums
    (with ``hessian``: the Hessian sum) in the units of the normalized release (``v / c``;
    ``R^-1 H R^-1``) and per token. Computed from public data only (no privacy cost)."""
    out = {}
    for name in sorted(scales):
        if name not in stats:
            raise ValueError(f"no public statistics of {name}: expected one per block")
        st = stats[name]
        if not st.tokens > 0:
            raise ValueError(f"public statistics of {name} over {st.tokens} tokens: expected > 0")
        c = _block_scales(scales, name, st.in_features)
        if hessian:
            inv = c.rsqrt()
            out[name] = st.hessian_sum.double() * inv[:, None] * inv[None, :] / st.tokens
        else:
            out[name] = st.sq_sum.double() / c / st.tokens
    return out


def shrink(stats: Mapping[str, Any], std: Mapping[str, float], hessian: bool,
           prior: Mapping[str, torch.Tensor] | None = None, z: float | None = None
           ) -> dict[str, float]:
    """Shrink each block's noisy NORMALIZED release toward a public prior (module docstring;
    post-processing), in place, once per distinct statistics object (``std``: each block's
    total noise std, by its owner's name):

    * without ``prior`` (``prior="shrink"``): the square sums toward their mean; a Hessian's
      diagonal and off-diagonal entries each toward its own mean;
    * with ``prior`` (``prior="public"``; :func:`normalized_prior`: public text's own
      statistics of the layer, by owner): toward ``a * prior``, ``a`` the release's
      least-squares level (clipping lowers it; a Hessian's one level over its upper triangle,
      so that a drowned release is a multiple of the public Hessian; the release's token count
      where the noise makes that level not positive), the residuals of a
      Hessian's diagonal and off-diagonal entries each with its own weight.

    A Hessian's square sums are then ``diag / 2``. ``z``: the standard errors a spread must
    pass to be credited to the signal with a prior (default :data:`SPREAD_Z`; a run's
    :func:`spread_z`: a false pass lets noise through and lifts the positive-definite floor).
    Returns each block's noise std left after the shrinkage (the largest weight times
    ``std``), the floor of :func:`postprocess` after a shrinkage toward public statistics."""
    z = SPREAD_Z if z is None else float(z)
    left = {}
    for name, st in _distinct(stats):
        if name not in std:
            raise ValueError(f"no noise scale for {name}: expected one per block")
        p = None
        if prior is not None:
            if name not in prior:
                raise ValueError(f"no prior for {name}: expected one per block")
            p = prior[name].double()
            want = (st.in_features,) * (2 if hessian else 1)
            if tuple(p.shape) != want:
                raise ValueError(f"prior of {name}: shape {tuple(p.shape)}, expected {want}")
        if not hessian:
            values = st.sq_sum.double()
            if p is None:
                st.sq_sum, weight = _js(values, std[name])
            else:
                target = _level(values, p, st.tokens) * p
                weight = _js_weight(values - target, std[name], z=z)
                st.sq_sum = target + weight * (values - target)
            left[name] = weight * float(std[name])
            continue
        h = st.hessian_sum.double()
        n = h.shape[0]
        rows, cols = torch.triu_indices(n, n, offset=1)
        diag, off = torch.diagonal(h).clone(), h[rows, cols].clone()
        if p is None:
            diag, w_diag = _js(diag, std[name])
            off, w_off = _js(off, std[name]) if n > 1 else (off, 0.0)
        else:
            urows, ucols = torch.triu_indices(n, n)
            level = _level(h[urows, ucols], p[urows, ucols], st.tokens)
            t_diag, t_off = level * torch.diagonal(p), level * p[rows, cols]
            w_diag = _js_weight(diag - t_diag, std[name], z=z) if n > 1 else 1.0
            w_off = _js_weight(off - t_off, std[name], z=z) if n > 2 else 1.0
            diag = t_diag + w_diag * (diag - t_diag)
            off = t_off + w_off * (off - t_off)
        out = torch.diag(diag)
        out[rows, cols] = off
        out[cols, rows] = off
        st.hessian_sum = out.to(st.hessian_sum.dtype)
        st.sq_sum = torch.diagonal(out).clone() / 2
        left[name] = max(w_diag, w_off) * float(std[name])
    return left


def postprocess(stats: Mapping[str, Any], std: Mapping[str, float], hessian: bool) -> None:
    """After the noise (post-processing, free): Wanda's square sums floored at 0; SparseGPT's
    Hessian sum made positive definite (:func:`make_positive_definite`) and its square sums
    set to ``diag / 2``. In place, once per distinct statistics object; ``std``: each block's
    noise std (its owner's name): the total, or what :func:`shrink` left of it."""
    for name, st in _distinct(stats):
        if hessian:
            st.hessian_sum = make_positive_definite(st.hessian_sum, std[name])
            st.sq_sum = torch.diagonal(st.hessian_sum).double().clone() / 2
        else:
            st.sq_sum = torch.clamp(st.sq_sum, min=0.0)
