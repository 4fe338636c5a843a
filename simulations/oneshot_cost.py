"""What a one-shot FedPrLLM round costs next to centralized pruning, and where a site's time goes.

    python simulations/oneshot_cost.py --out simulations/results/oneshot-cost

For each ``--setting`` (``MODEL:CLIENTS:WINDOWS``; default the embedded model with 16 sites x 4
windows and Qwen2.5-0.5B with 8 x 2), side by side in one process:

* **centralized**: one Wanda pass of the calibration walker on the union of the sites' windows;
* **one-shot round's work**: every site's own pass on its windows and its bit-packed payload
  (sites one after another, each with this process's threads, as the centralized pass), then
  the server's vote and pruning of a copy of the model; ``ratio`` = round work / centralized.
  Both are measured ``--repeats`` times, interleaved, and each keeps its fastest repeat.
  With as many workers as cores, the round's wall time is this work spread over them;
* **a site's pass by kind of work** (cProfile of site 0: the decoder layers' matrix products and
  attention, the statistics, the scores, the selection, the pruned layer copies, the payload).

``--flower`` also runs ``fedcompress prune`` (Flower's Simulation Engine, Ray workers) for each
setting with the centralized baseline and records its federated round's wall time next to the
centralized pass of the same run. Writes ``report.json``/``report.md``
(:class:`~fedcompress.report.RunReport`).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import logging
import pstats
import subprocess
import sys
import time
from pathlib import Path

import torch

from fedcompress.methods.fedprllm.federated import (
    FedPrLLMConfig,
    MaskAggregator,
    encode_masks,
    federation_windows,
)
from fedcompress.models import load_model
from fedcompress.pruning.local import local_masks
from fedcompress.report import RunReport, markdown_table

logger = logging.getLogger("oneshot_cost")

#: cProfile function names (substrings of "file:function") -> kind of work of a site's pass.
KINDS = (
    ("selection", ("select.py", "partition", "kthvalue", "cumsum", "count_nonzero")),
    ("scores", ("scores.py", "method 'abs'", "method 'mul'")),
    ("pruned weights", ("deepcopy", "method 'clone'", "masked_fill", "pruned_parameters",
                        "prune_layer_in_place")),
    ("statistics", ("walker.py:", "method 'pow'", "addmm_", "method 'sum'")),
    ("payload", ("codec.py", "packbits", "encode_mask")),
    ("matrix products", ("linear",)),
    ("attention", ("scaled_dot_product_attention", "rotary", "softmax")),
)


def kind_of(name: str) -> str:
    for kind, needles in KINDS:
        if any(n in name for n in needles):
            return kind
    return "other"


def profile_site(model, windows, config) -> dict[str, float]:
    """Seconds of site 0's pass (masks and payload) by kind of work (cProfile tottime)."""
    profiler = cProfile.Profile()
    profiler.enable()
    encode_masks(local_masks(model, windows, config.prune, batch_size=config.batch_size).masks)
    profiler.disable()
    stats = pstats.Stats(profiler)
    kinds: dict[str, float] = {}
    for (filename, line, function), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        kind = kind_of(f"{filename}:{line}({function})" if line else f"{filename}:{function}")
        kinds[kind] = kinds.get(kind, 0.0) + tottime
    return kinds


def in_process(model, config: FedPrLLMConfig, windows, repeats: int = 1) -> dict:
    """The centralized pass and the round's work, ``repeats`` times interleaved (centralized,
    then every site, then the server, again); each side keeps its fastest repeat (the least
    disturbed by other work on the machine), so a change of load between the two halves of
    one repeat cannot decide the ratio."""
    central, server = float("inf"), float("inf")
    site_seconds = [float("inf")] * len(windows)
    all_central = []
    for _ in range(repeats):
        start = time.perf_counter()
        local_masks(model, torch.cat(windows), config.prune, batch_size=config.batch_size)
        all_central.append(time.perf_counter() - start)
        central = min(central, all_central[-1])
        aggregator = MaskAggregator(model, len(windows))
        for i, site in enumerate(windows):
            start = time.perf_counter()
            payload = encode_masks(local_masks(model, site, config.prune,
                                               batch_size=config.batch_size).masks)
            site_seconds[i] = min(site_seconds[i], time.perf_counter() - start)
            aggregator.add_packed(payload)
        start = time.perf_counter()
        aggregator.prune(copy.deepcopy(model), config.server, config.prune.plan)
        server = min(server, time.perf_counter() - start)
    work = sum(site_seconds) + server
    return {"centralized_seconds": central, "site_seconds_mean": sum(site_seconds) /
            len(site_seconds), "server_seconds": server, "round_work_seconds": work,
            "ratio": work / central, "repeats": repeats,
            "centralized_seconds_each": all_central}


def flower_round(model: str, clients: int, windows: int, out: Path) -> dict:
    """``fedcompress prune`` on the Simulation Engine with the centralized baseline: its
    federated round's wall time and the centralized pass of the same run."""
    cmd = [str(Path(sys.executable).parent / "fedcompress"), "prune", "--model", model, "--clients",
           str(clients), "--samples-per-client", str(windows), "--baselines", "centralized",
           "--eval-windows", "1", "--no-save-model", "--out", str(out)]
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - start
    report = json.loads((out / "report.json").read_text())
    fed = next(r for r in report["results"] if r["name"].startswith("fedprllm"))
    central = next(r for r in report["results"] if r["name"] == "centralized")
    return {"flower_round_seconds": fed["federated_seconds"],
            "flower_engine_startup_seconds": fed["startup_seconds"],
            "flower_client_seconds_mean": fed["client_seconds_mean"],
            "flower_centralized_seconds": central["prune_seconds"],
            "flower_ratio": fed["federated_seconds"] / central["prune_seconds"],
            "flower_wall_seconds": wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="simulations/results/oneshot-cost")
    parser.add_argument("--setting", nargs="+",
                        default=["smollm2-135m:16:4", "qwen2.5-0.5b:8:2"],
                        help="MODEL:CLIENTS:WINDOWS per site")
    parser.add_argument("--repeats", type=int, default=2,
                        help="Interleaved repeats; each side keeps its fastest.")
    parser.add_argument("--flower", action="store_true",
                        help="Also time the round under fedcompress prune (Ray).")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    report = RunReport.for_script(__file__, opts, seeds={"seed": 0})
    with report:
        rows, kind_rows = [], []
        for setting in opts.setting:
            model_name, clients, per_site = setting.split(":")
            config = FedPrLLMConfig(model=model_name, clients=int(clients),
                                    samples_per_client=int(per_site))
            with report.phase(f"{model_name}-load"):
                loaded = load_model(model_name, device="cpu")
            windows = federation_windows(loaded.tokenizer, config)[0]
            local_masks(loaded.model, windows[0][:1], config.prune)  # warm the kernels
            with report.phase(f"{model_name}-in-process"):
                record = in_process(loaded.model, config, windows, opts.repeats)
            with report.phase(f"{model_name}-profile"):
                kinds = profile_site(loaded.model, windows[0], config)
            record.update({"name": setting, "model": model_name, "clients": int(clients),
                           "windows_per_site": int(per_site), "threads": torch.get_num_threads(),
                           "site_pass_by_kind": kinds})
            del loaded
            if opts.flower:
                with report.phase(f"{model_name}-flower"):
                    record.update(flower_round(model_name, int(clients), int(per_site),
                                               Path(opts.out) / f"flower-{model_name}"))
            report.add_result(record)
            rows.append([setting, f"{record['centralized_seconds']:.1f}",
                         f"{record['site_seconds_mean']:.2f}",
                         f"{record['server_seconds']:.2f}",
                         f"{record['round_work_seconds']:.1f}", f"**{record['ratio']:.2f}x**",
                         f"{record['flower_ratio']:.2f}x" if opts.flower else "-"])
            total = sum(kinds.values())
            kind_rows += [[setting, kind, f"{seconds:.2f}", f"{100 * seconds / total:.0f}%"]
                          for kind, seconds in sorted(kinds.items(), key=lambda kv: -kv[1])]
            logger.info("%s: ratio %.2fx", setting, record["ratio"])
        report.sections.append(("One-shot round vs centralized", markdown_table(
            ["setting", "centralized s", "site s (mean)", "server s", "round work s",
             "ratio", "Flower round / centralized"], rows)))
        report.sections.append(("A site's pass by kind of work (site 0, cProfile)",
                                markdown_table(["setting", "kind", "seconds", "share"],
                                               kind_rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
