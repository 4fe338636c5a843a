"""FedPrLLM benchmark on one model: quality orderings, speed and memory, side by side.

    python simulations/fedprllm_benchmark.py --out simulations/results/fedprllm [--eval-windows N]

Runs (each a `fedcompress prune` subprocess, so the peak RSS of its whole process tree, Ray
workers included, is sampled):

1. one-shot, 16 clients x 4 windows: dense, centralized, local-only and the 6 one-shot server
   variants (layer/row/column x scaling) from the SAME client masks;
2. iterative, one run per server variant (the masks depend on it): 6 runs;
3. memory: one-shot with 8 and with 64 clients (4 windows each), no baselines.

Writes OUT/summary.json and OUT/summary.md (tables, the paper's orderings checked, speed and
memory ratios). Ratios are measured in the same invocation on the same machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

GROUPS = ("layer", "row", "column")


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def run(name: str, out: Path, args: list[str]) -> dict:
    """One `fedcompress prune` run; returns its report plus peak tree RSS and wall time."""
    target = out / name
    report_file = target / "report.json"
    if report_file.exists() and json.loads(report_file.read_text())["status"] == "ok":
        print(f"[{name}] done before, reusing {report_file}", flush=True)
        return json.loads(report_file.read_text())
    cmd = [sys.executable, "-m", "fedcompress.cli", "prune", "--out", str(target),
           "--log-level", "WARNING", *args]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    ps = psutil.Process(proc.pid)
    peak = [0]

    def sample():
        while proc.poll() is None:
            try:
                peak[0] = max(peak[0], tree_rss(ps))
            except psutil.NoSuchProcess:
                break
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = proc.wait()
    sampler.join()
    if code != 0:
        raise RuntimeError(f"run {name} failed with exit code {code}")
    report = json.loads(report_file.read_text())
    report["benchmark"] = {"peak_rss_bytes": peak[0], "wall_seconds": time.perf_counter() - start}
    report_file.write_text(json.dumps(report, indent=2))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="simulations/results/fedprllm")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="wanda")
    parser.add_argument("--sparsity", default="0.5")
    parser.add_argument("--eval-windows", default="100",
                        help="evaluation windows of 256 tokens (0: the whole wiki test split)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: "
                                                   "iterative,memory")
    opts = parser.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--model", opts.model, "--method", opts.method, "--sparsity", opts.sparsity,
              "--eval-windows", opts.eval_windows, "--no-save-model"]
    skip = set(opts.skip.split(","))

    results: dict[str, dict] = {}
    oneshot = run("oneshot", out, [*common, "--variants", "all"])
    for r in oneshot["results"]:
        results[r["name"]] = r
    if "iterative" not in skip:
        for group in GROUPS:
            for scale in (False, True):
                name = f"iterative-{group}{'+scale' if scale else ''}"
                rep = run(name, out, [*common, "--mode", "iterative", "--group", group,
                                      "--scale" if scale else "--no-scale",
                                      "--baselines", "none"])
                results[rep["results"][0]["name"]] = rep["results"][0]
    memory = {}
    if "memory" not in skip:
        for clients in (8, 64):
            rep = run(f"memory-{clients}", out, [*common, "--clients", str(clients),
                                                 "--baselines", "none", "--eval-windows", "2"])
            memory[clients] = rep["benchmark"]["peak_rss_bytes"]

    ppl = {name: r["perplexity"] for name, r in results.items()}
    fed = results["fedprllm-oneshot-layer"]
    checks = []

    def check(label: str, ok: bool, detail: str) -> None:
        checks.append({"check": label, "holds": bool(ok), "detail": detail})

    for group in ("layer", "row"):
        v = ppl[f"fedprllm-oneshot-{group}"]
        check(f"one-shot {group}, no scaling <= local-only", v <= ppl["local-only"],
              f"{v:.3f} vs {ppl['local-only']:.3f}")
        check(f"one-shot {group}, no scaling within 3% of centralized",
              v <= 1.03 * ppl["centralized"], f"{v:.3f} vs {ppl['centralized']:.3f} "
              f"({100 * (v / ppl['centralized'] - 1):+.2f}%)")
    col, row = ppl["fedprllm-oneshot-column"], ppl["fedprllm-oneshot-row"]
    check("column comparison over row-local masks >= 2x row", col >= 2 * row,
          f"{col:.3f} vs {row:.3f} ({col / row:.2f}x)")
    for group in GROUPS:
        a, b = ppl[f"fedprllm-oneshot-{group}+scale"], ppl[f"fedprllm-oneshot-{group}"]
        check(f"scaling worse than no scaling ({group})", a > b, f"{a:.3f} vs {b:.3f}")
    if "iterative" not in skip:
        for group in GROUPS:
            a, b = ppl[f"fedprllm-iterative-{group}"], ppl[f"fedprllm-oneshot-{group}"]
            check(f"iterative about equal to one-shot ({group}, within 2%)",
                  abs(a / b - 1) <= 0.02, f"{a:.3f} vs {b:.3f} ({100 * (a / b - 1):+.2f}%)")
    central = results["centralized"]["prune_seconds"]
    speed = {"federated_round_seconds": fed["federated_seconds"],
             "engine_startup_seconds": fed["startup_seconds"],
             "centralized_prune_seconds": central,
             "client_compute_seconds_mean": fed["client_seconds_mean"],
             "ratio": fed["federated_seconds"] / central}
    check("one-shot pruning round (16 clients) <= 2x centralized pruning of the same windows",
          speed["ratio"] <= 2.0, f"{speed['ratio']:.2f}x")
    if memory:
        ratio = memory[64] / memory[8]
        check("peak RSS, 64 clients <= 1.2x 8 clients", ratio <= 1.2,
              f"{memory[64] / 2**30:.2f} GiB vs {memory[8] / 2**30:.2f} GiB ({ratio:.2f}x)")

    summary = {"command": " ".join(sys.argv), "model": opts.model, "method": opts.method,
               "sparsity": opts.sparsity, "eval_windows": opts.eval_windows,
               "perplexity": ppl, "speed": speed, "peak_rss_bytes": memory, "checks": checks,
               "bytes_up_per_client": fed["bytes_up_per_client"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = [f"# FedPrLLM benchmark: {opts.model}, {opts.method} {opts.sparsity}", "",
             f"Command: `{summary['command']}`", "",
             f"Perplexity on the bundled wiki test split, {opts.eval_windows} windows of 256 "
             "tokens (0 = all).", "", "| model | perplexity |", "|---|---|"]
    lines += [f"| {name} | {value:.3f} |" for name, value in ppl.items()]
    lines += ["", "| check | holds | detail |", "|---|---|---|"]
    lines += [f"| {c['check']} | {'yes' if c['holds'] else '**no**'} | {c['detail']} |"
              for c in checks]
    lines += ["", "Speed (s): " + ", ".join(f"{k} {v:.2f}" for k, v in speed.items()),
              f"Bytes up per client (one-shot): {fed['bytes_up_per_client']:,}"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
