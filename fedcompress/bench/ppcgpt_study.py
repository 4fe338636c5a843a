"""PPC-GPT baselines and ablations in one command (``fedcompress ppcgpt-study CONFIG.toml``).

Reproduces the shape of the PPC-GPT paper's Tables 1-7 (../shared/papers/ppc-gpt.txt) on a
bundled multiple-choice task: Table 1 compares the dense model, DenseSFT, Plain-C and PPC-GPT;
Tables 2-7 vary one setting of PPC-GPT at a time (privacy budget ``eps``, synthetic-data ratio,
with/without rationales, with/without server-side retraining, Block Influence vs "Seq" layer
removal, pruning ratio) and report the server's model on the clients' test data ("S") and the
clients' retrained model ("C").

A config has a ``[ppcgpt]`` table (the base run: any
:class:`~fedcompress.methods.ppcgpt.PPCGPTConfig`
setting), an ``[ablations]`` table (per axis, the values its table compares; the base value is
added when missing) and an optional ``[study]`` table (``title``, ``baselines``: any of
``dense``, ``dense-sft``, ``plain-c``; ``device``).

How it runs (in-process, by the library functions the Flower apps call, so no simulation
engine is needed; the Flower app itself is tested against them):

* each client's private data and round-1 text are
  :func:`~fedcompress.methods.ppcgpt.client_data` and
  :func:`~fedcompress.methods.ppcgpt.client_text`, exactly what its ClientApp sends;
* synthetic data is generated once per privacy budget and reused by every variant at that
  budget; the base budget is generated at the largest synthetic ratio of Table 3 and a smaller
  integer ratio ``r`` takes the first ``r`` accepted samples of each client example. It is
  stored under ``OUT/synthetic/<key>/`` and reused by a resumed study;
* every variant (and baseline) is a *cell*, stored in ``OUT/cells/<id>.json`` as soon as it
  finishes; a rerun skips finished cells and retries failed ones; a failing cell (for example
  too few accepted synthetic samples at some ``eps``) is recorded with its error and the study
  goes on;
* accuracy is lm-eval's log-likelihood multiple-choice accuracy
  (:func:`fedcompress.distill.task_accuracy`) over all clients' test examples.

Output: ``report.md`` (the tables, wall times, the synthetic-data acceptance per budget) and
``report.json`` (every cell, per client).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import math
import time
import tomllib
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedcompress.methods import ppcgpt
from fedcompress.methods.ppcgpt import PPCGPTConfig
from fedcompress.models import num_layers
from fedcompress.report import RunReport, atomic_write, markdown_table

logger = logging.getLogger(__name__)

#: The ablation axes, in the paper's table order, with each table's caption.
AXES: dict[str, str] = {
    "eps": "Table 2: privacy budget eps (per perturbed word)",
    "synth_ratio": "Table 3: synthetic data ratio (synthetic samples per client example)",
    "rationales": "Table 4: with vs without rationales (Block Influence and distillation loss)",
    "server_retrain": "Table 5: with vs without server-side retraining (CoT distillation)",
    "prune_policy": "Table 6: importance metric (Block Influence vs Seq)",
    "prune_ratio": "Table 7: pruning ratio (fraction of decoder layers removed)",
}
BASELINES = ("dense", "dense-sft", "plain-c")
STUDY_KEYS = ("title", "baselines", "device")
#: Settings that change no result (how long to wait for the generator, how many requests).
_NO_EFFECT = {"synth_timeout", "synth_workers"}
#: Settings that do not change the synthetic data (compression, training and evaluation).
_NOT_SYNTH = _NO_EFFECT | {
    "prune_ratio", "prune_policy", "rationales", "server_retrain", "server_epochs",
    "server_steps", "client_epochs", "client_steps", "lr", "batch_size", "grad_accum",
    "lora_r", "lora_alpha", "lora_dropout", "max_length", "eval_batch_size", "eval_split",
    "eval_per_client", "min_synthetic", "min_clients", "synth_ratio", "dtype"}


class StudyConfigError(ValueError):
    """A study config names an unknown setting or an impossible value."""


@dataclass(frozen=True)
class Cell:
    """One run of the study: PPC-GPT with ``overrides`` of the base, or a baseline."""

    kind: str  # "ppcgpt" or a baseline name
    config: PPCGPTConfig
    tables: tuple[str, ...]  # "main" and/or axis names this cell appears in

    @property
    def id(self) -> str:
        settings = {k: v for k, v in self.config.to_dict().items() if k not in _NO_EFFECT}
        return f"{self.kind}-{_digest(settings)}"


@dataclass
class Study:
    base: PPCGPTConfig
    axes: dict[str, list[Any]]
    title: str
    baselines: list[str]
    device: str | None

    def cells(self) -> list[Cell]:
        """Every cell once (a variant shared by two tables runs once), baselines first."""
        cells: dict[str, Cell] = {}

        def add(kind: str, config: PPCGPTConfig, table: str) -> None:
            cell = Cell(kind, config, (table,))
            if cell.id in cells:
                old = cells[cell.id]
                cells[cell.id] = dataclasses.replace(old, tables=old.tables + (table,))
            else:
                cells[cell.id] = cell

        for name in self.baselines:
            add(name, self.base, "main")
        add("ppcgpt", self.base, "main")
        # the eps axis last: its other budgets need new synthetic data (the slow part), so an
        # interrupted study has the tables that reuse the base budget's data first
        for axis in sorted(self.axes, key=lambda a: a == "eps"):
            for value in self.axes[axis]:
                add("ppcgpt", dataclasses.replace(self.base, **{axis: value}), axis)
        return list(cells.values())

    def generation_ratio(self) -> float:
        """Synthetic ratio generated at the base budget (the largest Table 3 compares)."""
        return max([self.base.synth_ratio, *self.axes.get("synth_ratio", [])])


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def load_study(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Study:
    """Read and validate a study config (``overrides``: base settings given on the command
    line, applied over ``[ppcgpt]``)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise StudyConfigError(f"study config {path} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise StudyConfigError(f"study config {path} is not valid TOML: {err}") from None
    return study_from_dict(raw, overrides)


def study_from_dict(raw: Mapping[str, Any], overrides: Mapping[str, Any] | None = None
                    ) -> Study:
    unknown = sorted(set(raw) - {"ppcgpt", "ablations", "study"})
    if unknown:
        raise StudyConfigError(f"unknown table(s) {unknown}: expected [ppcgpt], [ablations], "
                               "[study]")
    try:
        base = PPCGPTConfig.from_dict({**raw.get("ppcgpt", {}), **(overrides or {})})
    except (TypeError, ValueError) as err:
        raise StudyConfigError(f"[ppcgpt]: {err}") from None
    axes: dict[str, list[Any]] = {}
    for axis, values in raw.get("ablations", {}).items():
        axis = axis.replace("-", "_")
        if axis not in AXES:
            raise StudyConfigError(f"[ablations] {axis!r} is not an ablation: expected some of "
                                   f"{list(AXES)}")
        if not isinstance(values, list) or not values:
            raise StudyConfigError(f"[ablations] {axis} = {values!r}: expected a non-empty list")
        base_value = getattr(base, axis)
        merged = list(values) + ([base_value] if base_value not in values else [])
        for value in merged:
            try:
                PPCGPTConfig.from_dict({**base.to_dict(), axis: value})
            except (TypeError, ValueError) as err:
                raise StudyConfigError(f"[ablations] {axis}: {err}") from None
        axes[axis] = [getattr(PPCGPTConfig.from_dict({**base.to_dict(), axis: v}), axis)
                      for v in merged]
    ratios = axes.get("synth_ratio", [])
    if len(ratios) > 1:
        bad = [r for r in ratios if not float(r).is_integer()]
        if bad:
            raise StudyConfigError(f"[ablations] synth_ratio {bad}: the ratios of Table 3 must "
                                   "be whole numbers (each is the first r samples of every "
                                   "client example, from one generation at the largest ratio)")
    study = raw.get("study", {})
    unknown = sorted(set(study) - set(STUDY_KEYS))
    if unknown:
        raise StudyConfigError(f"[study] unknown key(s) {unknown}: expected some of "
                               f"{list(STUDY_KEYS)}")
    baselines = list(study.get("baselines", BASELINES))
    bad = [b for b in baselines if b not in BASELINES]
    if bad:
        raise StudyConfigError(f"[study] baselines {bad}: expected some of {list(BASELINES)}")
    return Study(base=base, axes=axes, title=str(study.get("title", "PPC-GPT study")),
                 baselines=baselines, device=study.get("device"))


# ---------------------------------------------------------------------------------------------
# Synthetic data, per privacy budget
# ---------------------------------------------------------------------------------------------


def synth_key(config: PPCGPTConfig, ratio: float) -> str:
    """Folder name of the synthetic data of ``config`` generated at ``ratio``."""
    settings = {k: v for k, v in config.to_dict().items() if k not in _NOT_SYNTH}
    return f"eps{config.eps:g}-ratio{ratio:g}-{_digest(settings)}"


def first_per_source(samples: Sequence[Any], ratio: float) -> list[Any]:
    """The first ``ratio`` (a whole number) accepted samples of every client example, in
    generation order (how a smaller synthetic ratio is read off a larger generation)."""
    if not float(ratio).is_integer() or ratio < 1:
        raise ValueError(f"ratio {ratio!r}: expected a whole number >= 1")
    taken: dict[str, int] = {}
    out = []
    for s in samples:
        if taken.get(s.source_id, 0) < ratio:
            taken[s.source_id] = taken.get(s.source_id, 0) + 1
            out.append(s)
    return out


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


class StudyRunner:
    """Runs the pending cells of a study under ``out`` (see the module docstring)."""

    def __init__(self, study: Study, out: str | Path, progress: bool = True,
                 backend_factory: Callable[[PPCGPTConfig, Any, Any], Any] | None = None):
        self.study = study
        self.out = Path(out)
        self.progress = progress
        self.backend_factory = backend_factory or (
            lambda config, model, tokenizer: ppcgpt.make_backend(config, model, tokenizer))
        (self.out / "cells").mkdir(parents=True, exist_ok=True)
        self.results: dict[str, dict] = {}
        for path in sorted((self.out / "cells").glob("*.json")):
            record = json.loads(path.read_text())
            self.results[record["id"]] = record
        self.synthetic: dict[str, dict] = {}  # folder -> its generation (this study's)
        for path in sorted((self.out / "synthetic").glob("*/study.json")):
            self.synthetic[path.parent.name] = json.loads(path.read_text())
        self.on_result: Callable[[dict], None] | None = None
        self._model = None
        self._data: dict[tuple, list] = {}

    def pending(self) -> list[Cell]:
        return [c for c in self.study.cells()
                if self.results.get(c.id, {}).get("status") != "ok"]

    # -- shared state ----------------------------------------------------------------------
    def model(self):
        if self._model is None:
            from fedcompress.models import load_model

            loaded = load_model(self.study.base.model, device=self.study.device,
                                dtype=self.study.base.dtype)
            self._model = (loaded.model, loaded.tokenizer)
        return self._model

    def data(self, config: PPCGPTConfig) -> list[ppcgpt.ClientData]:
        key = (config.task, config.eval_split, config.clients, config.examples_per_client,
               config.eval_per_client, config.partition, config.alpha, config.seed)
        if key not in self._data:
            self._data[key] = [ppcgpt.client_data(config, p) for p in range(config.clients)]
        return self._data[key]

    def samples(self, config: PPCGPTConfig) -> list[Any]:
        """The synthetic samples of ``config`` (generated once per budget, then read back)."""
        from fedcompress.synth import SynthConfig, generate_synthetic, load_jsonl

        base_budget = config.eps == self.study.base.eps
        ratio = self.study.generation_ratio() if base_budget else config.synth_ratio
        gen_config = dataclasses.replace(config, synth_ratio=ratio)
        key = synth_key(gen_config, ratio)
        folder = self.out / "synthetic" / key
        if (folder / "study.json").exists():
            meta = json.loads((folder / "study.json").read_text())
        else:
            start = time.perf_counter()
            examples, budgets = [], []
            for data in self.data(gen_config):
                text, budget = ppcgpt.client_text(gen_config, data)
                examples += text
                budgets.append(budget)
            model, tokenizer = self.model()
            backend = self.backend_factory(gen_config, model, tokenizer)
            result = generate_synthetic(examples, backend,
                                        SynthConfig(**gen_config.synth_settings()),
                                        progress=self.progress)
            result.save(folder)
            meta = {"eps": gen_config.eps, "ratio": ratio, "examples": len(examples),
                    "backend": result.backend, "stats": result.stats.to_dict(),
                    "eps_per_example_max": max(b["eps_per_example_max"] for b in budgets),
                    "seconds": time.perf_counter() - start}
            atomic_write(folder / "study.json", json.dumps(meta, indent=2) + "\n")
        self.synthetic[key] = meta
        samples = load_jsonl(folder / "samples.jsonl")
        if config.synth_ratio != ratio:
            samples = first_per_source(samples, config.synth_ratio)
        if len(samples) < config.min_synthetic:
            stats = meta["stats"]
            raise ppcgpt.NotEnoughSyntheticData(
                f"{len(samples)} synthetic sample(s) at eps={config.eps:g}, ratio "
                f"{config.synth_ratio:g} ({stats['accepted']} of {stats['attempts']} attempts "
                f"accepted by {meta['backend']}); min_synthetic={config.min_synthetic}")
        return samples

    # -- cells -----------------------------------------------------------------------------
    def run(self) -> None:
        for cell in self.pending():
            self._run_cell(cell)

    def _run_cell(self, cell: Cell) -> None:
        logger.info("cell %s (%s)", cell.id, ", ".join(cell.tables))
        start = time.perf_counter()
        record = {"id": cell.id, "kind": cell.kind, "tables": list(cell.tables),
                  "settings": cell.config.to_dict()}
        try:
            record.update(self._ppcgpt(cell.config) if cell.kind == "ppcgpt"
                          else self._baseline(cell.kind, cell.config))
            record["status"] = "ok"
        except Exception as err:  # recorded; the study goes on
            logger.error("cell %s failed: %s", cell.id, err)
            record.update({"status": "failed", "error": f"{type(err).__name__}: {err}",
                           "traceback": traceback.format_exc(limit=6)})
        record["seconds"] = time.perf_counter() - start
        atomic_write(self.out / "cells" / f"{cell.id}.json", json.dumps(record, indent=2) + "\n")
        self.results[cell.id] = record
        if self.on_result is not None:
            self.on_result(record)

    def _ppcgpt(self, config: PPCGPTConfig) -> dict:
        samples = self.samples(config)
        model, tokenizer = self.model()
        compressed = ppcgpt.compress(model, tokenizer, samples, config)
        per_client = []
        for data in self.data(config):
            result = ppcgpt.client_retrain(copy.deepcopy(compressed.model), tokenizer, data,
                                           config)
            per_client.append({"partition": data.partition, **result})
        return {"per_client": per_client, "synthetic": len(samples),
                "removed": list(compressed.plan.removed),
                "layers": compressed.plan.num_layers - len(compressed.plan.removed),
                "S": ppcgpt.weighted_accuracy(per_client, "server"),
                "C": ppcgpt.weighted_accuracy(per_client, "client"),
                "server_seconds": compressed.seconds,
                "client_seconds": sum(c["seconds"] for c in per_client)}

    def _baseline(self, name: str, config: PPCGPTConfig) -> dict:
        model, tokenizer = self.model()
        fn = {"dense": ppcgpt.dense_accuracy, "dense-sft": ppcgpt.dense_sft,
              "plain-c": ppcgpt.plain_c}[name]
        per_client = [{"partition": d.partition, **fn(model, tokenizer, d, config)}
                      for d in self.data(config)]
        removed = per_client[0].get("removed", [])
        return {"per_client": per_client, "C": ppcgpt.weighted_accuracy(per_client, "client"),
                "layers": num_layers(model) - len(removed)}


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------


def _acc(record: dict | None, key: str) -> str:
    """``acc ± standard error`` in percent over all clients' test examples (``-``: none)."""
    if record is None or record.get("status") != "ok" or key not in record:
        return "-"
    side = "server" if key == "S" else "client"
    n = sum(c[side]["n"] for c in record["per_client"])
    acc = record[key]
    return f"{100 * acc:.1f} ± {100 * math.sqrt(acc * (1 - acc) / max(n, 1)):.1f}"


def _axis_label(axis: str, value: Any) -> str:
    if axis == "rationales":
        return "w/ rationales" if value else "w/o rationales"
    if axis == "server_retrain":
        return "w/ server-side retraining" if value else "w/o server-side retraining"
    if axis == "prune_policy":
        return {"bi": "BI (label + rationale)", "seq": "Seq"}.get(value, str(value))
    if axis == "prune_ratio":
        return f"{100 * value:g}%"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _status(record: dict | None) -> str:
    if record is None:
        return "pending"
    if record.get("status") != "ok":
        return f"failed: {record.get('error', '?')[:100]}"
    return ""


def majority_share(data: Sequence[ppcgpt.ClientData]) -> float:
    """Accuracy of always answering the most common label of all clients' test examples (the
    floor a multiple-choice accuracy should be read against)."""
    labels = [r["label"] for d in data for r in d.test]
    return max(labels.count(v) for v in set(labels)) / len(labels)


def study_tables(study: Study, results: Mapping[str, dict], majority: float | None = None
                 ) -> list[tuple[str, str]]:
    """The paper-shaped tables as (title, markdown); ``majority``: the majority-label accuracy
    of the test examples, shown as a reference row of Table 1."""
    cells = {c.id: c for c in study.cells()}
    by_id = {i: results.get(i) for i in cells}
    out = []
    main_rows = []
    names = {"dense": "Dense (no training)", "dense-sft": "DenseSFT", "plain-c": "Plain-C",
             "ppcgpt": "PPC-GPT"}
    for cell in cells.values():
        if "main" not in cell.tables:
            continue
        r = by_id[cell.id]
        ok = r is not None and r.get("status") == "ok"
        main_rows.append([names[cell.kind], str(r["layers"]) if ok else "-",
                          _acc(r, "S"), _acc(r, "C"),
                          f"{r['seconds']:.0f}" if r else "-", _status(r)])
    if majority is not None:
        main_rows.append(["(majority label, reference)", "-", "-", f"{100 * majority:.1f}", "-",
                          ""])
    out.append((f"Table 1: compression methods on {study.base.task} "
                f"({study.base.model}, eps={study.base.eps:g}, prune ratio "
                f"{study.base.prune_ratio:g})",
                markdown_table(["method", "layers", "S acc %", "C acc %", "wall s", "note"],
                               main_rows)))
    for axis, values in study.axes.items():
        rows = []
        for value in values:
            cell = Cell("ppcgpt", dataclasses.replace(study.base, **{axis: value}), ())
            r = by_id.get(cell.id)
            ok = r is not None and r.get("status") == "ok"
            rows.append([_axis_label(axis, value), str(r["synthetic"]) if ok else "-",
                         str(r["layers"]) if ok else "-", _acc(r, "S"), _acc(r, "C"),
                         f"{r['seconds']:.0f}" if r else "-",
                         _status(r)])
        out.append((AXES[axis], markdown_table(
            [axis, "synthetic samples", "layers", "S acc %", "C acc %", "wall s", "note"],
            rows)))
    return out


def synthetic_table(meta: Mapping[str, dict]) -> str:
    rows = []
    for key, m in sorted(meta.items(), key=lambda item: (item[1]["eps"], item[1]["ratio"])):
        stats = m["stats"]
        reasons = ", ".join(f"{k} {v}" for k, v in stats.get("rejections", {}).items() if v)
        rows.append([f"{m['eps']:g}", f"{m['ratio']:g}", m["backend"], str(m["examples"]),
                     str(stats["attempts"]), str(stats["accepted"]),
                     f"{100 * stats['accepted'] / max(stats['attempts'], 1):.0f}%",
                     reasons or "-", f"{m['seconds']:.0f}", key])
    return markdown_table(["eps", "ratio", "LLM_syn", "client examples", "attempts", "accepted",
                           "acceptance", "rejections", "wall s", "folder"], rows)


def run_study(config_path: str | Path, out: str | Path, overrides: Mapping[str, Any] | None = None,
              progress: bool = True, dry_run: bool = False,
              backend_factory: Callable | None = None) -> RunReport:
    """Plan, run the pending cells (resuming ``out``) and write ``report.json``/``report.md``."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    study = load_study(config_path, overrides)
    out = Path(out)
    raw = tomllib.loads(Path(config_path).read_text())
    saved = {**raw, "ppcgpt": {**raw.get("ppcgpt", {}), **overrides}}
    runner = StudyRunner(study, out, progress=progress, backend_factory=backend_factory)
    report = RunReport(out, "ppcgpt-study", saved, seeds={"seed": study.base.seed})
    report.reproduce = f"fedcompress ppcgpt-study {out / 'config.toml'} --out {out}"
    report.markdown_results = False

    majority = majority_share(runner.data(study.base))
    # what the sites release in round 1 at the base budget (cheap: the sanitizer only)
    privacy = ppcgpt.privacy_notes(study.base, [ppcgpt.client_text(study.base, data)[1]
                                                for data in runner.data(study.base)])

    def update(_record: dict | None = None) -> None:
        cells = study.cells()
        report.results = [{"name": runner.results[c.id]["kind"], **runner.results[c.id]}
                          for c in cells if c.id in runner.results]
        report.sections = [*study_tables(study, runner.results, majority),
                           (f"Privacy (round 1 at the base eps {study.base.eps:g})", privacy)]
        if runner.synthetic:
            report.sections.append(("Synthetic data per privacy budget",
                                    synthetic_table(runner.synthetic)))
        report.extra["plan"] = {"cells": len(cells), "pending": len(runner.pending())}
        report.extra["synthetic"] = runner.synthetic
        report.write()

    with report:
        update()
        if dry_run:
            report.exit_status = "planned"
            return report
        runner.on_result = update
        try:
            with report.phase("study"):
                runner.run()
        finally:
            update()  # what finished, also when the study fails
        failed = [c for c in study.cells()
                  if runner.results.get(c.id, {}).get("status") != "ok"]
        report.exit_status = "ok" if not failed else "incomplete"
    return report
