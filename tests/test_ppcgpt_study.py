"""PPC-GPT's tables as a bench study (``[study.NAME] kind = "ppcgpt"`` of ``fedcompress
bench``): planning (cell ids, errors naming the key), the ratio subsets, and a real small study
(tiny 3-layer model, a scripted OpenAI-compatible generator on loopback): tables, a failed cell
recorded while the others complete, resume, a former ``ppcgpt-study`` folder read back."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import yes_no_generator
from test_ppcgpt import tiny_sanitizer

from fedcompress.bench.ppcgpt_study import (
    cell_of,
    first_per_source,
    majority_share,
)
from fedcompress.bench.run import run_bench
from fedcompress.bench.sweep import BenchConfigError, load_bench, plan
from fedcompress.methods import ppcgpt
from fedcompress.methods.ppcgpt import PPCGPTConfig
from fedcompress.synth.backends import OpenAIBackend


def _plan(study: dict, bench: dict | None = None, overrides: dict | None = None):
    return plan({"bench": bench or {}, "study": {"s": {"kind": "ppcgpt", **study}}},
                overrides)[0]


@pytest.mark.parametrize("study, message", [
    ({"ablation": {}}, r"unknown setting\(s\) \['ablation'\]; expected some of .*'ablations'"),
    ({"ablations": {"temperature": [1]}}, "'temperature' is not an ablation: expected"),
    ({"ablations": {"eps": 3}}, "eps = 3: expected a non-empty list"),
    ({"ablations": {"eps": [0, 3]}}, "ablations eps: .*eps"),
    ({"ablations": {"synth_ratio": [0.5, 2]}}, "whole numbers"),
    ({"epsilon": 1}, r"unknown setting\(s\) \['epsilon'\]; expected some of .*'eps'"),
    ({"baselines": ["dp-instruct"]}, r"baselines \['dp-instruct'\]: expected some of"),
    ({"eps": -1.0}, "study 's': eps=-1.0 is invalid"),
])
def test_bad_study_configs_name_the_key(study, message):
    with pytest.raises(BenchConfigError, match=message):
        _plan(study)


def test_cells_are_planned_once_with_the_base_value_added():
    study = _plan({"eps": 3.0, "prune_ratio": 0.3, "synth_timeout": 5.0,
                   "ablations": {"eps": [1, 10], "prune_ratio": [0.5], "rationales": [False]},
                   "baselines": ["dense"]}, bench={"model": "m", "sparsity": 0.5})
    assert study.kind == "ppcgpt" and study.options["axes"] == {
        "eps": [1.0, 10.0, 3.0], "prune_ratio": [0.5, 0.3], "rationales": [False, True]}
    assert study.options["base"]["model"] == "m"  # [bench] settings of the same name apply
    kinds = [c.kind for c in study.cells]
    assert kinds.count("ppcgpt-dense") == 1
    # the base run is one cell, shared by Table 1 and every ablation table
    assert kinds.count("ppcgpt") == 1 + 2 + 1 + 1
    assert len({c.id for c in study.cells}) == len(study.cells)
    base = PPCGPTConfig.from_dict({"model": "m", "eps": 3.0, "prune_ratio": 0.3})
    assert cell_of("ppcgpt", base).id in {c.id for c in study.cells}
    # settings that change no result (how long to wait for the generator) are not in the id
    assert cell_of("ppcgpt", base).id == cell_of("ppcgpt", base.replace(synth_timeout=5.0)).id
    # the command line's generator goes to PPC-GPT studies only
    mixed = plan({"bench": {}, "study": {"s": {"kind": "ppcgpt"}, "f": {"model": "x"}}},
                 {"synth_url": "http://h/v1", "eval_windows": 3})
    assert mixed[0].options["base"]["synth_url"] == "http://h/v1"
    assert dict(mixed[1].cells[0].evals)["eval_windows"] == 3


def test_first_per_source_takes_the_first_samples_of_each_example():
    s = [SimpleNamespace(source_id=src, n=i) for i, src in enumerate("aabacbb")]
    assert [x.n for x in first_per_source(s, 1)] == [0, 2, 4]
    assert [x.n for x in first_per_source(s, 2)] == [0, 1, 2, 4, 5]  # a third "a" (3) left
    with pytest.raises(ValueError, match="whole number"):
        first_per_source(s, 1.5)


def test_majority_share_counts_all_clients_test_labels():
    data = [ppcgpt.ClientData(0, [], [{"label": 0}, {"label": 1}]),
            ppcgpt.ClientData(1, [], [{"label": 1}, {"label": 1}])]
    assert majority_share(data) == 0.75


def _garbage(prompt: str, i: int) -> str:
    return "I cannot help with that."


STUDY = """
[bench]
model = "{model}"

[study.tiny]
kind = "ppcgpt"
title = "tiny"
baselines = ["dense", "plain-c"]
task = "strategyqa"
clients = 2
examples_per_client = 3
eval_per_client = 4
prune_ratio = 0.34
server_steps = 1
client_steps = 1
batch_size = 2
grad_accum = 1
max_length = 64
min_synthetic = 1
synth_model = "stub"
eps = 3.0

[study.tiny.ablations]
eps = [5.0]
synth_ratio = [2]
prune_policy = ["seq"]
"""


def test_small_study_end_to_end_and_resume(tiny_dir, tmp_path, openai_stub, monkeypatch):
    """Two budgets (eps 5's generator answers garbage: its cell fails, recorded, the study goes
    on), ratios 1 and 2 from one generation, Seq vs BI, two baselines; then a resume runs
    only the failed cell again; the HTML page has the tables."""
    monkeypatch.setattr(ppcgpt, "sanitizer_for", lambda *a: tiny_sanitizer())
    config = tmp_path / "study.toml"
    config.write_text(STUDY.format(model=tiny_dir))
    with openai_stub(yes_no_generator) as good, openai_stub(_garbage) as bad:
        calls = []

        def backend(cfg, model, tokenizer):
            calls.append(cfg.eps)
            return OpenAIBackend(bad.url if cfg.eps == 5.0 else good.url, "stub")

        monkeypatch.setattr(ppcgpt, "make_backend", backend)
        out = tmp_path / "out"
        planned = run_bench(config, out, progress=False, dry_run=True)
        assert planned.status == "planned" and planned.extra["plan"] == {"cells": 6,
                                                                         "pending": 6}
        report = run_bench(config, out, progress=False)
        assert report.status == "incomplete"  # the eps=5 cell failed
        assert sorted(calls) == [3.0, 5.0]  # one generation per budget
        results = {r["id"]: r for r in report.results}
        failed = [r for r in results.values() if r["status"] != "ok"]
        assert len(failed) == 1 and failed[0]["eps"] == 5.0
        assert "NotEnoughSyntheticData" in failed[0]["error"]
        ok = {(r["kind"], r["synth_ratio"], r["prune_policy"]): r
              for r in results.values() if r["status"] == "ok"}
        assert set(ok) == {("ppcgpt-dense", 1.0, "bi"), ("ppcgpt-plain-c", 1.0, "bi"),
                           ("ppcgpt", 1.0, "bi"), ("ppcgpt", 2.0, "bi"), ("ppcgpt", 1.0, "seq")}
        base = ok[("ppcgpt", 1.0, "bi")]
        assert base["synthetic"] == 6 and ok[("ppcgpt", 2.0, "bi")]["synthetic"] == 12
        assert ok[("ppcgpt", 1.0, "seq")]["removed"] == [2]  # the deepest of 3 layers
        for r in ok.values():
            assert 0.0 <= r["C"] <= 1.0
            assert sum(c["client"]["n"] for c in r["per_client"]) == 8
        md = (out / "report.md").read_text()
        for title in ("Table 1", "Table 2", "Table 3", "Table 6", "Synthetic data of `tiny`",
                      "Privacy of `tiny`", "Failed cells"):
            assert title in md
        assert "failed: NotEnoughSyntheticData" in md
        assert "kind=ppcgpt, clients=2, partition=iid" in md and "eps=5.0" in md  # Failed cells
        assert "(majority label, reference)" in md
        saved = json.loads((out / "report.json").read_text())
        assert saved["plan"] == {"cells": 6, "pending": 6}
        assert len(list((out / "synthetic").glob("*/study.json"))) == 2

        calls.clear()
        again = run_bench(config, out, progress=False)
        assert calls == []  # both generations read back; only the failed cell ran again
        assert again.status == "incomplete" and again.extra["plan"]["pending"] == 1
        assert {r["id"]: r["C"] for r in again.results if r["status"] == "ok"} == \
            {i: r["C"] for i, r in results.items() if r["status"] == "ok"}
        lines = (out / "results.jsonl").read_text().splitlines()
        assert len(lines) == 6 + 1  # the finished cells were not run again

    from fedcompress.report_html import render_run

    page = render_run(out)
    assert "Table 1: compression methods" in page and "Table 7" not in page
    assert "(majority label, reference)" in page


def test_a_former_ppcgpt_study_folder_is_resumed(tmp_path, monkeypatch):
    """A folder of the former ``ppcgpt-study`` command: its OUT/cells/<id>.json cells count as
    finished (ids of today's cells), the bench only plans what is missing."""
    monkeypatch.setattr(ppcgpt, "sanitizer_for", lambda *a: tiny_sanitizer())
    config = tmp_path / "study.toml"
    config.write_text(STUDY.format(model="nowhere"))
    study = plan(load_bench(config))[0]
    base = PPCGPTConfig.from_dict(study.options["base"])
    cells = tmp_path / "out" / "cells"
    cells.mkdir(parents=True)
    old = {"id": "ppcgpt-0123456789ab", "kind": "ppcgpt", "tables": ["main"],
           "settings": base.to_dict(), "per_client": [{"client": {"acc": 0.5, "n": 4},
                                                        "server": {"acc": 0.25, "n": 4}}],
           "synthetic": 6, "removed": [2], "layers": 2, "S": 0.25, "C": 0.5, "status": "ok",
           "seconds": 12.0}
    (cells / "ppcgpt-0123456789ab.json").write_text(json.dumps(old))
    report = run_bench(config, tmp_path / "out", progress=False, dry_run=True)
    assert report.extra["plan"] == {"cells": 6, "pending": 5}
    (record,) = report.results
    assert record["id"] == cell_of("ppcgpt", base).id and record["wall_seconds"] == 12.0
    assert "| PPC-GPT | 2 | 25.0 ± 21.7 | 50.0 ± 25.0 | 12 |" in (
        tmp_path / "out" / "report.md").read_text()
