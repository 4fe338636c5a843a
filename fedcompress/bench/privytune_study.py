"""PrunePrivyTune's tables as a bench study (``[study.NAME] kind = "privytune"`` of
``fedcompress bench CONFIG.toml``).

Reproduces the shape of the tables of the PrunePrivyTune paper (Garg and Torra, "PrunePrivyTune:
Accelerating Language Models with Pruning and Differentially Private Fine-Tuning") with the
centralized pipeline (:func:`fedcompress.methods.privytune.central_run`, the paper's setting: one
data holder), one column per task:

* Table 1: redundancy measure (adjacent "Cosine" vs "Pairwise-Cosine") x training (Train = full,
  LoRA) x DP (none, the study's epsilon), at ``compare_ratio`` (default: the smallest ratio;
  each cell names the layers it removed, so a reader sees where both measures pick the same);
* Table 2 (Train) and Table 3 (LoRA): removal ratio x DP, pairwise measure;
* Table 4: Train vs LoRA under DP by ratio (the cells of Tables 2-3);
* Table 6: the extraction audit by epsilon (the ``attack`` table: a causal LM fine-tuned on
  private text, perplexity and BERTScore of members vs held-out);
* Fig. 2: the heat map of the base model's cosine matrix per task (``fig2-<task>.png``).

The study's table holds ``tasks`` (task names, ``name:label1,label2`` picks a label subset),
``epsilon`` (the DP column), ``ratios``, ``compare_ratio`` (Table 1's), any setting of
:class:`~fedcompress.methods.privytune.PrivyTuneConfig` for the classification cells
(``[bench]`` settings of the same name apply too) and an optional ``attack`` table (settings
for the audit cells, plus ``epsilons``: 0 means no DP)::

    [study.sst2]
    kind = "privytune"
    tasks = ["multiemo_all_sentence_en:negative,positive"]
    ratios = [0.1, 0.2]
    [study.sst2.attack]
    corpus = "wiki"
    epsilons = [1.0, 0.0]

The cells are planned, stored (``OUT/results.jsonl``), resumed and reported by the bench
(:mod:`fedcompress.bench.studies`). A cell whose removal plan equals a finished cell's (same
layers removed, every other setting equal: e.g. both measures picking the same layers) takes
that cell's result, marked ``same_plan_as``, instead of training the same model again. A
folder of the former ``fedcompress privytune-study`` command (``OUT/cells/<id>.json``) is read
and resumed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedcompress.bench.cells import BenchConfigError, Cell, Study, bench_record
from fedcompress.bench.studies import check_keys, stored_cell
from fedcompress.layers.redundancy import CosineMatrix, plot_cosine_matrix
from fedcompress.layers.removal import lowest_score_plan
from fedcompress.methods import privytune as ppt

if TYPE_CHECKING:
    from fedcompress.bench.labels import StudyTable
    from fedcompress.bench.sweep import BenchRunner

logger = logging.getLogger(__name__)

#: A study's keys besides the PrivyTune settings (and ``title``, ``kind``).
STUDY_KEYS = ("tasks", "epsilon", "ratios", "compare_ratio", "attack")
#: Measured fields a cell's record must not take from ``central_run`` (its settings say them).
_SETTING_FIELDS = ("model", "epsilon")


def cell_of(table: str, settings: Mapping[str, Any]) -> Cell:
    """The bench cell of a ``classify`` or ``attack`` run with ``settings`` (its full
    :class:`~fedcompress.methods.privytune.PrivyTuneConfig`, so the id does not depend on
    which settings were written out)."""
    return Cell(f"privytune-{table}", tuple(ppt.PrivyTuneConfig.from_dict(
        dict(settings)).to_dict().items()))


@dataclass
class Layout:
    """What a PrivyTune study compares (stored as the study's options)."""

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
        return cell_of("classify", {**self.base, "task": task[0], "labels": task[1],
                                    "measure": measure, "mode": mode, "ratio": ratio,
                                    "removal": "ratio",
                                    "epsilon": self.epsilon if private else 0.0})

    def attack_cell(self, epsilon: float) -> Cell:
        return cell_of("attack", {**(self.attack or {}), "epsilon": epsilon})

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

    def options(self) -> dict[str, Any]:
        return {"tasks": [list(t) for t in self.tasks], "epsilon": self.epsilon,
                "ratios": self.ratios, "base": self.base, "attack": self.attack,
                "epsilons": self.epsilons, "compare_ratio": self.compare_ratio}

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Layout:
        return cls([(t[0], t[1]) for t in options["tasks"]], float(options["epsilon"]),
                   [float(r) for r in options["ratios"]], dict(options["base"]),
                   None if options.get("attack") is None else dict(options["attack"]),
                   [float(e) for e in options.get("epsilons", [])], options.get("compare_ratio"))


def plan_study(name: str, base: Mapping[str, Any], table: Mapping[str, Any],
               overrides: Mapping[str, Any]) -> Study:
    """A PrivyTune study of a bench config: its classification and audit cells, every one's
    settings checked before anything runs."""
    names = ppt.PrivyTuneConfig.names()
    check_keys(name, "privytune", table, [*names, *STUDY_KEYS])
    tasks = []
    for entry in table.get("tasks", ["epistemic_reasoning"]):
        task, _, labels = str(entry).partition(":")
        if task == "glue":  # glue:<name> keeps its colon
            task, labels = str(entry), ""
        tasks.append((task, labels))
    settings = {k: base[k] for k in names if k in base}
    attack = table.get("attack")
    if attack is not None and not isinstance(attack, Mapping):
        raise BenchConfigError(f"study {name!r}: attack = {attack!r}: expected a table of "
                               "PrivyTune settings and epsilons")
    attack = None if attack is None else {**settings, **attack}
    if attack is not None:
        check_keys(f"{name}.attack", "privytune", attack, [*names, "epsilons"])
    settings.update({k: v for k, v in table.items() if k in names})
    epsilons = [float(e) for e in (attack or {}).pop("epsilons", [])]
    ratios = table.get("ratios", [0.1, 0.2, 0.3])
    ratios = [float(r) for r in (ratios if isinstance(ratios, list) else [ratios])]
    compare = table.get("compare_ratio")
    layout = Layout(tasks, float(table.get("epsilon", 1.0)), ratios, settings, attack,
                    epsilons, None if compare is None else float(compare))
    try:  # every cell's settings valid before anything runs
        cells = layout.cells()
    except ValueError as err:
        raise BenchConfigError(f"study {name!r}: {err}") from err
    return Study(name, str(table.get("title", name)), settings, [], [], None, cells,
                 kind="privytune", options=layout.options())


def record_cell(record: Mapping[str, Any]) -> Cell:
    return stored_cell(record["kind"], record, ppt.PrivyTuneConfig)


def legacy_record(old: Mapping[str, Any]) -> dict | None:
    """A cell of the former ``fedcompress privytune-study`` (``OUT/cells/<id>.json``: its
    table, settings and results) as a bench record; None for another kind's."""
    if old.get("table") not in ("classify", "attack") or "settings" not in old:
        return None
    cell = cell_of(old["table"], old["settings"])
    fields = {k: v for k, v in old.items()
              if k not in ("table", "settings", *_SETTING_FIELDS)}
    return bench_record(cell, {"name": old["table"], **fields})


class CellRunner:
    """Computes PrivyTune cells: each base model loaded once and each task's matrix once."""

    def __init__(self, runner: BenchRunner):
        self.runner = runner
        self.out = runner.out
        self._models: dict[str, Any] = {}
        self._matrices: dict[str, CosineMatrix] = {}

    def _base(self, config: ppt.PrivyTuneConfig):
        from fedcompress.models import load_model

        if config.model not in self._models:
            self._models.clear()
            self._models[config.model] = load_model(config.model,
                                                    device=self.runner.device or "cpu",
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
            plot_cosine_matrix(matrix, self.out / fig2_name(name),
                               title=f"{config.model} on {name}: pairwise cosine (Fig. 2)")
        return self._matrices[key]

    @staticmethod
    def plan_key(cell: Cell, removed: tuple[int, ...]) -> str:
        """What a cell's result depends on: its settings except how the removal was chosen, and
        the layers removed (two measures or ratios that remove the same layers train the same
        model on the same data with the same seed)."""
        settings = {k: v for k, v in cell.client if k not in ("measure", "ratio")}
        return json.dumps({"kind": cell.kind, **settings, "removed": list(removed)},
                          sort_keys=True)

    def _same_plan(self, key: str) -> dict | None:
        for record in self.runner.results.values():
            if (record.get("kind", "").startswith("privytune-") and record.get("status") == "ok"
                    and "same_plan_as" not in record and self.plan_key(
                        record_cell(record), tuple(record["removed_layers"])) == key):
                return record
        return None

    def compute(self, cell: Cell) -> dict:
        """One cell's record fields (the bench stores them, or its failure)."""
        config = ppt.PrivyTuneConfig.from_dict(dict(cell.client))
        loaded = self._base(config)
        union = ppt.site_data(config, -1)
        matrix = self._matrix(config, loaded, union)
        plan = lowest_score_plan(matrix.importance(config.measure), config.ratio)
        twin = self._same_plan(self.plan_key(cell, plan.removed))
        if twin is not None:  # the same model, data and seed: its result, not a re-run
            logger.info("cell %s removes the same layers %s as a finished cell: reused",
                        cell.id, list(plan.removed))
            skip = {"id", "client_id", "kind", "eval", "status", "wall_seconds", "name",
                    "removed_layers", *ppt.PrivyTuneConfig.names()}
            row = {k: v for k, v in twin.items() if k not in skip}
            row["same_plan_as"] = twin["id"]
        else:
            row = ppt.central_run(config, loaded.model, loaded.path, loaded.tokenizer, plan,
                                  union)
            row = {k: v for k, v in row.items() if k not in _SETTING_FIELDS}
        return {**row, "name": cell.kind.removeprefix("privytune-"),
                "removed_layers": list(plan.removed)}


def fig2_name(task: str) -> str:
    """The file of Fig. 2 for a task (or corpus): a name in the output folder, also for a task
    given as a path."""
    return f"fig2-{Path(task.replace(':', '-')).name}.png"


def run_cells(runner: BenchRunner, cells: list[Cell]) -> None:
    """Run the pending PrivyTune cells in order (the bench stores each at once)."""
    computer = CellRunner(runner)
    for cell in cells:
        runner.run_cell(cell, lambda cell=cell: computer.compute(cell))


def study_plots(study: Study, results: Mapping[str, dict], out: Path) -> list[Path]:
    """Fig. 2: the cosine heat maps the cells drew."""
    return sorted(out.glob("fig2-*.png"))


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


def study_tables(study: Study, results: Mapping[str, dict]) -> list[StudyTable]:
    """The paper's tables (accuracy in %), from the finished cells."""
    from fedcompress.bench.labels import StudyTable

    layout = Layout.from_options(study.options)
    tasks = [_task_label(t) for t in layout.tasks]
    first = layout.table1_ratio
    eps = f"eps={layout.epsilon:g}"

    def acc(task, measure, mode, private, ratio) -> str:
        cell = layout.classify_cell(task, measure, mode, private, ratio)
        return _value(results.get(cell.id), "accuracy")

    def acc_layers(task, measure, mode, private, ratio) -> str:
        record = results.get(layout.classify_cell(task, measure, mode, private, ratio).id)
        value = _value(record, "accuracy")
        if record is None or record.get("status") != "ok":
            return value
        return f"{value} (-{','.join(f'L{i}' for i in record['removed_layers'])})"

    def table(caption: str, header: list[str], rows: list[list[str]], first_value: int
              ) -> StudyTable:
        return StudyTable(caption, "", header, rows, first_value, best=None)

    out = []
    rows = [[measure, {"full": "Train", "lora": "LoRA"}[mode], eps if private else "-",
             *[acc_layers(t, measure, mode, private, first) for t in layout.tasks]]
            for private in (False, True) for mode in ("full", "lora")
            for measure in ("adjacent", "pairwise")]
    out.append(table(f"Table 1: Cosine (adjacent) vs Pairwise-Cosine, ratio {first:g} "
                     "(accuracy %, removed layers)", ["redundancy", "training", "DP", *tasks],
                     rows, 3))
    for number, mode in ((2, "full"), (3, "lora")):
        rows = [[f"{ratio:g}", eps if private else "-",
                 *[acc(t, "pairwise", mode, private, ratio) for t in layout.tasks]]
                for private in (False, True) for ratio in layout.ratios]
        what = "Re-training (Train)" if mode == "full" else "LoRA fine-tuning"
        out.append(table(f"Table {number}: {what} by removal ratio, with and without DP",
                         ["ratio", "DP", *tasks], rows, 2))
    rows = [[{"full": "Train", "lora": "LoRA"}[mode], f"{ratio:g}",
             *[acc(t, "pairwise", mode, True, ratio) for t in layout.tasks]]
            for ratio in layout.ratios for mode in ("full", "lora")]
    out.append(table(f"Table 4: Train vs LoRA under DP ({eps})", ["training", "ratio", *tasks],
                     rows, 2))
    if layout.epsilons:
        keys = ("member_perplexity", "nonmember_perplexity", "membership_gap", "auc",
                "bert_precision_members", "bert_recall_members", "bert_f1_members",
                "bert_f1_nonmembers", "epsilon_spent_max", "wall_seconds")
        rows = [[f"{e:g}" if e > 0 else "none",
                 *[_value(results.get(layout.attack_cell(e).id), k) for k in keys]]
                for e in layout.epsilons]
        out.append(table("Table 6: extraction audit by epsilon (members = training texts)",
                         ["epsilon", *keys], rows, 1))
    times = []
    for cell in study.cells:
        r = results.get(cell.id)
        if r is None:
            continue
        settings = dict(cell.client)
        classify = cell.kind == "privytune-classify"
        times.append([_task_label((settings["task"], settings["labels"])) if classify
                      else "attack", settings["measure"] if classify else "-",
                      settings["mode"] if classify else "-", f"{settings['ratio']:g}",
                      f"{settings['epsilon']:g}",
                      "reused (same plan)" if "same_plan_as" in r else r["status"],
                      f"{r.get('wall_seconds', 0.0):.1f}"])
    out.append(table("Wall time per cell (s)", ["task", "measure", "mode", "ratio", "epsilon",
                                                "status", "seconds"], times, 6))
    return out
