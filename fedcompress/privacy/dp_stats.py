"""Differentially private layer statistics: the mechanism and its accounting (no Flower).

What a site releases in FedPrLLM's statistics mode (``aggregate=stats``) is, per decoder layer,
a SUM over its calibration windows of each window's input statistics: Wanda's per-column square
sums ``v_w[j] = sum_{t in w} x_tj^2`` and SparseGPT's ``H_w = sum_{t in w} 2 x_t x_t^T``. This
module makes that release differentially private.

**Privacy unit: one calibration window** (``seqlen`` consecutive tokens of the site's text).
A window is what the calibration draws, what the statistics are a sum over, and what the
leakage study's attacker identifies (which window a site calibrated on). A document that spans
``k`` windows is protected at ``k`` times the epsilon (group privacy); a site whose data has
short documents can cut one window per document to make the unit a document.

**Adjacency: replace one window** (the number of windows ``n`` and ``seqlen`` are public: they
are the run's announced calibration budget, so the token count ``n * seqlen`` a site sends is
data-independent and leaks nothing; :func:`check_public_tokens` refuses any other count).

**Clipping, per distinct input ("block").** A decoder layer's linear layers read ``k`` distinct
input tensors (llama: the q/k/v input, o's, the gate/up input, down's: ``k = 4``). Each window's
contribution to block ``j`` (Wanda: the vector ``v_w`` of the block's square sums; SparseGPT: the
matrix ``H_w``) is scaled by ``min(1, C_j / ||.||)`` (L2 norm; Frobenius for ``H_w``) BEFORE it is
summed, with a bound ``C_j`` per block (per input, because the inputs' scales differ by orders of
magnitude: one joint bound would drown the small blocks in noise). Both statistics are in a cone
of non-negative ``<a, b>`` (non-negative vectors; positive semi-definite matrices, ``tr(AB) >= 0``),
so replacing one window moves block ``j`` by at most ``sqrt(||a||^2 + ||b||^2) <= sqrt(2) C_j``
(adding or removing one: ``C_j``). Measured in units of the bounds (block ``j`` divided by
``C_j``), the layer's release has L2 sensitivity ``Delta = sqrt(2 k)``: the per-input bounds
COMPOSE, which the noise pays for (:func:`block_noise_std`). SparseGPT's Hessian is released as
its upper triangle (``||triu(D)||_2 <= ||D||_F``); its square sums are then ``diag(H) / 2``
(post-processing, no extra cost).

**Mechanism.** Gaussian noise of standard deviation ``sigma * Delta * C_j`` on block ``j``:
one Gaussian mechanism with noise multiplier ``sigma`` per layer. A run releases ``L`` layers,
each computed on the site's data after the previous layers were pruned with masks derived from
earlier releases: an ADAPTIVE composition of ``L`` Gaussian mechanisms on the same data, which
RDP composes exactly as DP-SGD's steps at sampling rate 1. ``sigma`` is set once for the whole
run by opacus' RDP accountant (:func:`gaussian_sigma`, through
:mod:`fedcompress.privacy.accounting`; ``steps = L``, ``sample_rate = 1``). Two placements:

* ``central``: the site sends its clipped, UN-noised sum; the server adds
  ``N(0, (sigma Delta C_j)^2)`` to the sites' sum (:func:`add_gaussian`). The server is trusted
  with the un-noised sum (and, without SecAgg+, with each site's clipped sum); its noise is
  floating-point Gaussian from OS entropy, not hardened against floating-point attacks.
* ``distributed``: under SecAgg+, each of the ``n`` sites adds integer noise to its fixed-point
  lanes (:func:`skellam_noise`), a symmetric Skellam share ``Sk`` of variance ``V_j / t`` with
  ``V_j = (sigma Delta C_j 2^f)^2`` in lanes of ``f`` fractional bits and ``t`` the SecAgg+
  threshold: sums of Skellams are Skellam, so whenever at least ``t`` sites are honest the sum
  the server unmasks carries Skellam noise of variance at least ``V_j`` (more if more sites
  are honest). It is accounted as Skellam, not as a Gaussian (:func:`skellam_rdp`: Agarwal,
  Kairouz, Liu, "The Skellam Mechanism for Differentially Private Federated Learning",
  NeurIPS 2021, Theorem 3.5 / Corollary 3.6, for integer orders ``alpha > 1`` and per-coordinate
  variance ``V``: ``eps(alpha) <= alpha D2^2 / (2V) + min(((2 alpha - 1) D2^2 + 6 D1) / (4 V^2),
  3 D1 / (2 V))``, as in the authors' ``distributed_dp`` accounting code), with the rounding of
  the site's sum to lanes counted in the sensitivity (``D2 = sqrt(2) C_j 2^f + sqrt(d_j)``,
  ``D1 = sqrt(d_j) D2``), block by block (independent noise: Renyi divergences add), composed
  over the ``L`` layers and converted to ``(epsilon, delta)`` by opacus' ``get_privacy_spent``.
  ``sigma`` is then the smallest that meets the target under that accountant
  (:func:`skellam_sigma`).

**Randomness.** Every draw a guarantee depends on comes from a generator seeded from the OS's
entropy once per release (:func:`secret_rng`: ``numpy.random.default_rng(secrets.randbits(128))``;
PCG64 then expands that 128-bit secret seed, so the draws are as secret as the seed, not OS
entropy per draw). A seed is for tests and research only; the guarantee does not hold against
whoever knows it.

**Defaults for the bounds** (:func:`public_calibration`): a high quantile (:data:`CLIP_QUANTILE`)
of the per-window norms of PUBLIC text (the bundled ``wiki`` corpus; another bundled corpus, or
a file the federation publishes and pins by its SHA-256 digest, :func:`check_public_text`)
through the DENSE model, per layer and block, computed from public data only (no privacy cost;
every site and the server compute the same values). A private window above its bound is scaled
down (biased, not leaked).

**Normalization by public scales** (``normalize="public"``, the default; :func:`public_scales`).
Before a window's statistics are computed, each input coordinate ``x_j`` is divided by
``r_j = sqrt(c_j)``, its public per-token mean square (public windows through the dense model,
as the bounds), so that the released block is ``v'_w[j] = v_w[j] / c_j`` (SparseGPT:
``H'_w = R^-1 H_w R^-1``, ``R = diag(r)``); the bounds are measured in those units, and the
server multiplies the noisy, post-processed sum back (:func:`denormalize`: ``v = c * v'``,
``H = R H' R``). Why: the noise is isotropic (the same std on every coordinate of a block) and
the bound is an L2 norm over the block, but the raw square sums of a transformer's inputs span
orders of magnitude across coordinates (a few outlier channels dominate the norm), so most
coordinates of a raw release sit below the noise (measured on SmolLM2 at 16 x 64 windows and
epsilon 8: a median signal-to-noise ratio per coordinate of 0.05 to 1.5, and about 40% of a
Wanda mask's bits flipped). Normalized, every coordinate carries a share of the bound of the
same order (a median ratio of 1.4 to 4). The scales are public values fixed before any
private data is read: a data-independent map applied before clipping, so the sensitivity,
the accounting and the guarantee are unchanged, and multiplying back is post-processing. A
coordinate whose private values are far above its public scale makes its window clipped
(biased, not leaked).

**Shrinkage toward the public prior** (``prior="shrink"``, with normalization; :func:`shrink`).
Normalized, every coordinate of a block has the same public expectation, so the block's mean
is a prior for each coordinate; the noisy release ``y`` is shrunk toward it with the
James-Stein weight ``w = tau^2 / (tau^2 + s^2)``, ``tau^2`` the spread of the coordinates
beyond the noise ``s`` and beyond what a noise-only sample spread reaches by chance
(:data:`SPREAD_Z`) (a Hessian: its diagonal and its off-diagonal entries, each toward its own
mean). Where the noise drowns the signal (few windows, small
epsilon) the release falls back to the public scales' shape instead of a random one (exact
zeros from the floor below would prune whole input columns); where the signal dominates it is
the release itself. It reads only the release, the public scales and the public noise scale:
post-processing, no privacy cost.

**Shrinkage toward public text's own statistics** (``prior="public"``; :func:`normalized_prior`).
A flat prior is a poor one for a Hessian: its off-diagonal entries (the inputs' correlations)
carry SparseGPT's weight updates, and the flat prior has one value for all of them, so a
drowned release falls back to no correlations at all. With ``public`` the server runs the
public windows through its own model as pruned so far (the sites' walker, the global masks and
weights of the layers before) and shrinks each block toward that layer's normalized public
statistics, scaled to the release's own level (least squares: clipping lowers it). A drowned
release then gives what pruning on public text gives, and any signal improves on it. Public
text and the server's own model only: post-processing, no privacy cost.

**Post-processing** (free): negative noisy square sums are floored at 0 and a noisy Hessian is
made positive definite (:func:`make_positive_definite`: eigenvalues floored at the noise's
spectral scale) before SparseGPT inverts it.

What is NOT protected: the number of windows and ``seqlen`` (public by design); the model and
public text; a document spanning several windows (group privacy, above); in the ``central``
placement, anything against the server itself; in the ``distributed`` placement, a site whose
sum is unmasked with fewer than ``t`` honest sites' noise.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedcompress.data.corpora import BUNDLED_CORPORA
from fedcompress.privacy.accounting import (
    RDP_ALPHAS,
    BudgetError,
    check_budget,
    epsilon_spent,
    noise_multiplier,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CLIP_QUANTILE",
    "PLACEMENTS",
    "DIGEST_PREFIX",
    "PUBLIC_CORPORA",
    "PUBLIC_CORPUS",
    "PUBLIC_SPLIT",
    "PUBLIC_WINDOWS",
    "SKELLAM_ORDERS",
    "UNIT",
    "DpStatsPlan",
    "NORMALIZATIONS",
    "PublicCalibration",
    "add_gaussian",
    "block_noise_std",
    "check_public_text",
    "check_public_tokens",
    "file_digest",
    "is_digest",
    "public_text_source",
    "clip_factors",
    "clipped_layer_stats",
    "denormalize",
    "gaussian_epsilon",
    "gaussian_sigma",
    "layer_blocks",
    "make_positive_definite",
    "normalized_prior",
    "plan_dp_stats",
    "postprocess",
    "public_calibration",
    "public_clip_bounds",
    "public_scales",
    "public_windows",
    "secret_rng",
    "sensitivity",
    "shrink",
    "spread_z",
    "skellam_epsilon",
    "skellam_noise",
    "skellam_rdp",
    "skellam_sigma",
    "window_inputs",
    "window_norms",
    "window_sums",
]

#: The privacy unit of a DP statistics release.
UNIT = "window"
#: Where the noise is added.
PLACEMENTS = ("central", "distributed")
#: How input coordinates are scaled before a window's statistics are clipped: by their public
#: per-token mean square (``public``), or not at all (``none``).
NORMALIZATIONS = ("public", "none")
#: What the server does with a normalized noisy release before it prunes: shrink it toward the
#: public scales' flat shape (``shrink``, :func:`shrink`), toward public text's own statistics
#: of the layer through the server's model (``public``, :func:`normalized_prior`), or take it
#: as it is (``none``).
PRIORS = ("shrink", "public", "none")
#: Smallest public scale, relative to the block's largest (a coordinate that is (nearly) zero on
#: public text is scaled as if it were this small: its private values are then clipped, not
#: blown up to infinity).
SCALE_FLOOR = 1e-6
#: Quantile of the public per-window norms used as the default clip bound of each block.
CLIP_QUANTILE = 0.95
#: The public corpus the default bounds come from (bundled with the package), and its split
#: (not the calibration split ``train`` nor the evaluation split ``test``).
PUBLIC_CORPUS = "wiki"
PUBLIC_SPLIT = "validation"
#: The public texts a run may name instead (``dp_public_text``: the bundled corpora, their
#: :data:`PUBLIC_SPLIT` split), or a pinned file (:data:`DIGEST_PREFIX`). Never a path: a file
#: the server named could be a site's own data, and bounds or scales from it would make the
#: mechanism depend on private text.
PUBLIC_CORPORA = BUNDLED_CORPORA
#: A pinned public text: ``sha256:`` and the 64 hex digits of the SHA-256 of a file (``.txt`` or
#: ``.jsonl``, read as :func:`~fedcompress.data.corpora.load_corpus` reads a local file, the
#: whole file) that the federation publishes and every party holds a copy of: each site finds
#: it among the files its own operator listed as public (node config ``dp-public-files``),
#: the server at its ``dp_public_file``; the digest makes every party's copy the same text.
DIGEST_PREFIX = "sha256:"
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
#: Public windows the default bounds are measured on.
PUBLIC_WINDOWS = 32
#: Integer Renyi orders of the Skellam bound (it holds for integer alpha > 1): the integers of
#: :data:`~fedcompress.privacy.accounting.RDP_ALPHAS`.
SKELLAM_ORDERS = sorted({int(a) for a in RDP_ALPHAS if float(a).is_integer() and a >= 2})
#: Largest Poisson mean drawn at once: numpy's sampler is accurate up to about 2^44 (measured:
#: its variance is off by 3% at 2^48 and 10% at 2^52); larger means are drawn as sums.
_MAX_POISSON = 2.0 ** 40
#: Most Poisson draws summed per coordinate (beyond: fewer fractional bits are needed).
_MAX_PARTS = 1024


# -- randomness -------------------------------------------------------------------------------


def secret_rng(seed: int | None = None) -> np.random.Generator:
    """The generator of one release's noise: seeded from the OS's entropy
    (``secrets.randbits(128)``), or from ``seed`` (tests and research only: whoever knows it can
    subtract the noise)."""
    if seed is None:
        return np.random.default_rng(secrets.randbits(128))
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"noise seed={seed!r} is invalid: expected None (secret) or an int >= 0")
    return np.random.default_rng(seed)


# -- sensitivity and noise scale -----------------------------------------------------------


def sensitivity(blocks: int) -> float:
    """L2 sensitivity, in units of the clip bounds, of a layer's release of ``blocks`` clipped
    blocks under the replacement of one window: ``sqrt(2 * blocks)`` (module docstring)."""
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ValueError(f"blocks={blocks!r}: expected an int >= 1")
    return math.sqrt(2 * blocks)


def block_noise_std(sigma: float, bounds: Mapping[str, float]) -> dict[str, float]:
    """Standard deviation of the (total) noise on each block: ``sigma * sqrt(2 k) * C_j``."""
    delta = sensitivity(len(bounds))
    return {name: float(sigma) * delta * float(c) for name, c in bounds.items()}


def check_public_tokens(tokens: int, windows: int, seqlen: int) -> None:
    """Refuse a token count that is not the public ``windows * seqlen`` (it would leak)."""
    if tokens != windows * seqlen:
        raise ValueError(f"a DP statistics release counts {tokens} tokens: expected the public "
                         f"{windows} windows x {seqlen} tokens = {windows * seqlen} (a count "
                         "that depends on the data would leak it)")


# -- accounting ------------------------------------------------------------------------------


def gaussian_sigma(epsilon: float, delta: float, releases: int) -> float:
    """The noise multiplier of ``releases`` Gaussian releases (sample rate 1) that spend at most
    ``(epsilon, delta)`` under opacus' RDP accountant (:func:`accounting.noise_multiplier
    <fedcompress.privacy.accounting.noise_multiplier>`); :class:`BudgetError` if none does."""
    return noise_multiplier(epsilon, delta, 1.0, releases, "rdp")


def gaussian_epsilon(sigma: float, releases: int, delta: float) -> float:
    """Epsilon of ``releases`` Gaussian releases of noise multiplier ``sigma`` (opacus' RDP)."""
    return epsilon_spent(sigma, 1.0, releases, delta, "rdp")


def _lane_sensitivity(bound: float, dim: int, frac_bits: int) -> tuple[float, float]:
    l2 = math.sqrt(2.0) * bound * 2.0 ** frac_bits + math.sqrt(dim)  # rounding: < 1 per lane
    return l2, math.sqrt(dim) * l2


def skellam_rdp(sigma: float, blocks: Mapping[str, tuple[int, float]], frac_bits: int,
                orders: Sequence[int] = SKELLAM_ORDERS) -> np.ndarray:
    """RDP at ``orders`` of ONE layer's release with (total) Skellam noise: block ``j``
    (``blocks[j] = (d_j coordinates, C_j)``) gets per-coordinate variance
    ``V_j = (sigma sqrt(2k) C_j 2^f)^2`` in lanes. Agarwal et al. 2021 (module docstring), per
    block, summed over the blocks."""
    stds = block_noise_std(sigma, {k: c for k, (_, c) in blocks.items()})
    out = np.zeros(len(orders))
    for name, (dim, bound) in blocks.items():
        var = (stds[name] * 2.0 ** frac_bits) ** 2
        l2, l1 = _lane_sensitivity(bound, dim, frac_bits)
        for i, a in enumerate(orders):
            out[i] += (a * l2 ** 2 / (2 * var)
                       + min(((2 * a - 1) * l2 ** 2 + 6 * l1) / (4 * var ** 2),
                             3 * l1 / (2 * var)))
    return out


def _rdp_epsilon(rdp: np.ndarray, delta: float, orders: Sequence[int]) -> float:
    from opacus.accountants.analysis.rdp import get_privacy_spent

    eps, _ = get_privacy_spent(orders=list(orders), rdp=rdp, delta=float(delta))
    return float(eps)


def skellam_epsilon(sigma: float, layers: Sequence[Mapping[str, tuple[int, float]]],
                    frac_bits: int, delta: float, releases: int | None = None) -> float:
    """Epsilon of the first ``releases`` (default: all) layers' Skellam releases (``layers``:
    each layer's blocks, :func:`skellam_rdp`), composed by RDP, converted by opacus."""
    chosen = layers[:releases] if releases is not None else layers
    if not chosen:
        return 0.0
    rdp = sum((skellam_rdp(sigma, b, frac_bits) for b in chosen), np.zeros(len(SKELLAM_ORDERS)))
    return _rdp_epsilon(rdp, delta, SKELLAM_ORDERS)


def skellam_sigma(epsilon: float, delta: float,
                  layers: Sequence[Mapping[str, tuple[int, float]]], frac_bits: int,
                  tolerance: float = 0.01) -> float:
    """The smallest noise multiplier (to ``tolerance`` in epsilon) whose Skellam releases of
    ``layers`` spend at most ``(epsilon, delta)``; :class:`BudgetError` if none up to 2000."""
    check_budget(epsilon, delta)
    if not layers:
        raise BudgetError("no release to account for: expected at least one layer")
    hi = max(gaussian_sigma(epsilon, delta, len(layers)), 1e-3)
    while skellam_epsilon(hi, layers, frac_bits, delta) > epsilon:
        hi *= 2
        if hi > 2000:
            raise BudgetError(f"no Skellam noise reaches epsilon={epsilon} at delta={delta} "
                              f"for {len(layers)} releases: expected a larger epsilon or delta, "
                              "or fewer releases")
    lo = hi / 2 if skellam_epsilon(hi / 2, layers, frac_bits, delta) > epsilon else 0.0
    while True:
        mid = (lo + hi) / 2
        eps = skellam_epsilon(mid, layers, frac_bits, delta)
        if eps > epsilon:
            lo = mid
        else:
            hi = mid
            if epsilon - eps < tolerance:
                return hi
        if hi - lo < 1e-9 * hi:
            return hi


# -- the plan of a run -------------------------------------------------------------------------


@dataclass(frozen=True)
class DpStatsPlan:
    """A site's DP statistics mechanism for one run, fixed before its first release.

    Attributes:
        epsilon: Target epsilon of the whole run (``releases`` layers).
        delta: Target delta.
        placement: ``"central"`` or ``"distributed"``.
        releases: Number of layer releases the noise was computed for (``L``).
        sigma: Noise multiplier (block ``j``'s total noise std is ``sigma sqrt(2k) C_j``).
        bounds: Per layer, the clip bound of each block (``{owner linear: C_j}``).
        mechanism: ``"gaussian"`` (central) or ``"skellam"`` (distributed).
        frac_bits: Fractional bits of the fixed-point lanes (distributed only, else -1).
        threshold: SecAgg+ threshold ``t`` whose honest sites' shares reach the target
            (distributed only, else 0).
        dims: Per layer, each block's number of noised coordinates (for the Skellam account).
        unit: The privacy unit (:data:`UNIT`).
        clip: How the bounds were set (``"public-q0.95"`` or ``"fixed"``).
        normalize: How input coordinates are scaled before clipping (:data:`NORMALIZATIONS`).
        scales: With ``normalize="public"``, per layer, each block's public per-coordinate
            mean squares ``c`` (:func:`public_scales`); the bounds and the noise are in the
            normalized units, :func:`denormalize` maps the sum back.
    """

    epsilon: float
    delta: float
    placement: str
    releases: int
    sigma: float
    bounds: tuple[dict[str, float], ...]
    mechanism: str
    frac_bits: int = -1
    threshold: int = 0
    dims: tuple[dict[str, int], ...] = field(default_factory=tuple)
    unit: str = UNIT
    clip: str = ""
    normalize: str = "none"
    scales: tuple[dict[str, torch.Tensor], ...] = field(default_factory=tuple, compare=False,
                                                        repr=False)

    def layer_scales(self, layer: int) -> dict[str, torch.Tensor] | None:
        """Layer ``layer``'s public scales (None without normalization)."""
        return self.scales[layer] if self.normalize == "public" else None

    def noise_std(self, layer: int) -> dict[str, float]:
        """Total noise std of each block of layer ``layer`` (value units)."""
        return block_noise_std(self.sigma, self.bounds[layer])

    def blocks(self, layer: int) -> dict[str, tuple[int, float]]:
        return {k: (self.dims[layer][k], c) for k, c in self.bounds[layer].items()}

    def epsilon_after(self, releases: int) -> float:
        """The accountant's epsilon after the first ``releases`` releases of the run."""
        if releases == 0:
            return 0.0
        if not 0 < releases <= self.releases:
            raise BudgetError(f"{releases} releases: this run planned {self.releases}")
        if self.mechanism == "gaussian":
            return gaussian_epsilon(self.sigma, releases, self.delta)
        return skellam_epsilon(self.sigma, [self.blocks(i) for i in range(self.releases)],
                               self.frac_bits, self.delta, releases)

    def ledger_mechanism(self) -> dict[str, Any]:
        """What the site's ledger fixes at the run's first release (compared at every later
        one): everything but the per-layer tables, which a digest stands for."""
        return {"epsilon": self.epsilon, "delta": self.delta, "placement": self.placement,
                "releases": self.releases, "sigma": self.sigma, "mechanism": self.mechanism,
                "frac_bits": self.frac_bits, "threshold": self.threshold, "unit": self.unit,
                "clip": self.clip, "bounds_digest": _digest(self.bounds),
                "normalize": self.normalize,
                **({"scales_digest": _scales_digest(self.scales)}
                   if self.normalize == "public" else {})}

    def to_dict(self) -> dict[str, Any]:
        out = self.ledger_mechanism()
        out["bounds"] = [dict(b) for b in self.bounds]
        return out


def _digest(bounds: Sequence[Mapping[str, float]]) -> str:
    import hashlib
    import json

    text = json.dumps([{k: float(v).hex() for k, v in sorted(b.items())} for b in bounds])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _scales_digest(scales: Sequence[Mapping[str, torch.Tensor]]) -> str:
    import hashlib

    h = hashlib.sha256()
    for layer in scales:
        for k in sorted(layer):
            h.update(k.encode())
            h.update(layer[k].detach().to(torch.float64).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def check_scales(scales: Sequence[Mapping[str, torch.Tensor]],
                 bounds: Sequence[Mapping[str, float]]) -> tuple[dict[str, torch.Tensor], ...]:
    """Public scales as a plan holds them (float64, 1-D, finite and > 0, one per block of
    every layer of ``bounds``); ValueError naming the first that is not."""
    if len(scales) != len(bounds):
        raise ValueError(f"public scales of {len(scales)} layers: expected {len(bounds)} (one "
                         "per layer release)")
    out = []
    for i, (layer, b) in enumerate(zip(scales, bounds)):
        if set(layer) != set(b):
            raise ValueError(f"layer {i}: public scales of blocks {sorted(layer)}: expected "
                             f"the clipped blocks {sorted(b)}")
        checked = {}
        for k, c in layer.items():
            c = torch.as_tensor(c).detach().to(torch.float64)
            if c.dim() != 1 or not bool(torch.isfinite(c).all()) or not bool((c > 0).all()):
                raise ValueError(f"layer {i} block {k}: public scales must be a vector of "
                                 "finite numbers > 0")
            checked[k] = c
        out.append(checked)
    return tuple(out)


def plan_dp_stats(epsilon: float, delta: float, placement: str,
                  bounds: Sequence[Mapping[str, float]],
                  dims: Sequence[Mapping[str, int]] | None = None, frac_bits: int = -1,
                  threshold: int = 0, clip: str = "", normalize: str = "none",
                  scales: Sequence[Mapping[str, torch.Tensor]] | None = None) -> DpStatsPlan:
    """The run's mechanism: ``sigma`` for ``len(bounds)`` layer releases at ``(epsilon,
    delta)``: Gaussian (``central``, opacus' RDP accountant) or Skellam (``distributed``: needs
    ``dims``, ``frac_bits`` >= 0 and the SecAgg+ threshold ``t >= 1``); with ``normalize=
    "public"``, the ``scales`` of :func:`public_scales` (the bounds then in normalized units).
    :class:`BudgetError` for a budget that cannot be met, ValueError for anything else
    invalid."""
    check_budget(epsilon, delta)
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize={normalize!r}: expected one of {NORMALIZATIONS}")
    if (normalize == "public") != (scales is not None):
        raise ValueError(f"normalize={normalize!r} with{'' if scales is not None else 'out'} "
                         "scales: expected public scales exactly when normalize is 'public'")
    frozen_scales = check_scales(scales, bounds) if scales is not None else ()
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r}: expected one of {PLACEMENTS}")
    if not bounds:
        raise ValueError("no layer to release: expected the clip bounds of at least one layer")
    for i, layer in enumerate(bounds):
        if not layer:
            raise ValueError(f"layer {i}: no block to clip")
        for name, c in layer.items():
            if not (isinstance(c, (int, float)) and math.isfinite(c) and c > 0):
                raise ValueError(f"layer {i} block {name}: clip bound {c!r}: expected a finite "
                                 "number > 0")
    frozen = tuple({k: float(v) for k, v in b.items()} for b in bounds)
    if placement == "central":
        sigma = gaussian_sigma(epsilon, delta, len(bounds))
        return DpStatsPlan(float(epsilon), float(delta), placement, len(bounds), sigma, frozen,
                           "gaussian", clip=clip, normalize=normalize, scales=frozen_scales)
    if dims is None or len(dims) != len(bounds) or any(set(d) != set(b)
                                                       for d, b in zip(dims, bounds)):
        raise ValueError("distributed placement: expected the noised coordinates of every "
                         "block of every layer (dims, as the bounds)")
    if isinstance(frac_bits, bool) or not isinstance(frac_bits, int) or not 0 <= frac_bits <= 52:
        raise ValueError(f"frac_bits={frac_bits!r}: expected 0..52 for the distributed "
                         "placement (fixed-point lanes)")
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ValueError(f"threshold={threshold!r}: expected the SecAgg+ threshold, an int >= 1")
    fdims = tuple({k: int(v) for k, v in d.items()} for d in dims)
    layers = [{k: (fdims[i][k], c) for k, c in b.items()} for i, b in enumerate(frozen)]
    sigma = skellam_sigma(epsilon, delta, layers, frac_bits)
    return DpStatsPlan(float(epsilon), float(delta), placement, len(bounds), sigma, frozen,
                       "skellam", frac_bits, threshold, fdims, clip=clip, normalize=normalize,
                       scales=frozen_scales)


def dp_frac_bits(plan_sigma: float, bounds: Sequence[Mapping[str, float]], n_windows: int,
                 n_sites: int, lane_std_bits: int = 12) -> int:
    """Fractional bits for the distributed placement: the smallest block noise std is about
    ``2^lane_std_bits`` lanes (rounding negligible against it), within 0..52 and so that
    ``n_sites`` sites' sums of ``n_windows`` clipped windows plus noise stay well inside int64
    (public quantities only)."""
    smallest = min(min(block_noise_std(plan_sigma, b).values()) for b in bounds)
    largest = max(max(b.values()) for b in bounds)
    bits = int(math.floor(lane_std_bits - math.log2(smallest)))
    # values: n_windows * C per site, noise about 10 std; keep n_sites * (that) < 2^62
    biggest_std = max(max(block_noise_std(plan_sigma, b).values()) for b in bounds)
    room = 62 - math.log2(n_sites * (n_windows * largest + 10 * biggest_std))
    return max(0, min(52, bits, int(math.floor(room))))


# -- per-window statistics and clipping ------------------------------------------------------


def layer_blocks(layer: nn.Module, inputs: Any) -> dict[str, str]:
    """``{linear name: owner}``: the owner (first in sorted order) of the distinct input tensor
    each linear layer of ``layer`` reads (what one batch of ``inputs`` shows)."""
    from fedcompress.models import ModelAdapter
    from fedcompress.pruning.walker import _call_layer, input_owners

    linears = ModelAdapter.linear_layers(layer)
    seen: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_pre_hook(
        lambda _m, args, name=name: seen.setdefault(name, args[0]))
        for name, m in linears.items()]
    try:
        with torch.no_grad():
            _call_layer(layer, inputs.hidden[:1], inputs.layer_kwargs[inputs.layer])
    finally:
        for handle in handles:
            handle.remove()
    missing = sorted(set(linears) - set(seen))
    if missing:
        raise RuntimeError(f"linear layers {missing} saw no input")
    return input_owners(seen)


@torch.no_grad()
def window_inputs(layer: nn.Module, inputs: Any, batch_size: int = 8,
                  scales: Mapping[str, torch.Tensor] | None = None
                  ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Per batch of windows: ``(first window index, {owner: X [b, t, d]})``, the float64
    inputs of every distinct input of ``layer`` (one per owner, :func:`layer_blocks`); with
    ``scales`` (``{owner: c}``, :func:`public_scales`), the normalized inputs
    ``x_j / sqrt(c_j)``. The windows' statistics (:func:`window_sums`, :func:`window_norms`)
    are computed from these."""
    from fedcompress.models import ModelAdapter
    from fedcompress.pruning.walker import _batches, _call_layer

    owners = layer_blocks(layer, inputs)
    linears = ModelAdapter.linear_layers(layer)
    kwargs = inputs.layer_kwargs[inputs.layer]
    xs: dict[str, torch.Tensor] = {}
    inv = None
    if scales is not None:
        missing = sorted(set(owners.values()) - set(scales))
        if missing:
            raise ValueError(f"no public scales for blocks {missing}: expected one per "
                             "distinct input")
        inv = {k: torch.as_tensor(c, dtype=torch.float64).rsqrt() for k, c in scales.items()}

    def hook(_m, args, name):
        if owners[name] != name:
            return
        x = args[0].to(torch.float64)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        if inv is not None:
            if inv[name].shape[0] != x.shape[-1]:
                raise ValueError(f"public scales of {name}: {inv[name].shape[0]} coordinates, "
                                 f"its input has {x.shape[-1]}")
            x = x * inv[name].to(x.device)
        xs[name] = x

    for rows in _batches(len(inputs.hidden), batch_size):
        xs.clear()
        handles = [m.register_forward_pre_hook(lambda _m, a, name=name: hook(_m, a, name))
                   for name, m in linears.items()]
        try:
            _call_layer(layer, inputs.hidden[rows], kwargs)
        finally:
            for handle in handles:
                handle.remove()
        yield rows.start, dict(xs)


def window_sums(layer: nn.Module, inputs: Any, hessian: bool, batch_size: int = 8,
                scales: Mapping[str, torch.Tensor] | None = None
                ) -> Iterator[tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """Per batch of windows: ``(first window index, {owner: square sums [b, d]},
    {owner: 2 X_w^T X_w [b, d, d]})`` (float64; the Hessians only with ``hessian``), each
    window's own statistics of every distinct input of ``layer``; with ``scales`` (``{owner:
    c}``, :func:`public_scales`), of the normalized inputs ``x_j / sqrt(c_j)``. Each window's
    Hessian is materialized: a site's release does not need them (:func:`clipped_layer_stats`
    clips from :func:`window_norms`), an attacker scoring single windows does."""
    for start, xs in window_inputs(layer, inputs, batch_size, scales):
        sq = {k: x.pow(2).sum(1) for k, x in xs.items()}
        hs = ({k: torch.einsum("bti,btj->bij", x, x).mul_(2.0) for k, x in xs.items()}
              if hessian else {})
        yield start, sq, hs


def window_norms(xs: Mapping[str, torch.Tensor], hessian: bool,
                 sq: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Each window's norm per block, what its contribution is clipped by: the L2 norm of its
    square sums ``sq`` (``[b, d]``, computed from ``xs`` if not given), or with ``hessian`` the
    Frobenius norm of ``H_w = 2 X_w^T X_w`` without forming it when the window has fewer
    tokens ``t`` than inputs ``d``: ``||X^T X||_F^2 = tr((X^T X)^2) = tr((X X^T)^2)``, so
    ``2 ||X_w X_w^T||_F`` from the ``t x t`` Gram matrix (``t^2 d`` instead of ``t d^2``
    multiplications; the same number up to float64 rounding)."""
    if not hessian:
        if sq is None:
            sq = {k: x.pow(2).sum(1) for k, x in xs.items()}
        return {k: torch.linalg.vector_norm(v, dim=1) for k, v in sq.items()}
    out = {}
    for k, x in xs.items():
        gram = (torch.einsum("bti,bsi->bts", x, x) if x.shape[1] < x.shape[2]
                else torch.einsum("bti,btj->bij", x, x))
        out[k] = torch.linalg.matrix_norm(gram, "fro").mul_(2.0)
    return out


def _block_norms(sq: Mapping[str, torch.Tensor], hs: Mapping[str, torch.Tensor],
                 hessian: bool) -> dict[str, torch.Tensor]:
    """Each window's norm per block from :func:`window_sums`' materialized statistics."""
    if hessian:
        return {k: torch.linalg.matrix_norm(h, "fro") for k, h in hs.items()}
    return {k: torch.linalg.vector_norm(v, dim=1) for k, v in sq.items()}


def clip_factors(norms: Mapping[str, torch.Tensor], bounds: Mapping[str, float]
                 ) -> dict[str, torch.Tensor]:
    """Per block, each window's scale ``min(1, C_j / norm)`` (1 for a zero norm)."""
    missing = sorted(set(norms) - set(bounds))
    if missing:
        raise ValueError(f"no clip bound for blocks {missing}: expected one per distinct input")
    return {k: torch.clamp(float(bounds[k]) / torch.clamp(n, min=1e-300), max=1.0)
            for k, n in norms.items()}


@dataclass
class ClippedStats:
    """A site's clipped sums of one layer: ``stats`` (``{linear: LayerStats}``, sharers hold the
    same object), ``owners`` (``{linear: owner}``) and how many windows each block clipped."""

    stats: dict[str, Any]
    owners: dict[str, str]
    clipped: dict[str, int]


@torch.no_grad()
def clipped_layer_stats(layer: nn.Module, inputs: Any, hessian: bool,
                        bounds: Mapping[str, float], batch_size: int = 8,
                        scales: Mapping[str, torch.Tensor] | None = None) -> ClippedStats:
    """The sum over windows of each window's statistics, each window's block ``j`` clipped to
    ``bounds[j]`` (L2 of its square sums; Frobenius of its Hessian with ``hessian``) before
    summing. With ``hessian`` the square sums are ``diag(H) / 2`` of the clipped Hessian. With
    ``scales``: of the normalized inputs (:func:`window_sums`; :func:`denormalize` maps the
    sum back)."""
    from fedcompress.pruning.walker import LayerStats

    owners = layer_blocks(layer, inputs)
    blocks = sorted(set(owners.values()))
    extra = sorted(set(bounds) - set(blocks))
    if extra:
        raise ValueError(f"clip bounds for unknown blocks {extra}: the layer's blocks are "
                         f"{blocks}")
    sums: dict[str, LayerStats] = {}
    clipped = {k: 0 for k in blocks}
    for _start, xs in window_inputs(layer, inputs, batch_size, scales):
        # with a Hessian the square sums are its diagonal: no separate square sums
        sq = None if hessian else {k: x.pow(2).sum(1) for k, x in xs.items()}
        factors = clip_factors(window_norms(xs, hessian, sq), bounds)
        for k in blocks:
            f = factors[k]
            clipped[k] += int((f < 1).sum())
            tokens = int(inputs.hidden.shape[1]) * int(f.shape[0])
            if k not in sums:
                sums[k] = LayerStats(xs[k].shape[-1], hessian=hessian)
            if sq is None:
                # sum_w f_w 2 X_w^T X_w as one product over the batch's tokens (no per-window
                # d x d matrices): each window's rows of one factor scaled by its f_w
                x = xs[k]
                h = torch.einsum("bti,btj->ij", x * f[:, None, None], x).mul_(2.0)
                sums[k].add_sums(tokens, torch.diagonal(h).clone() / 2, h)
            else:
                sums[k].add_sums(tokens, torch.einsum("b,bj->j", f, sq[k]), None)
    return ClippedStats({name: sums[owner] for name, owner in owners.items()}, owners, clipped)


def is_digest(spec: str) -> bool:
    """Whether ``spec`` names a pinned public file (``sha256:`` and 64 lowercase hex digits)."""
    return bool(_DIGEST.fullmatch(str(spec)))


def check_public_text(spec: str) -> str:
    """``spec`` if it is one of :data:`PUBLIC_CORPORA` or a pinned file's digest
    (:data:`DIGEST_PREFIX`), else a ValueError naming it."""
    if spec not in PUBLIC_CORPORA and not is_digest(spec):
        hint = (" (the digest is 64 lowercase hex digits: sha256sum FILE)"
                if str(spec).startswith(DIGEST_PREFIX) else "")
        raise ValueError(f"public text {spec!r}: expected a bundled corpus, one of "
                         f"{PUBLIC_CORPORA} (its {PUBLIC_SPLIT!r} split, shipped with the "
                         "package: the same at every party, and no site's data), or "
                         f"'{DIGEST_PREFIX}<hex digest>' of a public file every party holds"
                         f"{hint}")
    return spec


#: ``{(resolved path, size, mtime_ns): digest}`` of the files hashed in this process.
_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(path: str | os.PathLike) -> str:
    """``sha256:<hex>`` of the file at ``path`` (cached per path, size and modification time);
    an OSError names the path."""
    resolved = Path(path).expanduser().resolve()
    stat = resolved.stat()
    key = (str(resolved), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(resolved, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _DIGESTS[key] = DIGEST_PREFIX + h.hexdigest()
    return _DIGESTS[key]


def public_text_source(spec: str, files: Sequence[str] = ()) -> str:
    """What :func:`~fedcompress.data.corpora.load_corpus` loads for the public text ``spec``:
    the bundled corpus itself, or, for a digest, the one of ``files`` whose SHA-256 it is.

    Raises:
        ValueError: ``spec`` is neither (:func:`check_public_text`); no file of ``files`` has
            the digest (each file's digest, or why it cannot be read, is named).
    """
    check_public_text(spec)
    if not is_digest(spec):
        return spec
    seen = []
    for path in files:
        if not path:
            continue
        try:
            digest = file_digest(path)
        except OSError as err:
            seen.append(f"{path}: unreadable ({err.strerror or err})")
            continue
        if digest == spec:
            return str(path)
        seen.append(f"{path}: {digest}")
    raise ValueError(f"public text {spec}: no file here has that SHA-256 digest "
                     f"({'; '.join(seen) or 'no public file given'}): expected a copy of the "
                     "published file, byte for byte")


def public_windows(tokenizer: Any, seqlen: int, n: int = PUBLIC_WINDOWS, seed: int = 0,
                   corpus: str = PUBLIC_CORPUS, files: Sequence[str] = ()) -> torch.Tensor:
    """``n`` windows of ``seqlen`` tokens of PUBLIC text: the bundled ``corpus``'s
    :data:`PUBLIC_SPLIT` split (one of :data:`PUBLIC_CORPORA`, shipped with the package, the
    same at every party), or the pinned file of ``files`` whose digest ``corpus`` is (the whole
    file; :func:`public_text_source`); ``seed`` is public: nothing private depends on it."""
    from fedcompress.data.calibration import calibration_windows
    from fedcompress.data.corpora import load_corpus

    return calibration_windows(tokenizer,
                               load_corpus(public_text_source(corpus, files), PUBLIC_SPLIT),
                               n, seqlen, seed)


@dataclass(frozen=True)
class PublicCalibration:
    """What public text fixes of a DP statistics mechanism, per decoder layer: each block's
    clip bound (in normalized units when ``scales`` is set) and, with normalization, each
    block's public per-coordinate mean squares (:func:`public_scales`)."""

    bounds: list[dict[str, float]]
    scales: list[dict[str, torch.Tensor]] | None = None

    @property
    def normalize(self) -> str:
        return "public" if self.scales is not None else "none"


def _layer_scales(sq_parts: Mapping[str, list[torch.Tensor]], tokens: int, layer: int
                  ) -> dict[str, torch.Tensor]:
    out = {}
    for k, parts in sq_parts.items():
        c = torch.cat(parts).sum(0) / tokens
        top = float(c.max()) if c.numel() else 0.0
        if not (math.isfinite(top) and top > 0):
            raise ValueError(f"layer {layer} block {k}: public windows give no signal (largest "
                             f"mean square {top}): expected > 0 (more or longer public windows)")
        out[k] = torch.clamp(c, min=SCALE_FLOOR * top)
    return out


@torch.no_grad()
def public_calibration(model: nn.Module, windows: torch.Tensor, hessian: bool,
                       quantile: float = CLIP_QUANTILE, batch_size: int = 8,
                       normalize: str = "public") -> PublicCalibration:
    """The public part of the mechanism, from PUBLIC windows (e.g. the bundled
    :data:`PUBLIC_CORPUS`) through the DENSE model, per decoder layer and block: with
    ``normalize="public"``, the per-coordinate mean square over the windows' tokens (each
    floored at :data:`SCALE_FLOOR` of the block's largest), then the clip bound, the
    ``quantile`` of the per-window norms (as :func:`clipped_layer_stats` measures them, of the
    normalized inputs when normalizing). Public data only: no privacy cost, and every party
    computes the same values."""
    from fedcompress.models import ModelAdapter
    from fedcompress.pruning.walker import capture_layer_inputs, forward_layer

    if not 0 < quantile <= 1:
        raise ValueError(f"quantile={quantile!r}: expected a number in (0, 1]")
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize={normalize!r}: expected one of {NORMALIZATIONS}")
    adapter = ModelAdapter(model)
    inputs = capture_layer_inputs(model, windows, batch_size)
    tokens = int(windows.shape[0]) * int(windows.shape[1])
    out: list[dict[str, float]] = []
    scales: list[dict[str, torch.Tensor]] = []
    for i in range(len(adapter)):
        with adapter.onloaded(i) as layer:
            layer_scales = None
            if normalize == "public":
                sq_parts: dict[str, list[torch.Tensor]] = {}
                for _s, sq, _hs in window_sums(layer, inputs, False, batch_size):
                    for k, v in sq.items():
                        sq_parts.setdefault(k, []).append(v)
                layer_scales = _layer_scales(sq_parts, tokens, i)
                scales.append(layer_scales)
            norms: dict[str, list[torch.Tensor]] = {}
            for _s, xs in window_inputs(layer, inputs, batch_size, layer_scales):
                for k, n in window_norms(xs, hessian).items():
                    norms.setdefault(k, []).append(n)
            bounds = {}
            for k, parts in norms.items():
                value = float(torch.quantile(torch.cat(parts), quantile))
                if not value > 0:
                    raise ValueError(f"layer {i} block {k}: public windows give a clip bound of "
                                     f"{value}: expected > 0 (more or longer public windows)")
                bounds[k] = value
            out.append(bounds)
            if i + 1 < len(adapter):
                inputs = forward_layer(layer, inputs, batch_size)
    return PublicCalibration(out, scales if normalize == "public" else None)


def public_clip_bounds(model: nn.Module, windows: torch.Tensor, hessian: bool,
                       quantile: float = CLIP_QUANTILE, batch_size: int = 8
                       ) -> list[dict[str, float]]:
    """Default clip bounds of un-normalized statistics from PUBLIC windows:
    :func:`public_calibration` with ``normalize="none"``."""
    return public_calibration(model, windows, hessian, quantile, batch_size, "none").bounds


def public_scales(model: nn.Module, windows: torch.Tensor, batch_size: int = 8
                  ) -> list[dict[str, torch.Tensor]]:
    """Per decoder layer and block, each input coordinate's public per-token mean square
    (:func:`public_calibration`'s normalization)."""
    calib = public_calibration(model, windows, False, 1.0, batch_size, "public")
    assert calib.scales is not None
    return calib.scales


# -- noise -----------------------------------------------------------------------------------


def _sym_noise(n: int, std: float, rng: np.random.Generator) -> torch.Tensor:
    rows, cols = torch.triu_indices(n, n)
    noise = torch.zeros(n, n, dtype=torch.float64)
    values = torch.from_numpy(rng.normal(0.0, std, size=rows.shape[0]))
    noise[rows, cols] = values
    noise[cols, rows] = values
    return noise


def _distinct(stats: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(owner name, statistics)`` once per distinct object of ``stats`` (sharers hold their
    owner's object; the first name in sorted order is the owner)."""
    done: set[int] = set()
    for name in sorted(stats):
        st = stats[name]
        if id(st) not in done:
            done.add(id(st))
            yield name, st


def add_gaussian(stats: Mapping[str, Any], std: Mapping[str, float], hessian: bool,
                 rng: np.random.Generator) -> None:
    """Central placement: add ``N(0, std[j]^2)`` to every coordinate of each block (the
    square sums; with ``hessian`` the Hessian's upper triangle, mirrored, and the square sums
    set to ``diag / 2``), in place, once per distinct statistics object."""
    for name, st in _distinct(stats):
        if name not in std:
            raise ValueError(f"no noise scale for {name}: expected one per block")
        owner = name
        if hessian:
            st.hessian_sum += _sym_noise(st.in_features, std[owner], rng).to(st.hessian_sum)
            st.sq_sum = torch.diagonal(st.hessian_sum).double().clone() / 2
        else:
            st.sq_sum += torch.from_numpy(rng.normal(0.0, std[owner], size=st.in_features))


def skellam_noise(shape: int | tuple[int, ...], variance: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Symmetric Skellam integers ``Poisson(variance / 2) - Poisson(variance / 2)`` (int64),
    drawn as a sum of Skellams where the mean exceeds numpy's sampler (closed under sums)."""
    if not (math.isfinite(variance) and variance > 0):
        raise ValueError(f"Skellam variance {variance!r}: expected a finite number > 0")
    mu = variance / 2
    parts = max(1, math.ceil(mu / _MAX_POISSON))
    if parts > _MAX_PARTS:
        raise ValueError(f"Skellam variance {variance:.3g} is too large for 64-bit lanes: "
                         "expected fewer fractional bits")
    out = np.zeros(shape, np.int64)
    for _ in range(parts):
        out += rng.poisson(mu / parts, size=shape).astype(np.int64)
        out -= rng.poisson(mu / parts, size=shape).astype(np.int64)
    return out


# -- post-processing -------------------------------------------------------------------------


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
