"""Recipes: compression steps in llm-compressor's format, run over a federation.

A recipe (:func:`load_recipe`) lists stages of modifiers (``SparseGPTModifier``,
``WandaPruningModifier``, ``GPTQModifier``, ``QuantizationModifier``, and fedcompress's
``RIAPruningModifier`` and ``FedPrLLMVoteModifier``); :func:`stage_settings` turns it, with the
federation and privacy settings chosen beside it, into one FedPrLLM run per stage (with
``pipeline independent``, llm-compressor's default, a stage's pruning and quantization
modifiers are two runs: :func:`passes`), and
:func:`run_recipe` runs them in order (``fedcompress compress --recipe``,
:func:`fedcompress.compress`). Every field is read: what fedcompress does not implement is
refused by name (:class:`RecipeError`).
"""

from fedcompress.recipe.errors import RecipeError
from fedcompress.recipe.modifiers import (
    MODIFIERS,
    FedPrLLMVoteModifier,
    GPTQModifier,
    Modifier,
    QuantizationModifier,
    RIAPruningModifier,
    SparseGPTModifier,
    WandaPruningModifier,
)
from fedcompress.recipe.parse import Recipe, Stage, load_recipe, recipe_from_dict
from fedcompress.recipe.plan import (
    DEFAULT_AGGREGATE,
    DEFAULT_PIPELINE,
    PIPELINES,
    RECIPE_KEYS,
    passes,
    recipe_of,
    stage_settings,
)
from fedcompress.recipe.run import RecipeRun, run_recipe
from fedcompress.recipe.schemes import PRESETS, WeightScheme

__all__ = [
    "DEFAULT_AGGREGATE", "DEFAULT_PIPELINE", "MODIFIERS", "PIPELINES", "PRESETS", "RECIPE_KEYS",
    "FedPrLLMVoteModifier", "GPTQModifier", "Modifier", "QuantizationModifier",
    "RIAPruningModifier", "Recipe", "RecipeError", "RecipeRun", "SparseGPTModifier", "Stage",
    "WandaPruningModifier", "WeightScheme", "load_recipe", "passes", "recipe_from_dict",
    "recipe_of", "run_recipe", "stage_settings",
]
