"""Local pruning: walker exactness, selection groups, N:M, SparseGPT, and error cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcompress.models import ModelAdapter, weight_matrix
from fedcompress.pruning.local import PruneConfig, apply_masks, local_masks, sparsity_report
from fedcompress.pruning.scores import (
    RIA_ALPHA,
    ria_scores,
    sparsegpt_prune,
    wanda_scores,
)
from fedcompress.pruning.walker import capture_layer_inputs, forward_layer, walk
from fedcompress.solver.obs import CholeskyError
from fedcompress.solver.select import parse_nm, select_prune_mask


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text", "opt", "gpt2"])
def test_walker_reproduces_the_dense_forward(tiny_model, model_type):
    model = tiny_model(model_type, n_layers=3)
    windows = torch.randint(5, 100, (5, 20), generator=torch.Generator().manual_seed(0))
    inputs = capture_layer_inputs(model, windows, batch_size=2)
    for layer in ModelAdapter(model).layers:
        inputs = forward_layer(layer, inputs, batch_size=3)
    last = []
    hook = ModelAdapter(model).layers[-1].register_forward_hook(
        lambda _m, _a, out: last.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        model(windows)
    hook.remove()
    torch.testing.assert_close(inputs.hidden, last[0], rtol=1e-5, atol=1e-5)


def test_select_groups_exact():
    scores = torch.tensor([[4.0, 1.0, 3.0, 2.0], [0.5, 8.0, 7.0, 6.0]])
    assert select_prune_mask(scores, 0.5, "row").tolist() == [
        [False, True, False, True], [True, False, False, True]]
    assert select_prune_mask(scores, 0.5, "layer").tolist() == [
        [False, True, True, True], [True, False, False, False]]
    assert select_prune_mask(scores, 0.5, "column").tolist() == [
        [False, True, True, True], [True, False, False, False]]
    assert select_prune_mask(scores, 0.0, nm=(2, 4)).tolist() == [
        [False, True, False, True], [True, False, False, True]]


def test_select_ties_prune_lower_index_first():
    assert select_prune_mask(torch.ones(1, 4), 0.5, "row").tolist() == [[True, True, False, False]]


def _stable_sort_selection(scores, k, dim):
    """The reference rule: the first k of a stable ascending sort along ``dim``."""
    mask = torch.zeros_like(scores, dtype=torch.bool)
    order = torch.sort(scores, dim=dim, stable=True).indices.narrow(dim, 0, k)
    return mask.scatter_(dim, order, True)


@pytest.mark.parametrize("values", ["ties", "continuous", "signed-zeros-and-inf"])
def test_linear_time_selection_is_the_stable_sort_rule(values):
    """The selection (introselect + ties in index order) picks exactly the weights a stable
    ascending sort puts first, in every group, at every k, on the CPU and through the torch
    path other devices take."""
    from fedcompress.solver import select

    g = torch.Generator().manual_seed(0)
    if values == "ties":
        scores = torch.randint(0, 4, (24, 40), generator=g).float()
    elif values == "continuous":
        scores = torch.rand(24, 40, generator=g)
    else:
        pool = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1.0])
        scores = pool[torch.randint(0, 5, (24, 40), generator=g)]
    for dim in (0, 1):
        for k in range(0, scores.shape[dim] + 1, 3):
            expected = _stable_sort_selection(scores, k, dim)
            assert torch.equal(select._lowest_k_along(scores, k, dim), expected), (dim, k)
    flat = scores.reshape(1, -1)
    assert torch.equal(select.select_prune_mask(scores, 0.3, "layer").reshape(1, -1),
                       _stable_sort_selection(flat, int(0.3 * flat.numel()), 1))
    runs = scores.reshape(24, 10, 4)
    assert torch.equal(select.select_prune_mask(scores, 0.0, nm=(2, 4)),
                       _stable_sort_selection(runs, 2, 2).reshape(24, 40))


@pytest.mark.parametrize("values", ["wanda", "ties", "zeros", "tiny-range", "inf",
                                    "negative", "signed-zero"])
def test_compiled_row_select_is_the_stable_sort_rule(values):
    """Groups of at least KERNEL_MIN float32 scores go through the compiled radix select
    (several histogram steps where a bucket stays large): exactly the stable sort's set, at
    every k; rows with a negative score or -0.0 fall back to the partition, the same set."""
    from fedcompress.solver import select

    g = torch.Generator().manual_seed(3)
    shape = (6, 1000)
    if values == "wanda":  # |W| * ||X||: half-normal magnitudes spread over many binades
        scores = torch.randn(shape, generator=g).abs() * torch.rand(shape[1], generator=g) ** 4
    elif values == "ties":
        scores = torch.randint(0, 7, shape, generator=g).float()
    elif values == "zeros":  # a pruned model's scores: a third exactly 0
        scores = torch.rand(shape, generator=g) * (torch.rand(shape, generator=g) > 0.33)
    elif values == "tiny-range":  # keys a few units apart: every step's bucket is large
        scores = 1.0 + torch.randint(0, 300, shape, generator=g).float() * 2.0 ** -23
    elif values == "inf":
        scores = torch.rand(shape, generator=g)
        scores[torch.rand(shape, generator=g) < 0.2] = float("inf")
    elif values == "negative":
        scores = torch.randn(shape, generator=g)
    else:
        scores = torch.rand(shape, generator=g)
        scores[2, 5] = -0.0
    assert shape[1] >= select.KERNEL_MIN
    for k in (1, 2, 250, 499, 500, 501, 999):
        expected = _stable_sort_selection(scores, k, 1)
        assert torch.equal(select._lowest_k_along(scores, k, 1), expected), k


def test_radix_select_steps_find_every_kth():
    """The radix select's steps (down to a one-value bucket or a few keys) give every k-th
    smallest of keys that need one, two or several steps."""
    from fedcompress.solver import radix

    rng = np.random.default_rng(4)
    for keys in (rng.integers(0, 2**31, 5000), rng.integers(0, 300, 5000),
                 1 << 20 | rng.integers(0, 1 << 12, 5000), np.full(100, 7)):
        bits = keys.astype(np.uint32)
        ordered = np.sort(bits)
        for kth in (0, 1, len(bits) // 2, len(bits) - 2, len(bits) - 1):
            assert radix.kth_smallest_radix(bits, kth) == ordered[kth]


@pytest.mark.parametrize("threads", [2, 3, 64])
def test_selection_in_blocks_of_groups_on_threads_is_the_same(monkeypatch, threads):
    """Large score matrices are selected in blocks of groups on torch's threads: the same
    masks as one block (more threads than groups included), with ties, N:M and every group."""
    from fedcompress.solver import select

    g = torch.Generator().manual_seed(2)
    scores = torch.randint(0, 6, (24, 40), generator=g).float()
    serial = [select._lowest_k_along(scores, k, d) for d in (0, 1) for k in (1, 9, 20)]
    serial += [select.select_prune_mask(scores, 0.0, nm=(2, 4)),
               select.select_prune_mask(scores, 0.4, "layer")]
    monkeypatch.setattr(select, "PARALLEL_MIN", 0)
    monkeypatch.setattr(select.torch, "get_num_threads", lambda: threads)
    blocks = [select._lowest_k_along(scores, k, d) for d in (0, 1) for k in (1, 9, 20)]
    blocks += [select.select_prune_mask(scores, 0.0, nm=(2, 4)),
               select.select_prune_mask(scores, 0.4, "layer")]
    assert all(torch.equal(a, b) for a, b in zip(serial, blocks, strict=True))


def test_torch_selection_path_equals_the_numpy_path(monkeypatch):
    """Devices other than the CPU select with torch.kthvalue: the same masks."""
    from fedcompress.solver import select

    scores = torch.randint(0, 5, (16, 30), generator=torch.Generator().manual_seed(1)).float()
    cpu = [select._lowest_k_along(scores, k, d) for d in (0, 1) for k in (1, 7, 15)]

    class NotCpu:
        type = "other"

    class Wrapped(torch.Tensor):
        @property
        def device(self):  # only the dispatch looks at it
            return NotCpu()

    wrapped = scores.as_subclass(Wrapped)
    other = [select._lowest_k_along(wrapped, k, d).as_subclass(torch.Tensor)
             for d in (0, 1) for k in (1, 7, 15)]
    assert all(torch.equal(a, b) for a, b in zip(cpu, other))


def test_nan_scores_are_refused():
    scores = torch.rand(4, 6)
    scores[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        select_prune_mask(scores, 0.5, "row")
    scores[1, 2], scores[2, 3] = float("inf"), -float("inf")  # a NaN sum, no NaN score
    assert select_prune_mask(scores, 0.5, "row")[2, 3]


@pytest.mark.parametrize("nm", ["4:4", "3:2", "0:4", "2-4", "a:b"])
def test_bad_nm(nm):
    with pytest.raises(ValueError, match="N:M"):
        parse_nm(nm)


@pytest.mark.parametrize("sparsity", [-0.1, 1.0, 1.5])
def test_bad_sparsity(sparsity):
    with pytest.raises(ValueError, match="outside"):
        PruneConfig("wanda", sparsity)


def test_unknown_method():
    with pytest.raises(ValueError, match="magnitude, wanda, ria, sparsegpt"):
        PruneConfig("obs", 0.5)


def test_wanda_score_definition():
    w = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    sq = torch.tensor([4.0, 1.0])
    assert wanda_scores(w, sq).tolist() == [[2.0, 2.0], [6.0, 0.5]]


def test_ria_score_definition():
    """RIA by hand: |W_ij| over its row's and its column's total |W|, summed, times
    (mean x_j^2)^(a/2) = ||X_j||^a up to a per-layer constant, a = 0.5."""
    w = torch.tensor([[1.0, -2.0], [3.0, 0.0]])
    sq = torch.tensor([4.0, 16.0])  # ^(1/4): sqrt(2), 2
    # row totals 3, 3; column totals 4, 2
    want = torch.tensor([[(1 / 3 + 1 / 4) * 2 ** 0.5, (2 / 3 + 2 / 2) * 2],
                         [(3 / 3 + 3 / 4) * 2 ** 0.5, 0.0]])
    assert torch.allclose(ria_scores(w, sq), want, rtol=1e-6, atol=0)
    # a zero row or column scores 0, not NaN; the exponent is RIA_ALPHA unless given
    zero = ria_scores(torch.zeros(2, 3), torch.ones(3))
    assert torch.equal(zero, torch.zeros(2, 3))
    assert RIA_ALPHA == 0.5
    assert torch.allclose(ria_scores(w, sq, alpha=0.0), want / torch.tensor([2 ** 0.5, 2.0]))
    with pytest.raises(ValueError, match="input features"):
        ria_scores(w, torch.ones(3))
    with pytest.raises(ValueError, match="exponent"):
        ria_scores(w, sq, alpha=-1.0)


def test_ria_masks_are_the_top_of_its_own_score(tiny_model):
    """``PruneConfig("ria")`` prunes by :func:`ria_scores` of the walker's statistics (layer 0's
    inputs are the embeddings, the same for any mask), not by Wanda's."""
    model = tiny_model("llama", n_layers=1)
    windows = torch.randint(5, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    seen = {}

    def record(_index, layer, stats):
        seen.update(stats)
        return {}, None

    walk(model, windows, record)
    ria = local_masks(model, windows, PruneConfig("ria", 0.5, "row")).masks[0]
    wanda = local_masks(model, windows, PruneConfig("wanda", 0.5, "row")).masks[0]
    for name, module in ModelAdapter.linear_layers(ModelAdapter(model).layers[0]).items():
        scores = ria_scores(weight_matrix(module), seen[name].sq_norm)
        assert torch.equal(ria[name], select_prune_mask(scores, 0.5, "row")), name
    assert any(not torch.equal(ria[n], wanda[n]) for n in ria)


@pytest.mark.parametrize("method", ["magnitude", "wanda", "ria", "sparsegpt"])
@pytest.mark.parametrize("group", ["layer", "row", "column"])
def test_local_masks_hit_the_sparsity(tiny_model, method, group):
    model = tiny_model("llama", n_layers=2)
    windows = torch.randint(5, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    result = local_masks(model, windows, PruneConfig(method, 0.5, group))
    assert len(result.masks) == 2
    for layer_masks in result.masks:
        assert set(layer_masks) == set(ModelAdapter.linear_layers(ModelAdapter(model).layers[0]))
        for mask in layer_masks.values():
            assert mask.dtype == torch.bool
            assert abs(mask.float().mean().item() - 0.5) < 0.02


def test_masks_are_deterministic_and_model_untouched(tiny_model):
    model = tiny_model("llama", n_layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    windows = torch.randint(5, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    a = local_masks(model, windows, PruneConfig("sparsegpt", 0.5, "row"))
    b = local_masks(model, windows, PruneConfig("sparsegpt", 0.5, "row"))
    for la, lb in zip(a.masks, b.masks):
        for name in la:
            assert torch.equal(la[name], lb[name])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_nm_masks(tiny_model):
    model = tiny_model("llama", n_layers=1)
    windows = torch.randint(5, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    result = local_masks(model, windows, PruneConfig("wanda", group="row", nm="2:4"))
    for mask in result.masks[0].values():
        assert (mask.reshape(mask.shape[0], -1, 4).sum(-1) == 2).all()


def test_sparsegpt_reduces_reconstruction_error_vs_plain_masking():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=gen)
    x = torch.randn(512, 64, generator=gen) @ torch.randn(64, 64, generator=gen)  # correlated
    hessian = 2 * x.T @ x / x.shape[0]
    mask, new_w = sparsegpt_prune(w, hessian, 0.5, "row", blocksize=16)
    assert (new_w[mask] == 0).all()
    assert abs(mask.float().mean().item() - 0.5) < 1e-6
    plain = w.masked_fill(mask, 0)
    err_obs = (x @ (w - new_w).T).pow(2).mean()
    err_plain = (x @ (w - plain).T).pow(2).mean()
    assert err_obs < 0.75 * err_plain  # measured: 0.53


@pytest.mark.parametrize("sparsity", [0.5, 0.6, 0.7, 0.33])
@pytest.mark.parametrize("group", ["row", "layer", "column"])
def test_sparsegpt_prunes_exactly_the_target_though_it_chooses_block_by_block(sparsity, group):
    """SparseGPT chooses its mask per block of columns; the blocks of a row (of the matrix,
    for ``layer``) together prune exactly ``floor(sparsity * group size)``, what Wanda's
    choice over the whole group prunes (flooring each block alone gave 76 of 128 at 60%:
    59.4%). At 50% with blocks of even width each block's count is its own floor, as before."""
    from fedcompress.solver.select import block_prune_count

    gen = torch.Generator().manual_seed(1)
    rows, cols, block = 6, 200, 16  # 12 full blocks and one of 8 columns
    w = torch.randn(rows, cols, generator=gen)
    x = torch.randn(256, cols, generator=gen)
    mask, new_w = sparsegpt_prune(w, 2 * x.T @ x / 256, sparsity, group, blocksize=block)
    assert (new_w[mask] == 0).all()
    if group == "row":
        assert (mask.sum(1) == int(sparsity * cols)).all()
    elif group == "column":
        assert (mask.sum(0) == int(sparsity * rows)).all()
    else:
        assert int(mask.sum()) == int(sparsity * (rows * cols))
    counts = [block_prune_count(sparsity, group, rows, i, min(i + block, cols))
              for i in range(0, cols, block)]
    if group == "column":
        assert counts == [None] * len(counts)
    elif sparsity == 0.5:
        per = rows if group == "layer" else 1
        assert counts == [int(0.5 * per * min(block, cols - i)) for i in range(0, cols, block)]


def test_sparsegpt_raises_dampening_then_fails_clearly(caplog):
    w = torch.randn(4, 4)
    bad = -torch.eye(4)  # negative definite: no dampening of 1%..1e4% fixes it
    with pytest.raises(CholeskyError, match="not positive definite"):
        sparsegpt_prune(w, bad, 0.5)
    assert "raising it" in caplog.text


def test_apply_masks_and_sparsity_report(tiny_model):
    model = tiny_model("qwen2", n_layers=2)
    result = local_masks(model, torch.zeros(1, 4, dtype=torch.long), PruneConfig("magnitude", 0.5,
                                                                                  "row"))
    apply_masks(model, result.masks)
    report = sparsity_report(model)
    assert abs(report["overall"] - 0.5) < 0.01
    assert len(report["per_layer"]) == 2
    bad = [dict(result.masks[0]), result.masks[1]]
    name = "mlp.gate_proj"  # [64, 32]: its transpose has another shape
    bad[0][name] = bad[0][name].T
    with pytest.raises(ValueError, match="shape"):
        apply_masks(model, bad)


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_layers_the_plan_leaves_dense_are_only_forwarded(tiny_model, method):
    """A layer at ratio 0 is skipped (no statistics, no pruning, no forward after the last
    pruned layer), and the pruned layers come out bit for bit as from the pass that prunes the
    dense layers at ratio 0 too."""
    from fedcompress.pruning.local import layer_prune_fn

    model = tiny_model("llama", n_layers=4)
    windows = torch.randint(5, 100, (4, 16), generator=torch.Generator().manual_seed(3))
    config = PruneConfig(method, 0.5, "row", layer_sparsity="0,0.5,0,0.6")
    assert config.plan.dense_layers(4) == (0, 2)
    called = []
    fn = layer_prune_fn(config)

    def counting(index, layer, stats):
        called.append(index)
        return fn(index, layer, stats)

    full = walk(model, windows, counting, hessian=config.needs_hessian, keep_weights=True)
    assert called == [0, 1, 2, 3]
    called.clear()
    skipped = walk(model, windows, counting, hessian=config.needs_hessian, keep_weights=True,
                   dense=(0, 2))
    assert called == [1, 3]
    via_local = local_masks(model, windows, config, keep_weights=True)
    for result in (skipped, via_local):
        for layer in (1, 3):
            for name, mask in full.masks[layer].items():
                assert torch.equal(result.masks[layer][name], mask), (layer, name)
                if method == "sparsegpt":
                    assert torch.equal(result.weights[layer][name], full.weights[layer][name])
        for layer in (0, 2):
            assert result.weights[layer] is None
            assert not any(m.any() for m in result.masks[layer].values())
            assert result.masks[layer].keys() == full.masks[layer].keys()


def test_trailing_dense_layers_are_not_forwarded(tiny_model):
    model = tiny_model("llama", n_layers=3)
    windows = torch.randint(5, 100, (2, 16), generator=torch.Generator().manual_seed(4))
    seen = []
    hooks = [layer.register_forward_hook(lambda _m, _a, _o, i=i: seen.append(i))
             for i, layer in enumerate(ModelAdapter(model).layers)]
    config = PruneConfig("wanda", 0.5, "row", layer_sparsity="0,0.5,0")
    try:
        result = local_masks(model, windows, config)
    finally:
        for hook in hooks:
            hook.remove()
    # layer 0's forward feeds layer 1's statistics; layer 2, dense after the last pruned
    # layer, is not forwarded
    assert sorted(set(seen)) == [0, 1]
    assert len(result.masks) == 3 and not any(m.any() for m in result.masks[2].values())


def test_dense_layers_of_a_plan():
    from fedcompress.pruning.allocation import SparsityPlan

    plan = SparsityPlan(0.5, (0.0, 0.5, 0.0), {"0.mlp.up_proj": 0.3, "2.mlp.up_proj": 0.0})
    assert plan.dense_layers(3) == (2,)  # layer 0 prunes its up_proj
    assert SparsityPlan(0.5).dense_layers(2) == ()
    assert SparsityPlan(0.0).dense_layers(2) == (0, 1)
    with pytest.raises(ValueError, match="3 per-layer ratios"):
        plan.dense_layers(4)


def test_walk_refuses_dense_layers_the_model_lacks(tiny_model):
    model = tiny_model("llama", n_layers=2)
    windows = torch.randint(5, 100, (2, 16), generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match=r"dense layers \[2\]"):
        walk(model, windows, lambda i, layer, stats: ({}, None), dense=(2,))
