"""FedSpaLLM's aggregation (fedcompress/methods/fedspallm.py): the l0 average and the mask
expansion against hand-computed values, the layer assignment, one site equal to local
SparseGPT, and a tiny federation at the exact target sparsity."""

from __future__ import annotations

import pytest
import torch

from fedcompress.methods.fedspallm import (
    VALUE_BYTES,
    aggregate_layer,
    assign_layers,
    fedspallm_prune,
    l0_average,
    site_release,
)
from fedcompress.models import ModelAdapter, weight_matrix
from fedcompress.pruning.local import PruneConfig, apply_masks, local_masks, sparsity_report


def _release(weight: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return mask, weight[~mask]


def test_l0_average_and_mask_expansion_by_hand():
    # three sites, one 2x4 matrix; True = pruned
    w = [torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]),
         torch.tensor([[3.0, 2.0, 1.0, 0.5], [1.0, 1.0, 1.0, 1.0]]),
         torch.tensor([[5.0, 9.0, 2.0, 1.5], [2.0, 2.0, 4.0, 3.0]])]
    m = [torch.tensor([[0, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool),
         torch.tensor([[0, 1, 0, 1], [1, 0, 1, 0]], dtype=torch.bool),
         torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)]
    masks, values = zip(*(_release(a, b) for a, b in zip(w, m)))
    average, keepers = l0_average(masks, values)
    assert keepers.tolist() == [[2, 0, 2, 2], [0, 2, 2, 2]]
    # each weight: the mean over the sites that kept it; none kept it: 0
    assert average.tolist() == [[2.0, 0.0, 1.5, 2.75], [0.0, 3.5, 5.5, 2.0]]
    # expansion to 50% of the matrix (4 of 8): the two every site pruned (count 3), then two of
    # the count-1 weights by the smallest |average|: 1.5 (0,2) and 2.0 (1,3); 2.0 at (0,0)
    # ties 2.0 at (1,3) and loses on the index (row-major: (0,0) first)
    mask, weight = aggregate_layer(masks, values, 0.5, "layer")
    assert mask.tolist() == [[True, True, True, False], [True, False, False, False]]
    assert weight.tolist() == [[0.0, 0.0, 0.0, 2.75], [0.0, 3.5, 5.5, 2.0]]
    # per row: two of each row (row 0: (0,1) every site pruned, then 1.5; row 1: (1,0), then
    # 2.0 at (1,3))
    mask, _ = aggregate_layer(masks, values, 0.5, "row")
    assert mask.tolist() == [[False, True, True, False], [True, False, False, True]]


def test_l0_average_refuses_what_does_not_fit():
    mask = torch.zeros(2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="3 values for 4 kept"):
        l0_average([mask], [torch.ones(3)])
    with pytest.raises(ValueError, match="expected bool"):
        l0_average([mask.float()], [torch.ones(4)])
    with pytest.raises(ValueError, match="not finite"):
        l0_average([mask], [torch.tensor([1.0, float("nan"), 1.0, 1.0])])
    with pytest.raises(ValueError, match="one of each per site"):
        l0_average([], [])
    # a site that pruned more than the target leaves kept weights no site kept: refused
    full = torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="no site kept"):
        aggregate_layer([full], [torch.ones(0)], 0.5)


def test_assign_layers_covers_every_layer_within_each_budget():
    out = assign_layers(6, [2, 3, 1, 4], seed=3)
    assert [len(x) for x in out] == [2, 3, 1, 4]
    assert all(len(set(x)) == len(x) and all(0 <= i < 6 for i in x) for x in out)
    assert set().union(*map(set, out)) == set(range(6))
    assert out == assign_layers(6, [2, 3, 1, 4], seed=3)
    assert assign_layers(3, [3, 3], seed=0) == [[0, 1, 2], [0, 1, 2]]
    # budgets that add up to twice the layers: not the same sets in turn (random fills)
    halves = [assign_layers(30, [15] * 4, seed=s) for s in range(5)]
    assert any(h[0] != h[2] for h in halves)
    for h in halves:
        assert set(h[0]) | set(h[1]) | set(h[2]) | set(h[3]) == set(range(30))
    with pytest.raises(ValueError, match="add up to 4 < 6"):
        assign_layers(6, [2, 2], seed=0)
    with pytest.raises(ValueError, match=r"budgets \[7\]"):
        assign_layers(6, [7, 1], seed=0)


def test_one_site_with_every_layer_is_local_sparsegpt(tiny_model):
    model = tiny_model("llama", n_layers=2)
    windows = torch.randint(5, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    run = fedspallm_prune(model, [windows], 0.5, local_group="row", group="row")
    local = local_masks(model, windows, PruneConfig("sparsegpt", 0.5, "row"), keep_weights=True)
    for layer in range(2):
        for name, mask in local.masks[layer].items():
            assert torch.equal(run.masks[layer][name], mask), (layer, name)
            want = local.weights[layer][name].masked_fill(mask, 0.0)
            assert torch.equal(run.weights[layer][name], want), (layer, name)


def test_a_tiny_federation_reaches_the_target_exactly(tiny_model):
    model = tiny_model("llama", n_layers=3)
    gen = torch.Generator().manual_seed(1)
    windows = [torch.randint(5, 100, (2, 16), generator=gen) for _ in range(3)]
    run = fedspallm_prune(model, windows, 0.5, budgets=[1, 2, 2], seed=0)
    assert sorted(len(x) for x in run.assignment) == [1, 2, 2]
    assert set().union(*map(set, run.assignment)) == {0, 1, 2}
    pruned = apply_masks(tiny_model("llama", n_layers=3), run.masks, run.weights)
    assert sparsity_report(pruned)["overall"] == pytest.approx(0.5, abs=1e-3)
    for layer_masks in run.masks:
        for mask in layer_masks.values():
            assert int(mask.sum()) == int(0.5 * mask.numel())
    # a site sends one bit per weight and the values it kept, for its layers only
    site = site_release(model, windows[0], run.assignment[0], 0.5)
    adapter = ModelAdapter(model)
    bits = sum(-(-weight_matrix(m).numel() // 8) for i in run.assignment[0]
               for m in ModelAdapter.linear_layers(adapter.layers[i]).values())
    kept = sum(int((~m).sum()) for i in site.masks for m in site.masks[i].values())
    assert site.nbytes() == bits + VALUE_BYTES * kept == run.bytes_up_per_site[0]
    # the layers a site was not given are not in its release
    assert set(site.masks) == set(run.assignment[0])


def test_onloaded_sites_release_what_loaded_ones_do(tiny_dir):
    """``onload``: a site walks one decoder layer in memory at a time (a skeleton read from the
    safetensors folder) and releases what the fully loaded model gives."""
    from fedcompress.models import load_model

    full = load_model(tiny_dir, device="cpu").model
    skeleton = load_model(tiny_dir, device="cpu", onload=True).model
    gen = torch.Generator().manual_seed(2)
    windows = [torch.randint(5, 100, (2, 16), generator=gen) for _ in range(2)]
    a = fedspallm_prune(full, windows, 0.5, budgets=[2, 2], seed=1)
    b = fedspallm_prune(skeleton, windows, 0.5, budgets=[2, 2], seed=1)
    c = fedspallm_prune(full, windows, 0.5, budgets=[2, 2], seed=1, onload=True)
    for other in (b, c):
        assert other.assignment == a.assignment
        for layer in range(len(a.masks)):
            for name, mask in a.masks[layer].items():
                assert torch.equal(other.masks[layer][name], mask), (layer, name)
                assert torch.equal(other.weights[layer][name], a.weights[layer][name])
