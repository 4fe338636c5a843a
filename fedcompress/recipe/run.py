"""Running a recipe: its stages in order, each a FedPrLLM run on the model the stage before
made.

:func:`run_recipe` is Flower-free: the caller passes ``run_stage`` (the CLI and
:func:`fedcompress.compress` pass the Simulation Engine's run of the FedPrLLM apps, the same
path as ``fedcompress prune``). Layout of ``out``::

    out/recipe.yaml         the recipe as run (llm-compressor's format)
    out/config.toml         everything beside it: fedcompress compress --config out/config.toml
    out/report.json|md      the stages' results side by side, timings, the command
    out/stages/1-<name>/    each run's own folder (report, its model): a stage's, or with
                            pipeline independent a mixed stage's pruning and quantization
                            passes (<stage>-pruning, <stage>-quantization)
    out/model/              the last stage's model (compressed-tensors when quantized), with
                            recipe.yaml, as llm-compressor's oneshot writes its output folder
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedcompress.recipe.errors import RecipeError
from fedcompress.recipe.parse import Recipe
from fedcompress.recipe.plan import DEFAULT_PIPELINE, passes, stage_settings
from fedcompress.report import RunReport

logger = logging.getLogger(__name__)

#: What a stage's run returns: its report (``report.json`` as a dict).
StageRunner = Callable[[dict[str, Any]], dict[str, Any]]
#: The summary fields of a stage's result records in the recipe's report.
_SUMMARY = ("perplexity", "sparsity", "prune_seconds", "federated_seconds",
            "bytes_up_per_client", "eval_seconds")


@dataclass
class RecipeRun:
    """A finished recipe: ``out`` (its folder), ``model_dir`` (the compressed model, or None
    when not saved) and ``report`` (``out/report.json``), ``stages`` (each stage's report)."""

    out: Path
    model_dir: Path | None
    report: dict[str, Any]
    stages: list[dict[str, Any]] = field(default_factory=list)


def run_recipe(recipe: Recipe, beside: Mapping[str, Any], run_stage: StageRunner,
               out: str | Path, check_model: Callable[[Recipe, str], None] | None = None,
               argv: list[str] | None = None) -> RecipeRun:
    """Run ``recipe``'s stages in order with the settings ``beside`` it (flat FedPrLLM keys,
    ``out`` excluded), each through ``run_stage``; ``check_model(recipe, model spec)`` checks
    the modifiers' targets against the model first
    (:func:`fedcompress.recipe.targets.check_recipe`)."""
    out = Path(out)
    beside = {str(k).replace("-", "_"): v for k, v in beside.items()}
    if "out" in beside:
        raise RecipeError("out: pass the recipe's output folder as run_recipe's out")
    if not beside.get("save_model", True) and len(recipe.stages) > 1:
        raise RecipeError("save_model false: a later stage starts from the model the stage "
                          "before it saved: expected true with several stages")
    runs = stage_settings(recipe, beside)  # every refusal before anything runs
    beside.setdefault("pipeline", DEFAULT_PIPELINE)
    stages_run = passes(recipe, beside["pipeline"])
    model = str(beside.get("model", "smollm2-135m"))
    if check_model is not None:
        check_model(recipe, model)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.yaml").write_text(recipe.to_yaml())
    config = {**beside, "recipe": str(out / "recipe.yaml"), "out": str(out)}
    report = RunReport(out, "compress", config, argv=argv)
    stages: list[dict[str, Any]] = []
    with report:
        for i, (stage, settings) in enumerate(zip(stages_run, runs, strict=True)):
            folder = out / "stages" / f"{i + 1}-{stage.name}"
            last = i == len(runs) - 1
            settings = {**settings, "model": model, "out": str(folder)}
            if not last:  # the next stage reads it: in the run's own dtype, not rounded
                settings["save_model"] = True
                settings["save_dtype"] = str(beside.get("dtype", "float32"))
            logger.info("stage %d/%d %r: %s", i + 1, len(runs), stage.name,
                        ", ".join(m.NAME for m in stage.modifiers))
            with report.phase(f"stage {i + 1} {stage.name}"):
                stage_report = run_stage(settings)
            stages.append(stage_report)
            for record in stage_report.get("results", []):
                report.add_result({"stage": stage.name, "name": record["name"],
                                   **{k: record[k] for k in _SUMMARY if k in record}})
            model = str(folder / "model")
        model_dir = None
        if stages and Path(model).is_dir():
            model_dir = out / "model"
            if model_dir.exists():
                shutil.rmtree(model_dir)
            shutil.copytree(model, model_dir)
            (model_dir / "recipe.yaml").write_text(recipe.to_yaml())
        report.extra["stages"] = [{"stage": s.name, "modifiers": [m.NAME for m in s.modifiers],
                                   "out": str(out / "stages" / f"{i + 1}-{s.name}")}
                                  for i, s in enumerate(stages_run)]
        report.extra["model_dir"] = str(model_dir) if model_dir else None
    return RecipeRun(out, model_dir, json.loads((out / "report.json").read_text()), stages)
