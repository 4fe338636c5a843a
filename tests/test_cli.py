"""The `fedcompress` command line: help, eval reports, reproduction from config, clear errors."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from fedcompress.cli import app, main


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from conftest import build_tiny_model, build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model("llama", n_layers=2).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


def run_main(monkeypatch, capsys, *args):
    """Run the console entry point; return (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", ["fedcompress", *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["eval"], ["models"], ["prune"], ["bench"],
                                     ["sanitize"], ["ppcgpt"], ["site-agent"],
                                     ["ledger"]])
def test_help_on_every_command(command):
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "Usage" in result.output


@pytest.mark.parametrize("command, shown", [
    ("prune", "[default: 0.5]"), ("sanitize", "[default: 3.0]"), ("ppcgpt", "[default: 0.3]")])
def test_help_shows_defaults(command, shown):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert shown in result.output


def test_eval_writes_report_and_reproduces_from_config(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = ["eval", "--model", str(tiny_model_dir), "--ppl", "wiki", "--seqlen", "32,64",
            "--max-windows", "3", "--tasks", "hyperbaton,strategyqa", "--limit", "6",
            "--device", "cpu", "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok"
    assert report["config"]["seqlen"] == "32,64"
    assert {"python", "torch", "transformers", "flwr"} <= set(report["versions"])
    ppl = [r for r in report["results"] if "perplexity" in r]
    acc = [r for r in report["results"] if "accuracy" in r]
    assert [r["seqlen"] for r in ppl] == [32, 64]
    assert all(r["windows"] == 3 and r["perplexity"] > 1 and r["seconds"] > 0 for r in ppl)
    assert sorted(r["dataset"] for r in acc) == ["hyperbaton/test", "strategyqa/test"]
    assert all(r["examples"] == 6 and 0 <= r["accuracy"] <= 1 for r in acc)
    assert all(r["name"] == str(tiny_model_dir) for r in report["results"])
    assert "| perplexity |" in (out / "report.md").read_text()

    # Same config file -> same numbers.
    again = tmp_path / "again"
    result = CliRunner().invoke(app, ["eval", "--config", str(out / "config.toml"),
                                      "--out", str(again), "--no-progress"])
    assert result.exit_code == 0, result.output
    report2 = json.loads((again / "report.json").read_text())
    assert [r.get("perplexity") for r in report2["results"]] == [
        r.get("perplexity") for r in report["results"]]
    assert [r.get("accuracy") for r in report2["results"]] == [
        r.get("accuracy") for r in report["results"]]


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--tasks", "no_such_task"], "no_such_task"),
    (["--seqlen", "1000"], "1000"),
    (["--seqlen", "abc"], "expected integers"),
    (["--ppl", "no_such_corpus"], "no_such_corpus"),
])
def test_eval_clear_errors(monkeypatch, capsys, tiny_model_dir, tmp_path, args, message):
    base = ["eval", "--model", str(tiny_model_dir), "--out", str(tmp_path / "o"),
            "--no-progress", "--device", "cpu"]
    code, err = run_main(monkeypatch, capsys, *base, *args)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_empty_corpus_file(monkeypatch, capsys, tiny_model_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    code, err = run_main(monkeypatch, capsys, "eval", "--model", str(tiny_model_dir), "--ppl",
                         str(empty), "--out", str(tmp_path / "o"), "--no-progress")
    assert code == 2
    assert "empty" in err.lower() and "empty.txt" in err


def test_unknown_config_key(monkeypatch, capsys, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('modle = "x"\n')
    code, err = run_main(monkeypatch, capsys, "eval", "--config", str(config))
    assert code == 2
    assert "modle" in err


def test_failed_run_keeps_finished_results(tiny_model_dir, tmp_path):
    """Perplexity finishes, then an error: report.json keeps the result and says 'failed'."""
    out = tmp_path / "run"
    from fedcompress.cli import EVAL_DEFAULTS, run_eval

    settings = dict(EVAL_DEFAULTS, model=str(tiny_model_dir), seqlen="32", max_windows=2,
                    tasks="hyperbaton", limit=-5, out=str(out), device="cpu")
    with pytest.raises(ValueError):
        run_eval(settings, progress=False)
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "failed"
    assert len(report["results"]) == 1 and report["results"][0]["perplexity"] > 1


@pytest.mark.parametrize("args, message", [
    (["--sparsity", "1.0"], "sparsity=1.0 is invalid: expected a number in [0, 1)"),
    (["--clients", "0"], "clients=0 is invalid: expected an integer >= 1"),
    (["--nm", "4:2"], "N:M"),
    (["--group", "block"], "group='block' is invalid: expected one of 'layer', 'row'"),
    (["--mode", "async"], "mode"),
    (["--variants", "some"], "variants"),
    (["--baselines", "dense,oracle"], "oracle"),
])
def test_prune_bad_input_fails_before_any_work(monkeypatch, capsys, tmp_path, args, message):
    import server.simulation
    from fedcompress import models
    from fedcompress.methods.fedprllm import experiment

    def work(*args, **kwargs):  # no Ray start, no model load: the error comes first
        raise AssertionError("work started before the bad input was refused")

    # experiment binds load_model at its import: imported first, it binds the real one (an
    # import under the patch would keep `work` for every later test of this worker), and the
    # name it calls is patched too
    monkeypatch.setattr(server.simulation, "simulate", work)
    monkeypatch.setattr(models, "load_model", work)
    monkeypatch.setattr(experiment, "load_model", work)
    code, err = run_main(monkeypatch, capsys, "prune", "--out", str(tmp_path / "o"), *args)
    assert code == 2
    assert message in err


def test_prune_help():
    result = CliRunner().invoke(app, ["prune", "--help"])
    assert result.exit_code == 0 and "--tie-break" in result.output
