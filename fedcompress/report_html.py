"""One self-contained HTML page per run (``fedcompress report DIR``) and one page putting several
runs side by side (``fedcompress report --compare DIR1 DIR2 ...``).

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

import base64
import datetime as _dt
import html
import json
import logging
import math
from pathlib import Path
from typing import Any, Iterable

from fedcompress.report import _fmt, default_out

logger = logging.getLogger(__name__)

#: Sections of ``report.md`` the page renders from ``report.json`` instead.
_FROM_JSON = ("Results", "Timings (s)", "Config", "Versions", "Plots")
_IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
                ".gif": "image/gif", ".svg": "image/svg+xml"}
#: Generic values longer than this (as JSON) are cut in the page (report.json has them whole).
_MAX_JSON = 20_000
_MAX_ROWS = 500


class ReportError(ValueError):
    """A folder is not a readable run or bench folder."""


# ------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------

def load_report(folder: str | Path) -> dict[str, Any]:
    """``folder/report.json`` as a dict, or a :class:`ReportError` naming the folder and what
    a report folder holds."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ReportError(f"{folder}: not a folder; expected a run or bench output folder "
                          "(the --out of a fedcompress command) holding report.json")
    path = folder / "report.json"
    if not path.is_file():
        raise ReportError(f"{folder}: no report.json; expected a run or bench output folder "
                          "written by fedcompress (report.json, report.md, PNG plots)")
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ReportError(f"{path}: not readable as JSON: {err}") from err
    if not isinstance(report, dict) or "command" not in report:
        raise ReportError(f"{path}: not a fedcompress report (expected an object with "
                          "'command', 'config', 'results', ...)")
    return report


# ------------------------------------------------------------------------------------------
# Formatting
# ------------------------------------------------------------------------------------------

def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def human_bytes(n: float) -> str:
    """``13271040`` -> ``12.66 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)  # unreachable


def format_value(key: str, value: Any) -> tuple[str, str]:
    """The text shown for a result field and the exact value (a tooltip; ``""`` when the text
    is already exact): bytes in KiB/MiB, seconds and perplexities to two decimals, other
    floats to four significant digits."""
    if isinstance(value, bool) or value is None:
        return ("yes" if value else "no") if isinstance(value, bool) else "-", ""
    if isinstance(value, (int, float)) and "bytes" in key and math.isfinite(value):
        return human_bytes(value), f"{value:,}"
    if isinstance(value, float) and math.isfinite(value):
        if key.endswith(("seconds", "_s")) or key in ("perplexity", "seconds") or (
                key.endswith("perplexity")):
            return f"{value:.2f}", repr(value)
        return _fmt(value), repr(value)
    if isinstance(value, (list, dict)):
        text = json.dumps(value)
        return (text if len(text) <= 60 else text[:57] + "..."), ""
    return _fmt(value), ""


def _is_dense(record: dict) -> bool:
    return record.get("kind") == "dense" or record.get("name") == "dense"


def best_indices(records: list[dict], key: str, lower: bool = True) -> list[int]:
    """The rows with the best finite ``key`` (every row of a tie) among compressed results (a
    dense model is not a candidate unless every row is dense)."""
    rows = [(i, r[key]) for i, r in enumerate(records)
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
            and math.isfinite(r[key])]
    candidates = [(i, v) for i, v in rows if not _is_dense(records[i])] or rows
    if not candidates:
        return []
    best = (min if lower else max)(v for _, v in candidates)
    return [i for i, v in candidates if v == best]


def best_index(records: list[dict], key: str, lower: bool = True) -> int | None:
    """The first of :func:`best_indices`, or None."""
    found = best_indices(records, key, lower)
    return found[0] if found else None


def _table(header: list[str], rows: list[list[str]], raw: bool = False,
           classes: dict[tuple[int, int], str] | None = None, tips: dict | None = None,
           numeric: set[int] | None = None, wrap: set[int] | None = None) -> str:
    """An HTML table; cells are escaped unless ``raw`` (already HTML); ``numeric`` columns
    are right-aligned, ``wrap`` columns may wrap (default: those with a cell over 60
    characters; the others do not)."""
    classes, tips, numeric = classes or {}, tips or {}, numeric or set()
    if wrap is None:
        wrap = {c for row in rows for c, cell in enumerate(row) if len(cell) > 60}
    head = "".join(f"<th>{h if raw else _e(h)}</th>" for h in header)
    body = []
    for r, row in enumerate(rows[:_MAX_ROWS]):
        cells = []
        for c, cell in enumerate(row):
            cls = " ".join(x for x in (classes.get((r, c), ""), "num" if c in numeric else "",
                                       "wrap" if c in wrap else "") if x)
            attrs = (f' class="{cls}"' if cls else "") + (
                f' title="{_e(tips[(r, c)])}"' if tips.get((r, c)) else "")
            cells.append(f"<td{attrs}>{cell if raw else _e(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    more = (f'<p class="note">{len(rows) - _MAX_ROWS} more rows in report.json.</p>'
            if len(rows) > _MAX_ROWS else "")
    return (f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>{more}')


def _kv_table(items: Iterable[tuple[str, Any]], header: tuple[str, str] = ("key", "value")
              ) -> str:
    rows = [[str(k), format_value(str(k), v)[0] if not isinstance(v, (list, dict))
             else _short_json(v, 300)] for k, v in items]
    return _table(list(header), rows)


def _short_json(value: Any, limit: int = _MAX_JSON) -> str:
    text = json.dumps(value, indent=None if limit <= 300 else 1, default=str)
    return text if len(text) <= limit else text[:limit] + f" ... ({len(text) - limit:,} more " \
                                                         "characters in report.json)"


def _flatten(config: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += _flatten(value, name + ".")
        else:
            out.append((name, value))
    return out


def _generic(value: Any, depth: int = 0) -> str:
    """Any JSON value as HTML: a record -> key/value table, records -> a table, nested
    objects -> one heading each (three levels), the rest as (cut) JSON."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        columns = list(dict.fromkeys(k for v in value for k in v))
        rows = [[format_value(c, v.get(c))[0] for c in columns] for v in value]
        return _table(columns, rows)
    if isinstance(value, dict) and value:
        if all(not isinstance(v, dict) for v in value.values()):
            return _kv_table(value.items())
        if depth < 2:
            return "".join(f'<div class="sub"><h4>{_e(k)}</h4>{_generic(v, depth + 1)}</div>'
                           for k, v in value.items())
    if isinstance(value, (dict, list)):
        return f"<pre>{_e(_short_json(value))}</pre>"
    return f"<p>{_e(format_value('', value)[0])}</p>"


# ------------------------------------------------------------------------------------------
# Pieces of a page
# ------------------------------------------------------------------------------------------

def _data_uri(path: Path) -> str:
    mime = _IMAGE_TYPES[path.suffix.lower()]
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _markdown(text: str, folder: Path, used: set[str]) -> str:
    """``report.md`` text as HTML: raw HTML escaped, tables on, local images embedded (their
    names added to ``used``), any other image replaced by its alt text."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    tokens = md.parse(text)
    for token in tokens:
        for child in token.children or []:
            if child.type != "image":
                continue
            src = str(child.attrGet("src") or "")
            path = folder / src
            local = ("/" not in src and ".." not in src and path.suffix.lower() in _IMAGE_TYPES
                     and path.is_file())
            if local:
                child.attrSet("src", _data_uri(path))
                used.add(src)
            else:
                child.type, child.tag, child.children = "text", "", None
                child.content = f"[image not embedded: {src}]"
    return md.renderer.render(tokens, md.options, {})


def markdown_sections(text: str) -> list[tuple[str, str]]:
    """The ``## `` sections of a ``report.md`` (title, body), in order."""
    sections: list[tuple[str, list[str]]] = []
    fence = False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        if line.startswith("## ") and not fence:
            sections.append((line[3:].strip(), []))
        elif sections:
            sections[-1][1].append(line)
    return [(title, "\n".join(body).strip()) for title, body in sections]


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
                f"{_e(c)}={_e(format_value(c, records[0].get(c))[0])}" for c in same) + "</p>")
        parts.append(_table(shown, rows, classes=classes, tips=tips, numeric=numeric))
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
            cell_settings = _cell_settings(record)
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

    parts = [f"<h3>{_e(study.title)}</h3>"]
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
            parts.append(f"<h4>{_e(table.caption)}</h4>")
        if study.kind == "fedprllm":
            fixed = {k: v for k, v in study.settings.items() if k not in study.swept}
            parts.append('<p class="note">Perplexity (lower is better; the lowest of each '
                         "column but the dense model's is highlighted). Fixed: "
                         + _e(", ".join(f"{k}={bench_fmt(v)}" for k, v in sorted(fixed.items())))
                         + ".</p>")
        elif table.note:
            parts.append(f'<p class="note">{_markdown_inline(table.note)}'
                         + (" The lowest of each profile's column is highlighted."
                            if table.best == "min" else "") + "</p>")
        numeric = set(range(first, len(header))) if table.best == "min" else set()
        parts.append(_table(header, body, classes=classes, numeric=numeric))
    return "".join(parts)


def _status_badge(status: str) -> str:
    kind = {"ok": "ok", "planned": "info", "running": "warn", "incomplete": "warn"}.get(
        status, "bad")
    return f'<span class="badge {kind}">{_e(status)}</span>'


def _code(text: str, label: str) -> str:
    return (f'<div class="code"><div class="codehead">{_e(label)}'
            f'<button type="button" class="copy" onclick="copyCode(this)">copy</button></div>'
            f"<pre><code>{_e(text)}</code></pre></div>")


def _started(report: dict) -> str:
    text = str(report.get("started", ""))
    try:
        return _dt.datetime.fromisoformat(text).strftime("%Y-%m-%d %H:%M:%S %Z").strip()
    except ValueError:
        return text


# ------------------------------------------------------------------------------------------
# Pages
# ------------------------------------------------------------------------------------------

_CSS = """
:root{--fg:#1f2328;--muted:#59636e;--line:#d1d9e0;--bg:#fff;--soft:#f6f8fa;--accent:#0969da}
*{box-sizing:border-box}
body{font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
 color:var(--fg);background:var(--bg);margin:0}
main{max-width:1400px;margin:0 auto;padding:24px 32px 64px}
h1{font-size:24px;margin:0 0 4px}
h2{font-size:19px;margin:32px 0 10px;padding-bottom:4px;border-bottom:1px solid var(--line)}
h3{font-size:16px;margin:20px 0 6px}
h4{font-size:14px;margin:12px 0 4px}
.meta{color:var(--muted);margin:0 0 12px}
.badge{display:inline-block;padding:1px 10px;border-radius:12px;font-weight:600;font-size:13px;
 vertical-align:middle}
.badge.ok{background:#dafbe1;color:#116329}.badge.warn{background:#fff8c5;color:#7d4e00}
.badge.bad{background:#ffebe9;color:#a40e26}.badge.info{background:#ddf4ff;color:#0550ae}
.code{border:1px solid var(--line);border-radius:6px;margin:8px 0;background:var(--soft)}
.codehead{display:flex;justify-content:space-between;align-items:center;padding:4px 10px;
 color:var(--muted);font-size:12px;border-bottom:1px solid var(--line)}
.copy{font-size:12px;border:1px solid var(--line);border-radius:4px;background:#fff;
 cursor:pointer;padding:1px 8px}
pre{margin:0;padding:10px;overflow-x:auto;white-space:pre-wrap;word-break:break-all;
 font:12.5px/1.45 ui-monospace,"DejaVu Sans Mono",monospace}
code{font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:12.5px}
.scroll{overflow-x:auto;margin:6px 0 12px}
table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid var(--line);padding:3px 8px;text-align:left;vertical-align:top}
th,td{white-space:nowrap}td.wrap{white-space:normal;min-width:240px;max-width:440px}
th{background:var(--soft);font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums}
tbody tr:nth-child(even){background:#fbfcfd}
td.best{background:#dafbe1;font-weight:700}
td.bad{background:#ffebe9}
.note{color:var(--muted);font-size:13px;margin:4px 0}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin:12px 0}
.card{border:1px solid var(--line);border-radius:8px;padding:8px 14px;min-width:150px}
.card .v{font-size:20px;font-weight:700}.card .k{color:var(--muted);font-size:12px}
figure{margin:12px 0 20px}figure img{max-width:min(100%,960px);border:1px solid var(--line)}
figcaption{color:var(--muted);font-size:12px}
.md img{max-width:100%}
details{margin:8px 0}summary{cursor:pointer;font-weight:600}
.sub{margin-left:8px}
#img-warning{display:none;color:#a40e26;font-weight:600}
footer{margin-top:40px;color:var(--muted);font-size:12px}
#answer{border:1px solid var(--line);border-left:4px solid var(--accent);border-radius:8px;
 padding:4px 20px 12px;margin:12px 0 8px;background:#fcfdff}
#answer h2{border-bottom:none;margin-top:12px}
p.lead{font-size:16px;line-height:1.55;max-width:1100px;margin:6px 0 10px}
td.method{font-weight:700;color:#0550ae}
figure.svg{margin:8px 0 12px;overflow-x:auto}figure.svg svg{max-width:none}
p.missing{color:#7d4e00}
#diagnostics{margin-top:40px;padding-top:4px;border-top:3px double var(--line)}
#diagnostics h2{border-bottom:none}
"""

# Copy buttons, and a visible warning if an embedded image does not decode (the count of
# decoded images is also left on <body data-images-decoded> for the browser test, with where
# the answer and the diagnostics are laid out and how many chart bars were drawn).
_JS = """
function copyCode(b){var t=b.parentNode.nextElementSibling.innerText;
 if(navigator.clipboard){navigator.clipboard.writeText(t).then(function(){b.textContent='copied'},
 function(){b.textContent='select and copy'})}else{b.textContent='select and copy'}}
window.addEventListener('load',function(){var imgs=document.images,ok=0;
 for(var i=0;i<imgs.length;i++){if(imgs[i].complete&&imgs[i].naturalWidth>0){ok++}}
 document.body.setAttribute('data-images-decoded',ok+'/'+imgs.length);
 if(ok<imgs.length){document.getElementById('img-warning').style.display='block'}
 var a=document.getElementById('answer'),d=document.getElementById('diagnostics');
 if(a){var r=a.getBoundingClientRect();
  document.body.setAttribute('data-answer-box',Math.round(r.top)+','+Math.round(r.bottom))}
 if(d){document.body.setAttribute('data-diagnostics-top',
  Math.round(d.getBoundingClientRect().top))}
 var bars=document.querySelectorAll('svg.chart rect[data-value]'),drawn=0;
 for(var j=0;j<bars.length;j++){if(bars[j].getBBox().width>0){drawn++}}
 document.body.setAttribute('data-chart-bars',drawn+'/'+bars.length)});
"""


def _page(title: str, body: str) -> str:
    from fedcompress.report import versions

    made = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    commit = versions().get("git_commit", "")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body><main>\n"
            "<p id=\"img-warning\">Some embedded images did not load.</p>\n"
            f"{body}\n<footer>Written by <code>fedcompress report</code> on {_e(made)}"
            + (f" (fedcompress {_e(commit)})" if commit else "")
            + f".</footer>\n</main><script>{_JS}</script></body></html>\n")


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
    from fedcompress.report_answer import MAX_CHART_ROWS, answer, blank, chart_svg, layers_svg

    found = answer(report)
    parts = ['<section id="answer"><h2>What this run found</h2>',
             '<p class="lead">' + " ".join(_e(s) for s in found.summary) + "</p>"]
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
                           _time(entry.values)[1] if entry.role != "dense" else "-")
            rows.append(row)
            if entry.role == "method":
                classes[(r, 0)] = "method"
        numeric = {c for c, name in enumerate(columns)
                   if c >= 2 and name != "time measured"}
        parts.append(_table(columns, rows, classes=classes, numeric=numeric,
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
                     + _e("; ".join(found.missing)) + ".</p>")
    if found.pruned or found.layers:
        parts.append("<h3>What was pruned</h3>"
                     + "".join(f"<p>{_e(t)}</p>" for t in found.pruned))
        if found.layers:
            what, values, target = found.layers
            parts.append('<figure class="svg">' + layers_svg(what, values, target)
                         + "</figure>")
    parts.append("<h3>Privacy spent</h3>" + f"<p>{_e(found.privacy[0])}</p>"
                 + (f"<p>{_e(' '.join(found.privacy[1:]))}</p>" if found.privacy[1:] else ""))
    if found.privacy_rows:
        parts.append(_generic(found.privacy_rows))
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
    head = [f"<h1>fedcompress {_e(command)} {_status_badge(str(report.get('status', '?')))}"
            "</h1>",
            f'<p class="meta">Folder <code>{_e(folder)}</code> &middot; started '
            f"{_e(_started(report))}"
            + (f" &middot; commit <code>{_e(versions['git_commit'])}</code>"
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
            html_part = _markdown(text, folder, used)
            if title in _PRIVACY_SECTIONS or title.startswith("Privacy"):
                privacy_md.append(f"<details><summary>{_markdown_inline(title)}</summary>"
                                  f'<div class="md">{html_part}</div></details>')
            elif title in _DIAGNOSTIC_SECTIONS:
                diagnostic_md.append(f"<h3>{_markdown_inline(title)}</h3>"
                                     f'<div class="md">{html_part}</div>')
            else:
                parts.append(f"<h2>{_markdown_inline(title)}</h2>"
                             f'<div class="md">{html_part}</div>')

    parts.append("<h2>Results</h2>" + f'<p class="note">{_TIME_NOTE} Highlighted: the lowest '
                 "perplexity among compressed results (dense aside) and the highest accuracy."
                 "</p>" + summary_table(compare_rows([folder], [report]))
                 + "<h3>Every field</h3>" + results_html(report.get("results", [])))

    if "rejected" in report:
        rejected = report["rejected"] or []
        parts.append("<h2>Rejected sites</h2>" + (
            _generic(rejected) if rejected else
            '<p class="note">No site\'s reply was rejected.</p>'))
    if report.get("defence_outcome"):
        parts.append("<h2>Defence outcome</h2>" + _generic(report["defence_outcome"]))

    images = sorted(p for p in folder.iterdir()
                    if p.suffix.lower() in _IMAGE_TYPES and p.name not in used and p.is_file())
    if images:
        parts.append("<h2>Plots</h2>" + "".join(
            f'<figure><img alt="{_e(p.stem)}" src="{_data_uri(p)}">'
            f"<figcaption>{_e(p.name)}</figcaption></figure>" for p in images))

    diag = ['<section id="diagnostics"><h2>Diagnostics</h2>', *diagnostic_md]
    timings = report.get("timings") or {}
    if timings:
        diag.append("<h3>Timings</h3>" + _table(
            ["phase", "seconds"], [[k, f"{v:.2f}" if isinstance(v, (int, float)) else str(v)]
                                   for k, v in timings.items()], numeric={1}))
    diag.append("<h3>Command line and reproduce</h3>"
                + _code(str(report.get("command_line", "")), "command line")
                + _code(str(report.get("reproduce", "")), "reproduce"))
    diag.append("<h3>Config</h3>" + _kv_table(_flatten(report.get("config") or {})))
    if report.get("seeds"):
        diag.append("<h3>Seeds</h3>" + _kv_table(report["seeds"].items()))
    diag.append("<h3>Versions</h3>" + _kv_table(versions.items(), ("package", "version")))
    if report.get("machine"):
        diag.append("<h3>Machine</h3>" + _kv_table(report["machine"].items()))
    else:
        diag.append("<h3>Machine</h3>" + '<p class="note">Not in this report (no machine '
                    "record: CPU, threads, load average).</p>")
    extra = {k: v for k, v in report.items() if k not in _STANDARD}
    if extra:
        diag.append("<h3>More from report.json</h3>" + "".join(
            f"<details><summary>{_e(k)}</summary>{_generic(v)}</details>"
            for k, v in extra.items()))
    diag.append("</section>")
    body = [*head, answer_html(report, "".join(privacy_md)), *parts, *diag]
    return _page(f"fedcompress {command}: {folder.name}", "\n".join(body))


def _markdown_inline(text: str) -> str:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": False}).renderInline(text)


def _time(record: dict) -> tuple[float | None, str]:
    """The time a result cost and what it measures."""
    for key, label in (("federated_seconds", "federated"), ("prune_seconds", "prune"),
                       ("seconds", "run")):
        if isinstance(record.get(key), (int, float)):
            return float(record[key]), label
    parts = [record.get(k) for k in ("client_seconds_mean", "count_seconds", "aggregate_seconds")]
    if all(isinstance(p, (int, float)) for p in parts):
        return float(sum(parts)), "clients + server"  # type: ignore[arg-type]
    if isinstance(record.get("wall_seconds"), (int, float)):
        return float(record["wall_seconds"]), "wall"
    return None, ""


def _strategy(record: dict) -> str:
    """A bench cell's strategy label (``FedPrLLM one-shot, server layer, ...``), else the
    result's name."""
    if record.get("kind") in ("fedprllm", "dense", "centralized", "local-only") and (
            "id" in record):
        from fedcompress.bench.tables import strategy_label

        try:
            return strategy_label(record)
        except KeyError:
            pass
    return str(record.get("name", ""))


#: Cell settings a bench row's other columns (or its strategy label) already show.
_SHOWN = ("kind", "model", "method", "sparsity", "mode", "group", "scale", "tie_break",
          "defence", "trim")


def _cell_settings(record: dict) -> dict[str, Any]:
    """A bench record's cell settings (between ``client_id`` and ``eval``); {} otherwise."""
    keys = list(record)
    if "client_id" not in keys:
        return {}
    end = keys.index("eval") if "eval" in keys else len(keys)
    return {k: record[k] for k in keys[keys.index("client_id") + 1:end]}


def compare_rows(folders: list[Path], reports: list[dict]) -> list[dict[str, Any]]:
    """One row per finished result of each run: run folder, result (a bench cell: its
    strategy and the settings its study sweeps), method, sparsity, perplexity, accuracy,
    time (and what it measures), bytes up/down per client, rounds."""
    rows = []
    for folder, report in zip(folders, reports):
        config = report.get("config") or {}
        flat = dict(_flatten(config))
        records = [r for r in report.get("results", []) if r.get("status") in (None, "ok")]
        cells = [_cell_settings(r) for r in records]
        varying = [k for k in dict.fromkeys(k for c in cells for k in c) if k not in _SHOWN
                   and len({json.dumps(c.get(k)) for c in cells if c.get("kind") != "dense"
                            and k in c}) > 1]
        for record, cell in zip(records, cells):
            seconds, measure = _time(record)
            dense = _is_dense(record)
            method = record.get("method") or config.get("method") or flat.get("bench.method")
            result = _strategy(record)
            extra = [f"{k}={_fmt(cell[k])}" for k in varying if k in cell]
            up = record.get("bytes_up_per_client", record.get("bytes_up_per_site_round"))
            down = record.get("bytes_down_per_client", record.get("bytes_down_per_site"))
            rows.append({
                "run": str(folder), "name": record.get("name", ""), "kind": record.get("kind"),
                "result": result + (f" ({', '.join(extra)})" if extra else ""),
                "strategy": result, "settings": cell, "eval": record.get("eval"),
                "method": "-" if dense or method is None else method,
                "model": record.get("model") or config.get("model") or flat.get("bench.model"),
                "sparsity": record.get("sparsity", record.get("sparsity_measured")),
                "perplexity": record.get("perplexity"), "accuracy": record.get("accuracy"),
                "seconds": seconds, "time_measure": measure,
                "bytes_up_per_client": up, "bytes_down_per_client": down,
                "rounds": record.get("rounds", report.get("rounds")
                                     if isinstance(report.get("rounds"), int) else None),
                "valid_clients": record.get("valid_clients"),
                "per_round": "bytes_up_per_site_round" in record})
    return rows


#: Cell settings a curve's strategy label already names (besides :data:`_SHOWN`).
_LABELLED = ("aggregate", "fedspallm_layers")


def compare_curves(rows: list[dict[str, Any]], labels: dict[str, str] | None = None
                   ) -> list[dict[str, Any]]:
    """Perplexity against sparsity across the rows of :func:`compare_rows` (e.g. one bench run
    per sparsity): one curve set per model, evaluation and method, one line per strategy (with
    the cell settings that differ between its rows, such as the number of sites), the dense
    model as a reference. A point met twice with different
    perplexities (the same strategy in two runs) gets the run's label on its own line rather
    than being dropped. Sets where no line has two sparsities are left out: the table says it.
    Each item: ``title``, ``model``, ``method``, ``lines`` ({label: [(sparsity, perplexity),
    ...]}) and ``dense``."""
    plotted = [r for r in rows if isinstance(r["perplexity"], (int, float)) and (
        _is_dense(r) or isinstance(r["sparsity"], (int, float)))]
    sets: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    dense_of: dict[tuple[str, str], list[float]] = {}
    for row in plotted:
        where = (str(row["model"]), json.dumps(row.get("eval"), sort_keys=True))
        if _is_dense(row):
            dense_of.setdefault(where, []).append(float(row["perplexity"]))
        else:
            sets.setdefault((*where, str(row["method"])), []).append(row)
    curves = []
    for (model, eval_key, method), pruned in sets.items():
        cells = [r.get("settings") or {} for r in pruned]
        varying = [k for k in dict.fromkeys(k for c in cells for k in c)
                   if k not in (*_SHOWN, *_LABELLED)
                   and len({json.dumps(c[k]) for c in cells if k in c}) > 1]
        lines: dict[str, dict[float, float]] = {}
        for row in pruned:
            cell = row.get("settings") or {}
            label = row.get("strategy") or row["result"]
            extra = [f"{k}={_fmt(cell[k])}" for k in varying if k in cell]
            label += f" ({', '.join(extra)})" if extra else ""
            x, y = float(row["sparsity"]), float(row["perplexity"])
            if x in lines.get(label, {}) and lines[label][x] != y:
                label += f" [{(labels or {}).get(row['run'], row['run'])}]"
            lines.setdefault(label, {})[x] = y
        if not any(len(points) > 1 for points in lines.values()):
            continue
        dense = dense_of.get((model, eval_key), [])
        if len(set(dense)) > 1:
            logger.warning("dense perplexities differ between the runs for %s: %s; the plot "
                           "draws the first", model, sorted(set(dense)))
        evaluation = json.loads(eval_key) or {}
        on = (f"{evaluation.get('eval_windows')} windows of {evaluation.get('eval_seqlen')} "
              f"tokens of {evaluation.get('eval_text')} {evaluation.get('eval_split')}"
              if evaluation else "")
        title = (f"Perplexity against sparsity, {model}, {method}"
                 + (f" ({on})" if on else ""))
        curves.append({"title": title, "model": model, "method": method,
                       "dense": dense[0] if dense else None,
                       "lines": {k: sorted(v.items()) for k, v in lines.items()}})
    return curves


def curve_name(curve: dict[str, Any]) -> str:
    """A file name for one curve of :func:`compare_curves`: ``perplexity-MODEL-METHOD.png``
    (lower case, anything but letters, digits, dots and dashes made a dash)."""
    import re

    stem = f"perplexity-{curve['model']}-{curve['method']}".lower()
    return re.sub(r"[^a-z0-9.]+", "-", stem).strip("-") + ".png"


def draw_curves(curves: list[dict[str, Any]], folder: Path) -> list[tuple[dict[str, Any], Path]]:
    """Draw each curve of :func:`compare_curves` as a PNG in ``folder``, named by
    :func:`curve_name` (a second curve of the same model and method, on another evaluation,
    gets ``-2`` and so on); return each curve with its file."""
    import matplotlib.style

    from fedcompress.bench.plots import perplexity_lines

    folder.mkdir(parents=True, exist_ok=True)
    drawn, taken = [], set()
    for curve in curves:
        name, n = curve_name(curve), 1
        while name in taken:
            n += 1
            name = f"{curve_name(curve)[:-len('.png')]}-{n}.png"
        taken.add(name)
        with matplotlib.style.context("default"):  # the same bytes whatever the user's rc
            path = perplexity_lines(curve["lines"], curve["dense"], folder / name,
                                    curve["title"], "sparsity")
        if path is not None:
            logger.debug("plot written to %s", path)
            drawn.append((curve, path))
    return drawn


def curves_html(curves: list[dict[str, Any]], folder: Path | None = None) -> str:
    """The curves of :func:`compare_curves` as inline PNG figures (matplotlib); their files
    are kept in ``folder`` when one is given (:func:`draw_curves`)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fedcompress-compare-") as tmp:
        drawn = draw_curves(curves, Path(tmp) if folder is None else folder)
        if folder is not None and not drawn:
            logger.warning("--figures %s: no plot to write: no strategy has results at two "
                           "sparsities or more across these runs (the table has them all)",
                           folder)
        return "".join(f'<figure><img alt="{_e(curve["title"])}" src="{_data_uri(path)}">'
                       f"<figcaption>{_e(curve['title'])}</figcaption></figure>"
                       for curve, path in drawn)


_TIME_NOTE = ("Time: the federated round time of a Flower run, the pruning time of a baseline, "
              "a bench cell's mean client mask time plus the server's vote and selection "
              "(in-process), else the run's or the cell's wall time. Bytes: measured payloads "
              "per client.")


def summary_table(rows: list[dict[str, Any]], labels: dict[str, str] | None = None) -> str:
    """The rows of :func:`compare_rows` as one table (a ``run`` column when ``labels`` names
    the runs); a model or method the same in every row is said once above it; the best
    perplexity (lowest, not dense) and accuracy (highest) highlighted."""
    if not rows:
        return '<p class="note">No finished results.</p>'
    columns = ["run", "result", "method", "model", "sparsity", "perplexity", "accuracy",
               "time (s)", "time measured", "bytes up / client", "bytes down / client",
               "rounds", "valid clients"]
    if labels is None:
        columns.remove("run")
    for key, column in (("perplexity", "perplexity"), ("accuracy", "accuracy"),
                        ("valid_clients", "valid clients")):
        if all(r[key] is None for r in rows):
            columns.remove(column)
    same = {}
    for column in ("model", "method"):
        values = {str(r[column]) for r in rows if r[column] != "-"}
        if len(rows) > 1 and len(values) == 1:
            same[column] = values.pop()
    columns = [c for c in columns if c not in same]
    body, tips, classes = [], {}, {}
    for r, row in enumerate(rows):
        up = format_value("bytes", row["bytes_up_per_client"])
        values = {
            "run": ((labels or {}).get(row["run"], row["run"]), row["run"]),
            "result": (row["result"], row["name"]), "method": (str(row["method"]), ""),
            "model": format_value("model", row["model"]),
            "sparsity": format_value("sparsity", row["sparsity"]),
            "perplexity": format_value("perplexity", row["perplexity"]),
            "accuracy": format_value("accuracy", row["accuracy"]),
            "time (s)": format_value("seconds", row["seconds"]),
            "time measured": (row["time_measure"] or "-", ""),
            "bytes up / client": (up[0] + (" per round" if row["per_round"] else ""), up[1]),
            "bytes down / client": format_value("bytes", row["bytes_down_per_client"]),
            "rounds": format_value("rounds", row["rounds"]),
            "valid clients": format_value("valid_clients", row["valid_clients"])}
        body.append([values[c][0] for c in columns])
        for c, col in enumerate(columns):
            tips[(r, c)] = values[col][1]
    for metric, lower in (("perplexity", True), ("accuracy", False)):
        if metric in columns:
            for best in best_indices(rows, metric, lower):
                classes[(best, columns.index(metric))] = "best"
    numeric = {columns.index(c) for c in ("sparsity", "perplexity", "accuracy", "time (s)",
                                          "bytes up / client", "bytes down / client", "rounds",
                                          "valid clients") if c in columns}
    note = ('<p class="note">Same in every row: ' + ", ".join(
        f"{_e(k)}={_e(v)}" for k, v in same.items()) + "</p>" if same else "")
    return note + _table(columns, body, classes=classes, tips=tips, numeric=numeric,
                         wrap={columns.index("result")})


def render_compare(folders: list[str | Path], figures: str | Path | None = None) -> str:
    """One page with several runs side by side (:func:`summary_table`), the perplexity
    against sparsity plots (their PNG files also written to ``figures`` when given) and each
    run's command line."""
    if not folders:
        raise ReportError("--compare needs at least one run folder")
    paths = [Path(f) for f in folders]
    reports = [load_report(p) for p in paths]
    rows = compare_rows(paths, reports)
    labels = {str(p): f"#{i + 1} {p.name}" for i, p in enumerate(paths)}
    best = best_index(rows, "perplexity")
    summary = (f'<p>Lowest perplexity among compressed results (dense models aside): <b>'
               f'{rows[best]["perplexity"]:.2f}</b>, {_e(rows[best]["result"])} in '
               f'<code>{_e(rows[best]["run"])}</code>.</p>' if best is not None else "")
    drawn = curves_html(compare_curves(rows, labels), None if figures is None else Path(figures))
    curves = ("<h2>Perplexity against sparsity</h2>" + drawn) if drawn else ""
    runs = []
    for path, report in zip(paths, reports):
        runs.append(f"<h3>{_e(labels[str(path)])}: fedcompress {_e(report.get('command', ''))} "
                    f"{_status_badge(str(report.get('status', '?')))}</h3>"
                    f'<p class="meta">folder <code>{_e(path)}</code> &middot; started '
                    f"{_e(_started(report))}"
                    + (f" &middot; commit <code>{_e(report['versions']['git_commit'])}</code>"
                       if (report.get("versions") or {}).get("git_commit") else "") + "</p>"
                    + _code(str(report.get("command_line", "")), "command line"))
    page = ("<h1>fedcompress: runs compared</h1>"
            f'<p class="meta">{len(paths)} run folders, {len(rows)} finished results. '
            f"{_TIME_NOTE}</p>" + summary + "<h2>Results side by side</h2>"
            + summary_table(rows, labels) + curves + "<h2>Runs</h2>" + "\n".join(runs))
    return _page("fedcompress: runs compared", page)


def write_report(folder: str | Path, out: str | Path | None = None) -> Path:
    """Write the page of ``folder`` (default ``folder/report.html``); return its path."""
    text = render_run(folder)
    path = Path(out) if out is not None else Path(folder) / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    logger.info("report page written to %s (%.0f KiB)", path, len(text) / 1024)
    return path


def write_compare(folders: list[str | Path], out: str | Path | None = None,
                  figures: str | Path | None = None) -> Path:
    """Write the page comparing ``folders`` (default ``runs/compare-TIME.html``); with
    ``figures``, also each of its perplexity against sparsity plots as a PNG file there."""
    text = render_compare(folders, figures)
    path = Path(out) if out is not None else Path(f"{default_out('compare')}.html")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    logger.info("comparison page written to %s (%.0f KiB)", path, len(text) / 1024)
    return path
