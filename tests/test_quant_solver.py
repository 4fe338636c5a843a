"""The quantization solver (observer, RTN, GPTQ, joint SparseGPT + GPTQ) and the recipe that
carries it through the calibration walk and statistics mode. Tiny tensors and models."""

from __future__ import annotations

import pytest
import torch

from fedcompress.models import ModelAdapter, weight_matrix
from fedcompress.pruning.local import PruneConfig, apply_masks, local_masks, token_nll
from fedcompress.pruning.scores import sparsegpt_prune
from fedcompress.quant import QuantConfig
from fedcompress.quant.solver import (
    _obs_quantize,
    dequantize,
    gptq_quantize,
    observe,
    quant_range,
    rtn_quantize,
    sparsegpt_quantize,
)
from fedcompress.solver.obs import prepare_obs
from fedcompress.solver.select import select_prune_mask


def _problem(rows=16, cols=64, tokens=400, seed=0):
    """A weight and the Hessian ``2/N X^T X`` of correlated inputs (float64)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(rows, cols, generator=g)
    mix = torch.randn(cols, cols, generator=g) / cols ** 0.5 + torch.eye(cols)
    X = torch.randn(tokens, cols, generator=g) @ mix
    H = 2 * X.double().T @ X.double() / tokens
    return W, H


def _weighted_error(W, Wq, H):
    D = (W - Wq).double()
    return float(torch.trace(D @ H @ D.T))


def _on_grid(result, config):
    """The integers lie in range, and the weight is their dequantization."""
    qmin, qmax = quant_range(config.bits)
    assert result.q.dtype == torch.int8 and result.zero_point.dtype == torch.int8
    assert int(result.q.min()) >= qmin and int(result.q.max()) <= qmax
    groups = result.column_groups()
    by_hand = (result.q.float() - result.zero_point[:, groups].float()) \
        * result.scale[:, groups].float()
    assert torch.equal(result.weight, by_hand)
    if config.symmetric:
        assert not result.zero_point.any()


# --- the observer ------------------------------------------------------------------------------

def test_observer_matches_hand_computed_scales_and_zero_points():
    W = torch.tensor([[-1.5, 0.5, 2.0, 3.0],
                      [0.0, 0.0, -4.0, -1.0]])
    sym4 = QuantConfig(group_size=2)
    scale, zp = observe(W, sym4)
    # max(|min|, |max|) / 7.5, the range widened to include 0; an all-zero group gets eps.
    expected = torch.tensor([[1.5 / 7.5, 3.0 / 7.5], [torch.finfo(torch.float32).eps, 4.0 / 7.5]])
    assert torch.equal(scale, expected) and not zp.any()
    scale8, _ = observe(W, QuantConfig(scheme="w8a16", group_size=0))
    assert torch.equal(scale8, torch.tensor([[3.0 / 127.5], [4.0 / 127.5]]))
    asym4 = QuantConfig(group_size=2, symmetric=False)
    scale, zp = observe(W, asym4)
    # (max - min) / 15, zero point round(-8 - min / scale) clamped to [-8, 7].
    s00, s01, s11 = (0.5 + 1.5) / 15, 3.0 / 15, 4.0 / 15
    assert torch.allclose(scale, torch.tensor([[s00, s01], [torch.finfo(torch.float32).eps,
                                                            s11]]), rtol=0, atol=0)
    assert zp.tolist() == [[round(-8 + 1.5 / s00), -8], [-8, 7]]
    scale, zp = observe(W, QuantConfig(scheme="w8a16", group_size=0, symmetric=False))
    assert torch.equal(scale, torch.tensor([[4.5 / 255], [4.0 / 255]]))
    assert zp.tolist() == [[round(-128 + 1.5 / (4.5 / 255))], [127]]


def test_observer_computes_in_the_weights_dtype():
    W, _ = _problem()
    scale, _ = observe(W.bfloat16(), QuantConfig(group_size=16))
    assert scale.dtype == torch.bfloat16
    assert torch.equal(scale, (W.bfloat16().reshape(16, 4, 16).abs().amax(-1) / 7.5))


# --- round to nearest --------------------------------------------------------------------------

@pytest.mark.parametrize("config", [QuantConfig(group_size=16),
                                    QuantConfig(group_size=16, symmetric=False),
                                    QuantConfig(scheme="w8a16", group_size=0),
                                    QuantConfig(scheme="w8a16", group_size=32, symmetric=False)])
def test_rtn_is_quantize_dequantize(config):
    W, _ = _problem()
    result = rtn_quantize(W, config)
    _on_grid(result, config)
    qmin, qmax = quant_range(config.bits)
    groups = result.column_groups()
    s, z = result.scale[:, groups], result.zero_point[:, groups].float()
    q = torch.round(torch.clamp(W / s + z, qmin, qmax))
    assert torch.equal(result.q.float(), q)
    assert torch.equal(result.weight, (q - z) * s)
    # the nearest grid point: at most half a step away unless clamped at the range's end
    inside = (W / s + z <= qmax) & (W / s + z >= qmin)
    assert ((result.weight - W).abs()[inside] <= s[inside] / 2 * (1 + 1e-6)).all()


def test_rtn_refuses_group_order_and_groups_that_do_not_divide():
    W, _ = _problem()
    with pytest.raises(ValueError, match="activation order 'group'"):
        rtn_quantize(W, QuantConfig(actorder="group", group_size=16))
    with pytest.raises(ValueError, match="group size 128 does not divide the 64 input features "
                                         "of layer 0 q"):
        rtn_quantize(W, QuantConfig(), name="layer 0 q")


# --- GPTQ --------------------------------------------------------------------------------------

CONFIGS = [QuantConfig(group_size=16, block_size=32),
           QuantConfig(group_size=16, symmetric=False, actorder="none"),
           QuantConfig(group_size=0, scheme="w8a16", actorder="group"),
           QuantConfig(group_size=32, symmetric=False, actorder="group", block_size=16)]


@pytest.mark.parametrize("config", CONFIGS)
def test_gptq_lies_on_the_grid_and_beats_rtn(config):
    W, H = _problem()
    _, result, swept = _obs_quantize(W, H, config, None, "w")
    _on_grid(result, config)
    assert torch.equal(swept, result.weight)  # the sweep's values are the saved integers'
    assert torch.equal(result.weight, gptq_quantize(W, H, config).weight)
    rtn = rtn_quantize(W, QuantConfig(config.scheme, "rtn", config.group_size, config.symmetric,
                                      "none"))
    assert _weighted_error(W, result.weight, H) < 0.8 * _weighted_error(W, rtn.weight, H)


@pytest.mark.parametrize("config", [QuantConfig(group_size=16, actorder="none"),
                                    QuantConfig(group_size=16, actorder="static"),
                                    QuantConfig(group_size=0, symmetric=False, actorder="none")])
def test_gptq_with_an_identity_hessian_is_rtn(config):
    W, _ = _problem()
    result = gptq_quantize(W, torch.eye(64, dtype=torch.float64), config)
    rtn = rtn_quantize(W, config)
    assert torch.equal(result.q, rtn.q) and torch.equal(result.scale, rtn.scale)
    assert torch.equal(result.weight, rtn.weight)


def test_block_size_changes_the_integers_only_by_float_ties():
    W, H = _problem(rows=32, cols=128, seed=1)
    base = gptq_quantize(W, H, QuantConfig(group_size=32, block_size=128))
    for block in (1, 16, 50):
        other = gptq_quantize(W, H, QuantConfig(group_size=32, block_size=block))
        differ = int((other.q != base.q).sum())
        # the lazy batch updates only regroup float32 sums: measured 0 differing integers of
        # 147456 (6 seeds x actorder none/static x block sizes 1, 16, 50 against 128)
        assert differ <= 4, (block, differ)


def test_activation_orders():
    W, H = _problem()
    static = gptq_quantize(W, H, QuantConfig(group_size=16, actorder="static"))
    group = gptq_quantize(W, H, QuantConfig(group_size=16, actorder="group"))
    none = gptq_quantize(W, H, QuantConfig(group_size=16, actorder="none"))
    assert static.g_idx is None and none.g_idx is None
    # static keeps each column's own group: the scales are the dense weight's natural groups
    assert torch.equal(static.scale, none.scale)
    # group: g_idx maps every column to a group of 16 columns of decreasing Hessian diagonal
    assert group.g_idx is not None and group.g_idx.dtype == torch.int32
    assert torch.bincount(group.g_idx.long()).tolist() == [16] * 4
    order = torch.argsort(torch.diagonal(H), descending=True, stable=True)
    assert torch.equal(group.g_idx[order].long(), torch.arange(64) // 16)
    assert not torch.equal(group.g_idx.long(), torch.arange(64) // 16)
    # and the scales are those groups' dense min/max
    assert torch.equal(group.scale, observe(W, QuantConfig(group_size=16), perm=order)[0])
    for result in (static, group):
        _on_grid(result, QuantConfig(group_size=16))
        assert torch.equal(dequantize(result.q, result.scale, result.zero_point, 16,
                                      result.g_idx), result.weight)


def test_dead_columns_are_quantized_to_zero():
    W, H = _problem()
    H[5, :] = 0
    H[:, 5] = 0
    for symmetric in (True, False):
        config = QuantConfig(group_size=16, symmetric=symmetric)
        result = gptq_quantize(W, H, config)
        _on_grid(result, config)
        assert (result.weight[:, 5] == 0).all()
        assert torch.equal(result.q[:, 5], result.zero_point[:, 0])
        assert torch.isfinite(result.weight).all()


def test_bf16_scales_dequantize_as_the_runtime_does():
    """bfloat16 scales: in a float32 model the dequantized weight is the exact product (what
    compressed-tensors computes for a float32 load, scales upcast); in a bfloat16 model that
    product rounded once, the bfloat16 multiplication the runtime does in a bfloat16 load."""
    W, H = _problem()
    config = QuantConfig(group_size=16, symmetric=False)
    for weight in (W, W.bfloat16()):
        result = gptq_quantize(weight, H, config, scale_dtype=torch.bfloat16)
        assert result.scale.dtype == torch.bfloat16 and result.dtype == weight.dtype
        groups = result.column_groups()
        scale, zero = result.scale[:, groups], result.zero_point[:, groups]
        exact = (result.q.double() - zero.double()) * scale.double()
        bf16_load = (result.q.to(torch.bfloat16) - zero.to(torch.bfloat16)) * scale
        if weight.dtype == torch.float32:
            assert torch.equal(result.weight.double(), exact)
        else:
            assert torch.equal(result.weight, bf16_load.float())
        assert torch.equal(result.weight.bfloat16(), bf16_load)


# --- SparseGPT + GPTQ jointly ------------------------------------------------------------------

@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("rule", [dict(sparsity=0.5, group="layer"),
                                  dict(sparsity=0.5, group="row"), dict(sparsity=0.5, nm=(2, 4))])
def test_joint_sparsegpt_and_gptq(symmetric, rule):
    W, H = _problem()
    actorder = "none" if "nm" in rule else "static"
    config = QuantConfig(group_size=16, symmetric=symmetric, actorder=actorder)
    mask, result = sparsegpt_quantize(W, H, config, **rule)
    _on_grid(result, config)
    assert float(mask.float().mean()) == 0.5
    if rule.get("group") == "row" or "nm" in rule:
        assert (mask.sum(1) == 32).all()
    assert (result.weight[mask] == 0).all()
    groups = result.column_groups()
    assert torch.equal(result.q[mask], result.zero_point[:, groups].expand_as(mask)[mask])
    # kept weights are not all zero, and pruning + quantizing costs more than quantizing alone
    assert (result.weight[~mask] != 0).float().mean() > 0.5
    alone = gptq_quantize(W, H, config)
    assert _weighted_error(W, result.weight, H) > _weighted_error(W, alone.weight, H)


def test_joint_with_nm_refuses_activation_order():
    W, H = _problem()
    with pytest.raises(ValueError, match="N:M 2:4 pruning with activation order 'static'"):
        sparsegpt_quantize(W, H, QuantConfig(group_size=16), 0.5, nm=(2, 4))


def test_gptq_with_a_fixed_mask_keeps_it():
    W, H = _problem()
    mask = select_prune_mask(W.abs(), 0.5, "row")
    result = gptq_quantize(W, H, QuantConfig(group_size=16, symmetric=False), mask=mask)
    assert (result.weight[mask] == 0).all()
    assert (result.weight[~mask] != 0).float().mean() > 0.5


# --- sparsegpt_prune is SparseGPT's Algorithm 1 ------------------------------------------------

@torch.no_grad()
def _sparsegpt_algorithm_1(weight, hessian, sparsity, group="layer", nm=None, blocksize=128,
                           percdamp=0.01):
    """SparseGPT as its paper states it (Frantar & Alistarh, 2023, Algorithm 1), written
    directly and in float64: no lazy batch updates (every pruned weight's error is spread over
    all later columns at once) and no shared code but the choice of the k smallest scores
    (:func:`select_prune_mask` and its per-block count, tested on their own). Dead inputs
    (zero Hessian diagonal) get H_jj = 1 and a zero weight column; dampening adds
    ``percdamp * mean(diag H)``; ``Hinv`` is the upper Cholesky factor of ``H^-1``. The mask of
    columns ``[i, i + B)`` is chosen when the sweep reaches column ``i`` from
    ``w^2 / Hinv_jj^2`` (N:M: each run of M columns when the sweep reaches it)."""
    from fedcompress.solver.select import block_prune_count

    W = weight.double().clone()
    H = hessian.double().clone()
    rows, cols = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(cols, dtype=torch.float64)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    d = torch.diag(Hinv)
    M = torch.zeros(rows, cols, dtype=torch.bool)
    for i in range(cols):
        if nm is None and i % blocksize == 0:
            b = slice(i, min(i + blocksize, cols))
            M[:, b] = select_prune_mask((W[:, b] ** 2 / d[b] ** 2).float(), sparsity, group,
                                        count=block_prune_count(sparsity, group, rows, b.start,
                                                                b.stop))
        if nm is not None and i % nm[1] == 0:
            b = slice(i, i + nm[1])
            M[:, b] = select_prune_mask((W[:, b] ** 2 / d[b] ** 2).float(), 0.0, nm=nm)
        err = torch.where(M[:, i], W[:, i], 0.0) / Hinv[i, i]
        W[:, i:] -= err[:, None] * Hinv[i, i:][None, :]
    W[M] = 0
    return M, W


@pytest.mark.parametrize("kwargs", [dict(sparsity=0.5), dict(sparsity=0.3, group="row"),
                                    dict(sparsity=0.6, group="column"),
                                    dict(sparsity=0.5, nm=(2, 4)),
                                    dict(sparsity=0.5, blocksize=48)])
def test_sparsegpt_prune_is_the_papers_algorithm_1(kwargs):
    """The blocked float32 sweep with lazy batch updates gives Algorithm 1's mask exactly and
    its weights to float32 precision; the OBS update lowers the layer's reconstruction error
    below that of the same mask without it, and every pruned weight (and the dead input's
    column) is zero."""
    W, H = _problem(rows=24, cols=200, seed=3)
    H[7, :] = 0
    H[:, 7] = 0
    kwargs = dict(kwargs)
    sparsity = kwargs.pop("sparsity")
    mask, new = sparsegpt_prune(W, H, sparsity, **kwargs)
    ref_mask, ref_new = _sparsegpt_algorithm_1(W, H, sparsity, **kwargs)
    assert torch.equal(mask, ref_mask)
    torch.testing.assert_close(new.double(), ref_new, rtol=1e-4, atol=1e-4)
    assert (new[mask] == 0).all() and (new[:, 7] == 0).all()
    masked_only = W.masked_fill(mask, 0)
    assert _weighted_error(W, new, H) < 0.9 * _weighted_error(W, masked_only, H)


def test_prepare_obs_permutes_after_the_dead_columns():
    W, H = _problem()
    H[3, :] = 0
    H[:, 3] = 0
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    Wp, _, dead = prepare_obs(W, H, 0.01, perm=perm)
    assert dead.nonzero().flatten().tolist() == [3]
    assert (Wp[:, (perm == 3).nonzero().item()] == 0).all()
    with pytest.raises(ValueError, match="not a permutation"):
        prepare_obs(W, H, 0.01, perm=torch.zeros(64, dtype=torch.long))


# --- the recipe --------------------------------------------------------------------------------

def test_recipe_validation():
    quant = QuantConfig(group_size=16)
    assert PruneConfig("none", 0.0, quant=quant).needs_hessian
    assert not PruneConfig("none", 0.0, quant=QuantConfig(method="rtn")).needs_hessian
    assert PruneConfig("sparsegpt", quant=QuantConfig(method="rtn")).needs_hessian
    assert PruneConfig("wanda", quant=quant).needs_hessian
    with pytest.raises(ValueError, match="method none prunes nothing: expected a quantization"):
        PruneConfig("none", 0.0)
    with pytest.raises(ValueError, match="method none with sparsity 0.5"):
        PruneConfig("none", quant=quant)
    with pytest.raises(ValueError, match="quantization with the gradient method"):
        PruneConfig("gradient", quant=quant)


def _windows(n=6, seqlen=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (n, seqlen), generator=g)


def _loss(model, windows):
    with torch.no_grad():
        loss, tokens = token_nll(model, windows)
    return float(loss) / tokens


RECIPES = {
    "gptq": PruneConfig("none", 0.0, quant=QuantConfig(group_size=16)),
    "rtn": PruneConfig("none", 0.0, quant=QuantConfig(method="rtn", group_size=16)),
    "sparsegpt+gptq": PruneConfig("sparsegpt", 0.5, "row",
                                  quant=QuantConfig(group_size=16, symmetric=False,
                                                    actorder="group")),
    "wanda+gptq": PruneConfig("wanda", 0.5, quant=QuantConfig(scheme="w8a16", group_size=0)),
    "sparsegpt+rtn": PruneConfig("sparsegpt", 0.5, quant=QuantConfig(method="rtn",
                                                                     group_size=16)),
    "magnitude+rtn": PruneConfig("magnitude", 0.5, quant=QuantConfig(method="rtn",
                                                                     group_size=32,
                                                                     symmetric=False)),
}


@pytest.mark.parametrize("label", list(RECIPES))
def test_centralized_walk_gives_the_quantized_model(tiny_model, label):
    prune = RECIPES[label]
    model = tiny_model("llama", n_layers=2)
    windows = _windows()
    dense_loss = _loss(model, windows)
    result = local_masks(model, windows, prune, batch_size=4, keep_weights=True)
    assert len(result.quant) == 2 and all(layer is not None for layer in result.quant)
    apply_masks(model, result.masks, result.weights)
    for index, layer in enumerate(ModelAdapter(model).layers):
        for name, module in ModelAdapter.linear_layers(layer).items():
            quant = result.quant[index][name]
            mask = result.masks[index][name]
            assert torch.equal(weight_matrix(module), quant.weight)
            assert torch.equal(result.weights[index][name], quant.weight)
            assert (quant.weight[mask] == 0).all()
            if prune.method == "none":
                assert not mask.any()
            else:
                assert float(mask.float().mean()) == 0.5
            _on_grid(quant, prune.quant)
    loss = _loss(model, windows)
    assert torch.isfinite(torch.tensor(loss)) and loss < dense_loss + 1.0


def test_a_bf16_model_gets_bf16_scales_and_its_weights_exactly(tiny_model):
    model = tiny_model("llama", n_layers=2).to(torch.bfloat16)
    prune = PruneConfig("none", 0.0, quant=QuantConfig(group_size=16, symmetric=False))
    result = local_masks(model, _windows(), prune, batch_size=4, keep_weights=True)
    apply_masks(model, result.masks, result.weights)
    for index, layer in enumerate(ModelAdapter(model).layers):
        for name, module in ModelAdapter.linear_layers(layer).items():
            quant = result.quant[index][name]
            assert quant.scale.dtype == torch.bfloat16
            # the runtime's bf16 dequantization, which the sweep compensated for
            assert torch.equal(quant.weight.bfloat16().float(), quant.weight)
            assert torch.equal(weight_matrix(module).float(), quant.weight)


def test_a_group_size_that_does_not_divide_a_layer_is_refused_before_any_work(tiny_model):
    model = tiny_model("llama", n_layers=2)  # input widths 32 (hidden) and 64 (down_proj)
    with pytest.raises(ValueError, match="group size 64 does not divide the 32 input features "
                                         "of layer 0 "):
        local_masks(model, _windows(), PruneConfig("none", 0.0,
                                                   quant=QuantConfig(group_size=64)))


def test_statistics_mode_equals_the_centralized_pass_bit_for_bit(tiny_model):
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig
    from fedcompress.methods.fedprllm.stats import stats_prune

    model = tiny_model("llama", n_layers=2)
    sites = [_windows(2, seed=s) for s in range(3)]
    config = FedPrLLMConfig(method="sparsegpt", aggregate="stats", clients=3,
                            samples_per_client=2, seqlen=16, batch_size=2)
    for label in ("gptq", "sparsegpt+gptq"):
        prune = RECIPES[label]
        central = local_masks(model, torch.cat(sites), prune, batch_size=2, keep_weights=True)
        run = stats_prune(model, sites, config, prune=prune)
        assert len(run.quant) == 2
        for index in range(2):
            for name, quant in central.quant[index].items():
                fed = run.quant[index][name]
                assert torch.equal(run.masks[index][name], central.masks[index][name])
                assert torch.equal(run.weights[index][name], central.weights[index][name])
                assert torch.equal(fed.q, quant.q) and torch.equal(fed.scale, quant.scale)
                assert torch.equal(fed.zero_point, quant.zero_point)
                assert (fed.g_idx is None) == (quant.g_idx is None)
                if quant.g_idx is not None:
                    assert torch.equal(fed.g_idx, quant.g_idx)


def test_statistics_mode_refuses_a_data_free_recipe(tiny_model):
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig
    from fedcompress.methods.fedprllm.stats import stats_prune

    model = tiny_model("llama", n_layers=2)
    config = FedPrLLMConfig(method="sparsegpt", aggregate="stats", clients=2)
    with pytest.raises(ValueError, match="method 'none' and rtn"):
        stats_prune(model, [_windows(2)], config, prune=RECIPES["rtn"])
