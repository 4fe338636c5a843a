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
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedcompress.privacy.accounting import (
    RDP_ALPHAS,
    BudgetError,
    check_budget,
    epsilon_spent,
    noise_multiplier,
)
from fedcompress.privacy.dp_calibration import (  # noqa: F401 (this module's public names)
    _DIGEST,
    CLIP_QUANTILE,
    DIGEST_PREFIX,
    NORMALIZATIONS,
    PUBLIC_CORPORA,
    PUBLIC_CORPUS,
    PUBLIC_SPLIT,
    PUBLIC_WINDOWS,
    SCALE_FLOOR,
    ClippedStats,
    PublicCalibration,
    _block_norms,
    _layer_scales,
    check_public_text,
    clip_factors,
    clipped_layer_stats,
    file_digest,
    is_digest,
    layer_blocks,
    public_calibration,
    public_clip_bounds,
    public_scales,
    public_text_source,
    public_windows,
    window_inputs,
    window_norms,
    window_sums,
)
from fedcompress.privacy.dp_postprocess import (  # noqa: F401 (this module's public names)
    FALSE_SIGNAL_RATE,
    SPREAD_Z,
    _distinct,
    denormalize,
    make_positive_definite,
    normalized_prior,
    postprocess,
    shrink,
    spread_z,
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
#: What the server does with a normalized noisy release before it prunes: shrink it toward the
#: public scales' flat shape (``shrink``, :func:`shrink`), toward public text's own statistics
#: of the layer through the server's model (``public``, :func:`normalized_prior`), or take it
#: as it is (``none``).
PRIORS = ("shrink", "public", "none")
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
    import json

    text = json.dumps([{k: float(v).hex() for k, v in sorted(b.items())} for b in bounds])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _scales_digest(scales: Sequence[Mapping[str, torch.Tensor]]) -> str:

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


# -- noise -----------------------------------------------------------------------------------


def _sym_noise(n: int, std: float, rng: np.random.Generator) -> torch.Tensor:
    rows, cols = torch.triu_indices(n, n)
    noise = torch.zeros(n, n, dtype=torch.float64)
    values = torch.from_numpy(rng.normal(0.0, std, size=rows.shape[0]))
    noise[rows, cols] = values
    noise[cols, rows] = values
    return noise


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
