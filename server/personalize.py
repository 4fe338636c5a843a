"""Federated personalized pruning's ServerApp: the whole pipeline of one run.

Load the global model (the same spec every site loads), ask the sites for their unit classes,
count them into the global plan (Eq. 4, rescaled to ``p``), collect and sum the sites' masks at
it, send each site its plan and the shared masks, collect every site's held-out perplexity of
its personalized model and of the baselines, and write ``report.json``/``report.md`` (one row
per site) with a plot of how often each unit falls in each class across sites. With ``tasks``,
the server scores the global models it holds on zero-shot tasks (one record each: the shared
vote at the global plan, the uniform FedPrLLM vote and the dense model when those baselines are
asked for); the sites' personalized models never leave the sites and are not scored on them.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

# transformers at module level, before the library imports it: see server/app.py.
import transformers  # noqa: F401
from flwr.serverapp import Grid, ServerApp

from fedcompress.methods import personalize as pz
from fedcompress.methods.evaluation import TaskEvalSettings, task_fields
from fedcompress.models import load_model
from fedcompress.pruning.local import sparsity_report
from fedcompress.report import RunReport
from server.common import make_server_app, run_with_report
from strategies.personalize import PersonalizeServer

logger = logging.getLogger(__name__)


def check_settings(settings: dict) -> None:
    """Every setting valid and the data there, before any model is loaded or engine started."""
    config, evals, _ = pz.METHOD.parse(settings)
    pz.check_corpora(config)  # the sites' corpora load (offline: bundled or cached)
    evals.load_tasks()  # every zero-shot task exists and loads (offline: bundled or cached)


def run(grid: Grid, settings: dict) -> RunReport:
    return run_with_report(pz.METHOD, grid, settings, _run)


def _run(grid: Grid, config: pz.PersonalizeConfig, evals: TaskEvalSettings,
         server: pz.RunSettings, report: RunReport) -> None:
    out = Path(server.out)
    baselines = server.baseline_list()
    with report.phase("setup"):
        tasks = evals.load_tasks()  # before the model: a name that cannot load fails at once
        device = None if server.device in ("", "auto") else server.device
        loaded = load_model(config.model, device=device, dtype=config.dtype)
    report.extra["model"] = {"spec": loaded.spec, **loaded.info}
    strategy = PersonalizeServer(config, loaded.model)
    with report.phase("classify"):
        sites = strategy.collect_classes(grid, server.timeout)
        counts = pz.global_classes([c.classes for c in sites.values()])
        plan = pz.site_classes_plan(strategy.units, counts.classes, loaded.model,
                                    config.sparsity, config.factors, config.bound)
        plan_info = pz.site_plan_summary(strategy.units, counts.classes, loaded.model,
                                         config.sparsity, config.factors, config.bound)
    logger.info("global plan: %s", plan_info["text"])
    report.extra["classes"] = {**counts.to_dict(),
                               "sites": {str(n): c.classes for n, c in sites.items()}}
    report.extra["global_plan"] = {**plan.to_dict(), "summary": plan_info}
    report.write()
    with report.phase("masks"):
        voted, uniform = strategy.collect_masks(grid, list(sites), plan, baselines,
                                                server.timeout)
    with report.phase("personalize"):
        scores = strategy.personalize(grid, sites, counts, voted, uniform, baselines,
                                      server.timeout)
    plans = {int(m["partition"]): strategy.site_plans.get(int(m["node"]))
             for m in scores if "node" in m}
    for m in sorted(scores, key=lambda m: m["partition"]):
        row = {"name": f"site-{int(m['partition'])}", "site": int(m["partition"]),
               **{k: v for k, v in m.items() if k not in ("stage", "round", "partition")}}
        summary = plans.get(int(m["partition"]))
        if summary is not None:
            row.update({"plan_min_ratio": summary["min_ratio"],
                        "plan_max_ratio": summary["max_ratio"],
                        "plan_spread": summary["spread"], "bound_bit": summary["bound_bit"]})
        if "kept_fedprllm" in m:
            row["kept_model"] = "fedprllm" if m["kept_fedprllm"] else "personalized"
            row["guard"] = pz.guard_choice(m)[1]
        report.add_result(row)
    report.extra["site_plans"] = {str(p): s for p, s in sorted(plans.items()) if s}
    report.sections.append(("Plans", (
        f"Global plan: {plan_info['text']}. "
        + ("Each site's plan (its personalized units at the personalized factor, the global "
           "class elsewhere, rescaled to p): " + "; ".join(
               f"site {p}: {s['text']}" for p, s in sorted(plans.items()) if s)
           if any(plans.values()) else ""))))
    if config.guard != "off" and scores:
        kept = sorted(int(m["partition"]) for m in scores if m.get("kept_fedprllm"))
        report.extra["guard"] = {"kept_fedprllm": kept, "sites": len(scores)}
        report.sections.append(("Site guard", (
            f"Each site compared its personalized model with uniform FedPrLLM on its held-out "
            f"windows and kept the better: {len(kept)} of {len(scores)} sites kept uniform "
            f"FedPrLLM" + (f" (sites {kept})" if kept else "") + ". The kept model's "
            "perplexity (column kept) is chosen on the same windows it is scored on, so it is "
            "optimistic; the two models' own columns are not.")))
    shared_text = sorted(int(m["partition"]) for m in scores if not m.get("heldout_separate", 1))
    if shared_text:
        report.sections.append(("Held-out text", (
            f"Sites {shared_text} gave one file as data-path: their held-out windows come from "
            "the same text as their calibration windows, so their perplexities are not on "
            "unseen text. Give each site a directory with train.jsonl and test.jsonl.")))
    if "fedprllm" in baselines:
        report.extra["wins"] = sum(1 for m in scores if m["personalized"] < m["fedprllm"])
    report.extra["sites"] = strategy.outcome.client_metrics
    report.extra["rejected"] = strategy.outcome.rejected
    report.extra["bytes_down_per_site"] = strategy.outcome.bytes_down // max(len(sites), 1)
    means = {k: math.exp(sum(math.log(m[k]) for m in scores) / len(scores))
             for k in ("personalized", "fedprllm", "local-only", "dense")
             if scores and all(k in m for m in scores)}
    report.extra["geometric_mean_perplexity"] = means
    pz.plot_unit_classes(counts, out / "unit-classes.png")
    if tasks:
        with report.phase("zero_shot"):
            for name, model in pz.server_models(loaded.model, config, plan, voted, uniform,
                                                dense="dense" in baselines):
                report.add_result({"name": name, "sparsity": sparsity_report(model)["overall"],
                                   **task_fields(tasks, evals, model, loaded.tokenizer,
                                                 batch_size=config.batch_size,
                                                 seed=config.seed)})
        report.sections.append(("Zero-shot accuracy", (
            "The server scored the models it holds on the tasks: global-plan (the shared vote "
            "at the global plan on every layer: the model of a site that found no unit "
            "personalized)" + (", fedprllm (the uniform FedPrLLM vote at p)" if uniform else "")
            + (", dense" if "dense" in baselines else "") + ". Each site's personalized "
            "model (and local-only model) stays at the site and is not scored on the tasks; "
            "the per-site rows hold their held-out perplexities.")))


def make_app(settings: dict | None = None) -> ServerApp:
    """A ServerApp running personalized pruning with ``settings`` (the CLI), or with the Flower
    run config's ``personalize.*`` settings."""
    return make_server_app(pz.METHOD, run, settings)
