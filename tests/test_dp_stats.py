"""DP layer statistics (``fedcompress.privacy.dp_stats``): the noise has the stated variance, the
clipping bounds every window, one replaced window moves the release by at most the sensitivity,
the accountant is opacus' own, an unreachable budget is an error, and releases compose."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import build_tiny_model

from fedcompress.models import ModelAdapter
from fedcompress.privacy import dp_stats as dps
from fedcompress.privacy.accounting import RDP_ALPHAS, BudgetError
from fedcompress.pruning.walker import LayerStats, capture_layer_inputs

SEQ = 8


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model("llama", n_layers=2)


def layer0_inputs(model, windows):
    return capture_layer_inputs(model, windows, batch_size=4)


def windows(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 120, (n, SEQ), generator=gen)


def _vec(stats, hessian):
    """{block: the released coordinates} of a layer's stats (one entry per shared object)."""
    out, seen = {}, set()
    for name in sorted(stats):
        st = stats[name]
        if id(st) in seen:
            continue
        seen.add(id(st))
        out[name] = (st.hessian_sum if hessian else st.sq_sum).double().clone()
    return out


# -- noise --------------------------------------------------------------------------------------


@pytest.mark.parametrize("hessian", [False, True])
def test_gaussian_noise_has_the_stated_variance(hessian):
    d, std, reps = 24, 3.5, 400
    rng = np.random.default_rng(7)
    draws = []
    for _ in range(reps):
        st = LayerStats(d, hessian=hessian)
        dps.add_gaussian({"a": st}, {"a": std}, hessian, rng)
        if hessian:
            assert torch.equal(st.hessian_sum, st.hessian_sum.T)  # symmetric, mirrored
            assert torch.allclose(st.sq_sum, torch.diagonal(st.hessian_sum) / 2)
            rows, cols = torch.triu_indices(d, d)
            draws.append(st.hessian_sum[rows, cols].numpy())
        else:
            draws.append(st.sq_sum.numpy())
    x = np.concatenate(draws)
    n = x.size  # 9,600 (Wanda) or 120,000 (Hessian triangle)
    # sample variance: relative standard error sqrt(2 / n); 5 standard errors
    assert abs(x.var() / std ** 2 - 1) < 5 * math.sqrt(2 / n)
    assert abs(x.mean()) < 5 * std / math.sqrt(n)


def test_skellam_shares_sum_to_the_target_variance():
    rng = np.random.default_rng(11)
    target, t, n = 4.0e6, 5, 20000
    shares = [dps.skellam_noise(n, target / t, rng) for _ in range(t)]
    assert all(s.dtype == np.int64 for s in shares)
    total = np.sum(shares, axis=0)
    assert abs(total.var() / target - 1) < 5 * math.sqrt(2 / n)
    assert abs(total.mean()) < 5 * math.sqrt(target / n)
    # a variance beyond one Poisson draw's range is drawn as a sum of Skellams
    big = dps.skellam_noise(20000, 2.0 ** 46, rng)  # 32 draws of Poisson(2^40) each side
    assert abs(big.astype(np.float64).var() / 2.0 ** 46 - 1) < 5 * math.sqrt(2 / 20000)
    with pytest.raises(ValueError, match="variance"):
        dps.skellam_noise(3, -1.0, rng)


def test_secret_rng_differs_and_seeded_rng_repeats():
    a, b = dps.secret_rng(), dps.secret_rng()
    assert a.integers(0, 2 ** 62) != b.integers(0, 2 ** 62)
    assert dps.secret_rng(3).integers(0, 2 ** 62) == dps.secret_rng(3).integers(0, 2 ** 62)
    with pytest.raises(ValueError, match="seed"):
        dps.secret_rng(-1)


# -- clipping and sensitivity -------------------------------------------------------------------


def _release(model, wins, hessian, bounds, scales=None):
    inputs = layer0_inputs(model, wins)
    layer = ModelAdapter(model).layers[0]
    return dps.clipped_layer_stats(layer, inputs, hessian, bounds, batch_size=3, scales=scales)


def _random_scales(model, spread=1e4, seed=0):
    """Positive per-coordinate scales of layer 0's blocks, over ``spread`` orders of size."""
    from fedcompress.methods.fedprllm.stats import layer_in_features, layer_sharing

    gen = torch.Generator().manual_seed(seed)
    shared = layer_sharing(model, 0)
    return {k: spread ** torch.rand(d, generator=gen, dtype=torch.float64)
            for k, d in layer_in_features(model, 0).items() if k not in shared}


@pytest.mark.parametrize("hessian", [False, True])
@pytest.mark.parametrize("normalized", [False, True])
def test_one_replaced_window_moves_each_block_by_at_most_sqrt2_c(tiny, hessian, normalized):
    base = windows(6)
    inputs = layer0_inputs(tiny, base)
    layer = ModelAdapter(tiny).layers[0]
    owners = dps.layer_blocks(layer, inputs)
    blocks = sorted(set(owners.values()))
    assert len(blocks) == 4  # q/k/v, o, gate/up, down
    # bounds far below the windows' norms: every window is clipped
    # normalized: the bound holds in the normalized units, whatever the (public) scales
    scales = _random_scales(tiny) if normalized else None
    bounds = {k: 1e-3 * (i + 1) * (1e-6 if normalized else 1) for i, k in enumerate(blocks)}
    release = _release(tiny, base, hessian, bounds, scales)
    assert all(release.clipped[k] == 6 for k in blocks)
    # sharers hold one object, which encode_stats sends once
    assert release.stats["self_attn.q_proj"] is release.stats["self_attn.k_proj"]
    a = _vec(release.stats, hessian)

    # the neighbour: window 2 replaced by another window whose activations are huge
    from fedcompress.pruning.walker import LayerInputs

    other = layer0_inputs(tiny, windows(6, seed=1)).hidden[2] * 1e6
    hidden = inputs.hidden.clone()
    hidden[2] = other
    b = _vec(dps.clipped_layer_stats(layer, LayerInputs(hidden, inputs.layer_kwargs, 0),
                                     hessian, bounds, 3, scales).stats, hessian)
    # and the dataset with window 2 removed (add/remove adjacency)
    removed = LayerInputs(inputs.hidden[[0, 1, 3, 4, 5]], inputs.layer_kwargs, 0)
    c = _vec(dps.clipped_layer_stats(layer, removed, hessian, bounds, 3, scales).stats,
             hessian)
    total = 0.0
    for k in blocks:
        diff = float(torch.linalg.norm(a[k] - b[k]))
        assert diff <= math.sqrt(2) * bounds[k] * (1 + 1e-9)
        assert float(torch.linalg.norm(a[k] - c[k])) <= bounds[k] * (1 + 1e-9)
        total += (diff / bounds[k]) ** 2
    assert math.sqrt(total) <= dps.sensitivity(len(blocks)) * (1 + 1e-9)


def test_unclipped_windows_sum_to_the_plain_statistics(tiny):
    from fedcompress.pruning.walker import collect_stats

    wins = windows(5)
    inputs = layer0_inputs(tiny, wins)
    layer = ModelAdapter(tiny).layers[0]
    plain = collect_stats(layer, inputs, hessian=True, batch_size=2)
    blocks = set(dps.layer_blocks(layer, inputs).values())
    release = dps.clipped_layer_stats(layer, inputs, True, {k: 1e30 for k in blocks}, 2)
    for name, st in plain.items():
        got = release.stats[name]
        assert got.tokens == st.tokens == 5 * SEQ
        assert torch.allclose(got.hessian_sum, st.hessian_sum, rtol=1e-10, atol=1e-10)
        assert torch.allclose(got.sq_sum, st.sq_sum, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="unknown blocks"):
        dps.clipped_layer_stats(layer, inputs, False, {"nope": 1.0, **{k: 1.0 for k in blocks}})
    with pytest.raises(ValueError, match="no clip bound"):
        dps.clipped_layer_stats(layer, inputs, False, {})


@pytest.mark.parametrize("tokens,dim", [(4, 9), (9, 4), (6, 6)])
def test_window_norms_are_the_materialized_hessians_norms(tokens, dim):
    """The Gram-matrix norm (fewer tokens than inputs) and the direct one are the Frobenius
    norm of each window's ``2 X^T X``."""
    gen = torch.Generator().manual_seed(tokens * 10 + dim)
    x = torch.randn(3, tokens, dim, generator=gen, dtype=torch.float64)
    want = torch.linalg.matrix_norm(2 * torch.einsum("bti,btj->bij", x, x), "fro")
    got = dps.window_norms({"a": x}, True)["a"]
    assert torch.allclose(got, want, rtol=1e-13, atol=0)
    sq = x.pow(2).sum(1)
    assert torch.equal(dps.window_norms({"a": x}, False)["a"],
                       torch.linalg.vector_norm(sq, dim=1))


@pytest.mark.parametrize("hessian", [False, True])
@pytest.mark.parametrize("normalized", [False, True])
def test_clipped_release_is_the_sum_of_each_clipped_window(tiny, hessian, normalized):
    """A site's release never forms a window's d x d Hessian (its norm from the Gram matrix,
    the clipped sum as one product over the tokens), and is what clipping each window's
    materialized statistics (:func:`window_sums`) and summing them gives, to float64
    rounding, with some windows clipped and some not."""
    inputs = layer0_inputs(tiny, windows(7, seed=3))
    layer = ModelAdapter(tiny).layers[0]
    scales = _random_scales(tiny) if normalized else None
    parts: dict[str, list] = {}
    for _s, sq, hs in dps.window_sums(layer, inputs, hessian, 3, scales):
        for k, n in dps._block_norms(sq, hs, hessian).items():
            parts.setdefault(k, []).append(n)
    bounds = {k: float(torch.cat(v).median()) for k, v in parts.items()}  # about half clipped
    want: dict[str, torch.Tensor] = {}
    for _s, sq, hs in dps.window_sums(layer, inputs, hessian, 3, scales):
        factors = dps.clip_factors(dps._block_norms(sq, hs, hessian), bounds)
        for k, f in factors.items():
            part = (torch.einsum("b,bij->ij", f, hs[k]) if hessian
                    else torch.einsum("b,bj->j", f, sq[k]))
            want[k] = part if k not in want else want[k] + part
    release = dps.clipped_layer_stats(layer, inputs, hessian, bounds, 3, scales)
    for k, ref in want.items():
        assert 0 < release.clipped[k] < 7
        st = release.stats[k]
        got = st.hessian_sum if hessian else st.sq_sum
        assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12 * float(ref.abs().max()))
        if hessian:
            assert torch.allclose(st.sq_sum, torch.diagonal(ref) / 2, rtol=1e-12)


@pytest.mark.parametrize("hessian", [False, True])
def test_normalized_sums_map_back_to_the_plain_statistics(tiny, hessian):
    """Unclipped and noise-free, normalizing then :func:`denormalize` is the identity: the
    server gets the inputs' own statistics back (Wanda's square sums, SparseGPT's Hessian)."""
    from fedcompress.pruning.walker import collect_stats

    wins = windows(5, seed=4)
    inputs = layer0_inputs(tiny, wins)
    layer = ModelAdapter(tiny).layers[0]
    plain = collect_stats(layer, inputs, hessian=hessian, batch_size=2)
    scales = _random_scales(tiny, seed=2)
    release = dps.clipped_layer_stats(layer, inputs, hessian, {k: 1e30 for k in scales}, 2,
                                      scales)
    normalized = _vec(release.stats, hessian)
    some = sorted(scales)[0]
    assert not torch.allclose(normalized[some], _vec(plain, hessian)[some], rtol=1e-3)
    dps.denormalize(release.stats, scales, hessian)
    for name, st in plain.items():
        got = release.stats[name]
        assert torch.allclose(got.sq_sum, st.sq_sum, rtol=1e-9, atol=1e-12)
        if hessian:
            assert torch.allclose(got.hessian_sum, st.hessian_sum, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="no public scales"):
        dps.denormalize(release.stats, {}, hessian)
    with pytest.raises(ValueError, match="no public scales"):
        next(dps.window_sums(layer, inputs, hessian, 2, {}))


def test_public_scales_are_the_public_mean_squares(tiny):
    """Each block's scales are its inputs' per-token mean squares over the public windows
    (what Wanda's ``scaler_row`` is), the same at every call; the bounds are then a quantile
    of the NORMALIZED window norms."""
    from fedcompress.pruning.walker import collect_stats

    wins = windows(10, seed=3)
    calib = dps.public_calibration(tiny, wins, hessian=False, quantile=1.0, batch_size=4)
    assert calib.normalize == "public" and len(calib.scales) == 2
    plain = collect_stats(ModelAdapter(tiny).layers[0], layer0_inputs(tiny, wins), False, 4)
    for k, c in calib.scales[0].items():
        want = plain[k].sq_sum / plain[k].tokens
        assert torch.allclose(c, torch.clamp(want, min=dps.SCALE_FLOOR * float(want.max())),
                              rtol=1e-9)
    again = dps.public_scales(tiny, wins, batch_size=4)
    assert all(torch.equal(again[i][k], calib.scales[i][k]) for i in range(2)
               for k in again[i])
    # at the maximum, no public window is clipped in normalized units
    bounds = {k: c * 1.0001 for k, c in calib.bounds[0].items()}
    assert all(v == 0 for v in _release(tiny, wins, False, bounds,
                                        calib.scales[0]).clipped.values())
    raw = dps.public_clip_bounds(tiny, wins, hessian=False, quantile=1.0, batch_size=4)
    assert any(not math.isclose(raw[0][k], calib.bounds[0][k]) for k in raw[0])


def test_a_plan_takes_public_scales_only_with_public_normalization():
    bounds = [{"a": 1.0}]
    good = [{"a": torch.ones(4, dtype=torch.float64)}]
    plan = dps.plan_dp_stats(8.0, 1e-5, "central", bounds, normalize="public", scales=good)
    assert plan.layer_scales(0) is plan.scales[0]
    assert plan.ledger_mechanism()["normalize"] == "public"
    assert "scales_digest" in plan.ledger_mechanism()
    raw = dps.plan_dp_stats(8.0, 1e-5, "central", bounds)
    assert raw.layer_scales(0) is None and raw.ledger_mechanism()["normalize"] == "none"
    for kwargs, match in [(dict(normalize="public"), "public scales exactly"),
                          (dict(scales=good), "public scales exactly"),
                          (dict(normalize="whiten", scales=good), "normalize"),
                          (dict(normalize="public", scales=[{"b": good[0]["a"]}]), "blocks"),
                          (dict(normalize="public", scales=good * 2), "2 layers"),
                          (dict(normalize="public", scales=[{"a": torch.zeros(4)}]), "> 0")]:
        with pytest.raises(ValueError, match=match):
            dps.plan_dp_stats(8.0, 1e-5, "central", bounds, **kwargs)


def test_public_tokens_only():
    dps.check_public_tokens(64, 8, 8)
    with pytest.raises(ValueError, match="public"):
        dps.check_public_tokens(63, 8, 8)


def test_public_clip_bounds_are_a_quantile_of_window_norms(tiny):
    wins = windows(10, seed=3)
    bounds = dps.public_clip_bounds(tiny, wins, hessian=False, quantile=1.0, batch_size=4)
    assert len(bounds) == 2 and all(len(b) == 4 for b in bounds)
    # at the maximum, no public window is clipped (up to float32 batching differences)
    release = _release(tiny, wins, False, {k: c * 1.0001 for k, c in bounds[0].items()})
    assert all(v == 0 for v in release.clipped.values())
    lower = dps.public_clip_bounds(tiny, wins, hessian=False, quantile=0.5, batch_size=4)
    assert all(lower[0][k] <= bounds[0][k] for k in bounds[0])
    with pytest.raises(ValueError, match="quantile"):
        dps.public_clip_bounds(tiny, wins, hessian=False, quantile=0.0)


def test_default_bounds_come_from_public_text(tiny):
    from conftest import build_tiny_tokenizer

    wins = dps.public_windows(build_tiny_tokenizer(), seqlen=SEQ, n=6)
    assert wins.shape == (6, SEQ) and wins.dtype == torch.long
    assert torch.equal(wins, dps.public_windows(build_tiny_tokenizer(), seqlen=SEQ, n=6))
    bounds = dps.public_clip_bounds(tiny, wins, hessian=True, batch_size=3)
    assert all(c > 0 and math.isfinite(c) for b in bounds for c in b.values())


def test_public_text_of_the_sites_kind():
    """``corpus`` picks another bundled corpus' validation split (code for code sites): other
    windows, the same at every party; anything but a bundled corpus is refused."""
    from conftest import build_tiny_tokenizer

    from fedcompress.data.calibration import calibration_windows
    from fedcompress.data.corpora import load_corpus

    tok = build_tiny_tokenizer()
    code = dps.public_windows(tok, seqlen=SEQ, n=4, corpus="code")
    assert torch.equal(code, calibration_windows(tok, load_corpus("code", dps.PUBLIC_SPLIT), 4,
                                                 SEQ, 0))
    assert not torch.equal(code, dps.public_windows(tok, seqlen=SEQ, n=4))
    assert torch.equal(dps.public_windows(tok, seqlen=SEQ, n=4),
                       dps.public_windows(tok, seqlen=SEQ, n=4, corpus=dps.PUBLIC_CORPUS))
    for bad in ("wikitext2", "code.jsonl", ""):
        with pytest.raises(ValueError, match="bundled corpus"):
            dps.public_windows(tok, seqlen=SEQ, n=4, corpus=bad)


# -- accounting ---------------------------------------------------------------------------------


def _opacus_epsilon(sigma, steps, delta):
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    rdp = compute_rdp(q=1.0, noise_multiplier=sigma, steps=steps, orders=RDP_ALPHAS)
    return get_privacy_spent(orders=RDP_ALPHAS, rdp=rdp, delta=delta)[0]


BOUNDS = [{"a": 2.0, "b": 5.0}] * 6


def test_central_plan_is_opacus_rdp_and_meets_the_target():
    plan = dps.plan_dp_stats(8.0, 1e-5, "central", BOUNDS)
    assert plan.mechanism == "gaussian" and plan.releases == 6
    spent = plan.epsilon_after(6)
    assert spent == pytest.approx(_opacus_epsilon(plan.sigma, 6, 1e-5), rel=1e-12)
    assert 8.0 - 0.02 <= spent <= 8.0
    # noise per block: sigma * sqrt(2 k) * C_j
    std = plan.noise_std(0)
    assert std["b"] == pytest.approx(plan.sigma * 2.0 * 5.0)
    # composition is counted: epsilon grows with the releases
    eps = [plan.epsilon_after(k) for k in range(1, 7)]
    assert all(x < y for x, y in zip(eps, eps[1:]))
    sigmas = [dps.plan_dp_stats(8.0, 1e-5, "central", [{"a": 1.0}] * n).sigma
              for n in (1, 4, 16, 30)]
    assert all(x < y for x, y in zip(sigmas, sigmas[1:]))
    with pytest.raises(BudgetError):
        plan.epsilon_after(7)


def test_unreachable_budget_is_a_clear_error():
    with pytest.raises(BudgetError, match="epsilon"):
        dps.plan_dp_stats(1e-4, 1e-10, "central", [{"a": 1.0}] * 30)
    with pytest.raises(BudgetError, match="epsilon"):
        dps.plan_dp_stats(0.0, 1e-5, "central", BOUNDS)
    with pytest.raises(BudgetError, match="delta"):
        dps.plan_dp_stats(8.0, 1.5, "central", BOUNDS)
    with pytest.raises(ValueError, match="placement"):
        dps.plan_dp_stats(8.0, 1e-5, "local", BOUNDS)
    with pytest.raises(ValueError, match="clip bound"):
        dps.plan_dp_stats(8.0, 1e-5, "central", [{"a": 0.0}])


def test_skellam_rdp_is_the_papers_bound():
    # one block, one coordinate: eps(a) <= a D2^2/(2V) + min(((2a-1) D2^2 + 6 D1)/(4V^2), 3D1/(2V))
    sigma, c, f = 1.3, 0.75, 4
    rdp = dps.skellam_rdp(sigma, {"a": (1, c)}, f, orders=[2, 8, 64])
    var = (sigma * math.sqrt(2) * c * 2 ** f) ** 2
    d2 = math.sqrt(2) * c * 2 ** f + 1.0
    d1 = d2
    for a, got in zip([2, 8, 64], rdp):
        want = a * d2 ** 2 / (2 * var) + min(((2 * a - 1) * d2 ** 2 + 6 * d1) / (4 * var ** 2),
                                             3 * d1 / (2 * var))
        assert got == pytest.approx(want, rel=1e-12)


def test_distributed_plan_accounts_skellam_and_meets_the_target():
    dims = [{"a": 32, "b": 64}] * 6
    plan = dps.plan_dp_stats(8.0, 1e-5, "distributed", BOUNDS, dims, frac_bits=16, threshold=3)
    assert plan.mechanism == "skellam"
    spent = plan.epsilon_after(6)
    assert 8.0 - 0.02 <= spent <= 8.0
    # at the same sigma, the Skellam account is above the Gaussian one (rounding, discreteness)
    # but close at a fine lane resolution
    gauss = dps.gaussian_epsilon(plan.sigma, 6, 1e-5)
    assert gauss < spent < gauss * 1.05
    # coarse lanes (0 fractional bits, small bounds) cost noticeably more noise
    coarse = dps.plan_dp_stats(8.0, 1e-5, "distributed", [{"a": 2.0, "b": 5.0}] * 6, dims,
                               frac_bits=0, threshold=3)
    assert coarse.sigma > plan.sigma
    assert [plan.epsilon_after(k) for k in (1, 3, 6)] == sorted(
        plan.epsilon_after(k) for k in (1, 3, 6))
    with pytest.raises(ValueError, match="threshold"):
        dps.plan_dp_stats(8.0, 1e-5, "distributed", BOUNDS, dims, frac_bits=16, threshold=0)
    with pytest.raises(ValueError, match="dims"):
        dps.plan_dp_stats(8.0, 1e-5, "distributed", BOUNDS, None, frac_bits=16, threshold=2)


# -- post-processing ----------------------------------------------------------------------------


def test_noisy_hessian_made_positive_definite_gives_sparsegpt_masks():
    from fedcompress.pruning.scores import sparsegpt_prune

    torch.manual_seed(0)
    d, rows = 48, 16
    x = torch.randn(200, d, dtype=torch.float64)
    h = 2 * x.T @ x
    noise_std = 60.0
    rng = np.random.default_rng(5)
    noisy = h + dps._sym_noise(d, noise_std, rng)
    assert float(torch.linalg.eigvalsh(noisy).min()) < 0  # the noise broke definiteness
    fixed = dps.make_positive_definite(noisy, noise_std)
    assert torch.equal(fixed, fixed.T)
    assert float(torch.linalg.eigvalsh(fixed).min()) > 0
    torch.linalg.cholesky(fixed)  # does not raise
    w = torch.randn(rows, d)
    mask, weights = sparsegpt_prune(w, fixed / 200, 0.5, "row", None, name="test")
    assert mask.shape == w.shape
    assert float(mask.float().mean()) == pytest.approx(0.5)
    assert torch.isfinite(weights).all()


def test_postprocess_floors_square_sums():
    st = LayerStats(4)
    st.sq_sum = torch.tensor([-1.0, 2.0, -0.5, 3.0], dtype=torch.float64)
    dps.postprocess({"a": st}, {"a": 1.0}, hessian=False)
    assert st.sq_sum.tolist() == [0.0, 2.0, 0.0, 3.0]


@pytest.mark.parametrize("hessian", [False, True])
def test_shrink_moves_a_drowned_release_to_its_mean_and_keeps_a_clear_one(hessian):
    """James-Stein toward the block's mean: noise far above the coordinates' spread gives the
    prior (every coordinate the mean: no exact zeros to prune whole columns); noise far below
    it changes nothing that matters; the mean itself is kept."""
    gen = torch.Generator().manual_seed(0)
    d = 400
    signal = 100.0 + 10.0 * torch.randn(d, dtype=torch.float64, generator=gen)

    def release(noise_std):
        st = LayerStats(d, hessian=hessian)
        if hessian:
            h = torch.diag(2 * signal) + 0.5
            h += noise_std * torch.randn(d, d, dtype=torch.float64, generator=gen)
            st.hessian_sum = (h + h.T) / 2
            st.sq_sum = torch.diagonal(st.hessian_sum).clone() / 2
        else:
            st.sq_sum = signal + noise_std * torch.randn(d, dtype=torch.float64, generator=gen)
        return st

    def vec(st):
        return torch.diagonal(st.hessian_sum) / 2 if hessian else st.sq_sum

    drowned = release(1e4)
    before = vec(drowned).clone()
    dps.shrink({"a": drowned}, {"a": 1e4}, hessian)
    after = vec(drowned)
    # a spread the noise alone gives is not credited to the signal: the mean, everywhere
    assert torch.allclose(after, torch.full_like(after, float(before.mean())), rtol=1e-12)
    clear = release(1e-3)
    before = vec(clear).clone()
    dps.shrink({"a": clear}, {"a": 1e-3}, hessian)
    assert torch.allclose(vec(clear), before, rtol=1e-6)
    assert float(vec(clear).mean()) == pytest.approx(float(before.mean()), rel=1e-12)
    if hessian:
        assert torch.equal(clear.hessian_sum, clear.hessian_sum.T)
        assert torch.allclose(clear.sq_sum, torch.diagonal(clear.hessian_sum) / 2)
    with pytest.raises(ValueError, match="no noise scale"):
        dps.shrink({"a": clear}, {}, hessian)


def test_the_server_shrinks_only_a_normalized_release(tiny_dir):
    """server_finish: with normalization and prior shrink, a release the noise drowns prunes as
    the public scales' shape would; the setting is refused without normalization."""
    from fedcompress.config import SettingsError
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig

    with pytest.raises(SettingsError, match="dp_prior"):
        FedPrLLMConfig(model=tiny_dir, aggregate="stats", dp_epsilon=8.0,
                       dp_placement="central", dp_normalize="none", dp_prior="shrink")
    with pytest.raises(SettingsError, match="dp_prior"):
        FedPrLLMConfig(model=tiny_dir, aggregate="stats", dp_epsilon=8.0,
                       dp_placement="central", dp_normalize="none", dp_prior="public")
    from fedcompress.methods.fedprllm import dp as dpm

    d = 16
    plan = dps.plan_dp_stats(1.0, 1e-5, "central", [{"a": 1.0}], normalize="public",
                             scales=[{"a": torch.linspace(1, 4, d, dtype=torch.float64)}])
    st = LayerStats(d)  # no spread between the coordinates, noise of std ~7 on each
    st.sq_sum = torch.full((d,), 1000.0, dtype=torch.float64)
    out = dpm.server_finish({"a": st}, {}, plan, 0, False, 2, np.random.default_rng(3),
                            prior="shrink")
    # about the mean times each public scale: the scales' shape, not the noise's
    ratio = out["a"].sq_sum / torch.linspace(1, 4, d, dtype=torch.float64)
    assert float(ratio.std() / ratio.mean()) < 0.01 and float(ratio.mean()) > 990
    with pytest.raises(ValueError, match="prior='maybe'"):
        dpm.server_finish({"a": LayerStats(d)}, {}, plan, 0, False, 2,
                          np.random.default_rng(3), prior="maybe")


def _stats_with(values: torch.Tensor, hessian: bool, tokens: int = 100) -> LayerStats:
    st = LayerStats(values.shape[0], hessian=hessian)
    if hessian:
        st.hessian_sum = values.clone()
        st.sq_sum = torch.diagonal(values).clone() / 2
    else:
        st.sq_sum = values.clone()
    st.tokens = tokens
    return st


@pytest.mark.parametrize("hessian", [False, True])
def test_shrink_toward_public_statistics_keeps_their_shape_when_drowned(hessian):
    """prior="public": a release the noise drowns becomes the public statistics at the
    release's own level (a Hessian: one multiple of the whole public matrix, its correlations
    kept); a clear release is kept; the noise left is the largest weight times the noise."""
    gen = torch.Generator().manual_seed(0)
    d = 60
    x = torch.randn(400, d, dtype=torch.float64, generator=gen) * torch.linspace(0.5, 2, d)
    public = 2 * x.T @ x / 400 if hessian else x.pow(2).mean(0)
    shape = 1 + 0.2 * torch.randn(public.shape, dtype=torch.float64, generator=gen)
    if hessian:
        shape = (shape + shape.T) / 2
    signal = 300.0 * public * shape  # the private sum: 300 tokens, near the public shape

    def noised(std):
        noise = std * torch.randn(public.shape, dtype=torch.float64, generator=gen)
        return signal + ((noise + noise.T) / 2 if hessian else noise)

    drowned = _stats_with(noised(1e5), hessian)
    left = dps.shrink({"a": drowned}, {"a": 1e5}, hessian, {"a": public})
    out = drowned.hessian_sum if hessian else drowned.sq_sum
    level = float((out * public).sum() / public.pow(2).sum())
    assert level > 0 and torch.allclose(out, level * public, rtol=1e-10)
    assert left == {"a": 0.0}
    if hessian:
        assert torch.allclose(drowned.sq_sum, torch.diagonal(out) / 2)
    clear = _stats_with(noised(1e-6), hessian)
    before = (clear.hessian_sum if hessian else clear.sq_sum).clone()
    left = dps.shrink({"a": clear}, {"a": 1e-6}, hessian, {"a": public})
    assert torch.allclose(clear.hessian_sum if hessian else clear.sq_sum, before, rtol=1e-9)
    assert left["a"] == pytest.approx(1e-6, rel=1e-3)
    with pytest.raises(ValueError, match="no prior for a"):
        dps.shrink({"a": clear}, {"a": 1.0}, hessian, {"b": public})
    with pytest.raises(ValueError, match="expected"):
        dps.shrink({"a": clear}, {"a": 1.0}, hessian, {"a": public[:-1]})


def test_a_flat_public_prior_is_the_flat_shrinkage():
    """Toward a constant prior, the public shrinkage is the flat one (the mean is the
    least-squares level of a constant)."""
    gen = torch.Generator().manual_seed(2)
    values = 50 + 5 * torch.randn(300, dtype=torch.float64, generator=gen)
    flat, public = _stats_with(values, False), _stats_with(values, False)
    w_flat = dps.shrink({"a": flat}, {"a": 4.0}, False)
    w_public = dps.shrink({"a": public}, {"a": 4.0}, False,
                          {"a": torch.ones(300, dtype=torch.float64)})
    assert 0 < w_flat["a"] < 4.0 and w_public["a"] == pytest.approx(w_flat["a"], rel=1e-9)
    assert torch.allclose(flat.sq_sum, public.sq_sum, rtol=1e-12)


def test_normalized_prior_is_per_token_in_the_releases_units():
    h = torch.tensor([[4.0, 2.0], [2.0, 9.0]], dtype=torch.float64)
    st = _stats_with(h, True, tokens=2)
    c = torch.tensor([4.0, 9.0], dtype=torch.float64)
    (prior,) = dps.normalized_prior({"a": st}, {"a": c}, True).values()
    # R^-1 H R^-1 / tokens, R = diag(sqrt(c)) = diag(2, 3)
    assert torch.allclose(prior, torch.tensor([[0.5, 1 / 6], [1 / 6, 0.5]],
                                              dtype=torch.float64))
    (vec,) = dps.normalized_prior({"a": _stats_with(torch.tensor([8.0, 18.0]), False, 2)},
                                  {"a": c}, False).values()
    assert vec.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="over 0 tokens"):
        dps.normalized_prior({"a": _stats_with(h, True, tokens=0)}, {"a": c}, True)


def test_a_negative_level_falls_back_to_the_token_count(caplog):
    prior = torch.linspace(1, 2, 50, dtype=torch.float64)
    st = _stats_with(-3 * prior, False, tokens=7)
    dps.shrink({"a": st}, {"a": 1e6}, False, {"a": prior})
    assert torch.allclose(st.sq_sum, 7 * prior)
    assert "token count 7" in caplog.text


def test_spread_z_is_bonferroni():
    assert dps.spread_z(1, 0.05) == pytest.approx(1.6449, abs=1e-4)
    assert dps.spread_z(240) == pytest.approx(3.9346, abs=1e-3)  # 1% over 240 tests
    with pytest.raises(ValueError, match="tests=0"):
        dps.spread_z(0)


def test_the_floor_is_the_whole_noise_for_the_flat_prior_and_what_is_left_for_public():
    """server_finish on a drowned Hessian release: the flat prior's matrix is floored at the
    noise's spectral scale (its correlations are no estimate); shrunk to public text's Hessian,
    the floor is what the shrinkage left (nothing here), so that Hessian's spectrum stays."""
    from fedcompress.methods.fedprllm import dp as dpm

    d = 16
    plan = dps.plan_dp_stats(0.01, 1e-5, "central", [{"a": 1.0}], normalize="public",
                             scales=[{"a": torch.ones(d, dtype=torch.float64)}])
    (std,) = plan.noise_std(0).values()
    assert std > 100  # against a release of norm 4: drowned
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, d, dtype=torch.float64, generator=gen)
    public = _stats_with(2 * x.T @ x, True, tokens=40)
    floor = 2 * math.sqrt(d) * std
    flat = dpm.server_finish({"a": _stats_with(torch.eye(d, dtype=torch.float64), True)}, {},
                             plan, 0, True, 2, np.random.default_rng(1), prior="shrink")
    assert float(torch.linalg.eigvalsh(flat["a"].hessian_sum)[0]) >= floor * (1 - 1e-9)
    shrunk = dpm.server_finish({"a": _stats_with(torch.eye(d, dtype=torch.float64), True)}, {},
                               plan, 0, True, 2, np.random.default_rng(1), prior="public",
                               prior_stats={"a": public})
    h = shrunk["a"].hessian_sum
    level = float((h * public.hessian_sum).sum() / public.hessian_sum.pow(2).sum())
    assert torch.allclose(h, level * public.hessian_sum, rtol=1e-6)
    with pytest.raises(ValueError, match="prior_stats"):
        dpm.server_finish({"a": _stats_with(torch.eye(d, dtype=torch.float64), True)}, {},
                          plan, 0, True, 2, np.random.default_rng(1), prior="public")


def test_a_pinned_public_text_is_found_by_its_digest_only(tmp_path):
    """``dp_public_text = "sha256:..."``: the file among those given whose SHA-256 it is (a copy
    anywhere, byte for byte), never a path by its name; a malformed digest or none matching is
    an error naming what was found."""
    import hashlib

    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("one public text\n")
    second.write_text("another public text\n")
    digest = "sha256:" + hashlib.sha256(second.read_bytes()).hexdigest()
    assert dps.file_digest(second) == digest and dps.is_digest(digest)
    assert dps.public_text_source(digest, [str(first), "", str(second)]) == str(second)
    assert dps.public_text_source("code", [str(first)]) == "code"
    with pytest.raises(ValueError, match=f"{digest}: no file.*a.txt: sha256:"):
        dps.public_text_source(digest, [str(first)])
    with pytest.raises(ValueError, match="no public file given"):
        dps.public_text_source(digest)
    for bad in (str(second), "sha256:" + "A" * 64, "sha256:abc", "md5:" + "0" * 32):
        assert not dps.is_digest(bad)
        with pytest.raises(ValueError, match="expected a bundled corpus"):
            dps.public_text_source(bad, [str(second)])
    second.write_text("another public text, edited\n")  # a changed copy no longer matches
    with pytest.raises(ValueError, match="no file here has that SHA-256"):
        dps.public_text_source(digest, [str(second)])
