"""Statistics mode against centralized pruning and the mask vote, side by side in one run.

    python simulations/stats_mode.py --out simulations/results/stats-mode

For each local method (Wanda, SparseGPT) at ``--sparsity`` on ``--model`` with ``--clients``
sites of ``--samples-per-client`` windows (the same windows as ``fedcompress prune``):

* **centralized**: one pass of the calibration walker on the union of the sites' windows (with
  SparseGPT's weight update);
* **stats**: :func:`fedcompress.methods.fedprllm.stats.stats_prune`, the sites' summed
  statistics one decoder layer per round, every statistic through the wire encoding and its
  validation (what the Flower strategy does, sites one after another);
* **stats over SecAgg+**: the same, each site's statistics summed as SecAgg+ sums them (fixed
  point with ``--frac-bits`` fractional bits in 64-bit lanes, mod 2^64; the masking cancels
  exactly, so the cryptography is left out here): its perplexity, and the mask bits and largest
  weight difference against the plain statistics mode (the fixed-point error);
* **votes**: FedPrLLM's one-shot vote of the sites' local masks (server layer comparison).

Reported per method: perplexity of each pruned model on the first ``--eval-windows`` windows of
the wiki test split, mask bits that differ from centralized, the largest weight difference
(SparseGPT), rounds, bytes one site sends per round (and in all), seconds. Writes
``report.json``/``report.md`` (:class:`~fedcompress.report.RunReport`).
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time

import torch

from fedcompress.data.corpora import corpus_text, load_corpus
from fedcompress.eval.perplexity import perplexity
from fedcompress.masks.stats import flatten_masks
from fedcompress.methods.fedprllm.federated import (
    FedPrLLMConfig,
    MaskAggregator,
    federation_windows,
    payload_nbytes,
)
from fedcompress.methods.fedprllm.stats import FRAC_BITS, stats_prune
from fedcompress.models import ModelAdapter, load_model
from fedcompress.pruning.local import apply_masks, local_masks
from fedcompress.report import RunReport, markdown_table

logger = logging.getLogger("stats_mode")


def difference(ref, other) -> tuple[int, float]:
    """Mask bits of ``other`` that differ from ``ref``, and the largest absolute difference
    between the updated weights the two hold (0 when neither updates weights)."""
    bits = sum(int((a[k] != other.masks[i][k]).sum()) for i, a in enumerate(ref.masks) for k in a)
    gap = max((float((ref.weights[i][k] - w).abs().max())
               for i, layer in enumerate(other.weights) if layer
               for k, w in layer.items()), default=0.0)
    return bits, gap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="simulations/results/stats-mode")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", nargs="+", default=["wanda", "sparsegpt"])
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--samples-per-client", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--frac-bits", type=int, default=FRAC_BITS,
                        help="fixed-point fractional bits of the SecAgg+ statistics sum")
    parser.add_argument("--no-votes", action="store_true",
                        help="skip the one-shot vote (one local pass per site: the longest row)")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    report = RunReport.for_script(__file__, opts, seeds={"seed": 0})
    with report:
        loaded = load_model(opts.model, device="cpu")
        model, tokenizer = loaded.model, loaded.tokenizer
        eval_text = corpus_text(load_corpus("wiki", "test"))
        rows = []
        for method in opts.methods:
            config = FedPrLLMConfig(model=opts.model, method=method, sparsity=opts.sparsity,
                                    clients=opts.clients,
                                    samples_per_client=opts.samples_per_client,
                                    seqlen=opts.seqlen, batch_size=opts.batch_size,
                                    aggregate="stats")
            windows = federation_windows(tokenizer, config)[0]

            def evaluate(pruned) -> float:
                return perplexity(pruned, tokenizer, eval_text, seqlen=opts.seqlen,
                                  batch_size=8, max_windows=opts.eval_windows,
                                  progress=False).perplexity

            # Each model is evaluated and recorded (add_result writes the report) as soon as it
            # exists: a stopped run keeps every finished row.
            common = {"method": method, "sparsity": opts.sparsity}
            layers = len(ModelAdapter(model))
            ppl = {}
            with report.phase(f"{method}-centralized"):
                start = time.perf_counter()
                central = local_masks(model, torch.cat(windows), config.prune,
                                      batch_size=opts.batch_size, keep_weights=True)
                central_s = time.perf_counter() - start
            with report.phase(f"{method}-centralized-eval"):
                ppl["centralized"] = evaluate(apply_masks(copy.deepcopy(model), central.masks,
                                                          central.weights))
            report.add_result({"name": f"{method}-centralized", **common,
                               "perplexity": ppl["centralized"], "rounds": 0,
                               "bytes_up_per_site": 0, "seconds": central_s})
            with report.phase(f"{method}-stats"):
                start = time.perf_counter()
                run = stats_prune(model, windows, config)
                stats_s = time.perf_counter() - start
            differ, weight_gap = difference(central, run)
            weights = sum(m.numel() for layer in central.masks for m in layer.values())
            with report.phase(f"{method}-stats-eval"):
                ppl["stats"] = evaluate(apply_masks(copy.deepcopy(model), run.masks,
                                                    run.weights))
            per_round = sum(run.bytes_up_per_site) / layers
            report.add_result({"name": f"{method}-stats", **common, "perplexity": ppl["stats"],
                               "rounds": layers, "bytes_up_per_site": sum(run.bytes_up_per_site),
                               "bytes_up_per_site_per_round": per_round,
                               "mask_bits_differing": differ, "weights": weights,
                               "max_weight_difference": weight_gap, "seconds": stats_s,
                               "site_seconds_per_round": sum(run.site_seconds) / layers,
                               "server_seconds_per_round": sum(run.server_seconds) / layers})
            with report.phase(f"{method}-stats-secagg"):
                fixed = stats_prune(model, windows, config, frac_bits=opts.frac_bits)
            fixed_differ, fixed_gap = difference(run, fixed)
            with report.phase(f"{method}-stats-secagg-eval"):
                ppl["stats-secagg"] = evaluate(apply_masks(copy.deepcopy(model), fixed.masks,
                                                           fixed.weights))
            report.add_result({"name": f"{method}-stats-secagg", **common,
                               "perplexity": ppl["stats-secagg"], "rounds": layers,
                               "frac_bits": opts.frac_bits,
                               "mask_bits_differing_from_stats": fixed_differ,
                               "max_weight_difference_from_stats": fixed_gap})
            ppl["votes"], votes_s = float("nan"), float("nan")
            if not opts.no_votes:
                with report.phase(f"{method}-votes"):
                    start = time.perf_counter()
                    aggregator = MaskAggregator(model, len(windows))
                    for site in windows:
                        aggregator.add(flatten_masks(local_masks(model, site, config.prune,
                                                                 batch_size=opts.batch_size).masks))
                    voted = copy.deepcopy(model)
                    aggregator.prune(voted, config.server, config.prune.plan)
                    votes_s = time.perf_counter() - start
                with report.phase(f"{method}-votes-eval"):
                    ppl["votes"] = evaluate(voted)
                report.add_result({"name": f"{method}-votes", **common, "perplexity": ppl["votes"],
                                   "rounds": 1,
                                   "bytes_up_per_site": payload_nbytes(aggregator.shapes),
                                   "seconds": votes_s})
            rows.append([method, f"{ppl['centralized']:.3f}", f"{ppl['stats']:.3f}",
                         f"{100 * (ppl['stats'] / ppl['centralized'] - 1):+.3f}%",
                         f"{differ} of {weights}", f"{weight_gap:.2e}",
                         f"{ppl['stats-secagg']:.3f} ({fixed_differ} bits, "
                         f"{fixed_gap:.1e})",
                         f"{ppl['votes']:.3f}" if not opts.no_votes else "-",
                         f"{per_round / 1e6:.2f} MB x {layers}",
                         f"{central_s:.0f} / {stats_s:.0f} / "
                         + ("-" if opts.no_votes else f"{votes_s:.0f}")])
            logger.info("%s: centralized %.3f stats %.3f votes %.3f (%d bits differ)", method,
                        ppl["centralized"], ppl["stats"], ppl["votes"], differ)
        report.sections.append(("Statistics mode vs centralized and votes", markdown_table(
            ["method", "centralized ppl", "stats ppl", "stats vs centralized",
             "mask bits differing", "max weight diff",
             "stats over SecAgg+ ppl (bits, max weight diff vs stats)", "votes ppl",
             "bytes up per site",
             "seconds centralized / stats / votes (sites in sequence)"], rows)))
    report.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
