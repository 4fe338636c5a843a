"""A recipe as FedPrLLM runs: one run per stage, federation and privacy chosen beside it.

The recipe owns what is compressed and how (:data:`RECIPE_KEYS`); the run's other settings
(sites, windows, the text, the aggregation: ``stats`` by default, exact, or ``votes`` or
``fedspallm``; SecAgg+, DP) come beside it, from the command line, a TOML config or the Python
API, and must not name a key the recipe owns. :func:`recipe_of` goes the other way: the
compression settings of a ``fedcompress prune`` run as the recipe they are a shorthand for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedcompress.config import SettingsError, convert
from fedcompress.recipe.errors import RecipeError
from fedcompress.recipe.modifiers import (
    FedPrLLMVoteModifier,
    GPTQModifier,
    QuantizationModifier,
    RIAPruningModifier,
    SparseGPTModifier,
    WandaPruningModifier,
)
from fedcompress.recipe.parse import Recipe, Stage, load_recipe
from fedcompress.recipe.schemes import WeightScheme

#: FedPrLLM settings a recipe owns: given beside it, they are refused.
RECIPE_KEYS = ("method", "sparsity", "nm", "local_group", "sparsity_profile", "owl_m",
               "owl_lambda", "layer_sparsity", "quant", "quant_method", "quant_group_size",
               "quant_symmetric", "quant_block_size", "quant_dampening", "quant_actorder",
               "group", "scale", "tie_break", "mode")
#: The aggregation a recipe runs with unless told otherwise: the exact one (the sites' summed
#: statistics; the server computes what centralized compression on the pooled windows would).
DEFAULT_AGGREGATE = "stats"
#: How a stage holding a pruning and a quantization modifier runs (``--pipeline``, beside the
#: recipe, as ``oneshot``'s ``pipeline`` argument is beside llm-compressor's):
#:
#: * ``independent`` (the default, llm-compressor's ``oneshot`` default): each modifier in a
#:   pass of its own over the decoder layers, in the stage's order, as if each were a stage;
#:   the same recipe gives the model llm-compressor's default gives;
#: * ``joint``: the stage's modifiers in one pass, a layer pruned and quantized before the next
#:   layer's inputs are computed; SparseGPT with GPTQ in one optimal-brain-surgeon sweep (the
#:   SparseGPT paper's joint pruning and quantization, every pruned weight exactly 0), another
#:   pruning rule's mask kept by GPTQ. ``fedcompress prune --quant`` runs this way.
#:
#: llm-compressor's ``sequential`` (each modifier's own sweep of a layer, one after the other,
#: before the next layer) is not implemented: refused by name.
PIPELINES = ("independent", "joint")
DEFAULT_PIPELINE = "independent"
_PRUNING = {"wanda": WandaPruningModifier, "ria": RIAPruningModifier,
            "sparsegpt": SparseGPTModifier}


def check_pipeline(pipeline: Any) -> str:
    """``pipeline`` if it is one of :data:`PIPELINES`, else a :class:`RecipeError`."""
    if pipeline not in PIPELINES:
        known = ("; llm-compressor's sequential pipeline (one sweep per modifier and layer) is "
                 "not implemented") if pipeline == "sequential" else ""
        raise RecipeError(f"pipeline {pipeline!r}: expected one of {', '.join(PIPELINES)}"
                          f"{known}")
    return str(pipeline)


def passes(recipe: Recipe, pipeline: str = DEFAULT_PIPELINE) -> tuple[Stage, ...]:
    """The runs a recipe makes, in order (:data:`PIPELINES`): its stages, with ``independent``
    a stage holding a pruning and a quantization modifier split in two, named
    ``<stage>-<kind>`` (a vote modifier goes with the pruning, which it aggregates)."""
    if check_pipeline(pipeline) == "joint":
        return recipe.stages
    out: list[Stage] = []
    for stage in recipe.stages:
        quant = stage.of_kind("quantization")
        rest = tuple(m for m in stage.modifiers if m is not quant)
        if quant is None or stage.of_kind("pruning") is None:
            out.append(stage)
        else:
            out += [Stage(f"{stage.name}-pruning", rest),
                    Stage(f"{stage.name}-quantization", (quant,))]
    return tuple(out)


def stage_settings(recipe: Recipe, beside: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The flat FedPrLLM settings of each run of the recipe (:func:`passes`, by ``beside``'s
    ``pipeline``, default :data:`DEFAULT_PIPELINE`): ``beside`` (keys with ``-`` or ``_``,
    ``pipeline`` excluded) and the run's modifiers. Refuses a key of :data:`RECIPE_KEYS` beside
    the recipe, a vote modifier without ``aggregate votes`` and a stage after a quantizing one
    (fedcompress compresses float models)."""
    beside = {str(k).replace("-", "_"): v for k, v in beside.items()}
    stages = passes(recipe, beside.pop("pipeline", DEFAULT_PIPELINE))
    owned = sorted(k for k in beside if k in RECIPE_KEYS)
    if owned:
        raise RecipeError(f"{', '.join('--' + k.replace('_', '-') for k in owned)}: set by the "
                          "recipe: expected it in the recipe's modifiers, not beside it")
    beside.setdefault("aggregate", DEFAULT_AGGREGATE)
    runs = []
    for i, stage in enumerate(stages):
        if i and stages[i - 1].of_kind("quantization") is not None:
            raise RecipeError(f"stage {stage.name!r} follows the quantizing stage "
                              f"{stages[i - 1].name!r}: fedcompress compresses float "
                              "models: expected quantization in the last stage")
        if stage.of_kind("aggregation") is not None and beside["aggregate"] != "votes":
            raise RecipeError(f"stage {stage.name!r}: FedPrLLMVoteModifier sets FedPrLLM's "
                              f"vote, and the aggregation is {beside['aggregate']!r}: expected "
                              "--aggregate votes, or no vote modifier")
        runs.append({**beside, **stage.settings()})
    return runs


def recipe_of(settings: Mapping[str, Any]) -> Recipe | None:
    """The one-stage recipe a FedPrLLM run's compression settings (flat, a
    ``FedPrLLMConfig``'s or a subset with its defaults) are a shorthand for, run with
    ``pipeline joint`` (a ``prune`` run that prunes and quantizes does both in one pass); None
    when they have none (magnitude or gradient pruning, a per-layer plan, or a comparison
    group other than the modifier's own)."""
    s = {str(k).replace("-", "_"): v for k, v in settings.items()}
    modifiers: list = []
    method = s.get("method", "wanda")
    nm = str(s.get("nm", "none"))
    if method in _PRUNING:
        cls = _PRUNING[method]
        if s.get("local_group", "row") != cls.COMPARISON or s.get("layer_sparsity"):
            return None
        owl = s.get("sparsity_profile", "uniform") == "owl"
        structure = "0:0" if nm in ("", "none") else nm
        sweep = ({"block_size": int(s.get("sparsegpt_block_size", 128)),
                  "dampening_frac": float(s.get("sparsegpt_dampening", 0.01))}
                 if cls is SparseGPTModifier else {})
        modifiers.append(cls(
            sparsity=float(s.get("sparsity", 0.5)), mask_structure=structure,
            sparsity_profile="owl" if owl else None,
            owl_m=float(s.get("owl_m", 5.0)) if owl else None,
            owl_lmbda=float(s.get("owl_lambda", 0.08)) if owl else None,
            # what keeps lm_head out of llm-compressor's pruning (fedcompress.recipe.targets)
            ignore=("re:.*lm_head",), **sweep))
    elif method != "none":
        return None
    quant = s.get("quant", "none")
    if quant != "none":
        scheme = WeightScheme(int(str(quant)[1]), bool(s.get("quant_symmetric", True)),
                              int(s.get("quant_group_size", 128)))
        ignore = ("lm_head",)
        if s.get("quant_method", "gptq") == "gptq":
            modifiers.append(GPTQModifier(
                ignore=ignore, scheme=scheme, block_size=int(s.get("quant_block_size", 128)),
                dampening_frac=float(s.get("quant_dampening", 0.01)),
                actorder=str(s.get("quant_actorder", "static"))))
        else:
            modifiers.append(QuantizationModifier(ignore=ignore, scheme=scheme))
    if s.get("aggregate", "votes") == "votes":
        modifiers.append(FedPrLLMVoteModifier(
            comparison=str(s.get("group", "layer")), scale=bool(s.get("scale", False)),
            tie_break=str(s.get("tie_break", "magnitude")), mode=str(s.get("mode", "oneshot"))))
    if not any(m.KIND != "aggregation" for m in modifiers):
        return None
    return Recipe((Stage("default", tuple(modifiers)),))


def expand_settings(flat: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A FedPrLLM run's flat settings with its ``recipe`` (a file; empty: none) carried out:
    the recipe's one pass (:func:`passes`, by the settings' ``pipeline``) sets the keys of
    :data:`RECIPE_KEYS`, the rest stay as given (``recipe`` and ``pipeline`` too, so that the
    report's config runs again). This is how ``fedcompress prune``, ``flwr run`` and a bench
    study take a recipe. A key the recipe owns set beside it to another value than its default
    or the recipe's, and a recipe of several passes (``fedcompress compress`` runs those, each
    from the model the one before made), are refused. ``defaults``: every setting's default."""
    source = flat.get("recipe") or ""
    if not source:
        return dict(flat)
    recipe = load_recipe(str(source))
    beside = {"pipeline": flat.get("pipeline", DEFAULT_PIPELINE),
              "aggregate": flat.get("aggregate", DEFAULT_AGGREGATE)}
    stages = passes(recipe, beside["pipeline"])
    if len(stages) > 1:
        raise RecipeError(f"recipe {source}: {len(stages)} passes "
                          f"({', '.join(s.name for s in stages)}) and a run carries out one: "
                          "expected one stage (a pruning and a quantization modifier in it run "
                          "as one pass with pipeline joint), or fedcompress compress, which runs "
                          "the passes in order")
    (run,) = stage_settings(recipe, beside)
    owned = sorted(k for k in RECIPE_KEYS if k in flat
                   and not _same(k, flat[k], defaults.get(k))
                   and not _same(k, flat[k], run.get(k)))
    if owned:
        raise RecipeError(f"{', '.join(owned)}: set by the recipe {source}: expected "
                          f"{'it' if len(owned) == 1 else 'them'} in the recipe's modifiers, "
                          "not beside it")
    return {**{k: v for k, v in flat.items() if k not in RECIPE_KEYS}, **run}


def _same(key: str, value: Any, reference: Any) -> bool:
    """Whether a setting as given (a string from a command line or a run config, or a typed
    value) is ``reference``, read as every settings source is read
    (:func:`fedcompress.config.convert`)."""
    if reference is None:
        return False
    try:
        return convert(type(reference), key, value) == reference
    except SettingsError:
        return False
