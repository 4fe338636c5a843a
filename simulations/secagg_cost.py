"""What SecAgg+ costs next to the plain bit-packed vote, side by side in one run.

    python simulations/secagg_cost.py --out simulations/results/secagg

Every site computes its one-shot Wanda masks once (the same for both votes); then

* **plain**: the bit-packed payloads, counted by the server (:class:`MaskAggregator`);
* **SecAgg+**: the four stages of :mod:`fedcompress.privacy.secagg` for every site (keys,
  shares, masked votes, unmasking shares) and the server's relay and unmasking;
* **SecAgg+ with dropouts**: ``--drop`` sites lost before their masked votes.

The counts of each secure vote must equal the plain counts of the same sites bit for bit (the
script stops otherwise). Reported: bytes per site up and down, seconds per site and at the
server, and the one-shot round's work (the sites' mask computation plus the vote) with each.
The sites run one after another here; in a federation they run in parallel, so the per-site
columns are what one site adds to its own round. Writes ``results.json`` and ``report.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fedcompress.masks.stats import flatten_masks
from fedcompress.methods.fedprllm.federated import (
    FedPrLLMConfig,
    MaskAggregator,
    encode_masks,
    federation_windows,
)
from fedcompress.models import load_model
from fedcompress.privacy.secagg import SecAggConfig, SecAggServer, SecAggSite
from fedcompress.pruning.local import local_masks

logger = logging.getLogger("secagg_cost")


def secure_vote(votes: dict[int, np.ndarray], threshold: int, lost: set[int]) -> dict:
    """The four stages over ``votes`` (site -> 0/1 vector), sites in ``lost`` silent from the
    masked stage on; timings and bytes per stage."""
    n, numel = len(votes), next(iter(votes.values())).size
    config = SecAggConfig(tuple(sorted(votes)), threshold, numel)
    site_s = {i: 0.0 for i in votes}
    up = {i: 0 for i in votes}
    down = {i: 0 for i in votes}

    def timed(i, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        site_s[i] += time.perf_counter() - start
        return out

    sites = {i: timed(i, SecAggSite, i, config) for i in votes}
    server = SecAggServer(config)
    server.public = {i: timed(i, s.advertise) for i, s in sites.items()}
    for i in votes:
        up[i] += sum(len(k) for k in server.public[i])
        down[i] += sum(len(c) + len(s) for c, s in server.public.values())
    shares = {i: timed(i, s.share, server.public) for i, s in sites.items()}
    for i, per in shares.items():
        up[i] += sum(len(b) for b in per.values())
    start = time.perf_counter()
    inbox = server.relay(shares)
    server_s = time.perf_counter() - start
    masked = {}
    for i, s in sites.items():
        down[i] += sum(len(b) for b in inbox.get(i, {}).values())
        if i in lost:
            continue
        masked[i] = timed(i, s.masked, votes[i], inbox.get(i, {}))
        up[i] += masked[i].nbytes
    survivors = sorted(masked)
    dropped = [i for i in votes if i not in masked]
    unmask = {}
    for i in survivors:
        unmask[i] = timed(i, sites[i].unmask, survivors, dropped)
        up[i] += sum(len(b) for b in unmask[i].values())
        down[i] += 8 * (len(survivors) + len(dropped))
    start = time.perf_counter()
    counts = server.aggregate(masked, unmask)
    server_s += time.perf_counter() - start
    return {"counts": counts, "sites": n, "survivors": len(survivors), "threshold": threshold,
            "bits": config.bits, "site_seconds": [site_s[i] for i in survivors],
            "server_seconds": server_s,
            "bytes_up": [up[i] for i in survivors], "bytes_down": [down[i] for i in survivors],
            "masked_bytes": config.upload_bytes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--drop", type=int, default=2, help="sites lost before masking")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", default="simulations/results/secagg")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = FedPrLLMConfig(model=args.model, clients=args.clients, sparsity=args.sparsity,
                         samples_per_client=args.windows, seqlen=args.seqlen,
                         batch_size=args.batch_size, secagg=True)
    loaded = load_model(args.model, device="cpu")
    windows = federation_windows(loaded.tokenizer, cfg)[0]
    client_s, payloads, votes = [], [], {}
    for i, w in enumerate(windows):
        start = time.perf_counter()
        masks = local_masks(loaded.model, w, cfg.prune, batch_size=args.batch_size).masks
        client_s.append(time.perf_counter() - start)
        payloads.append(encode_masks(masks))
        flat = flatten_masks(masks)
        votes[i] = np.concatenate([flat[k].reshape(-1).numpy().astype(np.uint8)
                                   for k in sorted(flat)])
        logger.info("site %d: masks in %.1f s", i, client_s[-1])
    keys = sorted(payloads[0])

    def plain(sites: list[int]) -> tuple[np.ndarray, float]:
        start = time.perf_counter()
        agg = MaskAggregator(loaded.model, len(sites))
        for i in sites:
            agg.add_packed(payloads[i])
        counts = agg.counts()
        seconds = time.perf_counter() - start
        return torch.cat([counts[k].reshape(-1) for k in keys]).numpy().astype(np.int64), seconds

    everyone = list(range(args.clients))
    plain(everyone[:2])  # compiles the counting kernel: not part of the timing
    plain_counts, plain_s = plain(everyone)
    packed_bytes = sum(int(p.nbytes) for p in payloads[0].values())
    threshold = cfg.threshold_for(args.clients)
    runs = {}
    for name, lost in (("secagg", set()), (f"secagg, {args.drop} dropped",
                                           set(everyone[:args.drop]))):
        result = secure_vote(votes, threshold, lost)
        expected = plain_counts if not lost else plain([i for i in everyone if i not in lost])[0]
        identical = bool(np.array_equal(result.pop("counts"), expected))
        if not identical:
            raise SystemExit(f"{name}: the secure counts differ from the plain vote")
        runs[name] = {**result, "identical_to_plain": identical}
        logger.info("%s: identical counts; %.1f MB up per site", name,
                    np.mean(result["bytes_up"]) / 1e6)
    round_plain = sum(client_s) + plain_s
    report = {
        "command": "python " + shlex.join([sys.argv[0], *sys.argv[1:]]),
        "model": args.model, "clients": args.clients, "windows": args.windows,
        "sparsity": args.sparsity, "weights": int(plain_counts.size),
        "client_mask_seconds": client_s,
        "plain": {"bytes_up": packed_bytes, "server_seconds": plain_s,
                  "round_work_seconds": round_plain},
        "secure": {name: {**r, "round_work_seconds": sum(client_s) + sum(r["site_seconds"])
                          + r["server_seconds"]} for name, r in runs.items()},
    }
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# SecAgg+ vote vs the plain bit-packed vote", "",
             f"Command: `{report['command']}`.", "",
             f"{args.model}, {args.clients} sites x {args.windows} windows, Wanda "
             f"{args.sparsity}, {plain_counts.size:,} prunable weights; threshold {threshold}. "
             "The sites ran one after another on this machine; 'round work' is the sum of every "
             "site's and the server's seconds (in a federation the sites run in parallel).", "",
             "| vote | counts = plain | bytes up per site | x packed | bytes down per site | "
             "site s (mean) | server s | round work s | x plain |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| plain (bit-packed) | - | {packed_bytes:,} | 1.00 | - | "
             f"{np.mean(client_s):.2f} (masks) | {plain_s:.2f} | {round_plain:.1f} | 1.00 |"]
    for name, r in report["secure"].items():
        mean_up = float(np.mean(r["bytes_up"]))
        lines.append(
            f"| {name} ({r['survivors']} of {r['sites']}) | {r['identical_to_plain']} | "
            f"{mean_up:,.0f} | {mean_up / packed_bytes:.2f} | "
            f"{np.mean(r['bytes_down']):,.0f} | {np.mean(r['site_seconds']):.2f} (+ masks) | "
            f"{r['server_seconds']:.2f} | {r['round_work_seconds']:.1f} | "
            f"{r['round_work_seconds'] / round_plain:.2f} |")
    bits = runs["secagg"]["bits"]
    lines += ["", f"A masked vote takes {bits}-bit lanes ({64 // bits} weights per 64-bit word, "
              f"{64 / (64 // bits):.2f} bits per weight): a masked value must be uniform over a "
              f"group that holds the sum of {args.clients} votes, so no masking scheme sends "
              f"fewer than log2({args.clients + 1}) = {np.log2(args.clients + 1):.2f} bits per "
              "weight, against 1 for the plain bit-packed mask.", ""]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
