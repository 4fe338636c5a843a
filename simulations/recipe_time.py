"""Each recipe federated against its centralized run: the time, side by side in one run.

    python simulations/recipe_time.py --out simulations/results/recipe-time

For each recipe of :data:`recipe_anchor.RECIPES` (``--recipes``; SparseGPT 50%, GPTQ W4A16,
SparseGPT 50% then GPTQ W4A16, the recipes the anchor compares with llm-compressor), run the
way a user runs it: :func:`fedcompress.compress` (the Flower Simulation Engine, ``--clients``
sites of ``--samples-per-client`` windows of ``--seqlen`` tokens, statistics mode, each site a
Ray actor of ``--cpus-per-client`` CPUs), with the centralized baseline in the same run (the
same recipe on the pooled windows in the server's process, the run a user without a federation
makes). Per stage: the federated seconds (the sites' start-up, their statistics layer by layer
and the server's compression, as the stage's report records them), the centralized seconds,
their ratio; per recipe the sums. Evaluation (``--eval-windows`` windows) is not timed.

Time it alone on the machine (no test suite, helper or other benchmark beside it); the load
average at the start and the end of each recipe is in the result. Writes ``report.json`` /
``report.md`` / ``config.toml`` (:class:`~fedcompress.report.RunReport`); the models go to
``--out``/``cache/`` (not committed with a result).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from recipe_anchor import (  # noqa: E402  (the anchor's three recipes, its options)
    checked_options,
    recipe_options,
    recipe_text,
)

logger = logging.getLogger("recipe_time")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = recipe_options(argparse.ArgumentParser(description=__doc__.split("\n")[0]),
                       "simulations/results/recipe-time", 8,
                       "evaluation windows of each model (not timed)")
    return checked_options(p, argv)


def stage_times(stage: str, report: dict[str, Any]) -> dict[str, Any]:
    """One stage's federated and centralized seconds from its run's report."""
    results = {r["name"]: r for r in report["results"]}
    fed = next((r for n, r in results.items() if n.startswith("fedprllm")), None)
    central = results.get("centralized")
    if fed is None or central is None:
        raise ValueError(f"stage {stage!r}: expected a federated and a centralized result, "
                         f"found {sorted(results)}")
    return {"stage": stage, "federated_seconds": fed["federated_seconds"],
            "startup_seconds": fed.get("startup_seconds"),
            "centralized_seconds": central["prune_seconds"],
            "ratio": fed["federated_seconds"] / central["prune_seconds"],
            "federated_perplexity": fed["perplexity"],
            "centralized_perplexity": central["perplexity"]}


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    logging.basicConfig(level=getattr(logging, opts.log_level.upper()),
                        format="%(asctime)s %(name)s %(message)s")
    from fedcompress.api import compress
    from fedcompress.report import RunReport

    out = Path(opts.out)
    report = RunReport.for_script(__file__, opts, seeds={"seed": opts.seed})
    (out / "recipes").mkdir(parents=True, exist_ok=True)
    with report:
        for name in opts.recipes:
            text = recipe_text(name, opts.group_size)
            path = out / "recipes" / f"{name}.yaml"
            path.write_text(text)
            load_start = [round(x, 2) for x in os.getloadavg()]
            with report.phase(name):
                result = compress(
                    str(path), model=opts.model, sites=opts.clients, text=opts.calib_text,
                    windows=opts.samples_per_client, seqlen=opts.seqlen, aggregate="stats",
                    out=out / "cache" / name, cpus_per_site=opts.cpus_per_client,
                    seed=opts.seed, batch_size=opts.batch_size,
                    eval_windows=opts.eval_windows, eval_seqlen=opts.eval_seqlen,
                    baselines="centralized", device="cpu")
            load_end = [round(x, 2) for x in os.getloadavg()]
            stages = [stage_times(s["stage"], r) for s, r in
                      zip(result.report["stages"], result.run.stages, strict=True)]
            report.extra.setdefault("stages", {})[name] = stages
            fed = sum(s["federated_seconds"] for s in stages)
            central = sum(s["centralized_seconds"] for s in stages)
            report.add_result({"name": name, "stages": len(stages), "federated_seconds": fed,
                               "centralized_seconds": central, "ratio": fed / central,
                               "load_average_start": load_start,
                               "load_average_end": load_end})
    report.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
