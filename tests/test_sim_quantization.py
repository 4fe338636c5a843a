"""The pure parts of ``simulations/quantization.py`` (issue 31's measurement): the group size it
picks, the stable row names, the federated-against-centralized comparison of integers, the time
ratio and reading the llm-compressor anchor's report. Seconds; no model is loaded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from fedcompress.quant.solver import QuantResult

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("sim_quantization",
                                                  ROOT / "simulations" / "quantization.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_group_size_is_the_largest_that_divides_every_width(sim):
    assert sim.pick_group_size([576, 1536]) == 64  # SmolLM2: 128 does not divide 576
    assert sim.pick_group_size([896, 4864]) == 128  # Qwen2.5-0.5B
    assert sim.pick_group_size([96]) == 32
    with pytest.raises(ValueError, match=r"none of the group sizes .* \[100\]"):
        sim.pick_group_size([100])
    with pytest.raises(ValueError, match="positive widths"):
        sim.pick_group_size([])


def test_row_names_are_stable(sim):
    assert sim.result_name("w4a16", "gptq", "federated") == "w4a16-gptq-federated"
    assert sim.result_name("w8a16", "gptq", "centralized") == "w8a16-gptq-centralized"
    assert sim.result_name("w4a16", "rtn") == "w4a16-rtn"
    assert sim.result_name("sparsegpt50-w4a16", "gptq", "federated") == \
        "sparsegpt50-w4a16-federated"
    with pytest.raises(ValueError, match="recipe 'w3a16'"):
        sim.result_name("w3a16", "gptq")
    assert sim.result_name("w4a16", "gptq", "federated-secagg") == (
        "w4a16-gptq-federated-secagg")
    with pytest.raises(ValueError, match="where='server'"):
        sim.result_name("w4a16", "gptq", "server")


def _result(q, scale=None):
    q = torch.tensor(q, dtype=torch.int8)
    scale = torch.ones(q.shape[0], 1) if scale is None else scale
    return QuantResult(q, scale, torch.zeros(q.shape[0], 1, dtype=torch.int8), None, 0, True)


def test_compare_quant_counts_what_differs(sim):
    a = [{"q": _result([[1, 2], [3, 4]])}, None]
    same = sim.compare_quant(a, [{"q": _result([[1, 2], [3, 4]])}, None])
    assert same == {"integers": 4, "integers_differing": 0, "scales_differing": 0,
                    "zero_points_differing": 0}
    other = sim.compare_quant(a, [{"q": _result([[1, 2], [3, 5]], torch.full((2, 1), 2.0))},
                                  None])
    assert (other["integers_differing"], other["scales_differing"]) == (1, 2)
    with pytest.raises(ValueError, match="expected the same model"):
        sim.compare_quant(a, a[:1])
    with pytest.raises(ValueError, match="linear layers"):
        sim.compare_quant(a, [{"k": _result([[1, 2], [3, 4]])}, None])


def test_time_ratio(sim):
    assert sim.time_ratio(15.0, 10.0) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="centralized ones positive"):
        sim.time_ratio(1.0, 0.0)


def test_anchor_row_reports_the_settings_that_differ(sim):
    config = {"model": "smollm2-135m", "clients": 16, "samples_per_client": 4, "seqlen": 128,
              "seed": 0, "eval_windows": 64, "eval_seqlen": 256, "scheme": "w4a16",
              "group_size": 64}
    anchor = {"status": "ok", "config": config, "versions": {"git_commit": "abc"},
              "results": [{"name": "dense", "perplexity": 25.5},
                          {"name": "llmc-gptq", "perplexity": 33.7, "weights_bytes": 2**21}]}
    ours = dict(config)
    row = sim.anchor_row(anchor, ours, 64)
    assert row["name"] == "w4a16-llmc-gptq-centralized" and row["perplexity"] == 33.7
    assert row["recipe"] == "w4a16" and row["settings_differing"] == {}
    assert row["weights_mib"] == 2.0
    row = sim.anchor_row(anchor, {**ours, "eval_windows": 4}, 32)
    assert row["settings_differing"] == {"eval_windows": {"ours": 4, "anchor": 64},
                                         "group_size": {"ours": 32, "anchor": 64}}
    with pytest.raises(ValueError, match="no llmc-gptq row"):
        sim.anchor_row({"status": "running", "results": [{"name": "dense"}]}, ours, 64)
    # W8A16: per output channel (the anchor's group size 0), whatever our W4A16 group size
    w8 = {**anchor, "config": {**config, "scheme": "w8a16", "group_size": 0}}
    row = sim.anchor_row(w8, ours, 64)
    assert row["name"] == "w8a16-llmc-gptq-centralized" and row["settings_differing"] == {}
    grouped = {**anchor, "config": {**config, "scheme": "w8a16", "group_size": 128}}
    assert sim.anchor_row(grouped, ours, 64)["settings_differing"] == {
        "group_size": {"ours": 0, "anchor": 128}}
    with pytest.raises(ValueError, match="scheme 'w3a16'"):
        sim.anchor_row({**anchor, "config": {**config, "scheme": "w3a16"}}, ours, 64)
    # one report per scheme
    assert [r["recipe"] for r in sim.anchor_rows([anchor, w8], ours, 64)] == ["w4a16", "w8a16"]
    with pytest.raises(ValueError, match="two reports of scheme w4a16"):
        sim.anchor_rows([anchor, anchor], ours, 64)


def test_help_runs(sim):
    with pytest.raises(SystemExit) as exit_:
        sim.parse_args(["--help"])
    assert exit_.value.code == 0


def test_recipes_none_alone(sim):
    assert sim.parse_args(["--recipes", "none"]).recipes == ["none"]
    assert sim.parse_args([]).recipes == list(sim.RECIPES)
    with pytest.raises(SystemExit):
        sim.parse_args(["--recipes", "none", "w4a16"])
