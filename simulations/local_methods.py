"""Centralized local pruning methods side by side on one model (the published ordering check).

    python simulations/local_methods.py --out simulations/results/local_methods.json

Magnitude, Wanda (row-local, as published) and SparseGPT (its own block-wise selection, with
the OBS weight update) at the same sparsity, calibrated on the same seeded windows of the
bundled wiki train split; perplexity on the first windows of the wiki test split.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

from fedcompress.data.calibration import calibration_windows
from fedcompress.data.corpora import corpus_text, load_corpus
from fedcompress.eval.perplexity import perplexity
from fedcompress.models import load_model
from fedcompress.pruning.local import PruneConfig, apply_masks, local_masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--windows", type=int, default=8, help="calibration windows")
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="simulations/results/local_methods.json")
    opts = parser.parse_args()
    loaded = load_model(opts.model, device="cpu")
    windows = calibration_windows(loaded.tokenizer, load_corpus("wiki", "train"), opts.windows,
                                  256, opts.seed)
    text = corpus_text(load_corpus("wiki", "test"))

    def ppl(model) -> float:
        return perplexity(model, loaded.tokenizer, text, 256, max_windows=opts.eval_windows,
                          progress=False).perplexity

    results = {"dense": {"perplexity": ppl(loaded.model)}}
    for method, group in (("magnitude", "row"), ("wanda", "row"), ("sparsegpt", "layer")):
        start = time.perf_counter()
        masks = local_masks(loaded.model, windows, PruneConfig(method, opts.sparsity, group),
                            keep_weights=True, progress=True)
        seconds = time.perf_counter() - start
        pruned = apply_masks(copy.deepcopy(loaded.model), masks.masks, masks.weights)
        results[method] = {"perplexity": ppl(pruned), "prune_seconds": seconds, "group": group}
        print(method, results[method], flush=True)
        del pruned
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps({"options": vars(opts), "results": results}, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
