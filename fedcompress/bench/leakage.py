"""The leakage experiments of shared prune masks (FedPrLLM App. C) on one model.

The definitions are in :mod:`fedcompress.privacy.leakage` (pure functions); this module loads
the model, computes every mask the experiments need and measures them. Two front ends run it:
``simulations/leakage.py`` (a script, one run) and the bench (``[study.NAME] kind = "leakage"``
in ``fedcompress bench``, one resumable cell per setting; :mod:`fedcompress.bench.studies`).

What is computed: the calibration stream (``calib_text``/``calib_split``, tokenized once) is cut
into non-overlapping ``seqlen``-token chunks; ``clients`` clients get ``samples_per_client``
distinct chunks each (the last one is the client's *target*); every other role (replacement
windows, half-overlap fillers, the reference attacker's public windows, non-member candidates)
gets further distinct chunks, all drawn with ``seed``. Masks are the local masks of ``method``
at ``sparsity`` within ``local_group``, computed by the sequential calibration walker on the
first ``layers`` decoder layers (the later layers are removed from the in-memory model first;
the masks of the kept layers are the ones the full pass gives, since layer l's mask depends
only on layers < l).

(a) information in a mask vs in the weights (whole model and the measured layers), with
    conditional entropies of a client mask given the data-free magnitude mask, given another
    client's mask, and given the mask of a neighbouring dataset;
(b) Hamming distances: same windows (recomputed; reversed order), overlap W-1 of W (one window
    replaced), overlap W/2, disjoint (all client pairs);
(c) one-window sensitivity (target -> other, other -> other, with vs without the target);
(d) membership of the target window: the knows-the-rest attacker and the reference attacker
    (ROC AUC, top-1 rate, score distributions).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from itertools import combinations
from typing import Any, ClassVar

import torch

from fedcompress.config import Settings, setting
from fedcompress.privacy import leakage as lk

logger = logging.getLogger(__name__)

__all__ = ["PAPER", "LeakageConfig", "headline", "measure", "quantities", "sections"]

#: The paper's numbers (LLaMA-7B, App. C), by quantity key.
PAPER = {
    "mask_bits": "1.0 bit/weight",
    "fp16_entropy": "13.75 bits (q_proj, layer 0)",
    "mask_vs_fp16": "7.3%",
    "disjoint": "4.96%",
    "target_to_other": "4.96% (\"DP sensitivity\")",
    "with_vs_without_target": "3.23% (\"MIA signal\": with vs without the target)",
}


@dataclass(frozen=True)
class LeakageConfig(Settings):
    """One leakage experiment. The names are the bench's (FedPrLLM's) where they mean the same:
    ``local_group`` is the clients' comparison group of the masks, ``samples_per_client`` the
    windows per client (W), ``calib_text``/``calib_split`` the calibration corpus."""

    label: ClassVar[str] = "leakage"

    model: str = setting("smollm2-135m", "Model spec (embedded name, local directory, ...).")
    dtype: str = setting("float32", "Model dtype.", choices=("float32", "bfloat16", "float16"))
    method: str = setting("wanda", "Local pruning method of the masks.",
                          choices=("magnitude", "wanda", "sparsegpt", "gradient"))
    sparsity: float = setting(0.5, "Sparsity of the masks.", gt=0.0, lt=1.0)
    local_group: str = setting("row", "Comparison group of the masks.",
                               choices=("layer", "row", "column"))
    calib_text: str = setting("wiki", "Calibration corpus: bundled name, hub name or a file.")
    calib_split: str = setting("train", "Split of the calibration corpus.")
    seqlen: int = setting(256, "Tokens per window.", ge=2)
    samples_per_client: int = setting(4, "Windows per client (W; the last is the target).",
                                      ge=2)
    clients: int = setting(8, "Clients with disjoint windows.", ge=2)
    replacements: int = setting(2, "Fresh windows replacing each client's target window.",
                                ge=1)
    half_overlap: int = setting(4, "Clients whose mask is compared with one sharing half their "
                                   "windows.", ge=0)
    nonmembers: int = setting(12, "Fresh non-member candidates of the reference attacker.",
                              ge=0)
    layers: int = setting(6, "Measure the first N decoder layers (0: all).", ge=0)
    batch_size: int = setting(4, "Windows per forward.", ge=1)
    seed: int = setting(0, "Seed of every random choice.", ge=0)

    def validate(self) -> None:
        if self.half_overlap > self.clients:
            raise self.invalid("half_overlap", f"at most clients ({self.clients})")


# ------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------

def dense_information(model: torch.nn.Module, sparsity: float, group: str) -> dict:
    """(a) on the whole model: mask bits vs dense bits, empirical entropy of fp16 weights."""
    from fedcompress.methods.fedprllm.federated import expected_shapes
    from fedcompress.models import ModelAdapter, weight_matrix

    adapter = ModelAdapter(model)
    shapes = expected_shapes(model)
    info = lk.mask_information(shapes, sparsity, group)
    weights = [weight_matrix(m).detach().to(torch.float16)
               for layer in adapter.layers for m in ModelAdapter.linear_layers(layer).values()]
    info["fp16_entropy_bits_per_weight"] = lk.value_entropy(weights)
    first = ModelAdapter.linear_layers(adapter.layers[0])
    q_name = next((n for n in first if n.endswith("q_proj")), next(iter(first)))
    q = weight_matrix(first[q_name]).detach()
    info["first_layer_linear"] = q_name
    info["first_layer_fp16_entropy"] = lk.value_entropy(q.to(torch.float16))
    info["first_layer_fp32_entropy"] = lk.value_entropy(q.to(torch.float32))
    info["first_layer_weights"] = q.numel()
    return info


def measure(config: LeakageConfig, device: str | None = None,
            timings: dict[str, float] | None = None) -> dict:
    """Every number of the experiments; the seconds of the phases ``setup``, ``masks`` and
    ``analysis`` are added to ``timings``."""
    from fedcompress.data.calibration import tokenize_corpus
    from fedcompress.data.corpora import load_corpus
    from fedcompress.masks import stats
    from fedcompress.methods.fedprllm.federated import expected_shapes
    from fedcompress.models import load_model, num_layers, remove_layers
    from fedcompress.pruning.local import PruneConfig, local_masks

    timings = {} if timings is None else timings
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    prune = PruneConfig(config.method, config.sparsity, config.local_group)
    w = config.samples_per_client

    lm = load_model(config.model, device=device, dtype=config.dtype)
    model = lm.model
    total_layers = num_layers(model)
    info_model = dense_information(model, prune.target_sparsity, config.local_group)
    layers = total_layers if config.layers == 0 else min(config.layers, total_layers)
    if layers < total_layers:
        remove_layers(model, list(range(layers, total_layers)))
    shapes = expected_shapes(model)
    info_layers = lk.mask_information(shapes, prune.target_sparsity, config.local_group)

    tokens = tokenize_corpus(lm.tokenizer, load_corpus(config.calib_text, config.calib_split))
    available = tokens.numel() // config.seqlen
    plan = lk.make_plan(available, config.clients, w, config.replacements, config.half_overlap,
                        config.nonmembers, config.seed)
    vocab = int(getattr(lm.tokenizer, "vocab_size", 0) or len(lm.tokenizer))
    timings["setup"] = timings.get("setup", 0.0) + time.perf_counter() - start

    # ---- every mask the experiments need, computed once each ----
    jobs: list[tuple[str, list[int]]] = []
    for i, d in enumerate(plan.clients):
        jobs.append((f"client{i}", d))
    jobs.append(("client0-repeat", plan.clients[0]))
    jobs.append(("client0-reversed", list(reversed(plan.clients[0]))))
    for i, fill in enumerate(plan.half_overlap):
        jobs.append((f"half{i}", plan.clients[i][: w // 2] + fill))
    for i, reps in enumerate(plan.replacements):
        for r, o in enumerate(reps):
            jobs.append((f"replace{i}.{r}", plan.clients[i][:-1] + [o]))
    for i, d in enumerate(plan.clients):
        jobs.append((f"without{i}", d[:-1]))
    jobs.append(("reference", plan.reference))
    candidates = plan.targets + plan.nonmembers
    for j, c in enumerate(candidates):
        jobs.append((f"candidate{j}", plan.reference + [c]))

    masks: dict[str, dict[str, torch.Tensor]] = {}
    mask_seconds: dict[str, float] = {}
    for k, (name, chunks) in enumerate(jobs, 1):
        t0 = time.perf_counter()
        windows = lk.disjoint_windows(tokens, config.seqlen, chunks)
        masks[name] = stats.flatten_masks(
            local_masks(model, windows, prune, batch_size=config.batch_size).masks)
        mask_seconds[name] = time.perf_counter() - t0
        logger.info("[%d/%d] %s (%d windows): %.1fs", k, len(jobs), name, len(chunks),
                    mask_seconds[name])
    t0 = time.perf_counter()
    magnitude = stats.flatten_masks(local_masks(
        model, lk.disjoint_windows(tokens, config.seqlen, plan.reference),
        PruneConfig("magnitude", config.sparsity, config.local_group)).masks)
    mask_seconds["magnitude"] = time.perf_counter() - t0
    timings["masks"] = timings.get("masks", 0.0) + sum(mask_seconds.values())
    start = time.perf_counter()

    C = config.clients
    client = [masks[f"client{i}"] for i in range(C)]

    # ---- (b) Hamming distances by overlap ----
    def h(a, b) -> float:
        return stats.hamming_distance(a, b)

    same = [h(client[0], masks["client0-repeat"])]
    reversed_order = [h(client[0], masks["client0-reversed"])]
    replaced = [h(client[i], masks[f"replace{i}.{r}"])
                for i in range(C) for r in range(config.replacements)]
    half = [h(client[i], masks[f"half{i}"]) for i in range(config.half_overlap)]
    pairs = list(combinations(range(C), 2))
    disjoint = [h(client[i], client[j]) for i, j in pairs]
    with_without = [h(client[i], masks[f"without{i}"]) for i in range(C)]
    other_other = [h(masks[f"replace{i}.{r}"], masks[f"replace{i}.{q}"])
                   for i in range(C) for r, q in combinations(range(config.replacements), 2)]

    counts = stats.vote_counts_of(client)
    mean_pairwise = stats.mean_pairwise_hamming(counts, C)
    unanimous = stats.unanimity(counts, C)
    histogram = stats.vote_histogram(counts, C)

    def per_part(pairs_of_masks, by: str) -> dict[str, float]:
        acc: dict[str, list[float]] = {}
        for a, b in pairs_of_masks:
            distance = stats.hamming(a, b)
            split = distance.by_decoder_layer() if by == "layer" else distance.by_linear()
            for key, v in split.per_layer.items():
                acc.setdefault(key, []).append(v)
        return {k: sum(v) / len(v) for k, v in acc.items()}

    disjoint_pairs = [(client[i], client[j]) for i, j in pairs]
    replaced_pairs = [(client[i], masks[f"replace{i}.{r}"])
                      for i in range(C) for r in range(config.replacements)]

    # ---- (a) conditional entropies (bits per weight, measured layers) ----
    h_given_magnitude = [stats.conditional_entropy(m, magnitude).overall for m in client]
    h_given_other = [stats.conditional_entropy(client[i], client[j]).overall for i, j in pairs]
    h_given_neighbour = [stats.conditional_entropy(a, b).overall for a, b in replaced_pairs]
    d_magnitude = [h(m, magnitude) for m in client]

    # ---- (d) membership ----
    strong_scores, strong_members = [], []
    for i in range(C):
        # the member candidate is the client's own data: M(D_i[:W-1] + [t_i]) = M(D_i), whose
        # recomputation gives the same mask (checked: client0-repeat); non-members: replacements
        member_mask = masks["client0-repeat"] if i == 0 else client[i]
        cands = [member_mask] + [masks[f"replace{i}.{r}"] for r in range(config.replacements)]
        strong_scores.append(lk.closeness_scores(client[i], cands))
        strong_members.append([True] + [False] * config.replacements)
    strong = lk.membership_auc(strong_scores, strong_members)

    cand_masks = [masks[f"candidate{j}"] for j in range(len(candidates))]
    weak_scores, weak_members = [], []
    for i in range(C):
        weak_scores.append(lk.approach_scores(client[i], masks["reference"], cand_masks))
        weak_members.append([j == i for j in range(len(candidates))])
    weak = lk.membership_auc(weak_scores, weak_members)
    weak_member_scores = [weak_scores[i][i] for i in range(C)]
    weak_nonmember_scores = [s for i in range(C) for j, s in enumerate(weak_scores[i]) if j != i]
    ref_distance = [h(masks["reference"], client[i]) for i in range(C)]

    data_bits = w * config.seqlen * math.log2(vocab)
    scope = {"layers": layers, "total_layers": total_layers, "vocab_size": vocab,
             "stream_tokens": int(tokens.numel()), "available_windows": available}
    result = {
        "config": {**config.to_dict(), **scope},
        "scope": scope,
        "plan": plan.to_dict(),
        "mask_seconds": mask_seconds,
        "information": {
            "model": info_model,
            "measured_layers": info_layers,
            "client_data_bits_upper_bound": data_bits,
            "h_mask_given_magnitude": lk.summary(h_given_magnitude),
            "h_mask_given_other_client": lk.summary(h_given_other),
            "h_mask_given_neighbour": lk.summary(h_given_neighbour),
            "hamming_to_magnitude_mask": lk.summary(d_magnitude),
            "mask_entropy_measured": stats.mask_entropy(client[0]).overall,
        },
        "hamming": {
            "same_windows": lk.summary(same),
            "same_windows_reversed_order": lk.summary(reversed_order),
            "overlap_w_minus_1": lk.summary(replaced),
            "overlap_half": lk.summary(half),
            "disjoint": lk.summary(disjoint),
            "disjoint_matrix": stats.pairwise_hamming_matrix(client).tolist(),
            "mean_pairwise_from_counts": mean_pairwise.overall,
            "unanimity": unanimous.overall,
            "vote_histogram": histogram.overall.tolist(),
            "per_decoder_layer": {"disjoint": per_part(disjoint_pairs, "layer"),
                                  "one_window_replaced": per_part(replaced_pairs, "layer")},
            "per_linear": {"disjoint": per_part(disjoint_pairs, "linear"),
                           "one_window_replaced": per_part(replaced_pairs, "linear")},
        },
        "sensitivity": {"target_to_other": lk.summary(replaced),
                        "other_to_other": lk.summary(other_other),
                        "with_vs_without_target": lk.summary(with_without)},
        "membership": {
            "knows_rest": {**strong, "member_distance": lk.summary([-s[0] for s in strong_scores]),
                           "nonmember_distance": lk.summary(
                               [-v for s in strong_scores for v in s[1:]])},
            "reference": {**weak, "member_score": lk.summary(weak_member_scores),
                          "nonmember_score": lk.summary(weak_nonmember_scores),
                          "reference_to_client_distance": lk.summary(ref_distance)},
        },
    }
    timings["analysis"] = timings.get("analysis", 0.0) + time.perf_counter() - start
    return result


# ------------------------------------------------------------------------------------------
# Rendering
# ------------------------------------------------------------------------------------------

def pct(x: float) -> str:
    return f"{100 * x:.3f}%"


def dist(s: dict) -> str:
    """``mean ± std [min, max] (n=...)`` of a :func:`~fedcompress.privacy.leakage.summary`,
    as percentages."""
    if s["n"] == 0:
        return "-"
    if s["n"] == 1:
        return f"{pct(s['mean'])} (n=1)"
    return f"{pct(s['mean'])} ± {pct(s['std'])} [{pct(s['min'])}, {pct(s['max'])}] (n={s['n']})"


def bits(x: float) -> str:
    for unit, scale in (("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if x >= scale:
            return f"{x / scale:.4g} {unit}"
    return f"{x:.4g} bit"


#: The parts of the leakage table: (a) information, (b) Hamming, (c) sensitivity,
#: (d) membership.
PARTS = {"a": "Information", "b": "Hamming distances", "c": "Sensitivity",
         "d": "Membership inference"}


def quantities(r: dict) -> list[tuple[str, str, str, str]]:
    """The rows of the leakage table of one result: ``(part, key, quantity, measured)``; part
    is a key of :data:`PARTS`, ``key`` a stable name (also of :data:`PAPER`)."""
    c = r["config"]
    inf, hm, mem, sens = r["information"], r["hamming"], r["membership"], r["sensitivity"]
    im = inf["model"]
    w = c["samples_per_client"]
    g = c["local_group"]
    other = inf["h_mask_given_other_client"]
    return [
        ("a", "dense_bits", f"dense weights, whole model ({im['weights']:,} linear weights)",
         f"{bits(im['dense_bits_16'])} at 16 bit, {bits(im['dense_bits_32'])} at 32 bit"),
        ("a", "fp16_entropy", "empirical entropy of the fp16 weight values",
         f"{im['fp16_entropy_bits_per_weight']:.2f} bit/weight (all linear); "
         f"{im['first_layer_fp16_entropy']:.2f} ({im['first_layer_linear']}, layer 0; "
         f"fp32 values {im['first_layer_fp32_entropy']:.2f})"),
        ("a", "mask_bits", f"mask, whole model: packed / entropy bound / exact {g}-wise count",
         f"{bits(im['packed_bits'])} / {bits(im['entropy_bits'])} / "
         f"{bits(im['selection_bits'])} ({im['selection_bits'] / im['weights']:.4f} bit/weight)"),
        ("a", "mask_vs_fp16", "mask bits / fp16 weight bits",
         f"{im['entropy_bits'] / im['dense_bits_16']:.2%} (vs entropy of fp16 values: "
         f"{im['entropy_bits'] / (im['weights'] * im['fp16_entropy_bits_per_weight']):.2%})"),
        ("a", "h_given_magnitude", "H(client mask \\| data-free magnitude mask)",
         f"{inf['h_mask_given_magnitude']['mean']:.4f} bit/weight "
         f"(Hamming to magnitude mask {pct(inf['hamming_to_magnitude_mask']['mean'])})"),
        ("a", "h_given_other", "H(client mask \\| another client's mask), disjoint data",
         f"{other['mean']:.4f} ± {other['std']:.4f} bit/weight = "
         f"{bits(other['mean'] * inf['measured_layers']['weights'])} per client "
         "(plug-in, per weight)"),
        ("a", "h_given_neighbour", "H(client mask \\| mask with one window replaced)",
         f"{inf['h_mask_given_neighbour']['mean']:.4f} bit/weight"),
        ("a", "data_bits", f"one client's calibration data (upper bound {w}×{c['seqlen']} "
                           f"tokens × log2 {c['vocab_size']})",
         f"{bits(inf['client_data_bits_upper_bound'])}: a mask, a function of the data, "
         "reveals at most this much"),
        ("b", "same_windows", "same windows, recomputed", dist(hm["same_windows"])),
        ("b", "same_windows_reversed", "same windows, reversed order",
         dist(hm["same_windows_reversed_order"])),
        ("b", "overlap_w_minus_1", f"overlap {w - 1}/{w} windows (one replaced)",
         dist(hm["overlap_w_minus_1"])),
        ("b", "overlap_half", f"overlap {w // 2}/{w} windows", dist(hm["overlap_half"])),
        ("b", "disjoint", "disjoint windows (all client pairs)", dist(hm["disjoint"])),
        ("b", "unanimity", f"{c['clients']} clients: weights all agree on / mean pairwise "
                           "(from counts)",
         f"{pct(hm['unanimity'])} / {pct(hm['mean_pairwise_from_counts'])}"),
        ("c", "target_to_other", "one window replaced: target -> other",
         dist(sens["target_to_other"])),
        ("c", "other_to_other", "one window replaced: other -> other",
         dist(sens["other_to_other"])),
        ("c", "with_vs_without_target", f"with vs without the target window ({w} vs {w - 1} "
                                        "windows)", dist(sens["with_vs_without_target"])),
        ("d", "knows_rest_distance", "knows-the-rest attacker: member / non-member distance",
         f"{dist(mem['knows_rest']['member_distance'])} / "
         f"{dist(mem['knows_rest']['nonmember_distance'])}"),
        ("d", "knows_rest_auc", "knows-the-rest attacker: AUC / top-1 (chance)",
         f"{mem['knows_rest']['auc_within']:.3f} / {mem['knows_rest']['top1']:.3f} "
         f"({mem['knows_rest']['chance_top1']:.3f})"),
        ("d", "reference_score", "reference attacker: score of member / non-members "
                                 "(distance reduction)",
         f"{dist(mem['reference']['member_score'])} / "
         f"{dist(mem['reference']['nonmember_score'])}"),
        ("d", "reference_auc", "reference attacker: AUC within client / pooled / top-1 (chance)",
         f"{mem['reference']['auc_within']:.3f} / {mem['reference']['auc_pooled']:.3f} / "
         f"{mem['reference']['top1']:.3f} ({mem['reference']['chance_top1']:.3f})"),
    ]


def title(r: dict) -> str:
    c = r["config"]
    return (f"Leakage of shared masks ({c['model']}, {c['method']} {c['sparsity']:.0%} "
            f"{c['local_group']}-wise, {c['seqlen']}-token windows, {c['samples_per_client']} "
            "per client)")


def scope_text(r: dict) -> str:
    """What the masks were measured on, and how the distances read."""
    c = r["config"]
    il = r["information"]["measured_layers"]
    scope = (f"first {c['layers']} of {c['total_layers']} decoder layers"
             if c["layers"] < c["total_layers"] else f"all {c['layers']} decoder layers")
    return (f"Masks measured on the {scope} ({il['weights']:,} weights); {c['clients']} clients "
            f"with disjoint windows of `{c['calib_text']}/{c['calib_split']}` (non-overlapping "
            f"chunks), seed {c['seed']}. Hamming distance = fraction of differing mask bits, "
            "overall over the measured layers; mean ± sample std [min, max] (n).")


def sections(r: dict) -> list[tuple[str, str]]:
    """The report's sections of one result: the leakage table, per decoder layer, per linear
    layer."""
    from fedcompress.report import markdown_table

    hm = r["hamming"]
    table = markdown_table(["", "Quantity", "Measured", "Paper (LLaMA-7B)"],
                           [[f"({part})", label, value, PAPER.get(key, "")]
                            for part, key, label, value in quantities(r)])
    lines = [scope_text(r), "", table, "",
             f"{len(r['mask_seconds'])} masks, "
             f"{sum(r['mask_seconds'].values()) / len(r['mask_seconds']):.1f} s each on average "
             "(every mask's seconds: `mask_seconds` in report.json)."]
    per_layer = markdown_table(
        ["Layer", "disjoint data", "one window replaced"],
        [[key, pct(v), pct(hm["per_decoder_layer"]["one_window_replaced"][key])]
         for key, v in hm["per_decoder_layer"]["disjoint"].items()])
    per_linear = markdown_table(
        ["Linear", "disjoint data", "one window replaced"],
        [[key, pct(v), pct(hm["per_linear"]["one_window_replaced"][key])]
         for key, v in hm["per_linear"]["disjoint"].items()])
    return [(title(r), "\n".join(lines)),
            ("Per decoder layer (mean Hamming distance)", per_layer),
            ("Per linear layer (mean over the measured decoder layers)", per_linear)]


def headline(r: dict) -> list[tuple[str, dict[str, Any]]]:
    """The distributions of the table as named result records (fractions of differing bits,
    bits per weight, distance reductions)."""
    inf, hm, sens, mem = r["information"], r["hamming"], r["sensitivity"], r["membership"]
    return [
        ("hamming same windows", hm["same_windows"]),
        ("hamming same windows reversed", hm["same_windows_reversed_order"]),
        ("hamming one window replaced", hm["overlap_w_minus_1"]),
        ("hamming half overlap", hm["overlap_half"]),
        ("hamming disjoint", hm["disjoint"]),
        ("hamming to magnitude mask", inf["hamming_to_magnitude_mask"]),
        ("sensitivity other -> other", sens["other_to_other"]),
        ("sensitivity with vs without target", sens["with_vs_without_target"]),
        ("H(mask | magnitude mask) bit/weight", inf["h_mask_given_magnitude"]),
        ("H(mask | other client) bit/weight", inf["h_mask_given_other_client"]),
        ("H(mask | one window replaced) bit/weight", inf["h_mask_given_neighbour"]),
        ("knows-rest member distance", mem["knows_rest"]["member_distance"]),
        ("knows-rest non-member distance", mem["knows_rest"]["nonmember_distance"]),
        ("reference attacker member score", mem["reference"]["member_score"]),
        ("reference attacker non-member score", mem["reference"]["nonmember_score"]),
    ] + [(f"{name} attacker AUC", {k: v for k, v in mem[key].items()
                                   if k in ("auc_within", "auc_pooled", "top1", "chance_top1")})
         for name, key in (("knows-the-rest", "knows_rest"), ("reference", "reference"))]
