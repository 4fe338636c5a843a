"""`fedcompress report`: one self-contained HTML page per run or bench folder, and runs compared
side by side; checked on small synthetic folders and in a real headless browser (Debian's
chromium: screenshot and page text).

The browser test needs `chromium` on the PATH (`make test` installs it with apt-get when it is
missing, see the Makefile's `browser` target). Without it the test fails; it is skipped only
when the environment says there is no browser: FEDCOMPRESS_NO_BROWSER=1.
"""

from __future__ import annotations

import base64
import html
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


def make_bench(folder: Path, sparsity=(0.5, 0.6), values=(41.5, 22.75, 52.0, 39.75, 60.5,
                                                            70.5, 58.0), clients: int = 4):
    """A bench folder written by the bench's own code (plan, BenchRunner records, the
    report update): 2 sparsities x 2 server groups, dense and centralized baselines."""
    from fedcompress.bench.run import _update
    from fedcompress.bench.sweep import BenchRunner, plan

    raw = {"bench": {"model": "smollm2-135m", "clients": clients, "samples_per_client": 2,
                     "eval_windows": 8},
           "study": {"groups": {"title": "Server groups " + EVIL, "sparsity": list(sparsity),
                                "group": ["layer", "row"],
                                "baselines": ["dense", "centralized"]}}}
    studies = plan(raw)
    runner = BenchRunner(studies, folder)
    values = iter(values)
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


def _one_sparsity_benches(tmp_path, clients=(4, 4)):
    """Two bench runs split by sparsity (0.5, then 0.6), as the peers' SparseGPT configs are:
    cells in plan order (layer, dense, centralized, row)."""
    half = make_bench(tmp_path / "b50", sparsity=[0.5], values=[41.5, 22.75, 40.0, 39.75],
                      clients=clients[0])[0]
    more = make_bench(tmp_path / "b60", sparsity=[0.6], values=[60.5, 22.75, 55.0, 58.0],
                      clients=clients[1])[0]
    return half, more


def test_compare_draws_one_curve_across_runs_split_by_sparsity(tmp_path):
    from fedcompress.report_html import compare_curves, compare_rows

    folders = list(_one_sparsity_benches(tmp_path))
    rows = compare_rows(folders, [load_report(f) for f in folders])
    (curve,) = compare_curves(rows)
    assert curve["dense"] == 22.75
    assert curve["lines"] == {"FedPrLLM one-shot, server layer": [(0.5, 41.5), (0.6, 60.5)],
                              "FedPrLLM one-shot, server row": [(0.5, 39.75), (0.6, 58.0)],
                              "Centralized": [(0.5, 40.0), (0.6, 55.0)]}
    assert curve["title"].startswith("Perplexity against sparsity, smollm2-135m, wanda")
    page = render_compare(folders)
    assert "<h2>Perplexity against sparsity</h2>" in page
    assert page.count('<img alt="Perplexity against sparsity') == 1
    assert (curve["model"], curve["method"]) == ("smollm2-135m", "wanda")
    # the same plot as a file, for a paper or a doc
    out = write_compare(folders, tmp_path / "cmp.html", figures=tmp_path / "fig")
    assert sorted(p.name for p in (tmp_path / "fig").iterdir()) == [
        "perplexity-smollm2-135m-wanda.png"]
    png = (tmp_path / "fig" / "perplexity-smollm2-135m-wanda.png").read_bytes()
    assert base64.b64encode(png).decode() in out.read_text()  # the page's very figure
    # one run alone: no line has two points, no plot (the table says it all)
    single = render_compare(folders[:1])
    assert compare_curves(compare_rows(folders[:1], [load_report(folders[0])])) == []
    assert "Perplexity against sparsity" not in single


def test_figures_of_one_model_and_method_on_two_evaluations_keep_both_files(tmp_path):
    from fedcompress.report_html import curve_name, draw_curves

    curve = {"title": "t", "model": "Qwen/Qwen2.5-1.5B", "method": "sparsegpt",
             "dense": 16.0, "lines": {"Centralized": [(0.5, 21.3), (0.7, 54.2)]}}
    assert curve_name(curve) == "perplexity-qwen-qwen2.5-1.5b-sparsegpt.png"
    drawn = draw_curves([curve, {**curve, "title": "another evaluation"}], tmp_path)
    assert [p.name for _, p in drawn] == ["perplexity-qwen-qwen2.5-1.5b-sparsegpt.png",
                                          "perplexity-qwen-qwen2.5-1.5b-sparsegpt-2.png"]
    assert all(p.stat().st_size > 0 for _, p in drawn)


def test_figures_with_nothing_to_draw_say_so(tmp_path, caplog):
    from fedcompress.report_html import curves_html

    with caplog.at_level("WARNING", logger="fedcompress.report_html"):
        assert curves_html([], tmp_path / "fig") == ""
    assert "no plot to write: no strategy has results at two sparsities" in caplog.text


def test_compare_curves_keep_apart_what_differs_between_runs(tmp_path):
    from fedcompress.report_html import compare_curves, compare_rows

    # the same strategies with 4 and 8 sites: separate lines, named by the setting
    folders = list(_one_sparsity_benches(tmp_path / "a", clients=(4, 8)))
    rows = compare_rows(folders, [load_report(f) for f in folders])
    assert compare_curves(rows) == []  # every line has one point: nothing to draw
    # two runs with the same strategy at the same sparsity and different perplexities:
    # both points kept, the second under its run's label (nothing silently dropped)
    again = make_bench(tmp_path / "again", sparsity=[0.5], values=[43.0, 22.75, 40.0, 39.75])[0]
    folders = [*_one_sparsity_benches(tmp_path / "b"), again]
    rows = compare_rows(folders, [load_report(f) for f in folders])
    labels = {str(p): f"#{i + 1} {p.name}" for i, p in enumerate(folders)}
    (curve,) = compare_curves(rows, labels)
    assert curve["lines"]["FedPrLLM one-shot, server layer"] == [(0.5, 41.5), (0.6, 60.5)]
    assert curve["lines"]["FedPrLLM one-shot, server layer [#3 again]"] == [(0.5, 43.0)]
    assert curve["lines"]["FedPrLLM one-shot, server row"] == [(0.5, 39.75), (0.6, 58.0)]


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
    result = CliRunner().invoke(app, ["report", str(folder), "--figures", str(tmp_path / "f")])
    assert result.exit_code != 0 and "give --compare" in str(result.exception)
    assert not (tmp_path / "f").exists()
    result = CliRunner().invoke(app, ["report", str(folder), str(other)])
    assert result.exit_code != 0 and "give --compare" in str(result.exception)
    help_text = CliRunner().invoke(app, ["report", "--help"], env={"COLUMNS": "200"}).output
    assert "--compare" in help_text and "--out" in help_text and "--figures" in help_text


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
    # the answer is laid out at the top of the page, the diagnostics below it, and every
    # bar of the chart is drawn
    top, bottom = map(int, re.search(r'data-answer-box="(-?\d+),(-?\d+)"', dom).groups())
    diagnostics = int(re.search(r'data-diagnostics-top="(-?\d+)"', dom).group(1))
    assert 0 < top < 150 and top + 300 < bottom < diagnostics, (top, bottom, diagnostics)
    drawn, bars = map(int, re.search(r'data-chart-bars="(\d+)/(\d+)"', dom).groups())
    assert drawn == bars == (9 + 2 if kind == "run" else 8)  # run: + 2 layers
    assert text.index("What this run found") < text.index("Diagnostics")


def test_compare_page_in_headless_chromium(tmp_path):
    one = make_run(tmp_path / "one", ppl=47.92)
    two = make_run(tmp_path / "two", ppl=46.5, name="fedprllm-oneshot-row")
    out = write_compare([one, two], tmp_path / "compare.html")
    dom = _browser(out, tmp_path, "--dump-dom").stdout
    assert '<td class="best num" title="46.5">46.50</td>' in dom and "#2 two" in dom
    report = json.loads((one / "report.json").read_text())
    assert report["command_line"] in dom.replace("&gt;", ">")


# ------------------------------------------------------------------------------------------
# The answer a run's page leads with
# ------------------------------------------------------------------------------------------

def _visible_text(page: str) -> str:
    """The page's text as a reader sees it (no style, script or tags; SVG text included)."""
    page = re.sub(r"<(style|script)\b.*?</\1>", " ", page, flags=re.S)
    page = re.sub(r"<title>.*?</title>", " ", page, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))


def _bars(page: str, svg_class: str = "chart") -> dict[tuple[str, str], float]:
    """{(panel, row): value} of the chart's bars (data-value), or {(layer, ''): value} of a
    per-layer chart."""
    found = {}
    for svg in re.findall(rf'<svg [^>]*class="{svg_class}"[^>]*>.*?</svg>', page, flags=re.S):
        for attrs in re.findall(r"<rect ([^>]*data-value[^>]*)>", svg):
            a = dict(re.findall(r'([\w-]+)="([^"]*)"', attrs))
            key = (a["data-panel"], a["data-row"]) if "data-panel" in a else (a["data-layer"],
                                                                              "")
            found[key] = float(a["data-value"])
    return found


def test_run_page_leads_with_the_answer(tmp_path):
    folder = make_run(tmp_path / "run")
    page = render_run(folder)
    # the answer first, then the results, then the diagnostics
    order = [page.index(x) for x in ('<section id="answer">', "<h2>Results</h2>",
                                     '<section id="diagnostics">', "<h3>Timings</h3>",
                                     "<h3>Config</h3>", "<h3>Versions</h3>")]
    assert order == sorted(order)
    body = page.split("<main>")[1]
    assert body.index('<section id="answer">') < body.index("<table")  # no table before it
    answer = page.split('<section id="answer">')[1].split("</section>")[0]
    lead = _visible_text(answer.split('<p class="lead">')[1].split("</p>")[0])
    # the answer in words, from the results: method, sites, algorithm, against each baseline
    assert lead.startswith("FedPrLLM on smollm2-135m (4 sites, Wanda 50%) reaches")
    assert ("reaches perplexity 47.92 against centralized 48.17 (0.5% lower, better), "
            "dense 22.81 (110.1% higher, worse).") in lead
    assert "The model is 50.0% sparse" in lead
    assert "Privacy: This run has no differential-privacy guarantee" in lead
    # the privacy spent: none, said plainly, with what was released and SecAgg+ off
    text = _visible_text(answer)
    assert "binary pruning masks" in text and "SecAgg+ was off" in text
    # method against baselines: a table and one chart
    table = next(t for t in tables_of(answer).tables if t[0][0] == "method and baselines")
    assert [row[:2] for row in table[1:]] == [["fedprllm-oneshot-layer", "method"],
                                              ["centralized", "baseline"], ["dense", "dense"]]
    assert table[0][2:5] == ["perplexity", "vs dense", "sparsity"]
    assert table[1][2:4] == ["47.92", "+110.1%"]
    assert answer.count('<svg xmlns="http://www.w3.org/2000/svg" class="chart"') == 1
    # what was pruned: the per-layer sparsity chart
    assert "Sparsity per layer of fedprllm-oneshot-layer: 2 layers" in text
    assert _bars(answer, "chart layers") == {("0", ""): 0.5, ("1", ""): 0.5}


def test_chart_numbers_are_the_reports(tmp_path):
    folder = make_run(tmp_path / "run")
    report = load_report(folder)
    bars = _bars(render_run(folder))
    records = {r["name"]: r for r in report["results"]}
    for name, record in records.items():
        assert bars[("perplexity", name)] == record["perplexity"]
        assert bars[("sparsity", name)] == 100 * record["sparsity"]
    assert bars[("seconds", "fedprllm-oneshot-layer")] == records[
        "fedprllm-oneshot-layer"]["federated_seconds"]
    assert bars[("seconds", "centralized")] == records["centralized"]["prune_seconds"]
    assert bars[("bytes_up", "fedprllm-oneshot-layer")] == 13271040
    # a dense model has no compression time or bytes: said, not drawn
    assert ("seconds", "dense") not in bars and ("bytes_up", "dense") not in bars
    assert len(bars) == 3 + 3 + 2 + 1
    # the bar lengths follow the values: each panel is scaled to its own largest value
    page = render_run(folder)
    widths = {r: float(w) for r, w in re.findall(
        r'<rect x="[\d.]+" y="[\d.]+" width="([\d.]+)" height="14" fill="#[0-9a-f]+" '
        r'data-panel="perplexity" data-row="([^"]+)"', page) for w, r in [(r, w)]}
    assert widths["centralized"] > widths["fedprllm-oneshot-layer"] > widths["dense"]


def test_busy_machine_is_judged_by_the_load_before_the_run(tmp_path):
    """The 1-minute load at a run's end counts the run itself (an idle 2-CPU machine running a
    2-thread job ends near 2): only the load when the run started says whether another job
    held the CPUs."""
    folder = make_run(tmp_path / "run")
    path = folder / "report.json"
    report = json.loads(path.read_text())

    def lead(start, end):
        report["machine"].update(cpu_count=2, load_average_start=[start, 1.0, 1.0],
                                 load_average_end=[end, 1.0, 1.0])
        path.write_text(json.dumps(report))
        answer = render_run(folder).split('<section id="answer">')[1].split("</section>")[0]
        return _visible_text(answer.split('<p class="lead">')[1].split("</p>")[0])

    assert "busy machine" not in lead(0.17, 2.18)  # idle before, the run's own load at the end
    assert ("The times were measured on a busy machine (1-minute load average 1.5 on 2 CPUs "
            "when the run started): compare them with care.") in lead(1.5, 3.0)


def test_no_best_claim_for_what_is_not_best(tmp_path):
    # FedPrLLM worse than centralized and than dense: the page must not call it best
    folder = make_run(tmp_path / "run", ppl=52.5)
    page = render_run(folder)
    text = _visible_text(page)
    assert "best" not in text.replace(str(tmp_path), "").lower()  # the test's name is in it
    assert "reaches perplexity 52.50 against centralized 48.17 (9.0% higher, worse)" in text
    # the compare page says what it ranks
    other = make_run(tmp_path / "other", ppl=47.0)
    compare = _visible_text(render_compare([folder, other]))
    assert "best" not in compare.replace(str(tmp_path), "").lower()
    assert "Lowest perplexity among compressed results (dense models aside): 47.00" in compare


def _report(folder: Path, command: str, config: dict, results: list[dict], **extra) -> Path:
    report = RunReport(folder, command, config, argv=["fedcompress", command])
    for record in results:
        report.add_result(record)
    report.extra.update(extra)
    report.finish("ok")
    return folder


def test_privacy_spent_per_site_and_secagg(tmp_path):
    # a PrunePrivyTune run: DP-SGD per site, layers removed, accuracy
    sites = [{"stage": "train", "round": r, "node": 10 + p, "partition": p, "sigma": 0.76,
              "sample_rate": 0.125, "epsilon_spent": e * r / 2}
             for p, e in enumerate([7.99, 7.5]) for r in (1, 2)]
    folder = _report(
        tmp_path / "pt", "privytune",
        {"model": "smollm2-135m", "rounds": 2, "dp_delta": 1e-5, "mode": "lora"},
        [{"name": "federated", "accuracy": 0.6346, "layers": 27, "removed": 3, "epsilon": 8.0,
          "epsilon_spent_max": 7.99, "sites": 2, "central_epsilon": None, "seconds": 952.6,
          "bytes_up_per_site_round": 8867871},
         {"name": "central", "accuracy": 0.6844, "layers": 27, "removed": 3, "seconds": 300.8}],
        sites=sites, removal={"plan": {"policy": "lowest", "num_layers": 30,
                                       "removed": [12, 13, 14], "method": "cosine"}})
    page = render_run(folder)
    text = _visible_text(page)
    assert ("PrunePrivyTune on smollm2-135m (2 sites, 3 of 30 layers removed, 2 round(s), lora "
            "fine-tuning) reaches accuracy 0.6346 against central 0.6844 (7.3% lower, worse).") \
        in text
    assert "DP-SGD at each site: epsilon 7.99 spent at most (target 8.0), delta 1e-05" in text
    assert "no differential-privacy guarantee" not in text
    privacy = next(t for t in tables_of(page).tables if t[0][:2] == ["site", "epsilon (this run)"])
    assert [row[:2] for row in privacy[1:]] == [["0", "7.99"], ["1", "7.5"]]
    assert "3 of 30 layers removed (by index, from 0): 12, 13, 14; policy lowest" in text
    assert _bars(page, "chart layers")[("13", "")] == 1.0
    assert _bars(page)[("accuracy", "central")] == 0.6844
    # a FedPrLLM run with SecAgg+ and site ledgers
    folder = make_run(tmp_path / "secure")
    report = json.loads((folder / "report.json").read_text())
    report["config"]["secagg"] = True
    report["secagg"] = {"sum": {"sites": 4, "threshold": 3, "votes": 1, "authenticated": True}}
    report["site_ledgers"] = [{"node": 5, "replies": 1, "dp_releases": 0,
                               "ledger_run_epsilon": 0.0}]
    (folder / "report.json").write_text(json.dumps(report))
    text = _visible_text(render_run(folder))
    assert "SecAgg+ hid the individual sites: the server saw only the sum over 4 sites " \
           "(threshold 3, keys signed" in text
    assert "This run has no differential-privacy guarantee" in text


@pytest.mark.parametrize("kind", ["empty", "stopped", "unknown", "no-fields", "ppcgpt",
                                  "personalize"])
def test_answer_degrades_without_inventing(tmp_path, kind):
    folder = tmp_path / kind
    if kind == "empty":  # a run that failed before any result
        _report(folder, "prune", {"model": "smollm2-135m"}, [])
        expect = ["This prune report holds no finished result", "Not in this report: results"]
    elif kind == "stopped":  # a run stopped after its dense baseline
        report = RunReport(folder, "prune", {"clients": 4}, argv=["fedcompress", "prune"])
        report.add_result({"name": "dense", "perplexity": 118.1})
        expect = ["This prune report holds no FedPrLLM result; finished: dense perplexity "
                  "118.1. The run's status is running", "Not in this report: the FedPrLLM result"]
    elif kind == "unknown":  # a script's report: results without roles or quality
        _report(folder, "ledger-cost", {"n": 3}, [{"name": "a", "ms": 1.0},
                                                  {"name": "b", "ms": 2.0}])
        expect = ["This ledger-cost report holds 2 finished result(s), none with a "
                  "perplexity or an accuracy", "This report records no privacy accounting "
                  "(no epsilon, no secure-aggregation summary), so it states no "
                  "differential-privacy guarantee; what it released and whether SecAgg+ hid "
                  "individual sites are not recorded in it."]
        page = render_run(folder)
        assert "SecAgg+ was off" not in page  # not known for a script: not claimed
        assert "Method against baselines" not in page  # nothing to compare: no empty table
    elif kind == "no-fields":  # a method with a perplexity and nothing else
        _report(folder, "prune", {}, [{"name": "fedprllm-oneshot-layer", "perplexity": 50.0}])
        expect = ["FedPrLLM reaches perplexity 50.00; the report holds no baseline",
                  "The report does not record the model's sparsity or size",
                  "Not in this report: baselines", "time: no result records it",
                  "bytes sent: no result records it",
                  "The report records no per-layer sparsity or removal plan"]
    elif kind == "ppcgpt":
        _report(folder, "ppcgpt", {"model": "smollm2-135m", "clients": 2},
                [{"name": "ppcgpt", "acc_client": 0.61, "layers": 24, "removed": 6,
                  "synthetic": 40, "round2_seconds": 12.5, "per_client": [{"partition": 0}]},
                 {"name": "plain-c", "acc_client": 0.55, "layers": 30, "removed": 0},
                 {"name": "dense", "acc_client": 0.66, "layers": 30, "removed": 0}],
                privacy={"eps_per_word": 3.0, "mechanism": "custext",
                         "eps_per_example_max": 24.0,
                         "clients": [{"partition": 0, "eps_per_word": 3.0,
                                      "eps_per_example_max": 24.0, "examples": 8}]})
        expect = ["PPC-GPT on smollm2-135m (2 sites, 6 layers removed, 40 synthetic samples) "
                  "reaches accuracy at the sites 0.61 against plain-c 0.55 (10.9% higher, "
                  "better), dense 0.66 (7.6% lower, worse).",
                  "Text perturbation (custext): epsilon 3 per word",
                  "6 of 30 transformer layers were removed (20.0% of the blocks)."]
        assert "time: no result records it" not in _visible_text(render_run(folder))
        assert _bars(render_run(folder))[("seconds", "ppcgpt")] == 12.5  # round 2
    else:
        _report(folder, "personalize", {"model": "smollm2-135m", "sparsity": 0.5},
                [{"name": "site-0", "site": 0, "personalized": 30.0, "fedprllm": 33.0},
                 {"name": "site-1", "site": 1, "personalized": 40.0, "fedprllm": 39.0}],
                geometric_mean_perplexity={"personalized": 34.64, "fedprllm": 35.87,
                                           "dense": 20.0})
        expect = ["Personalized pruning on smollm2-135m (2 sites, sparsity 50.0%) reaches "
                  "perplexity 34.64 against fedprllm 35.87 (3.4% lower, better), dense 20.00",
                  "personalized (geometric mean over 2 sites)"]
    page = render_run(folder)
    text = _visible_text(page)
    for sentence in expect:
        assert sentence in text, sentence
    assert "best" not in text.lower()
    assert page.index('<section id="answer">') < page.index('<section id="diagnostics">')
    assert _external_refs(page) == []


def test_several_server_variants_lead_with_the_configured_one(tmp_path):
    folder = _report(tmp_path / "variants", "prune",
                     {"clients": 4, "method": "wanda", "sparsity": 0.5, "group": "row",
                      "scale": False},
                     [{"name": "dense", "perplexity": 22.0},
                      {"name": "fedprllm-oneshot-layer", "perplexity": 47.0, "sparsity": 0.5,
                       "server_group": "layer", "scale": False},
                      {"name": "fedprllm-oneshot-row", "perplexity": 49.0, "sparsity": 0.5,
                       "server_group": "row", "scale": False}])
    text = _visible_text(render_run(folder))
    # the configured variant (row) answers, though another variant is lower: no "best"
    assert ("FedPrLLM (4 sites, Wanda 50%, server vote per row) reaches perplexity 49.00 "
            "against dense 22.00 (122.7% higher, worse). This is the configured server "
            "variant; the 2 FedPrLLM results range 47.00-49.00.") in text
    assert "best" not in text.replace(str(tmp_path), "").lower()


def test_a_results_nan_and_inf_are_floats_again_when_read_back(tmp_path):
    """JSON has no nan or inf: a report stores them as text; read back, a result's are floats
    (a personalized site whose plan failed has perplexity nan: its study's table compares it)."""
    import math

    from fedcompress.report import RunReport

    report = RunReport(tmp_path / "run", "bench", {})
    with report:
        report.add_result({"name": "p", "perplexity": {"personalized": [12.5, math.nan]},
                           "worst": math.inf})
    stored = json.loads((tmp_path / "run" / "report.json").read_text())["results"][0]
    assert stored["perplexity"]["personalized"][1] == "nan" and stored["worst"] == "inf"
    (result,) = load_report(tmp_path / "run")["results"]
    assert math.isnan(result["perplexity"]["personalized"][1])
    assert result["perplexity"]["personalized"][0] == 12.5 and result["worst"] == math.inf
