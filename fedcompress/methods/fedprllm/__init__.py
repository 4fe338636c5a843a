"""FedPrLLM: federated pruning of an LLM by voting on the clients' local masks.

* :mod:`.config`: the settings (clients, evaluation, server) with every default;
* :mod:`.federated`: client windows, the wire formats and their validation, the vote
  (:class:`~.federated.MaskAggregator`), the iterative client step;
* :mod:`.stats`: the statistics mode (sites send summed input statistics per layer; the
  server prunes exactly as the centralized pass on the union of their windows);
* :mod:`.experiment`: the server's model, data, baselines and evaluation.

The Flower files: ``clients/fedprllm.py``, ``strategies/fedprllm/``, ``server/fedprllm.py``.
"""

from __future__ import annotations

from fedcompress.methods.base import Method
from fedcompress.methods.evaluation import accuracy_cells, accuracy_columns
from fedcompress.methods.fedprllm.config import EvalConfig, FedPrLLMConfig, RunSettings
from fedcompress.recipe.plan import expand_settings

__all__ = ["METHOD", "EvalConfig", "FedPrLLMConfig", "RunSettings"]


def summary(report: dict) -> tuple[str, list[str], list[list[str]], list[str]]:
    """The CLI's table of a ``prune`` report: perplexity, sparsity, times per model and, with
    ``--tasks``, the accuracy on each task."""
    tasks = accuracy_columns(report["results"])
    rows = []
    for r in report["results"]:
        prune_s = r.get("prune_seconds", r.get("federated_seconds"))
        rows.append([r["name"], f"{r['perplexity']:.3f}", f"{r['sparsity']:.3f}",
                     "-" if prune_s is None else f"{prune_s:.1f}", f"{r['eval_seconds']:.1f}",
                     *accuracy_cells(r, tasks)])
    return ("fedcompress prune", ["name", "perplexity", "sparsity", "prune s", "eval s",
                                  *(f"acc {t}" for t in tasks)], rows, [])


METHOD = Method(
    name="fedprllm",
    command="prune",
    help="Federated pruning (FedPrLLM) on Flower's Simulation Engine, with baselines and a "
         "report.",
    settings=(FedPrLLMConfig, EvalConfig, RunSettings),
    actions={"query.warmup": "warmup", "query.outliers": "outliers",
             "train.masks": "oneshot_masks",
             "train.layer_mask": "iterative_layer_mask",
             "train.layer_stats": "layer_stats",
             "train.fedspallm": "fedspallm_release",
             "query.secagg_keys": "secagg_keys", "query.secagg_share": "secagg_share",
             "train.secagg_masks": "secagg_masks", "query.secagg_confirm": "secagg_confirm",
             "query.secagg_unmask": "secagg_unmask"},
    message_keys={"config": "config", "masks": "masks", "metrics": "metrics",
                  "reference": "reference", "round": "round", "global": "global",
                  "state": "fedprllm", "outliers": "outliers", "secagg": "secagg",
                  "masked": "masked", "resync": "resync", "stats": "stats",
                  "shared": "shared", "global_weights": "global_weights",
                  "resync_weights": "resync_weights", "layers": "layers"},
    clear_releases={"train.masks": "its masks", "train.layer_mask": "a layer's masks",
                    "train.layer_stats": "a layer's input statistics",
                    "train.fedspallm": "its masks and the weights they keep"},
    client_module="clients.fedprllm",
    server_module="server.fedprllm",
    summary=summary,
    expand=expand_settings,
)
