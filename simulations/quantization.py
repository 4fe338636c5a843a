"""Federated quantization against centralized GPTQ, round-to-nearest and llm-compressor, with
sizes on disk and CPU decoding speed, side by side in one run (issue 31, item 4).

    python simulations/quantization.py --out simulations/results/quantization
    python simulations/quantization.py --model qwen2.5-0.5b \
        --out simulations/results/quantization-qwen

On ``--model`` with ``--clients`` sites of ``--samples-per-client`` windows of ``--seqlen`` tokens
of the wiki train split (seed ``--seed``; the windows of ``fedcompress prune``), every row
evaluated on the first ``--eval-windows`` windows of ``--eval-seqlen`` tokens of the wiki test
split:

* ``dense``: the input model;
* ``w4a16-gptq-federated`` / ``w8a16-gptq-federated``: statistics mode
  (:func:`fedcompress.methods.fedprllm.stats.stats_prune`: the sites' Hessian passes, the wire
  round trip and the server's GPTQ of each layer, sites one after another in this process);
  W4A16 with the largest group size of 128 / 64 / 32 that divides every quantized layer's
  input width (:func:`pick_group_size`; ``--group-size`` to fix it), W8A16 per output channel;
* ``...-gptq-centralized``: one calibration walk with GPTQ on the union of the sites' windows
  (:func:`fedcompress.pruning.local.local_masks`); its integers, scales and zero points are
  compared with the federated ones (:func:`compare_quant`): they must be equal bit for bit
  (the run fails after writing every row if they are not);
* ``...-rtn``: the same recipe with round-to-nearest (no data);
* ``sparsegpt50-w4a16-federated`` (and ``-centralized``): SparseGPT 50% and 4-bit jointly;
* ``...-federated-secagg`` (``--secagg-frac-bits``): the federated run with the sites' Hessians
  summed in fixed point as SecAgg+ sums them (without the cryptography), and how many of its
  integers differ from the plain federated run's;
* ``layers-removed``: the ``--remove-ratio`` decoder layers with the lowest Block Influence
  (ShortGPT / PPC-GPT: ``1 - mean cos(x_in, x_out)`` of each layer) on the pooled calibration
  windows, removed (:func:`fedcompress.layers.lowest_score_plan`), saved with its smaller config;
* ``<scheme>-llmc-gptq-centralized`` (``--llmc-report``, one report per scheme):
  llm-compressor's perplexity from the report of ``simulations/gptq_anchor.py`` (its
  ``--scheme``), beside ours, with the settings that differ from this run's.

Every model is saved (quantized ones in compressed-tensors ``pack-quantized`` with bfloat16
scales and other tensors, :func:`fedcompress.quant.compressed_tensors.save_quantized`; the others
by :func:`fedcompress.models.save_model` in bfloat16) and its size on disk is given next to the
dense bfloat16 folder's. The federated quantization's time is set against the centralized
walk's in the same run (the load average before and after each pair is recorded): wall time
with the sites in sequence, and with the sites in parallel (one site's passes plus the server's
GPTQ). The dense bfloat16, the federated W4A16 and the layer-removed folders are loaded in a
fresh interpreter by ``transformers`` alone (``simulations/saved_sizes.py``'s loader) for greedy
decoding tokens/s (``--new-tokens``, batch 1, ``--threads``). Writes ``report.json`` /
``report.md`` / ``config.toml`` to ``--out`` (:class:`~fedcompress.report.RunReport`); the
saved folders go to a temporary directory (``--keep``: ``OUT/models``).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from saved_sizes import LOADER  # noqa: E402

from fedcompress.data.corpora import corpus_text, load_corpus  # noqa: E402
from fedcompress.eval.perplexity import perplexity  # noqa: E402
from fedcompress.layers import LayerImportance, apply_plan, lowest_score_plan  # noqa: E402
from fedcompress.layers.influence import row_cosine, stream_layer_io  # noqa: E402
from fedcompress.methods.fedprllm.federated import (  # noqa: E402
    FedPrLLMConfig,
    federation_windows,
)
from fedcompress.methods.fedprllm.stats import stats_prune  # noqa: E402
from fedcompress.models import ModelAdapter, load_model, model_size, save_model  # noqa: E402
from fedcompress.pruning.local import apply_masks, local_masks  # noqa: E402
from fedcompress.quant.compressed_tensors import packed_layers, save_quantized  # noqa: E402
from fedcompress.report import RunReport, markdown_table  # noqa: E402

logger = logging.getLogger("quantization")

#: Group sizes tried for W4A16, largest first (llm-compressor's preset is 128).
GROUP_SIZES = (128, 64, 32)
#: The recipes, in the order they run: (recipe name, local method, sparsity, scheme, group).
#: ``group`` "w4" is the W4A16 group size of the run, 0 one scale per output channel.
RECIPES = {
    "w4a16": ("none", 0.0, "w4a16", "w4"),
    "w8a16": ("none", 0.0, "w8a16", 0),
    "sparsegpt50-w4a16": ("sparsegpt", 0.5, "w4a16", "w4"),
}
#: Settings of this run that the llm-compressor anchor's report must share for its perplexity
#: to sit in the same table: (our option, the anchor's config key).
#: The anchor's group size per scheme this script compares (None: our W4A16 group size).
ANCHOR_GROUP: dict[str, int | None] = {"w4a16": None, "w8a16": 0}
ANCHOR_SETTINGS = (("model", "model"), ("clients", "clients"),
                   ("samples_per_client", "samples_per_client"), ("seqlen", "seqlen"),
                   ("seed", "seed"), ("eval_windows", "eval_windows"),
                   ("eval_seqlen", "eval_seqlen"))


def pick_group_size(widths: Iterable[int], sizes: Iterable[int] = GROUP_SIZES) -> int:
    """The largest of ``sizes`` that divides every width in ``widths`` (the input widths of
    the quantized linear layers); an error naming the widths when none does."""
    widths = sorted(set(int(w) for w in widths))
    if not widths or any(w < 1 for w in widths):
        raise ValueError(f"input widths {widths}: expected positive widths of linear layers")
    sizes = list(sizes)
    for size in sorted(sizes, reverse=True):
        if all(w % size == 0 for w in widths):
            return size
    raise ValueError(f"none of the group sizes {sizes} divides every input width {widths}: "
                     "expected --group-size with one that does (or 0: per output channel)")


def quantized_widths(model: torch.nn.Module) -> list[int]:
    """The input widths of the linear layers of ``model``'s decoder layers."""
    return sorted({module.in_features for layer in ModelAdapter(model).layers
                   for module in layer.modules() if isinstance(module, torch.nn.Linear)})


def result_name(recipe: str, solver: str, where: str | None = None) -> str:
    """The stable name of a results row: ``<recipe>-<solver>[-<where>]``, e.g.
    ``w4a16-gptq-federated``, ``w8a16-rtn``, ``sparsegpt50-w4a16-federated`` (the joint
    recipe's solver is implied)."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    if where not in (None, "federated", "centralized", "federated-secagg"):
        raise ValueError(f"where={where!r}: expected federated, centralized, "
                         "federated-secagg or None")
    parts = [recipe] if recipe.startswith("sparsegpt") else [recipe, solver]
    return "-".join(parts + ([where] if where else []))


def compare_quant(federated: list[Mapping[str, Any] | None],
                  centralized: list[Mapping[str, Any] | None]) -> dict[str, int]:
    """Integers, scales and zero points (per decoder layer, per linear layer: QuantResults)
    of the federated run against the centralized one: how many of each differ, out of how
    many. Layers missing on one side are an error (the two runs quantized different models)."""
    if len(federated) != len(centralized):
        raise ValueError(f"{len(federated)} quantized decoder layers against "
                         f"{len(centralized)}: expected the same model")
    counts = {"integers": 0, "integers_differing": 0, "scales_differing": 0,
              "zero_points_differing": 0}
    for index, (ours, theirs) in enumerate(zip(federated, centralized)):
        ours, theirs = ours or {}, theirs or {}
        if set(ours) != set(theirs):
            raise ValueError(f"decoder layer {index}: linear layers {sorted(ours)} against "
                             f"{sorted(theirs)}: expected the same")
        for name, a in ours.items():
            b = theirs[name]
            if a.q.shape != b.q.shape:
                raise ValueError(f"{index}.{name}: integers of shape {tuple(a.q.shape)} "
                                 f"against {tuple(b.q.shape)}")
            counts["integers"] += a.q.numel()
            counts["integers_differing"] += int((a.q != b.q).sum())
            counts["scales_differing"] += int((a.scale != b.scale).sum())
            counts["zero_points_differing"] += int((a.zero_point != b.zero_point).sum())
    return counts


def time_ratio(federated_seconds: float, centralized_seconds: float) -> float:
    """Federated seconds over centralized ones (the target is at most 1.5)."""
    if not centralized_seconds > 0 or not math.isfinite(federated_seconds):
        raise ValueError(f"times {federated_seconds!r} / {centralized_seconds!r}: expected "
                         "finite seconds, the centralized ones positive")
    return federated_seconds / centralized_seconds


def anchor_row(anchor: Mapping[str, Any], ours: Mapping[str, Any],
               group_size: int) -> dict[str, Any]:
    """llm-compressor's row from the anchor's ``report.json`` (``anchor``, made with its
    ``--scheme``: ``w4a16`` when its config names none): its perplexity and every setting that
    differs from this run's (``ours``: this run's options by name; ``group_size``: our W4A16
    group size; W8A16 is per output channel, the anchor's group size 0), or an error when it
    has no finished ``llmc-gptq`` row or a scheme this script does not run."""
    found = [r for r in anchor.get("results", []) if r.get("name") == "llmc-gptq"]
    if not found or not isinstance(found[0].get("perplexity"), (int, float)):
        raise ValueError(f"the anchor report (status {anchor.get('status')!r}) has no "
                         "llmc-gptq row with a perplexity: expected a finished "
                         "simulations/gptq_anchor.py run")
    config = anchor.get("config", {})
    scheme = config.get("scheme", "w4a16")
    if scheme not in ANCHOR_GROUP:
        raise ValueError(f"the anchor report's scheme {scheme!r}: expected one of "
                         f"{', '.join(ANCHOR_GROUP)}")
    differ = {}
    for mine, theirs in ANCHOR_SETTINGS:
        if config.get(theirs) != ours.get(mine):
            differ[mine] = {"ours": ours.get(mine), "anchor": config.get(theirs)}
    expected = group_size if ANCHOR_GROUP[scheme] is None else ANCHOR_GROUP[scheme]
    if "group_size" in config and config["group_size"] != expected:
        differ["group_size"] = {"ours": expected, "anchor": config["group_size"]}
    row = found[0]
    return {"name": f"{scheme}-llmc-gptq-centralized", "recipe": scheme,
            "solver": "llm-compressor", "perplexity": float(row["perplexity"]),
            "weights_mib": row["weights_bytes"] / 2**20 if "weights_bytes" in row else None,
            "seconds": row.get("seconds"), "anchor_status": anchor.get("status"),
            "anchor_commit": anchor.get("versions", {}).get("git_commit"),
            "settings_differing": differ}


def anchor_rows(anchors: Sequence[Mapping[str, Any]], ours: Mapping[str, Any],
                group_size: int) -> list[dict[str, Any]]:
    """:func:`anchor_row` of each report, at most one per scheme (two of one scheme: an
    error naming it)."""
    rows = [anchor_row(anchor, ours, group_size) for anchor in anchors]
    schemes = [row["recipe"] for row in rows]
    twice = sorted({s for s in schemes if schemes.count(s) > 1})
    if twice:
        raise ValueError(f"--llmc-report: two reports of scheme {', '.join(twice)}: expected "
                         "one per scheme")
    return rows


def block_influence_windows(model: torch.nn.Module, windows: torch.Tensor,
                            batch_size: int) -> LayerImportance:
    """Block Influence of every decoder layer on token windows (every position counts): the
    ShortGPT / PPC-GPT score ``1 - mean cos(x_in, x_out)``, computed on calibration text
    rather than on (question, answer) pairs."""
    n_layers = len(ModelAdapter(model))
    sums = [0.0] * n_layers
    counted = 0
    with torch.inference_mode():
        for start in range(0, len(windows), batch_size):
            batch = windows[start:start + batch_size]
            counted += batch.numel()

            def accumulate(i: int, x_in: torch.Tensor, x_out: torch.Tensor) -> None:
                sums[i] += float(row_cosine(x_in, x_out).sum())

            stream_layer_io(model, batch, torch.ones_like(batch), accumulate)
    return LayerImportance("block_influence", tuple(1.0 - s / counted for s in sums),
                           n_examples=len(windows), n_tokens=counted,
                           info={"text": "pooled calibration windows"})


def decode_speed(folder: Path, ids_file: Path, threads: int, new_tokens: int) -> dict:
    """Load ``folder`` in a fresh interpreter with ``transformers`` alone and decode
    (``simulations/saved_sizes.py``'s loader): tokens/s, load seconds, whether the packed
    integers are kept, peak memory."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", LOADER, str(folder), str(ids_file),
                          str(threads), str(new_tokens)], capture_output=True, text=True,
                         env=env)
    if run.returncode:
        raise RuntimeError(f"loading {folder} with transformers failed: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="simulations/results/quantization")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES),
                        choices=[*RECIPES, "none"],
                        help="quantization recipes (none: only dense, layer removal, decoding)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="W4A16 group size (default: the largest of 128, 64, 32 that "
                        "divides every quantized layer's input width)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--samples-per-client", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--eval-seqlen", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4,
                        help="windows per forward; equal to --samples-per-client, the "
                        "centralized walk's batches are the sites' windows (float32 matmuls "
                        "depend on the batch: otherwise federated and centralized inputs, and "
                        "so integers, differ in later layers)")
    parser.add_argument("--remove-ratio", type=float, default=0.25,
                        help="share of decoder layers removed (lowest Block Influence)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads when decoding")
    parser.add_argument("--loaded-windows", type=int, default=2,
                        help="eval windows the decoding process also scores (a load check)")
    parser.add_argument("--llmc-report", nargs="+", default=[],
                        help="report.json of simulations/gptq_anchor.py (llm-compressor), one "
                        "per scheme (its --scheme: w4a16, w8a16)")
    parser.add_argument("--secagg-frac-bits", type=int, default=None,
                        help="also run each recipe with the sites' Hessians summed in fixed "
                        "point as SecAgg+ sums them (this many fractional bits, e.g. 25, "
                        "fedprllm's default): its perplexity and the integers that differ from "
                        "the plain federated run (off by default)")
    parser.add_argument("--no-decode", action="store_true", help="skip the decoding speeds")
    parser.add_argument("--keep", action="store_true", help="keep the saved folders in OUT")
    opts = parser.parse_args(argv)
    if "none" in opts.recipes and len(opts.recipes) > 1:
        parser.error(f"--recipes {' '.join(opts.recipes)}: expected none alone, or recipes")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # read first: a wrong path fails before any work
    anchors = [json.loads(Path(path).read_text()) for path in opts.llmc_report]
    if opts.batch_size != opts.samples_per_client:
        logger.warning("--batch-size %d differs from --samples-per-client %d: the centralized "
                       "batches are not the sites' windows, so federated and centralized GPTQ "
                       "will not be equal bit for bit", opts.batch_size, opts.samples_per_client)
    report = RunReport.for_script(__file__, opts, seeds={"seed": opts.seed})
    mismatches: list[str] = []
    with report, tempfile.TemporaryDirectory() as tmp:
        work = Path(opts.out) / "models" if opts.keep else Path(tmp)
        loaded = load_model(opts.model, device="cpu", dtype="float32")
        model, tokenizer = loaded.model, loaded.tokenizer
        from fedcompress.models import source_dtype

        dense_dtype = source_dtype(loaded)
        widths = quantized_widths(model)
        group = opts.group_size if opts.group_size is not None else pick_group_size(widths)
        report.extra["group_size"] = {"w4a16": group, "widths": widths,
                                      "chosen": "given" if opts.group_size is not None else
                                      f"largest of {list(GROUP_SIZES)} dividing every width"}
        logger.info("W4A16 group size %d (input widths %s)", group, widths)
        # llm-compressor's row is read before any work: a report without it fails here
        llmc = anchor_rows(anchors, vars(opts), group)
        eval_text = corpus_text(load_corpus("wiki", "test"))
        ids = tokenizer(eval_text, return_tensors="pt", add_special_tokens=False).input_ids[0]
        ids_file = Path(tmp) / "ids.pt"
        torch.save(ids[: opts.loaded_windows * opts.eval_seqlen].view(
            opts.loaded_windows, opts.eval_seqlen).clone(), ids_file)

        def evaluate(evaluated: torch.nn.Module) -> float:
            return perplexity(evaluated, tokenizer, eval_text, seqlen=opts.eval_seqlen,
                              batch_size=opts.batch_size, max_windows=opts.eval_windows,
                              progress=False).perplexity

        def size_of(saved) -> dict:
            size = model_size(saved, model, dense_dtype)
            return {"format": size["format"], "saved_dtype": size["dtype"],
                    "weights_mib": size["weights_bytes"] / 2**20,
                    "folder_mib": size["saved_bytes"] / 2**20,
                    "dense_mib": size["dense_bytes"] / 2**20, "size_ratio": size["ratio"]}

        folders: dict[str, Path] = {}
        with report.phase("dense"):
            dense_row = {"name": "dense", "recipe": "dense", "solver": "-",
                         "perplexity": evaluate(model)}
            saved = save_model(model, work / "dense", tokenizer, "bfloat16")
            folders["dense"] = saved.path
            dense_row.update(size_of(saved))
        report.add_result(dense_row)

        base = FedPrLLMConfig(model=opts.model, clients=opts.clients,
                              samples_per_client=opts.samples_per_client, seqlen=opts.seqlen,
                              seed=opts.seed, batch_size=opts.batch_size, aggregate="stats",
                              method="none", sparsity=0.0, quant="w4a16", quant_group_size=group)
        windows = federation_windows(tokenizer, base)[0]
        union = torch.cat(windows)
        timing_rows = []
        for recipe in (r for r in opts.recipes if r != "none"):
            method, sparsity, scheme, recipe_group = RECIPES[recipe]
            size = group if recipe_group == "w4" else recipe_group
            config = base.replace(method=method, sparsity=sparsity, quant=scheme,
                                  quant_group_size=size)
            prune, quant = config.prune, config.quant_config
            assert quant is not None
            # centralized first, then federated, back to back (load recorded around the pair)
            load_before = load_average()
            with report.phase(f"{recipe}-centralized"):
                start = time.perf_counter()
                central = local_masks(model, union, prune, batch_size=opts.batch_size,
                                      keep_weights=True)
                central_s = time.perf_counter() - start
            with report.phase(f"{recipe}-federated"):
                start = time.perf_counter()
                fed = stats_prune(model, windows, config, prune=prune)
                fed_s = time.perf_counter() - start
            load_after = load_average()
            same = compare_quant(fed.quant, central.quant)
            masks_differing = sum(int((m != central.masks[i][k]).sum())
                                  for i, layer in enumerate(fed.masks) for k, m in layer.items())
            identical = (same["integers_differing"] == same["scales_differing"]
                         == same["zero_points_differing"] == masks_differing == 0)
            if not identical:
                mismatches.append(f"{recipe}: {same}, {masks_differing} mask bits")
            n_sites = len(windows)
            site_s, server_s = sum(fed.site_seconds), sum(fed.server_seconds)
            timing = {"centralized_seconds": central_s, "federated_seconds": fed_s,
                      "federated_site_seconds_per_site": site_s,
                      "federated_server_seconds": server_s,
                      "federated_parallel_seconds": site_s + server_s,
                      "ratio_wall": time_ratio(fed_s, central_s),
                      "ratio_parallel_sites": time_ratio(site_s + server_s, central_s),
                      "load_before": load_before, "load_after": load_after}
            timing_rows.append([recipe, f"{central_s:.1f}", f"{fed_s:.1f}",
                                f"{site_s * n_sites:.1f} / {server_s:.1f}",
                                f"{timing['ratio_wall']:.2f}x",
                                f"{timing['ratio_parallel_sites']:.2f}x",
                                f"{load_before[0]} -> {load_after[0]}"])
            for where, result, seconds in (("federated", fed, fed_s),
                                           ("centralized", central, central_s)):
                name = result_name(recipe, "gptq", where)
                with report.phase(f"{name}-eval"):
                    quantized = apply_masks(copy.deepcopy(model), result.masks, result.weights)
                    ppl = evaluate(quantized)
                    saved = save_quantized(quantized, work / name,
                                           packed_layers(quantized, dict(enumerate(result.quant))),
                                           quant, tokenizer, "bfloat16")
                    folders[name] = saved.path
                    del quantized
                row = {"name": name, "recipe": recipe, "solver": "gptq", "where": where,
                       "scheme": scheme, "group_size": size, "sparsity": sparsity,
                       "perplexity": ppl, "seconds": seconds, **size_of(saved)}
                if where == "federated":
                    row.update({"identical_to_centralized": identical, **same,
                                "mask_bits_differing": masks_differing, **timing,
                                "bytes_up_per_site": sum(fed.bytes_up_per_site)})
                report.add_result(row)
            if opts.secagg_frac_bits is not None:  # the sites' Hessians summed as SecAgg+ does
                name = result_name(recipe, "gptq", "federated-secagg")
                with report.phase(name):
                    start = time.perf_counter()
                    secure = stats_prune(model, windows, config, frac_bits=opts.secagg_frac_bits,
                                         prune=prune)
                    secure_s = time.perf_counter() - start
                    quantized = apply_masks(copy.deepcopy(model), secure.masks, secure.weights)
                    ppl = evaluate(quantized)
                    del quantized
                report.add_result({
                    "name": name, "recipe": recipe, "solver": "gptq", "where": "federated-secagg",
                    "scheme": scheme, "group_size": size, "sparsity": sparsity,
                    "frac_bits": opts.secagg_frac_bits, "perplexity": ppl, "seconds": secure_s,
                    **{f"{k}_vs_plain": v for k, v in compare_quant(secure.quant,
                                                                     fed.quant).items()}})
            if recipe.startswith("sparsegpt"):
                continue
            name = result_name(recipe, "rtn")
            with report.phase(name):
                start = time.perf_counter()
                rtn = local_masks(model, union, replace(prune, quant=replace(quant, method="rtn")),
                                  batch_size=opts.batch_size, keep_weights=True)
                rtn_s = time.perf_counter() - start
                rounded = apply_masks(copy.deepcopy(model), rtn.masks, rtn.weights)
                ppl = evaluate(rounded)
                saved = save_quantized(rounded, work / name,
                                       packed_layers(rounded, dict(enumerate(rtn.quant))),
                                       replace(quant, method="rtn"), tokenizer, "bfloat16")
                del rounded
            report.add_result({"name": name, "recipe": recipe, "solver": "rtn",
                               "scheme": scheme, "group_size": size, "perplexity": ppl,
                               "seconds": rtn_s, **size_of(saved)})

        with report.phase("layers-removed"):
            importance = block_influence_windows(model, union, opts.batch_size)
            plan = lowest_score_plan(importance, opts.remove_ratio)
            removed = apply_plan(copy.deepcopy(model), plan)
            ppl = evaluate(removed)
            saved = save_model(removed, work / "layers-removed", tokenizer, "bfloat16")
            folders["layers-removed"] = saved.path
            del removed
        report.add_result({"name": "layers-removed", "recipe": f"remove {len(plan.removed)} "
                           f"of {plan.num_layers} layers (lowest Block Influence)",
                           "solver": "-", "removed_layers": list(plan.removed),
                           "block_influence": list(importance.scores), "perplexity": ppl,
                           **size_of(saved)})

        for row in llmc:
            ours = [r for r in report.results
                    if r["name"] == result_name(row["recipe"], "gptq", "centralized")]
            if ours:
                row["gap_vs_ours_centralized"] = row["perplexity"] / ours[0]["perplexity"] - 1
            report.add_result(row)

        if not opts.no_decode:
            w4 = result_name("w4a16", "gptq", "federated")
            for name in ("dense", w4, "layers-removed"):
                if name not in folders:
                    continue
                with report.phase(f"decode-{name}"):
                    speed = decode_speed(folders[name], ids_file, opts.threads, opts.new_tokens)
                for row in report.results:
                    if row["name"] == name:  # flat too: docs/numbers.toml cites a row's key
                        row["decode"] = speed
                        row["decode_tokens_per_second"] = speed["tokens_per_second"]
                report.write()

        by = {r["name"]: r for r in report.results}
        dense_ppl, dense_mib = by["dense"]["perplexity"], by["dense"]["weights_mib"]
        dense_tps = by["dense"].get("decode", {}).get("tokens_per_second")
        table = []
        for r in report.results:
            decode = r.get("decode", {}).get("tokens_per_second")
            table.append([
                r["name"], f"{r['perplexity']:.3f}",
                f"{100 * (r['perplexity'] / dense_ppl - 1):+.1f}%",
                f"{r['weights_mib']:.1f} ({r['weights_mib'] / dense_mib:.2f}x)"
                if r.get("weights_mib") else "-",
                {True: "yes", False: "NO"}.get(r.get("identical_to_centralized"), "-"),
                f"{decode:.1f} ({decode / dense_tps:.2f}x)" if decode and dense_tps else "-"])
        report.sections.append(("Perplexity, size, decoding", markdown_table(
            ["row", "perplexity", "vs dense", "weights MiB (vs dense bf16)",
             "federated == centralized", "decode tokens/s (vs dense)"], table)))
        report.sections.append(("Federated quantization time against centralized", markdown_table(
            ["recipe", "centralized s", "federated s (sites in sequence)",
             "sites total / server s", "ratio", "ratio, sites in parallel",
             "load 1 min before -> after"], timing_rows)))
        notes = [f"W4A16 group size {group} ({report.extra['group_size']['chosen']}; input "
                 f"widths {widths}); W8A16 per output channel; symmetric, static activation "
                 "order, dampening 0.01, blocks of 128 (llm-compressor's defaults); scales "
                 "bfloat16. Perplexity of the in-memory model (float32 dequantized weights). "
                 "Sizes: safetensors files, saved in bfloat16 (quantized: pack-quantized). "
                 f"Decoding: {opts.new_tokens} greedy tokens, batch 1, {opts.threads} thread(s), "
                 "the folder loaded by transformers alone in a fresh interpreter (it "
                 "decompresses packed layers at the first forward and then runs dense "
                 "weights). Layer removal: Block Influence on the pooled calibration windows "
                 "(in a federation the sites would send their per-layer cosine sums)."]
        for row, path in zip(llmc, opts.llmc_report):
            differ = row["settings_differing"]
            notes.append(f"llm-compressor {row['recipe']} (from {path}): "
                         + ("the same windows and recipe" if not differ else
                            "settings that DIFFER: " + json.dumps(differ)))
        report.sections.append(("Reading", "\n\n".join(notes)))
        if mismatches:
            raise AssertionError("federated quantization differs from centralized: "
                                 + "; ".join(mismatches))
    report.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
