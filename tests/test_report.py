"""Run reports: what they record of the command line."""

from __future__ import annotations

from fedcompress.report import RunReport


def test_command_line_never_records_the_flower_token(tmp_path):
    argv = ["flwr-serverapp", "--runtime-api-address", "127.0.0.1:1", "--token", "s3cret"]
    report = RunReport(tmp_path, "prune", {"x": 1}, argv=argv)
    assert "s3cret" not in report.command_line and "--token '***'" in report.command_line
    assert "s3cret" not in (tmp_path / "report.json").read_text()
    assert "s3cret" not in (tmp_path / "report.md").read_text()
