"""Paper-shaped tables of a bench sweep: one per study; rows are strategies (and the other
swept settings), columns the study's ``columns`` setting (sparsity, model, clients, ...). A
study of another kind has its own tables (:mod:`fedcompress.bench.studies`);
:func:`study_tables` gives every study's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedcompress.bench.sweep import SERVER_KEYS, Cell, Study
from fedcompress.report import markdown_table

KIND_ORDER = {"dense": 0, "centralized": 1, "local-only": 2, "fedprllm": 3}
KIND_LABEL = {"dense": "Dense", "centralized": "Centralized", "local-only": "Local-only"}


def strategy_label(settings: dict, omit: tuple[str, ...] = ()) -> str:
    """``FedPrLLM one-shot, server row, scaling`` / ``Centralized`` / ...; settings named in
    ``omit`` (e.g. the table's column setting) are left out of the label."""
    kind = settings["kind"]
    if kind != "fedprllm":
        return KIND_LABEL[kind]
    aggregate = settings.get("aggregate", "votes")
    if aggregate == "stats":  # no vote: its comparison group is the sites' local group
        return f"FedPrLLM statistics mode, {settings.get('local_group', 'row')}"
    if aggregate == "fedspallm":
        budget = settings.get("fedspallm_layers") or "all"
        return (f"FedSpaLLM{'' if 'group' in omit else ', server ' + settings['group']}, "
                f"{budget} layers per site")
    parts = []
    if "mode" not in omit:
        parts.append(f"FedPrLLM {'one-shot' if settings.get('mode') == 'oneshot' else 'iterative'}")
    else:
        parts.append("FedPrLLM")
    if "group" not in omit:
        parts.append(f"server {settings['group']}")
    if settings.get("scale") and "scale" not in omit:
        parts.append("scaling")
    if settings.get("tie_break", "magnitude") != "magnitude" and "tie_break" not in omit:
        parts.append(f"ties {settings['tie_break']}")
    defence = settings.get("defence", "none")
    if defence != "none" and "defence" not in omit:
        trim = f"trim {settings.get('trim')}"
        parts.append({"trim": trim, "hamming": "Hamming defence",
                      "both": f"Hamming defence + {trim}"}[defence])
    return ", ".join(parts)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def human_bytes(n: float) -> str:
    """``163774464`` -> ``164 MB`` (decimal units, three significant digits)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


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


@dataclass
class StudyTable:
    """One table of a study: an optional caption, the text before it (markdown), its header
    and rows; values start at column ``first_value``; ``best`` is ``"min"`` when the lowest
    value of each column is the best (highlighted on the report page), else None."""

    caption: str
    note: str
    header: list[str]
    body: list[list[str]]
    first_value: int
    best: str | None = "min"


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
