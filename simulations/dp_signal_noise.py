"""Signal against noise in DP statistics mode, per input coordinate: why a DP release prunes as
it does (issue 30: "show how far it is and why: the noise per column against the signal").

    python simulations/dp_signal_noise.py --out simulations/results/dp-signal-noise

What is measured, for Wanda's square sums on the dense model (``--model``) and ``--sample``
calibration windows of ``--seqlen`` tokens of the calibration text (wiki train), for each
budget (``--budgets``: sites x windows, N windows in all), each epsilon (``--epsilons``), each
input normalization (``none``: the raw statistics; ``public``: each coordinate divided by its
public mean square first, :func:`fedcompress.privacy.dp_stats.public_calibration`), with or
without the server's shrinkage toward the public prior (:func:`fedcompress.privacy.dp_stats.
shrink`), and each quantile of the public window norms taken as the clip bound
(``--clip-quantiles``):

* the plan a run would use (:func:`fedcompress.methods.fedprllm.dp.plan`: public clip bounds,
  opacus' RDP accountant over every decoder layer's release, central placement, delta
  ``--delta``): the noise std of each block;
* per layer and block, each coordinate's expected signal, ``N`` times the mean over the sample
  of the windows' clipped (normalized) square sums (:func:`~fedcompress.privacy.dp_stats.
  window_sums` and :func:`~fedcompress.privacy.dp_stats.clip_factors`, what the sites sum), and
  its ratio to the noise std: the median and the 10th percentile of that ratio over the block's
  coordinates, and the share of coordinates below 1;
* the share of the windows clipped;
* the share of Wanda's mask bits (50%, the server's own per-layer step,
  :func:`fedcompress.methods.fedprllm.stats.prune_layer`) that differ between the no-DP sum
  (``N`` times the sample's mean raw statistics) and one noisy release of the expected clipped
  sum (:func:`fedcompress.methods.fedprllm.dp.server_finish`: the noise, the post-processing and
  the map back to the inputs' units), seeded (``--seed``).

The signal is an estimate: ``N`` times a ``--sample``-window mean, not a sum over ``N`` drawn
windows; every layer sees the DENSE model's inputs (a run's later layers see the pruned
model's). Nothing here is timed. Writes ``report.json``, ``report.md``, ``config.toml`` and
``signal_noise.png`` (the median ratio and the flipped bits per layer) to ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedcompress.report import RunReport, markdown_table

logger = logging.getLogger(__name__)

NORMALIZATIONS = ("none", "public")
#: (normalization, the server's prior) of every variant measured
VARIANTS = (("none", "none"), ("public", "none"), ("public", "shrink"))
_BUDGET = re.compile(r"(\d+)x(\d+)")


def parse_budget(text: str) -> tuple[int, int]:
    match = _BUDGET.fullmatch(text.strip())
    if match is None or min(int(match[1]), int(match[2])) < 1:
        raise argparse.ArgumentTypeError(f"budget {text!r}: expected SITESxWINDOWS, both >= 1, "
                                         "such as 16x64")
    return int(match[1]), int(match[2])


def _stats(vectors: dict[str, torch.Tensor], owners: dict[str, str], tokens: int
           ) -> dict[str, Any]:
    from fedcompress.pruning.walker import LayerStats

    made = {}
    for owner, vec in vectors.items():
        st = LayerStats(int(vec.shape[0]))
        st.sq_sum = vec.clone()
        st.tokens = tokens
        made[owner] = st
    return {name: made[owner] for name, owner in owners.items()}


def _flipped(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[int, int]:
    diff = sum(int(torch.count_nonzero(a[k].bool() ^ b[k].bool())) for k in a)
    return diff, sum(int(a[k].numel()) for k in a)


def measure(opts: argparse.Namespace, report: RunReport) -> list[dict[str, Any]]:
    from fedcompress.data.calibration import calibration_windows
    from fedcompress.data.corpora import load_corpus
    from fedcompress.methods.fedprllm import dp as dpm
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig
    from fedcompress.methods.fedprllm.stats import layer_sharing, prune_layer
    from fedcompress.models import ModelAdapter, load_model
    from fedcompress.privacy import dp_stats as dps
    from fedcompress.pruning.walker import capture_layer_inputs, forward_layer

    lm = load_model(opts.model, device="cpu")
    model = lm.model
    n_layers = len(ModelAdapter(model))
    windows = calibration_windows(lm.tokenizer, load_corpus(opts.calib_text, "train"),
                                  opts.sample, opts.seqlen, opts.seed)
    base = dict(model=opts.model, method="wanda", sparsity=0.5, seqlen=opts.seqlen,
                aggregate="stats", dp_placement="central", dp_delta=opts.delta,
                batch_size=opts.batch_size)
    cells = [(b, e, v, q) for b in opts.budgets for e in opts.epsilons for v in VARIANTS
             for q in opts.clip_quantiles]
    plans, calibs = {}, {}
    with report.phase("public calibration"):
        for norm in NORMALIZATIONS:
            for q in opts.clip_quantiles:
                config = FedPrLLMConfig(**base, dp_epsilon=1.0, dp_normalize=norm,
                                        dp_clip_quantile=q, dp_prior="none")
                request = dpm.DpRequest.from_config(config, n_layers, 1)
                calibs[norm, q] = dpm.public_calibration(model, lm.tokenizer, request, False,
                                                         opts.batch_size)
        for (sites, per), eps, (norm, prior), q in cells:
            config = FedPrLLMConfig(**base, dp_epsilon=eps, dp_normalize=norm, clients=sites,
                                    samples_per_client=per, dp_clip_quantile=q, dp_prior=prior)
            request = dpm.DpRequest.from_config(config, n_layers, sites)
            plans[(sites, per), eps, (norm, prior), q] = dpm.plan(
                request, calibs[norm, q], dpm.block_dims(model, calibs[norm, q].bounds, False))
    prune = FedPrLLMConfig(**base).prune
    out = {cell: {"layers": []} for cell in cells}
    adapter = ModelAdapter(model)
    inputs = capture_layer_inputs(model, windows, opts.batch_size)
    rng = np.random.default_rng(opts.seed)
    with report.phase("layers"):
        for layer in range(n_layers):
            with adapter.onloaded(layer) as module:
                owners = dps.layer_blocks(module, inputs)
                raw_parts: dict[str, list[torch.Tensor]] = {}
                for _s, sq, _h in dps.window_sums(module, inputs, False, opts.batch_size):
                    for k, v in sq.items():
                        raw_parts.setdefault(k, []).append(v)
                raw = {k: torch.cat(v) for k, v in raw_parts.items()}
                sharing = layer_sharing(model, layer)
                for cell in cells:
                    (sites, per), eps, (norm, prior), q = cell
                    plan = plans[cell]
                    n = sites * per
                    tokens = n * opts.seqlen
                    scales = plan.layer_scales(layer)
                    per_window = ({k: v / scales[k] for k, v in raw.items()}
                                  if scales is not None else raw)
                    factors = dps.clip_factors(
                        {k: torch.linalg.vector_norm(v, dim=1) for k, v in per_window.items()},
                        plan.bounds[layer])
                    signal = {k: n * (factors[k][:, None] * v).mean(0)
                              for k, v in per_window.items()}
                    std = plan.noise_std(layer)
                    ratios = {k: (signal[k] / std[k]).numpy() for k in signal}
                    truth = prune_layer(model, layer,
                                        _stats({k: n * v.mean(0) for k, v in raw.items()},
                                               owners, tokens), prune)[0]
                    noisy = dpm.server_finish(_stats(signal, owners, tokens), sharing, plan,
                                              layer, False, sites,
                                              np.random.default_rng(rng.integers(2 ** 63)),
                                              prior=prior)
                    flips, bits = _flipped(truth, prune_layer(model, layer, noisy, prune)[0])
                    all_ratios = np.concatenate(list(ratios.values()))
                    out[cell]["layers"].append({
                        "layer": layer,
                        "median_snr": float(np.median(all_ratios)),
                        "p10_snr": float(np.quantile(all_ratios, 0.1)),
                        "below_one": float((all_ratios < 1).mean()),
                        "blocks": {k: {"median_snr": float(np.median(r)),
                                       "p10_snr": float(np.quantile(r, 0.1)),
                                       "clipped": float((factors[k] < 1).double().mean())}
                                   for k, r in ratios.items()},
                        "flipped": flips / bits})
                if layer + 1 < n_layers:
                    inputs = forward_layer(module, inputs, opts.batch_size)
            logger.info("layer %d/%d", layer + 1, n_layers)
    records = []
    for cell in cells:
        (sites, per), eps, (norm, prior), q = cell
        layers = out[cell]["layers"]
        plan = plans[cell]
        records.append({
            "name": f"{sites}x{per} eps {eps:g} {norm} {prior} q{q:g}",
            "budget": f"{sites}x{per}", "windows": sites * per, "epsilon": eps,
            "normalize": norm, "prior": prior, "clip_quantile": q,
            "sigma": plan.sigma,
            "releases": plan.releases,
            "median_snr": float(np.median([x["median_snr"] for x in layers])),
            "p10_snr": float(np.median([x["p10_snr"] for x in layers])),
            "below_one": float(np.mean([x["below_one"] for x in layers])),
            "clipped": float(np.mean([b["clipped"] for x in layers
                                      for b in x["blocks"].values()])),
            "flipped": float(np.mean([x["flipped"] for x in layers])),
            "layers": layers})
    return records


def plot(records: list[dict[str, Any]], budget: str, epsilon: float, quantile: float,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [r for r in records if r["budget"] == budget and r["epsilon"] == epsilon
              and r["clip_quantile"] == quantile]
    if not chosen:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in chosen:
        xs = [x["layer"] for x in r["layers"]]
        ax1.plot(xs, [x["median_snr"] for x in r["layers"]], marker="o", ms=3,
                 label=f"normalize {r['normalize']}, prior {r['prior']}")
        ax2.plot(xs, [100 * x["flipped"] for x in r["layers"]], marker="o", ms=3,
                 label=f"normalize {r['normalize']}, prior {r['prior']}")
    ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax1.set_yscale("log")
    ax1.set_xlabel("decoder layer")
    ax1.set_ylabel("median signal / noise std per coordinate")
    ax2.set_xlabel("decoder layer")
    ax2.set_ylabel("Wanda mask bits flipped by the noise (%)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"DP statistics, Wanda square sums: {budget} windows, epsilon {epsilon:g}, "
                 f"clip at the public q{quantile:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budgets", nargs="+", type=parse_budget,
                        default=[(16, 4), (16, 64)], help="sites x windows, e.g. 16x64")
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1, 2, 4, 8, 16])
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--clip-quantiles", nargs="+", type=float, default=[0.95],
                        help="quantiles of the public window norms taken as the clip bound")
    parser.add_argument("--sample", type=int, default=128,
                        help="calibration windows the expected signal is estimated from")
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--calib-text", default="wiki")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot-budget", default="16x64")
    parser.add_argument("--plot-epsilon", type=float, default=8.0)
    parser.add_argument("--out", default="simulations/results/dp-signal-noise")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with RunReport.for_script(__file__, opts, seeds={"seed": opts.seed}) as report:
        records = measure(opts, report)
        for record in records:
            report.add_result(record)
        rows = [[r["budget"], f"{r['epsilon']:g}", r["normalize"], r["prior"],
                 f"{r['clip_quantile']:g}", f"{r['sigma']:.3g}",
                 f"{r['median_snr']:.3g}", f"{r['p10_snr']:.3g}",
                 f"{100 * r['below_one']:.1f}%", f"{100 * r['clipped']:.1f}%",
                 f"{100 * r['flipped']:.1f}%"] for r in records]
        report.sections.append(("Signal against noise per coordinate", markdown_table(
            ["budget", "epsilon", "normalize", "prior", "clip quantile", "sigma",
             "median signal/noise",
             "10th pct signal/noise", "coordinates below 1", "windows clipped",
             "mask bits flipped"], rows)
            + f"\n\n{opts.model}, Wanda 50% (row groups), central noise, delta {opts.delta:g}, "
              f"every decoder layer's release composed; signal = N x the mean of "
              f"{opts.sample} windows of {opts.seqlen} tokens ({opts.calib_text} train) through "
              "the dense model; the ratio's median over a layer's coordinates, then over the "
              "layers (10th percentile likewise); flipped bits: one seeded noise draw per layer "
              "against the no-DP mask, mean over the layers."))
        plot(records, opts.plot_budget, opts.plot_epsilon, opts.clip_quantiles[0],
             Path(opts.out) / "signal_noise.png")
    print(report.markdown())


if __name__ == "__main__":
    main()
