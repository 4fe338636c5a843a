"""`fedcompress bench`: plan expansion, a tiny sweep end to end, resume, failed cells, tables."""

from __future__ import annotations

import json

import pytest
from conftest import run_bench  # fedcompress bench: FedPrLLM cells through the strategies

from fedcompress.bench.sweep import BenchConfigError, load_results, plan
from fedcompress.bench.tables import study_table


def _config(tiny_dir, **study):
    bench = {"model": tiny_dir, "seqlen": 16, "batch_size": 2, "eval_seqlen": 16,
             "eval_windows": 2, "clients": 2, "samples_per_client": 1}
    main = {"sparsity": [0.3, 0.5], "group": ["layer", "row"], "scale": False,
            "baselines": ["dense", "centralized", "local-only"], **study}
    return {"bench": bench, "study": {"main": main}}


def _write(tmp_path, config) -> str:
    import tomli_w

    path = tmp_path / "bench.toml"
    path.write_text(tomli_w.dumps(config))
    return str(path)


def test_another_bench_in_the_same_folder_is_refused(tiny_dir, tmp_path):
    out = tmp_path / "out"
    run_bench(_write(tmp_path, _config(tiny_dir)), out, progress=False, dry_run=True)
    run_bench(_write(tmp_path, _config(tiny_dir)), out, progress=False, dry_run=True)  # same
    other = _config(tiny_dir)
    other["study"] = {"iterative": other["study"]["main"]}
    with pytest.raises(BenchConfigError, match=r"studies \['main'\].*\['iterative'\]"):
        run_bench(_write(tmp_path, other), out, progress=False, dry_run=True)


def test_plan_expands_sweeps_and_shares_cells(tiny_dir):
    config = _config(tiny_dir)
    config["study"]["groups"] = {"sparsity": 0.5, "group": ["layer", "row", "column"],
                                 "baselines": ["dense"]}
    studies = plan(config)
    main, groups = studies
    kinds = [c.kind for c in main.cells]
    # 2 sparsities x 2 groups federated cells, one dense, centralized and local-only per sparsity
    assert kinds.count("fedprllm") == 4 and kinds.count("dense") == 1
    assert kinds.count("centralized") == 2 and kinds.count("local-only") == 2
    assert main.columns == "sparsity" and groups.columns == "group"
    shared = {c.id for c in main.cells} & {c.id for c in groups.cells}
    assert len(shared) == 3  # dense, and sparsity 0.5 x layer/row
    # one-shot masks are shared by the server variants of one client setting
    fed = [c for c in main.cells if c.kind == "fedprllm"]
    assert len({c.client_id for c in fed}) == 2


def test_plan_total_windows_and_errors(tiny_dir):
    config = _config(tiny_dir, clients=[1, 2], total_windows=2, sparsity=0.5)
    fed = [c for c in plan(config)[0].cells if c.kind == "fedprllm"]
    assert sorted((c.config().clients, c.config().samples_per_client) for c in fed) == [
        (1, 2), (1, 2), (2, 1), (2, 1)]
    with pytest.raises(BenchConfigError, match="not a multiple"):
        plan(_config(tiny_dir, clients=[3], total_windows=2))
    with pytest.raises(BenchConfigError, match="unknown setting"):
        plan(_config(tiny_dir, sparsty=0.5))
    with pytest.raises(BenchConfigError, match="baseline"):
        plan(_config(tiny_dir, baselines=["oracle"]))
    with pytest.raises(BenchConfigError, match="sparsity"):
        plan(_config(tiny_dir, sparsity=[1.5]))
    with pytest.raises(BenchConfigError, match="no \\[study"):
        plan({"bench": {}})


def test_bench_runs_resumes_and_records_failures(tiny_dir, tmp_path, monkeypatch):
    config = _config(tiny_dir)
    config["study"]["broken"] = {"sparsity": 0.5, "calib_text": "no-such-corpus",
                                 "group": "layer"}
    out = tmp_path / "out"
    report = run_bench(_write(tmp_path, config), out, progress=False)
    assert report.status == "incomplete"  # the broken study's cell failed, the rest ran
    data = json.loads((out / "report.json").read_text())
    ok = [r for r in data["results"] if r["status"] == "ok"]
    failed = [r for r in data["results"] if r["status"] != "ok"]
    assert len(ok) == 9 and len(failed) == 1 and "no-such-corpus" in failed[0]["error"]
    fed = [r for r in ok if r["kind"] == "fedprllm"]
    assert all(abs(r["sparsity_measured"] - r["sparsity"]) < 0.02 for r in fed)
    assert all(r["bytes_up_per_client"] > 0 and r["count_seconds"] >= 0 for r in fed)
    md = (out / "report.md").read_text()
    assert "FedPrLLM one-shot, server row" in md and "sparsity=0.3" in md
    assert "Failed cells" in md and (out / "ppl-main.png").exists()
    assert (out / "vote-histogram.png").exists() and (out / "layer-agreement.png").exists()
    assert data["mask_stats"] and all(s["clients"] == 2 for s in data["mask_stats"].values())
    # every cell says where it was made: this source's commit and this CPU
    from fedcompress.report import machine, versions

    where = {"commit": versions().get("git_commit", "unknown"),
             "cpu_model": machine()["cpu_model"]}
    assert all(r["made_at"]["commit"] == where["commit"] for r in data["results"])
    assert all(r["made_at"]["cpu_model"] == where["cpu_model"] for r in data["results"])
    (group,) = data["provenance"]
    assert len(group["cells"]) == 10 and group["commit"] == where["commit"]
    assert "## Where the cells were made" in md and "more than one commit" not in md

    # Resume: finished cells and cached client masks are reused, the failed cell is retried.
    import fedcompress.pruning.local as local

    def boom(*args, **kwargs):
        raise AssertionError("client masks recomputed")

    monkeypatch.setattr(local, "local_masks", boom)
    monkeypatch.setattr("fedcompress.methods.fedprllm.experiment.local_masks", boom)
    monkeypatch.setattr("clients.fedprllm.local_masks", boom)  # the sites' kept replies
    # ... resumed at another commit on another CPU: the report keeps both apart
    elsewhere = {"commit": "0123abc", "cpu_model": "Other CPU", "cpu_capability": "AVX2",
                 "torch_threads": 1}
    monkeypatch.setattr("fedcompress.bench.sweep.made_at", lambda: elsewhere)
    before = (out / "results.jsonl").read_text().splitlines()
    again = run_bench(_write(tmp_path, config), out, progress=False)
    after = (out / "results.jsonl").read_text().splitlines()
    assert len(after) == len(before) + 1  # only the failed cell ran again
    assert again.status == "incomplete"
    data = json.loads((out / "report.json").read_text())
    first, second = data["provenance"]
    assert len(first["cells"]) == 9 and first["commit"] == where["commit"]
    assert second == {**elsewhere, "cells": [failed[0]["id"]]}
    md = (out / "report.md").read_text()
    assert "| 0123abc | Other CPU | AVX2 | 1 | 1 |" in md and "more than one commit" in md


def test_provenance_groups_records_and_names_the_unrecorded():
    from fedcompress.bench.sweep import MADE_AT_KEYS, provenance

    a = {"commit": "aaa", "cpu_model": "X", "cpu_capability": "AVX512", "torch_threads": 2}
    records = [{"id": "c1", "made_at": a}, {"id": "c2"}, {"id": "c3", "made_at": a}]
    assert provenance(records) == [{**a, "cells": ["c1", "c3"]},
                                   {**dict.fromkeys(MADE_AT_KEYS), "cells": ["c2"]}]
    assert provenance([]) == []


def test_table_from_stored_results(tiny_dir):
    (study,) = plan(_config(tiny_dir, baselines=["centralized"]))
    results = {}
    for i, cell in enumerate(study.cells):
        results[cell.id] = {"status": "ok", "perplexity": 10.0 + i}
    failed = next(c for c in study.cells if c.kind == "fedprllm")
    results[failed.id] = {"status": "failed"}
    header, rows = study_table(study, results)
    assert header == ["strategy", "sparsity=0.3", "sparsity=0.5"]
    labels = [r[0] for r in rows]
    assert labels == ["Centralized", "FedPrLLM one-shot, server layer",
                      "FedPrLLM one-shot, server row"]
    assert rows[1][1] == "failed" and rows[0][1] == "11.00" and rows[2][2] == "15.00"


def test_table_with_a_server_setting_as_columns(tiny_dir):
    config = _config(tiny_dir, sparsity=0.5, local_group=["row", "column"], columns="group",
                     baselines=[])
    (study,) = plan(config)
    results = {cell.id: {"status": "ok", "perplexity": 1.0} for cell in study.cells}
    header, rows = study_table(study, results)
    assert header == ["local_group", "strategy", "group=layer", "group=row"]
    assert rows == [["row", "FedPrLLM one-shot", "1.00", "1.00"],
                    ["column", "FedPrLLM one-shot", "1.00", "1.00"]]


def test_kept_site_replies_serve_a_later_vote_and_an_older_cache(tiny_dir, tmp_path,
                                                                 monkeypatch):
    """The honest sites' one-shot replies (masks, OWL's outlier ratios) are kept under
    ``[bench] cache``: another bench of the same client settings (another server variant)
    asks no site for them; a cache of the bench's former mask pass (its masks and a
    ``meta.json``) serves too."""
    import numpy as np

    config = _config(tiny_dir, sparsity=0.6, group="layer", baselines=[],
                     sparsity_profile="owl", owl_m=2.0, owl_lambda=0.1)
    config["bench"]["cache"] = str(tmp_path / "cache")
    assert run_bench(_write(tmp_path, config), tmp_path / "a", progress=False).status == "ok"
    (folder,) = (tmp_path / "cache").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == [
        "client-0000.json", "client-0000.npz", "client-0001.json", "client-0001.npz",
        "outliers-0000.npy", "outliers-0001.npy"]
    first = json.loads((tmp_path / "a" / "results.jsonl").read_text())
    # the former cache's layout: the masks, the sites' seconds and ratios in meta.json
    ratios = [np.load(folder / f"outliers-{i:04d}.npy").tolist() for i in range(2)]
    for path in [*folder.glob("*.json"), *folder.glob("outliers-*")]:
        path.unlink()
    (folder / "meta.json").write_text(json.dumps({"clients": 2, "client_seconds": [1.5, 2.5],
                                                  "sites_outlier_ratios": ratios}))

    def boom(*args, **kwargs):
        raise AssertionError("a site computed what the cache keeps")

    monkeypatch.setattr("clients.fedprllm.local_masks", boom)
    monkeypatch.setattr("clients.fedprllm.outlier_ratios", boom)
    config["study"]["main"]["group"] = "row"
    assert run_bench(_write(tmp_path, config), tmp_path / "b", progress=False).status == "ok"
    second = json.loads((tmp_path / "b" / "results.jsonl").read_text())
    assert second["client_seconds_mean"] == 2.0 and second["group"] == "row"
    assert second["sparsity_per_layer"] == pytest.approx(first["sparsity_per_layer"], abs=0.04)
    assert len(set(first["sparsity_per_layer"])) > 1  # the OWL plan, from the kept ratios


def test_records_from_before_a_setting_existed_keep_their_cells(tiny_dir, tmp_path):
    """A stored record without a later-added setting (wire, wire_reference) is the cell at the
    value it was made with: a rerun finds it instead of recomputing it."""
    from fedcompress.bench.sweep import ADDED_LATER, SERVER_ADDED_LATER, load_results, record_cell

    (study,) = plan(_config(tiny_dir))[:1]
    path = tmp_path / "results.jsonl"
    with path.open("w") as fh:
        for cell in study.cells:
            record = {"id": cell.id, "kind": cell.kind, **cell.settings(),
                      "eval": dict(cell.evals), "status": "ok"}
            assert record_cell(record).id == cell.id  # today's records map to themselves
            old = {k: v for k, v in record.items()
                   if k not in ADDED_LATER and k not in SERVER_ADDED_LATER}
            old["id"] = "made-before-wire"
            fh.write(json.dumps(old) + "\n")
    found = load_results(path)
    assert set(found) == {c.id for c in study.cells}
    assert all(r["id"] in found for r in found.values())


def test_bench_sweeps_the_sparsity_profile(tiny_dir, tmp_path):
    """sparsity_profile is a sweep axis: the owl cells prune each layer at the plan the sites'
    outlier ratios decide (stored with the cached masks, reused on resume), the overall
    sparsity stays the target; the centralized baseline allocates from the union (centralized
    OWL); the uniform cells are untouched."""
    from fedcompress.methods.fedprllm.experiment import EvalConfig, prepare_experiment
    from fedcompress.methods.fedprllm.federated import FedPrLLMConfig, with_site_plan

    config = _config(tiny_dir, sparsity=0.6, group="layer", sparsity_profile=["uniform", "owl"],
                     owl_m=2.0, owl_lambda=0.1, baselines=["centralized"])
    out = tmp_path / "out"
    report = run_bench(_write(tmp_path, config), out, progress=False)
    assert report.status == "ok"
    rows = {(r["kind"], r["sparsity_profile"]): r
            for r in json.loads((out / "report.json").read_text())["results"]}
    settings = FedPrLLMConfig(model=tiny_dir, seqlen=16, batch_size=2, clients=2,
                              samples_per_client=1, sparsity=0.6, owl_m=2.0, owl_lambda=0.1,
                              sparsity_profile="owl")
    exp = prepare_experiment(settings, EvalConfig(eval_seqlen=16, eval_windows=2))
    planned, sites = with_site_plan(settings, exp.model, exp.windows)
    assert len(sites) == 2
    layers = list(planned.prune.plan.layers)
    assert len(set(layers)) > 1
    owl, uniform = rows[("fedprllm", "owl")], rows[("fedprllm", "uniform")]
    assert owl["sparsity_per_layer"] == pytest.approx(layers, abs=0.02)
    assert owl["sparsity_measured"] == pytest.approx(0.6, abs=0.01)
    assert uniform["sparsity_per_layer"] == pytest.approx([0.6] * 3, abs=0.01)
    central = rows[("centralized", "owl")]
    assert central["sparsity_per_layer"] != pytest.approx([0.6] * 3, abs=0.01)
    # rows of the tiny model hold 32-64 weights: flooring k per row costs up to 1/32 a layer
    assert central["sparsity_measured"] == pytest.approx(0.6, abs=0.03)


def test_bench_sweeps_attackers_and_defences(tiny_dir, tmp_path):
    """Attackers replace their honest (cached) masks after the cache; the defence is a server
    variant of the same masks; a keep-everything attacker is refused by the payload check."""
    config = _config(tiny_dir, sparsity=0.5, group="layer", baselines=["centralized"],
                     clients=6, attack=["none", "inverted"],
                     defence=["none", "hamming"])
    config["study"]["main"]["attackers"] = 1
    config["study"]["main"]["attack"] = ["inverted", "keep"]
    config["study"]["honest"] = {"sparsity": 0.5, "group": "layer", "clients": 6,
                                 "defence": ["none", "hamming"]}
    out = tmp_path / "out"
    report = run_bench(_write(tmp_path, config), out, progress=False)
    assert report.status == "ok"
    rows = json.loads((out / "report.json").read_text())["results"]
    fed = {(r["attack"], r["defence"]): r for r in rows if r["kind"] == "fedprllm"}
    inverted = fed[("inverted", "hamming")]
    assert inverted["defence_outcome"]["rejected"] == [0]
    assert fed[("inverted", "none")]["attack_outcome"]["refused_by_check"] == []
    assert "defence_outcome" not in fed[("inverted", "none")]
    keep = fed[("keep", "none")]
    assert [r["site"] for r in keep["attack_outcome"]["refused_by_check"]] == [0]
    honest = fed[("none", "hamming")]
    assert honest["defence_outcome"]["rejected"] == []
    # the defence removed the attacker: the same masks as the five honest sites alone would give
    assert inverted["perplexity"] != fed[("inverted", "none")]["perplexity"]
    assert len([r for r in rows if r["kind"] == "centralized"]) == 1


def test_curve_axis_follows_the_numeric_columns(tiny_dir):
    from fedcompress.bench.plots import curve_axis

    config = _config(tiny_dir, sparsity=0.5, group="layer", baselines=[], clients=6,
                     attack="inverted", attackers=[1, 2], defence=["none", "hamming"],
                     columns="attackers")
    (study,) = plan(config)
    assert curve_axis(study) == "attackers"
    (swept,) = plan(_config(tiny_dir))
    assert curve_axis(swept) == "sparsity"
    (flat,) = plan(_config(tiny_dir, sparsity=0.5, group="layer"))
    assert curve_axis(flat) is None
    rows = study_table(study, {})[1]
    assert any("Hamming defence" in cell for row in rows for cell in row)


def test_server_cost_names_the_model_of_each_row():
    """Two models' one-shot cells are told apart in the server-cost table; baselines and
    failed cells are not rows."""
    from fedcompress.bench.run import server_cost

    cell = dict(status="ok", kind="fedprllm", mode="oneshot", clients=16, samples_per_client=4,
                method="wanda", sparsity=0.5, group="layer", scale=False,
                client_seconds_mean=4.0, count_seconds=0.5, aggregate_seconds=0.5)
    records = [dict(cell, model="smollm2-135m"), dict(cell, model="qwen2.5-0.5b", group="row"),
               dict(cell, model="x", status="failed"), dict(status="ok", kind="dense")]
    lines = [line for line in server_cost(records).splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| model | clients |")
    assert lines[1:] == [
        "| smollm2-135m | 16 | 4 | wanda | 0.5 | layer | 4.00 | 0.500 | 0.500 | 25.0% |",
        "| qwen2.5-0.5b | 16 | 4 | wanda | 0.5 | row | 4.00 | 0.500 | 0.500 | 25.0% |"]


def test_bench_runs_statistics_mode_and_fedspallm_cells(tiny_dir, tmp_path, monkeypatch):
    """A FedPrLLM study's ``aggregate``: statistics mode (Wanda: the centralized perplexity
    exactly) and the peer FedSpaLLM (its sites' releases computed once for every server
    group), not votes under another name; DP statistics belong to a study of kind dp."""
    import fedcompress.methods.fedspallm as fs

    config = _config(tiny_dir)
    config["bench"].update(clients=3, samples_per_client=2)
    config["study"] = {
        "stats": {"method": "wanda", "sparsity": 0.5, "aggregate": "stats",
                  "baselines": ["centralized"]},
        "peer": {"method": "sparsegpt", "sparsity": 0.5, "aggregate": "fedspallm",
                 "fedspallm_layers": 2, "group": ["layer", "row"]}}
    calls = []
    real = fs.site_release
    monkeypatch.setattr(fs, "site_release", lambda *a, **k: calls.append(1) or real(*a, **k))
    import strategies.fedprllm.fedspallm as strategy

    spills, real_sum = [], fs.L0Sum
    monkeypatch.setattr(strategy, "L0Sum", lambda m, spill=None: spills.append(spill)
                        or real_sum(m, spill))
    out = tmp_path / "out"
    report = run_bench(_write(tmp_path, config), out, progress=False)
    assert report.status == "ok"
    # the server's sum was held on disk in the output folder, and nothing of it is left there
    assert spills == [out] and not [p for p in out.iterdir() if p.name.startswith("l0sum-")]
    data = json.loads((out / "report.json").read_text())
    by_name = {r["name"]: r for r in data["results"]}
    stats, central = by_name["fedprllm-stats-row"], by_name["centralized"]
    assert stats["perplexity"] == central["perplexity"] and stats["rounds"] == 3
    layer, row = by_name["fedspallm-layer"], by_name["fedspallm-row"]
    assert len(calls) == 3  # one release per site, shared by both groups
    for r in (layer, row):
        assert r["layers_per_site"] == [2, 2, 2] and r["rounds"] == 1
        assert abs(r["sparsity_measured"] - 0.5) < 0.02
    assert layer["bytes_up_per_client"] == row["bytes_up_per_client"] > 0
    assert layer["perplexity"] != row["perplexity"]
    # the cost table: bytes up and seconds per cell, beside the perplexities
    from fedcompress.bench.tables import human_bytes, study_tables

    results = load_results(out / "results.jsonl")
    for study in plan(config):
        main, cost = study_tables(study, results)
        assert cost.caption == "Cost" and cost.header == main.header
        labels = [r[0] for r in cost.body]
        assert labels == [r[0] for r in main.body]
    peer = next(s for s in plan(config) if s.name == "peer")
    values = [v for r in study_tables(peer, results)[1].body for v in r[1:]]
    assert values and all(v.startswith(human_bytes(layer["bytes_up_per_client"]) + " up, ")
                          for v in values)
    dp = _config(tiny_dir, aggregate="stats", dp_epsilon=8.0, dp_placement="central",
                 method="wanda", group="layer")
    with pytest.raises(BenchConfigError, match="kind dp"):
        plan(dp)


def test_cell_cost_names_bytes_and_seconds():
    from fedcompress.bench.tables import cell_cost, human_bytes

    assert human_bytes(163774464) == "164 MB" and human_bytes(999) == "999 B"
    assert human_bytes(3039456) == "3.04 MB" and human_bytes(2.6e9) == "2.6 GB"
    vote = {"bytes_up_per_client": 163774464, "client_seconds_mean": 41.07,
            "count_seconds": 1.06, "aggregate_seconds": 1.17}
    assert cell_cost(vote) == "164 MB up, 43 s (one site + server)"
    assert cell_cost({"bytes_up_per_client": 3039456, "prune_seconds": 247.1}) == (
        "3.04 MB up, 247 s")
    assert cell_cost({"prune_seconds": 208.2}) == "208 s"
    assert cell_cost({"eval_seconds": 191.2}) == "-"  # the dense model


def test_strategy_labels_name_the_aggregation():
    from fedcompress.bench.tables import strategy_label

    base = {"kind": "fedprllm", "mode": "oneshot", "group": "row", "scale": False}
    assert strategy_label(base) == "FedPrLLM one-shot, server row"
    assert strategy_label({**base, "aggregate": "stats", "group": "layer",
                           "local_group": "row"}) == "FedPrLLM statistics mode, row"
    assert strategy_label({**base, "aggregate": "fedspallm", "fedspallm_layers": 2}) == (
        "FedSpaLLM, server row, 2 layers per site")
    assert strategy_label({**base, "aggregate": "fedspallm", "fedspallm_layers": 0},
                          ("group",)) == "FedSpaLLM, all layers per site"


def test_the_peers_config_plans_every_strategy():
    """simulations/bench_peers.toml (16 x 4) and bench_peers_64x1.toml (issue 34), with their
    SparseGPT halves (split so that each run fits a session), plan votes, the iterative vote,
    statistics mode, RIA and FedSpaLLM at every sparsity, each pair at its budget, without
    running anything; a pair has no study name twice (their reports are read side by side)."""
    import tomllib
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "simulations" / "bench_peers.toml"
    sparsegpt_16x4 = tuple(f"bench_peers_sparsegpt_{pct}.toml" for pct in (50, 60, 70))
    sparsegpt_64x1 = tuple(f"bench_peers_64x1_sparsegpt_{pct}.toml" for pct in (50, 60, 70))
    for names, budget in ((("bench_peers.toml", *sparsegpt_16x4), (16, 4)),
                          (("bench_peers_64x1.toml", *sparsegpt_64x1), (64, 1))):
        halves = [plan(tomllib.loads((path.parent / name).read_text())) for name in names]
        names_seen = [s.name for half in halves for s in half]
        assert len(names_seen) == len(set(names_seen))
        assert {c.settings()["method"] for s in halves[0] for c in s.cells
                if c.kind == "fedprllm"} == {"wanda", "ria"}
        studies = [s for half in halves for s in half]
        cells = [c.settings() for s in studies for c in s.cells]
        mine = [c for c in cells if c["kind"] == "fedprllm"]
        assert {(c["clients"], c["samples_per_client"]) for c in mine} == {budget}
        kinds = {(c["method"], c["aggregate"], c["mode"]) for c in mine}
        assert kinds == {("wanda", "votes", "oneshot"), ("wanda", "votes", "iterative"),
                         ("wanda", "stats", "oneshot"), ("ria", "stats", "oneshot"),
                         ("sparsegpt", "stats", "oneshot"), ("ria", "votes", "oneshot"),
                         ("sparsegpt", "fedspallm", "oneshot")}
        assert {c["sparsity"] for c in mine} == {0.5, 0.6, 0.7}
        assert all(c["model"] == "qwen2.5-0.5b" for c in cells if "model" in c)
    # Qwen2.5-1.5B: the target and the four session-sized parts plan every (method, aggregate)
    # at 50% and 70%, with no cell twice and no study name twice (their pages are read together).
    parts = ["bench_peers_1p5b_target.toml", "bench_peers_1p5b_votes.toml",
             "bench_peers_1p5b_stats.toml",
             *(f"bench_peers_1p5b_{kind}_{pct}.toml"
               for kind in ("sparsegpt", "fedspallm") for pct in (50, 70))]
    big = [s for name in parts for s in plan(tomllib.loads((path.parent / name).read_text()))]
    assert len({s.name for s in big}) == len(big)
    assert len({c.id for s in big for c in s.cells}) == sum(len(s.cells) for s in big)
    fed = [c.settings() for s in big for c in s.cells if c.kind == "fedprllm"]
    assert all(c["onload"] and c["model"] == "qwen2.5-1.5b" for c in fed)
    assert all((c["clients"], c["samples_per_client"]) == (16, 4) for c in fed)
    for pair in (("wanda", "votes"), ("wanda", "stats"), ("ria", "stats"),
                 ("sparsegpt", "stats"), ("sparsegpt", "fedspallm")):
        assert {c["sparsity"] for c in fed if (c["method"], c["aggregate"]) == pair} == {
            0.5, 0.7}, pair
    assert {c["group"] for c in fed if c["aggregate"] == "votes"} == {"layer", "row", "column"}
    assert {c["fedspallm_layers"] for c in fed if c["aggregate"] == "fedspallm"} == {7}


def test_a_study_sweeps_recipes(tiny_dir, tmp_path):
    """``recipe`` in a FedPrLLM study (one file or a list, swept): each recipe's one pass
    sets its cell's settings, so a recipe's cell is the cell of its settings (the same id and
    cache); a recipe of several passes is refused, naming ``fedcompress compress``."""
    import yaml

    sparse, wanda = tmp_path / "sparse.yaml", tmp_path / "wanda.yaml"
    sparse.write_text(yaml.safe_dump({"s_stage": {"m_modifiers": {
        "SparseGPTModifier": {"sparsity": 0.5, "ignore": ["re:.*lm_head"]}}}}))
    wanda.write_text(yaml.safe_dump({"s_stage": {"m_modifiers": {
        "WandaPruningModifier": {"sparsity": 0.3, "ignore": ["re:.*lm_head"]}}}}))
    base = {"baselines": ["centralized"], "aggregate": "stats"}
    config = _config(tiny_dir, recipe=[str(sparse), str(wanda)], **base)
    for key in ("sparsity", "group", "scale"):
        del config["study"]["main"][key]
    (by_recipe,) = plan(config)
    flags = _config(tiny_dir, **base)
    flags["study"] = {"a": {**base, "method": "sparsegpt", "sparsity": 0.5,
                            "local_group": "layer"},
                      "b": {**base, "method": "wanda", "sparsity": 0.3}}
    a, b = plan(flags)
    assert [c.id for c in by_recipe.cells] == [c.id for c in a.cells + b.cells]
    assert by_recipe.columns == "recipe"
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump({
        "s_stage": {"m_modifiers": {"SparseGPTModifier": {"sparsity": 0.5,
                                                          "ignore": ["re:.*lm_head"]}}},
        "q_stage": {"m_modifiers": {"QuantizationModifier": {"scheme": "W8A16",
                                                             "ignore": ["lm_head"]}}}}))
    with pytest.raises(BenchConfigError, match="2 passes.*fedcompress compress"):
        plan(_config(tiny_dir, recipe=str(two), **base))
