"""Communication of FedPrLLM: exact bytes per client and round, one-shot vs iterative, for each
wire format, and the simulated end-to-end time under network profiles with stragglers
(paper Tables 16-17 shape).

    python simulations/communication.py --out simulations/results/communication \\
        [--bench simulations/results/bench-wanda] [--codec simulations/results/mask_codec]

Bytes: bit-packed payload sizes are exact (from the model's shapes); the compressed format's
per-layer sizes are those measured by ``simulations/mask_codec.py`` on real client masks
(``--codec``: its ``report.json``, or the ``results.json`` it wrote before it used
``RunReport``), or left out when absent. Client compute seconds: the mean
one-client mask computation measured by the Wanda bench (``--bench``: its ``results.jsonl``),
split evenly over layers in iterative mode. Nothing here is timed: it is arithmetic on
measured quantities (``fedcompress.bench.network``).

Writes ``report.json`` (a result per wire format with its bytes, and one per wire format, client
count and network profile with its simulated times), ``report.md`` and ``config.toml`` to
``--out`` (:class:`RunReport`).

The same simulation of a bench's own cells (each cell's measured bytes up/down, rounds, client
and server seconds, in its wire format) is a bench study ``[study.NAME] kind = "network"``
(:mod:`fedcompress.bench.studies`; ``simulations/bench_network_leakage.toml``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from fedcompress.bench.network import (
    PROFILES,
    Stragglers,
    compare,
    iterative_schedule,
    layer_mask_bytes,
    markdown_table,
    oneshot_schedule,
)
from fedcompress.report import RunReport
from fedcompress.report import markdown_table as report_markdown_table


def model_shapes(model: str) -> dict[str, tuple]:
    """Wire key -> weight shape of every prunable linear layer, from the model's config (no
    weights are materialized)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fedcompress.methods.fedprllm.federated import expected_shapes
    from fedcompress.models import load_model

    try:
        loaded = load_model(model, device="cpu")
        return expected_shapes(loaded.model)
    except Exception:  # a hub id without weights here: shapes from the config alone
        config = AutoConfig.from_pretrained(model)
        with torch.device("meta"):
            return expected_shapes(AutoModelForCausalLM.from_config(config))


def measured_client_seconds(bench: Path | None) -> float | None:
    if bench is None or not (bench / "results.jsonl").exists():
        return None
    seconds = []
    for line in (bench / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        if (r.get("status") == "ok" and r.get("kind") == "fedprllm" and r.get("clients") == 16
                and r.get("samples_per_client") == 4 and r.get("sparsity") == 0.5
                and r.get("client_seconds_mean")):
            seconds.append(r["client_seconds_mean"])
    return min(seconds) if seconds else None


def codec_layer_bytes(codec: Path | None, shapes: dict[str, tuple]) -> dict[str, list[int]]:
    """Per-decoder-layer bytes of the compressed format measured by mask_codec.py on 50% Wanda
    client masks (mean over its clients), per reference. Its totals are split over the decoder
    layers in proportion to their weights (the measured payloads are per linear group, not per
    decoder layer)."""
    if codec is not None and (codec / "report.json").exists():
        records = json.loads((codec / "report.json").read_text())["results"]
    elif codec is not None and (codec / "results.json").exists():  # before RunReport
        records = json.loads((codec / "results.json").read_text())["records"]
    else:
        return {}
    per_layer_weights: dict[int, int] = {}
    for key, shape in shapes.items():
        layer = int(key.split(".")[1])
        per_layer_weights[layer] = per_layer_weights.get(layer, 0) + int(np.prod(shape))
    total_weights = sum(per_layer_weights.values())
    totals: dict[str, list[int]] = {}
    for record in records:
        if record["method"] == "wanda" and record["sparsity"] == 0.5:
            for ref, coder in record["coders"].items():
                totals.setdefault(ref, []).append(coder["ctx_bytes"])
    formats = {}
    for ref, values in totals.items():
        total = float(np.mean(values))
        formats[f"compressed (reference {ref})"] = [
            int(round(total * per_layer_weights[i] / total_weights))
            for i in sorted(per_layer_weights)]
    return formats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="simulations/results/communication")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--bench", type=Path, default=Path("simulations/results/bench-wanda"))
    parser.add_argument("--codec", type=Path, default=Path("simulations/results/mask_codec"))
    parser.add_argument("--clients", default="16,64")
    parser.add_argument("--compute-seconds", type=float, default=None,
                        help="one client's mask computation (default: measured by --bench)")
    parser.add_argument("--stragglers", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()

    compute = opts.compute_seconds or measured_client_seconds(opts.bench)
    if compute is None:
        raise SystemExit("no measured client compute time: run the Wanda bench first or pass "
                         "--compute-seconds")
    stragglers = Stragglers(fraction=opts.stragglers, seed=opts.seed)
    with RunReport.for_script(__file__, opts, seeds={"seed": opts.seed}) as report:
        with report.phase("model_shapes"):
            shapes = model_shapes(opts.model)
        weights = sum(int(a) * int(b) for a, b in shapes.values())
        packed = layer_mask_bytes(shapes)
        formats = {"bit-packed": packed, **codec_layer_bytes(opts.codec, shapes)}
        report.markdown_results = False  # the sections' tables show them
        report.extra.update({"model": opts.model, "weights": weights, "layers": len(packed),
                             "client_compute_seconds": compute})
        byte_rows, tables = [], []
        down = layer_mask_bytes(shapes)  # global masks go down bit-packed
        for name, per_layer in formats.items():
            total = sum(per_layer)
            it_total = total + sum(down[:-1])
            record = {"name": name, "bits_per_weight": 8 * total / weights,
                      "oneshot_bytes_up_per_client": total,
                      "iterative_max_bytes_up_per_round": max(per_layer),
                      "iterative_bytes_per_client": it_total,
                      "oneshot_bytes_up_16_clients": 16 * total, "layer_bytes": per_layer}
            report.add_result(record)
            byte_rows.append(record)
            one = oneshot_schedule(per_layer, compute)
            it = iterative_schedule(per_layer, compute, global_mask_bytes=down)
            for n in [int(c) for c in opts.clients.split(",")]:
                rows = compare(one, it, n, tuple(PROFILES), stragglers)
                for r in rows:
                    report.add_result({"name": f"{name}, {n} clients, {r['profile']}",
                                       "format": name, **{k: v for k, v in r.items()
                                                          if k not in ("oneshot", "iterative")}})
                tables.append((f"{name}, {n} clients ({opts.stragglers:.0%} stragglers: half "
                               "bandwidth, half compute speed)", markdown_table(rows)))
        report.sections.append((
            f"FedPrLLM communication: {opts.model}",
            f"{weights:,} prunable weights in {len(packed)} decoder layers; one client's mask "
            f"computation {compute:.1f} s (measured). Iterative: one round per layer, each "
            "uploading that layer's masks and downloading the previous layer's global mask "
            "(always bit-packed); one-shot: one round.\n\n" + report_markdown_table(
                ["wire format", "bits/weight", "one-shot: bytes up per client (1 round)",
                 "iterative: bytes up per client per round (max)",
                 "iterative: up + down per client, total",
                 "all 16 clients, one-shot, total up"],
                [[r["name"], f"{r['bits_per_weight']:.4f}",
                  f"{r['oneshot_bytes_up_per_client']:,}",
                  f"{r['iterative_max_bytes_up_per_round']:,}",
                  f"{r['iterative_bytes_per_client']:,}",
                  f"{r['oneshot_bytes_up_16_clients']:,}"] for r in byte_rows])))
        report.sections.append(("Simulated end-to-end time", "\n\n".join(
            f"### {title}\n\n{table.rstrip()}" for title, table in tables)))
    print(report.markdown())


if __name__ == "__main__":
    main()
