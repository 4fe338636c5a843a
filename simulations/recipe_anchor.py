"""Recipes against llm-compressor's ``oneshot``: the same model from the same windows.

    python simulations/recipe_anchor.py --out simulations/results/recipe-anchor

For each recipe (``--recipes``; default the three of issue 64 on SmolLM2: SparseGPT 50%, GPTQ
W4A16, SparseGPT 50% then GPTQ W4A16; W4A16 with ``--group-size`` 64 columns a scale, since
the preset's 128 does not divide SmolLM2's 576), written in llm-compressor's format under
``--out``/``recipes/``:

1. **ours**: ``fedcompress compress``'s path (:func:`fedcompress.recipe.run_recipe` on the
   Flower Simulation Engine), ``--clients`` sites of ``--samples-per-client`` windows of
   ``--seqlen`` tokens, statistics mode (exact: what centralized compression of the pooled
   windows makes), each stage beside its centralized run on the pooled windows (both
   perplexities; this script compares models, it does not time them: its phases' seconds are
   in the report, but a comparison is no timing run);
2. **llm-compressor**: ``oneshot`` with the same recipe file, on the pooled windows in the
   sites' order (``simulations/anchor/llmc_runner.py recipe``, in llm-compressor's venv, see
   ``simulations/gptq_anchor.py``: ``--venv``, created on first use), saved with
   ``save_compressed=True``;
3. **compared**, over every linear layer of the decoder layers: the share of weights where both
   models are zero or both are not (the masks), where both kept a weight the share of equal
   values and their median relative difference, and, of quantized recipes, the share of equal
   integers and equal scales (read from both folders' ``weight_packed`` / ``weight_scale``);
   both models' perplexity by our evaluator on the first ``--eval-windows`` windows of
   ``--eval-seqlen`` tokens of the wiki test split, and the relative gap (target: within 0.5%
   where the arithmetic differs); the two output folders' files and quantization and sparsity
   configs side by side.

Writes ``report.json`` / ``report.md`` / ``config.toml`` (:class:`~fedcompress.report.RunReport`)
and, under ``--out``/``cache/`` (not committed with a result), both sides' models.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gptq_anchor  # noqa: E402  (the llm-compressor venv, its runner, the evaluator)

logger = logging.getLogger("recipe_anchor")

RECIPES = ("sparsegpt50", "w4a16", "sparsegpt50-w4a16")


def recipe_text(name: str, group_size: int) -> str:
    """A recipe of ``RECIPES`` in llm-compressor's format."""
    sparse = ("sparsity_stage:\n  sparsity_modifiers:\n    SparseGPTModifier:\n"
              "      sparsity: 0.5\n      mask_structure: \"0:0\"\n      targets: [Linear]\n"
              "      ignore: [\"re:.*lm_head\"]\n")
    quant = ("quant_stage:\n  quant_modifiers:\n    GPTQModifier:\n      targets: [Linear]\n"
             "      ignore: [lm_head]\n      config_groups:\n        group_0:\n"
             "          targets: [Linear]\n          weights: {num_bits: 4, type: int, "
             f"symmetric: true, strategy: group, group_size: {group_size}}}\n")
    return {"sparsegpt50": sparse, "w4a16": quant, "sparsegpt50-w4a16": sparse + quant}[name]


def recipe_options(p: argparse.ArgumentParser, out: str, eval_windows: int,
                   eval_help: str | None = None) -> argparse.ArgumentParser:
    """The options of a script over :data:`RECIPES` (this one, ``recipe_time.py``): the
    recipes, the model, the federation, the evaluation, logging."""
    p.add_argument("--out", default=out, help="the result's folder (default: %(default)s)")
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES,
                   help="the recipes to run, in order (default: all)")
    p.add_argument("--model", default="smollm2-135m",
                   help="a model name of fedcompress's registry or a local folder")
    p.add_argument("--group-size", type=int, default=64,
                   help="W4A16's columns per scale (128 does not divide SmolLM2's 576)")
    for flag, default, text in (
            ("--clients", 16, "sites of the federation"),
            ("--samples-per-client", 4, "calibration windows per site"),
            ("--seqlen", 128, "tokens per calibration window"),
            ("--seed", 0, "the seed of the windows' draw and partition"),
            ("--eval-seqlen", 256, "tokens per evaluation window"),
            ("--batch-size", 8, "windows per forward pass")):
        p.add_argument(flag, type=int, default=default, help=f"{text} (default: %(default)s)")
    p.add_argument("--eval-windows", type=int, default=eval_windows,
                   help=eval_help or "wiki test windows the perplexity is measured on "
                                     "(default: %(default)s)")
    p.add_argument("--calib-text", default="wiki",
                   help="the corpus the sites' windows come from (default: %(default)s)")
    p.add_argument("--cpus-per-client", type=float, default=1.0,
                   help="CPUs of a Simulation Engine site (default: %(default)s)")
    p.add_argument("--log-level", default="INFO", help="logging level (default: %(default)s)")
    return p


def checked_options(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p``'s options of ``argv``; a count of :func:`recipe_options` below 1 is an error."""
    opts = p.parse_args(argv)
    if min(opts.group_size, opts.clients, opts.samples_per_client, opts.eval_windows) < 1:
        p.error("--group-size, --clients, --samples-per-client and --eval-windows must be "
                "positive")
    return opts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = recipe_options(argparse.ArgumentParser(description=__doc__.split("\n")[0]),
                       "simulations/results/recipe-anchor", 64)
    p.add_argument("--venv", default=None,
                   help="llm-compressor's venv (default: $FEDCOMPRESS_CACHE/llmc), created "
                        "when missing")
    p.add_argument("--python", default="python3.11", help="interpreter that creates the venv")
    return checked_options(p, argv)


def linear_weights(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """``{linear: {weight | weight_packed | weight_scale | ...: tensor}}`` of a saved model's
    decoder layers, read from its safetensors files."""
    from safetensors import safe_open

    found: dict[str, dict[str, torch.Tensor]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if ".layers." not in key or key.endswith(("norm.weight", "bias")):
                    continue
                module, _, field = key.rpartition(".")
                if field.startswith("weight"):
                    found.setdefault(module, {})[field] = f.get_tensor(key)
    return found


def unpack_int32(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """compressed-tensors' ``pack-quantized`` words back to signed integers ``[rows,
    columns]`` (the inverse of :func:`fedcompress.quant.compressed_tensors.pack_int32`)."""
    per_word = 32 // bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    slots = [(words >> (bits * i)) & ((1 << bits) - 1) for i in range(per_word)]
    values = torch.stack(slots, dim=-1).reshape(packed.shape[0], -1)[:, :columns]
    return (values - (1 << (bits - 1))).to(torch.int8)


def dense_of(fields: dict[str, torch.Tensor], bits: int
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weights, integers or None)`` of one saved linear layer: a dense weight, or the
    dequantized weights of its packed integers and scales."""
    if "weight" in fields:
        return fields["weight"].to(torch.float32), None
    scale = fields["weight_scale"].to(torch.float32)
    columns = int(fields["weight_shape"][1]) if "weight_shape" in fields else \
        fields["weight_packed"].shape[1] * (32 // bits)
    q = unpack_int32(fields["weight_packed"], bits, columns)
    zero = fields.get("weight_zero_point")
    z = torch.zeros_like(scale) if zero is None else zero.to(torch.float32)
    groups = torch.arange(columns) // (columns // scale.shape[1])
    return (q.to(torch.float32) - z[:, groups]) * scale[:, groups], q


def compare_folders(ours: Path, theirs: Path, bits: int) -> dict[str, Any]:
    """Masks, integers and scales of every decoder linear layer of two saved models."""
    a, b = linear_weights(ours), linear_weights(theirs)
    if set(a) != set(b):
        raise ValueError(f"the two models hold different linear layers: only ours "
                         f"{sorted(set(a) - set(b))[:3]}, only theirs "
                         f"{sorted(set(b) - set(a))[:3]}")
    total = same_mask = same_int = ints = same_scale = scales = kept = same_kept = 0
    relative: list[torch.Tensor] = []
    worst = {"layer": None, "mask_share": 1.0}
    for name in sorted(a):
        wa, qa = dense_of(a[name], bits)
        wb, qb = dense_of(b[name], bits)
        same = int(((wa == 0) == (wb == 0)).sum())
        both = (wa != 0) & (wb != 0)
        kept += int(both.sum())
        same_kept += int(((wa == wb) & both).sum())
        relative.append(((wa - wb).abs() / wb.abs())[both])
        total += wa.numel()
        same_mask += same
        if same / wa.numel() < worst["mask_share"]:
            worst = {"layer": name, "mask_share": same / wa.numel()}
        if qa is not None and qb is not None:
            ints += qa.numel()
            same_int += int((qa == qb).sum())
            sa, sb = a[name]["weight_scale"], b[name]["weight_scale"]
            scales += sa.numel()
            same_scale += int((sa.to(torch.float32) == sb.to(torch.float32)).sum())
    return {"layers": len(a), "weights": total, "masks_identical": same_mask / total,
            "integers_identical": same_int / ints if ints else None,
            "scales_identical": same_scale / scales if scales else None,
            # where both kept a weight: the share of equal values, and the median of their
            # relative difference (float arithmetic that differs shows here first)
            "kept_values_identical": same_kept / kept if kept else None,
            "kept_median_relative_difference": float(torch.cat(relative).median())
            if kept else None,
            "least_identical_mask": worst}


def folder_layout(folder: Path) -> dict[str, Any]:
    """What a saved model folder holds: its files (suffixes) and the compression configs of
    its config.json."""
    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    return {"files": sorted({f.name if not f.name.startswith("model") else
                             "model*" + "".join(f.suffixes) for f in folder.iterdir()
                             if f.is_file()}),
            "format": quant.get("format"), "quant_method": quant.get("quant_method"),
            "sparsity_config": quant.get("sparsity_config"),
            "ignore": quant.get("ignore")}


def stage_results(run) -> list[dict[str, Any]]:
    """Each stage's federated perplexity beside its centralized run's."""
    rows = []
    for stage, report in zip(run.report["stages"], run.stages, strict=True):
        results = {r["name"]: r for r in report["results"]}
        fed = next(r for n, r in results.items() if n.startswith("fedprllm-stats"))
        central = results["centralized"]
        rows.append({"stage": stage["stage"], "federated_perplexity": fed["perplexity"],
                     "centralized_perplexity": central["perplexity"]})
    return rows


def script_run(script: str, opts: argparse.Namespace, prefix: str):
    """What a script comparing with llm-compressor starts with: the runner module, ``--out``,
    the :class:`~fedcompress.report.RunReport` of ``script``, a temporary work folder named
    ``prefix...`` and the runner's log (``--out``/``cache/llmc-runner.log``, emptied)."""
    from fedcompress.report import RunReport

    out = Path(opts.out)
    log = out / "cache" / "llmc-runner.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    return (gptq_anchor.load_runner(), out,
            RunReport.for_script(script, opts, seeds={"seed": opts.seed}),
            Path(tempfile.mkdtemp(prefix=prefix)), log)


def llmc_python(report, opts: argparse.Namespace, work: Path, log: Path) -> Path:
    """The interpreter of llm-compressor's venv (``opts.venv``, created when missing), its
    pins checked and its versions in ``report``'s ``llmc_venv`` (phase ``llmc-venv``)."""
    with report.phase("llmc-venv"):
        venv = Path(opts.venv) if opts.venv else gptq_anchor.default_venv()
        exe = gptq_anchor.ensure_venv(venv, opts.python)
        gptq_anchor.run_runner(exe, ["versions", str(work / "versions.json")], log)
        versions = json.loads((work / "versions.json").read_text())
        gptq_anchor.check_pins(versions)
    report.extra["llmc_venv"] = {"path": str(venv), "versions": versions}
    return exe


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    logging.basicConfig(level=getattr(logging, opts.log_level.upper()),
                        format="%(asctime)s %(name)s %(message)s")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from fedcompress.api import stage_runner
    from fedcompress.data.corpora import corpus_text, load_corpus
    from fedcompress.methods.fedprllm.federated import FedPrLLMConfig, federation_windows
    from fedcompress.models import load_model
    from fedcompress.recipe import load_recipe, run_recipe
    from fedcompress.recipe.targets import check_recipe

    runner, out, report, work, log = script_run(__file__, opts, "recipe-anchor-")
    with report:
        exe = llmc_python(report, opts, work, log)
        with report.phase("load"):
            loaded = load_model(opts.model, device="cpu", dtype="float32")
            config = FedPrLLMConfig(model=opts.model, clients=opts.clients,
                                    samples_per_client=opts.samples_per_client,
                                    seqlen=opts.seqlen, seed=opts.seed,
                                    calib_text=opts.calib_text, batch_size=opts.batch_size)
            windows = torch.cat(federation_windows(loaded.tokenizer, config)[0])
            eval_text = corpus_text(load_corpus("wiki", "test"))
        beside = {"model": opts.model, "clients": opts.clients,
                  "samples_per_client": opts.samples_per_client, "seqlen": opts.seqlen,
                  "seed": opts.seed, "calib_text": opts.calib_text,
                  "batch_size": opts.batch_size, "eval_windows": opts.eval_windows,
                  "eval_seqlen": opts.eval_seqlen, "baselines": "centralized",
                  "device": "cpu", "save_dtype": "float32",
                  # llm-compressor's scales take the model's dtype, float32 in its runner
                  "quant_scale_dtype": "float32"}
        (out / "recipes").mkdir(parents=True, exist_ok=True)
        for name in opts.recipes:
            text = recipe_text(name, opts.group_size)
            (out / "recipes" / f"{name}.yaml").write_text(text)
            recipe = load_recipe(text)
            with report.phase(f"{name}-ours"):
                ours = run_recipe(recipe, beside, stage_runner(opts.cpus_per_client),
                                  out / "cache" / f"ours-{name}", check_model=check_recipe)
            request = work / f"{name}.safetensors"
            runner.save_exchange(request, {"input_ids": windows.to(torch.int64)},
                                 {"recipe": text, "model_path": str(loaded.path)})
            with report.phase(f"{name}-llmc"):
                gptq_anchor.run_runner(
                    exe, ["recipe", str(request), str(work / name)], log)
                llmc_dir = out / "cache" / f"llmc-{name}"
                if llmc_dir.exists():
                    shutil.rmtree(llmc_dir)
                shutil.move(str(work / name / "model"), llmc_dir)
            bits = 4 if "w4a16" in name else 32
            compared = compare_folders(ours.model_dir, llmc_dir, bits)
            with report.phase(f"{name}-eval"):
                ppl = {}
                for side, folder in (("ours", ours.model_dir), ("llmc", llmc_dir)):
                    kwargs = {"quantization_config": CompressedTensorsConfig(dequantize=True)} \
                        if bits < 32 else {}
                    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs).eval()
                    ppl[side] = gptq_anchor.evaluate(model, loaded.tokenizer, eval_text, opts)
                    del model
            stages = stage_results(ours)
            report.extra.setdefault("layouts", {})[name] = {
                "ours": folder_layout(ours.model_dir), "llmc": folder_layout(llmc_dir)}
            report.extra.setdefault("stages", {})[name] = stages
            report.add_result({
                "name": name, "perplexity_ours": ppl["ours"], "perplexity_llmc": ppl["llmc"],
                "gap": ppl["ours"] / ppl["llmc"] - 1, **{k: v for k, v in compared.items()
                                                         if k != "least_identical_mask"},
                "least_identical_mask_layer": compared["least_identical_mask"]["layer"],
                "least_identical_mask_share": compared["least_identical_mask"]["mask_share"]})
    shutil.rmtree(work, ignore_errors=True)
    report.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
