"""Running a bench sweep and writing its report through :class:`fedcompress.report.RunReport`:
``report.json`` (every cell), ``report.md`` (one paper-shaped table per study, the server's cost
next to the clients', mask statistics) and PNG plots."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from fedcompress.bench import plots
from fedcompress.bench.studies import KINDS
from fedcompress.bench.sweep import (
    BenchConfigError,
    BenchRunner,
    Federation,
    Study,
    kind_overrides,
    load_bench,
    plan,
    provenance,
)
from fedcompress.bench.tables import study_markdown
from fedcompress.report import RunReport, markdown_table

logger = logging.getLogger(__name__)


def run_bench(config_path: str | Path, out: str | Path | None = None,
              overrides: dict | None = None, device: str | None = None,
              progress: bool = True, dry_run: bool = False,
              federation: Federation | None = None) -> RunReport:
    """Plan, run the pending cells (resuming ``out``), and write the report. ``federation``:
    what runs the FedPrLLM cells (:class:`~fedcompress.bench.sweep.Federation`; the
    composition root gives it: the ``bench`` command of ``fedcompress/cli.py``)."""
    raw = load_bench(config_path)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    studies = plan(raw, overrides)
    out = Path(out or raw.get("bench", {}).get("out") or f"runs/bench-{Path(config_path).stem}")
    device = device or raw.get("bench", {}).get("device")
    _check_same_bench(out, raw)
    saved = {"bench": dict(raw.get("bench", {})),
             "study": {name: {**table, **kind_overrides(table.get("kind", "fedprllm"),
                                                        overrides)}
                       for name, table in raw["study"].items()}}
    runner = BenchRunner(studies, out, device=device, progress=progress,
                         cache=raw.get("bench", {}).get("cache"), federation=federation)
    report = RunReport(out, "bench", saved)
    report.reproduce = f"fedcompress bench {out / 'config.toml'} --out {out}"
    report.markdown_results = False  # every cell is in report.json; the tables are above
    pending = runner.pending()
    report.extra["plan"] = {"cells": len(runner.cells()), "pending": len(pending)}
    logger.info("bench %s: %d studies, %d cells, %d pending", config_path, len(studies),
                len(runner.cells()), len(pending))
    with report:
        if dry_run:
            _update(report, runner, studies)
            report.exit_status = "planned"
            return report
        runner.on_result = lambda record: _update(report, runner, studies)
        try:
            with report.phase("sweep"):
                runner.run()
        finally:
            _update(report, runner, studies)  # what finished, also when the sweep fails
        with report.phase("plots"):
            _update(report, runner, studies, with_plots=True)
        failed = [r for r in runner.results.values() if r.get("status") != "ok"]
        report.exit_status = "ok" if not failed else "incomplete"
    return report


def _check_same_bench(out: Path, raw: dict) -> None:
    """An existing ``out`` must hold the report of the same studies: another config's run
    would replace that report (its finished cells would survive, its tables would not)."""
    path = out / "report.json"
    if not path.exists():
        return
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # an unreadable report is rewritten
    if report.get("command") != "bench":
        return  # a former study command's folder: its cells are read (load_results)
    old = sorted(report.get("config", {}).get("study", {}))
    new = sorted(raw.get("study", {}))
    if old and old != new:
        raise BenchConfigError(f"{out} holds the report of studies {old}, this config has "
                               f"{new}: use another --out (the report there would be replaced)")


def _update(report: RunReport, runner: BenchRunner, studies: list[Study],
            with_plots: bool = False) -> None:
    ids = {cell.id for cell in runner.cells()}
    records = [r for i, r in runner.results.items() if i in ids]
    report.results = [{"name": r.get("name", r["kind"]), **r} for r in records]
    extra: list[tuple[str, str]] = []  # first: a kind's sections may complete its options
    for study in studies:
        sections = KINDS[study.kind].sections if study.kind in KINDS else None
        extra += sections(study, runner.out) if sections else []
    report.extra["studies"] = {s.name: {"title": s.title, "kind": s.kind, "swept": s.swept,
                                        "columns": s.columns, "options": s.options,
                                        "cells": [c.id for c in s.cells]} for s in studies}
    report.extra["mask_stats"] = runner.stats
    report.extra["provenance"] = provenance(records)
    report.sections = [(f"Study `{s.name}`", study_markdown(s, runner.results))
                       for s in studies]
    report.sections += extra
    accuracy = accuracy_table(records)
    if accuracy:
        report.sections.append(("Zero-shot accuracy", accuracy))
    cost = server_cost(records)
    if cost:
        report.sections.append(("Server aggregation cost vs client mask computation", cost))
    if records:
        report.sections.append(("Where the cells were made", provenance_table(records)))
    failed = [r for r in records if r.get("status") != "ok"]
    if failed:
        report.sections.append(("Failed cells", markdown_table(
            ["cell", "settings", "error"],
            [[r["id"], _settings_text(r), r.get("error", "")] for r in failed])))
    if with_plots:
        pngs = make_plots(report.out_dir, runner, studies)
        if pngs:
            report.sections.append(("Plots", "\n".join(f"![{p.stem}]({p.name})" for p in pngs)))
    report.write()


def _settings_text(record: dict) -> str:
    keys = ("kind", "method", "sparsity", "local_group", "group", "scale", "mode", "clients",
            "samples_per_client", "partition", "alpha", "calib_text",
            # the other kinds' settings a failed cell is told apart by
            "task", "objective", "measure", "ratio", "epsilon", "eps", "synth_ratio",
            "prune_policy", "prune_ratio", "importance", "k", "personalized_factor",
            "adapt_steps")
    return ", ".join(f"{k}={record[k]}" for k in keys if k in record)


def accuracy_table(records: list[dict]) -> str:
    """Accuracy of every evaluated cell on each zero-shot task (``--tasks``), and their mean."""
    scored = [r for r in records if r.get("status") == "ok" and r.get("zero_shot")]
    if not scored:
        return ""
    tasks: list[str] = []
    for r in scored:
        tasks += [t for t in r["zero_shot"] if t not in tasks]
    rows = []
    for r in scored:
        accs = [r["zero_shot"][t]["acc"] if t in r["zero_shot"] else None for t in tasks]
        rows.append([r.get("name", r["kind"]), _settings_text(r),
                     *("-" if a is None else f"{a:.4f}" for a in accs),
                     f"{r['mean_acc']:.4f}" if "mean_acc" in r else "-"])
    return ("Accuracy (lm-eval's acc: the choice of highest log-likelihood) on each task of "
            "`tasks`, per evaluated model.\n\n"
            + markdown_table(["model", "settings", *tasks, "mean"], rows))


def server_cost(records: list[dict]) -> str:
    """Vote counting + global-mask selection per one-shot variant vs one client's masks."""
    rows = []
    for r in records:
        if (r.get("status") != "ok" or r.get("kind") != "fedprllm" or r.get("mode") != "oneshot"
                or r.get("aggregate", "votes") != "votes"):
            continue
        if r.get("client_seconds_mean") is None or r.get("aggregate_seconds") is None:
            continue
        total = r["count_seconds"] + r["aggregate_seconds"]
        rows.append([str(r.get("model", "-")), str(r["clients"]), str(r["samples_per_client"]),
                     r["method"],
                     str(r["sparsity"]),
                     f"{r['group']}{'+scale' if r['scale'] else ''}"
                     + (f", {r['wire']} wire" if r.get("wire", "packed") != "packed" else ""),
                     f"{r['client_seconds_mean']:.2f}", f"{r['count_seconds']:.3f}",
                     f"{r['aggregate_seconds']:.3f}",
                     f"{100 * total / r['client_seconds_mean']:.1f}%"])
    if not rows:
        return ""
    return ("Seconds on this machine, the same run: `client` is one client's mask computation "
            "(mean over clients, its own windows); `count` the vote counting of all clients' "
            "packed masks; `select+apply` the global mask by group and pruning of the model "
            "copy, one linear layer at a time per worker thread (the compiled kernels' one-off "
            "load is timed apart, not in these).\n\n" + markdown_table(
                ["model", "clients", "windows/client", "method", "sparsity", "server variant",
                 "client s", "count s", "select+apply s", "server / client"], rows))


def provenance_table(records: list[dict]) -> str:
    """Each distinct commit and CPU the cells were made at, with how many (a run resumed at
    another commit or on another machine keeps its finished cells)."""
    groups = provenance(records)
    rows = [[g["commit"] or "not recorded", g["cpu_model"] or "not recorded",
             g["cpu_capability"] or "-", "-" if g["torch_threads"] is None
             else str(g["torch_threads"]), str(len(g["cells"]))] for g in groups]
    text = markdown_table(["commit", "CPU", "kernels", "torch threads", "cells"], rows)
    if len(groups) > 1:
        text += ("\n\nThe cells were made at more than one commit or CPU: timings compare "
                 "only within a group, and float results (SparseGPT's and GPTQ's solves "
                 "above all) can differ across CPUs by their float floor. "
                 "`provenance` in report.json lists each group's cells.")
    return text


def make_plots(out: Path, runner: BenchRunner, studies: list[Study]) -> list[Path]:
    pngs: list[Path] = []
    for study in studies:
        if study.kind in KINDS:
            kind_plots = KINDS[study.kind].plots
            pngs += kind_plots(study, runner.results, out) if kind_plots else []
            continue
        path = plots.perplexity_curve(study, runner.results, out / f"ppl-{study.name}.png")
        if path:
            pngs.append(path)
    labels = {}
    for study in studies:
        for cell in study.cells:
            if cell.kind == "fedprllm" and cell.vote_id in runner.stats:
                s = cell.settings()
                attack = (f", {s['attackers']} {s['attack']} attackers" if s.get("attackers")
                          else "")
                labels[cell.vote_id] = (f"{s['method']} {s['sparsity']}, local {s['local_group']}"
                                          f", {s['clients']}x{s['samples_per_client']} "
                                          f"{s['partition']}"
                                          + (f"({s['alpha']})" if s['partition'] != "iid" else "")
                                          + (f" {s['calib_text']}" if s['calib_text'] != "wiki"
                                             else "") + attack)
    for fn, name in ((plots.vote_histograms, "vote-histogram.png"),
                     (plots.layer_agreement, "layer-agreement.png")):
        path = fn(runner.stats, labels, out / name)
        if path:
            pngs.append(path)
    return pngs
