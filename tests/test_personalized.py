"""Seed 004: personalized / generic units (Alg. 1) and Eq. 4's per-linear ratios."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from fedcompress.layers.personalized import (
    ClassifyConfig,
    classify_units,
    mean_lm_loss,
    personalized_plan,
    plan_summary,
    reclassify,
    switched_off,
    units_of,
)
from fedcompress.pruning.allocation import bounded_rescale, rescale
from fedcompress.pruning.local import PruneConfig, layer_sizes, local_masks

PLANTED = "1.mlp"


def _pattern(n: int, tokens: list[int], seqlen: int = 16) -> torch.Tensor:
    row = (tokens * seqlen)[:seqlen]
    return torch.tensor([row] * n)


@pytest.fixture(scope="module")
def planted():
    """A tiny llama whose MLP of block 1 alone was trained on client A's text (a repeating
    pattern): switching it off raises A's loss; client B's text is another pattern."""
    from conftest import build_tiny_model

    model = build_tiny_model("llama", 3)
    a = _pattern(4, [5, 6, 7, 8])
    params = [p for n, p in model.named_parameters() if n.startswith("model.layers.1.mlp.")]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=1e-2)
    torch.manual_seed(0)
    for _ in range(60):
        opt.zero_grad()
        model(input_ids=a, labels=a).loss.backward()
        opt.step()
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return model, a, _pattern(4, [40, 31, 22, 13, 9])


def test_units_by_granularity(tiny_model):
    model = tiny_model("llama", 2)
    sub = units_of(model)
    assert list(sub) == ["0.self_attn", "0.mlp", "1.self_attn", "1.mlp"]
    assert sub["0.mlp"] == ["0.mlp.gate_proj", "0.mlp.up_proj", "0.mlp.down_proj"]
    assert len(units_of(model, "linear")) == 14 and list(units_of(model, "layer")) == ["0", "1"]
    with pytest.raises(ValueError, match="granularity 'head' is unknown"):
        units_of(model, "head")


@pytest.mark.parametrize("zero", ["weights", "skip"])
def test_switching_off_restores_the_model_exactly(tiny_model, zero):
    model = tiny_model("llama", 2)
    before = copy.deepcopy(model.state_dict())
    windows = _pattern(2, [5, 6, 7])
    base = mean_lm_loss(model, windows)
    with switched_off(model, units_of(model)["1.mlp"], zero):
        off = mean_lm_loss(model, windows)
    assert off != base
    assert mean_lm_loss(model, windows) == base
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(RuntimeError, match="boom"), switched_off(model, ["0.mlp.up_proj"], zero):
        raise RuntimeError("boom")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bias_free_sublayer_weights_and_skip_agree(tiny_model):
    """LLaMA's MLP has no bias: zeroing its weights and skipping its linears both remove it."""
    model = tiny_model("llama", 2)
    windows = _pattern(2, [5, 6, 7])
    losses = []
    for zero in ("weights", "skip"):
        with switched_off(model, units_of(model)["0.mlp"], zero):
            losses.append(mean_lm_loss(model, windows))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_planted_personalized_unit_is_found_on_its_clients_data_only(planted):
    model, a, b = planted
    config = ClassifyConfig(k=1, max_iter=40, seed=0)
    on_a = classify_units(model, a, config)
    on_b = classify_units(model, b, config)
    assert on_a.classes[PLANTED] == "personalized"
    assert on_b.classes[PLANTED] != "personalized"
    with switched_off(model, on_a.units[PLANTED]):
        assert mean_lm_loss(model, a) > on_a.threshold
    again = classify_units(model, a, config)  # seeded: the same draws and classes
    assert again.to_dict() == on_a.to_dict()
    assert sum(on_a.counts().values()) == len(on_a.units)


def test_alg1_rules_on_scripted_losses(tiny_model, monkeypatch):
    """Above the threshold: the subset is personalized; below: generic unless already
    personalized (personalized wins); units never drawn are others."""
    import fedcompress.layers.personalized as pl

    model = tiny_model("llama", 2)
    names = list(units_of(model))
    losses = iter([1.0, 2.0, 0.5, 0.5])  # threshold, then one loss per draw
    monkeypatch.setattr(pl, "mean_lm_loss", lambda *a, **k: next(losses))
    draws = iter([[0, 1], [1, 2], [0, 1]])

    class Rng:
        def choice(self, n, k, replace):
            return next(draws)

    monkeypatch.setattr(pl.np.random, "default_rng", lambda seed: Rng())
    result = classify_units(model, _pattern(1, [5, 6]), ClassifyConfig(k=2, max_iter=3))
    assert result.classes == {names[0]: "personalized", names[1]: "personalized",
                              names[2]: "generic", names[3]: "others"}


def test_k_larger_than_the_units_is_named(tiny_model):
    with pytest.raises(ValueError, match="k=5 units per draw, but the model has only 4"):
        classify_units(tiny_model("llama", 2), _pattern(1, [5, 6]), ClassifyConfig(k=5))
    with pytest.raises(ValueError, match="k=0 is invalid"):
        ClassifyConfig(k=0)
    with pytest.raises(ValueError, match="zero='drop' is invalid"):
        ClassifyConfig(zero="drop")


def test_eq4_plan_keeps_the_proportions_and_the_global_ratio(tiny_model):
    model = tiny_model("llama", 2)
    sizes = layer_sizes(model)
    units = units_of(model)
    unit_class = {"0.self_attn": "personalized", "0.mlp": "generic", "1.self_attn": "others",
                  "1.mlp": "generic"}
    classes = {lin: unit_class[u] for u, lins in units.items() for lin in lins}
    plan = personalized_plan(classes, sizes, 0.5)
    mean = math.fsum(plan.at(int(k.split(".", 1)[0]), k.split(".", 1)[1]) * n
                     for k, n in sizes.items()) / sum(sizes.values())
    assert mean == pytest.approx(0.5, abs=1e-12)
    g = plan.linears["0.mlp.up_proj"]
    assert plan.linears["0.self_attn.q_proj"] == pytest.approx(g / 2)
    assert plan.linears["1.self_attn.o_proj"] == pytest.approx(3 * g / 4)
    masks = local_masks(model, _pattern(2, [5, 6, 7]), PruneConfig(
        "wanda", 0.5, "row", layer_sparsity=plan.to_text()), batch_size=2).masks
    for name, mask in masks[0].items():
        assert float(mask.float().mean()) == pytest.approx(plan.at(0, name),
                                                           abs=1 / mask.shape[1])
    with pytest.raises(ValueError, match="cannot reach"):
        personalized_plan(classes, sizes, 0.9)  # generic layers would need a ratio >= 1
    with pytest.raises(ValueError, match="no class for linear layers"):
        personalized_plan({}, sizes, 0.5)


def test_rescale_is_exact_and_refuses_the_impossible():
    assert rescale([0.1, 0.2], [1, 1], 0.3) == pytest.approx([0.2, 0.4])
    assert rescale([0.0, 0.0], [1, 1], 0.0) == [0.0, 0.0]
    with pytest.raises(ValueError, match="every ratio is 0"):
        rescale([0.0, 0.0], [1, 1], 0.5)
    with pytest.raises(ValueError, match="sparsity 1.2 is outside"):
        rescale([0.1], [1], 1.2)


def test_bounded_rescale_keeps_p_and_the_bound_and_equals_eq4_inside_it():
    import numpy as np

    rng = np.random.default_rng(0)
    solved = same = 0
    for _ in range(500):
        k = int(rng.integers(1, 20))
        raw = list(rng.random(k) * rng.integers(0, 2, k))
        sizes = list(rng.integers(1, 100, k))
        p = float(rng.random() * 0.9)
        bound = float(rng.random() * (0.99 - p))
        try:
            out = bounded_rescale(raw, sizes, p, bound)
        except ValueError as err:
            assert "out of reach inside the ratio bound" in str(err)
            continue
        solved += 1
        assert np.dot(out.ratios, sizes) / sum(sizes) == pytest.approx(p, abs=1e-12)
        assert min(out.ratios) >= max(0.0, p - bound) - 1e-12
        assert max(out.ratios) <= p + bound + 1e-12
        try:
            eq4 = rescale(raw, sizes, p)
        except ValueError:
            continue
        if max(eq4) <= p + bound and min(eq4) >= p - bound:  # the bound does not bind
            assert out.ratios == pytest.approx(eq4, abs=1e-12) and not out.bit
            same += 1
    assert solved > 200 and same > 50


def test_bounded_rescale_names_what_it_cannot_do():
    with pytest.raises(ValueError, match=r"out of reach inside the ratio bound 0.1: .*0\.7000 "
                       r"\(40\.0% of the weights\).*the mean is 0\.5800"):
        bounded_rescale([0, 0, 0, 1], [1, 2, 3, 4], 0.6, 0.1)
    with pytest.raises(ValueError, match="expected a bound below 1 - sparsity = 0.2000"):
        bounded_rescale([1, 2], [1, 1], 0.8, 0.2)
    with pytest.raises(ValueError, match="ratio bound -0.1"):
        bounded_rescale([1, 2], [1, 1], 0.5, -0.1)
    clipped = bounded_rescale([0.5, 0.5, 0.75, 1.0], [1, 2, 3, 4], 0.6, 0.1)
    assert clipped.ratios == pytest.approx([0.5, 0.5, 1.7 / 3, 0.7])  # mean 6 / 10
    assert clipped.clipped_low == [0, 1] and clipped.clipped_high == [3] and clipped.bit


def _smollm2_sizes():
    """SmolLM2-135M's prunable linear layers and their sizes (shapes only: no weights)."""
    import transformers

    from fedcompress.models.embedded import embedded_model_dir

    config = transformers.AutoConfig.from_pretrained(embedded_model_dir("smollm2-135m")[0])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return units_of(model), layer_sizes(model)


def test_the_collapsed_plan_of_the_issue_is_bounded():
    """A plan like the one the issue found on 4 sites (Alg. 1 called 40 of SmolLM2's 60
    sublayers personalized, none generic, the rest others): here every MLP and 10 attention
    sublayers personalized, 20 attention sublayers others. At p = 0.6 Eq. 4 alone puts 83% on
    every "others" sublayer (the issue's counts gave 86%); with the default bound no unit
    strays further from p than the bound, the mean is still p, and the summary says the bound
    bit and what Eq. 4 alone would have done."""
    from fedcompress.layers.personalized import DEFAULT_RATIO_BOUND

    units, sizes = _smollm2_sizes()
    names = list(units)
    assert len(names) == 60
    unit_class = {u: "personalized" if u.endswith("mlp") or int(u.split(".")[0]) % 3 == 0
                  else "others" for u in names}
    assert sum(c == "personalized" for c in unit_class.values()) == 40
    classes = {lin: unit_class[u] for u, lins in units.items() for lin in lins}
    eq4 = personalized_plan(classes, sizes, 0.6)
    assert max(eq4.linears.values()) == pytest.approx(0.831, abs=1e-3)  # the collapse
    bounded = personalized_plan(classes, sizes, 0.6, bound=DEFAULT_RATIO_BOUND)
    ratios = list(bounded.linears.values())
    bound = DEFAULT_RATIO_BOUND
    assert max(ratios) <= 0.6 + bound + 1e-12 and min(ratios) >= 0.6 - bound - 1e-12
    total = sum(sizes.values())
    assert sum(bounded.linears[k] * n for k, n in sizes.items()) / total == pytest.approx(0.6)
    summary = plan_summary(classes, sizes, 0.6, bound=DEFAULT_RATIO_BOUND)
    assert summary.bound_bit and summary.eq4_max == pytest.approx(max(eq4.linears.values()))
    assert summary.clipped["high"]
    assert summary.max_ratio == pytest.approx(0.6 + DEFAULT_RATIO_BOUND)
    assert f"the bound {DEFAULT_RATIO_BOUND:g} bit" in summary.line()
    assert not plan_summary(classes, sizes, 0.6).bound_bit  # Eq. 4 alone: nothing clipped


def test_a_setting_unlike_the_study_collapses_under_eq4_alone_not_under_the_bound(embedded):
    """Held-out style, the issue's setting in small: SmolLM2, 4 sites, wiki + code (Dirichlet
    0.1), 16 draws of 4 sublayers on one window of 32 tokens each (the committed study: 8 sites,
    wiki + shakespeare + code, 32 draws). The paper's rule calls most sublayers personalized and
    (almost) none generic, and Eq. 4 alone then puts about 86% sparsity on every sublayer left,
    at every site (the collapse the issue measured); the default bound keeps every ratio within
    p +- the bound at the same mean; the relative rule splits the same draws into both
    classes."""
    from fedcompress.methods import personalize as pz

    model, tokenizer = embedded.model, embedded.tokenizer
    config = pz.PersonalizeConfig(clients=4, samples_per_client=1, seqlen=32,
                                  calib_text="wiki+code", alpha=0.1, max_iter=16, sparsity=0.6,
                                  batch_size=1)
    calib, _ = pz.site_windows(config, tokenizer)
    sites = [classify_units(model, calib[s], config.classify_config(s)) for s in range(4)]
    assert all(site.counts()["personalized"] > 30 >= 3 >= site.counts()["generic"]
               for site in sites)
    counts = pz.global_classes([site.classes for site in sites])
    units = units_of(model)
    sizes = layer_sizes(model)
    total = sum(sizes.values())
    for classes in [counts.classes, *(pz.site_view(site, counts) for site in sites)]:
        eq4 = pz.site_classes_plan(units, classes, model, 0.6, config.factors)
        assert max(eq4.linears.values()) > 0.85  # collapsed
        bounded = pz.site_classes_plan(units, classes, model, 0.6, config.factors,
                                       config.bound)
        ratios = bounded.linears.values()
        assert 0.6 - config.bound - 1e-9 <= min(ratios)
        assert max(ratios) <= 0.6 + config.bound + 1e-9
        assert math.fsum(bounded.linears[k] * n for k, n in sizes.items()) / total == (
            pytest.approx(0.6, abs=1e-9))
        info = pz.site_plan_summary(units, classes, model, 0.6, config.factors, config.bound)
        assert info["bound_bit"] and info["eq4_max"] == pytest.approx(
            max(eq4.linears.values()))
    relative = [reclassify(site.units, site.draws, site.threshold, "relative") for site in sites]
    assert all(site.counts()["generic"] > 10 and site.counts()["personalized"] > 10
               for site in relative)


def test_reclassify_paper_rule_is_alg1_and_relative_rule_uses_the_draws_quantile():
    units = {u: [f"{u}.x"] for u in ("a", "b", "c", "d", "e")}
    draws = [{"units": ["a", "b"], "loss": 3.0}, {"units": ["b", "c"], "loss": 2.5},
             {"units": ["c", "d"], "loss": 2.2}]
    paper = reclassify(units, draws, base_loss=2.0)  # every draw above the untouched loss
    assert paper.classes == {"a": "personalized", "b": "personalized", "c": "personalized",
                             "d": "personalized", "e": "others"}
    assert paper.threshold == 2.0 and paper.rule == "paper"
    relative = reclassify(units, draws, base_loss=2.0, rule="relative")  # median 2.5
    assert relative.threshold == 2.5
    assert relative.classes == {"a": "personalized", "b": "personalized", "c": "generic",
                                "d": "generic", "e": "others"}
    assert relative.to_dict()["base_loss"] == 2.0
    with pytest.raises(ValueError, match="rule='mean' is invalid"):
        reclassify(units, draws, 2.0, rule="mean")
    with pytest.raises(ValueError, match="quantile=1 is invalid"):
        ClassifyConfig(rule="relative", quantile=1)


def test_classify_units_applies_its_rule_to_the_same_draws(planted):
    model, a, _ = planted
    paper = classify_units(model, a, ClassifyConfig(k=2, max_iter=6, seed=3))
    relative = classify_units(model, a, ClassifyConfig(k=2, max_iter=6, seed=3,
                                                       rule="relative"))
    assert [d["units"] for d in paper.draws] == [d["units"] for d in relative.draws]
    assert relative.base_loss == pytest.approx(paper.threshold)
    again = reclassify(paper.units, paper.draws, paper.threshold, "relative")
    assert again.classes == relative.classes


def test_the_guard_keeps_the_better_model_and_says_why():
    from fedcompress.methods.personalize import guard_choice

    kept, why = guard_choice({"personalized": 3308.0, "fedprllm": 67.5})
    assert kept == "fedprllm" and "49.01x" in why
    assert guard_choice({"personalized": 60.0, "fedprllm": 67.5})[0] == "personalized"
    assert guard_choice({"personalized": 67.5, "fedprllm": 67.5})[0] == "personalized"


# -- federated personalization (fedcompress.methods.personalize) -----------------------------
def test_global_classes_count_sites_and_break_ties_towards_keeping_weights():
    from fedcompress.methods.personalize import global_classes

    sites = [{"0.a": "generic", "0.b": "personalized", "1.a": "others"},
             {"0.a": "generic", "0.b": "generic", "1.a": "generic"},
             {"0.a": "personalized", "0.b": "others", "1.a": "others"}]
    result = global_classes(sites)
    assert result.counts["0.a"] == {"personalized": 1, "generic": 2, "others": 0}
    # 0.b: one vote each -> personalized; 1.a: others 2 vs generic 1
    assert result.classes == {"0.a": "generic", "0.b": "personalized", "1.a": "others"}
    with pytest.raises(ValueError, match="differently"):
        global_classes([sites[0], {"0.a": "generic"}])
    with pytest.raises(ValueError, match="unknown classes"):
        global_classes([{"0.a": "maybe"}])


def test_site_masks_use_the_vote_outside_the_sites_personalized_layers(tiny_model):
    from fedcompress.masks.aggregate import global_mask
    from fedcompress.methods.fedprllm.federated import MaskAggregator, mask_key
    from fedcompress.methods.personalize import SparsityPlan, shared_masks, site_masks

    model = tiny_model("llama", 2)
    windows = [_pattern(2, [5, 6, 7]), _pattern(2, [9, 10, 11, 12])]
    plan = SparsityPlan(0.5)
    # counts=None: every layer local, exactly the local pass at the plan
    alone = site_masks(model, windows[0], plan, None, batch_size=2)
    reference = local_masks(model, windows[0], PruneConfig("wanda", 0.5, "row"), 2).masks
    assert all(torch.equal(alone[i][n], reference[i][n]) for i in range(2) for n in alone[i])
    vote = MaskAggregator(model, 2)
    for w in windows:
        vote.add({mask_key(i, n): m for i, layer in enumerate(
            local_masks(model, w, PruneConfig("wanda", 0.5, "row"), 2).masks)
            for n, m in layer.items()})
    counts = vote.counts()
    personal = {"1.mlp.up_proj"}
    shared = shared_masks(counts, plan, personal, model, "layer")
    assert mask_key(1, "mlp.up_proj") not in shared and len(shared) == 13
    mixed = site_masks(model, windows[0], plan, shared, batch_size=2)
    from fedcompress.models import ModelAdapter, weight_matrix

    layers = ModelAdapter(model).layers
    for i in range(2):
        for name, mask in mixed[i].items():
            if f"{i}.{name}" in personal:
                continue
            w = weight_matrix(ModelAdapter.linear_layers(layers[i])[name]).detach()
            assert torch.equal(mask, global_mask(counts[mask_key(i, name)], 0.5, "layer",
                                                 "magnitude", w))
    assert float(mixed[1]["mlp.up_proj"].float().mean()) == pytest.approx(0.5, abs=1 / 32)


PERSONALIZE_STUDY = """
[bench]
model = "{model}"
clients = 2
samples_per_client = 2
seqlen = 16
batch_size = 2

[study.main]
kind = "personalize"
title = "tiny, by sparsity"
calib_text = "wiki+shakespeare+code"
k = 2
max_iter = 4
sparsity = [0.5, 0.6]

[study.importance]
kind = "personalize"
calib_text = "wiki+shakespeare+code"
k = 2
max_iter = 4
sparsity = 0.6
importance = ["wanda", "magnitude"]
"""


def test_personalize_study_plan_and_errors():
    from fedcompress.bench.personalize_study import METHODS
    from fedcompress.bench.sweep import BenchConfigError, plan

    config = {"bench": {"model": "m", "clients": 2},
              "study": {"a": {"kind": "personalize", "sparsity": [0.5, 0.6], "k": 2},
                        "b": {"kind": "personalize", "sparsity": 0.6, "k": [2, 3]}}}
    a, b = plan(config)
    assert a.kind == b.kind == "personalize" and a.swept == ["sparsity"] and b.swept == ["k"]
    assert len(a.cells) == 2 and len(b.cells) == 2
    settings = dict(a.cells[1].client)
    assert (settings["model"], settings["clients"], settings["sparsity"]) == ("m", 2, 0.6)
    assert settings["methods"] == ",".join(METHODS)
    # the same point in two studies is one cell (it runs once)
    assert a.cells[1].id == b.cells[0].id
    for table, message in (({"sparsities": [0.5]}, r"study 'x' \(kind personalize\): unknown "
                            r"setting\(s\) \['sparsities'\]; expected some of .*'sparsity'"),
                           ({"methods": ["uniform"]}, r"methods \['uniform'\]: expected some of"),
                           ({"k": []}, "k is an empty list"),
                           ({"sparsity": 1.5}, "study 'x': sparsity=1.5 is invalid")):
        with pytest.raises(BenchConfigError, match=message):
            plan({"study": {"x": {"kind": "personalize", **table}}})


def test_a_failed_site_plan_counts_as_worse_and_is_said_in_words():
    from fedcompress.bench.personalize_study import _ratio, versus_fedprllm

    per = {"personalized": [10.0, math.nan, 12.0], "fedprllm": [10.0, 11.0, 10.0]}
    against = versus_fedprllm(per)
    assert against == {"sites": 3, "within": 1, "worst": math.inf}
    assert _ratio(against["worst"]) == "a site's plan failed"
    assert _ratio(1.234) == "1.23x"
    assert versus_fedprllm({"personalized": [1.0]}) is None


def test_personalize_study_runs_resumes_and_records_a_failure(tiny_dir, tmp_path, monkeypatch):
    import json

    import fedcompress.layers.personalized as pl
    from fedcompress.bench import personalize_study as ps
    from fedcompress.bench.run import run_bench
    from fedcompress.report_html import render_run

    config = tmp_path / "bench.toml"
    config.write_text(PERSONALIZE_STUDY.format(model=tiny_dir))
    compute = ps.CellRunner.compute

    def magnitude_fails(self, cell):
        if dict(cell.client)["importance"] == "magnitude":
            raise RuntimeError("magnitude broke")
        return compute(self, cell)

    monkeypatch.setattr(ps.CellRunner, "compute", magnitude_fails)
    out = tmp_path / "out"
    report = run_bench(config, out, progress=False)
    assert report.status == "incomplete" and report.extra["plan"] == {"cells": 3, "pending": 3}
    by_status = {r["importance"] + str(r["sparsity"]): r for r in report.results}
    assert by_status["magnitude0.6"]["status"] == "failed"
    assert "magnitude broke" in by_status["magnitude0.6"]["error"]
    ok = by_status["wanda0.5"]
    assert ok["status"] == "ok" and set(ok["perplexity"]) == {
        "local-only", "fedprllm", "seed004-local", "personalized", "kept"}
    assert ok["kept"] == ["fedprllm" if a > b else "personalized" for a, b in
                          zip(ok["perplexity"]["personalized"], ok["perplexity"]["fedprllm"])]
    assert ok["perplexity"]["kept"] == [min(a, b) for a, b in
                                        zip(ok["perplexity"]["personalized"],
                                            ok["perplexity"]["fedprllm"])]
    assert ok["plan"]["bound"] == 0.05 and len(ok["site_plans"]) == 2
    for name, values in ok["achieved_sparsity"].items():
        assert all(v == pytest.approx(0.5, abs=0.04) for v in values), name
    assert len(ok["dense"]) == 2 and ok["classes_key"] == by_status["wanda0.6"]["classes_key"]
    assert len(list((out / "personalize").glob("classes-*.json"))) == 1  # classified once
    md = (out / "report.md").read_text()
    assert "### tiny, by sparsity" in md and "sparsity=0.5: held-out perplexity per site" in md
    assert "magnitude broke" in md and f"unit-classes-{ok['classes_key']}.png" in md
    assert "tiny, by sparsity" in render_run(out)

    # resume: the failed cell is retried, the finished ones are not rerun, the classes are
    # read back (classifying again would fail)
    monkeypatch.setattr(ps.CellRunner, "compute", compute)
    monkeypatch.setattr(pl, "classify_units", lambda *a, **k: pytest.fail("classified again"))
    again = run_bench(config, out, progress=False)
    assert again.status == "ok" and again.extra["plan"]["pending"] == 1
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["importance"] for r in lines[3:]] == ["magnitude"]


# -- the method on Flower (in process, and on the Simulation Engine) ---------------------------
def _settings(tiny_dir, out, **extra) -> dict:
    from conftest import personalize_tiny_settings

    return personalize_tiny_settings(tiny_dir, out, **extra)


def _in_process(settings: dict) -> dict:
    from conftest import personalize_in_process

    return personalize_in_process(settings)


def test_method_in_process_equals_the_library_steps(tiny_dir, tmp_path):
    """The ClientApp and server pipeline give every site the model the library steps build: the
    same classes, plan, shared masks and personalized masks (so the same perplexity), and only
    classes and scores leave a site."""
    from fedcompress.layers.personalized import classify_units
    from fedcompress.methods import personalize as pz
    from fedcompress.methods.fedprllm.federated import MaskAggregator, mask_key
    from fedcompress.models import load_model
    from fedcompress.pruning.local import apply_masks

    report = _in_process(_settings(tiny_dir, tmp_path / "run"))
    assert report["status"] == "ok", report.get("error")
    rows = report["results"]
    assert [r["site"] for r in rows] == [0, 1, 2]
    config = pz.PersonalizeConfig(model=tiny_dir, clients=3, samples_per_client=2, seqlen=16,
                                  batch_size=2, k=2, max_iter=6, partition="iid")
    loaded = load_model(tiny_dir, device="cpu")
    model = loaded.model
    calib, held = pz.site_windows(config, loaded.tokenizer)
    sites = [classify_units(model, calib[s], config.classify_config(s)) for s in range(3)]
    assert report["classes"]["sites"] == {str(100 + s): sites[s].classes for s in range(3)}
    counts = pz.global_classes([c.classes for c in sites])
    units = sites[0].units
    plan = pz.site_classes_plan(units, counts.classes, model, 0.5, config.factors,
                                config.bound)
    assert {k: v for k, v in report["global_plan"].items() if k != "summary"} == plan.to_dict()
    assert report["global_plan"]["summary"]["bound"] == config.bound == 0.05
    voted = MaskAggregator(model, 3)
    for s in range(3):
        masks = local_masks(model, calib[s], PruneConfig("wanda", 0.5, "row",
                                                         layer_sparsity=plan.to_text()), 2)
        voted.add({mask_key(i, n): m for i, layer in enumerate(masks.masks)
                   for n, m in layer.items()})
    for s in range(3):
        mine = pz.site_classes_plan(units, pz.site_view(sites[s], counts), model, 0.5,
                                    config.factors, config.bound)
        shared = pz.shared_masks(voted.counts(), mine, pz.personal_linears(sites[s]), model)
        masks = pz.site_masks(model, calib[s], mine, shared, batch_size=2)
        ppl = pz.windows_perplexity(apply_masks(copy.deepcopy(model), masks), held[s], 2)
        assert rows[s]["personalized"] == pytest.approx(ppl, rel=1e-6)
        assert rows[s]["sparsity_personalized"] == pytest.approx(0.5, abs=0.04)
        assert {"fedprllm", "local-only", "dense"} <= set(rows[s])
        kept = "fedprllm" if rows[s]["personalized"] > rows[s]["fedprllm"] else "personalized"
        assert rows[s]["kept_model"] == kept and rows[s]["kept"] == rows[s][kept]
        assert str(rows[s]["guard"]).startswith(f"kept {kept}:")
        assert rows[s]["plan_max_ratio"] <= 0.6 + 1e-9
        own = local_masks(model, calib[s], PruneConfig("wanda", 0.5, "row"), 2).masks
        assert rows[s]["local-only"] == pytest.approx(pz.windows_perplexity(
            apply_masks(copy.deepcopy(model), own), held[s], 2), rel=1e-6)
    assert report["rejected"] == []


def test_only_the_asked_baselines_are_computed(tiny_dir, tmp_path, monkeypatch):
    """Without the fedprllm and local-only baselines a site makes one pass at the global plan
    (no masks at the uniform ratio) and reports only what was asked."""
    import clients.personalize as cp

    passes = []
    original = cp.local_masks

    def counting(model, windows, config, **kwargs):
        passes.append(config.layer_sparsity != "")
        return original(model, windows, config, **kwargs)

    monkeypatch.setattr(cp, "local_masks", counting)
    report = _in_process(_settings(tiny_dir, tmp_path / "run", baselines="dense",
                                   guard="off"))
    assert report["status"] == "ok"
    assert passes == [True] * 3  # one pass per site, at the global plan
    for row in report["results"]:
        assert "dense" in row and "fedprllm" not in row and "kept" not in row
        assert "local-only" not in row
    # the guard needs uniform FedPrLLM: the sites make its masks even when no baseline asks
    passes.clear()
    report = _in_process(_settings(tiny_dir, tmp_path / "guarded", baselines="dense"))
    assert report["status"] == "ok"
    assert sorted(passes) == [False] * 3 + [True] * 3
    for row in report["results"]:
        assert {"fedprllm", "kept", "kept_model"} <= set(row) and "local-only" not in row
    assert report["guard"]["sites"] == 3


def test_a_site_sending_bad_classes_is_left_out(tiny_dir, tmp_path, monkeypatch):
    import numpy as np
    from flwr.app import Array, ArrayRecord

    import clients.personalize as cp

    original = cp.classify

    def liar(message, context):
        reply = original(message, context)
        if int(context.node_config["partition-id"]) == 1:
            reply.content["classes"] = ArrayRecord({"classes": Array(np.array([7], np.uint8))})
        return reply

    monkeypatch.setattr(cp, "classify", liar)
    report = _in_process(_settings(tiny_dir, tmp_path / "run", min_clients=2,
                                   baselines="fedprllm"))
    assert report["status"] == "ok"
    assert [r["site"] for r in report["results"]] == [0, 2]
    assert "class codes of shape (1,)" in report["rejected"][0]["reason"]


def test_flower_simulation_runs_the_method(tiny_dir, tmp_path):
    import json

    from server.simulation import simulate_method

    out = tmp_path / "sim"
    simulate_method("personalize", _settings(tiny_dir, out, clients=2))
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok" and len(report["results"]) == 2
    from conftest import same_personalize_result

    same_personalize_result(report, _in_process(_settings(tiny_dir, tmp_path / "ref",
                                                           clients=2)))
    assert (out / "unit-classes.png").exists()


# -- importance (Table V), unpruned personalized units (Table VI), adaptation (Alg. 1 line 2) --
def test_taylor_scores_are_weight_times_gradient():
    from fedcompress.pruning.scores import taylor_scores

    w = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    g = torch.tensor([[-4.0, 1.0], [2.0, 0.0]])
    assert torch.equal(taylor_scores(w, g), torch.tensor([[4.0, 2.0], [1.0, 0.0]]))
    with pytest.raises(ValueError, match=r"gradient of shape \(2,\) for a weight"):
        taylor_scores(w, torch.zeros(2))


def test_weight_gradients_equal_autograd_of_the_mean_token_loss(tiny_model):
    from fedcompress.models import ModelAdapter
    from fedcompress.pruning.local import weight_gradients

    model = tiny_model("llama", 2)
    windows = torch.cat([_pattern(3, [5, 6, 7]), _pattern(2, [9, 10, 11, 12])])
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    grads = weight_gradients(model, windows, batch_size=2)  # 3 batches, summed
    reference = copy.deepcopy(model)
    reference.zero_grad()
    reference(input_ids=windows, labels=windows).loss.backward()
    layers = ModelAdapter(reference).layers
    for i, layer in enumerate(grads):
        assert set(layer) == set(ModelAdapter.linear_layers(layers[i]))
        for name, g in layer.items():
            expected = ModelAdapter.linear_layers(layers[i])[name].weight.grad
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-6)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())


def test_gradient_masks_follow_the_plan_and_differ_from_wanda(tiny_model):
    model = tiny_model("llama", 3)
    windows = _pattern(4, [5, 6, 7, 8])
    plan = "0.3,0.5,0.7"
    grad = local_masks(model, windows, PruneConfig("gradient", 0.5, "row", layer_sparsity=plan),
                       batch_size=2).masks
    wanda = local_masks(model, windows, PruneConfig("wanda", 0.5, "row", layer_sparsity=plan),
                        batch_size=2).masks
    for i, ratio in enumerate((0.3, 0.5, 0.7)):
        for mask in grad[i].values():
            assert float(mask.float().mean()) == pytest.approx(ratio, abs=1 / mask.shape[1])
    assert any(not torch.equal(grad[i][n], wanda[i][n]) for i in range(3) for n in grad[i])


def test_gradient_method_is_refused_where_it_cannot_run():
    from fedcompress.config import SettingsError
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig
    from fedcompress.pruning.local import layer_prune_fn

    with pytest.raises(SettingsError, match="method='gradient' is invalid.*iterative mode"):
        FedPrLLMConfig(method="gradient", mode="iterative")
    with pytest.raises(SettingsError, match="wire_reference='wiki' is invalid"):
        FedPrLLMConfig(method="gradient", wire="compressed")
    FedPrLLMConfig(method="gradient", wire="compressed", wire_reference="none")
    with pytest.raises(ValueError, match="expected the gradients"):
        layer_prune_fn(PruneConfig("gradient", 0.5))


@pytest.mark.parametrize("importance", ["magnitude", "gradient"])
def test_site_masks_take_the_importance_of_the_local_pass(tiny_model, importance):
    from fedcompress.methods.personalize import SparsityPlan, site_masks

    model = tiny_model("llama", 2)
    windows = _pattern(2, [5, 6, 7])
    alone = site_masks(model, windows, SparsityPlan(0.5), None, batch_size=2,
                       importance=importance)
    reference = local_masks(model, windows, PruneConfig(importance, 0.5, "row"), 2).masks
    assert all(torch.equal(alone[i][n], reference[i][n]) for i in range(2) for n in alone[i])
    with pytest.raises(ValueError, match="importance='sparsegpt' is invalid"):
        site_masks(model, windows, SparsityPlan(0.5), None, importance="sparsegpt")


def test_unpruned_personalized_units_keep_every_weight_and_the_global_ratio(tiny_model):
    """Table VI: personalized factor 0 leaves the personalized units dense; the others carry
    the whole sparsity p."""
    from fedcompress.methods.personalize import site_classes_plan, site_masks
    from fedcompress.pruning.local import check_global_ratio

    model = tiny_model("llama", 2)
    units = units_of(model)
    classes = {u: "personalized" if u == "1.mlp" else "generic" for u in units}
    plan = site_classes_plan(units, classes, model, 0.5,
                             {"generic": 1.0, "personalized": 0.0, "others": 0.75})
    check_global_ratio(plan, model)
    masks = site_masks(model, _pattern(2, [5, 6, 7]), plan, None, batch_size=2)
    for name, mask in masks[1].items():
        if name.startswith("mlp."):
            assert not mask.any(), name
        else:
            assert float(mask.float().mean()) > 0.5


def test_adaptation_runs_on_a_copy_and_is_recorded(planted):
    model, _, b = planted
    before = copy.deepcopy(model.state_dict())
    config = ClassifyConfig(k=1, max_iter=3, seed=0, batch_size=2, adapt_steps=6,
                            adapt_lr=1e-2)
    first = classify_units(model, b, config)
    assert len(first.adapt_losses) == 6 and first.to_dict()["adapt_losses"]
    assert first.threshold < mean_lm_loss(model, b, 2) - 0.1  # the adapted copy fits B better
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    again = classify_units(model, b, config)
    assert again.to_dict() == first.to_dict()  # seeded


@pytest.mark.parametrize("bad", [{"adapt_steps": -1}, {"adapt_steps": 1.5}, {"adapt_lr": 0},
                                 {"adapt_lr": float("nan")}])
def test_bad_adaptation_settings_are_named(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"{name}=.* is invalid"):
        ClassifyConfig(**bad)


def test_settings_are_composed_of_pieces():
    """Four pieces (the federation, Alg. 1, Eq. 4's plan, the masks and vote) with the 27 flat
    settings in piece order; the plan's bound check runs alone and in the composition."""
    from fedcompress.layers.settings import PersonalizedPlanSettings, UnitClassSettings
    from fedcompress.methods import personalize as pz

    pieces = (pz.PersonalizeFederationSettings, UnitClassSettings, PersonalizedPlanSettings,
              pz.PersonalizeMaskSettings)
    assert pz.PersonalizeConfig.pieces() == pieces
    assert pz.PersonalizeConfig.names() == [n for p in pieces for n in p.names()]
    assert len(pz.PersonalizeConfig.names()) == 27 and max(len(p.names()) for p in pieces) <= 20
    config = pz.PersonalizeConfig(sparsity=0.6, ratio_bound=1.0, k=2, clients=3, min_clients=2)
    plan = config.piece(PersonalizedPlanSettings)
    assert plan.bound is config.bound is None and plan.factors == config.factors
    assert config.piece(UnitClassSettings) == UnitClassSettings(k=2)
    assert config.classify_config(1).k == 2 and config.required_clients == 2
    for make in (PersonalizedPlanSettings, pz.PersonalizeConfig):
        with pytest.raises(ValueError, match="ratio_bound=0.05 is invalid: expected below 1 - "
                                             "sparsity = 0.04"):
            make(sparsity=0.96)
    for make in (pz.PersonalizeFederationSettings, pz.PersonalizeConfig):
        with pytest.raises(ValueError, match="min_clients=9 is invalid"):
            make(min_clients=9)
