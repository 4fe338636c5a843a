"""Benchmark sweeps of FedPrLLM aggregation strategies (``fedcompress bench CONFIG.toml``).

A config has a ``[bench]`` table (settings shared by every study) and one ``[study.NAME]``
table per study. In a study, a setting given as a list is swept (cartesian product); a scalar is
fixed. Settings are those of :class:`~fedcompress.methods.fedprllm.config.FedPrLLMConfig`
(``model``,
``method``, ``sparsity``, ``local_group``, ``group``, ``scale``, ``mode``, ``tie_break``,
``clients``, ``samples_per_client``, ``partition``, ``alpha``, ``calib_text``, ...), the
evaluation settings (``eval_text``, ``eval_windows``, ``tasks``, ``tasks_path``, ...), and per
study:

* ``baselines``: any of ``dense``, ``centralized``, ``local-only``;
* ``total_windows``: fixed total calibration windows; ``samples_per_client`` becomes
  ``total_windows / clients`` (client-count sensitivity);
* ``title``, ``columns`` (the setting shown as table columns; default: the first swept
  client-side setting, e.g. ``sparsity``);
* ``kind``: ``fedprllm`` (the default: the sweep above), ``network`` (simulated end-to-end
  time of cells under network profiles, from their measured bytes, rounds and seconds),
  ``leakage`` (what a shared mask reveals about a client's windows), ``ppcgpt`` (PPC-GPT's
  Tables 1-7), ``privytune`` (PrunePrivyTune's Tables 1-4 and 6), ``personalize``
  (federated personalized layer pruning and seed 004's ablations) or ``dp-leakage`` (the
  membership attackers on a DP statistics release, per epsilon); see
  :mod:`fedcompress.bench.studies`: every kind's cells are planned, stored, resumed and
  reported the same way.

Every (client setting, server setting) pair is a *cell*, identified by a hash of its settings,
so cells shared by studies run once. Each finished cell is appended to ``OUT/results.jsonl`` at
once; a rerun skips finished cells and retries failed ones; a failing cell is recorded with its
error and the sweep goes on.

**One orchestration path.** A FedPrLLM cell runs through the strategies that ``fedcompress
prune`` and ``flwr run`` run: the runner is given a :class:`Federation` (``server/bench.py``:
the ServerApp's federated part, ``server.fedprllm.federate``, on an in-process grid whose
sites run the one ClientApp's handlers in this process, without Ray) and asks it for one run
per group of cells that share their sites' replies (:attr:`~fedcompress.bench.cells.Cell.
run_id`): the server variants of one one-shot vote (comparison group, scaling, tie-break,
defence: the same masks), the comparison groups of one FedSpaLLM run, or one iterative or
statistics-mode cell. Honest one-shot replies (the sites' bit-packed masks, OWL's outlier
ratios) are kept under ``OUT/cache/<id>/`` (or ``[bench] cache``, a folder that several
sweeps may share; :attr:`~fedcompress.bench.cells.Cell.replies_id`) and reused by every later
run of the same client settings and by a resumed sweep. The baselines (dense, centralized,
local-only) run in process, as the ServerApp runs them.

This module plans (:func:`plan`), runs (:class:`BenchRunner`) and resumes (:func:`load_results`)
a sweep; the cells and studies themselves, the settings' keys and the expansion of a FedPrLLM
study into cells are in :mod:`fedcompress.bench.cells` (their names are importable from here
too).
"""

from __future__ import annotations

import copy
import json
import logging
import time
import tomllib
import traceback
from pathlib import Path
from typing import Any, Iterator, Protocol

from fedcompress.bench.cells import (  # noqa: F401 (this module's public names)
    ATTACK_KEYS,
    BASELINES,
    BENCH_KEYS,
    CLIENT_KEYS,
    EVAL_KEYS,
    SERVER_KEYS,
    STUDY_KEYS,
    STUDY_KINDS,
    TASK_KEYS,
    WIRE_KEYS,
    BenchConfigError,
    Cell,
    Study,
    baseline_drop,
    bench_record,
    data_key,
    fedprllm_study,
)
from fedcompress.methods.fedprllm.experiment import Experiment, prepare_experiment
from fedcompress.methods.fedprllm.federated import FedPrLLMConfig

logger = logging.getLogger(__name__)

#: What a record's ``made_at`` holds: the source and the float kernels it ran on. A run resumed
#: at another commit or on another CPU keeps its finished cells, so each cell says where it
#: was made (the report groups them: :func:`provenance`).
MADE_AT_KEYS = ("commit", "cpu_model", "cpu_capability", "torch_threads")


def made_at() -> dict[str, Any]:
    """This process's ``made_at`` (:data:`MADE_AT_KEYS`): the git commit of the source
    (``+dirty`` when it has uncommitted changes), the CPU model, the kernel level torch
    dispatches to and torch's threads."""
    from fedcompress.report import machine, versions

    found = {"commit": versions().get("git_commit", "unknown"), **machine()}
    return {key: found.get(key, "unknown") for key in MADE_AT_KEYS}


def provenance(records: list[dict]) -> list[dict[str, Any]]:
    """The distinct ``made_at`` of ``records`` with their cell ids, in the order first seen;
    records stored before cells carried it form one group whose values are ``None``."""
    groups: dict[tuple, dict[str, Any]] = {}
    for record in records:
        where = record.get("made_at") or {}
        key = tuple(where.get(k) for k in MADE_AT_KEYS)
        group = groups.setdefault(key, {**dict(zip(MADE_AT_KEYS, key)), "cells": []})
        group["cells"].append(record["id"])
    return list(groups.values())


def load_bench(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise BenchConfigError(f"bench config {str(path)!r} not found")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise BenchConfigError(f"{path}: not valid TOML: {err}") from err


def plan(config: dict, overrides: dict | None = None) -> list[Study]:
    """Expand a bench config (``[bench]`` + ``[study.*]``) into studies of cells.
    ``overrides`` replace settings of every study (e.g. ``eval_windows`` from the CLI)."""
    unknown = set(config) - {"bench", "study"}
    if unknown:
        raise BenchConfigError(f"unknown top-level table(s) {sorted(unknown)}: expected [bench] "
                               "and [study.NAME]")
    base = dict(config.get("bench", {}))
    studies = config.get("study", {})
    if not studies:
        raise BenchConfigError("the config has no [study.NAME] table")
    from fedcompress.bench import studies as kinds

    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    planned: dict[str, Study] = {}
    for name, table in studies.items():  # network studies read the others': planned last
        kind = table.get("kind", "fedprllm")
        if kind not in STUDY_KINDS:
            raise BenchConfigError(f"study {name!r}: unknown kind {kind!r}: expected one of "
                                   f"{', '.join(STUDY_KINDS)}")
        if kind == "fedprllm":
            planned[name] = fedprllm_study(name, {**base, **table,
                                                  **kind_overrides(kind, overrides)})
        elif kind != "network":
            make = kinds.KINDS[kind].plan
            assert make is not None
            planned[name] = make(name, base, table, kind_overrides(kind, overrides))
    for name, table in studies.items():
        if table.get("kind") == "network":
            planned[name] = kinds.network_study(name, base, table,
                                                kind_overrides("network", overrides), planned)
    return [planned[name] for name in studies]


def kind_overrides(kind: str, overrides: dict) -> dict:
    """The command line's overrides a study of ``kind`` takes (a FedPrLLM or network study:
    the evaluation settings; PPC-GPT: its generator's url and model)."""
    from fedcompress.bench.studies import KINDS

    keys = EVAL_KEYS if kind == "fedprllm" else KINDS[kind].overrides
    return {k: v for k, v in overrides.items() if k in keys and v is not None}


# ------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------

class FederatedRun(Protocol):
    """One federated run of a group of cells (:meth:`Federation.run`)."""

    def counts(self) -> tuple[dict[str, Any], int] | None:
        """A one-shot vote's counts per linear layer and its number of sites (None: the run
        has no such vote)."""

    def result(self, config: FedPrLLMConfig) -> dict[str, Any]:
        """The record fields of the cell of ``config`` (its server variant): the global
        model pruned by the run and evaluated, with what the run measured."""

    def close(self) -> None:
        """Let the run's vote go."""


class Federation(Protocol):
    """What runs the FedPrLLM cells: the ServerApp's strategies on a grid of the one
    ClientApp (``server/bench.py``'s ``InProcessFederation``, which the composition root
    gives: this package imports no Flower)."""

    def run(self, exp: Experiment, configs: list[FedPrLLMConfig], out: Path,
            cache: Path | None = None, spill: Path | None = None) -> FederatedRun:
        """One run of the sites of ``configs`` (cells that differ only in their server
        variant) with ``exp``'s model and data: the ServerApp's report in ``out``, honest
        one-shot replies kept in ``cache``, a sum too large for memory in ``spill``."""


class BenchRunner:
    """Runs the pending cells of some studies into ``out``; see the module docstring.
    ``federation``: what runs the FedPrLLM cells (without one they fail, named)."""

    def __init__(self, studies: list[Study], out: str | Path, device: str | None = None,
                 progress: bool = True, cache: str | Path | None = None,
                 federation: Federation | None = None):
        self.studies = studies
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = device
        self.progress = progress
        #: the sites' kept one-shot replies, one folder per client setting
        self.cache = Path(cache) if cache else self.out / "cache"
        self.federation = federation
        self.results_file = self.out / "results.jsonl"
        self.results: dict[str, dict] = load_results(self.results_file)
        self.stats: dict[str, dict] = {}
        stats_file = self.out / "stats.json"
        if stats_file.exists():
            self.stats = json.loads(stats_file.read_text())
        self.on_result = None  # callback(record) after each finished cell
        self.made_at = made_at()

    # -- bookkeeping -----------------------------------------------------------------------
    def cells(self) -> list[Cell]:
        unique: dict[str, Cell] = {}
        for study in self.studies:
            for cell in study.cells:
                unique.setdefault(cell.id, cell)
        return list(unique.values())

    def pending(self) -> list[Cell]:
        return [c for c in self.cells() if self.results.get(c.id, {}).get("status") != "ok"]

    def _record(self, cell: Cell, record: dict) -> dict:
        if "sparsity" in record:  # the measured fraction; "sparsity" stays the requested one
            record["sparsity_measured"] = record.pop("sparsity")
        record = bench_record(cell, {**record, "made_at": self.made_at})
        self.results[cell.id] = record
        with self.results_file.open("a") as fh:
            fh.write(json.dumps(record, default=float) + "\n")
        if self.on_result:
            self.on_result(record)
        return record

    def run_cell(self, cell: Cell, fn) -> None:
        """Run one cell (``fn()`` -> its record's fields) and store it at once; an exception
        is recorded as the cell's failure and the sweep goes on."""
        start = time.perf_counter()
        try:
            record = fn()
            record.update(status="ok", wall_seconds=time.perf_counter() - start)
        except Exception as err:  # a failed cell is recorded and the sweep goes on
            logger.error("cell %s (%s) failed: %s", cell.id, cell.settings(), err)
            record = {"status": "failed", "error": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc(limit=8),
                      "wall_seconds": time.perf_counter() - start}
        self._record(cell, record)

    # -- the sweep ---------------------------------------------------------------------------
    def run(self) -> None:
        from fedcompress.bench.studies import CELL_KINDS, KINDS

        pending = self.pending()
        logger.info("%d cells, %d pending", len(self.cells()), len(pending))
        by_model: dict[tuple, list[Cell]] = {}
        by_kind: dict[str, list[Cell]] = {}
        for cell in pending:
            if cell.kind in CELL_KINDS:
                by_kind.setdefault(CELL_KINDS[cell.kind], []).append(cell)
                continue
            client = dict(cell.client)
            by_model.setdefault((client["model"], client["dtype"]), []).append(cell)
        for (model, dtype), cells in by_model.items():
            self._run_model(model, dtype, cells)
        for kind, cells in by_kind.items():  # each kind loads its own models
            run = KINDS[kind].run
            assert run is not None
            run(self, cells)

    def study_of(self, cell: Cell) -> Study:
        """The (first) study that plans ``cell``."""
        return next(s for s in self.studies if any(c.id == cell.id for c in s.cells))

    def _run_model(self, model: str, dtype: str, cells: list[Cell]) -> None:
        from fedcompress.models import load_model

        try:
            loaded = load_model(model, device=self.device, dtype=dtype)
        except Exception as err:
            for cell in cells:
                self.run_cell(cell, lambda err=err: _raise(err))
            return
        groups: dict[str, list[Cell]] = {}
        for cell in cells:
            groups.setdefault(data_key(cell), []).append(cell)
        for group in groups.values():
            try:
                exp = prepare_experiment(group[0].config(), group[0].eval_config(),
                                         loaded=loaded)
            except Exception as err:
                for cell in group:
                    self.run_cell(cell, lambda err=err: _raise(err))
                continue
            self._run_group(exp, group)

    def _run_group(self, exp: Experiment, cells: list[Cell]) -> None:
        """Cells sharing the model, calibration windows and evaluation text: the dense model,
        each federated run (:meth:`_run_federated`) and the baselines."""
        runs: dict[str, list[Cell]] = {}
        for cell in cells:
            if cell.kind == "fedprllm":
                runs.setdefault(cell.run_id, []).append(cell)
        for cell in cells:
            if cell.kind == "dense":
                self.run_cell(cell, lambda: exp.evaluate("dense", exp.model))
        for run_id, variants in runs.items():
            self._run_federated(exp, run_id, variants)
        for cell in cells:
            if cell.kind == "centralized":
                self.run_cell(cell, lambda cell=cell: self._centralized(exp, cell))
            elif cell.kind == "local-only":
                self.run_cell(cell, lambda cell=cell: self._local_only(exp, cell))

    def _experiment_for(self, exp: Experiment, cell: Cell) -> Experiment:
        view = copy.copy(exp)
        view.config = cell.config()
        return view

    def _centralized(self, exp: Experiment, cell: Cell) -> dict:
        view = self._experiment_for(exp, cell)
        model, seconds = view.centralized()
        return view.evaluate("centralized", model, prune_seconds=seconds)

    def _local_only(self, exp: Experiment, cell: Cell) -> dict:
        view = self._experiment_for(exp, cell)
        model, seconds = view.local_only(0)
        return view.evaluate("local-only", model, prune_seconds=seconds, client=0)

    def _run_federated(self, exp: Experiment, run_id: str, variants: list[Cell]) -> None:
        """The cells of one federated run (:attr:`Cell.run_id`: they differ only in their
        server variant) through :attr:`federation`: the run once, then each cell's result;
        a run that fails fails each of its cells."""
        view = self._experiment_for(exp, variants[0])
        configs = [cell.config() for cell in variants]
        try:
            if self.federation is None:
                raise RuntimeError("this bench runner has no federation: run FedPrLLM cells "
                                   "with `fedcompress bench`, which gives server/bench.py's")
            run = self.federation.run(view, configs, self.out / "runs" / run_id,
                                      cache=self.cache / variants[0].replies_id,
                                      spill=self.out)
        except Exception as err:
            for cell in variants:
                self.run_cell(cell, lambda err=err: _raise(err))
            return
        try:
            counts = run.counts()
            if counts is not None:
                self._mask_stats(variants[0].vote_id, *counts)
            for cell, config in zip(variants, configs):
                self.run_cell(cell, lambda config=config: run.result(config))
        finally:
            run.close()

    def _mask_stats(self, vote_id: str, counts: dict, m: int) -> None:
        """The vote's histogram and per-layer agreement (``stats.json``), once per vote."""
        from fedcompress.masks.stats import mean_pairwise_hamming, unanimity, vote_histogram

        if vote_id in self.stats:
            return
        hist = vote_histogram(counts, m)
        stats = {"clients": m, "vote_histogram": hist.overall.tolist()}
        by_layer: dict[int, dict] = {}
        for key, c in counts.items():
            layer = int(key.split(".")[1])
            by_layer.setdefault(layer, {})[key] = c
        if m >= 2:
            stats["agreement_per_layer"] = {
                layer: {"unanimity": unanimity(c, m).overall,
                        "mean_pairwise_hamming": mean_pairwise_hamming(c, m).overall}
                for layer, c in sorted(by_layer.items())}
        self.stats[vote_id] = stats
        (self.out / "stats.json").write_text(json.dumps(self.stats, indent=1, default=float))


def _raise(err: BaseException):
    raise err


# Settings added to FedPrLLM after results were first recorded, with the value every earlier
# record was made with: a record without the key is the cell at that value.
ADDED_LATER = {"wire": "packed", "wire_reference": "wiki", "sparsity_profile": "uniform",
               "owl_lambda": 0.08, "owl_m": 5.0, "layer_sparsity": "", "attack": "none",
               "attackers": 0, "dp_public_text": "wiki", "dp_public_file": "",
               "sparsegpt_block_size": 128, "sparsegpt_dampening": 0.01}
#: Server settings added after results were stored, with the value those results had.
SERVER_ADDED_LATER = {"defence": "none", "trim": 0, "reject_z": 3.5}


def record_cell(record: dict) -> Cell:
    """The cell a stored record belongs to, under today's settings (keys it lacks from
    :data:`ADDED_LATER` take the value it was made with)."""
    kind = record["kind"]
    from fedcompress.bench.studies import CELL_KINDS, KINDS

    if kind in CELL_KINDS:
        stored = KINDS[CELL_KINDS[kind]].record_cell
        assert stored is not None
        return stored(record)
    client = {k: record[k] for k in CLIENT_KEYS if k in record}
    server = {k: record[k] for k in SERVER_KEYS if k in record}
    if kind != "dense":
        client.update({k: v for k, v in ADDED_LATER.items() if k not in client})
    if kind == "fedprllm":
        server.update({k: v for k, v in SERVER_ADDED_LATER.items() if k not in server})
    elif kind != "dense":
        client = {k: v for k, v in client.items() if k not in baseline_drop(kind)}
    return Cell(kind, tuple((k, client[k]) for k in CLIENT_KEYS if k in client),
                tuple((k, server[k]) for k in SERVER_KEYS if k in server),
                tuple(sorted(record.get("eval", {}).items())))


def load_results(path: Path) -> dict[str, dict]:
    """``results.jsonl`` -> the last record of each cell, keyed by the cell's id under today's
    settings (:func:`record_cell`; an interrupted write is ignored). The cells of a study kind's
    former store beside it (``cells/<id>.json``, the ``ppcgpt-study`` / ``privytune-study``
    commands' folders) come first: a bench run in such a folder resumes them."""
    results: dict[str, dict] = {}
    for record in _legacy_records(path.parent / "cells"):
        cell_id = record_cell(record).id
        results[cell_id] = {**record, "id": cell_id}
    if not path.exists():
        return results
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            logger.warning("%s:%d: unreadable record skipped (interrupted write?)", path, number)
            continue
        cell_id = record_cell(record).id
        results[cell_id] = {**record, "id": cell_id} if record["id"] != cell_id else record
    return results


def _legacy_records(folder: Path) -> Iterator[dict]:
    from fedcompress.bench.studies import KINDS

    for file in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            old = json.loads(file.read_text())
        except (OSError, ValueError):
            logger.warning("%s: unreadable cell skipped", file)
            continue
        for kind in KINDS.values():
            record = kind.legacy(old) if kind.legacy else None
            if record is not None:
                yield record
                break
