"""PPC-GPT ServerApp: the whole pipeline of one run.

Round 1: collect the clients' DP-perturbed questions (labels stay on the clients). Server:
synthetic questions, 3-sample-agreed CoT answers and rationales from LLM_syn; Block Influence
layer removal of LLM_o; CoT distillation with LoRA. Round 2: the removal plan and the adapter go
to the clients, which measure the model's accuracy on their private test data ("S"), retrain
it on their private labelled data and measure again ("C"). Baselines run in-process on each
client's data: dense (no training), DenseSFT, Plain-C. With ``tasks``, the server scores
LLM_o and its distilled model (as round 2 sends it, before any client retrains it) on zero-shot
tasks: the ``dense`` and ``ppcgpt`` records get ``acc_<task>``, ``mean_acc`` and ``zero_shot``.
Writes report.json/report.md, the synthetic data (``synthetic/``) and the compressed model
(``model/``, adapter merged, in its smallest faithful dtype: ``save_dtype``).
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

import transformers  # noqa: F401  (at module level: see server/app.py)
from flwr.app import ArrayRecord
from flwr.serverapp import Grid, ServerApp

from fedcompress.methods import ppcgpt
from fedcompress.methods.evaluation import TaskEvalSettings, task_fields
from fedcompress.models import load_model, num_layers
from fedcompress.report import RunReport
from fedcompress.synth import SynthConfig, generate_synthetic
from server.common import make_server_app, run_with_report, save_run_model
from strategies.common import STARTUP_KEYS
from strategies.ppcgpt import PPCGPT

logger = logging.getLogger(__name__)

BASELINES = {"dense": ppcgpt.dense_accuracy, "dense-sft": ppcgpt.dense_sft,
             "plain-c": ppcgpt.plain_c}


def split_settings(settings: dict) -> tuple[ppcgpt.PPCGPTConfig, TaskEvalSettings,
                                            ppcgpt.RunSettings]:
    """Flat settings (CLI or run config, keys with ``-`` or ``_``) -> (method, zero-shot
    evaluation, server)."""
    return ppcgpt.METHOD.parse(settings)  # type: ignore[return-value]


def check_settings(settings: dict) -> None:
    """Every setting valid, before any model is loaded or any engine started."""
    config, evals, _ = split_settings(settings)
    ppcgpt.client_data(config, 0)  # the task exists and has enough examples
    evals.load_tasks()  # every zero-shot task exists and loads (offline: bundled or cached)


def _result(name: str, per_client: list[dict], **extra) -> dict:
    record = {"name": name}
    for side in ("server", "client"):
        if all(side in c for c in per_client):
            record[f"acc_{side}"] = ppcgpt.weighted_accuracy(per_client, side)
            record[f"n_{side}"] = sum(c[side]["n"] for c in per_client)
    record.update(extra)
    record["per_client"] = per_client
    return record


def _nested(metrics: dict) -> dict:
    """Flat round-2 metrics (``server_acc`` ...) -> ``{"server": {"acc": ...}, ...}``; the
    site's start-up split (``client_startup_seconds`` ...) stays flat."""
    def sided(key: str) -> bool:
        return key.startswith(("server_", "client_")) and key not in STARTUP_KEYS

    out = {k: v for k, v in metrics.items() if not sided(k)}
    for side in ("server", "client"):
        out[side] = {k[len(side) + 1:]: v for k, v in metrics.items()
                     if sided(k) and k.startswith(side + "_")}
    return out


def run(grid: Grid, settings: dict) -> RunReport:
    return run_with_report(ppcgpt.METHOD, grid, settings, _run)


def _run(grid: Grid, config: ppcgpt.PPCGPTConfig, evals: TaskEvalSettings,
         server: ppcgpt.RunSettings, report: RunReport) -> None:
    out = Path(server.out)
    baselines = server.baseline_list()
    timeout = server.timeout
    with report.phase("setup"):
        tasks = evals.load_tasks()  # before the model: a name that cannot load fails at once
        device = None if server.device in ("", "auto") else server.device
        loaded = load_model(config.model, device=device, dtype=config.dtype)
        model, tokenizer = loaded.model, loaded.tokenizer
    report.extra["model"] = {"spec": loaded.spec, **loaded.info}
    strategy = PPCGPT(config)

    with report.phase("round1_perturb"):
        examples = strategy.collect_text(grid, timeout)
    budgets = strategy.stage_metrics("perturb")
    report.extra["privacy"] = {
        "eps_per_word": config.eps, "mechanism": config.mechanism,
        "eps_per_example_max": max(m.get("eps_per_example_max", 0.0) for m in budgets),
        "clients": budgets}
    report.sections.append(("Privacy (round 1)",
                            ppcgpt.privacy_notes(config, budgets)))
    report.extra["rejected"] = strategy.outcome.rejected

    with report.phase("synthetic"):
        backend = ppcgpt.make_backend(config, model, tokenizer, device)
        synth = generate_synthetic(examples, backend, SynthConfig(**config.synth_settings()))
        synth.save(out / "synthetic")
    report.extra["synthetic"] = {"backend": synth.backend, **synth.stats.to_dict()}
    if synth.stats.accepted < config.min_synthetic:
        raise ppcgpt.NotEnoughSyntheticData(
            f"{synth.stats.accepted} synthetic sample(s) accepted of "
            f"{synth.stats.attempts} attempts (rejections: "
            f"{ {k: v for k, v in synth.stats.rejections.items() if v} }), the run needs "
            f"min_synthetic={config.min_synthetic}: use a stronger generator (synth_model "
            "or synth_url), a higher synth_ratio, or lower min_synthetic")

    with report.phase("compress"):
        compressed = ppcgpt.compress(model, tokenizer, synth.samples, config)
    report.extra["compression"] = {
        "plan": compressed.plan.to_dict(),
        "importance": None if compressed.importance is None
        else compressed.importance.to_dict(),
        "train": compressed.train_metrics, "seconds": compressed.seconds}
    if server.save_model:
        with report.phase("save"):
            merged = copy.deepcopy(compressed.model).merge_and_unload()
            save_run_model(report, merged, out / "model", tokenizer, loaded, model,
                           server.save_dtype, config.dtype)
            del merged

    # Zero-shot accuracy of LLM_o and of the server's model as round 2 sends it (distilled,
    # before any client retrains it): the fields of the "dense" and "ppcgpt" records.
    zero_shot: dict[str, dict] = {}
    if tasks:
        with report.phase("zero_shot"):
            for name, scored in (("dense", model), ("ppcgpt", compressed.model)):
                zero_shot[name] = task_fields(tasks, evals, scored, tokenizer,
                                              batch_size=config.eval_batch_size,
                                              seed=config.seed)

    strategy.set_model(list(compressed.plan.removed), ppcgpt.adapter_arrays(compressed.model))
    start = time.perf_counter()
    with report.phase("round2_retrain"):
        strategy.start(grid, ArrayRecord(), num_rounds=1, timeout=timeout)
    report.extra["rejected"] = strategy.outcome.rejected
    per_client = [_nested(m) for m in sorted(strategy.stage_metrics("retrain"),
                                             key=lambda m: m["partition"])]
    report.add_result(_result(
        "ppcgpt", per_client, layers=num_layers(model) - len(compressed.plan.removed),
        removed=len(compressed.plan.removed), synthetic=synth.stats.accepted,
        eps=config.eps, round2_seconds=time.perf_counter() - start,
        bytes_down_per_client=strategy.outcome.bytes_down // max(config.clients, 1),
        bytes_up_per_client=sum(m.get("bytes_up", 0) for m in budgets) // max(len(budgets), 1),
        **zero_shot.get("ppcgpt", {})))

    for name in baselines:
        per_client = []
        with report.phase(name):
            for partition in range(config.clients):
                data = ppcgpt.client_data(config, partition)
                per_client.append({"partition": partition,
                                   **BASELINES[name](model, tokenizer, data, config)})
        removed = len(per_client[0].get("removed", []))
        report.add_result(_result(name, per_client, layers=num_layers(model) - removed,
                                  removed=removed, **zero_shot.get(name, {})))
    if "dense" in zero_shot and "dense" not in baselines:  # LLM_o scored on the tasks only
        report.add_result({"name": "dense", "layers": num_layers(model), "removed": 0,
                           **zero_shot["dense"]})


def make_app(settings: dict | None = None) -> ServerApp:
    """A ServerApp running PPC-GPT with ``settings`` (the CLI), or with the Flower run
    config's ``ppcgpt.*`` settings."""
    return make_server_app(ppcgpt.METHOD, run, settings)
