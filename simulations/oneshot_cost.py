"""What a one-shot FedPrLLM round costs next to centralized pruning, and where a site's time goes.

    python simulations/oneshot_cost.py --out simulations/results/oneshot-cost

For each ``--setting`` (``MODEL:CLIENTS:WINDOWS[:onload]``; default issue 63's three sizes,
16 sites x 4 windows of ``--seqlen`` 256 tokens each, Qwen2.5-1.5B onloaded), side by side in one
process:

* **centralized**: one Wanda pass of the calibration walker on the union of the sites' windows;
* **one-shot round's work**: every site's own pass on its windows and its bit-packed payload
  (sites one after another, each with this process's threads, as the centralized pass), then
  the server's vote and pruning of a copy of the model; ``ratio`` = round work / centralized.
  ``:onload`` (or ``--onload`` for every setting): sequential onloading everywhere, the passes
  and the server read one decoder layer at a time from the safetensors files (the server
  prunes each layer so read, :meth:`MaskAggregator.prune` of the skeleton, instead of a copy
  of the whole model), so the process never holds the model;
  Both are measured ``--repeats`` times, interleaved, and each keeps its fastest repeat.
  With as many workers as cores, the round's wall time is this work spread over them;
* **a site's pass by kind of work** (cProfile of site 0: the decoder layers' matrix products and
  attention, the statistics, the scores, the selection, the pruned layer copies, the payload,
  an onloaded layer's read and release).

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
import resource
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
from fedcompress.models import load_model, onloader_of
from fedcompress.pruning.local import local_masks
from fedcompress.report import RunReport, markdown_table

logger = logging.getLogger("oneshot_cost")

#: cProfile function names (substrings of "file:function") -> kind of work of a site's pass.
KINDS = (
    # the selection's blocks run on worker threads: cProfile sees the main thread's wait
    ("selection", ("select.py", "partition", "kthvalue", "cumsum", "count_nonzero",
                   "method 'acquire' of '_thread.lock'")),
    ("scores", ("scores.py", "method 'abs'", "method 'mul'", "method 'mul_'")),
    ("pruned weights", ("deepcopy", "method 'clone'", "masked_fill", "pruned_parameters",
                        "prune_layer_in_place", "torch.where")),
    ("statistics", ("walker.py:", "method 'pow'", "addmm_", "method 'sum'")),
    ("payload", ("codec.py", "packbits", "encode_mask")),
    ("matrix products", ("linear",)),
    ("attention", ("scaled_dot_product_attention", "rotary", "softmax")),
    ("layer reads (onload)", ("adapter.py:", "safe_open", "get_tensor", "get_slice",
                              "method 'copy_'", "release_free_memory")),
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


def parse_setting(setting: str, seqlen: int, onload: bool = False) -> FedPrLLMConfig:
    """``MODEL:CLIENTS:WINDOWS[:onload]`` -> the FedPrLLM config of that federation (``onload``:
    onloaded whatever the setting says)."""
    parts = setting.split(":")
    if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] != "onload"):
        raise ValueError(f"setting {setting!r}: expected MODEL:CLIENTS:WINDOWS or "
                         "MODEL:CLIENTS:WINDOWS:onload")
    model, clients, windows = parts[:3]
    try:
        counts = int(clients), int(windows)
    except ValueError as err:
        raise ValueError(f"setting {setting!r}: expected integer CLIENTS and WINDOWS, got "
                         f"{clients!r} and {windows!r}") from err
    return FedPrLLMConfig(model=model, clients=counts[0], samples_per_client=counts[1],
                          seqlen=seqlen, onload=onload or len(parts) == 4)


def peak_rss_mib() -> float:
    """This process's peak resident set so far (ru_maxrss, KiB on Linux), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def server_copy(model):
    """What the server prunes: a copy of the global model, or an onloaded skeleton itself (each
    decoder layer read, pruned and freed in turn: the copy is the layer's read)."""
    return model if onloader_of(model) is not None else copy.deepcopy(model)


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
        aggregator.prune(server_copy(model), config.server, config.prune.plan)
        server = min(server, time.perf_counter() - start)
    work = sum(site_seconds) + server
    return {"centralized_seconds": central, "site_seconds_mean": sum(site_seconds) /
            len(site_seconds), "server_seconds": server, "round_work_seconds": work,
            "ratio": work / central, "repeats": repeats,
            "centralized_seconds_each": all_central}


def flower_round(config: FedPrLLMConfig, out: Path) -> dict:
    """``fedcompress prune`` on the Simulation Engine with the centralized baseline: its
    federated round's wall time and the centralized pass of the same run."""
    cmd = [str(Path(sys.executable).parent / "fedcompress"), "prune", "--model", config.model,
           "--clients", str(config.clients), "--samples-per-client",
           str(config.samples_per_client), "--seqlen", str(config.seqlen),
           "--baselines", "centralized", "--eval-windows", "1", "--no-save-model",
           "--out", str(out)] + (["--onload"] if config.onload else [])
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
                        default=["smollm2-135m:16:4", "qwen2.5-0.5b:16:4",
                                 "qwen2.5-1.5b:16:4:onload"],
                        help="MODEL:CLIENTS:WINDOWS per site, ':onload' to onload the model")
    parser.add_argument("--seqlen", type=int, default=256,
                        help="Tokens per calibration window (every setting).")
    parser.add_argument("--onload", action="store_true",
                        help="Onload every setting's model (one decoder layer at a time).")
    parser.add_argument("--repeats", type=int, default=2,
                        help="Interleaved repeats; each side keeps its fastest.")
    parser.add_argument("--flower", action="store_true",
                        help="Also time the round under fedcompress prune (Ray).")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    configs = [parse_setting(s, opts.seqlen, opts.onload) for s in opts.setting]
    report = RunReport.for_script(__file__, opts, seeds={"seed": 0})
    with report:
        rows, kind_rows = [], []
        for setting, config in zip(opts.setting, configs):
            model_name, clients, per_site = config.model, config.clients, config.samples_per_client
            with report.phase(f"{model_name}-load"):
                loaded = load_model(model_name, device="cpu", onload=config.onload)
            windows = federation_windows(loaded.tokenizer, config)[0]
            local_masks(loaded.model, windows[0][:1], config.prune)  # warm the kernels
            with report.phase(f"{model_name}-in-process"):
                record = in_process(loaded.model, config, windows, opts.repeats)
            with report.phase(f"{model_name}-profile"):
                kinds = profile_site(loaded.model, windows[0], config)
            record.update({"name": setting, "model": model_name, "clients": clients,
                           "windows_per_site": per_site, "seqlen": config.seqlen,
                           "onload": config.onload, "threads": torch.get_num_threads(),
                           "peak_rss_mib": round(peak_rss_mib()), "site_pass_by_kind": kinds})
            del loaded
            if opts.flower:
                with report.phase(f"{model_name}-flower"):
                    record.update(flower_round(config, Path(opts.out) / f"flower-{model_name}"))
            report.add_result(record)
            rows.append([setting, f"{record['centralized_seconds']:.1f}",
                         f"{record['site_seconds_mean']:.2f}",
                         f"{record['server_seconds']:.2f}",
                         f"{record['round_work_seconds']:.1f}", f"**{record['ratio']:.2f}x**",
                         f"{record['flower_ratio']:.2f}x" if opts.flower else "-"])
            total = sum(kinds.values())
            kind_rows += [[setting, kind, f"{seconds:.2f}", f"{100 * seconds / total:.0f}%"]
                          for kind, seconds in sorted(kinds.items(), key=lambda kv: -kv[1])]
            logger.info("%s: ratio %.2fx, peak RSS so far %d MiB", setting, record["ratio"],
                        record["peak_rss_mib"])
        report.sections.append(("One-shot round vs centralized", markdown_table(
            ["setting", "centralized s", "site s (mean)", "server s", "round work s",
             "ratio", "Flower round / centralized"], rows)))
        report.sections.append(("A site's pass by kind of work (site 0, cProfile)",
                                markdown_table(["setting", "kind", "seconds", "share"],
                                               kind_rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
