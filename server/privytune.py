"""PrunePrivyTune ServerApp: removal plan, federated DP-LoRA with FedAvg, audit, baselines.

Round 0: the sites' cosine matrices (or public text) -> the removal plan (ratio or Alg. 1's
greedy search). Rounds 1..R: Flower's FedAvg over the sites' DP-SGD-trained weights
(:class:`strategies.privytune.PrivyTuneFedAvg`), the global model evaluated on the test split
after every round. Then the sites' extraction audit (causal LMs), the merged model saved in its
smallest faithful dtype (``save_dtype``), and the centralized baseline on the union of the
sites' data. With ``tasks`` (objective lm), the initial model (layers removed, before
fine-tuning; an ``initial`` record), the final global model and the central baseline are scored
on zero-shot tasks (``acc_<task>``, ``mean_acc``, ``zero_shot``). Writes report.json/report.md,
the heat map of the cosine matrix (``cosine_matrix.png``, the paper's Fig. 2) and the model
(``model/``).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import transformers  # noqa: F401  (at module level: see server/app.py)
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedcompress.layers.redundancy import CosineMatrix, plot_cosine_matrix
from fedcompress.methods import privytune as ppt
from fedcompress.methods.evaluation import TaskEvalSettings, task_fields
from fedcompress.models import load_model, num_layers
from fedcompress.report import RunReport
from server.common import make_server_app, run_with_report, save_run_model
from strategies.privytune import PrivyTuneFedAvg, training_strategy

logger = logging.getLogger(__name__)


def split_settings(settings: dict) -> tuple[ppt.PrivyTuneConfig, TaskEvalSettings,
                                            ppt.RunSettings]:
    return ppt.METHOD.parse(settings)  # type: ignore[return-value]


def check_settings(settings: dict) -> None:
    """Every setting valid and the data there, before any model is loaded or engine started."""
    config, evals, server = split_settings(settings)
    server.validate()
    ppt.check_task_eval(config, evals)
    ppt.check_data(config)
    evals.load_tasks()  # every zero-shot task exists and loads (offline: bundled or cached)


def run(grid: Grid, settings: dict) -> RunReport:
    return run_with_report(ppt.METHOD, grid, settings, _run)


def _metric_row(metrics: dict) -> dict:
    return {k: metrics[k] for k in ("accuracy", "perplexity", "loss") if k in metrics}


def _merged(model):
    """The fine-tuned model, LoRA merged (reloadable with ``from_pretrained`` once saved)."""
    lm = model.lm if isinstance(model, ppt.LabelTokenClassifier) else model
    merge = getattr(lm, "merge_and_unload", None)
    return merge() if callable(merge) else lm


def _run(grid: Grid, config: ppt.PrivyTuneConfig, evals: TaskEvalSettings,
         server: ppt.RunSettings, report: RunReport) -> None:
    out = Path(server.out)
    ppt.check_task_eval(config, evals)
    with report.phase("setup"):
        tasks = evals.load_tasks()  # before the model: a name that cannot load fails at once
        device = None if server.device in ("", "auto") else server.device
        loaded = load_model(config.model, device=device, dtype=config.dtype)
        base, tokenizer, path = loaded.model, loaded.tokenizer, loaded.path
        union = ppt.site_data(config, -1)
    report.extra["model"] = {"spec": loaded.spec, **loaded.info}
    decoder = not ppt.is_encoder(base)
    strategy = PrivyTuneFedAvg(config, {}, [])

    with report.phase("round0_similarity"):
        if config.similarity_source == "sites":
            parts = strategy.collect_cosines(grid, server.timeout, num_layers(base) + 1)
            matrix = CosineMatrix.mean(parts)
        else:
            matrix = ppt.public_cosines(config, base, tokenizer)
    plot_cosine_matrix(matrix, out / "cosine_matrix.png",
                       title=f"{config.model}: pairwise cosine of hidden states")
    with report.phase("removal"):
        plan, greedy = ppt.plan_removal(config, matrix, base, path, tokenizer, union.label_names)
    report.extra["redundancy"] = {"source": config.similarity_source, **matrix.to_dict()}
    if config.private:
        report.extra["dp_noise"] = config.noise_note()
    report.extra["removal"] = {"plan": plan.to_dict(), "greedy": greedy or None}

    model = ppt.initial_model(config, base, path, tokenizer, union.label_names, plan.removed)
    initial = ppt.trainable_arrays(model)
    strategy.shapes = {k: tuple(v.shape) for k, v in initial.items()}
    strategy.removed = list(plan.removed)
    test = ppt.eval_split(config, tokenizer, union.label_names, decoder, "test")
    rounds: list[dict] = []

    def zero_shot(scored) -> dict:
        """The zero-shot fields of a model the server holds (none without tasks)."""
        return task_fields(tasks, evals, scored, tokenizer, batch_size=config.batch_size,
                           seed=config.seed)

    initial_fields: dict = {}
    if tasks:
        with report.phase("zero_shot"):
            initial_fields = zero_shot(model)  # layers removed, before any fine-tuning

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        ppt.load_trainable(model, {k: a.numpy() for k, a in arrays.items()})
        metrics = ppt.evaluate(config, model, tokenizer, test)
        rounds.append({"round": server_round, **metrics})
        report.extra["rounds"] = rounds
        report.write()
        return MetricRecord({k: float(v) for k, v in metrics.items()})

    trainer = training_strategy(strategy)
    start = time.perf_counter()
    with report.phase("federated"):
        result = trainer.start(
            grid, ArrayRecord({k: Array(v) for k, v in initial.items()}),
            num_rounds=config.rounds, timeout=server.timeout, train_config=strategy.site_config(),
            evaluate_fn=evaluate_fn)
    seconds = time.perf_counter() - start
    final = result.arrays
    ppt.load_trainable(model, {k: a.numpy() for k, a in final.items()})
    metrics = ppt.evaluate(config, model, tokenizer, test)
    if tasks:
        first = next((r for r in rounds if r["round"] == 0), {})
        report.add_result({"name": "initial", **_metric_row(first),
                           "layers": num_layers(base) - len(plan.removed),
                           "removed": len(plan.removed), **initial_fields})
    sites = strategy.stage_metrics("train")
    last = [m for m in sites if m["round"] == config.rounds]
    spent = [m["epsilon_spent"] for m in last if "epsilon_spent" in m]
    report.extra["sites"] = sites
    report.extra["rejected"] = strategy.outcome.rejected
    central = getattr(trainer, "central_spent", None)
    if central is not None:
        report.extra["central_dp"] = {"wrapper": config.central_dp,
                                      "noise_multiplier": config.central_noise,
                                      "clipping_norm": config.central_clip,
                                      "noise": "secret (fresh OS entropy, not recorded)"
                                      if config.central_noise_seed < 0 else
                                      f"reproducible from central_noise_seed="
                                      f"{config.central_noise_seed}: the epsilon below does "
                                      "NOT hold against anyone who reads this report",
                                      "rounds": central}
    row = {"name": "federated", **_metric_row(metrics), "layers": num_layers(base) -
           len(plan.removed), "removed": len(plan.removed),
           "epsilon": config.epsilon if config.private else "none",
           "epsilon_spent_max": max(spent) if spent else None, "sites": len(last),
           "central_epsilon": central[-1]["epsilon"] if central else None,
           "seconds": seconds,
           "bytes_down_per_site": strategy.outcome.bytes_down // max(config.clients, 1),
           "bytes_up_per_site_round": last[0].get("bytes_up") if last else None}

    if ppt.can_attack(config, base):
        with report.phase("attack"):
            attacks = strategy.collect_attacks(grid, final, server.timeout)
        report.extra["attack_sites"] = attacks
        for key in ("membership_gap", "auc", "bert_f1_members", "bert_f1_nonmembers"):
            row[key] = math.fsum(a[key] for a in attacks) / len(attacks)
    elif config.attack_samples:
        report.sections.append(("Extraction attack", (
            f"Not run: {config.model} is an encoder without an MLM head, so it cannot generate "
            "text. Run the audit with a causal LM (e.g. `--model smollm2-135m`).")))
    if tasks:
        with report.phase("zero_shot"):
            row.update(zero_shot(model))  # the final global model
    report.add_result(row)
    if server.save_model:
        with report.phase("save"):
            save_run_model(report, _merged(model), out / "model", tokenizer, loaded, base,
                           server.save_dtype, config.dtype)

    if "central" in server.baseline_list():
        with report.phase("central"):
            row = ppt.central_run(config, base, path, tokenizer, plan, union)
            row.update(zero_shot(row.pop("model")))
            report.add_result(row)


def make_app(settings: dict | None = None) -> ServerApp:
    """A ServerApp running PrunePrivyTune with ``settings`` (the CLI), or with the Flower run
    config's ``privytune.*`` settings."""
    return make_server_app(ppt.METHOD, run, settings)
