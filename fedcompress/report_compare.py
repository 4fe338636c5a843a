"""The page putting several runs side by side (``fedcompress report --compare DIR1 DIR2 ...``).

:func:`compare_rows` makes one row per finished result of each run (a run's own page shows its
rows with the same :func:`summary_table`); :func:`compare_curves` gathers perplexity against
sparsity across the runs, drawn by :func:`draw_curves` (:mod:`fedcompress.bench.plots`);
:func:`render_compare` lays out the table, the plots and each run's command line on one
self-contained page (:mod:`fedcompress.report_page`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from fedcompress.report import default_out, format_cell
from fedcompress.report_page import (
    SHOWN_SETTINGS,
    ReportError,
    bench_cell_settings,
    best_index,
    best_indices,
    code_block,
    data_uri,
    esc,
    flatten,
    format_value,
    html_table,
    is_dense,
    load_report,
    page_html,
    result_strategy,
    result_time,
    started_text,
    status_badge,
)

logger = logging.getLogger(__name__)


def compare_rows(folders: list[Path], reports: list[dict]) -> list[dict[str, Any]]:
    """One row per finished result of each run: run folder, result (a bench cell: its
    strategy and the settings its study sweeps), method, sparsity, perplexity, accuracy,
    time (and what it measures), bytes up/down per client, rounds."""
    rows = []
    for folder, report in zip(folders, reports):
        config = report.get("config") or {}
        flat = dict(flatten(config))
        records = [r for r in report.get("results", []) if r.get("status") in (None, "ok")]
        cells = [bench_cell_settings(r) for r in records]
        varying = [k for k in dict.fromkeys(k for c in cells for k in c) if k not in SHOWN_SETTINGS
                   and len({json.dumps(c.get(k)) for c in cells if c.get("kind") != "dense"
                            and k in c}) > 1]
        for record, cell in zip(records, cells):
            seconds, measure = result_time(record)
            dense = is_dense(record)
            method = record.get("method") or config.get("method") or flat.get("bench.method")
            result = result_strategy(record)
            extra = [f"{k}={format_cell(cell[k])}" for k in varying if k in cell]
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


#: Cell settings a curve's strategy label already names (besides
#: :data:`~fedcompress.report_page.SHOWN_SETTINGS`).
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
        is_dense(r) or isinstance(r["sparsity"], (int, float)))]
    sets: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    dense_of: dict[tuple[str, str], list[float]] = {}
    for row in plotted:
        where = (str(row["model"]), json.dumps(row.get("eval"), sort_keys=True))
        if is_dense(row):
            dense_of.setdefault(where, []).append(float(row["perplexity"]))
        else:
            sets.setdefault((*where, str(row["method"])), []).append(row)
    curves = []
    for (model, eval_key, method), pruned in sets.items():
        cells = [r.get("settings") or {} for r in pruned]
        varying = [k for k in dict.fromkeys(k for c in cells for k in c)
                   if k not in (*SHOWN_SETTINGS, *_LABELLED)
                   and len({json.dumps(c[k]) for c in cells if k in c}) > 1]
        lines: dict[str, dict[float, float]] = {}
        for row in pruned:
            cell = row.get("settings") or {}
            label = row.get("strategy") or row["result"]
            extra = [f"{k}={format_cell(cell[k])}" for k in varying if k in cell]
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
        return "".join(f'<figure><img alt="{esc(curve["title"])}" src="{data_uri(path)}">'
                       f"<figcaption>{esc(curve['title'])}</figcaption></figure>"
                       for curve, path in drawn)


#: What the time and bytes columns measure (said above the results on both pages).
TIME_NOTE = ("Time: the federated round time of a Flower run, the pruning time of a baseline, "
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
        f"{esc(k)}={esc(v)}" for k, v in same.items()) + "</p>" if same else "")
    return note + html_table(columns, body, classes=classes, tips=tips, numeric=numeric,
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
               f'{rows[best]["perplexity"]:.2f}</b>, {esc(rows[best]["result"])} in '
               f'<code>{esc(rows[best]["run"])}</code>.</p>' if best is not None else "")
    drawn = curves_html(compare_curves(rows, labels), None if figures is None else Path(figures))
    curves = ("<h2>Perplexity against sparsity</h2>" + drawn) if drawn else ""
    runs = []
    for path, report in zip(paths, reports):
        runs.append(f"<h3>{esc(labels[str(path)])}: fedcompress {esc(report.get('command', ''))} "
                    f"{status_badge(str(report.get('status', '?')))}</h3>"
                    f'<p class="meta">folder <code>{esc(path)}</code> &middot; started '
                    f"{esc(started_text(report))}"
                    + (f" &middot; commit <code>{esc(report['versions']['git_commit'])}</code>"
                       if (report.get("versions") or {}).get("git_commit") else "") + "</p>"
                    + code_block(str(report.get("command_line", "")), "command line"))
    page = ("<h1>fedcompress: runs compared</h1>"
            f'<p class="meta">{len(paths)} run folders, {len(rows)} finished results. '
            f"{TIME_NOTE}</p>" + summary + "<h2>Results side by side</h2>"
            + summary_table(rows, labels) + curves + "<h2>Runs</h2>" + "\n".join(runs))
    return page_html("fedcompress: runs compared", page)



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
