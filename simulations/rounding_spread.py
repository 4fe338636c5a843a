"""How far float rounding alone moves a recipe's model: the sites' order, ours and llm-compressor's.

    python simulations/rounding_spread.py --out simulations/results/rounding-spread

Statistics mode computes centralized compression's mathematics exactly, but not its float
rounding: the server adds the sites' float64 sums, the centralized pass adds batches of the
pooled windows, llm-compressor keeps a float32 running mean; each order rounds differently. GPTQ's
integers absorb such differences; SparseGPT's mask choices amplify them, layer after layer (a
weight that differs in its last bit can move a mask in a later block, which changes the next
layer's inputs). This script measures that amplification, so that a gap between two
implementations can be read against it.

For each recipe of ``--recipes`` (default SparseGPT 50%; the federation of
``recipe_anchor.py``: ``--clients`` sites of ``--samples-per-client`` windows of ``--seqlen``
tokens), and ``--orders`` orders of the sites (order 0: partition order, what a run sums; the
others: seeded permutations of the sites):

1. **ours, federated**: the statistics-mode run in one process
   (:func:`fedcompress.methods.fedprllm.stats.stats_prune`: the Flower strategy's site steps,
   wire round trip and server step, sites one after another, each with ``--site-threads``
   torch threads: 1, a Simulation Engine actor's, makes order 0 the model ``fedcompress
   compress`` computes) with the sites in that order;
2. **llm-compressor**: ``oneshot`` of the recipe (in its own venv, ``simulations/
   gptq_anchor.py``'s ``--venv``) on the pooled windows, the sites' blocks of windows in that
   order;
3. once, **ours, centralized**: the centralized pass on the pooled windows in partition order.

A recipe of several passes (``sparsegpt50-w4a16``: SparseGPT, then GPTQ on the pruned model)
runs its passes in order on each side, each order's pass on the model that order's pass before
it made (:func:`chained`, as ``fedcompress compress`` runs them; llm-compressor's ``oneshot``
runs its own stages), so the first pass's rounding reaches the second pass's statistics as it
does in a real run.

Each model's perplexity on the first ``--eval-windows`` windows of ``--eval-seqlen`` tokens of
the wiki test split (the anchor's evaluator), and the share of its weights whose mask (zero or
not) equals that of the same side's order 0. The summary: per side the mean, the lowest and the
highest perplexity and their spread (highest / lowest - 1), and the gap between the two sides'
means. Writes ``report.json`` / ``report.md`` / ``config.toml``; llm-compressor's models under
``--out``/``cache/`` (not committed with a result).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gptq_anchor  # noqa: E402  (the llm-compressor venv, its runner, the evaluator)
from recipe_anchor import (  # noqa: E402
    checked_options,
    llmc_python,
    recipe_options,
    recipe_text,
    script_run,
)

logger = logging.getLogger("rounding_spread")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = recipe_options(argparse.ArgumentParser(description=__doc__.split("\n")[0]),
                       "simulations/results/rounding-spread", 64)
    p.set_defaults(recipes=["sparsegpt50"])
    p.add_argument("--orders", type=int, default=4,
                   help="orders of the sites per side (order 0: partition order)")
    p.add_argument("--site-threads", type=int, default=1,
                   help="torch's threads for ours' site steps (1: a Simulation Engine actor's, "
                        "so that order 0 is what the Flower run computes, bit for bit)")
    p.add_argument("--venv", default=None,
                   help="llm-compressor's venv (default: $FEDCOMPRESS_CACHE/llmc), created "
                        "when missing")
    p.add_argument("--python", default="python3.11", help="interpreter that creates the venv")
    opts = checked_options(p, argv)
    if opts.orders < 2:
        p.error(f"--orders {opts.orders}: expected at least 2 (a spread needs two orders)")
    return opts


def site_orders(clients: int, orders: int, seed: int) -> list[list[int]]:
    """Order 0: the partitions in order; order k: a permutation seeded by ``(seed, k)``."""
    return [list(range(clients))] + [
        [int(i) for i in np.random.default_rng([seed, k]).permutation(clients)]
        for k in range(1, orders)]


def zero_pattern(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every decoder linear layer's zero pattern (True: the weight is exactly 0)."""
    return {name: (module.weight == 0).detach().clone()
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and ".layers." in name}


def same_mask_share(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The share of weights whose zero pattern is the same in ``a`` and ``b``."""
    if set(a) != set(b):
        raise ValueError("the two models hold different linear layers")
    same = sum(int((a[k] == b[k]).sum()) for k in a)
    return same / sum(a[k].numel() for k in a)


Compress = Callable[[torch.nn.Module, Any], tuple[dict, dict]]


def chained(model: torch.nn.Module, configs: list[Any], compress: Compress) -> torch.nn.Module:
    """The model after each of ``configs``' passes in order, each pass compressing the model
    the pass before it made (as ``fedcompress compress`` runs a recipe's passes: a stage's model
    is the next stage's input); ``compress(model, config)`` returns the pass's masks and
    weights. ``model`` itself is left as it is."""
    from fedcompress.pruning.local import apply_masks

    for config in configs:
        masks, weights = compress(model, config)
        model = apply_masks(copy.deepcopy(model), masks, weights)
    return model


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "lowest": min(values), "highest": max(values),
            "spread": max(values) / min(values) - 1}


class Recorder:
    """One recipe's results: each model's perplexity (``evaluate``) and the share of its mask
    equal to its side's order 0 (``ours-centralized`` against ``ours``' order 0)."""

    def __init__(self, report, recipe: str, evaluate: Callable[[torch.nn.Module], float]):
        self.report, self.recipe, self.evaluate = report, recipe, evaluate
        self.first: dict[str, dict[str, torch.Tensor]] = {}
        self.ppl: dict[str, list[float]] = {}

    def add(self, side: str, order: int, model: torch.nn.Module) -> float:
        perplexity, pattern = self.evaluate(model), zero_pattern(model)
        reference = self.first.setdefault(side.split("-")[0], pattern)
        self.report.add_result({"name": f"{self.recipe} {side} {order}", "recipe": self.recipe,
                                "side": side, "order": order, "perplexity": perplexity,
                                "masks_as_order_0": same_mask_share(reference, pattern)})
        self.ppl.setdefault(side, []).append(perplexity)
        return perplexity


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    logging.basicConfig(level=getattr(logging, opts.log_level.upper()),
                        format="%(asctime)s %(name)s %(message)s")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from fedcompress.data.corpora import corpus_text, load_corpus
    from fedcompress.methods.fedprllm.federated import FedPrLLMConfig, federation_windows
    from fedcompress.methods.fedprllm.stats import stats_prune
    from fedcompress.models import load_model
    from fedcompress.pruning.local import local_masks
    from fedcompress.recipe import load_recipe
    from fedcompress.recipe.plan import stage_settings

    runner, out, report, work, log = script_run(__file__, opts, "rounding-spread-")
    orders = site_orders(opts.clients, opts.orders, opts.seed)
    report.extra["orders"] = orders
    with report:
        exe = llmc_python(report, opts, work, log)
        with report.phase("load"):
            loaded = load_model(opts.model, device="cpu", dtype="float32")
            federation = dict(model=opts.model, clients=opts.clients,
                              samples_per_client=opts.samples_per_client, seqlen=opts.seqlen,
                              seed=opts.seed, calib_text=opts.calib_text,
                              batch_size=opts.batch_size)
            windows = federation_windows(loaded.tokenizer, FedPrLLMConfig(**federation))[0]
            eval_text = corpus_text(load_corpus("wiki", "test"))

        def evaluate(model: torch.nn.Module) -> float:
            return gptq_anchor.evaluate(model.eval(), loaded.tokenizer, eval_text, opts)

        summary: dict[str, Any] = {}
        for name in opts.recipes:
            text = recipe_text(name, opts.group_size)
            configs = [FedPrLLMConfig(**federation, **settings) for settings in
                       stage_settings(load_recipe(text), {"aggregate": "stats",
                                                          "quant_scale_dtype": "float32"})]
            bits = 4 if configs[-1].prune.quant is not None else 32
            record = Recorder(report, name, evaluate)

            for k, order in enumerate(orders):
                def federated(model, config, order=order):
                    run = stats_prune(model, [windows[i] for i in order], config,
                                      site_threads=opts.site_threads)
                    return run.masks, run.weights

                with report.phase(f"{name}-ours-{k}"):
                    record.add("ours-federated", k, chained(loaded.model, configs, federated))
                request = work / f"{name}-{k}.safetensors"
                ids = torch.cat([windows[i] for i in order]).to(torch.int64)
                runner.save_exchange(request, {"input_ids": ids},
                                     {"recipe": text, "model_path": str(loaded.path)})
                with report.phase(f"{name}-llmc-{k}"):
                    gptq_anchor.run_runner(exe, ["recipe", str(request), str(work / f"{k}")],
                                           log)
                    folder = out / "cache" / f"llmc-{name}-{k}"
                    if folder.exists():
                        shutil.rmtree(folder)
                    shutil.move(str(work / f"{k}" / "model"), folder)
                    kwargs = ({"quantization_config": CompressedTensorsConfig(dequantize=True)}
                              if bits < 32 else {})
                    record.add("llmc", k, AutoModelForCausalLM.from_pretrained(str(folder),
                                                                           **kwargs))
            def centralized(model, config):
                result = local_masks(model, torch.cat(windows), config.prune,
                                     batch_size=opts.batch_size, keep_weights=True)
                return result.masks, result.weights

            with report.phase(f"{name}-ours-centralized"):
                central = record.add("ours-centralized", 0,
                                     chained(loaded.model, configs, centralized))
            ours, llmc = spread(record.ppl["ours-federated"]), spread(record.ppl["llmc"])
            summary[name] = {"ours_federated": ours, "llmc": llmc,
                             "ours_centralized": central,
                             "gap_of_means": ours["mean"] / llmc["mean"] - 1}
            logger.info("%s: ours %.3f (spread %.2f%%), llm-compressor %.3f (spread %.2f%%), "
                        "gap of the means %+.2f%%", name, ours["mean"], 100 * ours["spread"],
                        llmc["mean"], 100 * llmc["spread"], 100 * summary[name]["gap_of_means"])
        report.extra["summary"] = summary
    shutil.rmtree(work, ignore_errors=True)
    report.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
