"""The pieces every report page is built from: the page of a run
(:mod:`fedcompress.report_html`), the page comparing runs (:mod:`fedcompress.report_compare`)
and the answer a run's page leads with (:mod:`fedcompress.report_answer`).

Loading a run or bench folder's ``report.json`` (:func:`load_report`, :class:`ReportError`);
formatting values (bytes, seconds, perplexities); HTML tables with every string escaped;
``report.md`` rendered as markdown with raw HTML disabled and local images embedded as base64
data URIs; the page itself (CSS and script inline, no external resource); and what a result
record says about itself: the time it cost (:func:`result_time`), its strategy label
(:func:`result_strategy`) and a bench cell's settings (:func:`bench_cell_settings`).
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import math
from pathlib import Path
from typing import Any, Iterable

from fedcompress.report import format_cell, nonfinite_restored

#: Image files a page embeds (suffix: MIME type).
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
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
    # a result's nan or inf was stored as text (JSON has no number for it): a float again
    report["results"] = nonfinite_restored(report.get("results", []))
    return report


# ------------------------------------------------------------------------------------------
# Formatting
# ------------------------------------------------------------------------------------------

def esc(value: Any) -> str:
    """``value`` as text safe in HTML (quotes escaped too)."""
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
        return format_cell(value), repr(value)
    if isinstance(value, (list, dict)):
        text = json.dumps(value)
        return (text if len(text) <= 60 else text[:57] + "..."), ""
    return format_cell(value), ""


def is_dense(record: dict) -> bool:
    """Whether a result is the dense (uncompressed) model."""
    return record.get("kind") == "dense" or record.get("name") == "dense"


def best_indices(records: list[dict], key: str, lower: bool = True) -> list[int]:
    """The rows with the best finite ``key`` (every row of a tie) among compressed results (a
    dense model is not a candidate unless every row is dense)."""
    rows = [(i, r[key]) for i, r in enumerate(records)
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
            and math.isfinite(r[key])]
    candidates = [(i, v) for i, v in rows if not is_dense(records[i])] or rows
    if not candidates:
        return []
    best = (min if lower else max)(v for _, v in candidates)
    return [i for i, v in candidates if v == best]


def best_index(records: list[dict], key: str, lower: bool = True) -> int | None:
    """The first of :func:`best_indices`, or None."""
    found = best_indices(records, key, lower)
    return found[0] if found else None


def html_table(header: list[str], rows: list[list[str]], raw: bool = False,
               classes: dict[tuple[int, int], str] | None = None, tips: dict | None = None,
               numeric: set[int] | None = None, wrap: set[int] | None = None) -> str:
    """An HTML table; cells are escaped unless ``raw`` (already HTML); ``numeric`` columns
    are right-aligned, ``wrap`` columns may wrap (default: those with a cell over 60
    characters; the others do not)."""
    classes, tips, numeric = classes or {}, tips or {}, numeric or set()
    if wrap is None:
        wrap = {c for row in rows for c, cell in enumerate(row) if len(cell) > 60}
    head = "".join(f"<th>{h if raw else esc(h)}</th>" for h in header)
    body = []
    for r, row in enumerate(rows[:_MAX_ROWS]):
        cells = []
        for c, cell in enumerate(row):
            cls = " ".join(x for x in (classes.get((r, c), ""), "num" if c in numeric else "",
                                       "wrap" if c in wrap else "") if x)
            attrs = (f' class="{cls}"' if cls else "") + (
                f' title="{esc(tips[(r, c)])}"' if tips.get((r, c)) else "")
            cells.append(f"<td{attrs}>{cell if raw else esc(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    more = (f'<p class="note">{len(rows) - _MAX_ROWS} more rows in report.json.</p>'
            if len(rows) > _MAX_ROWS else "")
    return (f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>{more}')


def kv_table(items: Iterable[tuple[str, Any]], header: tuple[str, str] = ("key", "value")
              ) -> str:
    """Key/value pairs as a two-column table (lists and objects as cut JSON)."""
    rows = [[str(k), format_value(str(k), v)[0] if not isinstance(v, (list, dict))
             else _short_json(v, 300)] for k, v in items]
    return html_table(list(header), rows)


def _short_json(value: Any, limit: int = _MAX_JSON) -> str:
    text = json.dumps(value, indent=None if limit <= 300 else 1, default=str)
    return text if len(text) <= limit else text[:limit] + f" ... ({len(text) - limit:,} more " \
                                                         "characters in report.json)"


def flatten(config: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """A nested config as dotted keys and their values (``bench.model``), in order."""
    out: list[tuple[str, Any]] = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += flatten(value, name + ".")
        else:
            out.append((name, value))
    return out


def generic_html(value: Any, depth: int = 0) -> str:
    """Any JSON value as HTML: a record -> key/value table, records -> a table, nested
    objects -> one heading each (three levels), the rest as (cut) JSON."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        columns = list(dict.fromkeys(k for v in value for k in v))
        rows = [[format_value(c, v.get(c))[0] for c in columns] for v in value]
        return html_table(columns, rows)
    if isinstance(value, dict) and value:
        if all(not isinstance(v, dict) for v in value.values()):
            return kv_table(value.items())
        if depth < 2:
            return "".join(f'<div class="sub"><h4>{esc(k)}</h4>{generic_html(v, depth + 1)}</div>'
                           for k, v in value.items())
    if isinstance(value, (dict, list)):
        return f"<pre>{esc(_short_json(value))}</pre>"
    return f"<p>{esc(format_value('', value)[0])}</p>"


# ------------------------------------------------------------------------------------------
# Pieces of a page
# ------------------------------------------------------------------------------------------

def data_uri(path: Path) -> str:
    """An image file as a base64 ``data:`` URI (embedded in the page)."""
    mime = IMAGE_TYPES[path.suffix.lower()]
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def markdown_html(text: str, folder: Path, used: set[str]) -> str:
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
            local = ("/" not in src and ".." not in src and path.suffix.lower() in IMAGE_TYPES
                     and path.is_file())
            if local:
                child.attrSet("src", data_uri(path))
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



def markdown_inline(text: str) -> str:
    """One line of markdown (a title, a note) as inline HTML, raw HTML escaped."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": False}).renderInline(text)


def status_badge(status: str) -> str:
    """A run's status as a coloured badge."""
    kind = {"ok": "ok", "planned": "info", "running": "warn", "incomplete": "warn"}.get(
        status, "bad")
    return f'<span class="badge {kind}">{esc(status)}</span>'


def code_block(text: str, label: str) -> str:
    """A labelled block of code with a copy button."""
    return (f'<div class="code"><div class="codehead">{esc(label)}'
            f'<button type="button" class="copy" onclick="copyCode(this)">copy</button></div>'
            f"<pre><code>{esc(text)}</code></pre></div>")


def started_text(report: dict) -> str:
    """When a run started, as local date and time (the stored text if unreadable)."""
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


def page_html(title: str, body: str) -> str:
    """The whole page around ``body``: inline CSS and script, a footer naming when and by
    which fedcompress commit it was written."""
    from fedcompress.report import versions

    made = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    commit = versions().get("git_commit", "")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{esc(title)}</title><style>{_CSS}</style></head>\n<body><main>\n"
            "<p id=\"img-warning\">Some embedded images did not load.</p>\n"
            f"{body}\n<footer>Written by <code>fedcompress report</code> on {esc(made)}"
            + (f" (fedcompress {esc(commit)})" if commit else "")
            + f".</footer>\n</main><script>{_JS}</script></body></html>\n")


# ------------------------------------------------------------------------------------------
# Result records
# ------------------------------------------------------------------------------------------

def result_time(record: dict) -> tuple[float | None, str]:
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


def result_strategy(record: dict) -> str:
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
SHOWN_SETTINGS = ("kind", "model", "method", "sparsity", "mode", "group", "scale", "tie_break",
                  "defence", "trim")


def bench_cell_settings(record: dict) -> dict[str, Any]:
    """A bench record's cell settings (between ``client_id`` and ``eval``); {} otherwise."""
    keys = list(record)
    if "client_id" not in keys:
        return {}
    end = keys.index("eval") if "eval" in keys else len(keys)
    return {k: record[k] for k in keys[keys.index("client_id") + 1:end]}


