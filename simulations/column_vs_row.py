"""Why server *column* comparison hurts more on some models than others (FedPrLLM, Table 2).

    python simulations/column_vs_row.py --models smollm2-135m qwen2.5-0.5b \
        --out simulations/results/column-vs-row

Within one input column ``j`` every Wanda score ``|W_ij| * ||X_j||`` shares the factor
``||X_j||``, so keeping the top scores *per column* is column-wise magnitude pruning: it prunes
the same fraction of every input feature however large its activations are. Keeping them per
row (Wanda's own group, and what the row-local client masks vote for) prunes the features with
small activations first. The cost of column comparison therefore grows with how unequal the
activation norms ``||X_j||`` are. This script measures, per linear layer, on public calibration
windows (wiki validation split, forwarded through the Wanda-pruned layers like a client's pass):

* the inequality of the input-column norms: Gini coefficient, and the share of ``sum_j ||X_j||^2``
  held by the top 1% of columns;
* the output error each selection causes at each sparsity, ``sum_pruned (|W| ||X||)^2 /
  sum (|W| ||X||)^2`` (the relative squared error of the layer's output when input features
  are uncorrelated: the proxy Wanda and OBS minimise), for per-row and per-column selection
  (ties: lower index; float32), and their ratio column / row;
* the fraction of the weights of the top-1% columns (by ``||X_j||``) each selection prunes.

It computes no perplexity: compare with the column/row perplexity ratios of
``fedcompress bench simulations/bench_models.toml`` (and bench-wanda across sparsities).

Writes ``report.json`` (a result per model and linear layer, named ``"{model} {key}"``, its
linear name under ``linear``; the means per model under ``summary``), ``report.md`` (the summary
tables) and ``config.toml`` to ``--out`` (:class:`RunReport`).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from fedcompress.data.calibration import calibration_windows
from fedcompress.data.corpora import load_corpus
from fedcompress.masks.reference import linear_weights, reference_scores
from fedcompress.masks.stats import flatten_masks
from fedcompress.models import load_model
from fedcompress.pruning.local import PruneConfig, column_norms
from fedcompress.report import RunReport, markdown_table
from fedcompress.solver.select import select_prune_mask


def gini(x: np.ndarray) -> float:
    """Gini coefficient of non-negative values (0: all equal; towards 1: one holds all)."""
    x = np.sort(x.astype(np.float64))
    n = x.size
    if n == 0 or x.sum() == 0:
        return 0.0
    return float((2 * np.arange(1, n + 1) - n - 1) @ x / (n * x.sum()))


def pruned_error(scores: torch.Tensor, mask: torch.Tensor) -> float:
    """``sum_pruned s^2 / sum s^2`` in float32."""
    sq = scores.square()
    return float(sq[mask].sum() / sq.sum())


def measure(model_name: str, sparsities: list[float], windows: int, seqlen: int, seed: int
            ) -> dict:
    loaded = load_model(model_name, device="cpu")
    calib = calibration_windows(loaded.tokenizer, load_corpus("wiki", "validation"), windows,
                                seqlen, seed)
    start = time.perf_counter()
    norms = flatten_masks(column_norms(loaded.model, calib, PruneConfig("wanda", 0.5, "row"),
                                       progress=True))
    weights = linear_weights(loaded.model)
    layers = []
    for key, norm in norms.items():
        _, index, name = key.split(".", 2)
        w = weights[key]
        scores = reference_scores(w, norm)  # Wanda's |W_ij| * ||X_j||, float32
        sq = np.sort(norm.numpy().astype(np.float64) ** 2)[::-1]
        top = max(1, int(round(0.01 * sq.size)))
        row = {"key": key, "name": name, "layer": int(index), "gini": gini(norm.numpy()),
               "top1pct_share": float(sq[:top].sum() / sq.sum())}
        outliers = torch.topk(norm, top).indices
        for s in sparsities:
            by_row = select_prune_mask(scores, s, "row")
            by_col = select_prune_mask(scores, s, "column")
            row[f"row_{s}"], row[f"column_{s}"] = (pruned_error(scores, by_row),
                                                   pruned_error(scores, by_col))
            row[f"outliers_row_{s}"] = float(by_row[:, outliers].float().mean())
            row[f"outliers_column_{s}"] = float(by_col[:, outliers].float().mean())
        layers.append(row)
    return {"model": model_name, "windows": windows, "seqlen": seqlen, "seed": seed,
            "seconds": time.perf_counter() - start, "layers": layers}


def summarise(result: dict, sparsities: list[float]) -> dict:
    layers = result["layers"]
    names = sorted({r["name"] for r in layers}, key=[r["name"] for r in layers].index)
    out = {"gini": float(np.mean([r["gini"] for r in layers])),
           "top1pct_share": float(np.mean([r["top1pct_share"] for r in layers])),
           "by_name": {}}
    for s in sparsities:
        row = float(np.mean([r[f"row_{s}"] for r in layers]))
        col = float(np.mean([r[f"column_{s}"] for r in layers]))
        out[f"row_{s}"], out[f"column_{s}"], out[f"ratio_{s}"] = row, col, col / row
        for sel in ("row", "column"):
            out[f"outliers_{sel}_{s}"] = float(np.mean([r[f"outliers_{sel}_{s}"]
                                                        for r in layers]))
    for name in names:
        sub = [r for r in layers if r["name"] == name]
        s = sparsities[0]
        out["by_name"][name] = {
            "gini": float(np.mean([r["gini"] for r in sub])),
            "top1pct_share": float(np.mean([r["top1pct_share"] for r in sub])),
            "ratio": float(np.mean([r[f"column_{s}"] for r in sub]))
            / float(np.mean([r[f"row_{s}"] for r in sub]))}
    return out


def summary_tables(summaries: dict, sparsities: list[float]) -> tuple[str, str]:
    """The per-model means at every sparsity, and the per-linear-name means at the first."""
    overall = markdown_table(
        ["model", "Gini of ||X_j||", "top-1% columns' share of sum ||X_j||^2",
         *[c for s in sparsities for c in (
             f"output error at {s:.0%}: row / column (column/row)",
             f"top-1% columns' weights pruned at {s:.0%}: row / column")]],
        [[model, f"{s['gini']:.3f}", f"{s['top1pct_share']:.3f}",
          *[c for p in sparsities for c in (
              f"{s[f'row_{p}']:.4f} / {s[f'column_{p}']:.4f} ({s[f'ratio_{p}']:.2f}x)",
              f"{s[f'outliers_row_{p}']:.3f} / {s[f'outliers_column_{p}']:.3f}")]]
         for model, s in summaries.items()])
    by_name = markdown_table(
        ["model", "linear", "Gini of ||X_j||", "top-1% share", "output error column/row"],
        [[model, name, f"{v['gini']:.3f}", f"{v['top1pct_share']:.3f}", f"{v['ratio']:.2f}x"]
         for model, s in summaries.items() for name, v in s["by_name"].items()])
    return overall, by_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m"])
    parser.add_argument("--sparsities", nargs="+", type=float, default=[0.5, 0.6, 0.7])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="simulations/results/column-vs-row")
    opts = parser.parse_args()
    with RunReport.for_script(__file__, opts, seeds={"seed": opts.seed}) as report:
        report.markdown_results = False  # a record per linear layer: the summaries are shown
        summaries = {}
        for model in opts.models:
            with report.phase(f"measure {model}"):
                result = measure(model, opts.sparsities, opts.windows, opts.seqlen, opts.seed)
            summaries[model] = summarise(result, opts.sparsities)
            report.extra["summary"] = summaries
            report.extra.setdefault("models", {})[model] = {
                k: v for k, v in result.items() if k not in ("model", "layers")}
            for row in result["layers"]:
                report.add_result({"name": f"{model} {row['key']}", "model": model,
                                   "linear": row["name"],
                                   **{k: v for k, v in row.items() if k != "name"}})
        overall, by_name = summary_tables(summaries, opts.sparsities)
        report.sections += [
            ("Column vs row selection of Wanda scores",
             f"Public calibration: {opts.windows} wiki validation windows of {opts.seqlen} "
             "tokens through the Wanda-50%-pruned layers. Means over all linear layers.\n\n"
             + overall),
            (f"By linear layer (mean over decoder layers), sparsity {opts.sparsities[0]:.0%}",
             by_name)]
    print(report.markdown())


if __name__ == "__main__":
    main()
