"""Seed 004's ablations in shape, on the federated setting of ``simulations/personalized.py``.

    python simulations/personalized_ablations.py --out simulations/results/personalized-ablations

The same 8 non-IID sites (Dirichlet 0.1 over wiki, shakespeare and code, SmolLM2), every model
scored by the perplexity of each site's OWN held-out windows. Each variant is one run of the
personalized benchmark (its own folder under ``--out`` with results.json and report.md); runs
with the main run's Alg. 1 settings reuse its classes (``--classes-from``). The tables:

* **II, prune rate**: the paper's prune rate sets how much is pruned; here the overall sparsity
  ``p`` (every method prunes exactly ``p``), 0.3 to 0.7.
* **IV, Random Number**: ``k`` units switched off per draw, 2 / 4 / 8 (new classifications).
* **V, weight vs gradient**: the masks' importance, Wanda and magnitude (weight) vs first-order
  Taylor (gradient), uniform FedPrLLM and personalized with the same importance.
* **VI, prune personalized layers or not**: Eq. 4's personalized factor 0.5 (pruned at p/2,
  then rescaled) vs 0 (never pruned; the other units carry p).
* **Adaptation** (Alg. 1 line 2): classes from the model as is vs after 16 LoRA steps on each
  site's windows.

Unlike the paper, ``p`` is held fixed across a table (the plans are rescaled to it), so a
variant changes which weights go, never how many: the paper's tables move both at once.
Writes ``ablations.json`` and ``report.md`` (one table per ablation: mean and median
perplexity over the sites, sites where personalized beats uniform FedPrLLM, mean units per
class).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

logger = logging.getLogger("personalized_ablations")

HERE = Path(__file__).resolve().parent
BOTH = "fedprllm,seed004-local,personalized"
OURS = "seed004-local,personalized"

#: (table, variant, sparsity, extra arguments of the benchmark, reuse the main run's classes)
VARIANTS: list[tuple[str, str, float, list[str], bool]] = [
    ("II", "p=0.3", 0.3, ["--methods", BOTH], True),
    ("II", "p=0.4", 0.4, ["--methods", BOTH], True),
    ("IV", "k=2", 0.6, ["--k", "2", "--methods", OURS], False),
    ("IV", "k=8", 0.6, ["--k", "8", "--methods", OURS], False),
    ("V", "magnitude", 0.6, ["--importance", "magnitude", "--methods", BOTH], True),
    ("V", "gradient", 0.6, ["--importance", "gradient", "--methods", BOTH], True),
    ("VI", "personalized not pruned", 0.6,
     ["--personalized-factor", "0", "--methods", OURS], True),
    ("adapt", "16 LoRA steps", 0.6, ["--adapt-steps", "16", "--methods", OURS], False),
]

#: Rows every table takes from the main run (``--main``): (table, label, sparsity).
FROM_MAIN = [("II", "p=0.5", 0.5), ("II", "p=0.6", 0.6), ("II", "p=0.7", 0.7),
             ("IV", "k=4", 0.6), ("V", "wanda", 0.6), ("VI", "personalized pruned (p/2)", 0.6),
             ("adapt", "none", 0.6)]

TITLES = {
    "II": "Table II shape: overall sparsity (the paper's prune rate)",
    "IV": "Table IV shape: Random Number k (units per draw), 60%",
    "V": "Table V shape: weight vs gradient importance, 60%",
    "VI": "Table VI shape: prune the personalized units or not, 60%",
    "adapt": "Alg. 1 line 2: classes with and without a short LoRA adaptation, 60%",
}


def _bench():
    spec = importlib.util.spec_from_file_location("personalized_bench",
                                                  HERE / "personalized.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(results: dict, sparsity: float, main_results: dict) -> dict:
    data = results["sparsities"].get(str(sparsity))
    if data is None:
        return {}
    perplexity = dict(data["perplexity"])
    wins = data.get("personalized_beats_fedprllm")
    reference = main_results["sparsities"].get(str(sparsity), {}).get("perplexity", {})
    if "fedprllm" not in perplexity and "fedprllm" in reference and "personalized" in perplexity:
        perplexity["fedprllm"] = reference["fedprllm"]  # Wanda FedPrLLM of the main run
        wins = sum(a < b for a, b in zip(perplexity["personalized"], reference["fedprllm"])
                   if not math.isnan(a))
    row: dict = {}
    for name, values in perplexity.items():
        finite = [v for v in values if not math.isnan(v)]
        row[name] = {"mean": statistics.fmean(finite) if finite else math.nan,
                     "median": statistics.median(finite) if finite else math.nan,
                     "sites": len(finite)}
    row["wins"] = wins
    sites = results["classes"]["sites"]
    row["classes"] = {c: statistics.fmean(s["counts"][c] for s in sites)
                      for c in ("personalized", "generic", "others")}
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--main", default="simulations/results/personalized",
                        help="the main run's folder (its classes and its rows are reused)")
    parser.add_argument("--only", default="", help="comma-separated tables to run (default all)")
    parser.add_argument("--out", default="simulations/results/personalized-ablations")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    main_results = json.loads((Path(args.main) / "results.json").read_text())
    base = ["--model", main_results["args"]["model"], "--corpora",
            main_results["args"]["corpora"], "--clients", str(main_results["args"]["clients"]),
            "--windows", str(main_results["args"]["windows"])]
    tables = set(args.only.split(",")) if args.only else set(TITLES)
    bench = _bench()
    start = time.perf_counter()
    for table, variant, p, extra, reuse in VARIANTS:
        if table not in tables:
            continue
        folder = out / variant.replace(" ", "-").replace("=", "")
        if (folder / "results.json").exists() and str(p) in json.loads(
                (folder / "results.json").read_text())["sparsities"]:
            logger.info("%s %s: finished", table, variant)
            continue
        argv_run = [*base, "--sparsities", str(p), *extra, "--out", str(folder)]
        if reuse:
            argv_run += ["--classes-from", str(Path(args.main) / "results.json")]
        logger.info("%s %s: %s", table, variant, shlex.join(argv_run))
        bench.main(argv_run)
    rows: dict = {t: [] for t in TITLES}
    for table, label, p in FROM_MAIN:
        rows[table].append({"variant": label, "sparsity": p, "source": args.main,
                            **_row(main_results, p, main_results)})
    for table, variant, p, _extra, _reuse in VARIANTS:
        folder = out / variant.replace(" ", "-").replace("=", "")
        if (folder / "results.json").exists():
            rows[table].append({"variant": variant, "sparsity": p, "source": str(folder),
                                **_row(json.loads((folder / "results.json").read_text()), p,
                                       main_results)})
    command = "python " + shlex.join([sys.argv[0], *sys.argv[1:]])
    (out / "ablations.json").write_text(json.dumps(
        {"command": command, "seconds": time.perf_counter() - start, "tables": rows},
        indent=1) + "\n")
    _report(rows, command, main_results, out)


def _fmt(cell: dict | None, key: str = "mean") -> str:
    if not cell or math.isnan(cell[key]):
        return "-"
    return f"{cell[key]:.2f}"


def _report(rows: dict, command: str, main_results: dict, out: Path) -> None:
    sites = main_results["args"]["clients"]
    lines = ["# Seed 004's ablations on federated personalized pruning", "",
             f"Command: `{command}`.", "",
             f"{sites} non-IID sites (Dirichlet {main_results['args']['alpha']} over "
             f"{main_results['args']['corpora']}), {main_results['args']['model']}; perplexity "
             "of each site's own held-out windows, mean (median) over the sites; every model "
             "has the same overall sparsity within a row. `wins`: sites where personalized "
             "beats uniform FedPrLLM of the same row (FedPrLLM with Wanda from the main run "
             "where the row has none). Classes: mean units per site (of "
             f"{sum(main_results['classes']['sites'][0]['counts'].values())}).", ""]
    for table, title in TITLES.items():
        lines += [f"## {title}", "",
                  "| variant | p | uniform FedPrLLM | seed004 alone | personalized | wins | "
                  "personalized / generic / others units |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows[table]:
            if "classes" not in r:
                lines.append(f"| {r['variant']} | {r['sparsity']} | not run | | | | |")
                continue
            cls = r["classes"]
            wins = "-" if r.get("wins") is None else f"{r['wins']}/{sites}"
            lines.append(
                f"| {r['variant']} | {r['sparsity']} | "
                + " | ".join(f"{_fmt(r.get(m))} ({_fmt(r.get(m), 'median')})"
                             if r.get(m) else "-"
                             for m in ("fedprllm", "seed004-local", "personalized"))
                + f" | {wins} | {cls['personalized']:.1f} / {cls['generic']:.1f} / "
                  f"{cls['others']:.1f} |")
        lines.append("")
    (out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
