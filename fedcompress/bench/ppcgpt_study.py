"""PPC-GPT baselines and ablations as a bench study (``[study.NAME] kind = "ppcgpt"`` of
``fedcompress bench CONFIG.toml``).

Reproduces the shape of the PPC-GPT paper's Tables 1-7 ("PPC-GPT: Federated Task-Specific
Compression of Large Language Models via Pruning and Chain-of-Thought Distillation") on a
bundled multiple-choice task: Table 1 compares the dense model, DenseSFT, Plain-C and PPC-GPT;
Tables 2-7 vary one setting of PPC-GPT at a time (privacy budget ``eps``, synthetic-data ratio,
with/without rationales, with/without server-side retraining, Block Influence vs "Seq" layer
removal, pruning ratio) and report the server's model on the clients' test data ("S") and the
clients' retrained model ("C").

The study's table holds the base run (any :class:`~fedcompress.methods.ppcgpt.PPCGPTConfig`
setting; ``[bench]`` settings of the same name apply too), ``baselines`` (any of ``dense``,
``dense-sft``, ``plain-c``; default all) and an ``ablations`` table (per axis, the values its
table compares; the base value is added when missing)::

    [study.strategyqa]
    kind = "ppcgpt"
    model = "smollm2-135m"
    eps = 3.0
    [study.strategyqa.ablations]
    eps = [1.0, 3.0, 10.0]

``fedcompress bench --synth-url URL --synth-model NAME`` override the generator of every
PPC-GPT study. The cells are planned, stored (``OUT/results.jsonl``), resumed and reported by
the bench (:mod:`fedcompress.bench.studies`); here is how a cell is computed (in-process, by
the library functions the Flower apps call, so no simulation engine is needed; the Flower app
itself is tested against them):

* each client's private data and round-1 text are
  :func:`~fedcompress.methods.ppcgpt.client_data` and
  :func:`~fedcompress.methods.ppcgpt.client_text`, exactly what its ClientApp sends;
* synthetic data is generated once per privacy budget and reused by every variant at that
  budget; the base budget is generated at the largest synthetic ratio of Table 3 and a smaller
  integer ratio ``r`` takes the first ``r`` accepted samples of each client example. It is
  stored under ``OUT/synthetic/<key>/`` and reused by a resumed study; a cell without enough
  accepted samples at its ``eps`` fails (recorded) and the others go on;
* accuracy is lm-eval's log-likelihood multiple-choice accuracy
  (:func:`fedcompress.distill.task_accuracy`) over all clients' test examples.

The report has the tables, the privacy of round 1 at the base budget and the synthetic-data
acceptance per budget; report.json every cell, per client. A folder of the former
``fedcompress ppcgpt-study`` command (``OUT/cells/<id>.json``) is read and resumed.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedcompress.bench.cells import BenchConfigError, Cell, Study, bench_record
from fedcompress.bench.studies import check_keys, stored_cell
from fedcompress.methods import ppcgpt
from fedcompress.methods.ppcgpt import PPCGPTConfig
from fedcompress.models import num_layers
from fedcompress.report import atomic_write, markdown_table

if TYPE_CHECKING:
    from fedcompress.bench.labels import StudyTable
    from fedcompress.bench.sweep import BenchRunner

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
#: A study's keys besides the PPC-GPT settings (and ``title``, ``kind``).
STUDY_KEYS = ("baselines", "ablations")
#: The bench's cell kind of each method.
CELL_KINDS = {"ppcgpt": "ppcgpt", **{b: f"ppcgpt-{b}" for b in BASELINES}}
#: Settings that change no result (how long to wait for the generator, how many requests):
#: not part of a cell, kept in the study's options.
_NO_EFFECT = ("synth_timeout", "synth_workers")
#: Settings that do not change the synthetic data (compression, training and evaluation).
_NOT_SYNTH = {*_NO_EFFECT,
              "prune_ratio", "prune_policy", "rationales", "server_retrain", "server_epochs",
              "server_steps", "client_epochs", "client_steps", "lr", "batch_size", "grad_accum",
              "lora_r", "lora_alpha", "lora_dropout", "max_length", "eval_batch_size",
              "eval_split", "eval_per_client", "min_synthetic", "min_clients", "synth_ratio",
              "dtype"}
NAMES = {"dense": "Dense (no training)", "dense-sft": "DenseSFT", "plain-c": "Plain-C",
         "ppcgpt": "PPC-GPT"}


def cell_of(method: str, config: PPCGPTConfig) -> Cell:
    """The bench cell of ``method`` (``ppcgpt`` or a baseline) run with ``config``."""
    return Cell(CELL_KINDS[method], tuple((k, v) for k, v in config.to_dict().items()
                                          if k not in _NO_EFFECT))


def method_of(cell: Cell) -> str:
    return next(m for m, kind in CELL_KINDS.items() if kind == cell.kind)


@dataclass
class Layout:
    """What a PPC-GPT study compares: the base run, the ablation axes (values per axis, the
    base value included) and the baselines; stored as the study's options."""

    base: PPCGPTConfig
    axes: dict[str, list[Any]]
    baselines: list[str]
    runtime: dict[str, Any]  # the _NO_EFFECT settings

    def cells(self) -> dict[str, tuple[Cell, tuple[str, ...]]]:
        """Every cell once (a variant shared by two tables runs once) with the tables it
        appears in ("main" and/or axis names), baselines first."""
        cells: dict[str, tuple[Cell, tuple[str, ...]]] = {}

        def add(method: str, config: PPCGPTConfig, table: str) -> None:
            cell = cell_of(method, config)
            old = cells.get(cell.id, (cell, ()))[1]
            cells[cell.id] = (cell, old + (table,))

        for name in self.baselines:
            add(name, self.base, "main")
        add("ppcgpt", self.base, "main")
        # the eps axis last: its other budgets need new synthetic data (the slow part), so an
        # interrupted study has the tables that reuse the base budget's data first
        for axis in sorted(self.axes, key=lambda a: a == "eps"):
            for value in self.axes[axis]:
                add("ppcgpt", dataclasses.replace(self.base, **{axis: value}), axis)
        return cells

    def config(self, cell: Cell) -> PPCGPTConfig:
        return PPCGPTConfig.from_dict({**dict(cell.client), **self.runtime})

    def generation_ratio(self) -> float:
        """Synthetic ratio generated at the base budget (the largest Table 3 compares)."""
        return max([self.base.synth_ratio, *self.axes.get("synth_ratio", [])])

    def options(self) -> dict[str, Any]:
        return {"base": self.base.to_dict(), "axes": self.axes, "baselines": self.baselines}

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Layout:
        base = PPCGPTConfig.from_dict(options["base"])
        return cls(base, {k: list(v) for k, v in options["axes"].items()},
                   list(options["baselines"]),
                   {k: getattr(base, k) for k in _NO_EFFECT})


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def plan_study(name: str, base: Mapping[str, Any], table: Mapping[str, Any],
               overrides: Mapping[str, Any]) -> Study:
    """A PPC-GPT study of a bench config: its cells (baselines, the base run, one per
    ablation value), checked before anything runs."""
    names = PPCGPTConfig.names()
    check_keys(name, "ppcgpt", table, [*names, *STUDY_KEYS])
    settings = {k: base[k] for k in names if k in base}
    settings.update({k: v for k, v in table.items() if k in names})
    settings.update(overrides)
    try:
        config = PPCGPTConfig.from_dict(settings)
    except (TypeError, ValueError) as err:
        raise BenchConfigError(f"study {name!r}: {err}") from None
    axes: dict[str, list[Any]] = {}
    ablations = table.get("ablations", {})
    if not isinstance(ablations, Mapping):
        raise BenchConfigError(f"study {name!r}: ablations = {ablations!r}: expected a table "
                               f"of axis = [values] (axes: {list(AXES)})")
    for axis, values in ablations.items():
        axis = axis.replace("-", "_")
        if axis not in AXES:
            raise BenchConfigError(f"study {name!r}: ablations {axis!r} is not an ablation: "
                                   f"expected some of {list(AXES)}")
        if not isinstance(values, list) or not values:
            raise BenchConfigError(f"study {name!r}: ablations {axis} = {values!r}: expected "
                                   "a non-empty list")
        base_value = getattr(config, axis)
        merged = list(values) + ([base_value] if base_value not in values else [])
        try:
            axes[axis] = [getattr(PPCGPTConfig.from_dict({**config.to_dict(), axis: v}), axis)
                          for v in merged]
        except (TypeError, ValueError) as err:
            raise BenchConfigError(f"study {name!r}: ablations {axis}: {err}") from None
    bad = [r for r in axes.get("synth_ratio", []) if not float(r).is_integer()]
    if len(axes.get("synth_ratio", [])) > 1 and bad:
        raise BenchConfigError(f"study {name!r}: ablations synth_ratio {bad}: the ratios of "
                               "Table 3 must be whole numbers (each is the first r samples of "
                               "every client example, from one generation at the largest "
                               "ratio)")
    baselines = table.get("baselines", list(BASELINES))
    baselines = [baselines] if isinstance(baselines, str) else list(baselines)
    bad = [b for b in baselines if b not in BASELINES]
    if bad:
        raise BenchConfigError(f"study {name!r}: baselines {bad}: expected some of "
                               f"{list(BASELINES)}")
    layout = Layout(config, axes, baselines, {k: getattr(config, k) for k in _NO_EFFECT})
    cells = [cell for cell, _ in layout.cells().values()]
    return Study(name, str(table.get("title", name)), settings, list(axes), [], None, cells,
                 kind="ppcgpt", options=layout.options())


def record_cell(record: Mapping[str, Any]) -> Cell:
    return stored_cell(record["kind"], record, PPCGPTConfig, drop=_NO_EFFECT)


def legacy_record(old: Mapping[str, Any]) -> dict | None:
    """A cell of the former ``fedcompress ppcgpt-study`` (``OUT/cells/<id>.json``: its kind,
    tables, full settings and results) as a bench record; None for another kind's."""
    if old.get("kind") not in CELL_KINDS or "tables" not in old or "settings" not in old:
        return None
    cell = cell_of(old["kind"], PPCGPTConfig.from_dict(
        {k: v for k, v in old["settings"].items() if k in PPCGPTConfig.names()}))
    fields = {k: v for k, v in old.items() if k not in ("id", "kind", "tables", "settings",
                                                         "seconds")}
    return bench_record(cell, {"name": NAMES[old["kind"]], **fields,
                               "wall_seconds": old.get("seconds", 0.0)})


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


class CellRunner:
    """Computes the cells of one PPC-GPT study under ``out`` (the model loaded once, each
    client's data once, the synthetic data once per budget)."""

    def __init__(self, layout: Layout, out: str | Path, device: str | None = None,
                 progress: bool = True):
        self.layout = layout
        self.out = Path(out)
        self.device = device
        self.progress = progress
        self._model = None
        self._data: dict[tuple, list] = {}

    # -- shared state ----------------------------------------------------------------------
    def model(self):
        if self._model is None:
            from fedcompress.models import load_model

            loaded = load_model(self.layout.base.model, device=self.device,
                                dtype=self.layout.base.dtype)
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

        base_budget = config.eps == self.layout.base.eps
        ratio = self.layout.generation_ratio() if base_budget else config.synth_ratio
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
            backend = ppcgpt.make_backend(gen_config, model, tokenizer)
            result = generate_synthetic(examples, backend,
                                        SynthConfig(**gen_config.synth_settings()),
                                        progress=self.progress)
            result.save(folder)
            meta = {"eps": gen_config.eps, "ratio": ratio, "examples": len(examples),
                    "backend": result.backend, "stats": result.stats.to_dict(),
                    "eps_per_example_max": max(b["eps_per_example_max"] for b in budgets),
                    "seconds": time.perf_counter() - start}
            atomic_write(folder / "study.json", json.dumps(meta, indent=2) + "\n")
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
    def compute(self, cell: Cell) -> dict:
        """One cell's record fields (the bench stores them, or its failure)."""
        method, config = method_of(cell), self.layout.config(cell)
        logger.info("PPC-GPT cell %s (%s)", cell.id, method)
        result = self._ppcgpt(config) if method == "ppcgpt" else self._baseline(method, config)
        return {"name": NAMES[method], **result}

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


def _wall(record: dict | None) -> str:
    return f"{record.get('wall_seconds', 0.0):.0f}" if record else "-"


def majority_share(data: Sequence[ppcgpt.ClientData]) -> float:
    """Accuracy of always answering the most common label of all clients' test examples (the
    floor a multiple-choice accuracy should be read against)."""
    labels = [r["label"] for d in data for r in d.test]
    return max(labels.count(v) for v in set(labels)) / len(labels)


def study_tables(study: Study, results: Mapping[str, dict]) -> list[StudyTable]:
    """The paper-shaped tables of a PPC-GPT study; Table 1 has the majority-label accuracy of
    the test examples as a reference row once :func:`study_sections` has computed it."""
    from fedcompress.bench.labels import StudyTable

    layout = Layout.from_options(study.options)
    base = layout.base
    main_rows = []
    for cell, tables in layout.cells().values():
        if "main" not in tables:
            continue
        r = results.get(cell.id)
        ok = r is not None and r.get("status") == "ok"
        main_rows.append([NAMES[method_of(cell)], str(r["layers"]) if ok else "-",
                          _acc(r, "S"), _acc(r, "C"), _wall(r), _status(r)])
    majority = study.options.get("majority")
    if majority is not None:
        main_rows.append(["(majority label, reference)", "-", "-", f"{100 * majority:.1f}", "-",
                          ""])
    out = [StudyTable(f"Table 1: compression methods on {base.task} ({base.model}, "
                      f"eps={base.eps:g}, prune ratio {base.prune_ratio:g})", "",
                      ["method", "layers", "S acc %", "C acc %", "wall s", "note"], main_rows,
                      first_value=2, best=None)]
    for axis, values in layout.axes.items():
        rows = []
        for value in values:
            r = results.get(cell_of("ppcgpt", dataclasses.replace(base, **{axis: value})).id)
            ok = r is not None and r.get("status") == "ok"
            rows.append([_axis_label(axis, value), str(r["synthetic"]) if ok else "-",
                         str(r["layers"]) if ok else "-", _acc(r, "S"), _acc(r, "C"),
                         _wall(r), _status(r)])
        out.append(StudyTable(AXES[axis], "", [axis, "synthetic samples", "layers", "S acc %",
                                               "C acc %", "wall s", "note"], rows,
                              first_value=3, best=None))
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


def study_sections(study: Study, out: Path) -> list[tuple[str, str]]:
    """What the sites release in round 1 at the base budget (the sanitizer only; computed once
    and kept under ``OUT/synthetic/``, with the majority-label accuracy of the test examples,
    which goes into the study's options for Table 1) and the synthetic data per budget."""
    layout = Layout.from_options(study.options)
    base = layout.base
    notes_file = out / "synthetic" / f"notes-{_digest(base.to_dict())}.json"
    if notes_file.exists():
        notes = json.loads(notes_file.read_text())
    else:
        data = [ppcgpt.client_data(base, p) for p in range(base.clients)]
        notes = {"majority": majority_share(data),
                 "privacy": ppcgpt.privacy_notes(base, [ppcgpt.client_text(base, d)[1]
                                                        for d in data])}
        notes_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(notes_file, json.dumps(notes, indent=2) + "\n")
    study.options["majority"] = notes["majority"]
    sections = [(f"Privacy of `{study.name}` (round 1 at the base eps {base.eps:g})",
                 notes["privacy"])]
    meta = {path.parent.name: json.loads(path.read_text())
            for path in sorted((out / "synthetic").glob("*/study.json"))}
    budgets = {base.eps, *layout.axes.get("eps", [])}  # the folder's generations at them
    meta = {k: m for k, m in meta.items() if m.get("eps") in budgets}
    if meta:
        sections.append((f"Synthetic data of `{study.name}` per privacy budget",
                         synthetic_table(meta)))
    return sections


def run_cells(runner: BenchRunner, cells: list[Cell]) -> None:
    """Run the pending PPC-GPT cells, study by study (the bench stores each at once)."""
    by_study: dict[str, list[Cell]] = {}
    for cell in cells:
        by_study.setdefault(runner.study_of(cell).name, []).append(cell)
    studies = {s.name: s for s in runner.studies}
    for name, pending in by_study.items():
        computer = CellRunner(Layout.from_options(studies[name].options), runner.out,
                              runner.device, runner.progress)
        for cell in pending:
            runner.run_cell(cell, lambda cell=cell, c=computer: c.compute(cell))
