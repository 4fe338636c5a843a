"""Server cost of FedPrLLM aggregation (count, select, apply) next to one site's mask pass, side
by side in one process, per model, with the memory-traffic floor of each step.

    python simulations/aggregation_cost.py --out simulations/results/aggregation_cost \\
        --models smollm2-135m qwen2.5-0.5b [--sites 16] [--windows 4] [--repeats 3] \\
        [--payloads DIR]

Per model (one after the other, in one run):

1. Every site's mask pass (Wanda 50%, row-local, ``--windows`` windows of 256 tokens of its own
   wiki share; ``local_masks``): timed; the **median over the sites** is the reference. The
   sites' masks are kept bit-packed, as the server receives them (``--payloads``: cached there,
   and the cached timings reused).
2. The server, from the held payloads (``MaskAggregator.add_packed``: read-only word views), for
   each comparison group (layer/row/column, with scaling: the most work), each step timed apart
   and run over the linear layers by the aggregator's worker threads, as ``prune`` runs them:
   ``count`` (vote counts of every layer from the packed masks), ``select`` (the global masks
   from the counts), ``apply`` (scale and zero a copy of the model's weights in place); then
   ``prune``, the server's real path end to end from the held payloads (count, select and
   apply per layer, one layer at a time per worker; its weights are checked bit-identical to
   the steps'). Medians of ``--repeats`` runs. The
   compiled kernels' one-off load (or first compilation) is timed apart, before the runs.
3. The floor of each step: the bytes it must read and write at least, divided by this
   machine's measured memory bandwidth (the best of a one-thread and a ``workers``-thread
   numpy copy of a 512 MiB array; read + written bytes per second). ``count`` reads every
   site's packed mask and writes the counts; ``select`` reads the counts and writes a one-byte
   mask; ``apply`` reads and writes the weights and reads the mask and counts; the whole
   aggregation can do no better than reading the packed masks and the weights and writing the
   weights once (``prune``'s floor). The keys read at ties are not counted (a lower bound).

``--layers N`` aggregates only the first N decoder layers (development runs on a busy machine;
the ratios are then not the model's). Writes ``report.json`` (a result per model and group),
``report.md`` and ``config.toml`` to ``--out`` (:class:`RunReport`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from fedcompress.masks.aggregate import apply_global_mask, count_dtype, load_kernels
from fedcompress.methods.fedprllm.federated import (
    FedPrLLMConfig,
    MaskAggregator,
    ServerConfig,
    encode_masks,
    federation_windows,
)
from fedcompress.models import load_model
from fedcompress.pruning.local import local_masks
from fedcompress.report import RunReport, markdown_table

GROUPS = ("layer", "row", "column")


def site_payloads(model, tokenizer, config: FedPrLLMConfig, cache: Path | None
                  ) -> tuple[list[dict[str, np.ndarray]], list[float], bool]:
    """Every site's bit-packed masks and mask-pass seconds, and whether they come from
    ``cache`` (computed, and cached when ``cache`` is given, if it does not hold them)."""
    if cache is not None and cache.exists():
        with np.load(cache) as stored:
            seconds = stored["seconds"].tolist()
            payloads = [{k[len(f"{i}/"):]: stored[k] for k in stored.files
                         if k.startswith(f"{i}/")} for i in range(config.clients)]
        return payloads, seconds, True
    payloads, seconds = [], []
    for windows in federation_windows(tokenizer, config)[0]:
        start = time.perf_counter()
        result = local_masks(model, windows, config.prune, batch_size=config.batch_size)
        seconds.append(time.perf_counter() - start)
        payloads.append(encode_masks(result.masks))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.savez(cache, seconds=np.array(seconds),
                 **{f"{i}/{k}": v for i, p in enumerate(payloads) for k, v in p.items()})
    return payloads, seconds, False


def memory_bandwidth(workers: int, mib: int, repeats: int = 5) -> dict:
    """Bytes read + written per second by a numpy copy of a ``mib`` MiB array: one thread, and
    ``workers`` threads each copying its own slice (numpy releases the GIL)."""
    src = np.ones(mib * 2**20 // 8, dtype=np.float64)
    dst = np.zeros_like(src)
    moved = 2 * src.nbytes

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return moved / min(times)

    one = best(lambda: np.copyto(dst, src))
    bounds = np.linspace(0, src.size, workers + 1).astype(int)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        many = best(lambda: list(pool.map(lambda i: np.copyto(dst[bounds[i]:bounds[i + 1]],
                                                              src[bounds[i]:bounds[i + 1]]),
                                          range(workers))))
    return {"one_thread_bytes_per_s": one, "threads_bytes_per_s": many, "threads": workers,
            "bytes_per_s": max(one, many)}


def _median_time(fn, repeats: int, setup=None) -> tuple[float, list[float], object]:
    """Median seconds of ``repeats`` calls ``fn(setup())`` (setup untimed), every run's
    seconds, and the last run's argument."""
    runs, arg = [], None
    for _ in range(repeats):
        arg = setup() if setup is not None else None
        start = time.perf_counter()
        fn(arg)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs), runs, arg


def server_steps(model, payloads, sites: int, sparsity: float, layers: list[int] | None,
                 repeats: int) -> tuple[list[dict], dict]:
    """Per group: the seconds of count, select, apply and the real ``prune`` (medians), and the
    kernels' one-off load."""
    aggregator = MaskAggregator(model, sites, layers)
    for payload in payloads:
        aggregator.add_packed({k: v for k, v in payload.items() if k in aggregator.shapes})
    keys = list(aggregator.shapes)
    start = time.perf_counter()  # the compiled kernels' one-off load / compilation
    load_kernels(sites)
    warmup = time.perf_counter() - start

    def count(_):
        return aggregator._map(aggregator.layer_counts, keys)

    count_s, count_runs, _ = _median_time(count, repeats)
    counts = dict(zip(keys, count(None)))
    rows = []
    for group in GROUPS:
        server = ServerConfig(group, scale=True)

        def select(_, server=server):
            return aggregator._map(lambda k: aggregator.global_mask(k, server, sparsity,
                                                                    counts=counts[k]), keys)

        select_s, select_runs, _ = _median_time(select, repeats)
        masks = dict(zip(keys, select(None)))

        def apply(target, masks=masks):
            aggregator._map(lambda k: apply_global_mask(aggregator._weight(k, target), masks[k],
                                                        counts[k], sites, True), keys)

        apply_s, apply_runs, stepwise = _median_time(apply, repeats,
                                                     lambda: copy.deepcopy(model))
        prune_s, prune_runs, pruned = _median_time(
            lambda target, server=server: aggregator.prune(target, server, sparsity), repeats,
            lambda: copy.deepcopy(model))
        # the real path and the steps give the same weights, bit for bit
        same = all(torch.equal(a, b) for a, b in zip(stepwise.state_dict().values(),
                                                     pruned.state_dict().values()))
        del stepwise, pruned
        rows.append({"group": group, "scale": True, "count_seconds": count_s,
                     "select_seconds": select_s, "apply_seconds": apply_s,
                     "prune_seconds": prune_s, "prune_equals_steps": same,
                     "runs": {"count": count_runs, "select": select_runs, "apply": apply_runs,
                              "prune": prune_runs}})
    return rows, {"kernel_warmup_seconds": warmup, "workers": aggregator.workers
                  or torch.get_num_threads(), "numel": sum(int(np.prod(s)) for s in
                                                           aggregator.shapes.values()),
                  "linear_layers": len(keys)}


def floors(numel: int, sites: int, bandwidth: float) -> dict[str, float]:
    """Seconds of the least memory traffic of each step at ``bandwidth`` bytes/s."""
    cb = torch.tensor([], dtype=count_dtype(sites)).element_size()
    packed = sites * numel / 8
    moved = {"count": packed + numel * cb,
             "select": numel * cb + numel,
             "apply": 4 * numel * 2 + numel + numel * cb,
             "prune": packed + 4 * numel * 2}
    return {k: v / bandwidth for k, v in moved.items()} | {f"{k}_bytes": v
                                                            for k, v in moved.items()}


def cost_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        f, site = r["floor_seconds"], r["site_seconds_median"]
        cells = [r["model"], r["group"] + "+scale", f"{site:.2f}"]
        for step in ("count", "select", "apply", "prune"):
            s = r[f"{step}_seconds"]
            cells.append(f"{s:.3f} ({100 * s / site:.1f}%; {s / f[step]:.1f}x floor)")
        cells.append(f"{100 * r['prune_seconds'] / site:.1f}%")
        cells.append("yes" if r["prune_equals_steps"] else "**NO**")
        out.append(cells)
    return markdown_table(
        ["model", "server group", "site mask pass s (median)", "count s", "select s",
         "apply s", "prune s (count+select+apply, the real path)", "server / site",
         "prune's weights = the steps'"], out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="simulations/results/aggregation_cost")
    parser.add_argument("--models", "--model", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b"],
                        help="model specs, measured one after the other in this run")
    parser.add_argument("--sites", type=int, default=16)
    parser.add_argument("--windows", type=int, default=4, help="windows of 256 tokens per site")
    parser.add_argument("--seqlen", type=int, default=256, help="tokens per window")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bandwidth-mib", type=int, default=512,
                        help="MiB of the array whose copy measures the memory bandwidth")
    parser.add_argument("--layers", type=int, default=0,
                        help="aggregate only the first N decoder layers (0: all; development)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--payloads", default="",
                        help="folder caching the sites' packed masks (computed once, reused; "
                             "the site timings are then the cached ones)")
    opts = parser.parse_args(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    with RunReport.for_script(__file__, opts, seeds={"seed": FedPrLLMConfig().seed}) as report:
        report.markdown_results = False  # the section's table shows them, with the ratios
        with report.phase("bandwidth"):
            workers = torch.get_num_threads()  # the aggregator's default worker threads
            bandwidth = memory_bandwidth(workers, opts.bandwidth_mib)
        report.extra["memory_bandwidth"] = bandwidth
        bw = bandwidth["bytes_per_s"]
        sections, all_rows = [], []
        for name in opts.models:
            config = FedPrLLMConfig(model=name, clients=opts.sites,
                                    samples_per_client=opts.windows, seqlen=opts.seqlen)
            with report.phase(f"{name}:load"):
                loaded = load_model(name, device="cpu")
            model = loaded.model
            cache = (Path(opts.payloads) / f"{Path(name).name}-{opts.sites}x{opts.windows}x"
                     f"{opts.seqlen}.npz" if opts.payloads else None)
            with report.phase(f"{name}:sites"):
                payloads, site_s, cached = site_payloads(model, loaded.tokenizer, config, cache)
            site = statistics.median(site_s)
            layers = list(range(opts.layers)) if opts.layers else None
            with report.phase(f"{name}:server"):
                rows, info = server_steps(model, payloads, opts.sites,
                                          config.prune.target_sparsity, layers, opts.repeats)
            floor = floors(info["numel"], opts.sites, bw)
            for row in rows:
                row.update(name=f"{name}:{row['group']}+scale", model=name, sites=opts.sites,
                           windows=opts.windows,
                           site_seconds_median=site, site_seconds=site_s,
                           payloads_from_cache=cached, floor_seconds=floor,
                           server_over_site=row["prune_seconds"] / site, **info)
                report.add_result(row)
            all_rows += rows
            sections.append(
                f"**{name}**: {info['numel'] / 1e6:.1f} M prunable weights in "
                f"{info['linear_layers']} linear layers"
                + (f" (the first {opts.layers} decoder layers only)" if opts.layers else "")
                + f"; site mask pass {site:.2f} s (median of {len(site_s)} sites, "
                f"{opts.windows} windows each"
                + (f", measured before and cached in {cache}" if cached else "")
                + f"); kernels' one-off load {info['kernel_warmup_seconds']:.2f} s (not in the "
                f"steps); {info['workers']} worker threads. Floors at "
                f"{bw / 1e9:.1f} GB/s: count {floor['count']:.3f} s "
                f"({floor['count_bytes'] / 2**20:.0f} MiB), select {floor['select']:.3f} s, "
                f"apply {floor['apply']:.3f} s, prune {floor['prune']:.3f} s "
                f"({floor['prune_bytes'] / 2**20:.0f} MiB).")
            del model, loaded, payloads
        report.sections.append((
            f"Server aggregation vs one site's mask pass ({opts.sites} sites)",
            f"Memory bandwidth (numpy copy of {opts.bandwidth_mib} MiB, read + written bytes/s, "
            f"best of 5): one thread "
            f"{bandwidth['one_thread_bytes_per_s'] / 1e9:.1f} GB/s, {workers} threads "
            f"{bandwidth['threads_bytes_per_s'] / 1e9:.1f} GB/s.\n\n"
            + "\n\n".join(sections) + "\n\n"
            + "Each step: seconds (of the site's mask pass; times its memory-traffic floor). "
            "`prune` is the server's real path from the held payloads (counting included).\n\n"
            + cost_table(all_rows)))
    print(report.markdown())


if __name__ == "__main__":
    main()
