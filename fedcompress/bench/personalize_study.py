"""Federated personalized layer pruning against uniform FedPrLLM and local-only pruning, per
site, and seed 004's ablations, as a bench study (``[study.NAME] kind = "personalize"`` of
``fedcompress bench CONFIG.toml``; configs ``simulations/bench_personalized*.toml``).

Non-IID sites (e.g. Dirichlet over the wiki, shakespeare and code corpora, alpha 0.1): each site
classifies the units of the model on its calibration windows (Alg. 1 of seed 004), the server
counts the classes, votes masks at the global plan, and each site keeps its personalized units
with local masks (:mod:`fedcompress.methods.personalize`). Every model is scored by the
perplexity of the site's OWN held-out windows (the test split of its corpora, the same source
mixture as its calibration windows), at equal overall sparsity for every method:

* ``dense``: the unpruned model (always scored);
* ``local-only``: the site's own masks at ``p`` (no federation);
* ``fedprllm``: uniform FedPrLLM, one global mask at ``p`` for every site;
* ``seed004-local``: the paper's method alone at the site (Eq. 4 on its own classes, local
  masks);
* ``personalized``: the federated design above.

The study's table holds any :class:`~fedcompress.methods.personalize.PersonalizeConfig`
setting (a list is swept, e.g. ``sparsity = [0.5, 0.6, 0.7]``, ``k = [2, 4, 8]``,
``importance = ["wanda", "gradient"]``, ``personalized_factor = [0.5, 0.0]``,
``adapt_steps = [0, 16]``; ``[bench]`` settings of the same name apply too) and ``methods``
(some of :data:`METHODS`, default all). One cell per point; the cells are planned, stored
(``OUT/results.jsonl``), resumed and reported by the bench (:mod:`fedcompress.bench.studies`).
The sites' classes depend only on the data and Alg. 1 settings: computed once per such setting
and kept under ``OUT/personalize/`` (every cell with those settings, in any study of the
folder, reuses them; a resumed run too), with a heat map ``unit-classes-<key>.png``.

Unlike the paper, ``p`` is held fixed within a cell (the plans are rescaled to it), so a
variant changes which weights go, never how many. A site whose Eq. 4 plan cannot reach ``p``
is recorded in the cell's ``errors`` and scored ``-``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedcompress.bench.cells import BenchConfigError, Cell, Study
from fedcompress.bench.studies import check_keys, settings_cells, stored_cell
from fedcompress.report import atomic_write

if TYPE_CHECKING:
    from fedcompress.bench.labels import StudyTable
    from fedcompress.bench.sweep import BenchRunner

logger = logging.getLogger(__name__)

#: The models a site can score besides the dense one (module docstring).
METHODS = ("local-only", "fedprllm", "seed004-local", "personalized")
#: The settings the sites' classes depend on (the data and Alg. 1).
CLASSIFY_KEYS = ("model", "dtype", "clients", "samples_per_client", "seqlen", "calib_text",
                 "partition", "alpha", "seed", "k", "max_iter", "granularity", "zero",
                 "adapt_steps", "adapt_lr", "batch_size")
#: Besides the windows, what the local-only and uniform FedPrLLM baselines depend on.
_BASELINE_KEYS = ("sparsity", "importance", "group", "tie_break")
#: What a cell stored before these settings existed computed: Alg. 1's own rule, Eq. 4
#: without a bound, no guard.
LEGACY = {"class_rule": "paper", "class_quantile": 0.5, "ratio_bound": 1.0, "guard": "off"}
_WINDOW_KEYS = ("model", "dtype", "clients", "samples_per_client", "seqlen", "calib_text",
                "partition", "alpha", "seed", "batch_size")


def _config_cls():
    from fedcompress.methods.personalize import PersonalizeConfig

    return PersonalizeConfig


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def _methods(name: str, value: Any) -> str:
    methods = [value] if isinstance(value, str) else list(value)
    methods = [m for part in methods for m in str(part).split(",") if m]
    bad = sorted(set(methods) - set(METHODS))
    if bad or not methods:
        raise BenchConfigError(f"study {name!r}: methods {bad or methods}: expected some of "
                               f"{list(METHODS)}")
    return ",".join(m for m in METHODS if m in methods)


def plan_study(name: str, base: Mapping[str, Any], table: Mapping[str, Any],
               overrides: Mapping[str, Any]) -> Study:
    """A personalized-pruning study: one cell per point of its swept settings."""
    config_cls = _config_cls()
    names = config_cls.names()
    check_keys(name, "personalize", table, [*names, "methods"])
    settings = {k: base[k] for k in names if k in base}
    settings.update({k: v for k, v in table.items() if k in names})
    methods = _methods(name, table.get("methods", list(METHODS)))
    swept, cells = settings_cells(name, "personalize", settings, config_cls)
    cells = [Cell("personalize", (*cell.client, ("methods", methods))) for cell in cells]
    return Study(name, str(table.get("title", name)), {**settings, "methods": methods}, swept,
                 [], None, cells, kind="personalize")


def record_cell(record: Mapping[str, Any]) -> Cell:
    cell = stored_cell("personalize", record, _config_cls(), legacy=LEGACY)
    return Cell("personalize", (*cell.client, ("methods", record.get("methods",
                                                                     ",".join(METHODS)))))


def classify_key(settings: Mapping[str, Any]) -> str:
    return _digest({k: settings[k] for k in CLASSIFY_KEYS})


# ------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------

class CellRunner:
    """Computes personalize cells: each model loaded once, each federation's windows and dense
    perplexities once, the sites' classes once per data and Alg. 1 settings (on disk)."""

    def __init__(self, runner: BenchRunner):
        self.runner = runner
        self.out = runner.out
        self._models: dict[tuple, Any] = {}
        self._windows: dict[str, dict] = {}
        self._baselines: dict[str, dict[str, list[tuple]]] = {}

    def model(self, config):
        from fedcompress.models import load_model

        key = (config.model, config.dtype)
        if key not in self._models:
            self._models.clear()
            self._models[key] = load_model(config.model, device=self.runner.device or "cpu",
                                           dtype=config.dtype)
        return self._models[key]

    def windows(self, config, loaded) -> dict:
        """The sites' calibration and held-out windows, their source mixture and the dense
        model's held-out perplexity per site."""
        from fedcompress.methods import personalize as pz
        from fedcompress.methods.fedprllm.federated import federation_windows

        key = _digest({k: getattr(config, k) for k in _WINDOW_KEYS})
        if key not in self._windows:
            calib, sources = federation_windows(loaded.tokenizer, config.windows_config("train"))
            held, held_sources = federation_windows(loaded.tokenizer,
                                                    config.windows_config("test"))
            if sources != held_sources:
                raise RuntimeError("held-out windows do not follow the calibration mixture")
            mixture = ([dict(sorted((s, src.count(s)) for s in set(src))) for src in sources]
                       if sources else [{config.calib_text: len(w)} for w in calib])
            dense = [pz.windows_perplexity(loaded.model, w, config.batch_size) for w in held]
            self._windows[key] = {"calib": calib, "held": held, "sources": mixture,
                                  "dense": dense}
        return self._windows[key]

    def baseline_scores(self, config, model, calib, held) -> dict[str, list[tuple]]:
        """Every site's held-out (perplexity, achieved sparsity) of local-only (its own masks
        at ``p``) and uniform FedPrLLM (the vote of those masks at ``p``): they depend on the
        data, ``p`` and the vote's settings only, so the cells that differ elsewhere (class
        rule, bound, guard, factors) share them (kept in memory for the run)."""
        from fedcompress.methods import personalize as pz
        from fedcompress.methods.fedprllm.federated import MaskAggregator
        from fedcompress.pruning.local import local_masks

        key = _digest({k: getattr(config, k) for k in (*_WINDOW_KEYS, *_BASELINE_KEYS)})
        if key not in self._baselines:
            uniform = MaskAggregator(model, config.clients)
            local = []
            for s in range(config.clients):
                masks = local_masks(model, calib[s], config.prune_config(),
                                    batch_size=config.batch_size).masks
                local.append(_score(model, masks, held[s], config.batch_size))
                uniform.add(_flat(masks))
                del masks
            voted = pz.masks_by_layer_list(pz.shared_masks(
                uniform.counts(), pz.SparsityPlan(config.sparsity), set(), model, config.group,
                config.tie_break), model)
            self._baselines[key] = {
                "local-only": local,
                "fedprllm": [_score(model, voted, held[s], config.batch_size)
                             for s in range(config.clients)]}
        return self._baselines[key]

    def classes(self, config, loaded, calib) -> tuple[list, float, str]:
        """Every site's classification (Alg. 1), its draws computed once per
        :data:`CLASSIFY_KEYS` and kept in ``OUT/personalize/classes-<key>.json`` (the paper's
        classes with them), the classes of the cell's ``class_rule`` derived from the same
        draws; its seconds; its key."""
        from fedcompress.layers.personalized import (
            Classification,
            classify_units,
            reclassify,
            units_of,
        )
        from fedcompress.methods import personalize as pz

        settings = config.to_dict()
        key = classify_key(settings)
        path = self.out / "personalize" / f"classes-{key}.json"
        units = units_of(loaded.model, config.granularity)
        if path.exists():
            stored = json.loads(path.read_text())
            sites = [Classification(c["classes"], units, c["threshold"], c["draws"],
                                    c.get("adapt_losses", []), c.get("rule", "paper"),
                                    c.get("base_loss", c["threshold"]))
                     for c in stored["sites"]]
        else:
            start = time.perf_counter()
            paper = config.replace(class_rule="paper")  # the draws: the same under any rule
            sites = [classify_units(loaded.model, calib[s], paper.classify_config(s))
                     for s in range(config.clients)]
            seconds = time.perf_counter() - start
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps({"settings": {k: settings[k] for k in CLASSIFY_KEYS},
                                           "seconds": seconds,
                                           "sites": [c.to_dict() for c in sites]}) + "\n")
            counts = pz.global_classes([c.classes for c in sites])
            pz.plot_unit_classes(counts, self.out / f"unit-classes-{key}.png")
            stored = {"seconds": seconds}
        if config.class_rule != "paper":  # the same draws, the cell's rule
            sites = [reclassify(units, c.draws, c.base_loss if c.base_loss is not None
                                else c.threshold, config.class_rule, config.class_quantile)
                     for c in sites]
        return sites, stored["seconds"], key

    def compute(self, cell: Cell) -> dict:
        """One cell: every site's held-out perplexity per method at the cell's sparsity."""
        from fedcompress.layers.personalized import units_of
        from fedcompress.methods import personalize as pz
        from fedcompress.methods.fedprllm.federated import MaskAggregator
        from fedcompress.pruning.local import local_masks

        settings = dict(cell.client)
        methods = settings.pop("methods").split(",")
        config = _config_cls().from_dict(settings)
        loaded = self.model(config)
        model = loaded.model
        data = self.windows(config, loaded)
        calib, held = data["calib"], data["held"]
        classifications, classify_seconds, key = self.classes(config, loaded, calib)
        counts = pz.global_classes([c.classes for c in classifications])
        units = units_of(model, config.granularity)
        p, batch = config.sparsity, config.batch_size
        sites = range(config.clients)
        errors: list[dict] = []
        baselines = (self.baseline_scores(config, model, calib, held)
                     if {"local-only", "fedprllm"} & set(methods) else {})
        voted_counts, plan, plan_info = None, None, None
        bound = config.bound
        try:
            plan = pz.site_classes_plan(units, counts.classes, model, p, config.factors, bound)
            plan_info = pz.site_plan_summary(units, counts.classes, model, p, config.factors,
                                             bound)
        except ValueError as err:  # Eq. 4 cannot reach p on the global classes: recorded
            errors.append({"site": "all", "method": "global plan", "error": str(err)})
        site_plans: list[dict | None] = []
        if "personalized" in methods and plan is not None:
            voted = MaskAggregator(model, config.clients)
            for s in sites:
                voted.add(_flat(local_masks(model, calib[s], config.prune_config(plan.to_text()),
                                            batch_size=batch).masks))
            voted_counts = voted.counts()
        perplexity: dict[str, list[float]] = {m: [] for m in methods}
        achieved: dict[str, list[float]] = {m: [] for m in methods}
        for s in sites:
            site = classifications[s]
            plans = {}
            for name, classes in (("seed004-local", site.classes),
                                  ("personalized", pz.site_view(site, counts))):
                if name not in methods or (name == "personalized" and voted_counts is None):
                    continue
                try:
                    plans[name] = pz.site_classes_plan(units, classes, model, p,
                                                       config.factors, bound)
                    if name == "personalized":
                        site_plans.append(pz.site_plan_summary(units, classes, model, p,
                                                               config.factors, bound))
                except ValueError as err:  # Eq. 4 cannot reach p for this site: recorded
                    errors.append({"site": s, "method": name, "error": str(err)})
                    if name == "personalized":
                        site_plans.append(None)  # one entry per site, in site order
            candidates = {}
            if "seed004-local" in plans:
                candidates["seed004-local"] = pz.site_masks(
                    model, calib[s], plans["seed004-local"], None, batch_size=batch,
                    importance=config.importance)
            if "personalized" in plans:
                assert voted_counts is not None
                candidates["personalized"] = pz.site_masks(
                    model, calib[s], plans["personalized"],
                    pz.shared_masks(voted_counts, plans["personalized"],
                                    pz.personal_linears(site), model, config.group,
                                    config.tie_break),
                    batch_size=batch, importance=config.importance)
            for name in methods:
                ppl, fraction = (baselines[name][s] if name in baselines else
                                 _score(model, candidates[name], held[s], batch)
                                 if name in candidates else (math.nan, math.nan))
                perplexity[name].append(ppl)
                achieved[name].append(fraction)
        both = {"personalized", "fedprllm"} <= set(methods)
        wins = (sum(a < b for a, b in zip(perplexity["personalized"], perplexity["fedprllm"])
                    if not math.isnan(a))
                if both else None)
        kept: list[str] = []
        if both and config.guard != "off":  # each site's guard, on its held-out windows
            perplexity["kept"] = []
            for mine, uniform in zip(perplexity["personalized"], perplexity["fedprllm"]):
                choice = ("fedprllm" if math.isnan(mine) else
                          pz.guard_choice({"personalized": mine, "fedprllm": uniform})[0])
                kept.append(choice)
                perplexity["kept"].append(uniform if choice == "fedprllm" else mine)
        return {"name": f"personalize p={p:g}", "sources": data["sources"],
                "dense": data["dense"], "perplexity": perplexity, "achieved_sparsity": achieved,
                "wins": wins, "errors": errors, "kept": kept,
                "global_plan": plan.to_dict() if plan else None, "plan": plan_info,
                "site_plans": site_plans, "classes_key": key,
                "classify_seconds": classify_seconds,
                "classes": {**counts.to_dict(),
                            "site_counts": [c.counts() for c in classifications]}}


def _flat(masks: list[dict]) -> dict:
    from fedcompress.methods.fedprllm.federated import mask_key

    return {mask_key(i, n): m for i, layer in enumerate(masks) for n, m in layer.items()}


def _score(model, masks, windows, batch_size) -> tuple[float, float]:
    from fedcompress.methods import personalize as pz
    from fedcompress.pruning.local import apply_masks, sparsity_report

    pruned = apply_masks(copy.deepcopy(model), masks)
    result = (pz.windows_perplexity(pruned, windows, batch_size),
              sparsity_report(pruned)["overall"])
    del pruned
    return result


def run_cells(runner: BenchRunner, cells: list[Cell]) -> None:
    """Run the pending personalize cells (the bench stores each at once)."""
    computer = CellRunner(runner)
    for cell in cells:
        runner.run_cell(cell, lambda cell=cell: computer.compute(cell))


# ------------------------------------------------------------------------------------------
# Tables and plots
# ------------------------------------------------------------------------------------------

def _fmt(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}"


def _mean_median(values: list[float]) -> str:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return "-"
    return f"{statistics.fmean(finite):.2f} ({statistics.median(finite):.2f})"


def _label(study: Study, cell: Cell) -> str:
    settings = dict(cell.client)
    return ", ".join(f"{k}={settings[k]:g}" if isinstance(settings[k], float)
                     else f"{k}={settings[k]}" for k in study.swept) or "measured"


def study_tables(study: Study, results: Mapping[str, dict]) -> list[StudyTable]:
    """A summary (one row per cell: mean (median) held-out perplexity over the sites per
    method, the sites where personalized beats uniform FedPrLLM, mean units per class), then
    each finished cell's per-site table."""
    from fedcompress.bench.labels import StudyTable

    fixed = {k: v for k, v in study.settings.items() if k not in study.swept}
    names = ["dense", *METHODS, "kept"]
    rows, per_site = [], []
    for cell in study.cells:
        label = _label(study, cell)
        r = results.get(cell.id)
        if r is None or r.get("status") != "ok":
            status = "pending" if r is None else f"failed: {r.get('error', '?')[:100]}"
            rows.append([label, status, *[""] * (len(names) + 1)])
            continue
        sites = len(r["dense"])
        per = {"dense": r["dense"], **r["perplexity"]}
        mean_units = {c: statistics.fmean(s[c] for s in r["classes"]["site_counts"])
                      for c in ("personalized", "generic", "others")}
        against = versus_fedprllm(per)
        plan = r.get("plan") or {}
        rows.append([label, "ok", *[_mean_median(per[n]) if n in per else "-" for n in names],
                     "-" if r.get("wins") is None else f"{r['wins']}/{sites}",
                     "-" if against is None else
                     f"{against['within']}/{against['sites']}, {_ratio(against['worst'])}",
                     " / ".join(f"{mean_units[c]:.1f}" for c in mean_units),
                     f"{plan['min_ratio']:.2f}-{plan['max_ratio']:.2f}"
                     + (" (bound bit)" if plan.get("bound_bit") else "") if plan else "-"])
        body = [[str(s), ", ".join(f"{k} {v}" for k, v in r["sources"][s].items()),
                 *[_fmt(per[n][s]) if n in per else "-" for n in names]]
                for s in range(sites)]
        finite = {n: [v for v in values if not math.isnan(v)]
                  for n, values in r["achieved_sparsity"].items()}
        achieved = ", ".join(f"{n} {statistics.fmean(v):.4f}" for n, v in finite.items() if v)
        errors = "; ".join(f"site {e['site']}, {e['method']}: {e['error']}"
                           for e in r.get("errors", []))
        per_site.append(StudyTable(
            f"{label}: held-out perplexity per site", f"Achieved sparsity (mean over sites): "
            f"{achieved or '-'}." + (f" Not scored: {errors}." if errors else ""),
            ["site", "sources", *names], body, first_value=2, best=None))
    note = ("Perplexity of each site's own held-out windows (lower is better), mean (median) "
            "over the sites; every model of a row has the same overall sparsity. `wins`: sites "
            "where personalized beats uniform FedPrLLM; `within 2%, worst`: sites where "
            "personalized is at most 2% worse than uniform FedPrLLM (or better), and its "
            "worst ratio to it; `kept`: the model each site's guard kept (the better of the "
            "two on its held-out windows: optimistic, chosen on the windows it is scored on). "
            "Units: mean units per site classified personalized / generic / others (Alg. 1). "
            "Global plan: its lowest and highest ratio. Fixed: "
            + ", ".join(f"{k}={v}" for k, v in sorted(fixed.items())) + ".")
    summary = StudyTable("", note, ["cell", "status", *names, "wins", "within 2%, worst",
                                    "units p / g / o", "global plan"], rows, first_value=2,
                         best=None)
    return [summary, *per_site]


def _ratio(worst: float) -> str:
    """The worst ratio to uniform FedPrLLM as the table prints it (a site whose plan failed
    makes it infinite: said in words)."""
    return "a site's plan failed" if math.isinf(worst) else f"{worst:.2f}x"


def versus_fedprllm(perplexity: Mapping[str, list[float]], margin: float = 0.02
                    ) -> dict | None:
    """Personalized against uniform FedPrLLM over the sites: how many are within ``margin``
    (relative) of it or better, and the worst ratio (a site whose plan failed counts as
    worse: ratio infinite); None without both."""
    if "personalized" not in perplexity or "fedprllm" not in perplexity:
        return None
    ratios = [math.inf if math.isnan(a) else a / b
              for a, b in zip(perplexity["personalized"], perplexity["fedprllm"])]
    return {"sites": len(ratios), "within": sum(r <= 1 + margin for r in ratios),
            "worst": max(ratios) if ratios else math.nan}


def study_plots(study: Study, results: Mapping[str, dict], out: Path) -> list[Path]:
    """The heat maps of the sites' classes the study's cells used."""
    keys = dict.fromkeys(r["classes_key"] for c in study.cells
                         if (r := results.get(c.id)) and r.get("status") == "ok")
    return [path for key in keys if (path := out / f"unit-classes-{key}.png").exists()]

