"""The membership attacks on a DP statistics release (:mod:`fedcompress.privacy.dp_attacks`),
written as attacks: on a synthetic Gaussian release whose target sits exactly at the clip
bound (the worst case the accountant pays for), the knows-the-rest attacker's AUC reaches the
GDP ceiling ``Phi(mu / sqrt 2)`` and never exceeds it beyond sampling error; without noise it
always wins; bad inputs are refused with a clear error."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcompress.privacy import dp_attacks as da
from fedcompress.privacy import dp_stats as dps
from fedcompress.privacy import leakage as lk

BOUNDS = {"a": 2.0, "b": 0.5, "c": 7.0}
DIMS = {"a": 6, "b": 4, "c": 5}


def at_bound(index: int) -> dict[str, torch.Tensor]:
    """A window whose every clipped block has norm exactly its bound, on coordinate
    ``index`` (two windows on different coordinates are orthogonal: the worst case)."""
    out = {}
    for k, d in DIMS.items():
        v = torch.zeros(d, dtype=torch.float64)
        v[index] = BOUNDS[k]
        out[k] = v
    return out


def synthetic_scores(sigma: float, layers: int, draws: int, seed: int, member: int):
    """``T = score(t) - score(o)`` on ``draws`` releases of ``layers`` layers holding window
    ``member`` (0: t, 1: o), each block noised with ``sigma sqrt(2k) C_j``."""
    rng = np.random.default_rng(seed)
    std = dps.block_noise_std(sigma, BOUNDS)
    rest = {k: torch.full((d,), 3.0, dtype=torch.float64) for k, d in DIMS.items()}
    t, o = at_bound(0), at_bound(1)
    held = t if member == 0 else o
    out = []
    for _ in range(draws):
        total = 0.0
        for _layer in range(layers):
            release = {k: rest[k] + held[k] + torch.from_numpy(rng.normal(0, std[k], DIMS[k]))
                       for k in DIMS}
            s_t, s_o = da.knows_rest_sum_scores(release, rest, [t, o], std)
            total += s_t - s_o
        out.append(total)
    return np.asarray(out)


def test_knows_rest_on_a_release_at_the_bound_meets_the_gdp_ceiling():
    """epsilon 2, delta 1e-5, 3 layers: the Gaussian mechanism's sigma from the accountant;
    the measured AUC over 3000 draws per world within 0.025 of Phi(mu / sqrt 2) (about 4
    standard errors), and the forced choice within 0.025 of Phi(mu / 2)."""
    layers, eps, delta = 3, 2.0, 1e-5
    sigma = dps.gaussian_sigma(eps, delta, layers)
    c = da.ceilings(eps, delta, sigma, layers, "gaussian")
    assert c["gdp_mu"] == pytest.approx(math.sqrt(layers) / sigma)
    with_t = synthetic_scores(sigma, layers, 3000, 1, member=0)
    with_o = synthetic_scores(sigma, layers, 3000, 2, member=1)
    two_worlds = lk.auc(with_t, with_o)  # the real neighbouring test: t in vs o in
    by_exchange = da.neighbour_auc(with_t)  # what the bench measures: one world only
    assert two_worlds == pytest.approx(c["gdp_auc"], abs=0.025)
    assert by_exchange == pytest.approx(c["gdp_auc"], abs=0.025)
    assert max(two_worlds, by_exchange) <= c["gdp_auc"] + 0.025
    choice = float((with_t > 0).mean())
    assert choice == pytest.approx(c["gdp_choice"], abs=0.025)
    # GDP is tighter than what (epsilon, delta) alone allows, and both are below 1
    assert c["gdp_auc"] < c["dp_auc"] < 1 and c["gdp_choice"] < c["dp_choice"] < 1


def test_a_window_inside_the_bound_leaks_less_than_the_ceiling():
    sigma = dps.gaussian_sigma(4.0, 1e-5, 1)
    std = dps.block_noise_std(sigma, BOUNDS)
    rng = np.random.default_rng(0)
    rest = {k: torch.zeros(d, dtype=torch.float64) for k, d in DIMS.items()}
    t = {k: v / 4 for k, v in at_bound(0).items()}
    o = {k: v / 4 for k, v in at_bound(1).items()}
    diffs = []
    for _ in range(2000):
        release = {k: t[k] + torch.from_numpy(rng.normal(0, std[k], DIMS[k])) for k in DIMS}
        s_t, s_o = da.knows_rest_sum_scores(release, rest, [t, o], std)
        diffs.append(s_t - s_o)
    mu = da.gdp_mu(sigma, 1)
    assert da.neighbour_auc(diffs) == pytest.approx(da.gdp_auc_ceiling(mu / 4), abs=0.03)
    assert da.neighbour_auc(diffs) < da.gdp_auc_ceiling(mu) - 0.05


def test_without_noise_the_member_scores_the_maximum():
    rest = {k: torch.full((d,), 1.0, dtype=torch.float64) for k, d in DIMS.items()}
    cands = [at_bound(i) for i in range(4)]
    release = {k: rest[k] + cands[2][k] for k in DIMS}
    unit = dict.fromkeys(DIMS, 1.0)
    scores = da.knows_rest_sum_scores(release, rest, cands, unit)
    assert all(s < scores[2] for i, s in enumerate(scores) if i != 2)
    # the log-likelihood of the release around rest + c, but for a term no candidate changes
    residual = {k: release[k] - rest[k] for k in DIMS}
    constant = sum(float(r.dot(r)) / 2 for r in residual.values())
    for c, score in zip(cands, scores):
        assert score == pytest.approx(da.gaussian_loglik(residual, c, unit) + constant)
    summary = da.summarize([scores], [[i == 2 for i in range(4)]])
    assert summary["auc_within"] == 1.0 and summary["top1"] == 1.0
    assert summary["neighbour_auc"] == 1.0 and summary["choice"] == 1.0


def test_standard_errors_resample_whole_releases():
    scores = [[0.0, -1.0], [0.0, 1.0], [0.0, -2.0], [0.0, -3.0]]
    members = [[True, False]] * 4
    one = da.summarize(scores, members, releases=[0, 0, 0, 0])
    assert one["releases"] == 1 and one["auc_within_se"] is None
    two = da.summarize(scores, members, releases=[0, 0, 1, 1])
    assert two["releases"] == 2 and two["auc_within"] == 0.75
    assert two["auc_within_se"] > 0  # release 0 wins half its pairs, release 1 all
    assert da.summarize(scores, members)["auc_within"] == two["auc_within"]
    with pytest.raises(ValueError, match="3 release indices for 4 groups"):
        da.summarize(scores, members, releases=[0, 0, 1])


def test_reference_sum_scores_favour_the_window_that_moves_the_mean():
    ref = {k: torch.full((d,), 1.0, dtype=torch.float64) for k, d in DIMS.items()}
    member = at_bound(0)
    other = at_bound(3)
    # release: 4 windows with per-window mean = (ref + member) / 2
    release = {k: 2 * (ref[k] + member[k]) for k in DIMS}
    scores = da.reference_sum_scores(release, 4, ref, 1, [member, other],
                                     dict.fromkeys(DIMS, 1.0))
    assert scores[0] > 0 and scores[0] > scores[1]


def test_mask_scores_are_the_leakage_studys():
    a = {"x": torch.tensor([True, False, True, True])}
    b = {"x": torch.tensor([True, True, True, True])}
    assert da.knows_rest_mask_scores(a, [a, b]) == [0.0, -0.25]
    assert da.reference_mask_scores(a, b, [a, b]) == [0.25, 0.0]


def test_ceilings_and_bounds():
    assert da.gdp_auc_ceiling(0.0) == 0.5 and da.gdp_choice_ceiling(0.0) == 0.5
    assert da.dp_auc_ceiling(0.0, 0.0) == pytest.approx(0.5)
    assert da.dp_choice_ceiling(0.0, 0.0) == 0.5
    # the area under the (eps, delta) region grows with epsilon and tends to 1
    values = [da.dp_auc_ceiling(e, 1e-5) for e in (0.5, 1, 2, 4, 8, 16)]
    assert values == sorted(values) and values[-1] > 0.999
    # the ROC bound itself: e^eps FPR + delta near 0, 1 at the top
    assert float(da.dp_roc_bound(1.0, 0.01, 0.0)) == pytest.approx(0.01)
    assert float(da.dp_roc_bound(1.0, 0.01, 1.0)) == 1.0
    sk = da.ceilings(8.0, 1e-5, 1.0, 2, "skellam")
    assert sk["gdp_auc"] is None and sk["gdp_mu"] is None and 0.5 < sk["dp_auc"] < 1
    assert da.ceilings(None, 1e-5, None, 2, "gaussian")["gdp_auc"] == 1.0


@pytest.mark.parametrize("call,match", [
    (lambda: da.gdp_mu(0.0, 2), "sigma=0.0"),
    (lambda: da.gdp_mu(1.0, 0), "releases=0"),
    (lambda: da.gdp_auc_ceiling(-1.0), "mu=-1.0"),
    (lambda: da.dp_auc_ceiling(-1.0, 0.0), "epsilon=-1.0"),
    (lambda: da.dp_choice_ceiling(1.0, 1.5), "delta=1.5"),
    (lambda: da.ceilings(1.0, 1e-5, 1.0, 2, "laplace"), "mechanism='laplace'"),
    (lambda: da.ceilings(1.0, 1e-5, None, 2, "gaussian"), "needs its sigma"),
    (lambda: da.neighbour_auc([1.0]), "at least 2"),
    (lambda: da.neighbour_auc([1.0, float("nan")]), "finite"),
    (lambda: da.knows_rest_sum_scores(at_bound(0), at_bound(1), [at_bound(2)], {"a": 1.0}),
     "no noise std"),
    (lambda: da.knows_rest_sum_scores(at_bound(0), {"a": torch.zeros(6)}, [], BOUNDS),
     "the rest has blocks"),
    (lambda: da.knows_rest_sum_scores(at_bound(0), at_bound(1), [{"a": torch.zeros(6)}],
                                      BOUNDS), "candidate 0"),
    (lambda: da.gaussian_loglik(at_bound(0), at_bound(1), {**BOUNDS, "a": 0.0}), "noise std"),
    (lambda: da.reference_sum_scores(at_bound(0), 0, at_bound(1), 1, [], BOUNDS),
     "release_windows=0"),
])
def test_bad_inputs_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()
