"""The membership attackers on a real DP statistics-mode release of a tiny model
(:mod:`fedcompress.bench.dp_leakage`), written as attacks: without DP the knows-the-rest
attacker on the sum always finds the member; at a small epsilon it is near chance; the bench
kind ``dp-leakage`` plans one cell per epsilon and reports every attack beside its ceilings;
bad settings are refused with a clear error."""

from __future__ import annotations

import pytest

from fedcompress.bench.dp_leakage import ATTACKS, DpLeakageConfig, measure
from fedcompress.config import SettingsError


def config(tiny_dir, corpus, **kw) -> DpLeakageConfig:
    base = dict(model=tiny_dir, calib_text=corpus, seqlen=16, sites=3, samples_per_client=2,
                replacements=2, nonmembers=3, layers=2, trials=2, public_windows=8,
                batch_size=2)
    base.update(kw)
    return DpLeakageConfig(**base)


@pytest.fixture(scope="module")
def no_dp(tiny_dir, corpus):
    return measure(config(tiny_dir, corpus, epsilon=0.0), "cpu")


def test_without_dp_the_knows_rest_attacker_always_finds_the_member(no_dp):
    a = no_dp["attacks"]
    for key in ("knows_rest_sum", "knows_rest_mask"):
        assert a[key]["auc_within"] == 1.0 and a[key]["top1"] == 1.0, key
        assert a[key]["neighbour_auc"] == 1.0, key
    assert a["knows_rest_sum"]["chance_top1"] == pytest.approx(1 / 3)
    # the noise-free sum: the member's score is the maximum of its candidates
    for scores in no_dp["scores"]["knows_rest_sum"]:
        assert scores[0] == max(scores) and all(s < scores[0] for s in scores[1:])
    assert no_dp["ceilings"]["gdp_auc"] == 1.0 and no_dp["scope"]["sigma"] is None
    assert len(no_dp["trials"]) == 2
    # a fresh draw of windows per trial (the neighbour AUC needs exchangeable candidates)
    assert no_dp["trials"][0]["plan"] != no_dp["trials"][1]["plan"]


def test_at_a_small_epsilon_the_attacks_are_near_chance(tiny_dir, corpus):
    """epsilon 0.5 over the 2 layer releases (GDP ceiling AUC about 0.53), 6 releases of 3
    sites: the knows-the-rest attacker's AUCs within 0.3 of chance and the member not always
    on top. The member's hypothesis is the same for every site of a release (rest + target is
    the release's data), so the sample is about one member score per release: hence the
    tolerance. (The reference attacker scores one group per release: too few to test.)"""
    r = measure(config(tiny_dir, corpus, epsilon=0.5, trials=6), "cpu")
    c = r["ceilings"]
    assert c["gdp_mu"] == pytest.approx(2 ** 0.5 / r["scope"]["sigma"])
    assert 0.5 < c["gdp_auc"] < 0.56 and c["gdp_auc"] < c["dp_auc"]
    assert r["scope"]["mechanism"] == "gaussian" and r["scope"]["releases"] == 2
    for key in ("knows_rest_sum", "knows_rest_mask"):
        m = r["attacks"][key]
        assert abs(m["auc_within"] - 0.5) <= 0.3, (key, m)
        assert abs(m["neighbour_auc"] - 0.5) <= 0.3, (key, m)
    assert r["attacks"]["knows_rest_sum"]["top1"] < 1.0
    # the real windows are far inside the worst case the accountant pays for
    assert r["pair_mu"]["mean"] < c["gdp_mu"]


def test_sparsegpt_without_dp_the_member_is_found_from_the_hessians(tiny_dir, corpus):
    r = measure(config(tiny_dir, corpus, method="sparsegpt", epsilon=0.0, trials=1), "cpu")
    m = r["attacks"]["knows_rest_sum"]
    assert m["auc_within"] == 1.0 and m["top1"] == 1.0


def test_distributed_placement_has_no_gdp_ceiling(tiny_dir, corpus):
    r = measure(config(tiny_dir, corpus, epsilon=1.0, placement="distributed", trials=1,
                       mask_view=False), "cpu")
    assert r["scope"]["mechanism"] == "skellam"
    assert sorted(r["attacks"]) == ["knows_rest_sum", "reference_sum"]  # no mask view
    assert r["ceilings"]["gdp_auc"] is None and 0.5 < r["ceilings"]["dp_auc"] < 1


def test_the_bench_kind_plans_a_cell_per_epsilon_and_tables_every_attack(tiny_dir, corpus,
                                                                         no_dp):
    from fedcompress.bench.studies import KINDS
    from fedcompress.bench.sweep import BenchConfigError, plan

    bench = {"bench": {"model": tiny_dir, "seqlen": 16, "batch_size": 2},
             "study": {"dpl": {"kind": "dp-leakage", "calib_text": corpus, "sites": 3,
                               "samples_per_client": 2, "nonmembers": 3, "trials": 2,
                               "public_windows": 8, "epsilon": [1, 0.0],
                               "method": ["wanda", "sparsegpt"]}}}
    (study,) = plan(bench)
    assert study.kind == "dp-leakage" and sorted(study.swept) == ["epsilon", "method"]
    assert len(study.cells) == 4 and all(c.kind == "dp-leakage" for c in study.cells)
    kind = KINDS["dp-leakage"]
    cell = next(c for c in study.cells if dict(c.client)["epsilon"] == 0.0
                and dict(c.client)["method"] == "wanda")
    assert kind.record_cell(dict(cell.client)).id == cell.id
    (table,) = kind.tables(study, {cell.id: {"status": "ok", "dp_leakage": no_dp}})
    rows = [row for row in table.body if row[2] == "none" and row[0] == "wanda"]
    assert [(row[3], row[4]) for row in rows] == list(ATTACKS.values())
    assert rows[0][5] == "1.000 ± 0.000" and rows[0][8] == "1.000 (0.333)"
    assert no_dp["attacks"]["knows_rest_sum"]["releases"] == 2
    assert sum(row[3] == "pending" for row in table.body) == 3
    bad = {**bench, "study": {"dpl": {"kind": "dp-leakage", "eps": 1}}}
    with pytest.raises(BenchConfigError, match="unknown setting"):
        plan(bad)


@pytest.mark.parametrize("kw,match", [
    ({"method": "magnitude"}, "method='magnitude'"),
    ({"placement": "distributed", "epsilon": 0.0}, "placement='distributed'"),
    ({"epsilon": -1.0}, "epsilon=-1.0"),
    ({"delta": 0.0}, "delta=0.0"),
    ({"sites": 1}, "sites=1"),
    ({"samples_per_client": 1}, "samples_per_client=1"),
    ({"layers": 0}, "layers=0"),
    ({"trials": 0}, "trials=0"),
])
def test_bad_settings_are_refused(tiny_dir, corpus, kw, match):
    with pytest.raises(SettingsError, match=match):
        config(tiny_dir, corpus, **kw)


def test_impossible_runs_are_refused(tiny_dir, corpus):
    with pytest.raises(ValueError, match="layers=5: the model has 3 decoder layers"):
        measure(config(tiny_dir, corpus, layers=5), "cpu")
    with pytest.raises(ValueError, match="the plan needs"):
        measure(config(tiny_dir, corpus, sites=40, samples_per_client=8), "cpu")


@pytest.mark.parametrize("hessian", [False, True])
def test_the_attackers_per_window_clipping_sums_to_the_sites_clipped_sum(tiny_dir, hessian):
    """What the attacker computes per window is what a site clips: summed over a site's
    windows it is :func:`~fedcompress.privacy.dp_stats.clipped_layer_stats` (tight bounds,
    so that most windows are clipped)."""
    import torch

    from fedcompress.bench.dp_leakage import window_blocks
    from fedcompress.models import ModelAdapter, load_model
    from fedcompress.privacy import dp_stats as dps
    from fedcompress.pruning.walker import capture_layer_inputs

    model = load_model(tiny_dir, device="cpu").model
    windows = torch.randint(3, 120, (5, 16), generator=torch.Generator().manual_seed(0))
    inputs = capture_layer_inputs(model, windows, 2)
    with ModelAdapter(model).onloaded(0) as layer:
        owners = dps.layer_blocks(layer, inputs)
        norms = {}
        for _s, sq, hs in dps.window_sums(layer, inputs, hessian, 2):
            for k, v in dps._block_norms(sq, hs, hessian).items():
                norms.setdefault(k, []).append(v)
        bounds = {k: float(torch.cat(v).median()) for k, v in norms.items()}
        site = dps.clipped_layer_stats(layer, inputs, hessian, bounds, 2)
        per = dict(window_blocks(layer, inputs, hessian, bounds, 2))
    assert sorted(per) == list(range(5)) and sum(site.clipped.values()) > 0
    for owner in set(owners.values()):
        total = sum(per[w][owner] for w in per)
        st = site.stats[owner]
        if hessian:
            n = st.in_features
            rows, cols = torch.triu_indices(n, n)
            expected = st.hessian_sum[rows, cols]
        else:
            expected = st.sq_sum
        assert torch.allclose(total, expected.double(), rtol=1e-12, atol=0), owner
        norms_w = [float(per[w][owner].norm()) for w in per]
        if not hessian:  # each clipped window is within its bound
            assert max(norms_w) <= bounds[owner] * (1 + 1e-9)


def test_a_dp_leakage_bench_runs_resumes_and_reports(tiny_dir, corpus, tmp_path, monkeypatch):
    """``fedcompress bench`` with a dp-leakage study: one stored cell per epsilon, the table in
    report.md, and a rerun that measures nothing again."""
    import json

    import tomli_w

    from fedcompress.bench.run import run_bench

    config = {"bench": {"model": tiny_dir, "seqlen": 16, "batch_size": 2, "seed": 0},
              "study": {"dpl": {"kind": "dp-leakage", "title": "DP leakage, tiny",
                                "calib_text": corpus, "sites": 3, "samples_per_client": 2,
                                "nonmembers": 3, "trials": 1, "public_windows": 8,
                                "epsilon": [0.0, 2.0]}}}
    path = tmp_path / "bench.toml"
    path.write_text(tomli_w.dumps(config))
    out = tmp_path / "out"
    run_bench(str(path), out, progress=False)
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["dp-leakage"] * 2
    assert all(r["status"] == "ok" for r in records), records
    no_dp = next(r for r in records if r["epsilon"] == 0.0)
    assert no_dp["auc_knows_rest_sum"] == 1.0 and no_dp["gdp_auc_ceiling"] == 1.0
    md = (out / "report.md").read_text()
    assert "Membership attacks on the DP release" in md and "knows-the-rest" in md

    import fedcompress.bench.dp_leakage as experiment

    def boom(*args, **kwargs):
        raise AssertionError("recomputed")

    monkeypatch.setattr(experiment, "measure", boom)
    run_bench(str(path), out, progress=False)
    assert len((out / "results.jsonl").read_text().splitlines()) == 2
