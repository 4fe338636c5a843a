"""FedPrLLM ServerApp: the whole pipeline of one run.

Broadcast the pruning config, collect and validate the clients' masks (one round, or one round
per layer), vote, prune the global model, evaluate it next to the dense model and the baselines,
save the pruned model in its smallest faithful dtype (``save_dtype``), and write
``report.json``/``report.md``.

The federated part (:func:`federate`: start-up, OWL, the strategy's rounds, their cost) is
shared with the bench, which runs it on an in-process grid (:mod:`server.bench`).

``app`` reads its settings from the Flower run config (``flwr run . --run-config ...``);
:func:`make_app` builds an app around settings given in Python (the ``fedcompress prune`` CLI).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# transformers at module level, before the library imports it: see server/app.py.
import transformers  # noqa: F401
from flwr.app import ArrayRecord
from flwr.serverapp import Grid, ServerApp

from fedcompress.methods.fedprllm import METHOD
from fedcompress.methods.fedprllm.config import EvalConfig, FedPrLLMConfig, RunSettings
from fedcompress.methods.fedprllm.experiment import Experiment, prepare_experiment
from fedcompress.methods.fedprllm.federated import (
    ServerConfig,
    expected_shapes,
    owl_plan_from_sites,
    public_reference_wire,
)
from fedcompress.pruning.local import check_global_ratio
from fedcompress.report import RunReport
from server.common import (
    make_server_app,
    quantized_save_dtype,
    run_with_report,
    save_run_model,
    startup_section,
)
from strategies.fedprllm import FedPrLLM, make_strategy

logger = logging.getLogger(__name__)


def split_settings(settings: dict) -> tuple[FedPrLLMConfig, EvalConfig, RunSettings]:
    """Flat settings (CLI or run config, keys with ``-`` or ``_``) -> the three settings."""
    return METHOD.parse(settings)  # type: ignore[return-value]


def check_settings(settings: dict) -> None:
    """Every setting valid, before any model is loaded or any engine started."""
    config, evals, server = split_settings(settings)
    server_variants(config, server.variants)
    if server.resume and config.mode != "iterative" and config.aggregate != "stats":
        raise ValueError("resume=True is invalid: expected mode iterative or aggregate stats "
                         "(a one-shot vote has one round: run it again)")
    _check_quant(config, server)
    evals.load_tasks()  # every zero-shot task exists and loads (offline: bundled or cached)


def _check_quant(config: FedPrLLMConfig, server: RunSettings) -> None:
    """The rtn baseline needs a quantizing run; a quantized model's save dtype must be its
    scales' (:func:`~server.common.quantized_save_dtype`)."""
    if "rtn" in server.baseline_list() and config.quant_config is None:
        raise ValueError("baseline rtn without --quant: expected a quantizing run (rtn rounds "
                         "its weights to nearest in place of GPTQ)")
    if config.quant_config is not None:
        quantized_save_dtype(server.save_dtype, config.quant_config)


def server_variants(config: FedPrLLMConfig, which: str) -> list[ServerConfig]:
    """``configured``: the run's server variant; ``all``: every group x scaling (one-shot)."""
    if config.aggregate != "votes" and which != "configured":
        raise ValueError(f"variants {which!r} with aggregate {config.aggregate}: expected "
                         "'configured' (the server variants are ways of voting)")
    if which == "configured" or config.mode == "iterative" or config.aggregate != "votes":
        return [config.server]
    if which != "all":
        raise ValueError(f"variants {which!r}: expected 'configured' or 'all'")
    return [replace(config.server, group=group, scale=scale)
            for group in ("layer", "row", "column") for scale in (False, True)]


def run(grid: Grid, settings: dict) -> RunReport:
    return run_with_report(METHOD, grid, settings, _run)


def _run(grid: Grid, config: FedPrLLMConfig, eval_config: EvalConfig, server: RunSettings,
         report: RunReport) -> None:
    out = Path(server.out)
    _check_quant(config, server)  # before the model is loaded (flwr run skips check_settings)
    with report.phase("setup"):
        device = None if server.device in ("", "auto") else server.device
        exp = prepare_experiment(config, eval_config, device=device)
    report.extra["model"] = {"spec": exp.loaded.spec, **exp.loaded.info}
    baselines = server.baseline_list()
    quant = config.quant_config
    if "dense" in baselines:
        with report.phase("eval"):
            report.add_result(exp.evaluate("dense", exp.model))

    per_layer = config.mode == "iterative" or config.aggregate == "stats"
    checkpoint = out / "checkpoint" if per_layer else None
    if server.resume and checkpoint is None:
        raise ValueError("resume=True is invalid: expected mode iterative (a one-shot run has "
                         "one round: run it again)")
    federated = federate(grid, config, exp, report, server.timeout, checkpoint, server.resume)
    strategy, comm = federated.strategy, federated.comm

    for variant in server_variants(config, server.variants):
        model = exp.fresh_copy()
        with report.phase("aggregate"):
            strategy.prune(model, variant)
        name = result_name(config, variant)
        if quant is not None:  # e.g. fedprllm-stats-row+w4a16-gptq
            name += f"+{quant.scheme}-{quant.method}"
        with report.phase("eval"):
            report.add_result(exp.evaluate(
                name, model, **comm,
                server_group=variant.group, scale=variant.scale))
        if server.save_model and variant == config.server:
            with report.phase("save"):
                quantized = None
                if quant is not None:
                    from fedcompress.quant.compressed_tensors import packed_layers

                    quantized = (packed_layers(model, strategy.quantized),  # type: ignore
                                 quant)
                save_run_model(report, model, out / "model", exp.tokenizer, exp.loaded,
                               exp.model, server.save_dtype, config.dtype, quantized)
        del model
    if strategy.defence:
        report.extra["defence_outcome"] = strategy.defence

    if "centralized" in baselines:
        with report.phase("centralized"):
            model, seconds = exp.centralized()
        with report.phase("eval"):
            report.add_result(exp.evaluate("centralized", model, prune_seconds=seconds))
    if "rtn" in baselines:
        with report.phase("rtn"):
            model, seconds = exp.round_to_nearest()
        with report.phase("eval"):
            report.add_result(exp.evaluate(f"rtn-{config.quant}", model, prune_seconds=seconds))
    if "local-only" in baselines:
        with report.phase("local_only"):
            model, seconds = exp.local_only(0)
        with report.phase("eval"):
            report.add_result(exp.evaluate("local-only", model, prune_seconds=seconds,
                                           client=0))
    if exp.plans:
        report.extra.setdefault("sparsity_profile", {})["baselines"] = exp.plans


def make_app(settings: dict | None = None) -> ServerApp:
    """A ServerApp running FedPrLLM with ``settings`` (the CLI), or with the Flower run
    config's ``fedprllm.*`` settings."""
    return make_server_app(METHOD, run, settings)


def result_name(config: FedPrLLMConfig, variant: ServerConfig) -> str:
    """The name of a run's result for server ``variant`` (``fedprllm-oneshot-row``,
    ``fedprllm-stats-row``, ``fedspallm-layer``, ...), as reports and the bench read it."""
    return (f"fedprllm-stats-{config.local_group}" if config.aggregate == "stats"
            else f"fedspallm-{variant.group}" if config.aggregate == "fedspallm"
            else f"fedprllm-{config.mode}-{variant.label}")


@dataclass
class Federated:
    """A run's finished rounds: the strategy (its vote or summed statistics, ready to prune
    copies of the global model, :meth:`~strategies.fedprllm.FedPrLLM.prune`) and what the
    rounds cost (``comm``: rounds, bytes per client, seconds, as the report's results carry
    them; ``reference_seconds``: the public reference of the compressed wire format)."""

    strategy: FedPrLLM
    comm: dict[str, Any]
    reference_seconds: float = 0.0


def federate(grid: Grid, config: FedPrLLMConfig, exp: Experiment, report: RunReport,
             timeout: float, checkpoint: Path | None = None, resume: bool = False,
             spill: Path | None = None, observe: Callable[[FedPrLLM], None] | None = None
             ) -> Federated:
    """The federated part of a FedPrLLM run, on any Grid (the Simulation Engine's, a
    deployment's, the bench's in-process one): the public wire reference, the strategy of
    ``config`` (:func:`~strategies.fedprllm.make_strategy`), the sites' start-up, OWL's
    outlier round, the rounds (resumed from ``checkpoint`` when ``resume``); what they cost
    and what the sites said go to ``report``. ``spill``: a folder for FedSpaLLM's sum;
    ``observe``: called with the strategy before its first message (the bench times its
    rounds)."""
    if config.layer_sparsity:
        check_global_ratio(config.prune.plan, exp.model)
    start = time.perf_counter()
    with report.phase("wire_reference"):
        reference = public_reference_wire(exp.model, exp.tokenizer, config)
    reference_seconds = time.perf_counter() - start
    strategy = make_strategy(config, exp.model, reference, checkpoint, exp.tokenizer, spill)
    if observe is not None:
        observe(strategy)
    with report.phase("engine_startup"):
        startup = strategy.warmup(grid, timeout=timeout)
    if config.sparsity_profile == "owl" and not config.layer_sparsity:
        with report.phase("owl_outliers"):
            sites = strategy.collect_outliers(grid, timeout=timeout)
            plan = owl_plan_from_sites(sites, config, exp.model)
            strategy.set_plan(plan.to_text())
        report.extra["sparsity_profile"] = {"rule": "owl", "m": config.owl_m,
                                            "lambda": config.owl_lambda,
                                            "sites_outlier_ratios": sites,
                                            "plan": plan.to_dict()}
    elif config.layer_sparsity:
        report.extra["sparsity_profile"] = {"rule": "given", "plan": config.prune.plan.to_dict()}
    if resume:  # after the OWL plan, which the checkpoint's settings carry
        report.extra["resumed_layers"] = strategy.resume(checkpoint)  # type: ignore
    start = time.perf_counter()
    with report.phase("federated_pruning"):
        strategy.start(grid, ArrayRecord(), num_rounds=strategy.num_rounds, timeout=timeout)
    fed_seconds = time.perf_counter() - start
    outcome = strategy.outcome
    client_seconds = [m["seconds"] for m in outcome.client_metrics]
    # Measured bytes of the valid replies (all rounds), per client.
    senders = {m["node"] for m in outcome.client_metrics}
    up = sum(int(m.get("bytes_up", 0)) for m in outcome.client_metrics) // max(len(senders), 1)
    comm = {"rounds": strategy.num_rounds, "clients": config.clients, "wire": config.wire,
            "bits_per_weight_up": 8 * up / max(sum(
                math.prod(shape) for shape in expected_shapes(exp.model).values()), 1),
            "valid_clients": config.clients - len({r["node"] for r in outcome.rejected}),
            "bytes_up_per_client": up,
            "bytes_down_per_client": outcome.bytes_down // max(config.clients, 1),
            "federated_seconds": fed_seconds, "startup_seconds": startup,
            "client_seconds_mean": sum(client_seconds) / max(len(client_seconds), 1)}
    secagg = getattr(strategy, "secagg", None)
    if secagg:  # every stage's bytes, not only the masked votes
        stages = [secagg[k] for k in ("keys", "share", "masked", "confirm", "unmask")
                  if k in secagg]
        sites = max(int(secagg["sum"]["sites"]), 1)
        comm["bytes_up_per_client"] = sum(int(st["bytes_up"]) for st in stages) // sites
        comm["bytes_down_per_client"] = sum(int(st["bytes_down"]) for st in stages) // sites
        comm["bits_per_weight_up"] = 8 * comm["bytes_up_per_client"] / max(sum(
            math.prod(shape) for shape in expected_shapes(exp.model).values()), 1)
        comm["rounds"] = len(stages)
        comm["valid_clients"] = sites
        report.extra["secagg"] = secagg
        summary = secagg["sum"]
        report.sections.append(("Secure aggregation", (
            f"SecAgg+ over {summary['sites']} sites, threshold {summary['threshold']}, "
            f"{summary['votes']} vote(s). "
            + ("The sites signed their keys with their identity keys and confirmed the "
               "survivor set before unmasking (consistency round): the sum is protected "
               "against a malicious server with up to threshold - 1 colluding sites."
               if summary.get("authenticated") else
               "**Unauthenticated** (simulation without secagg-key/secagg-peers): unsigned "
               "keys and no consistency round, so only an honest-but-curious server is "
               "covered."))))
    if config.aggregate == "fedspallm":  # the server's public layer assignment, per node
        report.extra["fedspallm_layers"] = {str(node): layers for node, layers
                                            in getattr(strategy, "node_layers", {}).items()}
    if config.aggregate == "stats":
        report.extra["stats_layers"] = {str(k): v for k, v in
                                        getattr(strategy, "layer_cost", {}).items()}
    if getattr(strategy, "resynced", None):
        report.extra["resynced"] = {str(k): v for k, v in strategy.resynced.items()}
    if getattr(strategy, "dp_plan", None) is not None:
        from fedcompress.methods.fedprllm.dp import describe
        from fedcompress.methods.fedprllm.dp import report as dp_report

        last = {m.get("node"): float(m["ledger_run_epsilon"]) for m in outcome.client_metrics
                if m.get("ledger_dp") == 1 and "ledger_run_epsilon" in m}  # each site's last
        report.extra["dp"] = dp_report(strategy.dp_plan, list(last.values()))
        report.extra["dp_noise"] = describe(strategy.dp_plan)
    report.extra["rejected"] = outcome.rejected
    report.extra["client_startup_seconds"] = outcome.startup_seconds
    report.extra["client_startup"] = outcome.startup_split()
    if section := startup_section(report.extra["client_startup"]):
        report.sections.append(section)
    report.extra["clients"] = outcome.client_metrics
    return Federated(strategy, comm, reference_seconds)
