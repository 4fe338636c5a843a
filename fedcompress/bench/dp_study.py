"""Perplexity against epsilon for differentially private statistics mode, as a bench study
(``[study.NAME] kind = "dp"`` of ``fedcompress bench CONFIG.toml``; config
``simulations/bench_dp.toml``).

For each setting of the study (``method``, ``sparsity``, a budget of sites x windows, the
noise's ``placement``) and each ``epsilon``, one cell runs
:func:`~fedcompress.methods.fedprllm.stats.stats_prune` (statistics mode, the sites one after
another in this process, each site's statistics clipped per window and noised as
:mod:`fedcompress.methods.fedprllm.dp` does) on the same calibration windows the bench draws
for its FedPrLLM cells (:func:`~fedcompress.methods.fedprllm.experiment.prepare_experiment`),
and evaluates the pruned model with the bench's evaluation
(:meth:`~fedcompress.methods.fedprllm.experiment.Experiment.evaluate`: the same text and
windows as every cell). A cell records the perplexity, the plan's noise multiplier ``sigma``,
the epsilon the accountant spent over the run's layer releases, delta, the mechanism, the
seconds of the run and the bytes one site sent. ``epsilon`` ``"none"`` (or 0) is plain
statistics mode: the sum of the sites' statistics, which is centralized pruning on the pooled
windows (the table says whether its perplexity equals the centralized cell's).

Beside them, planned as ordinary bench cells (shared with any other study of the folder that
plans the same cells): ``dense``, ``centralized``, ``local-only`` (site 0) and ``votes``
(FedPrLLM's one-shot vote of the sites' local masks, server comparison group ``vote_group``)
at each budget; and the study's own ``public`` cell per budget: centralized pruning on PUBLIC
text alone (:func:`~fedcompress.privacy.dp_stats.public_windows`: as many windows as the
budget's sites hold together, from the public corpus the DP plan already takes its clip bounds
from), what a server could do with no site's data and no privacy cost, the baseline a DP run
has to beat to be worth its epsilon.

Settings of the study table (``[bench]`` settings of the same name apply too):

* ``method`` (``wanda`` and/or ``sparsegpt``), ``sparsity`` and any other FedPrLLM client
  setting that statistics mode takes (``local_group``, ``seqlen``, ``partition``, ``seed``,
  ``calib_text``, ``batch_size``, ``nm``, ``dp_delta``, ``dp_clip``, ``dp_clip_quantile``,
  ``dp_public_windows``, ...); a list is swept;
* ``budgets``: sites x windows per site, e.g. ``["16x4", "16x64"]`` (default: ``clients`` x
  ``samples_per_client``);
* ``epsilon``: the run's epsilon per site, e.g. ``[1, 2, 4, 8, 16, "none"]`` (the default);
* ``placement``: ``central`` (the default: the server adds Gaussian noise to the clipped sum
  and is trusted with it) and/or ``distributed`` (each site adds a Skellam share in SecAgg+'s
  fixed-point lanes; the sum is taken as SecAgg+ takes it, without the cryptography);
* ``baselines``: some of :data:`BASELINES` (default all: ``centralized``, ``local-only``,
  ``votes``, ``dense``, ``public``);
* ``vote_group``: the votes' server comparison group (default ``layer``);
* ``draws``: noise draws per DP cell (default 1): the table shows their median and range, the
  plot the median with the range as an error bar, the cells' table every draw (a draw beyond
  the first is the same cell with its own noise seed);
* the evaluation settings (``eval_text``, ``eval_windows``, ...), as every study.

**The noise is seeded** per cell (``dp_seed``, from the cell's settings, its ``seed``
included) so that a rerun reproduces a cell. That is for research only: a draw someone can
repeat protects nobody, so no guarantee holds for these runs; a deployed site draws its noise
from OS entropy (:func:`fedcompress.privacy.dp_stats.secret_rng`). The simulated sites have no
ledger (the epsilon is the plan's accountant's).

Every cell is planned, stored in ``OUT/results.jsonl``, resumed (finished cells skipped, failed
ones retried; a failing cell is recorded with its error) and reported by the bench
(:mod:`fedcompress.bench.studies`). The report has the study's table (perplexity per epsilon
beside the baselines), the details of each DP cell and one plot, perplexity against epsilon
(``dp-NAME.png``).
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedcompress.bench.cells import (
    ATTACK_KEYS,
    CLIENT_KEYS,
    EVAL_KEYS,
    SERVER_KEYS,
    BenchConfigError,
    Cell,
    Study,
    data_key,
    digest,
    eval_items,
    fedprllm_cells,
)
from fedcompress.bench.studies import check_keys, stored_cell

if TYPE_CHECKING:
    from torch import nn

    from fedcompress.bench.labels import StudyTable
    from fedcompress.bench.sweep import BenchRunner
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig
    from fedcompress.methods.fedprllm.experiment import Experiment
    from fedcompress.methods.fedprllm.stats import StatsRun

logger = logging.getLogger(__name__)

#: The kind of a DP statistics-mode cell.
DP_CELL = "dp-stats"
#: What the study plans beside its DP cells (ordinary bench cells; ``votes``: FedPrLLM's
#: one-shot vote).
BASELINES = ("centralized", "local-only", "votes", "dense", "public")
#: The kind of a study's ``public`` cell: centralized pruning on public text (:func:`compute`).
PUBLIC_CELL = "dp-public"
#: The default epsilons (``"none"``: no DP).
EPSILONS = (1, 2, 4, 8, 16, "none")
PLACEMENTS = ("central", "distributed")
#: The study's own settings (not FedPrLLM's).
STUDY_SETTINGS = ("budgets", "epsilon", "placement", "baselines", "vote_group", "draws")
#: A DP cell's noise draw (a server-side tag of the cell, not a FedPrLLM setting: draw 0 is
#: the cell without it, so a study of one draw keeps its cells' ids).
DRAW = "draw"
#: FedPrLLM settings a dp study sets itself (or that do not apply to statistics mode), with
#: what to use instead.
RESERVED = {
    "aggregate": "statistics mode is what a dp study runs",
    "dp_epsilon": "use epsilon", "dp_placement": "use placement",
    "secagg": "set by placement (distributed: SecAgg+ lanes)",
    "mode": "the votes are one-shot", "min_clients": "every site answers",
    "wire": "statistics are float64 sums", "wire_reference": "statistics are float64 sums",
    "fault": "no faults", "faulty": "no faults", "fault_seconds": "no faults",
    "fault_layer": "no faults", "attack": "no attackers", "attackers": "no attackers",
}
#: FedPrLLM client settings a dp study takes.
FED_SETTINGS = tuple(k for k in CLIENT_KEYS if k not in RESERVED)
#: The budget's settings (``budgets`` sets them).
BUDGET_KEYS = ("clients", "samples_per_client")
_BUDGET = re.compile(r"\s*(\d+)\s*x\s*(\d+)\s*")
#: Settings added after DP results were stored, with the value those results had: left out of
#: a cell's noise seed at that value, so that a stored cell draws the noise it drew.
SEED_ADDED_LATER = {"dp_public_text": "wiki", "secagg_neighbours": 0,
                    "quant_preserve_zeros": False, "sparsegpt_block_size": 128,
                    "sparsegpt_dampening": 0.01}
#: Settings never in a noise seed: a path (the digest in ``dp_public_text`` pins the file's
#: text, wherever a machine keeps its copy).
SEED_EXCLUDED = ("dp_public_file",)
#: What the record says of its noise.
SEEDED_NOTE = ("seeded per cell for reproducible research: no privacy guarantee holds for a "
               "seeded draw")


# ------------------------------------------------------------------------------------------
# Planning
# ------------------------------------------------------------------------------------------

def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def parse_budget(name: str, value: Any) -> tuple[int, int]:
    """``"16x64"`` -> ``(16, 64)`` (sites, windows per site)."""
    match = _BUDGET.fullmatch(value) if isinstance(value, str) else None
    if match is None or min(int(match[1]), int(match[2])) < 1:
        raise BenchConfigError(f"study {name!r}: budgets entry {value!r}: expected "
                               "'SITESxWINDOWS' with both >= 1, such as '16x64'")
    return int(match[1]), int(match[2])


def parse_epsilon(name: str, value: Any) -> float:
    """An ``epsilon`` entry: a number > 0, or ``"none"`` / 0 (no DP) -> 0.0."""
    if isinstance(value, str) and value.strip().lower() == "none":
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise BenchConfigError(f"study {name!r}: epsilon entry {value!r}: expected a finite "
                               "number > 0, or 'none' (or 0) for no DP")
    return float(value)


def budget_label(settings: Mapping[str, Any]) -> str:
    return f"{settings['clients']}x{settings['samples_per_client']}"


def epsilon_label(epsilon: float) -> str:
    return "no DP" if not epsilon else f"ε={epsilon:g}"


def _options(name: str, table: Mapping[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """The study's own settings, checked: budgets, epsilons, placements, baselines."""
    from fedcompress.methods.fedprllm.stats import STATS_METHODS
    from fedcompress.solver.select import GROUPS

    if "budgets" in table:
        given = sorted(set(BUDGET_KEYS) & set(table))
        if given:
            raise BenchConfigError(f"study {name!r}: {given} and budgets both set the sites "
                                   "and windows: give budgets only")
        budgets = [parse_budget(name, b) for b in _as_list(table["budgets"])]
    else:
        values = [settings.get(k, dflt) for k, dflt in zip(BUDGET_KEYS, (16, 4))]
        if any(isinstance(v, list) for v in values):
            raise BenchConfigError(f"study {name!r}: clients / samples_per_client as lists: "
                                   "give budgets = ['SITESxWINDOWS', ...] instead")
        try:
            budgets = [(int(values[0]), int(values[1]))]
        except (TypeError, ValueError) as err:
            raise BenchConfigError(f"study {name!r}: clients / samples_per_client {values}: "
                                   "expected integers") from err
    epsilons = [parse_epsilon(name, e) for e in _as_list(table.get("epsilon", list(EPSILONS)))]
    placements = _as_list(table.get("placement", "central"))
    baselines = _as_list(table.get("baselines", list(BASELINES)))
    for key, values in (("budgets", budgets), ("epsilon", epsilons),
                        ("placement", placements)):
        if not values:
            raise BenchConfigError(f"study {name!r}: {key} is an empty list")
        if len(set(values)) != len(values):
            raise BenchConfigError(f"study {name!r}: {key} {values} names a value twice")
    bad = sorted({str(p) for p in placements} - set(PLACEMENTS))
    if bad:
        raise BenchConfigError(f"study {name!r}: placement {bad}: expected some of "
                               f"{list(PLACEMENTS)}")
    bad = sorted({str(b) for b in baselines} - set(BASELINES))
    if bad:
        raise BenchConfigError(f"study {name!r}: baselines {bad}: expected some of "
                               f"{list(BASELINES)}")
    vote_group = table.get("vote_group", "layer")
    if vote_group not in GROUPS:
        raise BenchConfigError(f"study {name!r}: vote_group {vote_group!r}: expected one of "
                               f"{list(GROUPS)}")
    methods = _as_list(settings.get("method", "wanda"))
    bad = sorted({str(m) for m in methods} - set(STATS_METHODS))
    if bad:
        raise BenchConfigError(f"study {name!r}: method {bad}: statistics mode (and its DP) "
                               f"takes {list(STATS_METHODS)}")
    if settings.get("sparsity_profile", "uniform") != "uniform":
        raise BenchConfigError(f"study {name!r}: sparsity_profile "
                               f"{settings['sparsity_profile']!r}: a dp study compares "
                               "statistics mode with the baselines at uniform (or fixed "
                               "layer_sparsity) plans")
    draws = table.get("draws", 1)
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise BenchConfigError(f"study {name!r}: draws {draws!r}: expected an integer >= 1 "
                               "(noise draws per DP cell)")
    return {"budgets": [list(b) for b in budgets], "epsilons": epsilons,
            "placements": [str(p) for p in placements],
            "baselines": [b for b in BASELINES if b in baselines], "vote_group": vote_group,
            "draws": draws}


def plan_study(name: str, base: Mapping[str, Any], table: Mapping[str, Any],
               overrides: Mapping[str, Any]) -> Study:
    """A dp study: per point of its swept FedPrLLM settings and per budget, one DP cell per
    placement and epsilon (epsilon 0: one plain statistics-mode cell) and the baselines'
    ordinary bench cells."""
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig

    for key in sorted(set(table) & set(RESERVED)):
        raise BenchConfigError(f"study {name!r} (kind dp): {key} is not a setting of a dp "
                               f"study: {RESERVED[key]}")
    check_keys(name, "dp", table, [*FED_SETTINGS, *EVAL_KEYS, *STUDY_SETTINGS])
    settings = {k: base[k] for k in FED_SETTINGS if k in base}
    settings.update({k: table[k] for k in FED_SETTINGS if k in table})
    evals = {k: base[k] for k in EVAL_KEYS if k in base}
    evals.update({k: table[k] for k in EVAL_KEYS if k in table})
    evals.update({k: v for k, v in overrides.items() if k in EVAL_KEYS})
    options = _options(name, table, settings)
    for key in BUDGET_KEYS:
        settings.pop(key, None)
    swept = [k for k, v in settings.items() if isinstance(v, list)]
    for key in swept:
        if not settings[key]:
            raise BenchConfigError(f"study {name!r}: {key} is an empty list")
    options["rows"] = swept
    cells: dict[str, Cell] = {}
    fed_baselines = [b for b in options["baselines"] if b not in ("votes", "public")]
    for values in itertools.product(*(settings[k] for k in swept)):
        point = {**settings, **dict(zip(swept, values))}
        for clients, windows in options["budgets"]:
            budget = {**point, "clients": clients, "samples_per_client": windows}
            for placement in options["placements"]:
                for epsilon in options["epsilons"]:
                    cell = dp_cell(name, budget, evals, epsilon, placement)
                    cells.setdefault(cell.id, cell)
                    for draw in range(1, options["draws"] if epsilon else 1):
                        other = with_draw(cell, draw)
                        cells.setdefault(other.id, other)
            if "public" in options["baselines"]:  # the budget's settings without DP
                plain = dp_cell(name, budget, evals, 0.0, options["placements"][0])
                text = budget.get("dp_public_text", FedPrLLMConfig.dp_public_text)
                public = Cell(PUBLIC_CELL, tuple((k, text if k == "dp_public_text" else v)
                                                 for k, v in plain.client), (), plain.evals)
                cells.setdefault(public.id, public)
            # the baselines: ordinary bench cells (no DP settings: shared with other studies)
            votes = {k: v for k, v in budget.items() if not k.startswith("dp_")}
            votes.update(mode="oneshot", group=options["vote_group"], **evals)
            for cell in fedprllm_cells(name, votes, fed_baselines):
                if cell.kind != "fedprllm" or "votes" in options["baselines"]:
                    cells.setdefault(cell.id, cell)
    fixed = {k: v for k, v in settings.items() if k not in swept}
    return Study(name, str(table.get("title", name)), {**fixed, **evals},
                 [*swept, "budget", "placement", "epsilon"], [], None, list(cells.values()),
                 kind="dp", options=options)


def dp_cell(name: str, point: Mapping[str, Any], evals: Mapping[str, Any], epsilon: float,
            placement: str) -> Cell:
    """The DP statistics-mode cell of ``point`` (FedPrLLM client settings) at ``epsilon``
    (0: no DP; its DP settings then take their defaults, so that one cell serves every
    placement)."""
    from fedcompress.config import SettingsError
    from fedcompress.methods.fedprllm.config import EvalConfig, FedPrLLMConfig

    values = dict(point)
    values.update(aggregate="stats", dp_epsilon=epsilon)
    if epsilon:
        values.update(dp_placement=placement, secagg=placement == "distributed")
    else:
        values = {k: v for k, v in values.items() if not k.startswith("dp_")}
    try:
        config = FedPrLLMConfig.from_dict(values)
        items = eval_items(EvalConfig(**evals))
    except (SettingsError, TypeError, ValueError) as err:
        raise BenchConfigError(f"study {name!r}: {err}") from err
    full = config.to_dict()
    if full["partition"] == "iid":  # alpha has no effect (as the bench's cells)
        full["alpha"] = FedPrLLMConfig.alpha
    return Cell(DP_CELL, tuple((k, full[k]) for k in CLIENT_KEYS), (), items)


def with_draw(cell: Cell, draw: int) -> Cell:
    """``cell`` with its noise's draw ``draw`` (0: the cell itself)."""
    return Cell(cell.kind, cell.client, ((DRAW, int(draw)),) if draw else (), cell.evals)


def draw_of(cell: Cell) -> int:
    return int(dict(cell.server).get(DRAW, 0))


def fed_config(cell: Cell) -> FedPrLLMConfig:
    """A DP or public cell's FedPrLLM settings (its draw is not one)."""
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig

    return FedPrLLMConfig.from_dict(dict(cell.client))


def record_cell(record: Mapping[str, Any]) -> Cell:
    """The cell a stored DP record belongs to (settings it lacks, added later, take their
    default, but ``dp_normalize`` and ``dp_prior``: a DP record from before they existed
    released raw statistics, and one from before ``dp_prior`` was not shrunk)."""
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig

    kind = PUBLIC_CELL if record.get("kind") == PUBLIC_CELL else DP_CELL
    legacy = {"dp_normalize": "none", "dp_prior": "none"} if record.get("dp_epsilon") else None
    cell = stored_cell(kind, record, FedPrLLMConfig, drop=SERVER_KEYS, legacy=legacy)
    return with_draw(Cell(kind, cell.client, (), tuple(sorted(record.get("eval", {}).items()))),
                     int(record.get(DRAW, 0)))


def dp_seed(cell: Cell) -> int:
    """The seed of a cell's noise: from its settings (its ``seed`` among them) and its draw,
    so that a rerun draws the same noise. Research only (module docstring)."""
    client = {k: v for k, v in cell.client if k not in ATTACK_KEYS and k not in SEED_EXCLUDED
              and (k, v) not in SEED_ADDED_LATER.items()}
    draw = draw_of(cell)
    return int(np.random.SeedSequence([int(client.get("seed", 0)), int(digest(client), 16),
                                       *([draw] if draw else [])]).generate_state(1)[0])


# ------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------

def prune_cell(exp: Experiment, cell: Cell) -> tuple[nn.Module, StatsRun, float, int | None]:
    """A DP cell's pruned model: statistics mode on the experiment's sites' windows (seeded
    noise with DP). Returns the model, the run, its seconds and the noise seed (None without
    DP)."""
    from fedcompress.methods.fedprllm.stats import stats_prune
    from fedcompress.pruning.local import apply_masks

    config = fed_config(cell)
    seed = dp_seed(cell) if config.dp else None
    start = time.perf_counter()
    run = stats_prune(exp.model, exp.windows, config, tokenizer=exp.tokenizer, dp_seed=seed)
    seconds = time.perf_counter() - start
    return apply_masks(exp.fresh_copy(), run.masks, run.weights), run, seconds, seed


def compute(exp: Experiment, cell: Cell) -> dict:
    """One DP cell's record: the bench's evaluation of its pruned model, and what the run
    cost and spent."""
    config = fed_config(cell)
    view = copy.copy(exp)
    view.config = config
    model, run, seconds, seed = prune_cell(view, cell)
    dp = run.dp
    fields: dict[str, Any] = {
        "prune_seconds": seconds, "rounds": len(run.masks),
        "bytes_up_per_site": int(sum(run.bytes_up_per_site)),
        "bytes_up_total": int(sum(run.bytes_up_per_site)) * config.clients,
        "site_seconds_mean": float(sum(run.site_seconds)),
        "server_seconds": float(sum(run.server_seconds)), "dp_report": dp}
    if dp.get("dp"):
        fields.update(sigma=dp["sigma"], epsilon_spent=dp["epsilon_spent"],
                      delta=dp["delta"], mechanism=dp["mechanism"], noise_seed=seed,
                      noise=SEEDED_NOTE)
    name = (f"dp-stats {config.method} {budget_label(config.to_dict())} "
            + (f"{config.dp_placement} eps {config.dp_epsilon:g}" if config.dp else "no DP"))
    record = view.evaluate(name, model, **fields)
    del model
    return record


def compute_public(exp: Experiment, cell: Cell) -> dict:
    """A ``public`` cell's record: centralized pruning (the cell's method and local group) on
    ``clients x samples_per_client`` windows of the public corpus (its ``dp_public_text``'s
    validation split, as the DP cells' bounds, scales and prior; seed: the cell's), evaluated
    as every cell; the record says which text and how many of its tokens the windows came
    from."""
    from fedcompress.data.calibration import tokenize_corpus
    from fedcompress.data.corpora import load_corpus
    from fedcompress.privacy.dp_stats import (
        PUBLIC_SPLIT,
        is_digest,
        public_text_source,
        public_windows,
    )
    from fedcompress.pruning.local import apply_masks, local_masks

    config = fed_config(cell)
    view = copy.copy(exp)
    view.config = config
    n = config.clients * config.samples_per_client
    start = time.perf_counter()
    text = config.dp_public_text
    files = (config.dp_public_file,)
    windows = public_windows(exp.tokenizer, config.seqlen, n, seed=config.seed, corpus=text,
                             files=files)
    result = local_masks(exp.model, windows, config.prune, batch_size=config.batch_size)
    seconds = time.perf_counter() - start
    model = apply_masks(exp.fresh_copy(), result.masks, result.weights)
    source = public_text_source(text, files)
    tokens = int(tokenize_corpus(exp.tokenizer, load_corpus(source, PUBLIC_SPLIT)).numel())
    name = (f"public-calibration {config.method} {budget_label(config.to_dict())}")
    record = view.evaluate(name, model, prune_seconds=seconds, public_windows=n,
                           public_text=(f"{text} (the whole file)" if is_digest(text)
                                        else f"{text} {PUBLIC_SPLIT}"),
                           public_tokens=tokens)
    del model
    return record


def run_cells(runner: BenchRunner, cells: list[Cell]) -> None:
    """Run the pending DP cells: each model loaded once, each set of windows and evaluation
    text prepared once (as the bench prepares its FedPrLLM cells'), each cell stored at once
    (a failure recorded with its error)."""
    from fedcompress.methods.fedprllm.experiment import prepare_experiment
    from fedcompress.models import load_model

    by_model: dict[tuple, list[Cell]] = {}
    for cell in cells:
        client = dict(cell.client)
        by_model.setdefault((client["model"], client["dtype"]), []).append(cell)
    for (model, dtype), group in by_model.items():
        try:
            loaded = load_model(model, device=runner.device, dtype=dtype)
        except Exception as err:  # every cell of the model fails with its error
            for cell in group:
                runner.run_cell(cell, lambda err=err: _raise(err))
            continue
        by_data: dict[str, list[Cell]] = {}
        for cell in group:
            by_data.setdefault(data_key(cell), []).append(cell)
        for same in by_data.values():
            try:
                exp = prepare_experiment(fed_config(same[0]), same[0].eval_config(),
                                         loaded=loaded)
            except Exception as err:
                for cell in same:
                    runner.run_cell(cell, lambda err=err: _raise(err))
                continue
            for cell in same:
                work = compute_public if cell.kind == PUBLIC_CELL else compute
                runner.run_cell(cell, lambda cell=cell, exp=exp, work=work: work(exp, cell))
        del loaded


def _raise(err: BaseException):
    raise err


# ------------------------------------------------------------------------------------------
# Tables and the plot
# ------------------------------------------------------------------------------------------

_REFERENCE = {"centralized": "centralized", "local-only": "local-only", "fedprllm": "votes"}
_BASELINE_LABEL = {"centralized": "centralized", "local-only": "local-only (site 0)",
                   "votes": "FedPrLLM vote", "dense": "dense",
                   "public": "public text (centralized)"}


def _rows(study: Study) -> list[dict[str, Any]]:
    """The table's rows: per point of the swept settings, budget and placement (placement
    ``-`` when the study has no DP epsilon)."""
    options = study.options
    placements = options["placements"] if any(options["epsilons"]) else ["-"]
    rows: dict[str, dict[str, Any]] = {}
    for cell in study.cells:
        if cell.kind != DP_CELL:
            continue
        s = cell.settings()
        for placement in placements:
            row = {**{k: s.get(k) for k in options["rows"]}, "budget": budget_label(s),
                   "placement": placement}
            rows.setdefault(repr(sorted(row.items())), row)
    return list(rows.values())


def _matches(row: Mapping[str, Any], settings: Mapping[str, Any], rows: list[str]) -> bool:
    """Whether a cell belongs to a row: its budget and swept settings (the DP settings only
    for a cell with DP: the others take their defaults; but a public cell's text is its
    row's ``dp_public_text``)."""
    if "clients" in settings and budget_label(settings) != row["budget"]:
        return False
    dp = settings.get("kind") == DP_CELL and bool(settings.get("dp_epsilon"))
    public = settings.get("kind") == PUBLIC_CELL
    return all(settings[k] == row[k] for k in rows
               if k in settings and (dp or not k.startswith("dp_")
                                     or (public and k == "dp_public_text")))


def _value(record: Mapping[str, Any] | None) -> str:
    if record is None:
        return "pending"
    if record.get("status") != "ok":
        return "failed"
    return f"{record['perplexity']:.2f}"


def row_values(study: Study, results: Mapping[str, dict], row: Mapping[str, Any]
               ) -> dict[str, Mapping[str, Any] | None]:
    """The records of a row: ``eps:<value>`` per epsilon (its first draw), and each baseline's
    (``None``: pending; a key missing: not planned)."""
    out: dict[str, Mapping[str, Any] | None] = {
        k: draws[0] for k, draws in row_draws(study, results, row).items()}
    for cell in study.cells:
        s = cell.settings()
        if cell.kind == "dense":
            out["dense"] = results.get(cell.id)
            continue
        if cell.kind == DP_CELL or not _matches(row, s, study.options["rows"]):
            continue
        if cell.kind == PUBLIC_CELL:
            out["public"] = results.get(cell.id)
        elif cell.kind in _REFERENCE:
            out[_REFERENCE[cell.kind]] = results.get(cell.id)
    return out


def row_draws(study: Study, results: Mapping[str, dict], row: Mapping[str, Any]
              ) -> dict[str, list[Mapping[str, Any] | None]]:
    """Every draw's record of a row's DP cells, ``eps:<value>`` -> [draw 0, draw 1, ...]
    (``None``: pending)."""
    out: dict[str, list[tuple[int, Mapping[str, Any] | None]]] = {}
    for cell in study.cells:
        s = cell.settings()
        if cell.kind != DP_CELL or not _matches(row, s, study.options["rows"]):
            continue
        eps = float(s["dp_epsilon"])
        if eps and s["dp_placement"] != row["placement"]:
            continue
        out.setdefault(f"eps:{eps:g}", []).append((draw_of(cell), results.get(cell.id)))
    return {k: [r for _, r in sorted(v, key=lambda d: d[0])] for k, v in out.items()}


def draw_summary(records: list[Mapping[str, Any] | None]) -> tuple[float, float, float] | None:
    """The median, lowest and highest perplexity of a DP cell's draws (None unless every
    draw finished)."""
    if not records or any(r is None or r.get("status") != "ok" for r in records):
        return None
    values = [float(r["perplexity"]) for r in records if r is not None]
    return float(np.median(values)), min(values), max(values)


def _draws_value(records: list[Mapping[str, Any] | None]) -> str:
    if len(records) == 1:
        return _value(records[0])
    summary = draw_summary(records)
    if summary is None:
        done = sum(1 for r in records if r is not None)
        failed = sum(1 for r in records if r is not None and r.get("status") != "ok")
        return f"failed ({failed} of {len(records)})" if failed else \
            f"pending ({done} of {len(records)})"
    median, lo, hi = summary
    return f"{median:.2f} ({lo:.2f}-{hi:.2f})"


def _same_as_centralized(values: Mapping[str, Mapping[str, Any] | None]) -> str:
    plain, central = values.get("eps:0"), values.get("centralized")
    if not plain or not central or plain.get("status") != "ok" \
            or central.get("status") != "ok":
        return "-"
    gap = plain["perplexity"] - central["perplexity"]
    return "yes (identical)" if gap == 0 else f"NO: {gap:+.3g}"


def study_tables(study: Study, results: Mapping[str, dict]) -> list[StudyTable]:
    """Perplexity per epsilon beside the baselines (one row per setting, budget and
    placement), then each DP cell's noise, spent epsilon, seconds and bytes."""
    from fedcompress.bench.labels import StudyTable, format_value, human_bytes

    options = study.options
    keys = [*options["rows"], "budget", "placement"]
    epsilons = options["epsilons"]
    columns = [f"eps:{e:g}" for e in epsilons] + [b for b in BASELINES
                                                  if b in options["baselines"]]
    header = [*keys, *(epsilon_label(e) for e in epsilons),
              *(_BASELINE_LABEL[b] for b in BASELINES if b in options["baselines"]),
              *(["no DP = centralized"] if 0.0 in epsilons and "centralized" in columns
                else [])]
    body = []
    draws = int(options.get("draws", 1))
    for row in _rows(study):
        values = row_values(study, results, row)
        drawn = row_draws(study, results, row)
        line = [*(format_value(row[k]) for k in keys),
                *(_draws_value(drawn[c]) if c in drawn else
                  _value(values.get(c)) if c in values else "-" for c in columns)]
        if header[-1] == "no DP = centralized":
            line.append(_same_as_centralized(values))
        body.append(line)
    fixed = ", ".join(f"{k}={format_value(v)}" for k, v in sorted(study.settings.items()))
    note = ("Perplexity (lower is better) of statistics mode with DP at each epsilon per site "
            "(delta and the clip bounds as fixed below; the noise multiplier and the epsilon "
            "the accountant spent over every layer's release are in the next table), beside "
            "the dense model, centralized pruning on the pooled windows, site 0 alone "
            "(local-only), FedPrLLM's one-shot vote (server "
            f"{options['vote_group']} group) at the same budget (sites x windows per site) "
            "and centralized pruning on as many windows of public text (no site's data: "
            "the baseline a DP run must beat). "
            "`no DP` is plain statistics mode, which is centralized pruning on the same "
            "windows (the last column compares the two perplexities). The noise is "
            f"{SEEDED_NOTE}"
            + (f"; each epsilon is {draws} draws of the noise: their median (lowest-highest)"
               if draws > 1 else "") + f". Fixed: {fixed}.")
    main = StudyTable("", note, header, body, first_value=len(keys), best="min")
    detail_header = [*keys[:-1], "placement", "epsilon", *(["draw"] if draws > 1 else []),
                     "perplexity", "sigma", "epsilon spent", "delta", "prune s", "up / site",
                     "status"]
    detail = []
    for cell in study.cells:
        if cell.kind != DP_CELL:
            continue
        s = cell.settings()
        eps = float(s["dp_epsilon"])
        record = results.get(cell.id)
        line = [*(format_value(s.get(k)) for k in options["rows"]), budget_label(s),
                s["dp_placement"] if eps else "-", epsilon_label(eps),
                *([str(draw_of(cell))] if draws > 1 else [])]
        if record is None or record.get("status") != "ok":
            status = "pending" if record is None else f"failed: {record.get('error', '?')}"
            detail.append(line + [""] * 6 + [status[:160]])
            continue
        spent = record.get("epsilon_spent")
        detail.append(line + [
            f"{record['perplexity']:.3f}",
            f"{record['sigma']:.4g}" if "sigma" in record else "-",
            f"{spent:.4g}" if spent is not None else "-",
            f"{record['delta']:g}" if "delta" in record else "-",
            f"{record['prune_seconds']:.1f}", human_bytes(record["bytes_up_per_site"]), "ok"])
    detail_note = ("Each DP cell: the noise multiplier sigma of its plan (a block's noise "
                   "std is sigma sqrt(2k) C_j for its clip bound C_j), the epsilon the "
                   "accountant gives for all the run's layer releases, seconds of the "
                   "statistics-mode run (all sites, one after another, in one process) and "
                   "the bytes one site sends over the run.")
    return [main, StudyTable("DP cells", detail_note, detail_header, detail,
                             first_value=len(options["rows"]) + 4 + (draws > 1), best=None)]


#: How far above the worst baseline a DP point may lie and still be drawn to scale: points
#: above it are drawn just above the panel's highest point to scale, as an up-triangle labelled
#: with their value, so that a wrecked low-epsilon cell does not flatten every baseline onto one
#: line.
PLOT_HEADROOM = 3.0


def study_plots(study: Study, results: Mapping[str, dict], out: Path) -> list[Path]:
    """``dp-NAME.png``: perplexity against epsilon (log x), one panel per method, one line
    per budget (and placement, other swept settings), horizontal lines for its centralized,
    no-DP, public-text, local-only and votes cells (the line's colour) and the dense model
    (grey). The y axis is linear and spans the baselines and the DP points up to
    :data:`PLOT_HEADROOM` times the worst baseline; a point above that is drawn on the top edge
    (an up-triangle with its value). The dense model's line is not in the span (the legend says
    when it is below the axis). The title wraps."""
    import textwrap

    from fedcompress.bench.plots import pyplot

    options = study.options
    panels: dict[str, list[tuple[dict, dict]]] = {}
    draws = int(options.get("draws", 1))
    for row in _rows(study):
        values = row_values(study, results, row)
        # the median of every finished set of draws, its range as an error bar
        summaries = {k: draw_summary(v) for k, v in row_draws(study, results, row).items()
                     if float(k[4:]) > 0}
        points = sorted((float(k[4:]), *v) for k, v in summaries.items() if v is not None)
        refs = {k: r["perplexity"] for k, r in values.items()
                if not k.startswith("eps:") and r and r.get("status") == "ok"}
        if "eps:0" in values and values["eps:0"] and values["eps:0"].get("status") == "ok":
            refs["no DP"] = values["eps:0"]["perplexity"]
        if not points and not refs:
            continue
        method = str(row.get("method", study.settings.get("method", "")))
        panels.setdefault(method, []).append((row, {"points": points, "refs": refs}))
    if not panels:
        return []
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 6.8), squeeze=False)
    styles = {"centralized": "--", "no DP": (0, (1, 1)), "local-only": ":", "votes": "-.",
              "dense": "-", "public": (0, (5, 1, 1, 1))}
    eps = [e for e in options["epsilons"] if e > 0]
    for ax, (method, lines) in zip(axes[0], sorted(panels.items())):
        dense = None
        refs_all = [y for _, line in lines for k, y in line["refs"].items() if k != "dense"]
        points_all = [y for _, line in lines for _, y, _, _ in line["points"]]
        limit = (max(refs_all) if refs_all else min(points_all, default=1.0)) * PLOT_HEADROOM
        scaled = refs_all + [y for y in points_all if y <= limit]
        lo, hi = (min(scaled), max(scaled)) if scaled else (0.0, 1.0)
        pad = 0.04 * (hi - lo) if hi > lo else 0.05 * max(abs(hi), 1.0)
        edge = hi + 2 * pad  # where a point off the scale is drawn
        drawn: set[tuple[str, str, float]] = set()  # a baseline shared by rows: drawn once
        for i, (row, line) in enumerate(lines):
            colour = f"C{i % 10}"
            label = ", ".join([row["budget"], *(f"{k}={row[k]}" for k in options["rows"]
                                                if k != "method"),
                               *([row["placement"]] if len(options["placements"]) > 1
                                 else [])])
            # a baseline has no DP setting: its label names the rest of the row
            base_label = ", ".join([row["budget"], *(f"{k}={row[k]}" for k in options["rows"]
                                                     if k != "method" and not k.startswith("dp_"))])
            if line["points"]:
                xs, ys, los, his = zip(*line["points"])
                shown = [y if y <= limit else edge for y in ys]
                ax.plot(xs, shown, marker="o", color=colour,
                        label=f"DP statistics, {label}"
                        + (f" (median of {draws} draws, bars: their range)" if draws > 1
                           else ""))
                if draws > 1:
                    for x, y, lo_, hi_ in zip(xs, ys, los, his):
                        if y <= limit:
                            ax.plot([x, x], [lo_, min(hi_, edge)], color=colour,
                                    linewidth=1.5, alpha=0.7)
                for x, y in zip(xs, ys):
                    if y > limit:
                        ax.plot([x], [edge], marker="^", markersize=10, color=colour)
                        ax.annotate(f"{y:,.0f}" if y >= 1000 else f"{y:.3g}", (x, edge),
                                    textcoords="offset points",
                                    xytext=(6, -12), fontsize=7, color=colour)
            for ref, y in line["refs"].items():
                if ref == "dense":
                    dense = y
                    continue
                if ref == "no DP" and "centralized" in line["refs"]:
                    continue  # the same windows pooled: on the centralized line (table)
                if (ref, base_label, y) in drawn:
                    continue
                drawn.add((ref, base_label, y))
                ax.axhline(y, color=colour, linestyle=styles[ref], linewidth=1, alpha=0.8,
                           label=f"{_BASELINE_LABEL.get(ref, ref)}, {base_label}")
        off_scale = any(y > limit for y in points_all)
        ax.set_ylim(lo - pad, (edge if off_scale else hi) + pad)
        if dense is not None:
            below = dense < lo - pad
            ax.axhline(dense, color="grey", linestyle="-", linewidth=1,
                       label=(f"dense ({dense:.4g}, below the axis)" if below else "dense"))
        ax.set_xscale("log", base=2)
        if eps:
            ax.set_xticks(eps, [f"{e:g}" for e in eps])
        ax.set_xlabel("epsilon per site (log scale)")
        ax.set_ylabel("perplexity")
        ax.set_title(f"{method} (a triangle: off the scale, labelled with its value)",
                     fontsize=9)
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    width = 75 * len(panels)
    fig.suptitle("\n".join(textwrap.wrap(study.title, width)), fontsize=10)
    fig.tight_layout()
    path = out / f"dp-{study.name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
