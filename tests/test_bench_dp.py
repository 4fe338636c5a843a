"""The bench study of kind ``dp`` (perplexity against epsilon of DP statistics mode): its plan,
bad settings, a tiny end-to-end run with its table and plot, no DP = centralized bit for bit,
resume and a failing cell."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_bench, write_bench_config

from fedcompress.bench import dp_study
from fedcompress.bench.sweep import BenchConfigError, Cell, load_results, plan


def _config(model: str, corpus: str, **study) -> dict:
    bench = {"model": model, "seqlen": 16, "batch_size": 2, "eval_seqlen": 16,
             "eval_windows": 2, "calib_text": corpus, "eval_text": corpus, "eval_split": "test"}
    table = {"kind": "dp", "title": "DP tiny", "method": "wanda", "sparsity": 0.5,
             "budgets": ["2x2"], "epsilon": [4, 16, "none"], "dp_public_windows": 4}
    table.update(study)
    return {"bench": bench, "study": {"dp": table}}


@pytest.fixture(scope="module")
def bench(tiny_dir, corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-dp")
    config = _config(tiny_dir, corpus, placement=["central", "distributed"])
    out = root / "out"
    report = run_bench(write_bench_config(root, config), out, progress=False)
    return config, root, out, report


def test_the_plan_of_a_dp_study(tiny_dir, corpus):
    config = _config(tiny_dir, corpus, method=["wanda", "sparsegpt"], budgets=["2x2", "2x4"],
                     epsilon=[1, 8, "none"], placement=["central", "distributed"])
    (study,) = plan(config)
    assert study.kind == "dp" and study.options["rows"] == ["method"]
    assert study.options["epsilons"] == [1.0, 8.0, 0.0]
    assert study.options["budgets"] == [[2, 2], [2, 4]]
    dp = [c for c in study.cells if c.kind == "dp-stats"]
    # 2 methods x 2 budgets x (2 placements x 2 epsilons + one plain statistics mode)
    assert len(dp) == 2 * 2 * (2 * 2 + 1)
    kinds = [c.kind for c in study.cells]
    assert kinds.count("dense") == 1
    for kind in ("centralized", "local-only", "fedprllm", "dp-public"):
        assert kinds.count(kind) == 4, kind  # per method and budget
    public = [c.settings() for c in study.cells if c.kind == "dp-public"]
    assert all(not s["dp_epsilon"] and s["aggregate"] == "stats" for s in public)
    assert {(s["method"], s["clients"], s["samples_per_client"]) for s in public} == {
        (m, 2, w) for m in ("wanda", "sparsegpt") for w in (2, 4)}
    for cell in dp:
        s = cell.settings()
        assert s["aggregate"] == "stats" and "group" not in s  # no server variant
        assert s["secagg"] == (s["dp_epsilon"] > 0 and s["dp_placement"] == "distributed")
    votes = [c.settings() for c in study.cells if c.kind == "fedprllm"]
    assert all(v["mode"] == "oneshot" and v["group"] == "layer" and v["aggregate"] == "votes"
               for v in votes)
    # the baselines are the cells a FedPrLLM study plans (shared ids)
    fed = plan({"bench": config["bench"], "study": {"s": {
        "method": "wanda", "sparsity": 0.5, "clients": 2, "samples_per_client": 2,
        "baselines": ["dense", "centralized", "local-only"]}}})[0]
    assert {c.id for c in fed.cells} <= {c.id for c in study.cells}
    # the noise seed: per cell, stable
    seeds = {dp_study.dp_seed(c) for c in dp}
    assert len(seeds) == len(dp)
    assert dp_study.dp_seed(dp[0]) == dp_study.dp_seed(plan(config)[0].cells[0])
    # a stored record finds its cell again
    record = {"kind": "dp-stats", **dict(dp[3].client), "eval": dict(dp[3].evals)}
    assert dp_study.record_cell(record).id == dp[3].id
    # a DP record from before dp_normalize and dp_prior existed released raw statistics: not
    # this cell
    legacy = {k: v for k, v in record.items() if k not in ("dp_normalize", "dp_prior")}
    assert dp[3].settings()["dp_epsilon"] and dp[3].settings()["dp_normalize"] == "public"
    assert dp_study.record_cell(legacy).settings()["dp_normalize"] == "none"
    assert dp_study.record_cell(legacy).settings()["dp_prior"] == "none"
    assert dp_study.record_cell(legacy).id != dp[3].id
    plain = next(c for c in dp if not c.settings()["dp_epsilon"])
    plain_record = {k: v for k, v in plain.client if k not in ("dp_normalize", "dp_prior")}
    assert dp_study.record_cell({"kind": "dp-stats", **plain_record,
                                 "eval": dict(plain.evals)}).id == plain.id
    # the server's prior with and without: a swept setting; raw statistics have no prior
    (both,) = plan(_config(tiny_dir, corpus, dp_prior=["shrink", "none"], epsilon=8,
                           baselines=[]))
    assert both.options["rows"] == ["dp_prior"]
    assert sorted(c.settings()["dp_prior"] for c in both.cells) == ["none", "shrink"]
    (raw,) = plan(_config(tiny_dir, corpus, dp_normalize="none", dp_prior="none", epsilon=8,
                          baselines=[]))
    assert raw.cells[0].settings()["dp_normalize"] == "none"
    with pytest.raises(BenchConfigError, match="dp_prior='shrink' is invalid"):
        plan(_config(tiny_dir, corpus, dp_normalize="none", epsilon=8, baselines=[]))
    public_cell = next(c for c in study.cells if c.kind == "dp-public")
    record = {"kind": "dp-public", **dict(public_cell.client), "eval": dict(public_cell.evals)}
    assert dp_study.record_cell(record).id == public_cell.id
    # no baselines, one epsilon: DP cells only
    (only,) = plan(_config(tiny_dir, corpus, baselines=[], epsilon=8))
    assert [c.kind for c in only.cells] == ["dp-stats"]


def test_public_text_of_the_sites_kind_in_a_study(tiny_dir, corpus, tmp_path):
    """``dp_public_text`` swept: each row's DP cells and its public baseline take their bounds,
    scales and windows from that text; the wiki row keeps the ids of a study without it."""
    (study,) = plan(_config(tiny_dir, corpus, dp_public_text=["wiki", "code"], epsilon=[8],
                            baselines=["public"]))
    assert study.options["rows"] == ["dp_public_text"]
    by_text = {(c.kind, c.settings()["dp_public_text"]) for c in study.cells}
    assert by_text == {(k, t) for k in ("dp-stats", "dp-public") for t in ("wiki", "code")}
    rows = dp_study._rows(study)
    assert [r["dp_public_text"] for r in rows] == ["wiki", "code"]
    for row in rows:  # each row's public baseline is its own text's
        (public,) = [c for c in study.cells if c.kind == "dp-public"
                     and c.settings()["dp_public_text"] == row["dp_public_text"]]
        found = {c.id for c in study.cells
                 if dp_study._matches(row, {"kind": c.kind, **c.settings()}, ["dp_public_text"])
                 and c.kind == "dp-public"}
        assert found == {public.id}
    (plain,) = plan(_config(tiny_dir, corpus, epsilon=[8], baselines=["public"]))
    wiki = {c.id for c in study.cells if c.settings()["dp_public_text"] == "wiki"}
    assert {c.id for c in plain.cells} == wiki
    (code,) = plan(_config(tiny_dir, corpus, dp_public_text="code", epsilon=[8],
                           baselines=["public"]))
    out = tmp_path / "out"
    run_bench(write_bench_config(tmp_path, {"bench": _config(tiny_dir, corpus)["bench"],
                                            "study": {"dp": _config(
                                                tiny_dir, corpus, dp_public_text="code",
                                                epsilon=[8], baselines=["public"])["study"][
                                                "dp"]}}), out, progress=False)
    records = load_results(out / "results.jsonl")
    assert {r["status"] for r in records.values()} == {"ok"}
    (public,) = [r for r in records.values() if r["kind"] == "dp-public"]
    assert public["public_text"] == "code validation"
    (dp,) = [r for r in records.values() if r["kind"] == "dp-stats"]
    assert dp["dp_public_text"] == "code"
    assert set(records) == {c.id for c in code.cells}


def test_several_noise_draws_per_dp_cell(tiny_dir, corpus, tmp_path):
    """``draws = 3``: each DP cell three times with its own noise seed (draw 0 is the cell of
    a one-draw study); the table shows the median and range, the cells' table every draw, the
    plot draws the range; a stored draw's record resolves to its cell."""
    config = _config(tiny_dir, corpus, epsilon=[4, "none"], baselines=[], draws=3)
    (study,) = plan(config)
    dp = [c for c in study.cells if c.kind == "dp-stats"]
    assert sorted(dp_study.draw_of(c) for c in dp) == [0, 0, 1, 2]  # no draws without DP
    (single,) = plan(_config(tiny_dir, corpus, epsilon=[4, "none"], baselines=[]))
    assert {c.id for c in single.cells} == {c.id for c in dp if not dp_study.draw_of(c)}
    noisy = [c for c in dp if c.settings()["dp_epsilon"]]
    assert len({dp_study.dp_seed(c) for c in noisy}) == 3
    assert {c.id for c in noisy} == {dp_study.with_draw(noisy[0], d).id for d in range(3)}
    out = tmp_path / "out"
    report = run_bench(write_bench_config(tmp_path, config), out, progress=False)
    assert report.exit_status == "ok"
    results = load_results(out / "results.jsonl")
    assert set(results) == {c.id for c in study.cells}  # every draw stored under its id
    ppl = sorted(results[c.id]["perplexity"] for c in noisy)
    assert [results[c.id]["draw"] for c in noisy if dp_study.draw_of(c)] == [1, 2]
    main, detail = dp_study.study_tables(study, results)
    assert main.body[0][main.header.index("ε=4")] == (
        f"{ppl[1]:.2f} ({ppl[0]:.2f}-{ppl[2]:.2f})")
    assert "3 draws of the noise" in main.note
    assert detail.header.index("draw") == detail.header.index("epsilon") + 1
    assert [r[detail.header.index("draw")] for r in detail.body] == ["0", "1", "2", "0"]
    assert (out / "dp-dp.png").exists()
    # a pending draw: the epsilon is pending, not the median of the others
    partial = {k: v for k, v in results.items() if k != noisy[2].id}
    assert dp_study.study_tables(study, partial)[0].body[0][main.header.index("ε=4")] == (
        "pending (2 of 3)")


def test_a_setting_added_later_leaves_the_noise_seeds_of_stored_results(tiny_dir, corpus):
    """``dp_public_text`` at its default (the text every earlier run used) is left out of a
    cell's noise seed; another text changes it. And every committed DP result's cells draw,
    under today's code, the noise seeds their records say they drew."""
    import tomllib
    from pathlib import Path

    (wiki,) = plan(_config(tiny_dir, corpus, epsilon=[8], baselines=[]))
    (code,) = plan(_config(tiny_dir, corpus, epsilon=[8], baselines=[], dp_public_text="code"))
    old = Cell(wiki.cells[0].kind, tuple((k, v) for k, v in wiki.cells[0].client
                                         if k != "dp_public_text"))
    assert dp_study.dp_seed(wiki.cells[0]) == dp_study.dp_seed(old)
    assert dp_study.dp_seed(code.cells[0]) != dp_study.dp_seed(wiki.cells[0])
    # where a machine keeps its copy of a pinned public file is not in the seed
    moved = Cell(wiki.cells[0].kind, tuple((k, "/elsewhere/public.txt" if k == "dp_public_file"
                                            else v) for k, v in wiki.cells[0].client))
    assert moved.client != wiki.cells[0].client
    assert dp_study.dp_seed(moved) == dp_study.dp_seed(wiki.cells[0])
    checked = 0
    for folder in sorted((Path(__file__).resolve().parents[1] / "simulations" / "results")
                         .glob("bench-dp-*")):
        if not (folder / "config.toml").exists():
            continue
        cells = {c.id: c for s in plan(tomllib.loads((folder / "config.toml").read_text()))
                 for c in s.cells}
        for cell_id, record in load_results(folder / "results.jsonl").items():
            if record.get("kind") == "dp-stats" and record.get("dp_epsilon"):
                assert dp_study.dp_seed(cells[cell_id]) == record["noise_seed"], (folder.name,
                                                                             cell_id)
                checked += 1
    assert checked >= 40


@pytest.mark.parametrize("change,match", [
    (dict(budgets=["2by2"]), "budgets entry '2by2'"),
    (dict(budgets=["0x4"]), "budgets entry '0x4'"),
    (dict(budgets=[]), "budgets is an empty list"),
    (dict(budgets=["2x2"], clients=4), "budgets both set"),
    (dict(epsilon=[-1]), "epsilon entry -1"),
    (dict(epsilon=["lots"]), "epsilon entry 'lots'"),
    (dict(epsilon=[8, 8.0]), "names a value twice"),
    (dict(epsilon=[]), "epsilon is an empty list"),
    (dict(placement="server"), "placement \\['server'\\]"),
    (dict(baselines=["oracle"]), "baselines \\['oracle'\\]"),
    (dict(method="magnitude"), "method \\['magnitude'\\]"),
    (dict(vote_group="block"), "vote_group 'block'"),
    (dict(dp_epsilon=8), "use epsilon"),
    (dict(aggregate="stats"), "statistics mode is what"),
    (dict(group="row"), "unknown setting\\(s\\) \\['group'\\]"),
    (dict(sparsity_profile="owl"), "sparsity_profile 'owl'"),
    (dict(sparsity=1.5), "sparsity"),
    (dict(draws=0), "draws 0"),
    (dict(draws="3"), "draws '3'"),
    (dict(draws=True), "draws True"),
])
def test_bad_dp_study_settings_are_refused(tiny_dir, corpus, change, match):
    with pytest.raises(BenchConfigError, match=match):
        plan(_config(tiny_dir, corpus, **change))


def test_a_dp_study_end_to_end(bench):
    _, _, out, report = bench
    assert report.exit_status == "ok"
    results = load_results(out / "results.jsonl")
    (study,) = plan(json.loads((out / "report.json").read_text())["config"])
    records = {c.id: results[c.id] for c in study.cells}
    assert all(r["status"] == "ok" for r in records.values())
    skellam = {float(r["dp_epsilon"]): r for r in records.values()
               if r["kind"] == "dp-stats" and r["dp_epsilon"] and r["secagg"]}
    assert sorted(skellam) == [4.0, 16.0]
    assert all(r["mechanism"] == "skellam" and r["dp_placement"] == "distributed"
               and r["epsilon_spent"] <= r["dp_epsilon"] for r in skellam.values())
    dp = {float(r["dp_epsilon"]): r for r in records.values()
          if r["kind"] == "dp-stats" and not r["secagg"]}
    assert sorted(dp) == [0.0, 4.0, 16.0]
    for eps in (4.0, 16.0):
        r = dp[eps]
        assert r["sigma"] > 0 and r["delta"] == 1e-5 and r["mechanism"] == "gaussian"
        assert 0.99 * eps <= r["epsilon_spent"] <= eps
        assert r["bytes_up_per_site"] > 0 and r["rounds"] == 3 and r["prune_seconds"] > 0
        assert r["noise_seed"] == dp_study.dp_seed(dp_study.record_cell(r))
        assert "no privacy guarantee" in r["noise"]
    assert dp[4.0]["sigma"] > dp[16.0]["sigma"]
    assert "sigma" not in dp[0.0] and dp[0.0]["dp_report"] == {"dp": False}
    central = next(r for r in records.values() if r["kind"] == "centralized")
    assert dp[0.0]["perplexity"] == central["perplexity"]  # the same model
    # the public baseline: centralized pruning on as many windows of public text
    (public,) = [r for r in records.values() if r["kind"] == "dp-public"]
    assert public["public_windows"] == 4 and public["public_text"] == "wiki validation"
    assert public["public_tokens"] > 0 and public["sparsity"] == pytest.approx(0.5, abs=0.05)
    assert public["name"] == "public-calibration wanda 2x2"
    md = (out / "report.md").read_text()
    assert "DP tiny" in md and "ε=4" in md and "no DP = centralized" in md
    assert "public text (centralized)" in md
    assert "yes (identical)" in md and "#### DP cells" in md
    assert "| 2x2 | distributed |" in md and "| 2x2 | central |" in md
    assert (out / "dp-dp.png").stat().st_size > 0 and "dp-dp.png" in md
    # the report page rebuilds the study's tables from report.json
    from fedcompress.report_html import bench_studies, study_html

    page = json.loads((out / "report.json").read_text())
    ((rebuilt, rebuilt_results),) = bench_studies(page)
    html = study_html(rebuilt, rebuilt_results)
    assert "yes (identical)" in html and "ε=16" in html


def test_no_dp_statistics_mode_is_centralized_bit_for_bit(tiny_dir, corpus):
    from fedcompress.methods.fedprllm.experiment import prepare_experiment

    for method in ("wanda", "sparsegpt"):
        (study,) = plan(_config(tiny_dir, corpus, method=method, epsilon="none",
                                budgets=["2x2"]))
        plain = next(c for c in study.cells if c.kind == "dp-stats")
        central = next(c for c in study.cells if c.kind == "centralized")
        exp = prepare_experiment(central.config(), central.eval_config())
        dp_exp = prepare_experiment(plain.config(), plain.eval_config(), loaded=exp.loaded)
        for a, b in zip(exp.windows, dp_exp.windows):  # the bench's windows, the same
            assert torch.equal(a, b)
        model, run, _, seed = dp_study.prune_cell(dp_exp, plain)
        assert seed is None and run.dp == {"dp": False}
        reference, _ = exp.centralized()
        for (key, w), (_, v) in zip(reference.state_dict().items(), model.state_dict().items()):
            assert torch.equal(w, v), (method, key)


def test_a_rerun_skips_finished_cells(bench):
    config, root, out, _ = bench
    lines = (out / "results.jsonl").read_text().splitlines()
    report = run_bench(write_bench_config(root, config), out, progress=False)
    assert report.extra["plan"]["pending"] == 0
    assert (out / "results.jsonl").read_text().splitlines() == lines


def test_a_failing_cell_is_recorded_and_retried(tiny_dir, corpus, tmp_path, monkeypatch):
    config = _config(tiny_dir, corpus, epsilon=[8, "none"], baselines=[])
    real = dp_study.prune_cell

    def fail_with_dp(exp, cell):
        if cell.config().dp:
            raise RuntimeError("noise went wrong")
        return real(exp, cell)

    monkeypatch.setattr(dp_study, "prune_cell", fail_with_dp)
    out = tmp_path / "out"
    report = run_bench(write_bench_config(tmp_path, config), out, progress=False)
    assert report.exit_status == "incomplete"
    records = load_results(out / "results.jsonl")
    failed = [r for r in records.values() if r["status"] != "ok"]
    assert len(failed) == 1 and "noise went wrong" in failed[0]["error"]
    assert failed[0]["dp_epsilon"] == 8.0
    md = (out / "report.md").read_text()
    assert "failed: RuntimeError: noise went wrong" in md
    monkeypatch.setattr(dp_study, "prune_cell", real)
    report = run_bench(write_bench_config(tmp_path, config), out, progress=False)
    assert report.exit_status == "ok" and report.extra["plan"]["pending"] == 1


def test_the_dp_plot_keeps_the_baselines_on_scale(bench, tmp_path, monkeypatch):
    """A wrecked cell (perplexity 1e5) is drawn on the top edge with its value, and the axis
    still spans every baseline instead of flattening them under a log scale."""
    import matplotlib.figure

    _, _, out, _ = bench
    results = {k: dict(v) for k, v in load_results(out / "results.jsonl").items()}
    (study,) = plan(json.loads((out / "report.json").read_text())["config"])
    wrecked = next(r for r in results.values() if r["kind"] == "dp-stats" and not r["secagg"]
                   and float(r["dp_epsilon"]) == 4.0)
    wrecked["perplexity"] = 1e5
    figures: list = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: figures.append(self))
    dp_study.study_plots(study, results, tmp_path)
    (ax,) = figures[0].axes
    lo, hi = ax.get_ylim()
    baselines = [r["perplexity"] for r in results.values()
                 if r["kind"] in ("centralized", "local-only", "votes", "dp-public")]
    assert baselines and all(lo <= y <= hi for y in baselines)
    assert hi < 1e5 and ax.get_yscale() == "linear"
    assert any(t.get_text() == "100,000" for t in ax.texts)


def test_the_dp_plot_draws_a_baseline_shared_by_rows_once(tiny_dir, corpus, tmp_path,
                                                          monkeypatch):
    """Rows that differ only in a DP setting (here the server's prior) share their baselines:
    each is drawn once, and its label names no DP setting."""
    import matplotlib.figure

    (study,) = plan(_config(tiny_dir, corpus, dp_prior=["shrink", "public"], epsilon=[8],
                            baselines=["local-only", "public"]))
    results = {c.id: {"status": "ok", "kind": c.kind, "perplexity": 40.0 + i}
               for i, c in enumerate(study.cells)}
    figures: list = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: figures.append(self))
    dp_study.study_plots(study, results, tmp_path)
    (ax,) = figures[0].axes
    labels = ax.get_legend_handles_labels()[1]
    baselines = [t for t in labels if not t.startswith("DP statistics")]
    assert len(baselines) == len(set(baselines))
    assert sum(t.startswith("local-only") for t in labels) == 1
    assert not any("dp_prior" in t for t in baselines)
    assert sum("dp_prior=public" in t for t in labels) == 1  # its DP line
