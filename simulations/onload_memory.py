"""Peak memory of the centralized Wanda pass: the whole model loaded vs sequential onloading.

    nice -n 10 python simulations/onload_memory.py --out simulations/results/onload-memory

For each model of ``--models`` and each mode, a fresh subprocess loads the model, cuts the
centralized calibration set (the union of ``--sites`` sites' ``--windows`` windows of
``--seqlen`` tokens of the bundled wiki corpus: ``federation_windows`` as a FedPrLLM run) and
runs ONE centralized pruning pass (``local_masks``, Wanda 50%, row groups):

* ``full``: ``load_model(spec)``, the whole model in memory (its safetensors memory-mapped by
  transformers; the walk touches every layer, so the whole model becomes resident);
* ``onload``: ``load_model(spec, onload=True)``, a skeleton on the meta device whose embeddings,
  norms and head are read at once and whose decoder layers the walker reads one at a time from
  the safetensors files (``safe_open``), freed after each.

Reported per run: the process's peak resident set (``ru_maxrss``: imports, loading, windows and
the pass), the resident set after imports and after loading, the seconds of loading and of the
pass, and a sha256 of every mask; per model, the ratio onload / full of the peak and whether the
masks are identical. Writes ``report.json``/``report.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys

from fedcompress.report import RunReport, markdown_table

logger = logging.getLogger("onload_memory")
MIB = 2 ** 20
MODES = ("full", "onload")


def _rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / MIB


def worker(model_name: str, mode: str, sites: int, windows: int, seqlen: int,
           batch_size: int) -> dict:
    """One centralized pass in this process: its peak RSS, timings and the masks' hash."""
    import hashlib
    import time

    import numpy as np
    import torch

    from fedcompress.methods.fedprllm.config import FedPrLLMConfig
    from fedcompress.methods.fedprllm.federated import federation_windows
    from fedcompress.models import load_model
    from fedcompress.pruning.local import local_masks

    imported = _rss_mib()
    start = time.perf_counter()
    loaded = load_model(model_name, device="cpu", dtype="float32", onload=mode == "onload")
    load_seconds = time.perf_counter() - start
    after_load = _rss_mib()
    config = FedPrLLMConfig(model=model_name, clients=sites, samples_per_client=windows,
                            seqlen=seqlen, batch_size=batch_size, onload=mode == "onload")
    union = torch.cat(federation_windows(loaded.tokenizer, config)[0])
    start = time.perf_counter()
    result = local_masks(loaded.model, union, config.prune, batch_size=batch_size,
                         progress=True)
    pass_seconds = time.perf_counter() - start
    digest = hashlib.sha256()
    pruned = total = 0
    for layer in result.masks:
        for name in sorted(layer):
            mask = layer[name]
            digest.update(name.encode())
            digest.update(np.packbits(mask.numpy()).tobytes())
            pruned += int(mask.sum())
            total += mask.numel()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"model": model_name, "mode": mode, "peak_rss_mib": peak,
            "rss_after_imports_mib": imported, "rss_after_load_mib": after_load,
            "load_seconds": load_seconds, "pass_seconds": pass_seconds,
            "windows": int(union.shape[0]), "seqlen": int(union.shape[1]),
            "layers": len(result.masks), "mask_sparsity": pruned / total,
            "masks_sha256": digest.hexdigest(), "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="simulations/results/onload-memory")
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b,qwen2.5-1.5b",
                        help="Comma-separated model specs.")
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--windows", type=int, default=1, help="Windows per site.")
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if not opts.worker:
        return measure(opts)
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(worker(opts.models, opts.worker, opts.sites, opts.windows, opts.seqlen,
                            opts.batch_size)))
    return 0


def _in_subprocess(model: str, mode: str, opts: argparse.Namespace) -> dict:
    """One mode's record from a fresh process (its peak RSS is its own)."""
    out = subprocess.run(
        [sys.executable, __file__, "--models", model, "--worker", mode, "--sites",
         str(opts.sites), "--windows", str(opts.windows), "--seqlen", str(opts.seqlen),
         "--batch-size", str(opts.batch_size)], check=True, stdout=subprocess.PIPE,
        text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(opts: argparse.Namespace) -> int:
    """Both modes of every model side by side, into the report."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    report = RunReport.for_script(__file__, argparse.Namespace(
        **{k: v for k, v in vars(opts).items() if k != "worker"}))
    rows: list[list[str]] = []
    summary: dict[str, dict] = {}
    with report:
        for model in [m for m in opts.models.split(",") if m]:
            records = {}
            for mode in MODES:
                with report.phase(f"{model} {mode}"):
                    record = _in_subprocess(model, mode, opts)
                records[mode] = record
                report.add_result({"name": f"{model} {mode}", **record})
                logger.info("%s %s: peak RSS %.0f MiB (after load %.0f MiB), pass %.1fs",
                            model, mode, record["peak_rss_mib"], record["rss_after_load_mib"],
                            record["pass_seconds"])
            full, onload = records["full"], records["onload"]
            ratio = onload["peak_rss_mib"] / full["peak_rss_mib"]
            same = full["masks_sha256"] == onload["masks_sha256"]
            summary[model] = {"peak_ratio": ratio, "identical_masks": same}
            for mode, record in records.items():
                rows.append([model, mode, f"{record['peak_rss_mib']:.0f}",
                             f"{record['rss_after_imports_mib']:.0f}",
                             f"{record['rss_after_load_mib']:.0f}",
                             f"{record['load_seconds']:.1f}", f"{record['pass_seconds']:.1f}",
                             f"{ratio:.3f}" if mode == "onload" else "",
                             str(same) if mode == "onload" else "",
                             record["masks_sha256"][:12]])
            if not same:
                raise RuntimeError(f"{model}: onloading gave other masks than the whole model")
        report.extra["summary"] = summary
        report.sections.append(("Peak memory of the centralized Wanda pass", markdown_table(
            ["model", "mode", "peak RSS MiB", "RSS after imports MiB", "RSS after load MiB",
             "load s", "pass s", "peak onload / full", "identical masks", "masks sha256"],
            rows) + f"\n\n{opts.sites} sites x {opts.windows} window(s) x {opts.seqlen} tokens "
            "(the union: the centralized pass), Wanda 50% row-wise, float32, CPU; each run in a "
            "fresh process, peak = ru_maxrss over the whole process (imports, loading, pass)."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
