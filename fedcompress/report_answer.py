"""What a run was for, read from its ``report.json``: the answer a report page leads with.

:func:`answer` picks out the method's result and its baselines (which records are which
depends on the command: ``prune``, ``bench``, ``privytune``, ``ppcgpt``, ``personalize``; any
other report's results are shown side by side without roles), and writes in words what the
method reached against them, how small the model became, and the privacy spent. Nothing is
invented: a value the report does not hold is named as missing. :func:`chart_svg` draws the
method against its baselines (quality, size, time, bytes) and :func:`layers_svg` what was
pruned or removed per layer, both as inline SVG (no script, no external resource).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from fedcompress.report_page import (
    bench_cell_settings,
    human_bytes,
    result_strategy,
    result_time,
)

#: Quality metrics a result may hold: (field, lower is better, label).
QUALITY = (("perplexity", True, "perplexity"), ("accuracy", False, "accuracy"),
           ("acc_client", False, "accuracy at the sites"),
           ("acc_server", False, "server-side accuracy"))
#: Baselines every method may compare with (names as their results carry them).
_DENSE = ("dense",)
#: At most this many rows in the chart (a large bench: the table has them all).
MAX_CHART_ROWS = 24
# a run started on a busy machine: the 1-minute load average at its start at least this share of
# the CPUs (another job held about half of them)
BUSY_LOAD = 0.5

_METHOD_NAMES = {"prune": "FedPrLLM", "bench": "FedPrLLM", "privytune": "PrunePrivyTune",
                 "ppcgpt": "PPC-GPT", "personalize": "Personalized pruning"}


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any) -> float | None:
    """A finite number, or None (booleans, strings, NaN are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _count(n: float) -> str:
    """``134515008`` -> ``135 M``; ``4096`` -> ``4,096``."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.0f} M" if n >= 1e6 else f"{n:,.0f}"


def _sites(n: int) -> str:
    return f"{n} site" + ("" if n == 1 else "s")


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


@dataclass
class Entry:
    """One row of the comparison: a result (or a value the report derived, such as a
    personalized run's geometric mean over sites) and its role."""

    name: str
    label: str
    role: str  # "method", "baseline", "dense" or "result" (a report without roles)
    values: dict[str, Any]


@dataclass
class Panel:
    """One metric of the chart: a value per entry (None: not recorded)."""

    key: str
    title: str
    values: list[float | None]
    text: Callable[[float], str]
    lower_better: bool | None = None
    column: str = ""  # the table's (short) header; default the title


@dataclass
class Answer:
    """What :func:`answer` read from a report."""

    command: str
    summary: list[str]  # sentences of the lead paragraph
    entries: list[Entry]
    quality: tuple[str, bool, str] | None
    panels: list[Panel]
    missing: list[str]  # what the comparison lacks, in words
    pruned: list[str]  # what was pruned or removed, in words
    layers: tuple[str, list[float], float | None] | None  # (what, per-layer values, target)
    privacy: list[str]
    privacy_rows: list[dict[str, Any]] = field(default_factory=list)


# ------------------------------------------------------------------------------------------
# Roles
# ------------------------------------------------------------------------------------------

def _ok(record: dict) -> bool:
    return record.get("status") in (None, "ok")


def _label(record: dict) -> str:
    return result_strategy(record)


def _role(command: str, record: dict) -> str:
    name, kind = str(record.get("name", "")), record.get("kind")
    if name in _DENSE or kind == "dense":
        return "dense"
    if command == "prune":
        return "method" if name.startswith("fedprllm") else "baseline"
    if command == "bench":
        return "method" if kind == "fedprllm" else "baseline" if kind in (
            "centralized", "local-only") else "result"
    if command == "privytune":
        return "method" if name == "federated" else "baseline"
    if command == "ppcgpt":
        return "method" if name == "ppcgpt" else "baseline"
    return "result"


def entries(report: dict[str, Any]) -> list[Entry]:
    """The finished results as comparison rows (method first, then baselines, dense last)."""
    command = str(report.get("command", ""))
    records = [r for r in report.get("results", []) if isinstance(r, dict) and _ok(r)]
    if command == "personalize":
        means = report.get("geometric_mean_perplexity") or {}
        sites = [r for r in records if "site" in r]
        found = []
        for key in ("personalized", "fedprllm", "local-only", "dense"):
            if _num(means.get(key)) is None:
                continue
            role = "method" if key == "personalized" else "dense" if key == "dense" \
                else "baseline"
            found.append(Entry(key, f"{key} (geometric mean over {len(sites)} sites)", role,
                               {"perplexity": means[key]}))
        return found
    out = [Entry(str(r.get("name", "")), _label(r), _role(command, r), r) for r in records]
    order = {"method": 0, "result": 1, "baseline": 2, "dense": 3}
    return sorted(out, key=lambda e: order[e.role])


def _quality(found: list[Entry]) -> tuple[str, bool, str] | None:
    """The quality metric the method rows (else any row) hold."""
    for pool in ([e for e in found if e.role == "method"], found):
        for key, lower, label in QUALITY:
            if any(_num(e.values.get(key)) is not None for e in pool):
                return key, lower, label
    return None


def _seconds(record: dict) -> tuple[float | None, str]:
    seconds, measure = result_time(record)
    if seconds is None and _num(record.get("round2_seconds")) is not None:  # PPC-GPT
        seconds, measure = float(record["round2_seconds"]), "round 2"
    return (None, "") if seconds is None or not math.isfinite(seconds) else (seconds, measure)


def _sparsity(record: dict) -> float | None:
    for key in ("sparsity_measured", "sparsity"):
        if _num(record.get(key)) is not None:
            return _num(record[key])
    return None


def _bytes_up(record: dict) -> float | None:
    return _num(record.get("bytes_up_per_client", record.get("bytes_up_per_site_round")))


def panels(found: list[Entry], quality: tuple[str, bool, str] | None) -> list[Panel]:
    """The chart's metrics: quality, size (sparsity or layers removed), time, bytes up; a
    metric no row holds is left out."""
    out = []
    if quality is not None:
        key, lower, label = quality
        out.append(Panel(key, f"{label} ({'lower' if lower else 'higher'} is better)",
                         [_num(e.values.get(key)) for e in found],
                         (lambda v: f"{v:.2f}") if key == "perplexity" else
                         (lambda v: f"{v:.4g}"), lower, label))
    sparsity = [_sparsity(e.values) for e in found]
    if any(v is not None for v in sparsity):
        out.append(Panel("sparsity", "sparsity (weights zero)",
                         [None if v is None else 100 * v for v in sparsity],
                         lambda v: f"{v:.1f}%", column="sparsity"))
    removed = [_num(e.values.get("removed")) for e in found]
    if any(v is not None for v in removed):
        out.append(Panel("removed", "layers removed", removed, lambda v: f"{v:.0f}"))
    # a dense model is not compressed: its record's time (an evaluation's) is not shown
    times = [(None, "") if e.role == "dense" else _seconds(e.values) for e in found]
    if any(t is not None for t, _ in times):
        out.append(Panel("seconds", "time (s)", [t for t, _ in times],
                         lambda v: f"{v:.1f} s", True, "time (s)"))
    up = [_bytes_up(e.values) for e in found]
    if any(v is not None for v in up):
        per_round = any("bytes_up_per_site_round" in e.values for e in found)
        title = "bytes up / site" + (" / round" if per_round else "")
        out.append(Panel("bytes_up", title, up, human_bytes, True, title))
    return out


# ------------------------------------------------------------------------------------------
# Words
# ------------------------------------------------------------------------------------------

def _describe(report: dict[str, Any], method: Entry | None) -> str:
    """The method and its settings, e.g. ``FedPrLLM on smollm2-135m (16 sites, Wanda 50%,
    one-shot, server vote per layer)``."""
    command = str(report.get("command", ""))
    config = report.get("config") or {}
    model = (report.get("model") or {}).get("spec") if isinstance(report.get("model"), dict) \
        else None
    model = model or config.get("model") or (config.get("bench") or {}).get("model")
    name = _METHOD_NAMES.get(command, f"fedcompress {command}")
    bits: list[str] = []
    values = method.values if method else {}
    if command in ("prune", "bench"):
        sites = values.get("clients", config.get("clients"))
        if sites is not None:
            bits.append(f"{sites} sites")
        algo = values.get("method", config.get("method"))
        # a prune result's sparsity is measured; its config holds the target
        target = _num(config.get("sparsity") if command == "prune" else values.get("sparsity"))
        if algo or target is not None:
            bits.append(" ".join(x for x in (
                str(algo).capitalize() if algo else "", _pct(target).replace(".0%", "%")
                if target is not None else "") if x))
        mode = values.get("mode", config.get("mode"))
        if mode:
            bits.append({"oneshot": "one-shot"}.get(str(mode), str(mode)))
        if config.get("aggregate") == "stats" or "stats" in (method.name if method else ""):
            bits.append("statistics aggregated")
        else:
            group = values.get("server_group", values.get("group", config.get("group")))
            if group:
                bits.append(f"server vote per {group}"
                            + (", scaled" if values.get("scale", config.get("scale")) else ""))
        if config.get("secagg"):
            bits.append("SecAgg+")
    elif command == "privytune":
        if values.get("sites") is not None:
            bits.append(f"{values['sites']} sites")
        if _num(values.get("removed")) is not None and _num(values.get("layers")) is not None:
            bits.append(f"{values['removed']} of {values['removed'] + values['layers']} "
                        "layers removed")
        if config.get("rounds") is not None:
            bits.append(f"{config['rounds']} round(s)")
        if config.get("mode"):
            bits.append(f"{config['mode']} fine-tuning")
    elif command == "ppcgpt":
        if config.get("clients") is not None:
            bits.append(f"{config['clients']} sites")
        if _num(values.get("removed")) is not None:
            bits.append(f"{values['removed']} layer{'' if values['removed'] == 1 else 's'} "
                        "removed")
        if values.get("synthetic") is not None:
            bits.append(f"{values['synthetic']} synthetic samples")
    elif command == "personalize":
        sites = [r for r in report.get("results", []) if "site" in r]
        bits.append(f"{len(sites)} sites")
        if _num(config.get("sparsity")) is not None:
            bits.append(f"sparsity {_pct(config['sparsity'])}")
    text = name + (f" on {model}" if model else "")
    return text + (f" ({', '.join(bits)})" if bits else "")


def _versus(method_value: float, other: float, lower: bool) -> str:
    if method_value == other:
        return "equal"
    better = method_value < other if lower else method_value > other
    side = "lower" if method_value < other else "higher"
    if not other:
        return f"{side}, {'better' if better else 'worse'}"
    return f"{_pct(abs(method_value - other) / abs(other))} {side}, " \
           f"{'better' if better else 'worse'}"


def _comparison(method: Entry, others: list[Entry], quality: tuple[str, bool, str],
                fmt: Callable[[float], str]) -> str:
    key, lower, label = quality
    value = _num(method.values.get(key))
    if value is None:
        return f"The method's result ({method.label}) has no {label}."
    parts = []
    by_name: dict[str, list[float]] = {}
    for entry in others:
        v = _num(entry.values.get(key))
        if v is not None:
            by_name.setdefault(entry.name if entry.role != "dense" else "dense", []).append(v)
    for name, values in by_name.items():
        if len(values) == 1:
            parts.append(f"{name} {fmt(values[0])} ({_versus(value, values[0], lower)})")
        else:
            parts.append(f"{name} {fmt(min(values))}-{fmt(max(values))} "
                         f"({len(values)} results)")
    text = f"reaches {label} {fmt(value)}"
    if parts:
        return text + " against " + ", ".join(parts) + "."
    return text + "; the report holds no baseline with this metric to compare it with."


def _size(method: Entry | None, report: dict[str, Any]) -> str:
    if method is None:
        return ""
    values = method.values
    sparsity = _sparsity(values)
    model = report.get("model") if isinstance(report.get("model"), dict) else {}
    if sparsity is not None:
        params = _num(model.get("parameters"))
        return (f"The model is {_pct(sparsity)} sparse: that share of its decoder layers' "
                "linear weights is zero" + (f" ({_count(params)} parameters in all, "
                                            "stored dense)" if params else "") + ".")
    removed, layers = _num(values.get("removed")), _num(values.get("layers"))
    if removed is not None and layers is not None:
        return (f"{removed:.0f} of {removed + layers:.0f} transformer layers "
                f"{'was' if removed == 1 else 'were'} removed "
                f"({_pct(removed / (removed + layers))} of the blocks).")
    return "The report does not record the model's sparsity or size."


def _released(report: dict[str, Any]) -> str:
    command = str(report.get("command", ""))
    config = report.get("config") or {}
    if command == "prune":
        if config.get("aggregate") == "stats":
            return "each site's per-layer calibration statistics"
        return "each site's binary pruning masks (one bit per prunable weight)"
    if command == "bench":
        return ("each simulated site's pruning masks (in one process: the bench measures "
                "strategies, not a deployment)")
    if command == "privytune":
        return "each site's layer-similarity scores (round 0) and its trained weights per round"
    if command == "ppcgpt":
        return "each site's perturbed text (round 1) and its retrained adapter (round 2)"
    if command == "personalize":
        return "each site's unit classes and pruning masks"
    return "not recorded in this report"


def privacy(report: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """The privacy spent, in sentences, and a row per site where the report has one."""
    config = report.get("config") or {}
    results = [r for r in report.get("results", []) if isinstance(r, dict)]
    sentences: list[str] = []
    rows: list[dict[str, Any]] = []
    dp = False
    ledger_text: list[str] = []  # after the mechanism's own sentences
    ledgers = [s for s in report.get("site_ledgers") or [] if isinstance(s, dict)]
    if any(_num(s.get("ledger_run_epsilon")) or s.get("dp_releases") for s in ledgers):
        dp = True
        spent = [_num(s.get("ledger_run_epsilon")) or 0.0 for s in ledgers]
        span = f"{min(spent):.3g}" + (f"-{max(spent):.3g}" if max(spent) != min(spent) else "")
        ledger_text.append(f"The sites' own privacy ledgers record epsilon {span} spent in this "
                         f"run at each of {_sites(len(ledgers))}.")
        rows += [{"site": s.get("node"), "epsilon (this run)": s.get("ledger_run_epsilon"),
                  "epsilon (lifetime)": s.get("ledger_lifetime_epsilon"),
                  "lifetime budget": s.get("ledger_lifetime_budget"),
                  "DP releases": s.get("dp_releases")} for s in ledgers]
    elif ledgers:
        ledger_text.append(f"The sites' own privacy ledgers ({_sites(len(ledgers))}) record no "
                         "DP release in this run.")
    if ledgers:
        enforced = sum(1 for s in ledgers if s.get("site_policy_enforced"))
        seeded = sum(1 for s in ledgers if s.get("secrets_reproducible"))
        ledger_text.append(("No site enforced its site policy (a simulation enforces none)."
                          if not enforced else
                          f"{enforced} of {_sites(len(ledgers))} enforced their site policy.")
                         + (f" {seeded} site(s) drew their secrets from a research seed: no "
                            "guarantee holds there." if seeded else ""))
    fed = next((r for r in results if r.get("name") == "federated"), None)
    if report.get("command") == "privytune" and fed is not None:
        target = fed.get("epsilon")
        spent_max = _num(fed.get("epsilon_spent_max"))
        if spent_max is not None:
            dp = True
            delta = config.get("dp_delta")
            sentences.append(f"DP-SGD at each site: epsilon {spent_max:.3g} spent at most "
                             f"(target {target})" + (f", delta {delta:g}" if isinstance(
                                 delta, (int, float)) else ", delta not recorded")
                             + " per site, on its own data.")
            if not rows:
                last: dict[Any, dict] = {}
                for site in report.get("sites") or []:
                    if isinstance(site, dict) and "epsilon_spent" in site:
                        last[site.get("partition", site.get("node"))] = site
                rows += [{"site": k, "epsilon (this run)": v.get("epsilon_spent"),
                          "delta": delta, "noise multiplier": v.get("sigma"),
                          "sample rate": v.get("sample_rate")} for k, v in sorted(
                              last.items(), key=lambda kv: str(kv[0]))]
        if _num(fed.get("central_epsilon")) is not None:
            dp = True
            sentences.append(f"Central DP on the aggregate: epsilon {fed['central_epsilon']:.3g}.")
    ppc = report.get("privacy")
    if isinstance(ppc, dict) and _num(ppc.get("eps_per_word")) is not None:
        dp = True
        sentences.append(
            f"Text perturbation ({ppc.get('mechanism', '?')}): epsilon {ppc['eps_per_word']:g} "
            "per word (metric local DP of each word, not a DP guarantee on the dataset), up to "
            f"{_num(ppc.get('eps_per_example_max')) or 0:g} per example.")
        rows += [{"site": c.get("partition", c.get("node")),
                  "epsilon per word": c.get("eps_per_word"),
                  "epsilon per example (max)": c.get("eps_per_example_max"),
                  "epsilon per example (mean)": c.get("eps_per_example_mean"),
                  "examples": c.get("examples")} for c in ppc.get("clients") or []
                 if isinstance(c, dict)]
    if isinstance(report.get("dp_noise"), str):
        sentences.append(f"DP noise: {report['dp_noise']}.")
    secagg = report.get("secagg") if isinstance(report.get("secagg"), dict) else None
    summary = (secagg or {}).get("sum") if secagg else None
    if isinstance(summary, dict):
        hid = (f"SecAgg+ hid the individual sites: the server saw only the sum over "
               f"{summary.get('sites', '?')} sites (threshold {summary.get('threshold', '?')}, "
               + ("keys signed, consistency round: covers a malicious server with fewer than "
                  "threshold colluding sites)." if summary.get("authenticated") else
                  "unauthenticated: an honest-but-curious server only)."))
    elif config.get("secagg"):
        hid = "SecAgg+ was configured, but the report records no secure-aggregation summary."
    else:
        hid = "SecAgg+ was off: the server saw each site's release individually."
    sentences += ledger_text
    if not dp and report.get("command") not in _METHOD_NAMES and not secagg:
        return ["This report records no privacy accounting (no epsilon, no secure-aggregation "
                "summary), so it states no differential-privacy guarantee; what it released and "
                "whether SecAgg+ hid individual sites are not recorded in it."], rows
    if not dp:
        sentences.insert(0, "This run has no differential-privacy guarantee: no epsilon was "
                            f"spent or recorded. What left the sites: {_released(report)}.")
    else:
        sentences.append(f"What left the sites: {_released(report)}.")
    if report.get("command") not in ("privytune", "ppcgpt") or secagg or config.get("secagg"):
        sentences.append(hid)
    return sentences, rows


def _layers(report: dict[str, Any], method: Entry | None
            ) -> tuple[list[str], tuple[str, list[float], float | None] | None]:
    """What was pruned or removed, in words, and the per-layer values to draw."""
    words: list[str] = []
    config = report.get("config") or {}
    values = method.values if method else {}
    per_layer = values.get("sparsity_per_layer")
    if isinstance(per_layer, list) and per_layer and all(
            _num(v) is not None for v in per_layer):
        numbers = [float(v) for v in per_layer]
        target = _num(values.get("sparsity", config.get("sparsity")))
        words.append(f"Sparsity per layer of {method.label if method else 'the model'}: "
                     f"{len(numbers)} layers, {_pct(min(numbers))} to {_pct(max(numbers))}"
                     + (f" (target {_pct(target)})" if target is not None else "") + ".")
        profile = report.get("sparsity_profile")
        if isinstance(profile, dict) and profile.get("rule"):
            words.append(f"Per-layer targets: {profile['rule']} rule.")
        return words, ("sparsity", numbers, target)
    for key in ("removal", "compression"):
        plan = (report.get(key) or {}).get("plan") if isinstance(report.get(key), dict) \
            else None
        if isinstance(plan, dict) and isinstance(plan.get("removed"), list) and _num(
                plan.get("num_layers")) is not None:
            removed, total = plan["removed"], int(plan["num_layers"])
            words.append(f"{len(removed)} of {total} layers removed"
                         + (f" (by index, from 0): {', '.join(map(str, removed))}"
                            if removed else "")
                         + f"; policy {plan.get('policy', '?')}, measure "
                         f"{plan.get('method', '?')}.")
            return words, ("removed", [1.0 if i in removed else 0.0 for i in range(total)],
                           None)
    if method is not None:
        words.append("The report records no per-layer sparsity or removal plan.")
    return words, None


#: A bench cell's settings that name its strategy (not the data, model or target it shares
#: with its baselines).
_STRATEGY_KEYS = ("kind", "mode", "group", "scale", "tie_break", "defence", "trim")


def _comparable(method: dict, other: dict) -> bool:
    """Whether two bench cells agree on every setting both have but their strategy's."""
    mine, theirs = bench_cell_settings(method), bench_cell_settings(other)
    return all(mine[k] == theirs[k] for k in mine.keys() & theirs.keys()
               if k not in _STRATEGY_KEYS)


def answer(report: dict[str, Any]) -> Answer:
    """The answer a run's page leads with (see the module's docstring)."""
    command = str(report.get("command", ""))
    found = entries(report)
    quality = _quality(found)
    methods = [e for e in found if e.role == "method"]
    missing: list[str] = []
    config = report.get("config") or {}
    method = methods[0] if methods else None
    if len(methods) > 1 and quality is not None:  # the configured variant, else the lowest
        configured = [m for m in methods if m.values.get("server_group") == config.get("group")
                      and m.values.get("scale", False) == config.get("scale", False)]
        scored = [m for m in methods if _num(m.values.get(quality[0])) is not None]
        if configured and command == "prune":
            method = configured[0]
        elif scored:
            pick = min if quality[1] else max
            method = pick(scored, key=lambda m: float(m.values[quality[0]]))
    shown = panels(found, quality)
    fmt = shown[0].text if shown and quality and shown[0].key == quality[0] else str
    summary: list[str] = []
    failed = [r for r in report.get("results", []) if isinstance(r, dict) and not _ok(r)]
    status = report.get("status")
    if method is not None and quality is not None:
        others = [e for e in found if e.role in ("baseline", "dense")]
        if command == "bench":  # like for like: the cells of the method's own settings
            others = [e for e in others if _comparable(method.values, e.values)]
        summary.append(_describe(report, method) + " " + _comparison(method, others, quality,
                                                                      fmt))
        if len(methods) > 1:
            values = sorted(float(m.values[quality[0]]) for m in methods
                            if _num(m.values.get(quality[0])) is not None)
            name = _METHOD_NAMES.get(command, "method")
            if command == "prune" and method.values.get("server_group") == config.get("group"):
                how = f"This is the configured server variant; the {len(methods)} {name} " \
                      "results"
            else:
                how = (f"This is the {'lowest' if quality[1] else 'highest'} {quality[2]} of "
                       f"the {len(methods)} {name} results, which")
            summary.append(f"{how} range {fmt(values[0])}-{fmt(values[-1])}"
                           + (" over the settings swept (the study tables below compare them "
                              "like for like)." if command == "bench" else "."))
        if command == "bench":
            keep = {id(method), *map(id, others)}
            found = [e for e in found if id(e) in keep]
            shown = panels(found, quality)
        if not others:
            missing.append("baselines: the report has no dense or other baseline result")
    elif method is not None:
        summary.append(_describe(report, method) + f": its result ({method.label}) records no "
                       "quality metric (perplexity or accuracy).")
        missing.append("a quality metric (perplexity or accuracy)")
    elif found and command in _METHOD_NAMES:  # a run stopped before its method's result
        name = _METHOD_NAMES[command]
        done = ", ".join(f"{e.label}" + (f" {quality[2]} {_num(e.values.get(quality[0])):.4g}"
                                         if quality and _num(e.values.get(quality[0]))
                                         is not None else "") for e in found)
        summary.append(f"This {command} report holds no {name} result; finished: {done}.")
        missing.append(f"the {name} result")
    elif found and quality is not None:
        summary.append(f"This {command} report holds {len(found)} finished result(s) with "
                       f"{quality[2]}; the page does not know which is the method and which "
                       "the baselines, so they are shown side by side without a ranking.")
    elif found:
        summary.append(f"This {command} report holds {len(found)} finished result(s), none "
                       "with a perplexity or an accuracy to compare.")
        missing.append("a quality metric (perplexity or accuracy)")
    else:
        summary.append(f"This {command} report holds no finished result"
                       + (f" (status {status})" if status else "") + ".")
        missing.append("results")
    if failed:
        summary.append(f"{len(failed)} result(s) failed (marked in the tables below).")
    if status not in (None, "ok"):
        summary.append(f"The run's status is {status}: the numbers are those finished so far.")
    machine = report.get("machine") if isinstance(report.get("machine"), dict) else {}
    cpus = _num(machine.get("cpu_count"))
    start = machine.get("load_average_start")
    # the load before the run's own work: at the end the 1-minute average counts the run itself,
    # which keeps every CPU busy on an idle machine
    before = _num(start[0]) if isinstance(start, list) and start else None
    if cpus and before is not None and before >= BUSY_LOAD * cpus \
            and any(p.key == "seconds" for p in shown):
        summary.append(f"The times were measured on a busy machine (1-minute load average "
                       f"{before:g} on {cpus:g} CPUs when the run started): compare them with "
                       "care.")
    size = _size(method, report)
    if size:
        summary.append(size)
    sentences, rows = privacy(report)
    secagg = next((t for t in sentences if t.startswith("SecAgg+")), "")
    warnings = [t for t in sentences[1:] if "NOT" in t and t != secagg]
    summary.append("Privacy: " + " ".join([sentences[0], *warnings]) + (
        " " + secagg.split(":")[0].rstrip(".") + "." if secagg and secagg != sentences[0]
        else ""))
    for wanted, key in (("time", "seconds"), ("bytes sent", "bytes_up")):
        if found and method is not None and not any(p.key == key for p in shown):
            missing.append(f"{wanted}: no result records it")
    pruned, layers = _layers(report, method)
    return Answer(command, summary, found, quality, shown, missing, pruned, layers, sentences,
                  rows)


# ------------------------------------------------------------------------------------------
# Charts (inline SVG)
# ------------------------------------------------------------------------------------------

_COLORS = {"method": "#0969da", "baseline": "#8c959f", "dense": "#424a53", "result": "#1a7f37"}
_ROLE_TEXT = {"method": "method", "baseline": "baseline", "dense": "dense (uncompressed)",
              "result": "result"}


def _trim(text: str, n: int = 34) -> str:
    return text if len(text) <= n else text[:n - 1] + "\u2026"


def blank(entry: Entry, panel: Panel) -> str:
    """What a chart or table says for a value a result does not hold: a dense model has no
    compression time or bytes (it is the model the sites start from), the in-process
    baselines send nothing; anything else is ``not recorded``."""
    if entry.role == "dense" and panel.key in ("seconds", "bytes_up"):
        return "n/a (not compressed)"
    if entry.role == "baseline" and panel.key == "bytes_up":
        return "n/a (in-process)"
    return "not recorded"


def chart_svg(found: list[Entry], shown: list[Panel]) -> str:
    """The method against its baselines, one bar panel per metric (bars scaled per panel,
    each labelled with its value; a value not recorded is written ``not recorded``). Every
    bar carries its exact value in ``data-value``."""
    rows = found[:MAX_CHART_ROWS]
    if not rows or not shown:
        return ""
    label_w, panel_w, gap, row_h, top = 210, 200, 18, 22, 46
    width = label_w + len(shown) * (panel_w + gap)
    height = top + len(rows) * row_h + 34
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           f'aria-label="method against baselines: {_e(", ".join(p.title for p in shown))}" '
           'font-family="system-ui, DejaVu Sans, sans-serif" font-size="12">']
    for r, entry in enumerate(rows):
        y = top + r * row_h
        if r % 2:
            out.append(f'<rect x="0" y="{y}" width="{width}" height="{row_h}" fill="#f6f8fa"/>')
        out.append(f'<text x="{label_w - 8}" y="{y + 15}" text-anchor="end" fill="#1f2328"'
                   + (' font-weight="700"' if entry.role == "method" else "")
                   + f"><title>{_e(entry.label)}</title>{_e(_trim(entry.label))}</text>")
    for p, panel in enumerate(shown):
        x0 = label_w + p * (panel_w + gap)
        room = panel_w - 78
        values = [v for v in panel.values[:len(rows)] if v is not None]
        peak = max((abs(v) for v in values), default=0.0) or 1.0
        out.append(f'<text x="{x0}" y="18" font-weight="700" fill="#1f2328">'
                   f"{_e(_trim(panel.title, 34))}<title>{_e(panel.title)}</title></text>")
        out.append(f'<line x1="{x0}" y1="{top - 6}" x2="{x0}" y2="{top + len(rows) * row_h}" '
                   'stroke="#d1d9e0"/>')
        for r, entry in enumerate(rows):
            y = top + r * row_h
            value = panel.values[r]
            if value is None:
                out.append(f'<text x="{x0 + 4}" y="{y + 15}" fill="#8c959f" '
                           f'data-panel="{_e(panel.key)}" data-row="{_e(entry.name)}">'
                           f"{_e(blank(entry, panel))}</text>")
                continue
            length = max(room * abs(value) / peak, 1.0)
            out.append(f'<rect x="{x0}" y="{y + 4}" width="{length:.1f}" height="14" '
                       f'fill="{_COLORS[entry.role]}" data-panel="{_e(panel.key)}" '
                       f'data-row="{_e(entry.name)}" data-value="{value!r}">'
                       f"<title>{_e(entry.label)}: {_e(panel.text(value))}</title></rect>")
            out.append(f'<text x="{x0 + length + 4:.1f}" y="{y + 15}" fill="#1f2328">'
                       f"{_e(panel.text(value))}</text>")
    y = top + len(rows) * row_h + 22
    x = label_w
    for role in dict.fromkeys(e.role for e in rows):
        out.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{_COLORS[role]}"/>'
                   f'<text x="{x + 16}" y="{y}" fill="#59636e">{_ROLE_TEXT[role]}</text>')
        x += 40 + 7 * len(_ROLE_TEXT[role])
    out.append("</svg>")
    return "".join(out)


def layers_svg(what: str, values: list[float], target: float | None) -> str:
    """Per-layer bars: the sparsity of each layer (0-100%, the target dashed), or the layers
    removed (full bars). Every bar carries its value in ``data-value``."""
    if not values:
        return ""
    bar, left, top, high = max(6, min(22, 640 // len(values))), 60, 14, 110
    width = left + bar * len(values) + 20
    height = top + high + 36
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart layers" role="img" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           f'aria-label="{_e(what)} per layer" '
           'font-family="system-ui, DejaVu Sans, sans-serif" font-size="11">']
    for frac in (0.0, 0.5, 1.0):
        y = top + high * (1 - frac)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - 16}" y2="{y:.1f}" '
                   'stroke="#d1d9e0"/>')
        label = f"{100 * frac:.0f}%" if what == "sparsity" else ("removed" if frac == 1 else "")
        if label:
            out.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" '
                       f'fill="#59636e">{label}</text>')
    for i, value in enumerate(values):
        h = high * min(max(value, 0.0), 1.0)
        x = left + i * bar
        tip = f"layer {i}: " + (f"{100 * value:.2f}% sparse" if what == "sparsity" else
                                 "removed" if value else "kept")
        out.append(f'<rect x="{x + 1}" y="{top + high - h:.1f}" width="{bar - 2}" '
                   f'height="{max(h, 0.5):.1f}" fill="{"#0969da" if value else "#d1d9e0"}" '
                   f'data-layer="{i}" data-value="{value!r}"><title>{tip}</title></rect>')
        if i % 5 == 0:
            out.append(f'<text x="{x + bar / 2:.1f}" y="{top + high + 14}" text-anchor="middle" '
                       f'fill="#59636e">{i}</text>')
    if target is not None and what == "sparsity":
        y = top + high * (1 - target)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - 16}" y2="{y:.1f}" '
                   'stroke="#cf222e" stroke-dasharray="4 3"/>')
    out.append(f'<text x="{left}" y="{height - 4}" fill="#59636e">layer'
               + (" (dashed: target)" if target is not None and what == "sparsity" else "")
               + "</text></svg>")
    return "".join(out)
