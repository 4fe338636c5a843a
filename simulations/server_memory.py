"""Peak server memory of the one-shot vote: every payload held vs counted as it arrives.

    python simulations/server_memory.py --out simulations/results/server-memory

For ``--sites`` sites (default 64) on ``--model``, each site's bit-packed payload (1 bit per
linear weight, the wire's size; seeded random bits: the content does not change the memory)
arrives one after another and goes to the server's :class:`MaskAggregator`, which then prunes
the global model with the vote. Two modes, each in its own subprocess, side by side:

* ``held``: the aggregator keeps every payload until the vote (the former server);
* ``streaming``: it counts each payload into running counts as it arrives and drops it
  (``MaskAggregator(streaming=True)``, what the strategy does as replies arrive).

Reported: the peak resident memory above the process's level after loading the model, making
its weights resident (they are memory-mapped from the safetensors file: pruning them in place
otherwise adds the model's size, whatever the number of sites) and compiling the vote's kernels
on a small vote (sampled every 5 ms), the payload size and the running
counts' size, and whether both modes give the same pruned model (a hash of its weights).
Writes ``report.json``/``report.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import subprocess
import sys
import threading
import time

import numpy as np
import psutil

from fedcompress.report import RunReport, markdown_table

logger = logging.getLogger("server_memory")
MIB = 2 ** 20


def worker(model_name: str, sites: int, mode: str) -> dict:
    """One mode in this process: the peak RSS above the loaded model's level."""
    import torch

    from fedcompress.masks.aggregate import count_dtype
    from fedcompress.methods.fedprllm.federated import MaskAggregator, ServerConfig
    from fedcompress.models import load_model

    model = load_model(model_name, device="cpu").model
    warm = MaskAggregator(model, 2, layers=[0])  # compile the kernels (not the vote's memory)
    for _ in range(2):
        warm.add({k: torch.zeros(s, dtype=torch.bool) for k, s in warm.shapes.items()})
    warm.prune(model, ServerConfig(), 0.5)  # layer 0, the same in both modes
    del warm
    with torch.no_grad():  # the weights the vote prunes in place: resident before the baseline
        for param in model.parameters():
            param.add_(0)
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    aggregator = MaskAggregator(model, sites, streaming=mode == "streaming")
    nbytes = {k: (int(np.prod(s)) + 7) // 8 for k, s in aggregator.shapes.items()}
    for site in range(sites):
        rng = np.random.default_rng(site)
        payload = {k: rng.integers(0, 256, n, dtype=np.uint8) for k, n in nbytes.items()}
        aggregator.add_packed(payload)
        del payload
    aggregator.prune(model, ServerConfig(), 0.5)
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.contiguous().numpy().tobytes())
    numel = sum(int(np.prod(s)) for s in aggregator.shapes.values())
    return {"mode": mode, "sites": sites, "peak_extra_mib": (peak[0] - base) / MIB,
            "payload_mib": sum(nbytes.values()) / MIB,
            "counts_mib": numel * torch.empty(0, dtype=count_dtype(sites)).element_size() / MIB,
            "seconds": seconds, "model_sha256": digest.hexdigest()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="simulations/results/server-memory")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sites", type=int, default=64)
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        print(json.dumps(worker(opts.model, opts.sites, opts.worker)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    shown = argparse.Namespace(**{k: v for k, v in vars(opts).items() if k != "worker"})
    report = RunReport.for_script(__file__, shown)
    with report:
        rows = []
        records = {}
        for mode in ("held", "streaming"):
            with report.phase(mode):
                out = subprocess.run(
                    [sys.executable, __file__, "--model", opts.model, "--sites",
                     str(opts.sites), "--worker", mode], check=True, capture_output=True,
                    text=True).stdout
            record = json.loads(out.strip().splitlines()[-1])
            records[mode] = record
            report.add_result({"name": mode, **record})
            rows.append([mode, str(opts.sites), f"{record['peak_extra_mib']:.0f}",
                         f"{record['payload_mib']:.1f}", f"{record['counts_mib']:.1f}",
                         f"{record['seconds']:.1f}"])
            logger.info("%s: peak +%.0f MiB", mode, record["peak_extra_mib"])
        same = records["held"]["model_sha256"] == records["streaming"]["model_sha256"]
        report.extra["same_pruned_model"] = same
        report.sections.append(("Server memory of the vote", markdown_table(
            ["mode", "sites", "peak MiB above the loaded model", "one payload MiB",
             "counts MiB", "seconds"], rows) + f"\n\nSame pruned model: **{same}**."))
        if not same:
            raise RuntimeError("the streaming vote pruned another model than the held one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
