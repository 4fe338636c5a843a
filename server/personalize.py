"""Federated personalized pruning's ServerApp: the whole pipeline of one run.

Load the global model (the same spec every site loads), ask the sites for their unit classes,
count them into the global plan (Eq. 4, rescaled to ``p``), collect and sum the sites' masks at
it, send each site its plan and the shared masks, collect every site's held-out perplexity of
its personalized model and of the baselines, and write ``report.json``/``report.md`` (one row
per site) with a plot of how often each unit falls in each class across sites.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

# transformers at module level, before the library imports it: see server/app.py.
import transformers  # noqa: F401
from flwr.serverapp import Grid, ServerApp

from fedcompress.methods import personalize as pz
from fedcompress.models import load_model
from fedcompress.report import RunReport
from server.common import make_server_app, run_with_report
from strategies.personalize import PersonalizeServer

logger = logging.getLogger(__name__)


def check_settings(settings: dict) -> None:
    """Every setting valid, before any model is loaded or any engine started."""
    pz.METHOD.parse(settings)


def run(grid: Grid, settings: dict) -> RunReport:
    return run_with_report(pz.METHOD, grid, settings, _run)


def _run(grid: Grid, config: pz.PersonalizeConfig, server: pz.RunSettings,
         report: RunReport) -> None:
    out = Path(server.out)
    baselines = server.baseline_list()
    with report.phase("setup"):
        device = None if server.device in ("", "auto") else server.device
        loaded = load_model(config.model, device=device, dtype=config.dtype)
    report.extra["model"] = {"spec": loaded.spec, **loaded.info}
    strategy = PersonalizeServer(config, loaded.model)
    with report.phase("classify"):
        sites = strategy.collect_classes(grid, server.timeout)
        counts = pz.global_classes([c.classes for c in sites.values()])
        plan = pz.site_classes_plan(strategy.units, counts.classes, loaded.model,
                                    config.sparsity, config.factors)
    report.extra["classes"] = {**counts.to_dict(),
                               "sites": {str(n): c.classes for n, c in sites.items()}}
    report.extra["global_plan"] = plan.to_dict()
    report.write()
    with report.phase("masks"):
        voted, uniform = strategy.collect_masks(grid, list(sites), plan, baselines,
                                                server.timeout)
    with report.phase("personalize"):
        scores = strategy.personalize(grid, sites, counts, voted, uniform, baselines,
                                      server.timeout)
    for m in sorted(scores, key=lambda m: m["partition"]):
        row = {"name": f"site-{int(m['partition'])}", "site": int(m["partition"]),
               **{k: v for k, v in m.items() if k not in ("stage", "round", "partition")}}
        report.add_result(row)
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


def make_app(settings: dict | None = None) -> ServerApp:
    """A ServerApp running personalized pruning with ``settings`` (the CLI), or with the Flower
    run config's ``personalize.*`` settings."""
    return make_server_app(pz.METHOD, run, settings)
