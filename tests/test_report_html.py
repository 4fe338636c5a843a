"""`fedcompress report`: one self-contained HTML page per run or bench folder, and runs compared
side by side; checked on small synthetic folders and in a real headless browser (Debian's
chromium: screenshot and page text).

The browser test needs `chromium` on the PATH (`make test` installs it with apt-get when it is
missing, see the Makefile's `browser` target). Without it the test fails; it is skipped only
when the environment says there is no browser: FEDCOMPRESS_NO_BROWSER=1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedcompress.cli import app, main
from fedcompress.report import RunReport
from fedcompress.report_html import (
    ReportError,
    human_bytes,
    load_report,
    render_compare,
    render_run,
    write_compare,
    write_report,
)

EVIL = '<script>alert("x")</script>&<b>'


# ------------------------------------------------------------------------------------------
# Synthetic folders
# ------------------------------------------------------------------------------------------

def _png(path: Path, color: tuple[int, int, int] = (200, 40, 40)) -> Path:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (240, 160), "white")
    ImageDraw.Draw(image).rectangle((20, 20, 200, 120), fill=color)
    image.save(path)
    return path


def make_run(folder: Path, ppl: float = 47.92, name: str = "fedprllm-oneshot-layer",
             evil: bool = False) -> Path:
    """A `prune`-shaped run: dense / fedprllm / centralized results, a rejected site, the
    defence's decision, a section with an image, a plot."""
    config = {"model": "smollm2-135m", "method": "wanda", "sparsity": 0.5, "clients": 4,
              "note": EVIL if evil else "plain"}
    argv = ["fedcompress", "prune", "--out", str(folder), "--sparsity", "0.5"]
    if evil:
        argv.append(EVIL)
    report = RunReport(folder, "prune", config, seeds={"seed": 0}, argv=argv)
    _png(folder / "ppl-curve.png")
    _png(folder / "inline.png", (40, 40, 200))
    report.sections.append(("Privacy " + (EVIL if evil else ""),
                            "Some **notes**" + (f" {EVIL}" if evil else "")
                            + ".\n\n![inline](inline.png)\n\n| a | b |\n|---|---|\n| 1 | 2 |"))
    report.add_result({"name": "dense", "perplexity": 22.809, "sparsity": 0.0003,
                       "eval_seconds": 32.4})
    report.add_result({"name": name + (EVIL if evil else ""), "perplexity": ppl,
                       "sparsity": 0.5, "rounds": 1, "clients": 4, "valid_clients": 3,
                       "bytes_up_per_client": 13271040, "bytes_down_per_client": 302,
                       "federated_seconds": 109.59, "eval_seconds": 32.9,
                       "sparsity_per_layer": [0.5, 0.5]})
    report.add_result({"name": "centralized", "perplexity": 48.17, "sparsity": 0.5,
                       "prune_seconds": 56.4, "eval_seconds": 33.5})
    report.extra["rejected"] = [{"stage": "masks", "round": 1, "node": 77,
                                 "reason": "invalid masks: sparsity 0.99" + (
                                     EVIL if evil else "")}]
    report.extra["defence_outcome"] = {"layer": {"threshold": 0.0123, "rejected": [2],
                                                 "rejected_nodes": [77],
                                                 "distances": [0.01, 0.011, 0.4, 0.009]}}
    report.extra["model"] = {"spec": "smollm2-135m", "num_layers": 30}
    with report.phase("federated_pruning"):
        pass
    report.finish("ok")
    return folder


def make_bench(folder: Path):
    """A bench folder written by the bench's own code (plan, BenchRunner records, the
    report update): 2 sparsities x 2 server groups, dense and centralized baselines."""
    from fedcompress.bench.run import _update
    from fedcompress.bench.sweep import BenchRunner, plan

    raw = {"bench": {"model": "smollm2-135m", "clients": 4, "samples_per_client": 2,
                     "eval_windows": 8},
           "study": {"groups": {"title": "Server groups " + EVIL, "sparsity": [0.5, 0.6],
                                "group": ["layer", "row"],
                                "baselines": ["dense", "centralized"]}}}
    studies = plan(raw)
    runner = BenchRunner(studies, folder)
    values = iter([41.5, 22.75, 52.0, 39.75, 60.5, 70.5, 58.0])
    for cell in studies[0].cells:
        result = {"perplexity": next(values), "eval_seconds": 1.5, "sparsity": 0.5}
        if cell.kind == "fedprllm":
            result.update(client_seconds_mean=3.0, count_seconds=0.5, aggregate_seconds=0.25,
                          rounds=1, bytes_up_per_client=2048, bytes_up_total=8192)
        runner._record(cell, {**result, "status": "ok"})
    report = RunReport(folder, "bench", raw, argv=["fedcompress", "bench", "b.toml"])
    report.markdown_results = False
    _update(report, runner, studies)
    _png(folder / "ppl-sparsity.png")
    report.finish("ok")
    return folder, studies, runner


class _Tables(HTMLParser):
    """Every <table> of a page as rows of cell texts, and the cells marked best."""

    def __init__(self):
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.best: list[str] = []
        self._cell: list[str] | None = None
        self._best = False

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []
            self._best = "best" in (dict(attrs).get("class") or "").split()

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            text = "".join(self._cell).strip()
            self.tables[-1][-1].append(text)
            if self._best:
                self.best.append(text)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def tables_of(page: str) -> _Tables:
    parser = _Tables()
    parser.feed(page)
    return parser


def _external_refs(page: str) -> list[str]:
    """src/href values that would make the browser fetch something."""
    refs = re.findall(r'\b(?:src|href)="([^"]*)"', page)
    return [r for r in refs if not r.startswith(("data:", "#"))] + re.findall(
        r"<link\b|@import|url\((?!data:)", page)


# ------------------------------------------------------------------------------------------
# The page of a run
# ------------------------------------------------------------------------------------------

def test_run_page_is_self_contained_and_complete(tmp_path):
    folder = make_run(tmp_path / "run")
    path = write_report(folder)
    assert path == folder / "report.html"
    page = path.read_text()
    assert _external_refs(page) == []
    assert page.count("<img ") == 2 and page.count('src="data:image/png;base64,') == 2
    assert "<h1>fedcompress prune" in page and ">ok</span>" in page
    assert f"fedcompress prune --config {folder / 'config.toml'}" in page  # reproduce
    assert "fedcompress prune --out" in page  # command line
    assert "best perplexity" not in page.lower()
    tables = tables_of(page)
    summary = next(t for t in tables.tables if t[0][0] == "result")
    assert summary[0][:3] == ["result", "sparsity", "perplexity"]
    fed = next(row for row in summary if row[0] == "fedprllm-oneshot-layer")
    assert fed[2:] == ["47.92", "109.59", "federated", "12.66 MiB", "302 B", "1", "3"]
    assert "13,271,040" in page  # the exact byte count as the cell's tooltip
    # every field of every result, one table per kind of record
    flat = [cell for table in tables.tables for row in table for cell in row]
    for text in ("22.81", "48.17", "56.40", "32.90", "federated_pruning", "valid_clients"):
        assert text in flat
    # the best compressed perplexity is highlighted, not the dense model's
    assert "47.92" in tables.best and "22.81" not in tables.best
    # rejected sites, the defence's decision, timings, config, versions, machine, extras
    for heading in ("Rejected sites", "Defence outcome", "Plots", "Diagnostics"):
        assert f"<h2>{heading}</h2>" in page
    diagnostics = page.split('<section id="diagnostics">')[1]
    for heading in ("Timings", "Config", "Versions", "Machine", "More from report.json",
                    "Command line and reproduce"):
        assert f"<h3>{heading}</h3>" in diagnostics
    assert "invalid masks: sparsity 0.99" in page and "0.0123" in page
    assert "torch" in flat and "wanda" in flat
    # the report.md section is rendered (bold, table, inline image), its Results not twice
    assert "<strong>notes</strong>" in page and "inline.png" not in page.split("<h2>Plots")[1]
    assert page.count("<h2>Results</h2>") == 1


def test_every_string_is_escaped(tmp_path):
    folder = make_run(tmp_path / "evil", evil=True)
    page = render_run(folder)
    assert page.count("<script") == 1  # the page's own script only
    assert "<b>" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&lt;b&gt;" in page
    # in the config, the result's name, the rejected reason, the command line, the section
    assert page.count("&lt;script&gt;alert") >= 5
    bench, _, _ = make_bench(tmp_path / "bench")
    page = render_run(bench)
    assert page.count("<script") == 1 and "Server groups &lt;script&gt;" in page


def test_missing_report_json_names_the_folder(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    with pytest.raises(ReportError, match=r"not-a-run: no report\.json; expected a run or bench "
                                          r"output folder"):
        load_report(empty)
    with pytest.raises(ReportError, match="not a folder"):
        load_report(tmp_path / "missing")
    (empty / "report.json").write_text("{not json")
    with pytest.raises(ReportError, match=r"report\.json: not readable as JSON"):
        render_run(empty)
    monkeypatch.setattr(sys, "argv", ["fedcompress", "report", str(tmp_path / "missing")])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    assert "missing: not a folder" in capsys.readouterr().err


def test_human_bytes():
    assert human_bytes(302) == "302 B"
    assert human_bytes(13271040) == "12.66 MiB"
    assert human_bytes(3 * 2**30) == "3.00 GiB"


# ------------------------------------------------------------------------------------------
# The page of a bench
# ------------------------------------------------------------------------------------------

def test_bench_page_has_the_same_study_tables_as_report_md(tmp_path):
    from fedcompress.bench.tables import study_table

    folder, studies, runner = make_bench(tmp_path / "bench")
    page = write_report(folder).read_text()
    header, body = study_table(studies[0], runner.results)
    tables = tables_of(page)
    assert [header, *body] in tables.tables
    assert header == ["strategy", "sparsity=0.5", "sparsity=0.6"]
    md = (folder / "report.md").read_text()
    for row in body:  # the very rows report.md shows
        assert "| " + " | ".join(row) + " |" in md
    # the lowest value of each column but the dense model's is highlighted
    assert body == [["Dense", "22.75", "22.75"], ["Centralized", "52.00", "70.50"],
                    ["FedPrLLM one-shot, server layer", "41.50", "60.50"],
                    ["FedPrLLM one-shot, server row", "39.75", "58.00"]]
    studies_part = page.split("<h2>Studies</h2>")[1].split("<h2>")[0]
    assert sorted(tables_of(studies_part).best) == ["39.75", "58.00"]
    # the report.md sections rendered from report.json are not repeated
    assert page.count("<h3>Server groups") == 1
    assert "Server aggregation cost vs client mask computation" in page
    assert _external_refs(page) == [] and 'src="data:image/png;base64,' in page
    # every cell in the results table
    summary = tables.tables[[t[0][0] for t in tables.tables].index("result")]
    assert len(summary) == 1 + len(runner.results)


# ------------------------------------------------------------------------------------------
# Runs compared
# ------------------------------------------------------------------------------------------

def test_compare_puts_runs_side_by_side(tmp_path):
    one = make_run(tmp_path / "one", ppl=47.92)
    two = make_run(tmp_path / "two", ppl=46.5, name="fedprllm-oneshot-row")
    bench, _, runner = make_bench(tmp_path / "bench")
    out = write_compare([one, two, bench], tmp_path / "cmp" / "compare.html")
    page = out.read_text()
    assert _external_refs(page) == []
    tables = tables_of(page)
    (table,) = tables.tables
    header = table[0]
    assert header[:2] == ["run", "result"] and "perplexity" in header
    assert "bytes up / client" in header and "rounds" in header and "time (s)" in header
    assert len(table) - 1 == 3 + 3 + len(runner.results)
    ppl = header.index("perplexity")
    # the best perplexity over every run (dense aside) is highlighted: 39.75 in the bench
    assert tables.best == ["39.75"]
    row = next(r for r in table if r[1] == "fedprllm-oneshot-row")
    assert row[0] == "#2 two" and row[ppl] == "46.50"
    assert row[header.index("bytes up / client")] == "12.66 MiB"
    assert row[header.index("sparsity")] == "0.5"
    bench_row = next(r for r in table if r[1].startswith("FedPrLLM one-shot, server row"))
    assert bench_row[header.index("time measured")] == "clients + server"
    assert bench_row[header.index("time (s)")] == "3.75"
    # each run's command line
    assert f"fedcompress prune --out {one} --sparsity 0.5" in page
    assert f"fedcompress prune --out {two} --sparsity 0.5" in page
    assert "fedcompress bench b.toml" in page
    with pytest.raises(ReportError, match="no report.json"):
        render_compare([one, tmp_path])


def test_cli_report_prints_the_path(tmp_path):
    folder = make_run(tmp_path / "run")
    result = CliRunner().invoke(app, ["report", str(folder)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(folder / "report.html")
    assert (folder / "report.html").is_file()
    other = make_run(tmp_path / "other", ppl=40.0)
    out = tmp_path / "cmp.html"
    result = CliRunner().invoke(app, ["report", "--compare", str(folder), str(other),
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(out) and "runs compared" in out.read_text()
    result = CliRunner().invoke(app, ["report", str(folder), str(other)])
    assert result.exit_code != 0 and "give --compare" in str(result.exception)
    help_text = CliRunner().invoke(app, ["report", "--help"], env={"COLUMNS": "200"}).output
    assert "--compare" in help_text and "--out" in help_text


# ------------------------------------------------------------------------------------------
# In a real browser
# ------------------------------------------------------------------------------------------

def _chromium() -> str:
    found = shutil.which("chromium")
    if found:
        return found
    if os.environ.get("FEDCOMPRESS_NO_BROWSER"):
        pytest.skip("FEDCOMPRESS_NO_BROWSER is set: no browser on this machine")
    pytest.fail("chromium is not on the PATH: the report page's browser test needs Debian's "
                "chromium (`make browser`, or `apt-get install -y chromium`); set "
                "FEDCOMPRESS_NO_BROWSER=1 only on a machine that cannot have a browser")


def _browser(page: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu",
               "--disable-dev-shm-usage", "--hide-scrollbars", "--no-first-run",
               f"--user-data-dir={tmp_path / 'chromium-profile'}", *args,
               page.resolve().as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{command} failed: {done.stderr[-2000:]}"
    return done


def _check_screenshot(path: Path) -> None:
    from PIL import Image

    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        assert image.size == (1280, 2000)
        rgb = image.convert("RGB")
        colors = rgb.getcolors(maxcolors=1 << 20)
        assert colors is not None and len(colors) > 50, "a blank or nearly blank screenshot"
        white = sum(n for n, c in colors if c == (255, 255, 255))
        assert white < 0.97 * 1280 * 2000, "a blank screenshot"
        dark = sum(n for n, c in colors if sum(c) < 200)  # text
        assert dark > 2000
        assert path.stat().st_size > 20_000


@pytest.mark.parametrize("kind", ["run", "bench"])
def test_page_in_headless_chromium(tmp_path, kind):
    if kind == "run":
        folder = make_run(tmp_path / "run")
        expected = ["47.92", "12.66 MiB", "48.17", "invalid masks: sparsity 0.99",
                    f"fedcompress prune --config {folder / 'config.toml'}"]
        images = "2/2"
    else:
        folder, _, _ = make_bench(tmp_path / "bench")
        expected = ["Server groups", "sparsity=0.6", "39.75", "70.50", "Centralized"]
        images = "1/1"
    page = write_report(folder)
    shot = tmp_path / "shot.png"
    _browser(page, tmp_path, f"--screenshot={shot}", "--window-size=1280,2000")
    _check_screenshot(shot)
    dom = _browser(page, tmp_path, "--dump-dom").stdout
    assert f'data-images-decoded="{images}"' in dom  # every embedded PNG decoded
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))
    text = text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    for value in expected:
        assert value in text, value
    assert "Some embedded images did not load" in text  # present in the DOM, hidden by CSS
    assert 'id="img-warning" style="display' not in dom  # and never shown


def test_compare_page_in_headless_chromium(tmp_path):
    one = make_run(tmp_path / "one", ppl=47.92)
    two = make_run(tmp_path / "two", ppl=46.5, name="fedprllm-oneshot-row")
    out = write_compare([one, two], tmp_path / "compare.html")
    dom = _browser(out, tmp_path, "--dump-dom").stdout
    assert '<td class="best num" title="46.5">46.50</td>' in dom and "#2 two" in dom
    report = json.loads((one / "report.json").read_text())
    assert report["command_line"] in dom.replace("&gt;", ">")
