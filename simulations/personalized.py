"""Federated personalized layer pruning against uniform FedPrLLM and local-only pruning, per site.

    python simulations/personalized.py --out simulations/results/personalized

Non-IID sites (Dirichlet over the wiki, shakespeare and code corpora, alpha 0.1): each site
classifies the units of the model on its calibration windows (Alg. 1 of seed 004), the server
counts the classes, votes masks at the global plan, and each site keeps its personalized units
with local masks (:mod:`fedcompress.methods.personalize`). Every model is scored by the
perplexity of the site's OWN held-out windows (the test split of its corpora, the same source
mixture as its calibration windows), at equal overall sparsity for every method:

* ``dense``: the unpruned model;
* ``local-only``: the site's own Wanda masks at ``p`` (no federation);
* ``fedprllm``: uniform FedPrLLM, one global mask at ``p`` for every site (server group layer);
* ``seed004-local``: the paper's method alone at the site (Eq. 4 on its own classes, local
  masks);
* ``personalized``: the federated design above.

Writes ``results.json`` (every number, the classes, the command line) and ``report.md`` (one
table per sparsity), and ``unit-classes.png`` (per-unit class frequency across sites).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fedcompress.layers.personalized import Classification, classify_units, units_of
from fedcompress.methods import personalize as pz
from fedcompress.methods.fedprllm.config import FedPrLLMConfig
from fedcompress.methods.fedprllm.federated import MaskAggregator, federation_windows, mask_key
from fedcompress.models import load_model
from fedcompress.pruning.local import apply_masks, local_masks, sparsity_report

logger = logging.getLogger("personalized")

#: The models a site can score at each sparsity (module docstring).
METHODS = ("local-only", "fedprllm", "seed004-local", "personalized")


def _flat(masks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {mask_key(i, n): m for i, layer in enumerate(masks) for n, m in layer.items()}


def _score(model, masks, windows, batch_size) -> tuple[float, float]:
    pruned = apply_masks(copy.deepcopy(model), masks)
    result = (pz.windows_perplexity(pruned, windows, batch_size),
              sparsity_report(pruned)["overall"])
    del pruned
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpora", default="wiki+shakespeare+code")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--windows", type=int, default=4, help="calibration windows per site")
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.5, 0.6, 0.7])
    parser.add_argument("--k", type=int, default=4, help="units per draw (Random Number)")
    parser.add_argument("--max-iter", type=int, default=32)
    parser.add_argument("--granularity", default="sublayer")
    parser.add_argument("--zero", default="weights")
    parser.add_argument("--group", default="layer", help="server comparison group")
    parser.add_argument("--importance", default="wanda", choices=pz.IMPORTANCES,
                        help="weight importance of every mask (Table V: weight vs gradient)")
    parser.add_argument("--personalized-factor", type=float, default=0.5,
                        help="Eq. 4 factor of personalized units (0: never pruned, Table VI)")
    parser.add_argument("--others-factor", type=float, default=0.75)
    parser.add_argument("--adapt-steps", type=int, default=0,
                        help="LoRA steps on a site's windows before Alg. 1 (0: none)")
    parser.add_argument("--adapt-lr", type=float, default=1e-3)
    parser.add_argument("--methods", default="local-only,fedprllm,seed004-local,personalized",
                        help="comma-separated models scored at each sparsity")
    parser.add_argument("--classes-from", default=None, metavar="RESULTS_JSON",
                        help="reuse the sites' classes of a finished run with the same data and "
                             "Alg. 1 settings (checked) instead of classifying again")
    parser.add_argument("--resume", action="store_true",
                        help="keep OUT/results.json's finished sparsities and classes; compute "
                             "the missing sparsities")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="simulations/results/personalized")
    parser.add_argument("--render", action="store_true",
                        help="only write report.md and the plot from OUT/results.json")
    args = parser.parse_args(argv)
    if args.render:
        stored = json.loads((Path(args.out) / "results.json").read_text())
        _report(stored, Path(args.out))
        pz.plot_unit_classes(pz.UnitCounts(stored["classes"]["counts"],
                                           stored["classes"]["classes"]),
                             Path(args.out) / "unit-classes.png")
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    loaded = load_model(args.model, device="cpu")
    model, tokenizer = loaded.model, loaded.tokenizer
    cfg = FedPrLLMConfig(model=args.model, clients=args.clients,
                         samples_per_client=args.windows, seqlen=args.seqlen,
                         partition="dirichlet", alpha=args.alpha, seed=args.seed,
                         calib_text=args.corpora, calib_split="train")
    calib, calib_sources = federation_windows(tokenizer, cfg)
    held, held_sources = federation_windows(tokenizer, cfg.replace(calib_split="test"))
    if calib_sources != held_sources:
        raise RuntimeError("held-out windows do not follow the calibration mixture")
    sites = range(args.clients)
    mixture = [dict(sorted(((s, src.count(s)) for s in set(src)))) for src in calib_sources]
    results: dict = {"command": "python " + shlex.join([sys.argv[0], *sys.argv[1:]]),
                     "args": vars(args), "sources": mixture, "dense": [], "sparsities": {}}
    results["dense"] = [pz.windows_perplexity(model, held[s], args.batch_size) for s in sites]

    source = Path(args.classes_from) if args.classes_from else (
        out / "results.json" if args.resume and (out / "results.json").exists() else None)
    previous = json.loads(source.read_text()) if source else None
    classify_args = ("model", "corpora", "clients", "alpha", "windows", "seqlen", "k",
                     "max_iter", "granularity", "zero", "seed", "adapt_steps", "adapt_lr")
    if previous is not None:
        stored = previous["args"]
        differ = [a for a in classify_args
                  if stored.get(a, parser.get_default(a)) != getattr(args, a)]
        if differ:
            raise SystemExit(f"{source}: its classes come from other settings "
                             f"({', '.join(f'{a}={stored.get(a)!r}' for a in differ)}): "
                             "expected the same data and Alg. 1 settings")
        classifications = [Classification(c["classes"], units_of(model, args.granularity),
                                          c["threshold"], c["draws"], c.get("adapt_losses", []))
                           for c in previous["classes"]["sites"]]
        results["classify_seconds"] = previous["classify_seconds"]
        results["classes_from"] = str(source)
        if args.resume and source == out / "results.json":
            results["sparsities"] = previous["sparsities"]
            results["errors_before"] = previous.get("errors", [])
        logger.info("classes of %d sites from %s", len(classifications), source)
    else:
        t = time.perf_counter()
        classifications = [classify_units(model, calib[s], pz.classify_config(
            args.k, args.max_iter, args.granularity, args.zero, args.seed, s, args.batch_size,
            args.adapt_steps, args.adapt_lr)) for s in sites]
        results["classify_seconds"] = time.perf_counter() - t
    counts = pz.global_classes([c.classes for c in classifications])
    units = units_of(model, args.granularity)
    results["classes"] = {"sites": [c.to_dict() for c in classifications],
                          **counts.to_dict()}
    factors = {"generic": 1.0, "personalized": args.personalized_factor,
               "others": args.others_factor}
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"--methods {unknown}: expected some of {', '.join(METHODS)}")

    errors: list[dict] = []
    results["errors"] = errors
    for p in args.sparsities:
        if str(p) in results["sparsities"]:
            logger.info("sparsity %.2f: finished in %s", p, source)
            continue
        logger.info("sparsity %.2f", p)
        row: dict = {m: [] for m in methods}
        sparsity: dict = {m: [] for m in row}
        prune = pz.PersonalizeConfig(sparsity=p, importance=args.importance)
        local: list = []
        uniform_masks = None
        if {"local-only", "fedprllm"} & set(methods):
            # uniform FedPrLLM and local-only: the sites' masks at p
            uniform = MaskAggregator(model, args.clients)
            for s in sites:
                masks = local_masks(model, calib[s], prune.prune_config(),
                                    batch_size=args.batch_size).masks
                local.append(masks)
                uniform.add(_flat(masks))
            uniform_masks = pz.masks_by_layer_list(pz.shared_masks(
                uniform.counts(), pz.SparsityPlan(p), set(), model, args.group), model)
        voted_counts, plan = None, None
        try:
            plan = pz.site_classes_plan(units, counts.classes, model, p, factors)
        except ValueError as err:  # Eq. 4 cannot reach p on the global classes: recorded
            errors.append({"sparsity": p, "site": "all", "method": "global plan",
                           "error": str(err)})
        if "personalized" in methods and plan is not None:
            voted = MaskAggregator(model, args.clients)
            for s in sites:
                voted.add(_flat(local_masks(model, calib[s], prune.prune_config(plan.to_text()),
                                            batch_size=args.batch_size).masks))
            voted_counts = voted.counts()
        for s in sites:
            c = classifications[s]
            personal = pz.personal_linears(c)
            plans = {}
            for name, classes in (("seed004-local", c.classes),
                                  ("personalized", pz.site_view(c, counts))):
                if name not in methods or (name == "personalized" and voted_counts is None):
                    continue
                try:
                    plans[name] = pz.site_classes_plan(units, classes, model, p, factors)
                except ValueError as err:  # Eq. 4 cannot reach p for this site: recorded
                    errors.append({"sparsity": p, "site": s, "method": name,
                                   "error": str(err)})
            candidates = {}
            if "local-only" in methods:
                candidates["local-only"] = local[s]
            if uniform_masks is not None and "fedprllm" in methods:
                candidates["fedprllm"] = uniform_masks
            if "seed004-local" in plans:
                candidates["seed004-local"] = pz.site_masks(
                    model, calib[s], plans["seed004-local"], None, batch_size=args.batch_size,
                    importance=args.importance)
            if "personalized" in plans:
                assert voted_counts is not None
                candidates["personalized"] = pz.site_masks(
                    model, calib[s], plans["personalized"],
                    pz.shared_masks(voted_counts, plans["personalized"], personal, model,
                                    args.group), batch_size=args.batch_size,
                    importance=args.importance)
            for name in row:
                if name not in candidates:
                    row[name].append(float("nan"))
                    sparsity[name].append(float("nan"))
                    continue
                ppl, achieved = _score(model, candidates[name], held[s], args.batch_size)
                row[name].append(ppl)
                sparsity[name].append(achieved)
        wins = (sum(a < b for a, b in zip(row["personalized"], row["fedprllm"])
                    if not math.isnan(a))
                if {"personalized", "fedprllm"} <= set(row) else None)
        results["sparsities"][str(p)] = {"perplexity": row, "sparsity": sparsity,
                                         "global_plan": plan.to_dict() if plan else None,
                                         "personalized_beats_fedprllm": wins}
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    results["seconds"] = time.perf_counter() - start
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    _report(results, out)
    pz.plot_unit_classes(counts, out / "unit-classes.png")


def _report(results: dict, out: Path) -> None:
    total = (f"{results['seconds'] / 60:.1f} min; " if "seconds" in results
             else "did not finish: the sparsities below are those it completed; ")
    lines = ["# Federated personalized layer pruning, per site", "",
             f"Command: `{results['command']}` ({total}"
             f"classification {results['classify_seconds']:.0f} s).", "",
             "Perplexity of each site's own held-out windows (lower is better).", ""]
    for p, data in results["sparsities"].items():
        ppl, sp = data["perplexity"], data["sparsity"]
        names = list(ppl)
        lines += [f"## Sparsity {p}", "",
                  "| site | sources | dense | " + " | ".join(names) + " |",
                  "|---|---|---|" + "---|" * len(names)]
        for s, dense in enumerate(results["dense"]):
            src = ", ".join(f"{k} {v}" for k, v in results["sources"][s].items())
            lines.append(f"| {s} | {src} | {dense:.2f} | "
                         + " | ".join(f"{ppl[n][s]:.2f}" if ppl[n][s] == ppl[n][s] else "-"
                                      for n in names) + " |")
        lines += ["", "Achieved sparsity (mean over sites): "
                  + ", ".join(f"{n} {np.nanmean(sp[n]):.4f}" for n in names) + ".",
                  (f"Personalized beats uniform FedPrLLM on "
                   f"{data['personalized_beats_fedprllm']} of {len(results['dense'])} sites."
                   if data.get("personalized_beats_fedprllm") is not None else ""),
                  ""]
    for error in results.get("errors_before", []) + results.get("errors", []):
        lines.append(f"- sparsity {error['sparsity']}, site {error['site']}, "
                     f"{error['method']}: {error['error']}")
    lines.append("")
    counts = results["classes"]["counts"]
    lines += ["## Global classes", "", "| unit | personalized | generic | others | global |",
              "|---|---|---|---|---|"]
    for unit, c in counts.items():
        lines.append(f"| {unit} | {c['personalized']} | {c['generic']} | {c['others']} | "
                     f"{results['classes']['classes'][unit]} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
