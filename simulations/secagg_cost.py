"""What SecAgg+ costs next to the plain bit-packed vote, and what authentication and the
consistency round add to it, side by side in one run.

    python simulations/secagg_cost.py --model smollm2-135m --clients 16 \\
        --out simulations/results/secagg

Every site computes its one-shot Wanda masks once (the same for every vote); then

* **plain**: the bit-packed payloads, counted by the server (:class:`MaskAggregator`);
* **SecAgg+, unauthenticated** (what the Simulation Engine runs without keys): the stages of
  :mod:`fedcompress.privacy.secagg` for every site (keys, shares, masked votes, unmasking
  shares), no signatures and no consistency round;
* **SecAgg+, authenticated**: every site signs its keys with a long-term P-384 key and checks
  every peer's signature, and the consistency round runs (each survivor signs the survivor set,
  each checks ``t`` signatures before unmasking): what a deployed site runs;
* each of the two again with ``--drop`` sites lost before their masked votes;
* with ``--complete``, the authenticated vote again on the complete masking graph (every site
  masks with every other, SecAgg rather than SecAgg+): what the sparse graph saves.

The masking graph's degree is ``--neighbours`` (default ``FedPrLLMConfig``'s: ``2 ceil(log2
n)``, 8 of 16 sites, 12 of 64).

The counts of each secure vote must equal the plain counts of the same sites bit for bit (the
script stops otherwise). Reported per stage: seconds per site (mean) and bytes per site up and
down; the server's seconds; and the one-shot round's work (the sites' mask computation plus
the vote). The sites run one after another here; in a federation they run in parallel, so the
per-site columns are what one site adds to its own round. Writes ``report.json``,
``report.md`` and ``config.toml`` to ``--out`` (:class:`RunReport`).
"""

from __future__ import annotations

import argparse
import copy
import logging
import time
from collections.abc import Mapping

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric import ec

from fedcompress.masks.stats import flatten_masks
from fedcompress.methods.fedprllm.federated import (
    FedPrLLMConfig,
    MaskAggregator,
    encode_masks,
    federation_windows,
)
from fedcompress.models import load_model
from fedcompress.privacy.secagg import (
    CURVE,
    SecAggConfig,
    SecAggServer,
    SecAggSite,
    identity_public,
)
from fedcompress.pruning.local import local_masks
from fedcompress.report import RunReport, markdown_table

logger = logging.getLogger("secagg_cost")

STAGES = ("keys", "share", "masked", "confirm", "unmask")


class PackedVotes(dict):
    """Each site's 0/1 vote vector kept bit-packed (64 sites' uint8 vectors would take 7 GB on
    SmolLM2); ``votes[i]`` unpacks one (outside the timed calls)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel = numel

    def __getitem__(self, site: int) -> np.ndarray:
        return np.unpackbits(super().__getitem__(site), count=self.numel)


def secure_vote(votes: Mapping[int, np.ndarray], threshold: int, lost: set[int],
                authenticated: bool, neighbours: int = 0, bits: int = 0, layer: int = -1
                ) -> dict:
    """The stages over ``votes`` (site -> 0/1 vector; ``bits=64``: fixed-point uint64
    statistics), sites in ``lost`` silent from the masked stage on; ``authenticated``: signed
    keys and the consistency round; ``neighbours``: the masking graph's degree (0: the
    default). Per stage: every site's seconds and bytes up and down; the server's seconds."""
    numel = votes.numel if isinstance(votes, PackedVotes) else next(iter(votes.values())).size
    config = SecAggConfig(tuple(sorted(votes)), threshold, numel, bits=bits, run=1, round=1,
                          layer=layer, neighbours=neighbours)
    seconds = {st: {i: 0.0 for i in votes} for st in STAGES}
    up = {st: {i: 0 for i in votes} for st in STAGES}
    down = {st: {i: 0 for i in votes} for st in STAGES}
    identities = {i: ec.generate_private_key(CURVE) for i in votes} if authenticated else {}
    peers = {identity_public(k): f"site-{i}" for i, k in identities.items()} or None

    def timed(stage, i, fn, *args, **kw):
        start = time.perf_counter()
        out = fn(*args, **kw)
        seconds[stage][i] += time.perf_counter() - start
        return out

    sites = {i: timed("keys", i, SecAggSite, i, config, identity=identities.get(i),
                      peers=peers, min_neighbours=config.neighbours) for i in votes}
    server = SecAggServer(config)
    server.public = {i: s.advertise() for i, s in sites.items()}
    advert_bytes = {i: sum(len(x) for x in a) for i, a in server.public.items()}
    for i in votes:
        up["keys"][i] += advert_bytes[i]
        down["share"][i] += sum(advert_bytes.values())
    shares = {i: timed("share", i, s.share, server.public) for i, s in sites.items()}
    for i, per in shares.items():
        up["share"][i] += sum(len(b) for b in per.values())
    start = time.perf_counter()
    inbox = server.relay(shares)
    server_s = time.perf_counter() - start
    masked = {}
    for i, s in sites.items():
        down["masked"][i] += sum(len(b) for b in inbox.get(i, {}).values())
        if i in lost:
            continue
        masked[i] = timed("masked", i, s.masked, votes[i], inbox.get(i, {}))
        up["masked"][i] += masked[i].nbytes
    survivors = sorted(masked)
    signatures = {}
    if authenticated:
        for i in survivors:
            signatures[i] = timed("confirm", i, sites[i].confirm, survivors)
            down["confirm"][i] += 8 * len(survivors)
            up["confirm"][i] += len(signatures[i])
    unmask = {}
    for i in survivors:
        unmask[i] = timed("unmask", i, sites[i].unmask, survivors, signatures)
        up["unmask"][i] += sum(len(b) for b in unmask[i].values())
        down["unmask"][i] += 8 * len(survivors) + sum(len(s) + 8 for s in signatures.values())
    start = time.perf_counter()
    counts = server.aggregate(masked, unmask)
    server_s += time.perf_counter() - start
    per_stage = {st: {"site_seconds": float(np.mean([seconds[st][i] for i in survivors])),
                      "bytes_up": float(np.mean([up[st][i] for i in survivors])),
                      "bytes_down": float(np.mean([down[st][i] for i in survivors]))}
                 for st in STAGES}
    return {"counts": counts, "sites": len(votes), "survivors": len(survivors),
            "threshold": threshold, "lanes": config.lanes, "authenticated": authenticated,
            "neighbours": config.neighbours,
            "consistency_round": authenticated, "stages": per_stage,
            "site_seconds": [sum(seconds[st][i] for st in STAGES) for i in survivors],
            "server_seconds": server_s,
            "bytes_up": [sum(up[st][i] for st in STAGES) for i in survivors],
            "bytes_down": [sum(down[st][i] for st in STAGES) for i in survivors],
            "masked_bytes": config.upload_bytes}


def stage_table(runs: dict[str, dict]) -> str:
    """Per stage and vote: a site's seconds (mean) and bytes up and down."""
    rows = []
    for name, r in runs.items():
        for stage, st in r["stages"].items():
            if not any(st.values()):
                continue
            rows.append([name, stage, f"{st['site_seconds']:.4f}", f"{st['bytes_up']:,.0f}",
                         f"{st['bytes_down']:,.0f}"])
        rows.append([name, "server (relay + unmask)", f"{r['server_seconds']:.4f}", "-", "-"])
    return markdown_table(["vote", "stage", "site s (mean)", "bytes up per site",
                           "bytes down per site"], rows)


def _secure_summer(method: str, votes: list[dict], threshold: int, neighbours: int):
    """``stats_prune``'s ``sum_fixed``: an authenticated SecAgg+ vote over a layer's fixed-point
    vectors, its sum checked against the plain modular sum, its costs appended to ``votes``."""
    def secure_sum(layer: int, vectors: list[np.ndarray]) -> np.ndarray:
        expected = np.zeros_like(vectors[0])
        with np.errstate(over="ignore"):
            for v in vectors:
                expected += v
        result = secure_vote(dict(enumerate(vectors)), threshold, set(), True, neighbours,
                             bits=64, layer=layer)
        total = result.pop("counts").view(np.uint64)
        if not np.array_equal(total, expected):
            raise SystemExit(f"{method}, layer {layer}: the secure sum differs from the plain "
                             "sum")
        votes.append(result)
        return total
    return secure_sum


def stats_mode(args, model, windows, cfg: FedPrLLMConfig, report: RunReport) -> None:
    """Statistics mode (one decoder layer per round) in the clear and over SecAgg+, per pruning
    rule in ``args.stats``: the sites' and the server's work of each (two runs of
    :func:`stats_prune`, the sites one after another), the secure run's per-layer sums made by
    authenticated SecAgg+ votes with the consistency round over the sites' 64-bit fixed-point
    vectors (each vote's sum checked equal to the plain sum of the same vectors, bit for bit)."""
    from fedcompress.methods.fedprllm.stats import stats_prune

    threshold = cfg.threshold_for(args.clients)
    neighbours = cfg.neighbours_for(args.clients)
    results = {}
    for method in args.stats:
        stats_cfg = cfg.replace(method=method, aggregate="stats", secagg=False)
        plain = stats_prune(copy.deepcopy(model), windows, stats_cfg, args.batch_size)
        votes: list[dict] = []
        secure_sum = _secure_summer(method, votes, threshold, neighbours)
        secure = stats_prune(copy.deepcopy(model), windows, stats_cfg, args.batch_size,
                             frac_bits=cfg.secagg_frac_bits, sum_fixed=secure_sum)

        def work(run) -> float:
            return float(sum(s * args.clients for s in run.site_seconds)
                         + sum(run.server_seconds))
        site_vote = float(sum(np.mean(v["site_seconds"]) for v in votes))
        server_vote = float(sum(v["server_seconds"] for v in votes))
        secure_work = work(secure) + site_vote * args.clients + server_vote
        protocol = float(sum(1e3 * sum(st["site_seconds"] for name, st in v["stages"].items()
                                       if name != "masked") for v in votes) / len(votes))
        results[method] = {
            "layers": len(votes), "plain_round_work_seconds": work(plain),
            "secure_round_work_seconds": secure_work,
            "ratio": secure_work / work(plain),
            "plain_site_seconds": float(sum(plain.site_seconds)),
            "secure_site_seconds": float(sum(secure.site_seconds)),
            "vote_site_seconds": site_vote, "vote_server_seconds": server_vote,
            "protocol_ms_per_vote": protocol,
            "vote_masked_seconds": float(sum(v["stages"]["masked"]["site_seconds"]
                                             for v in votes)),
            "bytes_up_per_site": float(sum(np.mean(v["bytes_up"]) for v in votes)),
            "plain_bytes_up_per_site": float(sum(plain.bytes_up_per_site)),
            "sums_identical": True, "neighbours": neighbours, "threshold": threshold}
        logger.info("statistics mode, %s: %.3fx", method, results[method]["ratio"])
    report.extra["stats_mode"] = results
    rows = [[m, str(r["layers"]), f"{r['plain_site_seconds']:.2f}",
             f"{r['vote_site_seconds']:.2f}", f"{r['protocol_ms_per_vote']:.1f}",
             f"{r['vote_server_seconds']:.2f}", f"{r['plain_bytes_up_per_site'] / 1e6:.1f}",
             f"{r['bytes_up_per_site'] / 1e6:.1f}", f"{r['plain_round_work_seconds']:.1f}",
             f"{r['secure_round_work_seconds']:.1f}", f"{r['ratio']:.3f}"]
            for m, r in results.items()]
    report.sections.append((
        "Statistics mode over SecAgg+ vs plain statistics mode",
        f"{args.model}, {args.clients} sites x {args.windows} windows; one authenticated "
        "SecAgg+ vote (signed keys, consistency round, masking graph of degree "
        f"{neighbours}, threshold {threshold}) per decoder layer over each site's 64-bit "
        "fixed-point statistics, every sum equal to the plain sum of the same vectors bit for "
        "bit. 'round work' is every site's and the server's seconds over all layers (sites one "
        "after another; the messages' latency is not in it).\n\n"
        + markdown_table(["rule", "layers", "a site's statistics s (plain)",
                          "a site's SecAgg+ s", "protocol ms per vote (not masking)",
                          "server SecAgg+ s", "MB up per site (plain)",
                          "MB up per site (SecAgg+)", "plain round work s",
                          "SecAgg+ round work s", "x plain"], rows)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--drop", type=int, default=2, help="sites lost before masking")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--neighbours", type=int, default=0,
                        help="the masking graph's degree (0: 2 * ceil(log2 clients))")
    parser.add_argument("--complete", action="store_true",
                        help="also the authenticated vote on the complete graph")
    parser.add_argument("--stats", nargs="*", default=[], choices=("wanda", "sparsegpt"),
                        help="also statistics mode over SecAgg+ against plain statistics mode, "
                             "for these pruning rules")
    parser.add_argument("--out", default="simulations/results/secagg")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = FedPrLLMConfig(model=args.model, clients=args.clients, sparsity=args.sparsity,
                         samples_per_client=args.windows, seqlen=args.seqlen,
                         batch_size=args.batch_size, secagg=True,
                         secagg_neighbours=args.neighbours)
    with RunReport.for_script(__file__, args, seeds={"seed": cfg.seed}) as report:
        report.markdown_results = False  # the sections' tables show them
        with report.phase("load"):
            loaded = load_model(args.model, device="cpu")
            windows = federation_windows(loaded.tokenizer, cfg)[0]
        client_s: list[float] = []
        payloads: list[dict[str, np.ndarray]] = []
        votes: PackedVotes | None = None
        with report.phase("site_masks"):
            for i, w in enumerate(windows):
                start = time.perf_counter()
                masks = local_masks(loaded.model, w, cfg.prune, batch_size=args.batch_size).masks
                client_s.append(time.perf_counter() - start)
                payloads.append(encode_masks(masks))
                flat = flatten_masks(masks)
                vote = np.concatenate([flat[k].reshape(-1).numpy().astype(np.uint8)
                                       for k in sorted(flat)])
                votes = votes if votes is not None else PackedVotes(vote.size)
                dict.__setitem__(votes, i, np.packbits(vote))
                logger.info("site %d: masks in %.1f s", i, client_s[-1])
        keys = sorted(payloads[0])

        def plain(sites: list[int]) -> tuple[np.ndarray, float]:
            start = time.perf_counter()
            agg = MaskAggregator(loaded.model, len(sites))
            for i in sites:
                agg.add_packed(payloads[i])
            counts = agg.counts()
            seconds = time.perf_counter() - start
            return (torch.cat([counts[k].reshape(-1) for k in keys]).numpy().astype(np.int64),
                    seconds)

        everyone = list(range(args.clients))
        plain(everyone[:2])  # compiles the counting kernel: not part of the timing
        plain_counts, plain_s = plain(everyone)
        packed_bytes = sum(int(p.nbytes) for p in payloads[0].values())
        threshold = cfg.threshold_for(args.clients)
        neighbours = cfg.neighbours_for(args.clients)
        assert votes is not None
        runs = {}
        lost_set = set(everyone[:args.drop])
        with report.phase("secure_warmup"):  # first-touch allocations: not part of the timing
            secure_vote(votes, threshold, set(), False, neighbours)
        with report.phase("secure_votes"):
            cells = [("secagg, unauthenticated", set(), False, neighbours),
                     ("secagg, authenticated + consistency", set(), True, neighbours),
                     (f"secagg, unauthenticated, {args.drop} dropped", lost_set, False,
                      neighbours),
                     (f"secagg, authenticated + consistency, {args.drop} dropped", lost_set,
                      True, neighbours)]
            if args.complete:
                cells.append(("secagg, authenticated + consistency, complete graph", set(),
                              True, args.clients - 1))
            for name, lost, auth, degree in cells:
                result = secure_vote(votes, threshold, lost, auth, degree)
                expected = (plain_counts if not lost
                            else plain([i for i in everyone if i not in lost])[0])
                identical = bool(np.array_equal(result.pop("counts"), expected))
                if not identical:
                    raise SystemExit(f"{name}: the secure counts differ from the plain vote")
                runs[name] = {**result, "identical_to_plain": identical,
                              "round_work_seconds": sum(client_s) + sum(result["site_seconds"])
                              + result["server_seconds"]}
                logger.info("%s: identical counts; %.1f MB up per site", name,
                            np.mean(result["bytes_up"]) / 1e6)
        unauth, auth = runs["secagg, unauthenticated"], runs["secagg, authenticated + consistency"]

        def protocol_ms(r: dict) -> float:
            """A site's seconds in the stages other than masking (the same work in both)."""
            return 1e3 * sum(st["site_seconds"] for name, st in r["stages"].items()
                             if name != "masked")
        round_plain = sum(client_s) + plain_s
        report.extra.update({
            "protocol_ms_per_site": {"unauthenticated": protocol_ms(unauth),
                                     "authenticated": protocol_ms(auth)},
            "model": args.model, "clients": args.clients, "windows": args.windows,
            "sparsity": args.sparsity, "weights": int(plain_counts.size),
            "threshold": threshold, "neighbours": neighbours, "client_mask_seconds": client_s,
            "plain": {"bytes_up": packed_bytes, "server_seconds": plain_s,
                      "round_work_seconds": round_plain},
            "secure": runs})
        rows = [["plain (bit-packed)", "-", f"{packed_bytes:,}", "1.00", "-",
                 f"{np.mean(client_s):.2f} (masks)", f"{plain_s:.2f}", f"{round_plain:.1f}",
                 "1.00"]]
        for name, r in runs.items():
            mean_up = float(np.mean(r["bytes_up"]))
            rows.append([f"{name} ({r['survivors']} of {r['sites']})",
                         str(r["identical_to_plain"]), f"{mean_up:,.0f}",
                         f"{mean_up / packed_bytes:.2f}", f"{np.mean(r['bytes_down']):,.0f}",
                         f"{np.mean(r['site_seconds']):.3f} (+ masks)",
                         f"{r['server_seconds']:.2f}", f"{r['round_work_seconds']:.1f}",
                         f"{r['round_work_seconds'] / round_plain:.3f}"])
        lanes = unauth["lanes"]
        report.sections.append((
            "SecAgg+ vote vs the plain bit-packed vote",
            f"{args.model}, {args.clients} sites x {args.windows} windows, Wanda "
            f"{args.sparsity}, {plain_counts.size:,} prunable weights; threshold {threshold}; "
            f"masking graph of degree {neighbours}"
            f"{' (complete)' if neighbours >= args.clients - 1 else ''}: each site masks with "
            f"{neighbours} others. "
            "The sites ran one after another on this machine; 'round work' is the sum of every "
            "site's and the server's seconds (in a federation the sites run in parallel).\n\n"
            + markdown_table(["vote", "counts = plain", "bytes up per site", "x packed",
                              "bytes down per site", "site s (mean)", "server s",
                              "round work s", "x plain"], rows)
            + "\n\nSigned keys and the consistency round: a site's stages other than masking "
            f"(keys, share, confirm, unmask) take {protocol_ms(auth):.1f} ms against "
            f"{protocol_ms(unauth):.1f} ms unauthenticated, and "
            f"{np.mean(auth['bytes_up']) - np.mean(unauth['bytes_up']):,.0f} more bytes up "
            f"and {np.mean(auth['bytes_down']) - np.mean(unauth['bytes_down']):,.0f} more "
            "down per site; masking (the same in both) dominates the vote.\n\n"
            f"A masked vote packs {lanes} weights per 64-bit word as digits of base "
            f"{args.clients + 1} ({64 / lanes:.2f} bits per weight): a masked value must be "
            "uniform over a "
            f"group that holds the sum of {args.clients} votes, so no masking scheme sends "
            f"fewer than log2({args.clients + 1}) = {np.log2(args.clients + 1):.2f} bits per "
            "weight, against 1 for the plain bit-packed mask."))
        report.sections.append(("Per stage", stage_table(runs)))
        if args.stats:
            with report.phase("stats_mode"):
                stats_mode(args, loaded.model, windows, cfg, report)
    print(report.markdown())


if __name__ == "__main__":
    main()
