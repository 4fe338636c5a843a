"""PNG plots of a bench sweep (matplotlib, Agg backend): perplexity vs sparsity (or another
numeric swept setting, e.g. the number of attackers) per strategy,
the histogram of vote counts, the per-layer agreement between client masks, a network study's
simulated time per profile and a leakage study's mask distances."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path
from typing import Any

from fedcompress.bench.cells import Study
from fedcompress.bench.labels import strategy_label

logger = logging.getLogger(__name__)


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, ax, path: Path, title: str, xlabel: str, ylabel: str,
          legend_below: bool = False, ncol: int = 2) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(textwrap.fill(title, 72), fontsize=10)
    if legend_below:  # many lines across the whole plot: the legend under it
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=ncol)
    else:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    fig.clf()
    pyplot().close(fig)
    return path


#: Swept settings a curve can take as its x axis (numbers), in order of preference.
CURVE_AXES = ("sparsity", "attackers", "owl_lambda", "clients", "samples_per_client", "alpha")


def curve_axis(study: Study) -> str | None:
    """The x axis of a study's curve: its columns when they are a numeric swept setting, else
    the first swept of :data:`CURVE_AXES`; None when nothing numeric is swept."""
    if study.columns in CURVE_AXES and study.columns in study.swept:
        return study.columns
    return next((k for k in CURVE_AXES if k in study.swept), None)


def perplexity_curve(study: Study, results: dict[str, dict], path: Path) -> Path | None:
    """Perplexity against the study's numeric axis (:func:`curve_axis`: sparsity, the number of
    attackers, ...), one line per strategy and other swept setting; ``None`` when nothing
    numeric is swept."""
    axis = curve_axis(study)
    if axis is None:
        return None
    lines: dict[str, list[tuple[float, float]]] = {}
    for cell in study.cells:
        record = results.get(cell.id)
        if not record or record.get("status") != "ok" or cell.kind == "dense":
            continue
        settings = cell.settings()
        if axis not in settings:
            continue
        # (the strategy label names the server group, scaling and defence)
        others = [f"{k}={settings[k]}" for k in study.swept
                  if k not in (axis, "group", "scale", "tie_break", "defence", "trim")
                  and k in settings]
        label = ", ".join([strategy_label(settings), *others])
        lines.setdefault(label, []).append((settings[axis], record["perplexity"]))
    dense = [r["perplexity"] for c in study.cells if c.kind == "dense"
             and (r := results.get(c.id)) and r.get("status") == "ok"]
    return perplexity_lines(lines, dense[0] if dense else None, path, study.title, axis)


def perplexity_lines(lines: dict[str, list[tuple[float, float]]], dense: float | None,
                     path: Path, title: str, xlabel: str) -> Path | None:
    """Draw perplexity against ``xlabel``, one line per label of ``lines`` (its points sorted
    by x), the dense model as a dotted horizontal line; a log scale when the perplexities span
    more than a factor of 3. ``None`` when there is no line."""
    if not lines:
        return None
    many = len(lines) > 8  # the legend under the plot, the figure taller for it
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8 + (0.15 * (len(lines) + 1) if many else 0)))
    styles = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("x", "--")]
    for i, (label, points) in enumerate(sorted(lines.items())):
        xs, ys = zip(*sorted(points))
        marker, line = styles[i % len(styles)]  # lines that coincide stay visible
        ax.plot(xs, ys, marker=marker, linestyle=line, label=label, alpha=0.85)
    if dense is not None:
        ax.axhline(dense, color="grey", linestyle=":", label="Dense")
    values = [y for points in lines.values() for _, y in points]
    values += [] if dense is None else [dense]
    if max(values) > 3 * min(values):  # log scale only when perplexities span a wide range
        ax.set_yscale("log")
        return _save(fig, ax, path, title, xlabel, "perplexity (log scale)", many, ncol=1)
    return _save(fig, ax, path, title, xlabel, "perplexity", many, ncol=1)


def vote_histograms(stats: dict[str, dict], labels: dict[str, str], path: Path) -> Path | None:
    """Fraction of weights pruned by ``c`` of ``m`` clients, one line per client setting."""
    if not stats:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for client_id, item in stats.items():
        hist = item["vote_histogram"]
        total = sum(hist) or 1
        m = item["clients"]
        ax.plot([c / m for c in range(m + 1)], [h / total for h in hist], marker=".",
                label=labels.get(client_id, client_id))
    ax.set_yscale("log")
    return _save(fig, ax, path, "Vote counts of the client masks",
                 "vote count / clients (fraction of clients that prune the weight)",
                 "fraction of weights")


def layer_agreement(stats: dict[str, dict], labels: dict[str, str], path: Path) -> Path | None:
    """Mean pairwise Hamming distance between client masks per decoder layer."""
    items = {k: v for k, v in stats.items() if "agreement_per_layer" in v}
    if not items:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for client_id, item in items.items():
        layers = sorted(item["agreement_per_layer"], key=int)
        ax.plot([int(layer) for layer in layers],
                [item["agreement_per_layer"][layer]["mean_pairwise_hamming"] for layer in layers],
                marker=".", label=labels.get(client_id, client_id))
    return _save(fig, ax, path, "Disagreement between client masks per layer",
                 "decoder layer", "mean pairwise Hamming distance")


def network_times(study: Study, rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Simulated end-to-end seconds per network profile of a network study, one line per row
    of its table (strategy, other settings, straggler fraction): ``rows`` are
    :func:`fedcompress.bench.studies.network_rows` of the study's results."""
    rows = [r for r in rows if r["status"] == "ok"]
    if not rows:
        return None
    profiles = study.options["profiles"]
    several = len(study.options["stragglers"]) > 1
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8 + 0.12 * len(rows)))
    styles = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("x", "--")]
    values = []
    for i, row in enumerate(rows):
        label = ", ".join([row["strategy"], *(f"{k}={v}" for k, v in row["settings"].items()),
                           *([f"{row['stragglers']:.0%} stragglers"] if several else [])])
        ys = [row["seconds"][p] for p in profiles]
        values += ys
        marker, line = styles[i % len(styles)]
        ax.plot(range(len(profiles)), ys, marker=marker, linestyle=line, label=label, alpha=0.85)
    ax.set_xticks(range(len(profiles)), profiles)
    if max(values) > 10 * min(values):
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, 1.05 * max(values))
    return _save(fig, ax, path, study.title, "network profile",
                 "simulated end-to-end time (s)", legend_below=True)


def leakage_distances(study: Study, summary: dict[str, dict], path: Path) -> Path | None:
    """A leakage study's Hamming distances between masks by how much data they share (bars,
    mean and sample std), and per decoder layer (disjoint data and one window replaced), one
    colour per cell: ``summary`` is :func:`fedcompress.bench.studies.leakage_summary` of the
    study's results."""
    if not summary:
        return None
    plt = pyplot()
    fig, (bars, layers) = plt.subplots(1, 2, figsize=(10, 4.5))
    width = 0.8 / len(summary)
    for i, (label, item) in enumerate(summary.items()):
        names = list(item["overlap"])
        means = [100 * item["overlap"][n]["mean"] for n in names]
        stds = [100 * (item["overlap"][n]["std"] if item["overlap"][n]["n"] > 1 else 0.0)
                for n in names]
        xs = [j + (i - (len(summary) - 1) / 2) * width for j in range(len(names))]
        bars.bar(xs, means, width, yerr=stds, capsize=2, label=label, alpha=0.85)
        bars.set_xticks(range(len(names)), [textwrap.fill(n, 12) for n in names], fontsize=7)
        per_layer = item["per_layer"]
        keys = list(per_layer["disjoint"])
        for what, style in (("disjoint", "-"), ("one_window_replaced", "--")):
            layers.plot(range(len(keys)), [100 * per_layer[what][k] for k in keys], marker=".",
                        linestyle=style, label=f"{label}: {what.replace('_', ' ')}")
        layers.set_xticks(range(len(keys)), [k.split(".")[-1] for k in keys])
    bars.set_ylabel("differing mask bits (%)")
    bars.set_title("by shared windows", fontsize=9)
    bars.legend(fontsize=7)
    fig.suptitle(textwrap.fill(study.title, 100), fontsize=10)
    return _save(fig, layers, path, "per decoder layer", "decoder layer",
                 "differing mask bits (%)")
