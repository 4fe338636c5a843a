"""Bench studies that are not FedPrLLM sweeps: ``[study.NAME] kind = "network"``,
``"leakage"``, ``"ppcgpt"`` (:mod:`fedcompress.bench.ppcgpt_study`), ``"privytune"``
(:mod:`fedcompress.bench.privytune_study`), ``"personalize"``
(:mod:`fedcompress.bench.personalize_study`), ``"dp"`` (:mod:`fedcompress.bench.dp_study`:
perplexity against epsilon of DP statistics mode) and ``"dp-leakage"``
(:mod:`fedcompress.bench.dp_leakage`: the leakage study's membership attackers on a DP
statistics release, per epsilon). Each is a :class:`StudyKind` of :data:`KINDS`:
planned by :func:`fedcompress.bench.sweep.plan` into cells with the same ids, stored in the
same ``OUT/results.jsonl`` and resumed by the same
:class:`~fedcompress.bench.sweep.BenchRunner` (a rerun skips finished cells and retries failed
ones; a failing cell is recorded with its error and the rest goes on), and reported by
:mod:`fedcompress.bench.run` with the other studies: their tables are built from the cells'
records (also by ``fedcompress report``, from ``report.json``).

Network (FedPrLLM Tables 16-17)
-------------------------------
Simulated end-to-end time of FedPrLLM cells under network profiles, from what each cell
measured: its bytes up and down per client, its rounds (one-shot 1, iterative one per decoder
layer) and its client and server seconds
(:func:`~fedcompress.bench.network.schedule_from_bench_record`, then
:func:`~fedcompress.bench.network.simulate`). Nothing is re-timed: arithmetic on the measured
quantities. Settings:

* ``profiles``: names of :data:`fedcompress.bench.network.PROFILES` (default all four:
  datacenter, lan, wan, edge);
* ``stragglers``: the fraction of slow clients (a list: one row per fraction; default 0.2),
  ``straggler_transfer`` (bandwidth divided by, default 2), ``straggler_compute`` (compute
  seconds multiplied by, default 2), ``straggler_seed`` (default 0);
* ``studies``: names of other studies whose FedPrLLM cells are simulated (their baselines have
  no communication and are left out); without it, the study's own FedPrLLM settings are swept
  as in any study (e.g. ``mode = ["oneshot", "iterative"]``, ``wire = ["packed",
  "compressed"]``) and its cells run with the others.

Leakage (FedPrLLM App. C)
-------------------------
What a shared mask reveals about a client's calibration windows
(:mod:`fedcompress.bench.leakage`): one cell per setting of
:class:`~fedcompress.bench.leakage.LeakageConfig` (a list is swept): ``model``,
``dtype``, ``method``, ``sparsity``, ``local_group`` (the masks' comparison group),
``clients``, ``samples_per_client`` (windows per client), ``seqlen``, ``calib_text``,
``calib_split``, ``batch_size``, ``seed`` (taken from ``[bench]`` too, as in every study) and
``layers`` (the first N decoder layers), ``replacements``, ``half_overlap``, ``nonmembers``. A
finished cell is appended to ``results.jsonl`` like any cell and skipped on a rerun.
DP statistics mode (issue 30)
-----------------------------
Perplexity against epsilon of statistics mode with differential privacy
(:mod:`fedcompress.bench.dp_study`): one cell per method, sparsity, budget (``budgets =
["16x4", "16x64"]``: sites x windows), placement and ``epsilon`` (``[1, 2, 4, 8, 16,
"none"]``; ``none``: plain statistics mode, which equals centralized pruning), each
:func:`~fedcompress.methods.fedprllm.stats.stats_prune` on the bench's windows with noise
seeded per cell (research only: no guarantee holds for a seeded draw), beside the dense,
centralized, local-only and one-shot vote cells of each budget (ordinary bench cells). Its
table has a row per setting and budget, a column per epsilon and per baseline; its plot
``dp-NAME.png`` is perplexity against epsilon.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedcompress.bench.cells import (
    EVAL_KEYS,
    SERVER_KEYS,
    BenchConfigError,
    Cell,
    Study,
    fedprllm_study,
)

if TYPE_CHECKING:
    from fedcompress.bench.labels import StudyTable
    from fedcompress.bench.sweep import BenchRunner

NETWORK_DEFAULTS: dict[str, Any] = {
    "profiles": ["datacenter", "lan", "wan", "edge"], "stragglers": [0.2],
    "straggler_transfer": 2.0, "straggler_compute": 2.0, "straggler_seed": 0}
NETWORK_KEYS = (*NETWORK_DEFAULTS, "studies")
#: Keys of a study table that describe the study, not its cells.
META_KEYS = ("title", "kind")


# ------------------------------------------------------------------------------------------
# The kinds of study
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StudyKind:
    """How the bench plans, runs and reports one kind of study (``[study.NAME] kind = ...``).

    ``plan(name, base, table, overrides)`` -> :class:`Study` (``base``: the ``[bench]`` table;
    ``overrides``: the command line's, only the keys of ``overrides`` below);
    ``record_cell(record)`` -> the :class:`Cell` a stored record belongs to, under today's
    settings (how a rerun finds what finished); ``run(runner, cells)`` runs pending cells, each
    through :meth:`~fedcompress.bench.sweep.BenchRunner.run_cell` (stored at once, a failure
    recorded); ``tables(study, results)`` -> its :class:`~fedcompress.bench.labels.StudyTable`
    list (report.md and the HTML page); ``sections(study, out)`` -> extra report sections
    ``(title, markdown)``; ``plots(study, results, out)`` -> PNG paths; ``legacy(record)``: a
    cell of the kind's former store (``OUT/cells/<id>.json``) as a bench record, or None."""

    name: str
    cell_kinds: tuple[str, ...]
    plan: Callable[..., Study] | None  # network: fedcompress.bench.sweep.plan's own
    record_cell: Callable[[dict], Cell] | None
    run: Callable[[BenchRunner, list[Cell]], None] | None
    tables: Callable[[Study, Mapping[str, dict]], list[StudyTable]]
    plots: Callable[[Study, Mapping[str, dict], Path], list[Path]] | None = None
    sections: Callable[[Study, Path], list[tuple[str, str]]] | None = None
    overrides: tuple[str, ...] = ()
    legacy: Callable[[dict], dict | None] | None = None


def settings_cells(name: str, kind: str, settings: Mapping[str, Any], config_cls
                   ) -> tuple[list[str], list[Cell]]:
    """The swept settings (lists) of ``settings`` and one cell per point of them, each the
    full settings of ``config_cls`` (a :class:`fedcompress.config.Settings`) in its order."""
    from fedcompress.config import SettingsError

    swept = [k for k, v in settings.items() if isinstance(v, list)]
    for key in swept:
        if not settings[key]:
            raise BenchConfigError(f"study {name!r}: {key} is an empty list")
    cells: dict[str, Cell] = {}
    for values in itertools.product(*(settings[k] for k in swept)):
        point = {**settings, **dict(zip(swept, values))}
        try:
            config = config_cls.from_dict(point)
        except (SettingsError, TypeError, ValueError) as err:
            raise BenchConfigError(f"study {name!r}: {err}") from err
        cell = Cell(kind, tuple(config.to_dict().items()))
        cells.setdefault(cell.id, cell)
    return swept, list(cells.values())


def check_keys(name: str, kind: str, table: Mapping[str, Any], known, hint: str = "") -> None:
    """Refuse a study table's unknown keys, naming them and what is expected."""
    unknown = sorted(set(table) - set(known) - set(META_KEYS))
    if unknown:
        raise BenchConfigError(f"study {name!r} (kind {kind}): unknown setting(s) {unknown}"
                               f"{hint}; expected some of {sorted(set(known) | set(META_KEYS))}")


def stored_cell(kind: str, record: Mapping[str, Any], config_cls, drop=(),
                legacy: Mapping[str, Any] | None = None) -> Cell:
    """The cell of a stored record whose settings are those of ``config_cls`` (settings it
    lacks, added later, take their ``legacy`` value: what the code computed before the
    setting existed; else their default)."""
    names = [k for k in config_cls.names() if k not in drop]
    values = {**config_cls.defaults(), **(legacy or {}),
              **{k: record[k] for k in names if k in record}}
    return Cell(kind, tuple((k, values[k]) for k in names))


def _lazy(module: str, name: str) -> Callable:
    def call(*args, **kwargs):
        import importlib

        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    return call


def _run_each(compute: Callable[[Cell, str | None], dict]) -> Callable:
    def run(runner: BenchRunner, cells: list[Cell]) -> None:
        for cell in cells:
            runner.run_cell(cell, lambda cell=cell: compute(cell, runner.device))

    return run


def _network_tables(study: Study, results: Mapping[str, dict]) -> list:
    return [network_table(study, results)]


def _network_plots(study: Study, results: Mapping[str, dict], out: Path) -> list[Path]:
    from fedcompress.bench import plots

    path = plots.network_times(study, network_rows(study, results),
                               out / f"network-{study.name}.png")
    return [path] if path else []


def _leakage_plots(study: Study, results: Mapping[str, dict], out: Path) -> list[Path]:
    from fedcompress.bench import plots

    path = plots.leakage_distances(study, leakage_summary(study, results),
                                   out / f"leakage-{study.name}.png")
    return [path] if path else []


_PPCGPT = "fedcompress.bench.ppcgpt_study"
_PRIVYTUNE = "fedcompress.bench.privytune_study"
_PERSONALIZE = "fedcompress.bench.personalize_study"
_DP = "fedcompress.bench.dp_study"
_DP_LEAKAGE = "fedcompress.bench.dp_leakage"

#: Every kind of study but ``fedprllm`` (the sweep of :mod:`fedcompress.bench.sweep`).
#: ``network`` studies read other studies' cells: they are planned last and run none of their
#: own kind.
KINDS: dict[str, StudyKind] = {k.name: k for k in (
    StudyKind("network", (), None, None, None, _network_tables, _network_plots,
              overrides=EVAL_KEYS),
    StudyKind("leakage", ("leakage",), lambda name, base, table, _o: leakage_study(
        name, base, table), lambda r: leakage_cell(r), _run_each(
        lambda cell, device: run_leakage_cell(cell, device)),
        lambda study, results: leakage_tables(study, results), _leakage_plots),
    StudyKind("ppcgpt", ("ppcgpt", "ppcgpt-dense", "ppcgpt-dense-sft", "ppcgpt-plain-c"),
              _lazy(_PPCGPT, "plan_study"), _lazy(_PPCGPT, "record_cell"),
              _lazy(_PPCGPT, "run_cells"), _lazy(_PPCGPT, "study_tables"),
              sections=_lazy(_PPCGPT, "study_sections"),
              overrides=("synth_url", "synth_model"), legacy=_lazy(_PPCGPT, "legacy_record")),
    StudyKind("privytune", ("privytune-classify", "privytune-attack"),
              _lazy(_PRIVYTUNE, "plan_study"), _lazy(_PRIVYTUNE, "record_cell"),
              _lazy(_PRIVYTUNE, "run_cells"), _lazy(_PRIVYTUNE, "study_tables"),
              _lazy(_PRIVYTUNE, "study_plots"), legacy=_lazy(_PRIVYTUNE, "legacy_record")),
    StudyKind("personalize", ("personalize",), _lazy(_PERSONALIZE, "plan_study"),
              _lazy(_PERSONALIZE, "record_cell"), _lazy(_PERSONALIZE, "run_cells"),
              _lazy(_PERSONALIZE, "study_tables"), _lazy(_PERSONALIZE, "study_plots")),
    StudyKind("dp", ("dp-stats", "dp-public"), _lazy(_DP, "plan_study"), _lazy(_DP, "record_cell"),
              _lazy(_DP, "run_cells"), _lazy(_DP, "study_tables"), _lazy(_DP, "study_plots"),
              overrides=EVAL_KEYS),
    StudyKind("dp-leakage", ("dp-leakage",), _lazy(_DP_LEAKAGE, "plan_study"),
              _lazy(_DP_LEAKAGE, "record_cell"), _lazy(_DP_LEAKAGE, "run_cells"),
              _lazy(_DP_LEAKAGE, "study_tables")),
)}
#: The study kind of each kind of cell (``dense`` and the other FedPrLLM cells: none).
CELL_KINDS = {cell: kind.name for kind in KINDS.values() for cell in kind.cell_kinds}


# ------------------------------------------------------------------------------------------
# Network
# ------------------------------------------------------------------------------------------

def network_study(name: str, base: Mapping[str, Any], table: Mapping[str, Any],
                  overrides: Mapping[str, Any], planned: Mapping[str, Study]) -> Study:
    """A network study: its options and the FedPrLLM cells it simulates (other studies' or
    its own sweep's)."""
    from fedcompress.bench.network import get_profile

    options = {k: table.get(k, v) for k, v in NETWORK_DEFAULTS.items()}
    for key in ("profiles", "stragglers"):
        if not isinstance(options[key], list):
            options[key] = [options[key]]
        if not options[key]:
            raise BenchConfigError(f"study {name!r}: {key} is an empty list")
    try:
        options["profiles"] = [get_profile(p).name for p in options["profiles"]]
        for fraction in options["stragglers"]:
            stragglers(options, fraction)
    except (TypeError, ValueError) as err:
        raise BenchConfigError(f"study {name!r}: {err}") from err
    rest = {k: v for k, v in table.items() if k not in NETWORK_KEYS and k not in META_KEYS}
    if "studies" in table:
        sources = table["studies"]
        sources = [sources] if isinstance(sources, str) else list(sources)
        if rest:
            raise BenchConfigError(f"study {name!r}: a network study over the cells of "
                                   f"{sources} takes no cell settings ({sorted(rest)}): set them "
                                   "in those studies, or drop `studies` to sweep its own cells")
        for source in sources:
            if source not in planned:
                raise BenchConfigError(f"study {name!r}: studies names {source!r}, which is not "
                                       "a FedPrLLM or leakage study of this config")
        cells = [c for source in sources for c in planned[source].cells]
        options["studies"] = sources
        settings: dict[str, Any] = {}
    else:
        if "baselines" in rest:
            raise BenchConfigError(f"study {name!r}: a network study has no baselines (they "
                                   "send nothing)")
        own = fedprllm_study(name, {**base, **rest, **overrides})
        cells, settings = own.cells, own.settings
    unique: dict[str, Cell] = {}
    for cell in cells:
        if cell.kind == "fedprllm":
            unique.setdefault(cell.id, cell)
    if not unique:
        raise BenchConfigError(f"study {name!r}: no FedPrLLM cell to simulate")
    study = Study(name, table.get("title", name), settings, varying(list(unique.values())), [],
                  "profile", list(unique.values()), kind="network", options=options)
    return study


def stragglers(options: Mapping[str, Any], fraction: float):
    from fedcompress.bench.network import Stragglers

    return Stragglers(fraction=float(fraction),
                      transfer_slowdown=float(options["straggler_transfer"]),
                      compute_slowdown=float(options["straggler_compute"]),
                      seed=int(options["straggler_seed"]))


def varying(cells: list[Cell]) -> list[str]:
    """The settings whose values differ between ``cells`` (in the order of the first)."""
    settings = [c.settings() for c in cells]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    return [k for k in keys if k != "kind" and k not in EVAL_KEYS
            and len({repr(s.get(k)) for s in settings}) > 1]


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def network_rows(study: Study, results: Mapping[str, dict]) -> list[dict[str, Any]]:
    """One row per (cell, straggler fraction): the cell's settings, its status, and when it
    finished its measured quantities and each profile's simulated seconds
    (:func:`fedcompress.bench.network.simulate` of its measured schedule)."""
    from fedcompress.bench.labels import strategy_label
    from fedcompress.bench.network import schedule_from_bench_record, simulate

    options = study.options
    shown = [k for k in study.swept if k not in SERVER_KEYS and k != "mode"]
    rows = []
    for cell in study.cells:
        settings = cell.settings()
        record = results.get(cell.id)
        for fraction in options["stragglers"]:
            row: dict[str, Any] = {
                "cell": cell.id, "strategy": strategy_label(settings),
                "settings": {k: settings.get(k) for k in shown}, "stragglers": float(fraction)}
            rows.append(row)
            if record is None:
                row["status"] = "pending"
                continue
            if record.get("status") != "ok":
                row["status"] = "failed"
                continue
            try:
                schedule, server_s = schedule_from_bench_record(record)
                sims = {p: simulate(schedule, int(record["clients"]), p,
                                    stragglers(options, fraction), server_s)
                        for p in options["profiles"]}
            except (KeyError, TypeError, ValueError) as err:
                row["status"] = f"not simulated: {err}"
                continue
            first = next(iter(sims.values()))
            row.update(status="ok", clients=int(record["clients"]), rounds=schedule.rounds,
                       bytes_up=first.bytes_up_per_client, bytes_down=first.bytes_down_per_client,
                       client_seconds=float(sum(schedule.matrix("compute_s", 1)[:, 0])),
                       server_seconds=server_s * schedule.rounds,
                       slow_clients=len(first.stragglers),
                       seconds={p: r.total_seconds for p, r in sims.items()},
                       homogeneous_seconds={p: r.homogeneous_seconds for p, r in sims.items()})
    return rows


def network_table(study: Study, results: Mapping[str, dict]):
    """The study's table: rows (cell x straggler fraction), columns the measured quantities and
    each profile's simulated seconds."""
    from fedcompress.bench.labels import StudyTable, format_value
    from fedcompress.bench.network import PROFILES, format_bits_per_second

    options = study.options
    rows = network_rows(study, results)
    shown = list(rows[0]["settings"]) if rows else []
    several = len(options["stragglers"]) > 1
    header = [*shown, "strategy", *(["stragglers"] if several else []), "rounds",
              "up / client", "down / client", "client s", "server s",
              *(f"{p} s" for p in options["profiles"])]
    body = []
    for row in rows:
        line = [*(format_value(row["settings"][k]) for k in shown), row["strategy"],
                *([f"{row['stragglers']:g}"] if several else [])]
        if row["status"] != "ok":
            body.append(line + [row["status"]] + [""] * (len(header) - len(line) - 1))
            continue
        body.append(line + [str(row["rounds"]), _bytes(row["bytes_up"]),
                            _bytes(row["bytes_down"]), f"{row['client_seconds']:.4g}",
                            f"{row['server_seconds']:.3g}",
                            *(f"{row['seconds'][p]:.4g}" for p in options["profiles"])])
    profiles = "; ".join(
        f"{p} {PROFILES[p].latency_s * 1000:g} ms, {format_bits_per_second(PROFILES[p].down_bps)}"
        for p in options["profiles"])
    fractions = ", ".join(f"{f:.0%}" for f in options["stragglers"])
    source = (f"the FedPrLLM cells of {', '.join(f'`{s}`' for s in options['studies'])}"
              if "studies" in options else "its FedPrLLM cells")
    note = (f"Simulated end-to-end seconds (lower is better) of {source} on each network profile "
            f"({profiles}; symmetric), from what each cell measured: bytes up/down per client "
            "(its wire format), rounds (one-shot 1, iterative one per decoder layer), a "
            "client's compute seconds (mean over clients; the compressed format's encoding "
            "included) and the server's (`server s`, all rounds: counting, selection and, for the "
            "compressed format, the public reference norms it computes each run and the "
            "decoding of every payload). Synchronous rounds: each waits for the "
            f"slowest client. Stragglers: {fractions} of the clients (seed "
            f"{options['straggler_seed']}) with bandwidth / {options['straggler_transfer']:g} "
            f"and compute x {options['straggler_compute']:g}. Nothing is re-timed "
            "(`fedcompress.bench.network`).")
    first = header.index(f"{options['profiles'][0]} s")
    return StudyTable("", note, header, body, first_value=first, best="min")


# ------------------------------------------------------------------------------------------
# Leakage
# ------------------------------------------------------------------------------------------

def leakage_study(name: str, base: Mapping[str, Any], table: Mapping[str, Any]) -> Study:
    """A leakage study: one cell per point of its swept settings."""
    from fedcompress.bench.leakage import LeakageConfig

    names = LeakageConfig.names()
    check_keys(name, "leakage", table, names, " (the masks' comparison group is local_group)"
               if "group" in table else "")
    # [bench] settings that mean the same here (model, method, clients, ...) apply too
    settings = {k: base[k] for k in names if k in base}
    settings.update({k: table[k] for k in names if k in table})
    swept, cells = settings_cells(name, "leakage", settings, LeakageConfig)
    return Study(name, table.get("title", name), settings, swept, [], None, cells,
                 kind="leakage")


def leakage_cell(record: Mapping[str, Any]) -> Cell:
    """The cell a stored leakage record belongs to (settings it lacks, added later, take their
    default)."""
    from fedcompress.bench.leakage import LeakageConfig

    return stored_cell("leakage", record, LeakageConfig)


def run_leakage_cell(cell: Cell, device: str | None = None) -> dict:
    """Measure one leakage cell: the whole result under ``leakage``, its headline numbers as
    fields of the record."""
    from fedcompress.bench.leakage import LeakageConfig, measure

    config = LeakageConfig.from_dict(dict(cell.client))
    timings: dict[str, float] = {}
    result = measure(config, device, timings)
    hm, sens, mem = result["hamming"], result["sensitivity"], result["membership"]
    return {"name": f"leakage {config.method} {config.sparsity:g} {config.local_group}",
            "measured_layers": result["scope"]["layers"],
            "masks": len(result["mask_seconds"]),
            "hamming_disjoint": hm["disjoint"]["mean"],
            "hamming_one_window": hm["overlap_w_minus_1"]["mean"],
            "with_vs_without_target": sens["with_vs_without_target"]["mean"],
            "h_given_other_client": result["information"]["h_mask_given_other_client"]["mean"],
            "auc_knows_rest": mem["knows_rest"]["auc_within"],
            "auc_reference": mem["reference"]["auc_within"],
            "top1_reference": mem["reference"]["top1"],
            "phase_seconds": timings, "leakage": result}


def _cell_label(study: Study, cell: Cell) -> str:
    settings = dict(cell.client)
    return ", ".join(f"{k}={settings[k]}" for k in study.swept) or "measured"


def leakage_tables(study: Study, results: Mapping[str, dict]) -> list:
    """One table per part of the analysis (information, Hamming distances, sensitivity,
    membership): a row per quantity, a column per cell (its swept settings), the paper's
    value last."""
    from fedcompress.bench.labels import StudyTable, format_value
    from fedcompress.bench.leakage import PAPER, PARTS, quantities, scope_text

    columns, values, labels = [], [], {}
    first = None
    for cell in study.cells:
        columns.append(_cell_label(study, cell))
        record = results.get(cell.id)
        if record is None:
            values.append("pending")
        elif record.get("status") != "ok":
            values.append("failed")
        else:
            result = record["leakage"]
            first = first or result
            rows = {key: value for _, key, _, value in quantities(result)}
            for part, key, label, _ in quantities(result):
                labels.setdefault(key, (part, label))
            values.append(rows)
    settings = dict(study.cells[0].client) if study.cells else study.settings
    fixed = {k: v for k, v in settings.items() if k not in study.swept}
    note = ("Fixed: " + ", ".join(f"{k}={format_value(v)}" for k, v in sorted(fixed.items())) + ". "
            + (scope_text(first) if first else "No cell has finished yet."))
    tables = []
    for part, caption in PARTS.items():
        keys = [k for k, (p, _) in labels.items() if p == part]
        body = [[labels[k][1], *(v if isinstance(v, str) else v.get(k, "") for v in values),
                 PAPER.get(k, "")] for k in keys]
        if not keys:
            body = [["(every quantity)", *(v if isinstance(v, str) else "" for v in values), ""]]
        tables.append(StudyTable(f"({part}) {caption}", note if part == "a" else "",
                                 ["quantity", *columns, "paper (LLaMA-7B)"], body,
                                 first_value=1, best=None))
    return tables


def leakage_summary(study: Study, results: Mapping[str, dict]) -> dict[str, dict]:
    """Per finished cell (by its label): the Hamming distances by overlap and per decoder
    layer, for the plot."""
    out = {}
    for cell in study.cells:
        record = results.get(cell.id)
        if not record or record.get("status") != "ok":
            continue
        r = record["leakage"]
        hm, sens = r["hamming"], r["sensitivity"]
        w = r["config"]["samples_per_client"]
        out[_cell_label(study, cell)] = {
            "overlap": {"same windows": hm["same_windows"],
                        f"{w - 1}/{w} shared": hm["overlap_w_minus_1"],
                        f"{w // 2}/{w} shared": hm["overlap_half"],
                        "disjoint": hm["disjoint"],
                        f"with vs without target ({w} vs {w - 1})":
                            sens["with_vs_without_target"]},
            "per_layer": hm["per_decoder_layer"]}
    return out
