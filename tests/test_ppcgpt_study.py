"""The PPC-GPT study (``fedcompress ppcgpt-study``): config validation, cell planning, the
ratio subsets, and a real small study (tiny 3-layer model, a scripted OpenAI-compatible
generator on loopback): tables, failed cells, resume."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import yes_no_generator
from test_ppcgpt import tiny_sanitizer

from fedcompress.bench.ppcgpt_study import (
    StudyConfigError,
    first_per_source,
    load_study,
    majority_share,
    run_study,
    study_from_dict,
)
from fedcompress.methods import ppcgpt
from fedcompress.synth.backends import OpenAIBackend


@pytest.mark.parametrize("raw, message", [
    ({"ablation": {}}, "unknown table"),
    ({"ablations": {"temperature": [1]}}, "not an ablation"),
    ({"ablations": {"eps": 3}}, "non-empty list"),
    ({"ablations": {"eps": [0, 3]}}, "eps"),
    ({"ablations": {"synth_ratio": [0.5, 2]}}, "whole numbers"),
    ({"ppcgpt": {"epsilon": 1}}, "unknown PPC-GPT setting"),
    ({"study": {"baselines": ["dp-instruct"]}}, "baselines"),
    ({"study": {"seeds": 3}}, "unknown key"),
])
def test_bad_study_configs_are_clear_errors(raw, message):
    with pytest.raises(StudyConfigError, match=message):
        study_from_dict(raw)


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(StudyConfigError, match="does not exist"):
        load_study(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text("[ppcgpt\n")
    with pytest.raises(StudyConfigError, match="not valid TOML"):
        load_study(tmp_path / "bad.toml")


def test_cells_are_planned_once_with_the_base_value_added():
    study = study_from_dict({"ppcgpt": {"eps": 3.0, "prune_ratio": 0.3},
                             "ablations": {"eps": [1, 10], "prune_ratio": [0.5],
                                           "rationales": [False]},
                             "study": {"baselines": ["dense"]}})
    assert study.axes == {"eps": [1.0, 10.0, 3.0], "prune_ratio": [0.5, 0.3],
                          "rationales": [False, True]}
    cells = study.cells()
    kinds = [c.kind for c in cells]
    assert kinds.count("dense") == 1
    # the base run is one cell in Table 1 and in every ablation table
    base = [c for c in cells if c.kind == "ppcgpt" and c.config == study.base]
    assert len(base) == 1 and set(base[0].tables) == {"main", "eps", "prune_ratio", "rationales"}
    assert kinds.count("ppcgpt") == 1 + 2 + 1 + 1
    assert len({c.id for c in cells}) == len(cells)


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


def test_small_study_end_to_end_and_resume(tiny_dir, tmp_path, openai_stub, monkeypatch):
    """Two budgets (eps 5's generator answers garbage: its cell fails, recorded, the study goes
    on), ratios 1 and 2 from one generation, Seq vs BI, two baselines; then a resume runs
    nothing again."""
    monkeypatch.setattr(ppcgpt, "sanitizer_for", lambda *a: tiny_sanitizer())
    config = tmp_path / "study.toml"
    config.write_text(f"""
[ppcgpt]
model = "{tiny_dir}"
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

[ablations]
eps = [5.0]
synth_ratio = [2]
prune_policy = ["seq"]

[study]
title = "tiny"
baselines = ["dense", "plain-c"]
""")
    with openai_stub(yes_no_generator) as good, openai_stub(_garbage) as bad:
        calls = []

        def backend(cfg, model, tokenizer):
            calls.append(cfg.eps)
            return OpenAIBackend(bad.url if cfg.eps == 5.0 else good.url, "stub")

        out = tmp_path / "out"
        report = run_study(config, out, progress=False, backend_factory=backend)
        assert report.status == "incomplete"  # the eps=5 cell failed
        assert sorted(calls) == [3.0, 5.0]  # one generation per budget
        results = {r["id"]: r for r in report.results}
        failed = [r for r in results.values() if r["status"] != "ok"]
        assert len(failed) == 1 and failed[0]["settings"]["eps"] == 5.0
        assert "NotEnoughSyntheticData" in failed[0]["error"]
        ok = {(r["kind"], r["settings"]["synth_ratio"], r["settings"]["prune_policy"]): r
              for r in results.values() if r["status"] == "ok"}
        assert set(ok) == {("dense", 1.0, "bi"), ("plain-c", 1.0, "bi"), ("ppcgpt", 1.0, "bi"),
                           ("ppcgpt", 2.0, "bi"), ("ppcgpt", 1.0, "seq")}
        base = ok[("ppcgpt", 1.0, "bi")]
        assert base["synthetic"] == 6 and ok[("ppcgpt", 2.0, "bi")]["synthetic"] == 12
        assert ok[("ppcgpt", 1.0, "seq")]["removed"] == [2]  # the deepest of 3 layers
        for r in ok.values():
            assert 0.0 <= r["C"] <= 1.0
            assert sum(c["client"]["n"] for c in r["per_client"]) == 8
        md = (out / "report.md").read_text()
        for title in ("Table 1", "Table 2", "Table 3", "Table 6", "Synthetic data"):
            assert title in md
        assert "failed: NotEnoughSyntheticData" in md
        assert "(majority label, reference)" in md
        saved = json.loads((out / "report.json").read_text())
        assert saved["plan"] == {"cells": 6, "pending": 1}
        assert len(saved["synthetic"]) == 2

        calls.clear()
        again = run_study(config, out, progress=False, backend_factory=backend)
        assert calls == []  # both generations read back; only the failed cell ran again
        assert again.status == "incomplete"
        assert {r["id"]: r["C"] for r in again.results if r["status"] == "ok"} == \
            {i: r["C"] for i, r in results.items() if r["status"] == "ok"}
