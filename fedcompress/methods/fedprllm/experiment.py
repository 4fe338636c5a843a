"""Server-side pieces of a FedPrLLM run that need no Flower: data, baselines, evaluation.

The ServerApp (``server/fedprllm.py``) and the benchmark scripts compose these.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from fedcompress.data.corpora import corpus_text, load_corpus
from fedcompress.eval.perplexity import perplexity
from fedcompress.eval.tasks import TaskSuite
from fedcompress.methods.evaluation import task_fields
from fedcompress.methods.fedprllm.config import EvalConfig, FedPrLLMConfig
from fedcompress.methods.fedprllm.federated import federation_windows
from fedcompress.models import LoadedModel, load_model
from fedcompress.pruning.local import (
    PruneConfig,
    apply_masks,
    local_masks,
    outlier_ratios,
    owl_plan,
    sparsity_report,
)

logger = logging.getLogger(__name__)


@dataclass
class Experiment:
    """The global model, every client's windows and the evaluation text of one run."""

    config: FedPrLLMConfig
    eval_config: EvalConfig
    loaded: LoadedModel
    windows: list[torch.Tensor]
    eval_text: str
    timings: dict[str, float] = field(default_factory=dict)
    #: Zero-shot tasks every evaluated model is scored on (``eval_config.tasks``).
    tasks: TaskSuite | None = None
    #: Per-layer plans the baselines chose (OWL), for the report.
    plans: dict[str, dict] = field(default_factory=dict)

    @property
    def model(self) -> nn.Module:
        return self.loaded.model

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def fresh_copy(self) -> nn.Module:
        """A copy of the dense global model, to be pruned."""
        return copy.deepcopy(self.model)

    def evaluate(self, name: str, model: nn.Module, **extra) -> dict:
        """A result record: perplexity on the evaluation text, sparsity of ``model`` and, with
        ``eval_config.tasks``, its accuracy on each task (``acc_<task>`` columns; the details,
        acc_norm, examples and chance, under ``zero_shot``)."""
        start = time.perf_counter()
        ppl = perplexity(model, self.tokenizer, self.eval_text, seqlen=self.eval_config.eval_seqlen,
                         batch_size=self.config.batch_size,
                         max_windows=self.eval_config.eval_windows or None, progress=False)
        sparsity = sparsity_report(model)
        record = {"name": name, "perplexity": ppl.perplexity,
                  "sparsity": sparsity["overall"], **extra}
        record.update(task_fields(self.tasks, self.eval_config, model, self.tokenizer,
                                  batch_size=self.config.batch_size, seed=self.config.seed))
        record.update({"eval_seconds": time.perf_counter() - start,
                       "sparsity_per_layer": sparsity["per_layer"]})
        logger.info("%s: perplexity %.3f (sparsity %.3f)%s", name, ppl.perplexity,
                    sparsity["overall"],
                    f", mean accuracy {record['mean_acc']:.4f}" if "mean_acc" in record else "")
        return record

    def prune_config(self, windows: torch.Tensor) -> tuple[PruneConfig, list[float] | None]:
        """The recipe of a pass on ``windows``: the configured one, or under
        ``sparsity_profile=owl`` (and no fixed plan) OWL's plan from these windows' outlier ratios
        (returned too)."""
        config = self.config
        if config.sparsity_profile != "owl" or config.layer_sparsity:
            return config.prune, None
        ratios = outlier_ratios(self.model, windows, config.owl_m, config.batch_size)
        plan = owl_plan(ratios, config.sparsity, config.owl_lambda, self.model)
        return config.replace(layer_sparsity=plan.to_text()).prune, ratios

    def centralized(self) -> tuple[nn.Module, float]:
        """One pruning pass on the union of every client's windows (with SparseGPT's weight
        update, as the method prunes centrally; under OWL its plan from the union's outlier
        ratios: centralized OWL). Returns the pruned copy and its seconds."""
        union = torch.cat(self.windows)
        start = time.perf_counter()
        prune, ratios = self.prune_config(union)
        if ratios is not None:
            self.plans["centralized"] = {"outlier_ratios": ratios, "plan": prune.plan.to_dict()}
        result = local_masks(self.model, union, prune,
                             batch_size=self.config.batch_size, keep_weights=True)
        seconds = time.perf_counter() - start
        return apply_masks(self.fresh_copy(), result.masks, result.weights), seconds

    def round_to_nearest(self) -> tuple[nn.Module, float]:
        """The data-free baseline of a quantizing recipe: the same recipe with round-to-nearest
        in place of GPTQ (quantization alone: no data at all; with pruning, the pruning as
        the centralized pass does it on the union, then each kept weight rounded). Returns
        the quantized copy and its seconds."""
        from dataclasses import replace

        prune = self.config.prune
        if prune.quant is None:
            raise ValueError("the rtn baseline rounds a quantizing recipe: expected --quant "
                             "w4a16 or w8a16")
        prune = replace(prune, quant=replace(prune.quant, method="rtn"))
        start = time.perf_counter()
        result = local_masks(self.model, torch.cat(self.windows), prune,
                             batch_size=self.config.batch_size, keep_weights=True)
        seconds = time.perf_counter() - start
        return apply_masks(self.fresh_copy(), result.masks, result.weights), seconds

    def local_only(self, client: int = 0) -> tuple[nn.Module, float]:
        """Client ``client`` prunes alone on its own windows (local-only baseline; under OWL
        with its own outlier ratios)."""
        start = time.perf_counter()
        prune, ratios = self.prune_config(self.windows[client])
        if ratios is not None:
            self.plans[f"local-only-{client}"] = {"outlier_ratios": ratios,
                                                  "plan": prune.plan.to_dict()}
        result = local_masks(self.model, self.windows[client], prune,
                             batch_size=self.config.batch_size, keep_weights=True)
        seconds = time.perf_counter() - start
        return apply_masks(self.fresh_copy(), result.masks, result.weights), seconds


def prepare_experiment(config: FedPrLLMConfig, eval_config: EvalConfig,
                       device: str | None = None, loaded: LoadedModel | None = None
                       ) -> Experiment:
    """Load the global model (unless ``loaded`` is given), cut every client's calibration
    windows, read the eval text and load the zero-shot tasks (a name that cannot be loaded
    fails here, before any pruning)."""
    timings = {}
    start = time.perf_counter()
    tasks = eval_config.load_tasks()
    eval_text = corpus_text(load_corpus(eval_config.eval_text, eval_config.eval_split))
    timings["eval_data"] = time.perf_counter() - start
    start = time.perf_counter()
    if loaded is None:
        loaded = load_model(config.model, device=device, dtype=config.dtype)
    timings["load_model"] = time.perf_counter() - start
    start = time.perf_counter()
    windows, _ = federation_windows(loaded.tokenizer, config)
    timings["data"] = time.perf_counter() - start
    return Experiment(config, eval_config, loaded, windows, eval_text, timings, tasks=tasks)
