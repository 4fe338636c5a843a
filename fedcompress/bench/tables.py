"""Paper-shaped tables of a bench sweep: one per study; rows are strategies (and the other
swept settings), columns the study's ``columns`` setting (sparsity, model, clients, ...). A
study of another kind has its own tables (:mod:`fedcompress.bench.studies`);
:func:`study_tables` gives every study's. The strategy labels, value formats and the
:class:`StudyTable` type are in :mod:`fedcompress.bench.labels` (importable from here too)."""

from __future__ import annotations

from collections.abc import Callable

from fedcompress.bench.cells import SERVER_KEYS, Cell, Study
from fedcompress.bench.labels import (  # noqa: F401 (this module's public names)
    KIND_LABEL,
    StudyTable,
    format_value,
    human_bytes,
    strategy_label,
)
from fedcompress.report import markdown_table

#: :func:`~fedcompress.bench.labels.format_value` (this module's name for it; imported from
#: here by ``fedcompress.report_html``).
_fmt = format_value

KIND_ORDER = {"dense": 0, "centralized": 1, "local-only": 2, "fedprllm": 3}


def cell_cost(record: dict) -> str:
    """What a cell cost: the bytes one site sent, and the seconds of its compression (``prune
    s``: the whole run in this process for statistics mode, centralized and local-only pruning;
    one site's mask pass plus the server's count and selection for a vote, whose sites run in
    parallel in a deployment; FedSpaLLM: its run)."""
    parts = []
    if record.get("bytes_up_per_client") is not None:
        parts.append(f"{human_bytes(float(record['bytes_up_per_client']))} up")
    if record.get("prune_seconds") is not None:
        parts.append(f"{float(record['prune_seconds']):.0f} s")
    elif record.get("client_seconds_mean") is not None:
        seconds = float(record["client_seconds_mean"]) + float(
            record.get("count_seconds") or 0) + float(record.get("aggregate_seconds") or 0)
        parts.append(f"{seconds:.0f} s (one site + server)")
    return ", ".join(parts) or "-"


def study_table(study: Study, results: dict[str, dict], metric: str = "perplexity",
                fmt: Callable[[dict], str] | None = None) -> tuple[list[str], list[list[str]]]:
    """Columns and rows of one study's table (values: ``metric``, or ``fmt(record)``, or
    ``failed``/``pending``)."""
    col_key = study.columns
    col_values = list(dict.fromkeys(
        _fmt(dict(c.settings()).get(col_key)) for c in study.cells
        if col_key in c.settings())) if col_key else ["value"]
    other = [k for k in study.swept if k != col_key and k not in SERVER_KEYS]
    rows: dict[tuple, dict[str, str]] = {}
    order: dict[tuple, tuple] = {}
    for index, cell in enumerate(study.cells):
        settings = cell.settings()
        label = strategy_label(settings, (col_key,) if col_key else ())
        key = (*(_fmt(settings.get(k, "")) if k in settings else "" for k in other), label)
        order.setdefault(key, (KIND_ORDER[cell.kind], index))
        record = results.get(cell.id)
        if record is None:
            value = "pending"
        elif record.get("status") != "ok":
            value = "failed"
        elif fmt is not None:
            value = fmt(record)
        else:
            value = f"{record[metric]:.2f}" if isinstance(record.get(metric), float) else _fmt(
                record.get(metric, ""))
        targets = [_fmt(settings[col_key])] if col_key in settings else (
            col_values if col_key else ["value"])
        for target in targets:
            rows.setdefault(key, {})[target] = value
    header = [*other, "strategy", *(f"{col_key}={v}" if col_key else v for v in col_values)]
    body = [[*key, *(rows[key].get(v, "") for v in col_values)]
            for key in sorted(rows, key=lambda k: order[k])]
    return header, body


def study_tables(study: Study, results: dict[str, dict]) -> list[StudyTable]:
    """Every table of a study, by its kind (a FedPrLLM sweep's perplexity table, or those of
    :data:`fedcompress.bench.studies.KINDS`: network times, leakage, PPC-GPT, ...)."""
    from fedcompress.bench.studies import KINDS

    if study.kind in KINDS:
        return KINDS[study.kind].tables(study, results)
    header, body = study_table(study, results)
    fixed = {k: v for k, v in study.settings.items() if k not in study.swept}
    note = "Perplexity (lower is better). Fixed: " + ", ".join(
        f"{k}={_fmt(v)}" for k, v in sorted(fixed.items())) + "."
    cost_header, cost_body = study_table(study, results, fmt=cell_cost)
    cost_note = ("What each cell cost: the bytes one site sent over the run (`up`; none for "
                 "the dense model, centralized and local-only pruning), and the seconds of "
                 "its compression on this machine: the whole run in one process for "
                 "statistics mode, FedSpaLLM, centralized and local-only pruning (the sites "
                 "one after another); for a vote, one site's mask pass (the mean over the "
                 "sites; they run in parallel in a deployment) plus the server's count and "
                 "selection. The evaluation is not included.")
    return [StudyTable("", note, header, body, header.index("strategy") + 1),
            StudyTable("Cost", cost_note, cost_header, cost_body,
                       cost_header.index("strategy") + 1, best=None)]


def study_markdown(study: Study, results: dict[str, dict]) -> str:
    lines = [f"### {study.title}"]
    for table in study_tables(study, results):
        if table.caption:
            lines += ["", f"#### {table.caption}"]
        if table.note:
            lines += ["", table.note]
        lines += ["", markdown_table(table.header, table.body)]
    return "\n".join(lines)


def cells_by_id(studies: list[Study]) -> dict[str, Cell]:
    return {cell.id: cell for study in studies for cell in study.cells}
