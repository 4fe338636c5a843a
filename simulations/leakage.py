"""Leakage analysis of shared prune masks (FedPrLLM App. C) as a table, measured on one model.

    python simulations/leakage.py --out simulations/results/leakage [--layers 6]

The experiments (definitions in :mod:`fedcompress.privacy.leakage`, the run in
:mod:`fedcompress.bench.leakage`) are those of a bench study
``[study.NAME] kind = "leakage"`` (``fedcompress bench``, resumable, several settings in one
table); this script runs one of them with command-line options: ``--group`` is the masks'
(local) comparison group, ``--windows-per-client`` W, ``--corpus``/``--split`` the calibration
corpus.

Writes ``report.json`` (options, versions, phase timings, the headline distributions as
results, and every number under ``scope``, ``plan``, ``mask_seconds``, ``information``,
``hamming``, ``sensitivity``, ``membership``), ``report.md`` and ``config.toml`` to ``--out``
(:class:`~fedcompress.report.RunReport`).
"""

from __future__ import annotations

import argparse
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fedcompress.bench.leakage import (  # noqa: E402
    LeakageConfig,
    headline,
    measure,
    sections,
)
from fedcompress.report import RunReport  # noqa: E402

logger = logging.getLogger("leakage")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="simulations/results/leakage")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default=None, help="default: CUDA when available, else CPU")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--method", default="wanda")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--group", default="row", help="local comparison group")
    p.add_argument("--corpus", default="wiki")
    p.add_argument("--split", default="train")
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--windows-per-client", type=int, default=4)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--replacements", type=int, default=2,
                   help="fresh windows replacing each client's target window")
    p.add_argument("--half-overlap", type=int, default=4,
                   help="clients whose mask is compared with one sharing half their windows")
    p.add_argument("--nonmembers", type=int, default=12,
                   help="fresh non-member candidates of the reference attacker")
    p.add_argument("--layers", type=int, default=6,
                   help="measure the first N decoder layers (0: all)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def config_of(args: argparse.Namespace) -> LeakageConfig:
    """The experiment's settings from the command-line options."""
    return LeakageConfig(
        model=args.model, dtype=args.dtype, method=args.method, sparsity=args.sparsity,
        local_group=args.group, calib_text=args.corpus, calib_split=args.split,
        seqlen=args.seqlen, samples_per_client=args.windows_per_client, clients=args.clients,
        replacements=args.replacements, half_overlap=args.half_overlap,
        nonmembers=args.nonmembers, layers=args.layers or 0, batch_size=args.batch_size,
        seed=args.seed)


def run(args: argparse.Namespace) -> RunReport:
    """Every experiment, written through a :class:`RunReport` under ``args.out``."""
    with RunReport.for_script(__file__, args, seeds={"seed": args.seed}) as report:
        result = measure(config_of(args), args.device, report.timings)
        report.extra.update({k: v for k, v in result.items() if k != "config"})
        report.sections.extend(sections(result))
        report.write()
        for name, summary in headline(result):
            report.add_result({"name": name, **summary})
    return report


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    report = run(args)
    print(report.markdown())
    logger.info("wrote %s in %.0fs", args.out, sum(report.timings.values()))


if __name__ == "__main__":
    main()
