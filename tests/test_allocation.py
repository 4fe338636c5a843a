"""Per-layer sparsity plans and OWL's allocation: exact small cases, and the plan followed by the
local pass, the vote and the validation of a site's masks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcompress.methods.fedprllm.federated import (
    InvalidMaskError,
    MaskAggregator,
    ServerConfig,
    check_payload,
    encode_masks,
    expected_shapes,
    mask_key,
)
from fedcompress.models import ModelAdapter, load_model
from fedcompress.pruning.allocation import SparsityPlan, outlier_ratio, owl_ratios, renormalize
from fedcompress.pruning.local import (
    PruneConfig,
    check_global_ratio,
    layer_sizes,
    local_masks,
    outlier_ratios,
    owl_plan,
)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, device="cpu")


def windows(n=4, seqlen=16, seed=0):
    return torch.randint(5, 100, (n, seqlen), generator=torch.Generator().manual_seed(seed))


# -- the plan ---------------------------------------------------------------------------------
def test_plan_lookup_and_text_round_trip():
    plan = SparsityPlan(0.5, (0.4, 0.5, 0.6), {"1.mlp.up_proj": 0.3})
    assert plan.at(0, "self_attn.q_proj") == 0.4 and plan.at(2) == 0.6
    assert plan.at(1, "mlp.up_proj") == 0.3 and plan.at(1, "mlp.down_proj") == 0.5
    assert plan.at_key("layers.1.mlp.up_proj") == 0.3
    assert SparsityPlan.from_text(plan.to_text(), 0.5) == plan
    assert SparsityPlan.from_text("0.25,0.75", 0.5).layers == (0.25, 0.75)
    assert SparsityPlan.from_text("", 0.5).is_uniform and SparsityPlan(0.5).to_text() == ""
    sizes = {"0.a": 10, "1.a": 30}  # 0.25 * 10 + 0.75 * 30 = 25 of 40
    assert SparsityPlan(0.5, (0.25, 0.75)).global_ratio(sizes) == pytest.approx(25 / 40)


@pytest.mark.parametrize("make, message", [
    (lambda: SparsityPlan(0.5, (0.4, 1.0)), r"sparsity of layer 1: sparsity 1.0 is outside"),
    (lambda: SparsityPlan(-0.1), "default sparsity"),
    (lambda: SparsityPlan(0.5, linears={"q_proj": 0.2}), "'<layer index>.<linear name>'"),
    (lambda: SparsityPlan.from_text("0.4,x", 0.5), "comma-separated ratios"),
    (lambda: SparsityPlan.from_text('{"layer": [0.5]}', 0.5), "unknown keys"),
    (lambda: SparsityPlan(0.5, (0.4, 0.6)).check_layers(3), "2 per-layer ratios, the model has 3"),
    (lambda: PruneConfig(nm="2:4", layer_sparsity="0.5,0.5"), "N:M fixes every layer"),
])
def test_bad_plans_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_renormalize_keeps_the_weighted_mean_exactly():
    ratios = renormalize([0.3, 0.5, 0.9], [100, 300, 600], 0.6)
    assert math.fsum(r * n for r, n in zip(ratios, [100, 300, 600])) / 1000 == \
        pytest.approx(0.6, abs=1e-12)
    assert ratios[1] - ratios[0] == pytest.approx(0.2)  # one shift for every layer
    with pytest.raises(ValueError, match=r"layer 2: ratio 1.0\d+ .* outside \[0, 1\)"):
        renormalize([0.1, 0.5, 0.9], [1, 1, 1], 0.6)


# -- OWL ----------------------------------------------------------------------------------
def test_outlier_ratio_counts_scores_above_m_times_the_layer_mean():
    # mean of all 10 scores = (9 * 1 + 91) / 10 = 10; above 5 x 10 = 50: only the 91
    scores = [torch.ones(3, 3), torch.tensor([[91.0]])]
    scores[0].view(-1)[-1] = 1.0
    assert outlier_ratio(scores, 5.0) == pytest.approx(1 / 10)
    assert outlier_ratio([torch.ones(4, 4)], 1.0) == 0.0  # nothing above the mean itself
    with pytest.raises(ValueError, match="M=0"):
        outlier_ratio(scores, 0)


def test_owl_ratios_follow_the_rule():
    # outliers min-max scaled to [0, 2 * 0.1] = [0, 0.1, 0.2]; mean 0.1; p - (s - 0.1)
    assert owl_ratios([0.01, 0.02, 0.03], 0.5, 0.1) == pytest.approx([0.6, 0.5, 0.4])
    assert owl_ratios([0.2, 0.2], 0.7, 0.08) == pytest.approx([0.7, 0.7])  # no spread: uniform
    with pytest.raises(ValueError, match="lambda=0.6"):
        owl_ratios([0.1, 0.2], 0.5, 0.6)
    with pytest.raises(ValueError, match="outlier ratios"):
        owl_ratios([0.1, float("nan")], 0.5, 0.1)


def test_outlier_ratios_of_a_model_and_its_owl_plan(tiny):
    ratios = outlier_ratios(tiny.model, windows(), m=3.0, batch_size=2)
    assert len(ratios) == len(ModelAdapter(tiny.model)) and all(0 <= r <= 1 for r in ratios)
    plan = owl_plan(ratios, 0.5, 0.08, tiny.model)
    assert check_global_ratio(plan, tiny.model) == pytest.approx(0.5, abs=1e-9)
    order = np.argsort(ratios, kind="stable")  # more outliers: pruned less
    assert plan.layers[order[-1]] <= plan.layers[order[0]]


# -- the plan in the local pass, the vote and the validation ------------------------------------
def test_uniform_plan_gives_exactly_the_uniform_masks(tiny):
    a = local_masks(tiny.model, windows(), PruneConfig("wanda", 0.5, "row"), batch_size=2)
    b = local_masks(tiny.model, windows(), PruneConfig("wanda", 0.5, "row",
                                                        layer_sparsity="0.5,0.5,0.5"), 2)
    for la, lb in zip(a.masks, b.masks, strict=True):
        assert all(torch.equal(la[k], lb[k]) for k in la)


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_local_pass_prunes_each_layer_at_its_ratio(tiny, method):
    plan = '{"layers": [0.3, 0.5, 0.7], "linears": {"1.mlp.up_proj": 0.25}}'
    result = local_masks(tiny.model, windows(), PruneConfig(method, 0.5, "row",
                                                             layer_sparsity=plan), 2)
    for index, layer in enumerate(result.masks):
        for name, mask in layer.items():
            want = 0.25 if (index, name) == (1, "mlp.up_proj") else (0.3, 0.5, 0.7)[index]
            assert float(mask.float().mean()) == pytest.approx(want, abs=1 / mask.shape[1]), \
                (index, name)
    with pytest.raises(ValueError, match="2 per-layer ratios, the model has 3"):
        local_masks(tiny.model, windows(), PruneConfig(method, 0.5, layer_sparsity="0.4,0.6"))


@pytest.mark.parametrize("group", ["layer", "row", "column"])
def test_vote_keeps_each_layer_at_its_ratio(tiny, group):
    prune = PruneConfig("wanda", 0.5, "row", layer_sparsity="0.2,0.5,0.8")
    aggregator = MaskAggregator(tiny.model, 3)
    for seed in range(3):
        masks = local_masks(tiny.model, windows(seed=seed), prune, batch_size=2).masks
        aggregator.add({mask_key(i, n): m for i, layer in enumerate(masks)
                        for n, m in layer.items()})
    flat = aggregator.global_masks(ServerConfig(group), prune.plan)
    for key, mask in flat.items():
        want = (0.2, 0.5, 0.8)[int(key.split(".")[1])]
        assert float(mask.float().mean()) == pytest.approx(want, abs=2 / min(mask.shape))


def test_site_masks_are_checked_against_their_layers_ratio(tiny):
    prune = PruneConfig("wanda", 0.5, "row", layer_sparsity="0.2,0.5,0.8")
    payload = encode_masks(local_masks(tiny.model, windows(), prune, batch_size=2).masks)
    shapes = expected_shapes(tiny.model)
    check_payload(payload, shapes, prune.plan)  # each layer at its own ratio: accepted
    with pytest.raises(InvalidMaskError, match=r"layers.0.* sparsity 0.1\d\d, requested 0.500"):
        check_payload(payload, shapes, 0.5)  # the uniform target refuses the plan's masks


def test_a_plan_that_changes_the_global_ratio_is_refused(tiny):
    sizes = layer_sizes(tiny.model)
    assert sum(sizes.values()) == sum(math.prod(s) for s in expected_shapes(tiny.model).values())
    with pytest.raises(ValueError, match="prunes 0.600000 of the weights, the global sparsity "
                                         "is 0.5"):
        check_global_ratio(SparsityPlan(0.5, (0.6, 0.6, 0.6)), tiny.model)
