"""The leakage study's membership attackers on a DP statistics-mode release, per epsilon
(``[study.NAME] kind = "dp-leakage"`` of ``fedcompress bench CONFIG.toml``; e.g.
``simulations/bench_dp_leakage.toml``).

One cell is one setting of :class:`DpLeakageConfig` (a list is swept, e.g. ``epsilon = [1, 2,
4, 8, 16, 0]``, ``method = ["wanda", "sparsegpt"]``). The pure scores and ceilings are
:mod:`fedcompress.privacy.dp_attacks`'s; this module runs the release and feeds them.

What is run: the model is cut to its first ``layers`` decoder layers (layer ``l``'s release
depends only on layers ``< l``), so the run's ``L = layers`` releases are the ones measured
and the whole epsilon is spent on them (the attacks see the entire run: a conservative
setting; a full model spends the same epsilon over more layers, each noisier). The
calibration stream is cut into non-overlapping ``seqlen``-token chunks and, for each trial
anew (seed ``seed * 1000 + trial``), :func:`fedcompress.privacy.leakage.make_plan` draws
disjoint windows: ``sites`` sites with
``samples_per_client`` windows each (the last one is the site's *target*), ``replacements``
fresh windows per site, ``samples_per_client - 1`` public reference windows and
``nonmembers`` fresh candidates (a new draw per trial: the neighbour AUC relies on the member
and the non-members being exchangeable, which holds over draws, not within one). Each of
``trials`` runs is
:func:`fedcompress.methods.fedprllm.stats.stats_prune` (statistics mode, sites one after
another, its noise seeded with the trial's seed) keeping what the server saw
(``keep_release``): per layer the noisy sum before post-processing, and the global masks.

What the attacker computes: every window's statistics of layer ``l`` through the model pruned
with the RELEASED masks (and SparseGPT's released weights) of layers ``< l``
(:func:`fedcompress.methods.fedprllm.federated.advance_to_layer`, the sites' own walker), each
window clipped alone by :func:`fedcompress.privacy.dp_stats.clipped_layer_stats` at the run's
bounds (the sites' clipping); the noise std of each block is the plan's (the distributed
placement: all sites honest, ``sites / t`` shares of the target variance, as the server's
post-processing assumes). Noise-free masks of "rest + c" and "R (+ c)" come from the server's
own per-layer step (:func:`fedcompress.methods.fedprllm.stats.prune_layer`).

Per cell, for each attacker (knows-the-rest: the target's site, candidates its target and its
replacements, knowing every other window of the release; reference: the release as one group,
members every site's target, non-members the fresh candidates) and view (``sum``, ``mask``):
AUC within a group, pooled AUC, the neighbour AUC, top-1 and chance
(:func:`fedcompress.privacy.dp_attacks.summarize`), the ceilings
(:func:`fedcompress.privacy.dp_attacks.ceilings` at the accountant's spent epsilon), and the
knows-the-rest pairs' effective ``mu`` (``sqrt(sum ||c_t - c_o||^2 / s^2)`` over blocks and
layers: how far the real windows are from the worst case the accountant pays for). With
``epsilon = 0`` (no DP) the release is the plain, unclipped sum: the knows-the-rest attacker's
member scores the maximum.

Not measured: the perplexity of the DP model (issue 30's bench study), a full-depth run's
releases beyond ``layers``, attackers that know less than the rest but more than public text,
and the distributed placement against dishonest sites (all sites add their share here).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from fedcompress.config import Settings, setting
from fedcompress.privacy import dp_attacks as da
from fedcompress.privacy import leakage as lk

if TYPE_CHECKING:
    from fedcompress.bench.cells import Cell, Study
    from fedcompress.bench.labels import StudyTable
    from fedcompress.bench.sweep import BenchRunner

logger = logging.getLogger(__name__)

__all__ = ["ATTACKS", "DpLeakageConfig", "measure", "plan_study", "record_cell", "run_cells",
           "study_tables"]

#: The cell kind of the bench.
KIND = "dp-leakage"
#: (attacker, view) of every measured attack, by its key in a result.
ATTACKS = {"knows_rest_sum": ("knows-the-rest", "sum"),
           "knows_rest_mask": ("knows-the-rest", "mask"),
           "reference_sum": ("reference", "sum"),
           "reference_mask": ("reference", "mask")}


@dataclass(frozen=True)
class DpLeakageConfig(Settings):
    """One DP leakage measurement (one epsilon; the bench sweeps lists)."""

    label: ClassVar[str] = "dp-leakage"

    model: str = setting("smollm2-135m", "Model spec (embedded name, local directory, ...).")
    dtype: str = setting("float32", "Model dtype.", choices=("float32", "bfloat16", "float16"))
    method: str = setting("wanda", "Statistics of the release.", choices=("wanda", "sparsegpt"))
    sparsity: float = setting(0.5, "Sparsity of the global masks.", gt=0.0, lt=1.0)
    calib_text: str = setting("wiki", "Calibration corpus: bundled name or a file.")
    calib_split: str = setting("train", "Split of the calibration corpus.")
    seqlen: int = setting(128, "Tokens per window.", ge=2)
    sites: int = setting(8, "Sites of the release.", ge=2)
    samples_per_client: int = setting(4, "Windows per site (the last is its target).", ge=2)
    replacements: int = setting(2, "Fresh non-member candidates per target.", ge=1)
    nonmembers: int = setting(8, "Fresh non-member candidates of the reference attacker.",
                              ge=1)
    layers: int = setting(2, "The first N decoder layers (the run's releases).", ge=1)
    epsilon: float = setting(8.0, "Epsilon of the run per site (0: no DP).", ge=0.0)
    delta: float = setting(1e-5, "Delta of the run per site.", gt=0.0, lt=1.0)
    placement: str = setting("central", "Where the noise is added.",
                             choices=("central", "distributed"))
    trials: int = setting(2, "Runs, each with its own noise draw (dp_seed).", ge=1)
    clip_quantile: float = setting(0.95, "Quantile of the public per-window norms (clip "
                                   "bounds).", gt=0.0, le=1.0)
    public_windows: int = setting(32, "Public windows the clip bounds are measured on.", ge=1)
    normalize: str = setting("public", "Input normalization before clipping (public: by the "
                             "public scales; none: raw statistics).", choices=("public", "none"))
    batch_size: int = setting(4, "Windows per forward.", ge=1)
    seed: int = setting(0, "Seed of the windows' draw (and of the noise, per trial).", ge=0)
    mask_view: bool = setting(True, "Also attack the released mask: one noise-free pruning of "
                              "each layer per candidate hypothesis (SparseGPT's take seconds "
                              "each).")

    def validate(self) -> None:
        if self.epsilon == 0 and self.placement != "central":
            raise self.invalid("placement", "central with epsilon 0 (no DP: no noise to place)")


# ------------------------------------------------------------------------------------------
# Statistics as the attacks read them
# ------------------------------------------------------------------------------------------

def _vector(st: Any, hessian: bool) -> torch.Tensor:
    if not hessian:
        return st.sq_sum.double().reshape(-1).clone()
    n = st.in_features
    rows, cols = torch.triu_indices(n, n)
    return st.hessian_sum.double()[rows, cols].clone()


def _blocks(stats: Mapping[str, Any], owners: Sequence[str], hessian: bool) -> dict:
    return {k: _vector(stats[k], hessian) for k in owners}


def _add(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], sign: float = 1.0
         ) -> dict[str, torch.Tensor]:
    return {k: a[k] + sign * b[k] for k in a}


def _layer_stats(blocks: Mapping[str, torch.Tensor], owners: Mapping[str, str],
                 dims: Mapping[str, int], hessian: bool, tokens: int) -> dict[str, Any]:
    """``{linear: LayerStats}`` of summed block vectors (sharers hold their owner's object)."""
    from fedcompress.pruning.walker import LayerStats

    made: dict[str, LayerStats] = {}
    for owner, vec in blocks.items():
        st = LayerStats(dims[owner], hessian=hessian)
        if hessian:
            n = dims[owner]
            rows, cols = torch.triu_indices(n, n)
            full = torch.zeros(n, n, dtype=torch.float64)
            full[rows, cols] = vec
            full[cols, rows] = vec
            st.hessian_sum = full.to(st.hessian_sum.dtype)
            st.sq_sum = torch.diagonal(full).clone() / 2
        else:
            st.sq_sum = vec.clone()
        st.tokens = tokens
        made[owner] = st
    return {name: made[owner] for name, owner in owners.items()}


@torch.no_grad()
def window_blocks(layer: torch.nn.Module, inputs: Any, hessian: bool,
                  bounds: Mapping[str, float], batch_size: int = 8,
                  scales: Mapping[str, torch.Tensor] | None = None
                  ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Every window's own clipped statistics of ``layer``, as the sites clip them
    (:func:`fedcompress.privacy.dp_stats.window_sums`, each window's block norms scaled by
    :func:`fedcompress.privacy.dp_stats.clip_factors`, what
    :func:`~fedcompress.privacy.dp_stats.clipped_layer_stats` sums): ``(window index,
    {block: flat vector})`` (square sums; the Hessian's upper triangle with ``hessian``). A
    bound of ``inf`` clips nothing (no DP). ``scales``: the plan's public scales (the sites
    normalize their inputs by them before clipping; the release is in those units)."""
    from fedcompress.privacy import dp_stats as dps

    for start, sq, hs in dps.window_sums(layer, inputs, hessian, batch_size, scales):
        factors = dps.clip_factors(dps._block_norms(sq, hs, hessian), bounds)
        for b in range(next(iter(sq.values())).shape[0]):
            out = {}
            for k, f in factors.items():
                if hessian:
                    n = hs[k].shape[-1]
                    rows, cols = torch.triu_indices(n, n)
                    out[k] = (f[b] * hs[k][b])[rows, cols]
                else:
                    out[k] = f[b] * sq[k][b]
            yield start + b, out


def _hamming_bits(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> int:
    return int(sum(int(torch.count_nonzero(a[k].bool() ^ b[k].bool())) for k in a))


# ------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------

def _windows(tokens: torch.Tensor, config: DpLeakageConfig, seed: int) -> dict[str, Any]:
    """One trial's disjoint windows (:func:`fedcompress.privacy.leakage.make_plan` with
    ``seed``): the sites' windows, and every window the attacker scores in one tensor with the
    indices of each role in it."""
    S, W, R = config.sites, config.samples_per_client, config.replacements
    available = tokens.numel() // config.seqlen
    plan = lk.make_plan(available, S, W, R, 0, config.nonmembers, seed)
    chunks = [c for d in plan.clients for c in d]
    targets = [i * W + W - 1 for i in range(S)]
    reps = [[len(chunks) + i * R + r for r in range(R)] for i in range(S)]
    chunks += [c for rs in plan.replacements for c in rs]
    ref = list(range(len(chunks), len(chunks) + W - 1))
    chunks += plan.reference
    fresh = list(range(len(chunks), len(chunks) + config.nonmembers))
    chunks += plan.nonmembers
    return {"plan": plan, "sites": [lk.disjoint_windows(tokens, config.seqlen, d)
                                    for d in plan.clients],
            "all": lk.disjoint_windows(tokens, config.seqlen, chunks), "targets": targets,
            "reps": reps, "ref": ref, "fresh": fresh,
            "kept": sorted(set(targets) | {j for rs in reps for j in rs} | set(ref) | set(fresh))}


def measure(config: DpLeakageConfig, device: str | None = None,
            timings: dict[str, float] | None = None) -> dict:
    """Every number of one cell (module docstring); the seconds of the phases ``setup``,
    ``release`` (the runs) and ``attack`` are added to ``timings``."""
    from fedcompress.data.calibration import tokenize_corpus
    from fedcompress.data.corpora import load_corpus
    from fedcompress.methods.fedprllm import dp as dpm
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig
    from fedcompress.methods.fedprllm.federated import advance_to_layer
    from fedcompress.methods.fedprllm.stats import prune_layer, stats_prune
    from fedcompress.models import (
        ModelAdapter,
        load_model,
        num_layers,
        remove_layers,
        weight_matrix,
    )
    from fedcompress.privacy import dp_stats as dps

    timings = {} if timings is None else timings
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    lm = load_model(config.model, device=device, dtype=config.dtype)
    model = lm.model
    total_layers = num_layers(model)
    if config.layers > total_layers:
        raise ValueError(f"layers={config.layers}: the model has {total_layers} decoder layers")
    if config.layers < total_layers:
        remove_layers(model, list(range(config.layers, total_layers)))
    L = config.layers
    S, W, R = config.sites, config.samples_per_client, config.replacements
    tokens = tokenize_corpus(lm.tokenizer, load_corpus(config.calib_text, config.calib_split))
    available = tokens.numel() // config.seqlen
    dp = config.epsilon > 0
    fed = FedPrLLMConfig(model=config.model, dtype=config.dtype, method=config.method,
                         sparsity=config.sparsity, clients=S, samples_per_client=W,
                         seqlen=config.seqlen, batch_size=config.batch_size, aggregate="stats",
                         dp_epsilon=config.epsilon, dp_delta=config.delta,
                         dp_placement=config.placement,
                         secagg=dp and config.placement == "distributed",
                         dp_clip_quantile=config.clip_quantile,
                         dp_public_windows=config.public_windows,
                         dp_normalize=config.normalize,
                         dp_prior="shrink" if config.normalize == "public" else "none")
    prune = fed.prune
    hessian = prune.needs_hessian
    the_plan = None
    if dp:
        request = dpm.DpRequest.from_config(fed, L, S)
        calib = dpm.public_calibration(model, lm.tokenizer, request, hessian,
                                       config.batch_size)
        the_plan = dpm.plan(request, calib, dpm.block_dims(model, calib.bounds, hessian))
    else:
        calib = None
    timings["setup"] = timings.get("setup", 0.0) + time.perf_counter() - start

    groups: dict[str, tuple[list[list[float]], list[list[bool]]]] = {k: ([], [])
                                                                      for k in ATTACKS}
    release_of: dict[str, list[int]] = {k: [] for k in ATTACKS}  # the trial of each group
    pair_mu: list[float] = []
    trials_out = []
    adapter = ModelAdapter(model)
    for trial in range(config.trials):
        t0 = time.perf_counter()
        trial_seed = config.seed * 1000 + trial
        drawn = _windows(tokens, config, trial_seed)
        all_windows, targets, reps = drawn["all"], drawn["targets"], drawn["reps"]
        ref, fresh, kept = drawn["ref"], drawn["fresh"], set(drawn["kept"])
        dp_seed = trial_seed if dp else None
        run = stats_prune(model, drawn["sites"], fed, tokenizer=lm.tokenizer, dp_seed=dp_seed,
                          keep_release=True, dp_calibration=calib)
        if dp and not math.isclose(run.dp["sigma"], the_plan.sigma):
            raise RuntimeError(f"the run's sigma {run.dp['sigma']} is not the attacker's "
                               f"{the_plan.sigma}: the plans differ")
        timings["release"] = timings.get("release", 0.0) + time.perf_counter() - t0
        t0 = time.perf_counter()
        kr_sum = np.zeros((S, 1 + R))
        kr_bits = np.zeros((S, 1 + R))
        ref_sum = np.zeros(S + config.nonmembers)
        ref_bits = np.zeros(S + config.nonmembers)
        ref_base_bits = 0.0
        pair_sq = np.zeros((S, R))
        total_bits = 0
        hidden = kwargs = None
        for layer in range(L):
            inputs = advance_to_layer(model, all_windows, layer, hidden,
                                      run.masks[layer - 1] if layer else None, kwargs,
                                      config.batch_size,
                                      run.weights[layer - 1] if layer else None)
            hidden, kwargs = inputs.hidden, inputs.layer_kwargs
            release_stats = run.released[layer]
            owners_list = sorted(release_stats)
            if the_plan is not None:
                layer_bounds = the_plan.bounds[layer]
                layer_scales = the_plan.layer_scales(layer)
                std = the_plan.noise_std(layer)
                if the_plan.placement == "distributed":
                    std = {k: s * math.sqrt(S / the_plan.threshold) for k, s in std.items()}
            else:
                layer_bounds = dict.fromkeys(owners_list, math.inf)
                layer_scales = None
                std = dict.fromkeys(owners_list, 1.0)
            release = _blocks(release_stats, owners_list, hessian)
            total: dict[str, torch.Tensor] | None = None
            per: dict[int, dict[str, torch.Tensor]] = {}
            with adapter.onloaded(layer) as module:
                owners = dps.layer_blocks(module, inputs)
                dims = {k: int(weight_matrix(m).shape[1]) for k, m in
                        ModelAdapter.linear_layers(module).items() if k in owners_list}
                for w, vec in window_blocks(module, inputs, hessian, layer_bounds,
                                            config.batch_size, layer_scales):
                    if w < S * W:
                        total = vec if total is None else _add(total, vec)
                    if w in kept:
                        per[w] = vec
            assert total is not None
            # knows-the-rest, sum
            for i, t in enumerate(targets):
                rest = _add(total, per[t], -1.0)
                cands = [per[t]] + [per[j] for j in reps[i]]
                kr_sum[i] += da.knows_rest_sum_scores(release, rest, cands, std)
                for r, j in enumerate(reps[i]):
                    pair_sq[i, r] += sum(float((per[t][k] - per[j][k]).pow(2).sum()) / std[k] ** 2
                                         for k in owners_list)
            # reference, sum
            ref_total = per[ref[0]]
            for j in ref[1:]:
                ref_total = _add(ref_total, per[j])
            ref_cands = [per[t] for t in targets] + [per[j] for j in fresh]
            ref_sum += da.reference_sum_scores(release, S * W, ref_total, len(ref), ref_cands,
                                               std)
            # the masks: noise-free masks of rest + c and R (+ c) against the released one
            released_mask = run.masks[layer]
            total_bits += sum(int(m.numel()) for m in released_mask.values())
            if not config.mask_view:
                del per, total
                continue

            def mask_of(blocks, windows, layer=layer, owners=owners, dims=dims,
                        scales=layer_scales):
                stats = _layer_stats(blocks, owners, dims, hessian, windows * config.seqlen)
                if scales is not None:  # as the server: back to the inputs' units
                    dps.denormalize(stats, scales, hessian)
                return prune_layer(model, layer, stats, prune)[0]

            for i, t in enumerate(targets):
                rest = _add(total, per[t], -1.0)
                for c, j in enumerate([t, *reps[i]]):
                    kr_bits[i, c] += _hamming_bits(mask_of(_add(rest, per[j]), S * W),
                                                   released_mask)
            ref_base_bits += _hamming_bits(mask_of(ref_total, len(ref)), released_mask)
            for c, vec in enumerate(ref_cands):
                ref_bits[c] += _hamming_bits(mask_of(_add(ref_total, vec), len(ref) + 1),
                                             released_mask)
            del per, total
        # the groups of candidates: per target (knows the rest), per release (reference)
        kr_members = [True] + [False] * R
        for key in ATTACKS:
            sites = S if key.startswith("knows_rest") else 1
            if config.mask_view or key.endswith("sum"):
                release_of[key] += [trial] * sites
        for i in range(S):
            groups["knows_rest_sum"][0].append(kr_sum[i].tolist())
            groups["knows_rest_sum"][1].append(kr_members)
            if config.mask_view:
                groups["knows_rest_mask"][0].append((-kr_bits[i] / total_bits).tolist())
                groups["knows_rest_mask"][1].append(kr_members)
        ref_members = [True] * S + [False] * config.nonmembers
        groups["reference_sum"][0].append(ref_sum.tolist())
        groups["reference_sum"][1].append(ref_members)
        if config.mask_view:
            groups["reference_mask"][0].append(((ref_base_bits - ref_bits) / total_bits)
                                               .tolist())
            groups["reference_mask"][1].append(ref_members)
        pair_mu += np.sqrt(pair_sq).reshape(-1).tolist()
        trials_out.append({"seed": trial_seed, "dp_seed": dp_seed, "dp": run.dp,
                           "plan": drawn["plan"].to_dict()})
        if config.mask_view:
            trials_out[-1].update(
                member_mask_distance=lk.summary((kr_bits[:, 0] / total_bits).tolist()),
                nonmember_mask_distance=lk.summary((kr_bits[:, 1:] / total_bits)
                                                   .reshape(-1).tolist()))
        timings["attack"] = timings.get("attack", 0.0) + time.perf_counter() - t0
        logger.info("dp-leakage %s eps=%g trial %d: %.1fs", config.method, config.epsilon,
                    trial, time.perf_counter() - t0)

    attacks = {k: da.summarize(*groups[k], releases=release_of[k]) for k in ATTACKS
               if groups[k][0]}
    spent = trials_out[0]["dp"].get("epsilon_spent") if dp else None
    ceilings = da.ceilings(spent, config.delta, the_plan.sigma if the_plan else None, L,
                           the_plan.mechanism if the_plan else "gaussian")
    scope = {"layers": L, "total_layers": total_layers, "releases": L,
             "windows_per_release": S * W, "available_windows": available,
             "sigma": the_plan.sigma if the_plan else None,
             "mechanism": the_plan.mechanism if the_plan else None,
             "epsilon_spent": spent}
    effective = lk.summary(pair_mu) if dp else None
    return {"config": {**config.to_dict(), **scope}, "scope": scope,
            "attacks": attacks, "ceilings": ceilings,
            "pair_mu": effective,
            "pair_mu_auc": (da.gdp_auc_ceiling(effective["mean"]) if effective else None),
            "scores": {k: groups[k][0] for k in ATTACKS}, "trials": trials_out}


# ------------------------------------------------------------------------------------------
# The bench study
# ------------------------------------------------------------------------------------------

def plan_study(name: str, base: Mapping[str, Any], table: Mapping[str, Any],
               _overrides: Mapping[str, Any] | None = None) -> Study:
    """A dp-leakage study: one cell per point of its swept settings (``[bench]`` settings of
    the same name apply too)."""
    from fedcompress.bench.cells import Study
    from fedcompress.bench.studies import check_keys, settings_cells

    names = DpLeakageConfig.names()
    check_keys(name, KIND, table, names)
    settings = {k: base[k] for k in names if k in base}
    settings.update({k: table[k] for k in names if k in table})
    swept, cells = settings_cells(name, KIND, settings, DpLeakageConfig)
    return Study(name, table.get("title", name), settings, swept, [], None, cells, kind=KIND)


def record_cell(record: Mapping[str, Any]) -> Cell:
    """The cell a stored record belongs to (settings it lacks take their default, but
    ``normalize``: a record from before it existed released raw statistics)."""
    from fedcompress.bench.studies import stored_cell

    return stored_cell(KIND, record, DpLeakageConfig, legacy={"normalize": "none"})


def run_cell(cell: Cell, device: str | None = None) -> dict:
    """Measure one cell: the whole result under ``dp_leakage``, its headline numbers as
    fields of the record."""
    config = DpLeakageConfig.from_dict(dict(cell.client))
    timings: dict[str, float] = {}
    result = measure(config, device, timings)
    a = result["attacks"]
    return {"name": f"dp-leakage {config.method} eps={config.epsilon:g} {config.placement}",
            "auc_knows_rest_sum": a["knows_rest_sum"]["auc_within"],
            "auc_knows_rest_mask": a.get("knows_rest_mask", {}).get("auc_within"),
            "auc_reference_sum": a["reference_sum"]["auc_within"],
            "auc_reference_mask": a.get("reference_mask", {}).get("auc_within"),
            "gdp_auc_ceiling": result["ceilings"]["gdp_auc"],
            "dp_auc_ceiling": result["ceilings"]["dp_auc"],
            "phase_seconds": timings, "dp_leakage": result}


def run_cells(runner: BenchRunner, cells: list[Cell]) -> None:
    for cell in cells:
        runner.run_cell(cell, lambda cell=cell: run_cell(cell, runner.device))


def _num(x: Any) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _se(value: Any, se: Any) -> str:
    return _num(value) if se is None else f"{_num(value)} ± {se:.3f}"


def study_tables(study: Study, results: Mapping[str, dict]) -> list[StudyTable]:
    """One table: a row per cell and attack (attacker, view), with AUC within / pooled /
    neighbour, top-1 (chance) and the ceilings."""
    from fedcompress.bench.labels import StudyTable, format_value

    header = ["method", "placement", "epsilon", "attacker", "view", "AUC within",
              "AUC pooled", "neighbour AUC", "top-1 (chance)", "GDP ceiling AUC / choice",
              "(eps, delta) ceiling AUC / choice"]
    body = []
    for cell in study.cells:
        s = dict(cell.client)
        eps = "none" if not s["epsilon"] else f"{s['epsilon']:g}"
        record = results.get(cell.id)
        if record is None or record.get("status") != "ok":
            state = "pending" if record is None else "failed"
            body.append([s["method"], s["placement"], eps, state, "", "", "", "", "", "", ""])
            continue
        r = record["dp_leakage"]
        c = r["ceilings"]
        gdp = ("n/a (Skellam)" if c["gdp_auc"] is None
               else f"{_num(c['gdp_auc'])} / {_num(c['gdp_choice'])}")
        dpc = f"{_num(c['dp_auc'])} / {_num(c['dp_choice'])}"
        for key, (who, view) in ATTACKS.items():
            if key not in r["attacks"]:
                continue  # mask_view off
            m = r["attacks"][key]
            body.append([s["method"], s["placement"], eps, who, view,
                         _se(m["auc_within"], m.get("auc_within_se")),
                         _num(m["auc_pooled"]),
                         _se(m["neighbour_auc"], m.get("neighbour_auc_se")),
                         f"{_num(m['top1'])} ({_num(m['chance_top1'])})", gdp, dpc])
    settings = dict(study.cells[0].client) if study.cells else study.settings
    fixed = {k: v for k, v in settings.items() if k not in study.swept}
    note = ("Membership of one calibration window in a DP statistics release (the noisy sum "
            "before post-processing, and the global mask); knows-the-rest: the DP neighbour "
            "(every other window known); reference: public windows only. AUC within = the "
            "forced choice between the member and a non-member on one release (ceiling: "
            "'choice'); neighbour AUC = the ROC AUC of the test between neighbouring datasets "
            "(ceiling: 'AUC'); ± a bootstrap standard error over the releases (trials). "
            "Fixed: " + ", ".join(f"{k}={format_value(v)}"
                                                    for k, v in sorted(fixed.items())) + ".")
    return [StudyTable("Membership attacks on the DP release", note, header, body,
                       first_value=5, best=None)]
