"""How the bench names and shows what it measured: the label of a cell's strategy
(:func:`strategy_label`), a setting's value (:func:`format_value`) and a byte count
(:func:`human_bytes`) as a table shows them, and :class:`StudyTable`, the table every kind of
study is reported in (:mod:`fedcompress.bench.tables` builds a FedPrLLM sweep's; each kind of
:mod:`fedcompress.bench.studies` its own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def format_value(value: Any) -> str:
    """A setting's value in a table: a float in its shortest form (``0.5``, ``1e-05``)."""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def human_bytes(n: float) -> str:
    """``163774464`` -> ``164 MB`` (decimal units, three significant digits)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


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
