"""The Python API: a recipe over a simulated federation in one call::

    from fedcompress import compress

    result = compress("recipe.yaml", model="smollm2-135m", sites=16, text="wiki",
                      windows=4, out="runs/w4a16")
    result.model            # the compressed model (transformers), loaded from result.model_dir
    result.report           # report.json: each stage's federated and centralized results

``recipe``: a recipe file, a YAML/JSON string, a mapping in llm-compressor's format or a list
of modifiers (:mod:`fedcompress.recipe`). The federation is chosen beside it: ``sites`` and
their ``text`` (a bundled corpus, a .txt/.jsonl file, or a list of them, one per site),
``windows`` per site of ``seqlen`` tokens, the ``aggregate`` (``stats``: exact, the default;
``votes``: FedPrLLM; ``fedspallm``), and any other ``fedcompress compress`` setting as a
keyword (``secagg=True``, ``dp_epsilon=4.0``, ...).

Like the CLI, this module is a composition root: it starts the Flower apps on the Simulation
Engine (:func:`simulate`, the path of every ``fedcompress`` method command); the library below
it never does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from fedcompress.recipe import Recipe, RecipeRun, load_recipe, run_recipe
from fedcompress.recipe.targets import check_recipe
from fedcompress.report import default_out

logger = logging.getLogger(__name__)

#: What ``compress`` runs with unless told otherwise (beside the FedPrLLM defaults): the
#: baselines a recipe is measured against.
COMPRESS_BASELINES = "dense,centralized"


@dataclass
class CompressResult:
    """A finished :func:`compress`: the output folder, the compressed model's folder and the
    report; :attr:`model` loads the model (a quantized one needs ``compressed-tensors``)."""

    run: RecipeRun

    @property
    def out(self) -> Path:
        return self.run.out

    @property
    def model_dir(self) -> Path | None:
        return self.run.model_dir

    @property
    def report(self) -> dict[str, Any]:
        return self.run.report

    @cached_property
    def model(self):
        if self.model_dir is None:
            raise ValueError("the run saved no model (save_model false)")
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(self.model_dir))


def site_texts(text: str | Path | Sequence[str | Path]) -> tuple[str, str | None]:
    """``(calib_text, partition)``: one corpus (partitioned among the sites as configured) or
    one text per site (the ``sources`` partition: site ``i`` reads the ``i``-th)."""
    if isinstance(text, (str, Path)):
        return str(text), None
    texts = [str(t) for t in text]
    if not texts:
        raise ValueError("text: an empty list: expected a corpus or one text per site")
    return "+".join(texts), "sources"


def method_defaults(method) -> dict[str, Any]:
    """What ``fedcompress METHOD.command`` accepts (its --config keys) and their defaults."""
    return {**method.defaults(), "cpus_per_client": 1.0, "ray_address": ""}


def simulate(name: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Validate every setting of method ``name`` (flat, with ``cpus_per_client`` and
    ``ray_address``), run its Flower apps on the Simulation Engine and return its report."""
    import json

    from fedcompress.methods import get_method
    from server.simulation import simulate_method

    method = get_method(name)
    settings = dict(settings)
    cpus = float(settings.pop("cpus_per_client"))
    if not cpus > 0:
        raise ValueError(f"--cpus-per-client {cpus}: expected a positive number")
    ray_address = str(settings.pop("ray_address", "") or "")
    settings["out"] = settings.get("out") or str(default_out(method.command))
    simulate_method(name, settings, num_cpus_per_client=cpus, ray_address=ray_address)
    return json.loads((Path(settings["out"]) / "report.json").read_text())


def stage_runner(cpus_per_site: float = 1.0, ray_address: str = ""):
    """A stage's run on the Simulation Engine: ``fedcompress prune``'s path (its summary
    table printed, as the command prints it)."""
    def run(settings: dict[str, Any]) -> dict[str, Any]:
        from fedcompress.methods import get_method

        method = get_method("fedprllm")
        report = simulate("fedprllm", {**method_defaults(method), **settings,
                                       "cpus_per_client": cpus_per_site,
                                       "ray_address": ray_address})
        logger.info("stage done: %s", ", ".join(
            f"{r['name']} perplexity {r['perplexity']:.3f}" for r in report["results"]))
        return report

    return run


def compress(recipe: str | Path | Mapping[str, Any] | Sequence[Any] | Recipe, *,
             model: str = "smollm2-135m", sites: int = 16,
             text: str | Path | Sequence[str | Path] = "wiki", windows: int = 4,
             seqlen: int = 256, aggregate: str = "stats", out: str | Path | None = None,
             cpus_per_site: float = 1.0, **settings: Any) -> CompressResult:
    """Run ``recipe`` over ``sites`` simulated sites (module docstring) and return the
    compressed model and the report."""
    calib_text, partition = site_texts(text)
    beside = {"model": model, "clients": sites, "samples_per_client": windows,
              "seqlen": seqlen, "aggregate": aggregate, "calib_text": calib_text,
              "baselines": COMPRESS_BASELINES, **settings}
    if partition is not None:
        beside["partition"] = partition
    out = Path(out or default_out("compress"))
    argv = ["fedcompress", "compress", "--config", str(out / "config.toml")]
    return CompressResult(run_recipe(load_recipe(recipe), beside, stage_runner(cpus_per_site),
                                     out, check_model=check_recipe, argv=argv))
