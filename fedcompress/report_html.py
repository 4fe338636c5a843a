"""One self-contained HTML page per run (``fedcompress report DIR``); the page putting several
runs side by side (``fedcompress report --compare DIR1 DIR2 ...``) is
:mod:`fedcompress.report_compare`, and the pieces both pages are built from are
:mod:`fedcompress.report_page` (their public names are importable from here too).

The page of a run or bench folder (a folder :class:`~fedcompress.report.RunReport` wrote) leads
with what the run found (:mod:`fedcompress.report_answer`): the answer in words, the method
against its baselines as a table and an inline SVG chart, what was pruned per layer and the
privacy spent. Below come a bench's study tables (the same tables as its ``report.md``, from
:mod:`fedcompress.bench.tables`), the other sections of ``report.md``, every result, the PNG
plots, rejected sites and the defence's decision when there are any; then the diagnostics:
site start-up, timings, the command line and how to reproduce it, config, versions and
machine. Everything is in the one file: CSS inline, images as base64 data URIs,
no external resource (the page opens offline and can be mailed or archived as it is). Every
string from the report is escaped; ``report.md`` is rendered with raw HTML disabled.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from fedcompress.report_answer import MAX_CHART_ROWS, answer, blank, chart_svg, layers_svg
from fedcompress.report_compare import (
    TIME_NOTE,
    compare_curves,
    compare_rows,
    curve_name,
    curves_html,
    draw_curves,
    render_compare,
    summary_table,
    write_compare,
)
from fedcompress.report_page import (
    IMAGE_TYPES,
    ReportError,
    bench_cell_settings,
    best_index,
    best_indices,
    code_block,
    data_uri,
    esc,
    flatten,
    format_value,
    generic_html,
    html_table,
    human_bytes,
    kv_table,
    load_report,
    markdown_html,
    markdown_inline,
    markdown_sections,
    page_html,
    result_time,
    started_text,
    status_badge,
)

__all__ = [
    "ReportError", "load_report", "human_bytes", "format_value", "best_indices", "best_index",
    "markdown_sections", "results_html", "bench_studies", "study_html", "answer_html",
    "render_run", "write_report", "compare_rows", "compare_curves", "curve_name", "draw_curves",
    "curves_html", "summary_table", "render_compare", "write_compare",
]

logger = logging.getLogger(__name__)

#: Sections of ``report.md`` the page renders from ``report.json`` instead.
_FROM_JSON = ("Results", "Timings (s)", "Config", "Versions", "Plots")


def _group_results(results: list[dict]) -> list[list[dict]]:
    """Records grouped by their set of scalar fields (as report.md's tables)."""
    groups: dict[tuple[str, ...], list[dict]] = {}
    for record in results:
        key = tuple(k for k, v in record.items() if not isinstance(v, (dict, list)))
        groups.setdefault(key, []).append(record)
    return list(groups.values())


def results_html(results: list[dict]) -> str:
    """One table per kind of record; a column with the same value in every row (of several)
    is said once above its table; the best perplexity (lowest, not dense) and accuracy
    (highest) are highlighted."""
    if not results:
        return '<p class="note">No results.</p>'
    parts = []
    for records in _group_results(results):
        columns = [k for k, v in records[0].items() if not isinstance(v, (dict, list))]
        columns = ["name", *[c for c in columns if c != "name"]]
        keep = ("name", "perplexity", "accuracy", "status")
        same = [c for c in columns if len(records) > 1 and c not in keep
                and len({json.dumps(r.get(c)) for r in records}) == 1]
        shown = [c for c in columns if c not in same]
        rows, tips, classes = [], {}, {}
        for r, record in enumerate(records):
            row = []
            for c, col in enumerate(shown):
                text, tip = format_value(col, record.get(col))
                row.append(text)
                tips[(r, c)] = tip
            rows.append(row)
        for metric, lower in (("perplexity", True), ("accuracy", False)):
            if metric in shown:
                for best in best_indices(records, metric, lower) if len(records) > 1 else []:
                    classes[(best, shown.index(metric))] = "best"
        for r, record in enumerate(records):
            if record.get("status") not in (None, "ok"):
                classes[(r, 0)] = "bad"
        numeric = {c for c, col in enumerate(shown)
                   if any(isinstance(rec.get(col), (int, float)) for rec in records)}
        if same:
            parts.append('<p class="note">Same in every row: ' + ", ".join(
                f"{esc(c)}={esc(format_value(c, records[0].get(c))[0])}" for c in same) + "</p>")
        parts.append(html_table(shown, rows, classes=classes, tips=tips, numeric=numeric))
    return "\n".join(parts)


def bench_studies(report: dict[str, Any]) -> list[tuple[Any, dict[str, dict]]]:
    """A bench report's studies as :class:`~fedcompress.bench.sweep.Study` objects with their
    cells rebuilt from the stored results (a result record holds its cell's settings between
    ``client_id`` and ``eval``), and the results keyed by those cells' ids, for
    :func:`fedcompress.bench.tables.study_table`. Cells not finished yet (no record) are left
    out. Empty for any other report."""
    from fedcompress.bench.sweep import BENCH_KEYS, STUDY_KEYS, Cell, Study

    studies = report.get("studies")
    config = report.get("config", {})
    if report.get("command") != "bench" or not isinstance(studies, dict):
        return []
    by_id = {r.get("id"): r for r in report.get("results", [])}
    out = []
    for name, meta in studies.items():
        settings = {**config.get("bench", {}), **config.get("study", {}).get(name, {})}
        for key in (*STUDY_KEYS, *BENCH_KEYS):
            settings.pop(key, None)
        study = Study(name, meta.get("title", name), settings, list(meta.get("swept", [])),
                      [], meta.get("columns"), kind=meta.get("kind", "fedprllm"),
                      options=dict(meta.get("options") or {}))
        results: dict[str, dict] = {}
        for cell_id in meta.get("cells", []):
            record = by_id.get(cell_id)
            if record is None:
                continue
            cell_settings = bench_cell_settings(record)
            kind = cell_settings.pop("kind", record.get("kind", "fedprllm"))
            cell = Cell(kind, tuple(cell_settings.items()))
            study.cells.append(cell)
            results[cell.id] = record
        out.append((study, results))
    return out


def study_html(study: Any, results: dict[str, dict]) -> str:
    """One study's tables (:func:`fedcompress.bench.tables.study_tables`, as in report.md): a
    FedPrLLM study's perplexities, a network study's simulated times, a leakage study's
    quantities; where lower is better, the lowest value of each column (not the dense
    model's) highlighted."""
    from fedcompress.bench.tables import _fmt as bench_fmt
    from fedcompress.bench.tables import study_tables

    parts = [f"<h3>{esc(study.title)}</h3>"]
    for table in study_tables(study, results):
        header, first = table.header, table.first_value
        body = [[cell.replace("\\|", "|") for cell in row] for row in table.body]
        classes = {}
        for c in range(first, len(header)) if table.best == "min" else ():
            values = {}
            for r, row in enumerate(body):
                try:
                    if "Dense" not in row[:first]:
                        values[r] = float(row[c])
                except ValueError:  # pending, failed, empty
                    continue
            for r, value in values.items():
                if value == min(values.values()):
                    classes[(r, c)] = "best"
        if table.caption:
            parts.append(f"<h4>{esc(table.caption)}</h4>")
        if study.kind == "fedprllm":
            fixed = {k: v for k, v in study.settings.items() if k not in study.swept}
            parts.append('<p class="note">Perplexity (lower is better; the lowest of each '
                         "column but the dense model's is highlighted). Fixed: "
                         + esc(", ".join(f"{k}={bench_fmt(v)}" for k, v in sorted(fixed.items())))
                         + ".</p>")
        elif table.note:
            parts.append(f'<p class="note">{markdown_inline(table.note)}'
                         + (" The lowest of each profile's column is highlighted."
                            if table.best == "min" else "") + "</p>")
        numeric = set(range(first, len(header))) if table.best == "min" else set()
        parts.append(html_table(header, body, classes=classes, numeric=numeric))
    return "".join(parts)

#: report.json keys every report has (rendered in their own sections).
_STANDARD = ("command", "command_line", "reproduce", "status", "started", "config", "seeds",
             "versions", "machine", "timings", "results", "rejected", "defence_outcome",
             "studies")


#: ``report.md`` sections shown with the privacy spent, and those shown as diagnostics.
_PRIVACY_SECTIONS = ("Site privacy ledgers", "Secure aggregation")
_DIAGNOSTIC_SECTIONS = ("Site start-up per message",)


def answer_html(report: dict[str, Any], md_privacy: str = "") -> str:
    """The section a run's page leads with (:func:`fedcompress.report_answer.answer`): the
    answer in words, the method against its baselines as a table and one chart, what was
    pruned or removed per layer, and the privacy spent (``md_privacy``: report.md's privacy
    sections, rendered)."""
    found = answer(report)
    parts = ['<section id="answer"><h2>What this run found</h2>',
             '<p class="lead">' + " ".join(esc(s) for s in found.summary) + "</p>"]
    if found.entries and found.panels:
        parts.append("<h3>Method against baselines</h3>")
        columns = ["method and baselines", "role", *[p.column or p.title for p in found.panels]]
        vs_dense = None
        dense = [e for e in found.entries if e.role == "dense"]
        if found.quality and len(dense) == 1 and found.panels and found.panels[0].key == (
                found.quality[0]):
            vs_dense = found.panels[0].values[found.entries.index(dense[0])]
            columns.insert(3, "vs dense")
        timed = "time (s)" in columns
        if timed:
            columns.insert(columns.index("time (s)") + 1, "time measured")
        rows, classes = [], {}
        for r, entry in enumerate(found.entries):
            row = [entry.label, entry.role]
            for p, panel in enumerate(found.panels):
                value = panel.values[r]
                row.append(blank(entry, panel) if value is None else panel.text(value))
                if p == 0 and vs_dense is not None:
                    row.append("-" if value is None or entry.role == "dense" or not vs_dense
                               else f"{100 * (value - vs_dense) / vs_dense:+.1f}%")
            if timed:
                row.insert(columns.index("time measured"),
                           result_time(entry.values)[1] if entry.role != "dense" else "-")
            rows.append(row)
            if entry.role == "method":
                classes[(r, 0)] = "method"
        numeric = {c for c, name in enumerate(columns)
                   if c >= 2 and name != "time measured"}
        parts.append(html_table(columns, rows, classes=classes, numeric=numeric,
                                wrap={0} if len(found.entries) > 8 else set()))
        chart = chart_svg(found.entries, found.panels)
        if chart:
            more = len(found.entries) - MAX_CHART_ROWS
            parts.append('<figure class="svg">' + chart + "<figcaption>Each panel is scaled "
                         "to its own largest value."
                         + (f" The chart shows the first {MAX_CHART_ROWS} rows of the table "
                            f"({more} more above)." if more > 0 else "")
                         + "</figcaption></figure>")
    if found.missing:
        parts.append('<p class="note missing">Not in this report: '
                     + esc("; ".join(found.missing)) + ".</p>")
    if found.pruned or found.layers:
        parts.append("<h3>What was pruned</h3>"
                     + "".join(f"<p>{esc(t)}</p>" for t in found.pruned))
        if found.layers:
            what, values, target = found.layers
            parts.append('<figure class="svg">' + layers_svg(what, values, target)
                         + "</figure>")
    parts.append("<h3>Privacy spent</h3>" + f"<p>{esc(found.privacy[0])}</p>"
                 + (f"<p>{esc(' '.join(found.privacy[1:]))}</p>" if found.privacy[1:] else ""))
    if found.privacy_rows:
        parts.append(generic_html(found.privacy_rows))
    parts.append(md_privacy + "</section>")
    return "".join(parts)


def render_run(folder: str | Path) -> str:
    """The HTML page of one run or bench folder: the answer first (:func:`answer_html`), then
    the studies, sections and every result, then the diagnostics (site start-up, timings,
    config, versions, machine, the command line and how to reproduce it)."""
    folder = Path(folder)
    report = load_report(folder)
    command = str(report.get("command", "run"))
    versions = report.get("versions") or {}
    head = [f"<h1>fedcompress {esc(command)} {status_badge(str(report.get('status', '?')))}"
            "</h1>",
            f'<p class="meta">Folder <code>{esc(folder)}</code> &middot; started '
            f"{esc(started_text(report))}"
            + (f" &middot; commit <code>{esc(versions['git_commit'])}</code>"
               if versions.get("git_commit") else "")
            + ' &middot; <a href="#diagnostics">diagnostics and how to reproduce</a></p>']

    used: set[str] = set()
    rendered_studies: set[str] = set()
    parts: list[str] = []
    studies = bench_studies(report)
    if studies:
        parts.append("<h2>Studies</h2>")
        for study, results in studies:
            parts.append(study_html(study, results))
            rendered_studies.add(f"Study `{study.name}`")
    md_path = folder / "report.md"
    privacy_md, diagnostic_md = [], []
    if md_path.is_file():
        for title, text in markdown_sections(md_path.read_text()):
            if title in _FROM_JSON or title in rendered_studies or not text:
                continue
            html_part = markdown_html(text, folder, used)
            if title in _PRIVACY_SECTIONS or title.startswith("Privacy"):
                privacy_md.append(f"<details><summary>{markdown_inline(title)}</summary>"
                                  f'<div class="md">{html_part}</div></details>')
            elif title in _DIAGNOSTIC_SECTIONS:
                diagnostic_md.append(f"<h3>{markdown_inline(title)}</h3>"
                                     f'<div class="md">{html_part}</div>')
            else:
                parts.append(f"<h2>{markdown_inline(title)}</h2>"
                             f'<div class="md">{html_part}</div>')

    parts.append("<h2>Results</h2>" + f'<p class="note">{TIME_NOTE} Highlighted: the lowest '
                 "perplexity among compressed results (dense aside) and the highest accuracy."
                 "</p>" + summary_table(compare_rows([folder], [report]))
                 + "<h3>Every field</h3>" + results_html(report.get("results", [])))

    if "rejected" in report:
        rejected = report["rejected"] or []
        parts.append("<h2>Rejected sites</h2>" + (
            generic_html(rejected) if rejected else
            '<p class="note">No site\'s reply was rejected.</p>'))
    if report.get("defence_outcome"):
        parts.append("<h2>Defence outcome</h2>" + generic_html(report["defence_outcome"]))

    images = sorted(p for p in folder.iterdir()
                    if p.suffix.lower() in IMAGE_TYPES and p.name not in used and p.is_file())
    if images:
        parts.append("<h2>Plots</h2>" + "".join(
            f'<figure><img alt="{esc(p.stem)}" src="{data_uri(p)}">'
            f"<figcaption>{esc(p.name)}</figcaption></figure>" for p in images))

    diag = ['<section id="diagnostics"><h2>Diagnostics</h2>', *diagnostic_md]
    timings = report.get("timings") or {}
    if timings:
        diag.append("<h3>Timings</h3>" + html_table(
            ["phase", "seconds"], [[k, f"{v:.2f}" if isinstance(v, (int, float)) else str(v)]
                                   for k, v in timings.items()], numeric={1}))
    diag.append("<h3>Command line and reproduce</h3>"
                + code_block(str(report.get("command_line", "")), "command line")
                + code_block(str(report.get("reproduce", "")), "reproduce"))
    diag.append("<h3>Config</h3>" + kv_table(flatten(report.get("config") or {})))
    if report.get("seeds"):
        diag.append("<h3>Seeds</h3>" + kv_table(report["seeds"].items()))
    diag.append("<h3>Versions</h3>" + kv_table(versions.items(), ("package", "version")))
    if report.get("machine"):
        diag.append("<h3>Machine</h3>" + kv_table(report["machine"].items()))
    else:
        diag.append("<h3>Machine</h3>" + '<p class="note">Not in this report (no machine '
                    "record: CPU, threads, load average).</p>")
    extra = {k: v for k, v in report.items() if k not in _STANDARD}
    if extra:
        diag.append("<h3>More from report.json</h3>" + "".join(
            f"<details><summary>{esc(k)}</summary>{generic_html(v)}</details>"
            for k, v in extra.items()))
    diag.append("</section>")
    body = [*head, answer_html(report, "".join(privacy_md)), *parts, *diag]
    return page_html(f"fedcompress {command}: {folder.name}", "\n".join(body))


def write_report(folder: str | Path, out: str | Path | None = None) -> Path:
    """Write the page of ``folder`` (default ``folder/report.html``); return its path."""
    text = render_run(folder)
    path = Path(out) if out is not None else Path(folder) / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    logger.info("report page written to %s (%.0f KiB)", path, len(text) / 1024)
    return path

