"""PrunePrivyTune's tables in one command (``fedcompress privytune-study CONFIG.toml``).

Reproduces the shape of the paper's tables (../shared/papers/prune-privy-tune.txt) with the
centralized pipeline (:func:`fedcompress.methods.privytune.central_run`, the paper's setting: one
data holder), one column per task:

* Table 1: redundancy measure (adjacent "Cosine" vs "Pairwise-Cosine") x training (Train = full,
  LoRA) x DP (none, the study's epsilon), at ``compare_ratio`` (default: the smallest ratio;
  each cell names the layers it removed, so a reader sees where both measures pick the same);
* Table 2 (Train) and Table 3 (LoRA): removal ratio x DP, pairwise measure;
* Table 4: Train vs LoRA under DP by ratio (the cells of Tables 2-3);
* Table 6: the extraction audit by epsilon (the ``[attack]`` table: a causal LM fine-tuned on
  private text, perplexity and BERTScore of members vs held-out);
* Fig. 2: the heat map of the base model's cosine matrix per task (``fig2-<task>.png``).

A config has ``[study]`` (``title``, ``tasks``: task names, ``name:label1,label2`` picks a label
subset; ``epsilon``: the DP column; ``ratios``; ``compare_ratio``: Table 1's),
``[privytune]`` (any setting of :class:`~fedcompress.methods.privytune.PrivyTuneConfig` for the
classification cells) and an optional ``[attack]`` (settings for the audit cells, plus
``epsilons``: 0 means no DP).

Every cell is stored in ``OUT/cells/<id>.json`` as soon as it finishes (its id is a digest of
its full settings); a cell whose removal plan equals a finished cell's (same layers removed,
every other setting equal: e.g. both measures picking the same layers) takes that cell's result,
marked ``same_plan_as``, instead of training the same model again; a rerun skips finished cells
and retries failed ones; a failing cell is
recorded with its error and the study goes on. Wall times per cell are in the tables' report.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import tomllib
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedcompress.layers.redundancy import CosineMatrix, plot_cosine_matrix
from fedcompress.layers.removal import lowest_score_plan
from fedcompress.methods import privytune as ppt
from fedcompress.models import load_model
from fedcompress.report import RunReport, atomic_write, markdown_table

logger = logging.getLogger(__name__)

STUDY_KEYS = ("title", "tasks", "epsilon", "ratios", "compare_ratio")


class StudyConfigError(ValueError):
    """A study config that names an unknown table or key, or an invalid setting."""


@dataclass(frozen=True)
class Cell:
    """One run of the centralized pipeline."""

    table: str  # "classify" or "attack"
    settings: dict[str, Any]

    @property
    def id(self) -> str:
        text = json.dumps({"table": self.table, **self.settings}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def config(self) -> ppt.PrivyTuneConfig:
        return ppt.PrivyTuneConfig.from_dict(self.settings)


@dataclass
class Study:
    title: str
    tasks: list[tuple[str, str]]  # (task, labels)
    epsilon: float
    ratios: list[float]
    base: dict[str, Any]
    attack: dict[str, Any] | None
    epsilons: list[float] = field(default_factory=list)
    compare_ratio: float | None = None

    @property
    def table1_ratio(self) -> float:
        return min(self.ratios) if self.compare_ratio is None else self.compare_ratio

    def classify_cell(self, task: tuple[str, str], measure: str, mode: str, private: bool,
                      ratio: float) -> Cell:
        return Cell("classify", {**self.base, "task": task[0], "labels": task[1],
                                 "measure": measure, "mode": mode, "ratio": ratio,
                                 "removal": "ratio",
                                 "epsilon": self.epsilon if private else 0.0})

    def attack_cell(self, epsilon: float) -> Cell:
        return Cell("attack", {**(self.attack or {}), "epsilon": epsilon})

    def cells(self) -> list[Cell]:
        out: dict[str, Cell] = {}
        first = self.table1_ratio
        for task in self.tasks:
            for measure in ("adjacent", "pairwise"):
                for mode in ("full", "lora"):
                    for private in (False, True):
                        cell = self.classify_cell(task, measure, mode, private, first)
                        out[cell.id] = cell
            for ratio in self.ratios:
                for mode in ("full", "lora"):
                    for private in (False, True):
                        cell = self.classify_cell(task, "pairwise", mode, private, ratio)
                        out[cell.id] = cell
        for epsilon in self.epsilons:
            cell = self.attack_cell(epsilon)
            out[cell.id] = cell
        return list(out.values())


def load_study(path: str | Path) -> Study:
    raw = tomllib.loads(Path(path).read_text())
    unknown = sorted(set(raw) - {"study", "privytune", "attack"})
    if unknown:
        raise StudyConfigError(f"unknown table(s) {unknown}: expected [study], [privytune], "
                               "[attack]")
    meta = dict(raw.get("study", {}))
    bad = sorted(set(meta) - set(STUDY_KEYS))
    if bad:
        raise StudyConfigError(f"unknown [study] key(s) {bad}: expected some of {STUDY_KEYS}")
    tasks = []
    for entry in meta.get("tasks", ["epistemic_reasoning"]):
        name, _, labels = str(entry).partition(":")
        if name == "glue":  # glue:<name> keeps its colon
            name, _, labels = str(entry), "", ""
        tasks.append((name, labels))
    base = dict(raw.get("privytune", {}))
    attack = dict(raw["attack"]) if "attack" in raw else None
    epsilons = [float(e) for e in (attack or {}).pop("epsilons", [])]
    ratios = [float(r) for r in meta.get("ratios", [0.1, 0.2, 0.3])]
    compare = meta.get("compare_ratio")
    study = Study(str(meta.get("title", "PrunePrivyTune")), tasks,
                  float(meta.get("epsilon", 1.0)), ratios, base, attack, epsilons,
                  None if compare is None else float(compare))
    try:  # every cell's settings valid before anything runs
        for cell in study.cells():
            cell.config()
    except ValueError as err:
        raise StudyConfigError(str(err)) from err
    return study


class StudyRunner:
    """Runs cells in order, loading each base model once and each task's matrix once."""

    def __init__(self, study: Study, out: Path):
        self.study = study
        self.out = out
        (out / "cells").mkdir(parents=True, exist_ok=True)
        self.results: dict[str, dict] = {}
        for path in (out / "cells").glob("*.json"):
            record = json.loads(path.read_text())
            if record.get("status") == "ok":
                self.results[path.stem] = record
        self._models: dict[str, Any] = {}
        self._matrices: dict[str, CosineMatrix] = {}

    def pending(self) -> list[Cell]:
        return [c for c in self.study.cells() if c.id not in self.results]

    def _base(self, config: ppt.PrivyTuneConfig):
        if config.model not in self._models:
            self._models.clear()
            self._models[config.model] = load_model(config.model, device="cpu",
                                                    dtype=config.dtype)
        return self._models[config.model]

    def _matrix(self, config: ppt.PrivyTuneConfig, loaded, union: ppt.SiteData) -> CosineMatrix:
        key = json.dumps([config.model, config.task, config.labels, config.objective,
                          config.corpus, config.similarity_texts, config.max_length,
                          config.train_examples, config.seed])
        if key not in self._matrices:
            matrix = ppt.site_cosines(config, loaded.model, loaded.tokenizer, union)
            self._matrices[key] = matrix
            name = config.task if config.objective == "classify" else config.corpus
            plot_cosine_matrix(matrix, self.out / f"fig2-{name.replace(':', '-')}.png",
                               title=f"{config.model} on {name}: pairwise cosine (Fig. 2)")
        return self._matrices[key]

    @staticmethod
    def plan_key(cell: Cell, removed: tuple[int, ...]) -> str:
        """What a cell's result depends on: its settings except how the removal was chosen, and
        the layers removed (two measures or ratios that remove the same layers train the same
        model on the same data with the same seed)."""
        settings = {k: v for k, v in cell.settings.items() if k not in ("measure", "ratio")}
        return json.dumps({"table": cell.table, **settings, "removed": list(removed)},
                          sort_keys=True)

    def _same_plan(self, key: str) -> dict | None:
        for record in self.results.values():
            if record.get("status") == "ok" and "same_plan_as" not in record and self.plan_key(
                    Cell(record["table"], record["settings"]),
                    tuple(record["removed_layers"])) == key:
                return record
        return None

    def run_cell(self, cell: Cell) -> dict:
        start = time.perf_counter()
        config = cell.config()
        try:
            loaded = self._base(config)
            union = ppt.site_data(config, -1)
            matrix = self._matrix(config, loaded, union)
            plan = lowest_score_plan(matrix.importance(config.measure), config.ratio)
            twin = self._same_plan(self.plan_key(cell, plan.removed))
            if twin is not None:  # the same model, data and seed: its result, not a re-run
                logger.info("cell %s removes the same layers %s as a finished cell: reused",
                            cell.id, list(plan.removed))
                row = {k: v for k, v in twin.items()
                       if k not in ("status", "table", "settings", "removed_layers",
                                    "wall_seconds")}
                row["same_plan_as"] = Cell(twin["table"], twin["settings"]).id
            else:
                row = ppt.central_run(config, loaded.model, loaded.path, loaded.tokenizer,
                                      plan, union)
                row.pop("model")
            record = {"status": "ok", "table": cell.table, "settings": cell.settings,
                      "removed_layers": list(plan.removed), **row,
                      "wall_seconds": time.perf_counter() - start}
        except Exception as err:  # noqa: BLE001 - a failing cell is recorded, the study goes on
            logger.error("cell %s failed: %s", cell.id, err)
            record = {"status": "failed", "table": cell.table, "settings": cell.settings,
                      "error": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc(limit=8),
                      "wall_seconds": time.perf_counter() - start}
        atomic_write(self.out / "cells" / f"{cell.id}.json",
                     json.dumps(record, indent=2, default=str) + "\n")
        self.results[cell.id] = record
        return record


def _value(record: dict | None, key: str) -> str:
    if record is None:
        return "-"
    if record.get("status") != "ok":
        return "failed"
    value = record.get(key)
    if value is None:
        return "-"
    return f"{100 * value:.2f}" if key == "accuracy" else f"{value:.4g}"


def _task_label(task: tuple[str, str]) -> str:
    return task[0] + (f" ({task[1]})" if task[1] else "")


def study_tables(study: Study, results: Mapping[str, dict]) -> list[tuple[str, str]]:
    """The paper's tables (accuracy in %), from the finished cells."""
    tasks = [_task_label(t) for t in study.tasks]
    first = study.table1_ratio
    eps = f"eps={study.epsilon:g}"

    def acc(task, measure, mode, private, ratio) -> str:
        cell = study.classify_cell(task, measure, mode, private, ratio)
        return _value(results.get(cell.id), "accuracy")

    def acc_layers(task, measure, mode, private, ratio) -> str:
        record = results.get(study.classify_cell(task, measure, mode, private, ratio).id)
        value = _value(record, "accuracy")
        if record is None or record.get("status") != "ok":
            return value
        return f"{value} (-{','.join(f'L{i}' for i in record['removed_layers'])})"

    sections = []
    rows = [[measure, {"full": "Train", "lora": "LoRA"}[mode], eps if private else "-",
             *[acc_layers(t, measure, mode, private, first) for t in study.tasks]]
            for private in (False, True) for mode in ("full", "lora")
            for measure in ("adjacent", "pairwise")]
    sections.append((f"Table 1: Cosine (adjacent) vs Pairwise-Cosine, ratio {first:g} "
                     "(accuracy %, removed layers)",
                     markdown_table(["redundancy", "training", "DP", *tasks], rows)))
    for number, mode in ((2, "full"), (3, "lora")):
        rows = [[f"{ratio:g}", eps if private else "-",
                 *[acc(t, "pairwise", mode, private, ratio) for t in study.tasks]]
                for private in (False, True) for ratio in study.ratios]
        what = "Re-training (Train)" if mode == "full" else "LoRA fine-tuning"
        sections.append((f"Table {number}: {what} by removal ratio, with and without DP",
                         markdown_table(["ratio", "DP", *tasks], rows)))
    rows = [[{"full": "Train", "lora": "LoRA"}[mode], f"{ratio:g}",
             *[acc(t, "pairwise", mode, True, ratio) for t in study.tasks]]
            for ratio in study.ratios for mode in ("full", "lora")]
    sections.append((f"Table 4: Train vs LoRA under DP ({eps})",
                     markdown_table(["training", "ratio", *tasks], rows)))
    if study.epsilons:
        keys = ("member_perplexity", "nonmember_perplexity", "membership_gap", "auc",
                "bert_precision_members", "bert_recall_members", "bert_f1_members",
                "bert_f1_nonmembers", "epsilon_spent_max", "wall_seconds")
        rows = [[f"{e:g}" if e > 0 else "none",
                 *[_value(results.get(study.attack_cell(e).id), k) for k in keys]]
                for e in study.epsilons]
        sections.append(("Table 6: extraction audit by epsilon (members = training texts)",
                         markdown_table(["epsilon", *keys], rows)))
    times = [[_task_label((r["settings"].get("task", ""), r["settings"].get("labels", "")))
              if r["table"] == "classify" else "attack", r["settings"].get("measure", "-"),
              r["settings"].get("mode", "-"), f"{r['settings'].get('ratio', 0):g}",
              f"{r['settings'].get('epsilon', 0):g}",
              "reused (same plan)" if "same_plan_as" in r else r["status"],
              f"{r['wall_seconds']:.1f}"] for r in results.values()]
    sections.append(("Wall time per cell (s)", markdown_table(
        ["task", "measure", "mode", "ratio", "epsilon", "status", "seconds"], times)))
    return sections


def run_study(config_path: str | Path, out: str | Path, dry_run: bool = False) -> RunReport:
    """Plan, run the pending cells (resuming ``out``) and write ``report.json``/``report.md``."""
    study = load_study(config_path)
    out = Path(out)
    runner = StudyRunner(study, out)
    raw = tomllib.loads(Path(config_path).read_text())
    report = RunReport(out, "privytune-study", raw, seeds={"seed": int(study.base.get(
        "seed", 0))})
    report.reproduce = f"fedcompress privytune-study {out / 'config.toml'} --out {out}"
    report.markdown_results = False

    def update() -> None:
        cells = study.cells()
        report.results = [{**{k: v for k, v in runner.results[c.id].items()
                              if k != "traceback"},
                           "name": f"{runner.results[c.id]['table']}-{c.id}"}
                          for c in cells if c.id in runner.results]
        report.sections = study_tables(study, runner.results)
        report.extra["plan"] = {"cells": len(cells), "pending": len(runner.pending())}
        report.write()

    with report:
        update()
        if dry_run:
            report.exit_status = "planned"
            return report
        try:
            with report.phase("study"):
                for cell in runner.pending():
                    runner.run_cell(cell)
                    update()
        finally:
            update()
        failed = [c for c in study.cells()
                  if runner.results.get(c.id, {}).get("status") != "ok"]
        report.exit_status = "ok" if not failed else "incomplete"
    return report
