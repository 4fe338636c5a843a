"""Run reports: what they record of the command line."""

from __future__ import annotations

from fedcompress.report import RunReport


def test_command_line_never_records_the_flower_token(tmp_path):
    argv = ["flwr-serverapp", "--runtime-api-address", "127.0.0.1:1", "--token", "s3cret"]
    report = RunReport(tmp_path, "prune", {"x": 1}, argv=argv)
    assert "s3cret" not in report.command_line and "--token '***'" in report.command_line
    assert "s3cret" not in (tmp_path / "report.json").read_text()
    assert "s3cret" not in (tmp_path / "report.md").read_text()


def test_script_report_spells_out_every_option(tmp_path):
    import argparse

    opts = argparse.Namespace(model="smollm2-135m", seeds=[0, 1], fast=True, slow=False,
                              limit=None, out=str(tmp_path / "r"))
    report = RunReport.for_script("simulations/local_methods.py", opts, seeds={"seed": 0})
    assert report.command == "local-methods"
    assert report.reproduce == report.command_line == (
        f"python simulations/local_methods.py --model smollm2-135m --seeds 0 1 --fast "
        f"--out {tmp_path / 'r'}")
    assert "--model smollm2-135m" in (tmp_path / "r" / "report.md").read_text()


def test_report_records_the_load_average_at_start_and_end(tmp_path, monkeypatch):
    import json
    import os

    loads = iter([(3.5, 2.25, 1.0), (0.5, 1.0, 1.5)])
    monkeypatch.setattr(os, "getloadavg", lambda: next(loads))
    report = RunReport(tmp_path, "prune", {"x": 1})
    assert "3.5 / 2.25 / 1.0 at the start" in (tmp_path / "report.md").read_text()
    report.finish()
    machine = json.loads((tmp_path / "report.json").read_text())["machine"]
    assert machine["load_average_start"] == [3.5, 2.25, 1.0]
    assert machine["load_average_end"] == [0.5, 1.0, 1.5]
    assert "3.5 / 2.25 / 1.0 at the start, 0.5 / 1.0 / 1.5 at the end" in (
        tmp_path / "report.md").read_text()


def test_tree_state_is_dirty_for_code_not_for_a_results_own_files(tmp_path):
    """Re-running a committed result replaces its files under simulations/results/: the tree
    stays clean; a changed tracked file elsewhere makes it dirty."""
    import subprocess

    from fedcompress.report import tree_state

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    result = tmp_path / "simulations" / "results" / "r" / "report.json"
    result.parent.mkdir(parents=True)
    result.write_text("{}")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    clean = tree_state(tmp_path)
    assert clean and not clean.endswith("+dirty")
    result.unlink()  # the re-run starts afresh
    assert tree_state(tmp_path) == tree_state(tmp_path / "simulations") == clean
    (tmp_path / "code.py").write_text("x = 2\n")
    assert tree_state(tmp_path) == tree_state(tmp_path / "simulations") == clean + "+dirty"
