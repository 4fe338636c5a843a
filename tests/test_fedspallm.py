"""FedSpaLLM's aggregation (fedcompress/methods/fedspallm.py): the l0 average and the mask
expansion against hand-computed values, the layer assignment, one site equal to local
SparseGPT, and a tiny federation at the exact target sparsity."""

from __future__ import annotations

import pytest
import torch

from fedcompress.methods.fedspallm import (
    VALUE_BYTES,
    L0Sum,
    SiteRelease,
    aggregate_layer,
    aggregate_releases,
    assign_layers,
    fedspallm_prune,
    l0_average,
    run_sites,
    site_release,
)
from fedcompress.models import ModelAdapter, weight_matrix
from fedcompress.pruning.local import (
    PruneConfig,
    apply_layer_masks,
    apply_masks,
    local_masks,
    sparsity_report,
)


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


def test_the_running_sum_is_the_lists_aggregation_bit_for_bit(tiny_model):
    """L0Sum (one release in memory at a time: what the bench and fedspallm_prune use) gives
    aggregate_layer's masks and weights exactly, for both comparison groups from one sum, with
    layer sampling (layers held by different numbers of sites)."""
    model = tiny_model("llama", n_layers=3)
    gen = torch.Generator().manual_seed(4)
    windows = [torch.randint(5, 100, (2, 16), generator=gen) for _ in range(3)]
    assignment = assign_layers(3, [2, 2, 1], seed=2)
    releases = [site_release(model, w, layers, 0.5) for w, layers in zip(windows, assignment)]
    runs = run_sites(model, windows, 0.5, budgets=[2, 2, 1], seed=2)
    assert runs.assignment == assignment
    assert runs.bytes_up == [r.nbytes() for r in releases]
    assert runs.total.releases == 3
    for group in ("layer", "row"):
        masks, weights = runs.total.aggregate(0.5, group)
        listed = aggregate_releases(model, releases, 0.5, group)
        assert all(torch.equal(listed[1][i][n], w) for i in range(3)
                   for n, w in weights[i].items())
        for i, layer in enumerate(ModelAdapter(model).layers):
            held = [r for r in releases if i in r.masks]
            assert runs.total.holders[i] == len(held)
            for name in ModelAdapter.linear_layers(layer):
                mask, weight = aggregate_layer([r.masks[i][name] for r in held],
                                               [r.values[i][name] for r in held], 0.5, group)
                assert torch.equal(masks[i][name], mask), (group, i, name)
                assert torch.equal(weights[i][name], weight), (group, i, name)


def test_a_sum_spilled_to_disk_is_the_one_in_memory_bit_for_bit(tiny_model, tmp_path):
    """L0Sum with ``spill`` (what the bench uses, so that Qwen2.5-1.5B's sum need not fit in
    memory): memory-mapped files, unlinked as soon as they are mapped (the folder stays empty),
    give the in-memory sums, counts, masks and weights exactly; its per-layer stream applied
    one layer at a time gives the model the lists give."""
    model = tiny_model("llama", n_layers=3)
    gen = torch.Generator().manual_seed(6)
    windows = [torch.randint(5, 100, (2, 16), generator=gen) for _ in range(3)]
    memory = run_sites(model, windows, 0.6, budgets=[2, 1, 2], seed=3)
    spilled = run_sites(model, windows, 0.6, budgets=[2, 1, 2], seed=3, spill=tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert spilled.total.holders == memory.total.holders
    for i in memory.total.totals:
        for name, total in memory.total.totals[i].items():
            assert torch.equal(spilled.total.totals[i][name], total)
            assert torch.equal(spilled.total.keepers[i][name], memory.total.keepers[i][name])
            assert spilled.total.keepers[i][name].dtype == torch.int16
    for group in ("layer", "row"):
        masks, weights = memory.total.aggregate(0.6, group)
        listed = apply_masks(tiny_model("llama", n_layers=3), masks, weights)
        streamed = tiny_model("llama", n_layers=3)
        for index, layer_masks, layer_weights in spilled.total.layers(0.6, group):
            assert all(torch.equal(layer_masks[n], m) for n, m in masks[index].items())
            assert all(torch.equal(layer_weights[n], w) for n, w in weights[index].items())
            apply_layer_masks(streamed, index, layer_masks, layer_weights)
        for a, b in zip(listed.state_dict().values(), streamed.state_dict().values()):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="expected an existing directory"):
        L0Sum(model, spill=tmp_path / "missing")
    with pytest.raises(ValueError, match=r"decoder layer 3: expected 0\.\.2"):
        apply_layer_masks(model, 3, {})


def test_the_running_sum_refuses_a_bad_release_whole(tiny_model):
    model = tiny_model("llama", n_layers=2)
    windows = torch.randint(5, 100, (2, 16), generator=torch.Generator().manual_seed(5))
    good = site_release(model, windows, [0, 1], 0.5)
    total = L0Sum(model)
    total.add(good)
    before = {n: t.clone() for n, t in total.totals[1].items()}
    name = sorted(good.masks[1])[-1]
    short = SiteRelease([0, 1], {i: dict(m) for i, m in good.masks.items()},
                        {i: dict(v) for i, v in good.values.items()})
    short.values[1][name] = short.values[1][name][:-1]
    with pytest.raises(ValueError, match=f"release 1, layer 1 {name}: .* values for"):
        total.add(short)
    missing = SiteRelease([0], {0: dict(list(good.masks[0].items())[:1])},
                          {0: dict(list(good.values[0].items())[:1])})
    with pytest.raises(ValueError, match="expected the linear layers"):
        total.add(missing)
    with pytest.raises(ValueError, match=r"layers \[7\]"):
        total.add(SiteRelease([7], {7: {}}, {7: {}}))
    # nothing of the refused releases was added
    assert total.releases == 1 and total.holders == [1, 1]
    assert all(torch.equal(before[n], t) for n, t in total.totals[1].items())
    with pytest.raises(ValueError, match=r"decoder layers \[1\] are in no valid"):
        one = L0Sum(model)
        one.add(SiteRelease([0], {0: good.masks[0]}, {0: good.values[0]}))
        one.aggregate(0.5)


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


def test_a_site_prunes_only_its_layers_and_releases_what_the_full_pass_gives(tiny_model,
                                                                             monkeypatch):
    """A site's pass runs SparseGPT only on the layers it was assigned (none on the others,
    which it only forwards) and releases, bit for bit, what the pass pruning every other layer
    at ratio 0 gives."""
    import fedcompress.pruning.local as local
    from fedcompress.pruning.local import layer_prune_fn
    from fedcompress.pruning.walker import walk

    model = tiny_model("llama", n_layers=4)
    windows = torch.randint(5, 100, (2, 16), generator=torch.Generator().manual_seed(6))
    calls = []
    real = local.sparsegpt_prune

    def counting(*args, **kwargs):
        calls.append(kwargs["name"])
        return real(*args, **kwargs)

    monkeypatch.setattr(local, "sparsegpt_prune", counting)
    release = site_release(model, windows, [1, 2], 0.5, "row")
    per_layer = len(ModelAdapter.linear_layers(ModelAdapter(model).layers[0]))
    assert len(calls) == 2 * per_layer
    calls.clear()
    config = PruneConfig("sparsegpt", 0.5, "row", layer_sparsity="0,0.5,0.5,0")
    full = walk(model, windows, layer_prune_fn(config), hessian=True, keep_weights=True)
    assert len(calls) == 4 * per_layer
    for layer in (1, 2):
        for name, mask in full.masks[layer].items():
            assert torch.equal(release.masks[layer][name], mask), (layer, name)
            assert torch.equal(release.values[layer][name], full.weights[layer][name][~mask])
