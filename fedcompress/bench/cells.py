"""The cells and studies of a bench sweep (the types every bench module shares): the settings'
keys, :class:`Cell` (one evaluated model, identified by a hash of its settings: cells shared by
studies run once), :class:`Study`, :class:`BenchConfigError`, a stored record
(:func:`bench_record`), and the expansion of a FedPrLLM study's settings into its cells
(:func:`fedprllm_study`; the config format is described in :mod:`fedcompress.bench.sweep`, which
plans, runs and resumes them)."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from typing import Any, Iterator

from fedcompress.methods.evaluation import TaskEvalSettings
from fedcompress.methods.fedprllm.experiment import EvalConfig
from fedcompress.methods.fedprllm.federated import FedPrLLMConfig
from fedcompress.recipe.plan import expand_settings

SERVER_KEYS = ("group", "scale", "tie_break", "defence", "trim", "reject_z")
#: Client settings that do not change an honest site's masks (a simulated attack replaces the
#: attackers' masks after the cache): left out of the mask cache's key.
ATTACK_KEYS = ("attack", "attackers")
EVAL_KEYS = tuple(EvalConfig.names())
#: Evaluation settings of the zero-shot tasks (they matter only when ``tasks`` names some).
TASK_KEYS = tuple(TaskEvalSettings.names())
CLIENT_KEYS = tuple(k for k in FedPrLLMConfig.names() if k not in SERVER_KEYS)
STUDY_KEYS = ("title", "baselines", "total_windows", "columns", "kind")
#: Kinds of study (``[study.NAME] kind = ...``): a FedPrLLM sweep, or the studies of
#: :data:`fedcompress.bench.studies.KINDS` (arithmetic on other cells' records, or their own
#: cells).
STUDY_KINDS = ("fedprllm", "network", "leakage", "ppcgpt", "privytune", "personalize", "dp",
               "dp-leakage")
#: The wire-format settings: the client masks are the same in every format (only the bytes
#: differ), so one-shot cells of any format share their client id; each format keeps its own
#: replies (:attr:`Cell.replies_id`).
WIRE_KEYS = ("wire", "wire_reference")
BENCH_KEYS = ("device", "out", "cache")
#: A FedPrLLM study's recipe (a file, llm-compressor's format) and how a stage of it runs: its
#: one pass sets the cell's pruning and quantization settings
#: (:func:`fedcompress.recipe.plan.expand_settings`); a cell of a recipe is the cell of the
#: settings it stands for (the same id, the same cache).
RECIPE_KEYS = ("recipe", "pipeline")
BASELINES = ("dense", "centralized", "local-only")


class BenchConfigError(ValueError):
    """A bench config names an unknown setting or an impossible value."""


@dataclass(frozen=True)
class Cell:
    """One evaluated model: ``kind`` is ``fedprllm``, ``centralized``, ``local-only`` or
    ``dense``; ``client`` the client-side settings, ``server`` the server variant."""

    kind: str
    client: tuple[tuple[str, Any], ...]
    server: tuple[tuple[str, Any], ...] = ()
    evals: tuple[tuple[str, Any], ...] = ()

    @property
    def id(self) -> str:
        return digest({"kind": self.kind, "client": dict(self.client),
                       "server": dict(self.server), "eval": dict(self.evals)})

    @property
    def client_id(self) -> str:
        """What the cached client masks depend on (the server variant too, when iterative);
        not the wire format (the same masks, bit-packed in the cache)."""
        client = {k: v for k, v in self.client if k not in ATTACK_KEYS}
        if "wire" in client:
            client.update((k, FedPrLLMConfig.defaults()[k]) for k in WIRE_KEYS)
        extra = dict(self.server) if client.get("mode") == "iterative" else {}
        return digest({"client": client, "server": extra})

    @property
    def vote_id(self) -> str:
        """What the vote depends on: the cached honest masks, the simulated attackers and the
        wire format (the cells of one vote differ only in the server variant)."""
        client = dict(self.client)
        attack = {k: v for k, v in client.items() if k in ATTACK_KEYS}
        wire = {k: client[k] for k in WIRE_KEYS if k in client}
        return (self.client_id + (f"-{digest(attack)}" if attack.get("attackers") else "")
                + (f"-{digest(wire)}" if wire.get("wire", "packed") != "packed" else ""))

    @property
    def run_id(self) -> str:
        """The federated run of a FedPrLLM cell (``OUT/runs/<run_id>``): the cells of one
        one-shot vote or FedSpaLLM run share it (their sites' replies serve every server
        variant); an iterative or statistics-mode cell has a run of its own (its rounds
        depend on the server)."""
        client = dict(self.client)
        if client.get("mode") == "iterative" or client.get("aggregate") == "stats":
            return self.id
        return self.vote_id

    @property
    def replies_id(self) -> str:
        """The folder of the honest sites' kept one-shot replies: :attr:`client_id` (their
        masks bit-packed, the default wire format: the bench's mask cache since its first
        version), with the wire format's digest for another format (its payloads differ)."""
        client = dict(self.client)
        wire = {k: client[k] for k in WIRE_KEYS if k in client}
        if wire.get("wire", "packed") == "packed":
            return self.client_id
        return f"{self.client_id}-{digest(wire)}"

    def config(self) -> FedPrLLMConfig:
        return FedPrLLMConfig.from_dict({**dict(self.client), **dict(self.server)})

    def eval_config(self) -> EvalConfig:
        return EvalConfig(**dict(self.evals))

    def settings(self) -> dict:
        return {"kind": self.kind, **dict(self.client), **dict(self.server)}


def bench_record(cell: Cell, fields: dict) -> dict:
    """A stored record: the cell's id and settings (between ``client_id`` and ``eval``, where
    ``fedcompress report`` reads them), then what it measured."""
    return {"id": cell.id, "client_id": cell.client_id, **cell.settings(),
            "eval": dict(cell.evals), **fields}


def digest(value: Any) -> str:
    """12 hex digits of the SHA-1 of ``value`` as sorted JSON (a cell's id, ...)."""
    return hashlib.sha1(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class Study:
    name: str
    title: str
    settings: dict[str, Any]
    swept: list[str]
    baselines: list[str]
    columns: str | None
    cells: list[Cell] = field(default_factory=list)
    #: :data:`STUDY_KINDS`; ``options`` are the settings of a study of another kind that are
    #: not cell settings (profiles, stragglers, the studies it reads, a PPC-GPT study's
    #: ablation axes, ...; JSON, stored in report.json for its tables).
    kind: str = "fedprllm"
    options: dict[str, Any] = field(default_factory=dict)


def fedprllm_study(name: str, settings: dict) -> Study:
    """A FedPrLLM study (``kind = "fedprllm"``) of its settings: the cartesian product of the
    swept ones, each point's FedPrLLM cell and baselines (:func:`fedprllm_cells`)."""
    known = set(CLIENT_KEYS) | set(SERVER_KEYS) | set(EVAL_KEYS) | set(STUDY_KEYS) | set(
        BENCH_KEYS) | set(RECIPE_KEYS)
    unknown = sorted(set(settings) - known)
    if unknown:
        raise BenchConfigError(f"study {name!r}: unknown setting(s) {unknown}; expected some of "
                               f"{sorted(known)}")
    meta = {k: settings.pop(k) for k in STUDY_KEYS if k in settings}
    meta.pop("kind", None)
    for key in BENCH_KEYS:
        settings.pop(key, None)
    baselines = meta.get("baselines", [])
    baselines = [baselines] if isinstance(baselines, str) else list(baselines)
    bad = sorted(set(baselines) - set(BASELINES))
    if bad:
        raise BenchConfigError(f"study {name!r}: unknown baseline(s) {bad}: expected some of "
                               f"{', '.join(BASELINES)}")
    swept = [k for k, v in settings.items() if isinstance(v, list)]
    for key in swept:
        if not settings[key]:
            raise BenchConfigError(f"study {name!r}: {key} is an empty list")
    columns = meta.get("columns") or next(
        (k for k in swept if k in CLIENT_KEYS and k != "samples_per_client"),
        swept[0] if swept else None)
    if columns is not None and columns not in settings:
        raise BenchConfigError(f"study {name!r}: columns {columns!r} is not one of its settings")
    study = Study(name, meta.get("title", name), settings, swept, baselines, columns)
    seen = set()
    for values in itertools.product(*(settings[k] for k in swept)):
        point = {**settings, **dict(zip(swept, values))}
        if "total_windows" in meta:
            total, clients = int(meta["total_windows"]), int(point.get("clients", 16))
            if total % clients:
                raise BenchConfigError(f"study {name!r}: total_windows {total} is not a "
                                       f"multiple of clients {clients}")
            point["samples_per_client"] = total // clients
        for cell in fedprllm_cells(name, point, baselines):
            if cell.id not in seen:
                seen.add(cell.id)
                study.cells.append(cell)
    return study


def eval_items(eval_config: EvalConfig) -> tuple[tuple[str, Any], ...]:
    """The evaluation settings a cell's id depends on: the task settings only when tasks are
    named (so the cells of sweeps without tasks keep their ids, and their results resume)."""
    items = eval_config.to_dict()
    if not items.get("tasks"):
        items = {k: v for k, v in items.items() if k not in TASK_KEYS}
    return tuple(sorted(items.items()))


def fedprllm_cells(study: str, point: dict, baselines: list[str]) -> Iterator[Cell]:
    """The cells of one point of a FedPrLLM study: its FedPrLLM cell, then its baselines'."""
    evals = {k: point[k] for k in EVAL_KEYS if k in point}
    try:
        point = expand_settings(point, FedPrLLMConfig.defaults())
        config = FedPrLLMConfig.from_dict({k: v for k, v in point.items()
                                           if k not in EVAL_KEYS and k not in RECIPE_KEYS})
        eval_config = EvalConfig(**evals)
    except (TypeError, ValueError) as err:
        raise BenchConfigError(f"study {study!r}: {err}") from err
    if config.dp:
        raise BenchConfigError(f"study {study!r}: dp_epsilon={config.dp_epsilon}: DP statistics "
                               "cells belong to a study of kind dp (seeded noise, its "
                               "baselines and plot)")
    if config.wire != "packed" and config.mode != "oneshot":
        raise BenchConfigError(f"study {study!r}: wire={config.wire!r} with mode="
                               f"{config.mode!r}: the bench measures the {config.wire} wire "
                               "format of one-shot cells only")
    full = config.to_dict()
    if full["partition"] == "iid":  # alpha has no effect: one cell, not one per alpha
        full["alpha"] = FedPrLLMConfig.alpha
    client = tuple((k, full[k]) for k in CLIENT_KEYS)
    server = tuple((k, full[k]) for k in SERVER_KEYS)
    ev = eval_items(eval_config)
    yield Cell("fedprllm", client, server, ev)
    for baseline in baselines:
        if baseline == "dense":
            keep = ("model", "dtype", "batch_size")
            yield Cell("dense", tuple((k, v) for k, v in client if k in keep), (), ev)
        else:
            # Baselines do not depend on the federation's server side or mode; centralized
            # pruning sees the union of the windows, the same for every partition.
            drop = baseline_drop(baseline)
            yield Cell(baseline, tuple((k, v) for k, v in client if k not in drop), (), ev)


def baseline_drop(kind: str) -> tuple[str, ...]:
    """The client settings a baseline does not depend on (no federation, no attackers;
    centralized pruning sees the union of the windows, the same for every partition)."""
    return ("mode", "min_clients", *ATTACK_KEYS) + (
        ("partition", "alpha") if kind == "centralized" else ())


def data_key(cell: Cell) -> str:
    """Cells with the same model, calibration windows and evaluation text share an Experiment."""
    client = dict(cell.client)
    keys = ("model", "dtype", "clients", "samples_per_client", "seqlen", "partition", "alpha",
            "seed", "calib_text", "calib_split")
    if cell.kind == "dense":
        return digest({"dense": [client.get("model"), client.get("dtype")],
                       "eval": dict(cell.evals)})
    return digest({"data": {k: client.get(k) for k in keys}, "eval": dict(cell.evals)})
