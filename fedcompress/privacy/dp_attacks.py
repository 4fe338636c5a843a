"""Membership attacks on a DP statistics release, and the ceilings DP puts on them (no model).

The leakage study (:mod:`fedcompress.privacy.leakage`) shows that a site's shared mask tells
which window it calibrated on. Under DP statistics mode (:mod:`fedcompress.privacy.dp_stats`)
the server sees, per decoder layer, the noisy SUM of every site's clipped per-window
statistics (Wanda: each block's square sums; SparseGPT: the upper triangle of each block's
Hessian sum), and the global mask pruned from it. This module scores candidate windows against
those two views with the leakage study's two attackers, and gives what DP allows them.

Views and attackers (pure functions: the caller computes every window's clipped statistics
with the sites' own clipping, :func:`fedcompress.privacy.dp_stats.clip_factors` on each
window's :func:`~fedcompress.privacy.dp_stats.window_sums`, and sums the per-layer scores, as
:mod:`fedcompress.bench.dp_leakage` does; a layer's statistics are ``{block: flat float64
tensor}``, a block being the owner linear of one distinct input, holding Wanda's square sums
or SparseGPT's Hessian upper triangle):

* **knows-the-rest on the sum** (:func:`knows_rest_sum_scores`, the DP neighbouring setting):
  the attacker knows every window of the release but the target, so the clipped sum ``r`` of
  the rest; for a candidate ``c`` it scores the Gaussian log-likelihood of the release ``y``
  under "rest + c", ``-sum_j ||y_j - r_j - c_j||^2 / (2 s_j^2)`` per block ``j`` of noise std
  ``s_j``, summed over the blocks and the layers (independent noise: log-likelihoods add). The
  difference of two candidates' scores is their log-likelihood ratio: the Neyman-Pearson test
  between them, the strongest there is for the central Gaussian placement.
* **knows-the-rest on the mask** (:func:`knows_rest_mask_scores`): ``-Hamming`` between the
  released mask and the noise-free mask of rest + c (the leakage study's
  :func:`~fedcompress.privacy.leakage.closeness_scores`).
* **reference attacker** (knows only public windows ``R``): on the mask, the leakage study's
  :func:`~fedcompress.privacy.leakage.approach_scores` with the noise-free masks of ``R`` and
  ``R + c``; on the sum (:func:`reference_sum_scores`), how much adding ``c`` to ``R`` moves
  ``R``'s per-window mean toward the release's per-window mean (noise-scaled squared
  distances, per block, summed).

Measures: the leakage study's :func:`~fedcompress.privacy.leakage.membership_auc` (AUC within
a group of candidates = the two-candidate forced choice on one release, pooled AUC, top-1,
chance) and :func:`neighbour_auc`, the ROC AUC of the test between two neighbouring datasets
(``t`` in, or ``o`` in its place) computed from ``T = score(t) - score(o)`` on releases that
hold ``t``: the windows are drawn at random, so ``t`` and ``o`` are exchangeable and the test
statistic on a release holding ``o`` is distributed as ``-T`` (exact in distribution over the
draw of the windows).

Ceilings (:func:`ceilings`):

* **GDP.** A layer's release in the central placement is a Gaussian mechanism of L2
  sensitivity ``Delta = sqrt(2k)`` (in units of the clip bounds) and noise std
  ``sigma * Delta`` (:func:`fedcompress.privacy.dp_stats.block_noise_std`): ``1/sigma``-GDP
  (Dong, Roth, Su, "Gaussian Differential Privacy", 2022); ``L`` layer releases compose
  (adaptively) to ``mu = sqrt(L) / sigma`` (:func:`gdp_mu`). This is the same composition
  opacus' RDP accountant sees (``L`` steps at sample rate 1, RDP ``alpha L / (2 sigma^2)``,
  which is exactly that of ``mu``-GDP), so ``sigma`` from
  :func:`~fedcompress.privacy.dp_stats.gaussian_sigma` makes the run ``mu``-GDP. Then no test
  between two neighbouring datasets has ROC AUC above ``Phi(mu / sqrt 2)``
  (:func:`gdp_auc_ceiling`) and no two-candidate forced choice is right more often than
  ``Phi(mu / 2)`` on average over exchangeable candidates (:func:`gdp_choice_ceiling`). The
  distributed placement is a Skellam mechanism accounted as such
  (:func:`~fedcompress.privacy.dp_stats.skellam_rdp`, with extra terms beyond the Gaussian's):
  it is NOT ``mu``-GDP by that argument, and :func:`ceilings` gives no GDP ceiling for it.
* **(epsilon, delta).** Any test has ``TPR <= e^eps FPR + delta`` and, by the symmetric
  neighbour, ``1 - FPR <= e^eps (1 - TPR) + delta`` (:func:`dp_roc_bound`); the area under
  that bound (:func:`dp_auc_ceiling`) and its forced-choice value ``(e^eps + delta) /
  (1 + e^eps)`` (:func:`dp_choice_ceiling`) hold for either placement.

What is NOT measured here: the top-1 rate has no ceiling beside it (only chance); the scores
assume the attacker knows the clip bounds and the noise scale (public: the plan's); the
post-processed release (floored square sums, the positive-definite Hessian) is not attacked,
only the noisy sum before it (post-processing cannot add to what it reveals).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedcompress.privacy import leakage as lk

__all__ = [
    "ceilings",
    "dp_auc_ceiling",
    "dp_choice_ceiling",
    "dp_roc_bound",
    "gdp_auc_ceiling",
    "gdp_choice_ceiling",
    "gdp_mu",
    "gaussian_loglik",
    "knows_rest_mask_scores",
    "knows_rest_sum_scores",
    "neighbour_auc",
    "reference_mask_scores",
    "reference_sum_scores",
    "summarize",
]

# One layer's statistics as the attacks read them: {block (owner linear): flat float64 vector}
# (Wanda: the square sums; SparseGPT: the Hessian's upper triangle).
_Blocks = Mapping[str, torch.Tensor]


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _check_blocks(what: str, blocks: _Blocks, like: _Blocks) -> None:
    if set(blocks) != set(like):
        raise ValueError(f"{what} has blocks {sorted(blocks)}: expected {sorted(like)}")
    for k, v in blocks.items():
        if v.shape != like[k].shape:
            raise ValueError(f"{what} block {k}: shape {tuple(v.shape)}, expected "
                             f"{tuple(like[k].shape)}")


def _check_std(std: Mapping[str, float], release: _Blocks) -> None:
    missing = sorted(set(release) - set(std))
    if missing:
        raise ValueError(f"no noise std for blocks {missing}: expected one per block")
    bad = {k: s for k, s in std.items() if not (math.isfinite(s) and s > 0)}
    if bad:
        raise ValueError(f"noise std {bad}: expected finite numbers > 0")


# -- scores ----------------------------------------------------------------------------------


def gaussian_loglik(release: _Blocks, mean: _Blocks, std: Mapping[str, float]) -> float:
    """``-sum_j ||release_j - mean_j||^2 / (2 std_j^2)``: the log-likelihood of ``release``
    under independent Gaussian noise of std ``std[j]`` on every coordinate of block ``j``
    around ``mean`` (constants dropped)."""
    _check_blocks("the mean", mean, release)
    _check_std(std, release)
    total = 0.0
    for k, y in release.items():
        diff = y.double() - mean[k].double()
        total -= float(diff.dot(diff)) / (2.0 * float(std[k]) ** 2)
    return total


def knows_rest_sum_scores(release: _Blocks, rest: _Blocks, candidates: Sequence[_Blocks],
                          std: Mapping[str, float]) -> list[float]:
    """One layer's knows-the-rest scores on the sum: for each candidate ``c`` (its clipped
    statistics, one window), the log-likelihood ratio of ``release`` around ``rest + c``
    against around ``rest`` alone (``rest``: the clipped sum of every other window of the
    release): with ``r = release - rest``, ``sum_j (2 <r_j, c_j> - ||c_j||^2) / (2 std_j^2)``.
    That is :func:`gaussian_loglik` of ``release`` around ``rest + c`` plus
    ``||r||^2 / (2 std^2)``, a term that does not depend on the candidate; left out, because
    next to the noise's ``||r||^2`` (of the order of ``d std^2``, a Hessian's million
    coordinates) the candidates' differences are below float64's resolution and every score
    would tie."""
    _check_blocks("the rest", rest, release)
    _check_std(std, release)
    residual = {k: release[k].double() - rest[k].double() for k in release}
    out = []
    for i, c in enumerate(candidates):
        _check_blocks(f"candidate {i}", c, release)
        total = 0.0
        for k, r in residual.items():
            x = c[k].double()
            total += float(2.0 * r.dot(x) - x.dot(x)) / (2.0 * float(std[k]) ** 2)
        out.append(total)
    return out


def knows_rest_mask_scores(released_mask: Any, candidate_masks: Sequence[Any]) -> list[float]:
    """Knows-the-rest scores on the mask: ``-Hamming(released mask, mask of rest + c)``
    (:func:`fedcompress.privacy.leakage.closeness_scores`)."""
    return lk.closeness_scores(released_mask, candidate_masks)


def reference_mask_scores(released_mask: Any, reference_mask: Any,
                          candidate_masks: Sequence[Any]) -> list[float]:
    """Reference scores on the mask: :func:`fedcompress.privacy.leakage.approach_scores`
    (``reference_mask``: the noise-free mask of ``R``; ``candidate_masks``: of ``R + c``)."""
    return lk.approach_scores(released_mask, reference_mask, candidate_masks)


def reference_sum_scores(release: _Blocks, release_windows: int, reference: _Blocks,
                         reference_windows: int, candidates: Sequence[_Blocks],
                         std: Mapping[str, float]) -> list[float]:
    """One layer's reference scores on the sum: ``D(R) - D(R + c)`` with ``D(S) = sum_j
    ||release_j / N - S_j / n_S||^2 / std_j^2`` (``N = release_windows``, the public number of
    windows summed in the release; ``n_S`` the windows of ``S``): how much adding ``c`` moves
    the reference's per-window mean toward the release's."""
    for name, n in (("release_windows", release_windows),
                    ("reference_windows", reference_windows)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}={n!r}: expected an int >= 1")
    _check_blocks("the reference", reference, release)
    _check_std(std, release)
    # D(R) - D(R + c) without the release's own ||t||^2 (huge next to the differences: it
    # cancels, and computed apart it would round every score to the same value): with the
    # means a = R / n, b = (R + c) / (n + 1) and u = b - a, the difference is
    # sum_j <u_j, 2 t_j - a_j - b_j> / std_j^2.
    target = {k: y.double() / release_windows for k, y in release.items()}
    before = {k: reference[k].double() / reference_windows for k in target}
    out = []
    for i, c in enumerate(candidates):
        _check_blocks(f"candidate {i}", c, release)
        total = 0.0
        for k, t in target.items():
            after = (reference[k].double() + c[k].double()) / (reference_windows + 1)
            u = after - before[k]
            total += float(u.dot(2.0 * t - before[k] - after)) / float(std[k]) ** 2
        out.append(total)
    return out


# -- measures --------------------------------------------------------------------------------


def neighbour_auc(differences: Sequence[float]) -> float:
    """ROC AUC of the test between neighbouring datasets from ``T = score(member) -
    score(non-member)`` on releases holding the member: ``P(T_a + T_b > 0)`` over pairs
    ``a != b`` (ties 1/2), i.e. :func:`~fedcompress.privacy.leakage.auc` of ``T`` against
    ``-T`` (the statistic on the neighbouring release, by exchangeability) without the pairs
    of a value with itself."""
    t = np.asarray(differences, dtype=np.float64)
    n = t.size
    if n < 2:
        raise ValueError(f"{n} differences: the neighbour AUC needs at least 2")
    if not np.isfinite(t).all():
        raise ValueError("the differences must be finite")
    total = lk.auc(t, -t) * n * n
    self_pairs = float((t > 0).sum() + 0.5 * (t == 0).sum())
    return float((total - self_pairs) / (n * (n - 1)))


def gdp_mu(sigma: float, releases: int) -> float:
    """``mu = sqrt(releases) / sigma``: ``releases`` Gaussian releases of noise multiplier
    ``sigma`` (each ``1/sigma``-GDP) composed."""
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma={sigma!r}: expected a finite number > 0")
    if isinstance(releases, bool) or not isinstance(releases, int) or releases < 1:
        raise ValueError(f"releases={releases!r}: expected an int >= 1")
    return math.sqrt(releases) / float(sigma)


def gdp_auc_ceiling(mu: float) -> float:
    """``Phi(mu / sqrt 2)``: the largest ROC AUC of any test between neighbouring datasets of a
    ``mu``-GDP mechanism (the AUC of ``N(0, 1)`` against ``N(mu, 1)``)."""
    if not (mu >= 0 and math.isfinite(mu)):
        raise ValueError(f"mu={mu!r}: expected a finite number >= 0")
    return _phi(mu / math.sqrt(2.0))


def gdp_choice_ceiling(mu: float) -> float:
    """``Phi(mu / 2)``: the largest mean success of a forced choice between two exchangeable
    candidates under ``mu``-GDP (``1 - (alpha + beta) / 2`` at the trade-off's symmetric
    point)."""
    if not (mu >= 0 and math.isfinite(mu)):
        raise ValueError(f"mu={mu!r}: expected a finite number >= 0")
    return _phi(mu / 2.0)


def _check_eps_delta(epsilon: float, delta: float) -> None:
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon={epsilon!r}: expected a finite number >= 0")
    if not 0 <= delta < 1:
        raise ValueError(f"delta={delta!r}: expected a number in [0, 1)")


def dp_roc_bound(epsilon: float, delta: float, fpr: float | np.ndarray) -> np.ndarray:
    """The largest TPR at ``fpr`` of any test between neighbouring datasets of an ``(epsilon,
    delta)``-DP mechanism: ``min(1, e^eps FPR + delta, 1 - e^-eps (1 - delta - FPR))``."""
    _check_eps_delta(epsilon, delta)
    x = np.asarray(fpr, dtype=np.float64)
    e = math.exp(min(epsilon, 700.0))  # beyond: 1 to float precision
    return np.minimum.reduce([np.ones_like(x), e * x + delta, 1.0 - (1.0 - delta - x) / e])


def dp_auc_ceiling(epsilon: float, delta: float) -> float:
    """The area under :func:`dp_roc_bound` (exact: the bound is piecewise linear and its
    breakpoints are on the grid)."""
    _check_eps_delta(epsilon, delta)
    e = math.exp(min(epsilon, 700.0))  # beyond: 1 to float precision
    breaks = [0.0, 1.0, (1 - delta) / (e + 1), (1 - delta) / e, 1 - delta]
    x = np.unique(np.clip(np.concatenate([np.linspace(0, 1, 1001), breaks]), 0, 1))
    y = dp_roc_bound(epsilon, delta, x)
    return float(np.sum((y[1:] + y[:-1]) * np.diff(x)) / 2)


def dp_choice_ceiling(epsilon: float, delta: float) -> float:
    """``(e^eps + delta) / (1 + e^eps)``: the largest mean success of a forced choice between
    two exchangeable candidates under ``(epsilon, delta)``-DP."""
    _check_eps_delta(epsilon, delta)
    e = math.exp(min(epsilon, 700.0))  # beyond: 1 to float precision
    return (e + delta) / (1.0 + e)


def ceilings(epsilon: float | None, delta: float, sigma: float | None, releases: int,
             mechanism: str) -> dict[str, float | None]:
    """What DP allows the attacks: ``gdp_mu``, ``gdp_auc`` and ``gdp_choice`` (the central
    ``gaussian`` mechanism only: None for ``skellam``, which is not ``mu``-GDP by the module's
    argument), ``dp_auc`` and ``dp_choice`` from ``(epsilon, delta)`` (the accountant's spent
    epsilon). Without DP (``epsilon`` None) every ceiling is 1."""
    if epsilon is None:
        return {"gdp_mu": None, "gdp_auc": 1.0, "gdp_choice": 1.0, "dp_auc": 1.0,
                "dp_choice": 1.0}
    if mechanism not in ("gaussian", "skellam"):
        raise ValueError(f"mechanism={mechanism!r}: expected 'gaussian' or 'skellam'")
    out: dict[str, float | None] = {"gdp_mu": None, "gdp_auc": None, "gdp_choice": None}
    if mechanism == "gaussian":
        if sigma is None:
            raise ValueError("the Gaussian mechanism's ceiling needs its sigma")
        mu = gdp_mu(sigma, releases)
        out = {"gdp_mu": mu, "gdp_auc": gdp_auc_ceiling(mu), "gdp_choice": gdp_choice_ceiling(mu)}
    out["dp_auc"] = dp_auc_ceiling(epsilon, delta)
    out["dp_choice"] = dp_choice_ceiling(epsilon, delta)
    return out


def summarize(scores: Sequence[Sequence[float]], members: Sequence[Sequence[bool]],
              releases: Sequence[int] | None = None, resamples: int = 200) -> dict:
    """:func:`~fedcompress.privacy.leakage.membership_auc` of groups of candidate scores (one
    group per release and target), with ``neighbour_auc`` from every (member, non-member) pair
    of a group (None with fewer than 2 pairs) and ``choice`` (the fraction of those pairs the
    member wins, ties 1/2: the forced choice, equal to the within AUC).

    ``releases`` (the release each group was scored on): adds ``auc_within_se``,
    ``neighbour_auc_se`` and ``top1_se``, bootstrap standard errors over the RELEASES
    (``resamples`` draws with replacement, seeded: groups of one release share its noise and,
    for the knows-the-rest attacker, the member's hypothesis, so they are not independent;
    None with a single release)."""
    out = _summary(scores, members)
    if releases is None:
        return out
    if len(releases) != len(scores):
        raise ValueError(f"{len(releases)} release indices for {len(scores)} groups")
    ids = sorted(set(releases))
    out["releases"] = len(ids)
    keys = ("auc_within", "neighbour_auc", "top1")
    if len(ids) < 2:
        out.update({f"{k}_se": None for k in keys})
        return out
    by = {r: [i for i, g in enumerate(releases) if g == r] for r in ids}
    rng = np.random.default_rng(0)
    draws: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(resamples):
        picked = [i for r in rng.choice(ids, len(ids), replace=True) for i in by[int(r)]]
        sub = _summary([scores[i] for i in picked], [members[i] for i in picked])
        for k in keys:
            v = sub[k]
            if v is not None and not (isinstance(v, float) and math.isnan(v)):
                draws[k].append(float(v))
    out.update({f"{k}_se": (float(np.std(v, ddof=1)) if len(v) > 1 else None)
                for k, v in draws.items()})
    return out


def _summary(scores: Sequence[Sequence[float]], members: Sequence[Sequence[bool]]) -> dict:
    out = lk.membership_auc(scores, members)
    diffs = [m - n for s, f in zip(scores, members)
             for m in (v for v, flag in zip(s, f) if flag)
             for n in (v for v, flag in zip(s, f) if not flag)]
    out["pairs"] = len(diffs)
    out["neighbour_auc"] = neighbour_auc(diffs) if len(diffs) >= 2 else None
    out["choice"] = (float(np.mean([1.0 if d > 0 else 0.5 if d == 0 else 0.0 for d in diffs]))
                     if diffs else None)
    return out
