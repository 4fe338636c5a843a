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
so cells shared by studies run once. One-shot client masks do not depend on the server's
comparison group, scaling or tie-break: they are computed once per client setting (model,
method, local group, sparsity, partition, seed, ...), stored bit-packed under
``OUT/cache/<id>/`` (or ``[bench] cache``, a folder that several sweeps may share) and reused
by every server variant and by a resumed sweep. Each finished
cell is appended to ``OUT/results.jsonl`` at once; a rerun skips finished cells and retries
failed ones; a failing cell is recorded with its error and the sweep goes on.

Client masks are computed in-process by the same library functions the Flower ClientApp calls
(their equality with a Flower federation is tested), so a sweep needs no simulation engine.

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
from typing import Any, Iterator

import numpy as np

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
from fedcompress.masks.aggregate import load_kernels
from fedcompress.methods.fedprllm.experiment import Experiment, prepare_experiment
from fedcompress.methods.fedprllm.federated import (
    InvalidMaskError,
    MaskAggregator,
    encode_masks,
    iterative_vote,
    payload_nbytes,
    with_site_plan,
)

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

class MaskCache:
    """Bit-packed one-shot client masks on disk, one folder per client setting."""

    def __init__(self, root: Path):
        self.root = root

    def folder(self, client_id: str) -> Path:
        return self.root / client_id

    def load(self, client_id: str, aggregator: MaskAggregator) -> dict | None:
        folder = self.folder(client_id)
        meta_file = folder / "meta.json"
        if not meta_file.exists():
            return None
        meta = json.loads(meta_file.read_text())
        for i in range(meta["clients"]):
            with np.load(folder / f"client-{i:04d}.npz") as data:
                aggregator.add_packed({k: data[k] for k in aggregator.shapes})
        return meta

    def store(self, client_id: str, client: int, payload: dict[str, np.ndarray]) -> None:
        folder = self.folder(client_id)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"client-{client:04d}.tmp.npz"
        np.savez(tmp, **payload)
        tmp.replace(folder / f"client-{client:04d}.npz")

    def load_client(self, client_id: str, client: int) -> dict[str, np.ndarray] | None:
        path = self.folder(client_id) / f"client-{client:04d}.npz"
        if not path.exists():
            return None
        with np.load(path) as data:
            return {k: data[k] for k in data.files}

    def finish(self, client_id: str, meta: dict) -> None:
        (self.folder(client_id) / "meta.json").write_text(json.dumps(meta, indent=2))


class BenchRunner:
    """Runs the pending cells of some studies into ``out``; see the module docstring."""

    def __init__(self, studies: list[Study], out: str | Path, device: str | None = None,
                 progress: bool = True, cache: str | Path | None = None):
        self.studies = studies
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = device
        self.progress = progress
        self.cache = MaskCache(Path(cache) if cache else self.out / "cache")
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
        """Cells sharing the model, calibration windows and evaluation text."""
        fed: dict[str, list[Cell]] = {}
        peers: dict[str, list[Cell]] = {}  # FedSpaLLM cells, by their sites' releases
        for cell in cells:
            if cell.kind != "fedprllm":
                continue
            aggregate = dict(cell.client)["aggregate"]
            if aggregate == "votes":
                fed.setdefault(cell.vote_id, []).append(cell)
            elif aggregate == "fedspallm":
                peers.setdefault(cell.client_id, []).append(cell)
        for cell in cells:
            if cell.kind == "dense":
                self.run_cell(cell, lambda: exp.evaluate("dense", exp.model))
        for vote_id, variants in fed.items():
            self._run_federated(exp, vote_id, variants)
        for cell in cells:
            if cell.kind == "fedprllm" and dict(cell.client)["aggregate"] == "stats":
                self.run_cell(cell, lambda cell=cell: self._stats_mode(exp, cell))
        for variants in peers.values():
            self._run_fedspallm(exp, variants)
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

    def _run_federated(self, exp: Experiment, vote_id: str, variants: list[Cell]) -> None:
        config = variants[0].config()
        client_id = variants[0].client_id
        view = self._experiment_for(exp, variants[0])
        if config.mode == "iterative":
            for cell in variants:
                self.run_cell(cell, lambda cell=cell: self._iterative(view, cell))
            return
        try:
            aggregator, meta = self._client_masks(view, client_id)
        except Exception as err:
            for cell in variants:
                self.run_cell(cell, lambda err=err: _raise(err))
            return
        if config.wire != "packed":
            try:
                meta = {**meta, **self._wire_bytes(view, client_id, aggregator.shapes)}
            except Exception as err:
                for cell in variants:
                    self.run_cell(cell, lambda err=err: _raise(err))
                return
        start = time.perf_counter()  # the kernels' one-off load, apart from the counting
        load_kernels(aggregator.max_clients)
        meta = {**meta, "kernel_load_seconds": time.perf_counter() - start}
        start = time.perf_counter()
        aggregator.counts()  # cached for every variant; timed apart as the counting cost
        meta = {**meta, "count_seconds": time.perf_counter() - start}
        self._mask_stats(vote_id, aggregator)
        for cell in variants:
            self.run_cell(cell, lambda cell=cell, agg=aggregator: self._oneshot(view, cell, agg,
                                                                                 meta))
        del aggregator

    def _client_masks(self, exp: Experiment, client_id: str) -> tuple[MaskAggregator, dict]:
        """Every client's one-shot masks: from the cache, or computed and cached."""
        from fedcompress.pruning.local import local_masks

        config = exp.config
        aggregator = MaskAggregator(exp.model, config.clients, cache_counts=True)
        meta = self.cache.load(client_id, aggregator)
        if meta is not None:
            logger.info("client masks %s: %d clients from the cache", client_id, meta["clients"])
            return self._attacked(exp, aggregator, meta)
        start = time.perf_counter()
        config, sites = with_site_plan(config, exp.model, exp.windows)  # federated OWL
        owl_seconds = time.perf_counter() - start
        seconds = []
        for i, windows in enumerate(_progress(exp.windows, self.progress,
                                              f"client masks ({config.method} "
                                              f"{config.sparsity}, {config.clients} clients)")):
            payload = self.cache.load_client(client_id, i)
            if payload is None:
                start = time.perf_counter()
                result = local_masks(exp.model, windows, config.prune,
                                     batch_size=config.batch_size)
                seconds.append(time.perf_counter() - start)
                payload = encode_masks(result.masks)
                self.cache.store(client_id, i, payload)
            aggregator.add_packed(payload)
        meta = {"clients": config.clients, "client_seconds": seconds,
                "client_seconds_mean": float(np.mean(seconds)) if seconds else None,
                "bytes_up_per_client": payload_nbytes(aggregator.shapes),
                "settings": config.to_dict(), "layer_sparsity": config.layer_sparsity}
        if sites is not None:
            meta.update({"sites_outlier_ratios": sites, "owl_seconds": owl_seconds})
        self.cache.finish(client_id, meta)
        return self._attacked(exp, aggregator, meta)

    def _wire_bytes(self, exp: Experiment, client_id: str, shapes: dict[str, tuple]) -> dict:
        """Each (honest) client's cached masks sent in the cell's wire format, as its ClientApp
        sends them (:func:`~fedcompress.methods.fedprllm.federated.encode_wire`, against the
        public reference the server broadcasts), and decoded as the server decodes them (checked
        equal to the cached masks): measured bytes and seconds."""
        from fedcompress.masks.codec import decode_mask
        from fedcompress.methods.fedprllm.federated import (
            decode_wire,
            encode_wire,
            public_reference_wire,
        )

        config = exp.config
        start = time.perf_counter()
        reference = public_reference_wire(exp.model, exp.tokenizer, config)
        reference_seconds = time.perf_counter() - start
        sizes, encode, decode = [], [], []
        for i in range(config.clients):
            packed = self.cache.load_client(client_id, i)
            if packed is None:
                raise RuntimeError(f"client {i}'s cached masks of {client_id} are missing")
            masks = {k: decode_mask(packed[k], shape, k) for k, shape in shapes.items()}
            start = time.perf_counter()
            payload = encode_wire(masks, exp.model, config, reference)
            encode.append(time.perf_counter() - start)
            sizes.append(sum(int(a.nbytes) for a in payload.values()))
            start = time.perf_counter()
            decoded = decode_wire(payload, shapes, exp.model, config, reference)
            decode.append(time.perf_counter() - start)
            if any(not np.array_equal(decoded[k], packed[k]) for k in shapes):
                raise RuntimeError(f"client {i}: the {config.wire} payload does not decode to "
                                   "its masks")
        return {"bytes_up_per_client": float(np.mean(sizes)), "wire_bytes_up": sizes,
                "wire_encode_seconds_mean": float(np.mean(encode)),
                "wire_decode_seconds_total": float(np.sum(decode)),
                "bytes_down_per_client": sum(int(a.nbytes) for a in (reference or {}).values()),
                "reference_seconds": reference_seconds}

    def _attacked(self, exp: Experiment, aggregator: MaskAggregator, meta: dict
                  ) -> tuple[MaskAggregator, dict]:
        """The honest sites' aggregator with the simulated attackers' masks in place of
        theirs (:mod:`fedcompress.methods.fedprllm.attacks`); an attacker's payload goes through
        the server's payload check like any reply, and is left out when it fails it."""
        from fedcompress.methods.fedprllm.attacks import attack_masks
        from fedcompress.methods.fedprllm.federated import check_payload

        config = exp.config
        if not config.attackers:
            return aggregator, meta
        if meta.get("layer_sparsity"):
            config = config.replace(layer_sparsity=meta["layer_sparsity"])
        replaced, refused = {}, []
        for i in range(config.attackers):
            masks = attack_masks(config.attack, exp.model, exp.windows[i], config.prune,
                                 config.seed, i, config.batch_size, exp.windows[0])
            payload = encode_masks(masks)
            try:
                replaced[i] = check_payload(payload, aggregator.shapes, config.prune.plan,
                                            config.mask_tolerance)
            except InvalidMaskError as err:
                refused.append({"site": i, "reason": str(err)})
        attacked = aggregator.with_sites(replaced)
        if refused:
            refused_sites = {r["site"] for r in refused}
            attacked = attacked.subset([i for i in range(attacked.clients)
                                        if i not in refused_sites])
        logger.info("%d attackers (%s): %d masks refused by the payload check",
                    config.attackers, config.attack, len(refused))
        return attacked, {**meta, "attack": {"kind": config.attack, "sites": config.attackers,
                                             "refused_by_check": refused}}

    def _mask_stats(self, client_id: str, aggregator: MaskAggregator) -> None:
        from fedcompress.masks.stats import mean_pairwise_hamming, unanimity, vote_histogram

        if client_id in self.stats:
            return
        counts = aggregator.counts()
        m = aggregator.clients
        hist = vote_histogram(counts, m)
        stats = {"clients": m, "vote_histogram": hist.overall.tolist()}
        by_layer = {}
        for key, c in counts.items():
            layer = int(key.split(".")[1])
            by_layer.setdefault(layer, {})[key] = c
        if m >= 2:
            stats["agreement_per_layer"] = {
                layer: {"unanimity": unanimity(c, m).overall,
                        "mean_pairwise_hamming": mean_pairwise_hamming(c, m).overall}
                for layer, c in sorted(by_layer.items())}
        self.stats[client_id] = stats
        (self.out / "stats.json").write_text(json.dumps(self.stats, indent=1, default=float))

    def _oneshot(self, exp: Experiment, cell: Cell, aggregator: MaskAggregator,
                 meta: dict) -> dict:
        config = cell.config()
        if meta.get("layer_sparsity"):  # the plan the sites' masks were made with (OWL)
            config = config.replace(layer_sparsity=meta["layer_sparsity"])
        model = exp.fresh_copy()
        start = time.perf_counter()
        aggregator.prune(model, config.server, config.prune.plan,
                         config.prune.nm_pattern)
        aggregate = time.perf_counter() - start
        name = f"fedprllm-oneshot-{config.server.label}"
        wire = {k: meta[k] for k in ("wire_bytes_up", "wire_encode_seconds_mean",
                                     "wire_decode_seconds_total", "bytes_down_per_client",
                                     "reference_seconds") if k in meta}
        return exp.evaluate(name, model, aggregate_seconds=aggregate,
                            count_seconds=meta["count_seconds"], rounds=1,
                            client_seconds_mean=meta.get("client_seconds_mean"),
                            bytes_up_per_client=meta["bytes_up_per_client"],
                            bytes_up_total=meta["bytes_up_per_client"] * config.clients,
                            **wire,
                            **({"attack_outcome": meta["attack"]} if "attack" in meta else {}),
                            **({"defence_outcome": aggregator.rejection.to_dict()}
                               if aggregator.rejection is not None else {}))

    def _stats_mode(self, exp: Experiment, cell: Cell) -> dict:
        """A statistics-mode cell: the sites' summed statistics, one round per decoder layer
        (:func:`~fedcompress.methods.fedprllm.stats.stats_prune`; the bytes are a site's
        statistics over every round)."""
        from fedcompress.methods.fedprllm.stats import stats_prune
        from fedcompress.pruning.local import apply_masks

        config = cell.config()
        start = time.perf_counter()
        run = stats_prune(exp.model, exp.windows, config, tokenizer=exp.tokenizer)
        seconds = time.perf_counter() - start
        model = apply_masks(exp.fresh_copy(), run.masks, run.weights)
        up = int(sum(run.bytes_up_per_site))
        return exp.evaluate(f"fedprllm-stats-{config.local_group}", model,
                            prune_seconds=seconds, rounds=len(run.masks),
                            bytes_up_per_client=up, bytes_up_total=up * config.clients,
                            client_seconds_mean=float(sum(run.site_seconds)) / config.clients,
                            server_seconds=float(sum(run.server_seconds)))

    def _run_fedspallm(self, exp: Experiment, variants: list[Cell]) -> None:
        """FedSpaLLM cells sharing their sites' releases (the same client settings: only the
        server's comparison ``group`` differs): the releases once, summed as they come (one in
        memory at a time) into a sum held on disk under the output folder (memory-mapped,
        unlinked at once: :class:`~fedcompress.methods.fedspallm.L0Sum`; for Qwen2.5-1.5B it
        would not fit in 24 GiB beside the model), then each cell's l0 average and mask
        expansion, one decoder layer at a time (:mod:`fedcompress.methods.fedspallm`)."""
        from fedcompress.methods.fedspallm import run_sites

        config = variants[0].config()
        budgets = ([config.fedspallm_layers] * config.clients if config.fedspallm_layers
                   else None)
        try:
            runs = run_sites(exp.model, exp.windows, config.sparsity, budgets,
                             config.local_group, config.seed, config.batch_size, config.onload,
                             wrap=lambda w: _progress(w, self.progress,
                                                      f"FedSpaLLM releases ({config.clients} "
                                                      "sites)"),
                             spill=self.out)
        except Exception as err:
            for cell in variants:
                self.run_cell(cell, lambda err=err: _raise(err))
            return
        for cell in variants:
            self.run_cell(cell, lambda cell=cell: self._fedspallm(exp, cell, runs))

    def _fedspallm(self, exp: Experiment, cell: Cell, runs: Any) -> dict:
        from fedcompress.pruning.local import apply_layer_masks

        config = cell.config()
        model = exp.fresh_copy()
        aggregate = 0.0  # the server's seconds: each layer's average and expansion, not applying
        layers = runs.total.layers(config.sparsity, config.group)
        while True:
            start = time.perf_counter()
            item = next(layers, None)
            aggregate += time.perf_counter() - start
            if item is None:
                break
            apply_layer_masks(model, *item)
            del item
        return exp.evaluate(f"fedspallm-{config.group}", model, rounds=1,
                            aggregate_seconds=aggregate,
                            client_seconds_mean=float(np.mean(runs.seconds)),
                            bytes_up_per_client=int(np.mean(runs.bytes_up)),
                            bytes_up_total=int(sum(runs.bytes_up)),
                            layers_per_site=[len(layers) for layers in runs.assignment])

    def _iterative(self, exp: Experiment, cell: Cell) -> dict:
        config = cell.config()
        start = time.perf_counter()
        timings: dict[str, list] = {}
        aggregators = iterative_vote(exp.model, exp.windows, config, timings=timings)
        vote_seconds = time.perf_counter() - start
        model = exp.fresh_copy()
        for aggregator in aggregators.values():
            aggregator.prune(model, config.server, config.prune.plan,
                             config.prune.nm_pattern)
        layer_up = [payload_nbytes(aggregators[layer].shapes) for layer in sorted(aggregators)]
        # Each round but the first carries the previous layer's global mask down.
        layer_down = [0] + layer_up[:-1]
        return exp.evaluate(f"fedprllm-iterative-{config.server.label}", model,
                            rounds=len(aggregators), iterative_seconds=vote_seconds,
                            bytes_up_per_client=sum(layer_up),
                            bytes_up_total=sum(layer_up) * config.clients,
                            bytes_down_masks_per_client=sum(layer_down),
                            client_seconds_mean=float(np.sum(timings["client_seconds"])
                                                      / config.clients),
                            layer_bytes_up_per_client=layer_up,
                            layer_bytes_down_per_client=layer_down,
                            layer_client_seconds_mean=[float(np.mean(s))
                                                       for s in timings["client_seconds"]],
                            layer_server_seconds=timings["server_seconds"])


def _raise(err: BaseException):
    raise err


def _progress(items, enabled: bool, description: str):
    if not enabled:
        yield from items
        return
    from tqdm.auto import tqdm

    yield from tqdm(items, desc=description, leave=False)


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
