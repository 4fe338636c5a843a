"""A recipe: llm-compressor's format, read strictly.

The format (``llmcompressor.recipe.Recipe.from_dict``)::

    sparsity_stage:                 # a stage: "<name>_stage", applied in order
      sparsity_modifiers:           # a group: "<name>_modifiers"
        SparseGPTModifier:          # a modifier and its arguments
          sparsity: 0.5
          mask_structure: "0:0"
          ignore: ["re:.*lm_head"]      # (llm-compressor 0.14 prunes lm_head under [lm_head])
    quantization_stage:
      quantization_modifiers:
        GPTQModifier: {scheme: W4A16, targets: Linear, ignore: [lm_head]}

as YAML or JSON, in a file, a string or a mapping; or, in Python, a list of modifier objects
(:mod:`fedcompress.recipe.modifiers`: one stage). The modifiers of one stage run in one pass
over the decoder layers (a layer pruned, then quantized, before the next layer's inputs are
computed); each stage starts from the model the stage before it made, as llm-compressor's
``oneshot`` runs them. llm-compressor passes over what it does not read; fedcompress refuses it,
naming it: a recipe means what it says or does not run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedcompress.recipe.errors import RecipeError
from fedcompress.recipe.modifiers import MODIFIERS, Modifier

#: A stage's keys besides its groups: llm-compressor's older ``run_type`` (one-shot only here).
_STAGE_KEYS = ("run_type",)


@dataclass(frozen=True)
class Stage:
    """One stage: its name and its modifiers, at most one of each kind (pruning, quantization,
    aggregation)."""

    name: str
    modifiers: tuple[Modifier, ...]

    def __post_init__(self) -> None:
        if not self.modifiers:
            raise RecipeError(f"stage {self.name!r}: expected at least one modifier")
        kinds: dict[str, str] = {}
        for modifier in self.modifiers:
            if not isinstance(modifier, Modifier):
                raise RecipeError(f"stage {self.name!r}: {modifier!r} is not a modifier of "
                                  "fedcompress.recipe")
            if modifier.KIND in kinds:
                raise RecipeError(f"stage {self.name!r}: {kinds[modifier.KIND]} and "
                                  f"{modifier.NAME} are both {modifier.KIND} modifiers: "
                                  f"expected one per stage (put the other in a stage of its own)")
            kinds[modifier.KIND] = modifier.NAME

    def of_kind(self, kind: str) -> Modifier | None:
        return next((m for m in self.modifiers if m.KIND == kind), None)

    def settings(self) -> dict[str, Any]:
        """What the stage asks of a FedPrLLM run: its modifiers' settings; a stage without a
        pruning modifier prunes nothing (``method none``), one without a quantization modifier
        quantizes nothing."""
        out: dict[str, Any] = {"method": "none", "sparsity": 0.0, "quant": "none"}
        for modifier in self.modifiers:
            out.update(modifier.settings())
        return out


@dataclass(frozen=True)
class Recipe:
    """Stages applied in order."""

    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        if not self.stages:
            raise RecipeError("the recipe has no modifier: expected at least one stage with a "
                              f"modifier ({', '.join(MODIFIERS)})")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise RecipeError(f"stages {names} name a stage twice")

    @property
    def modifiers(self) -> tuple[Modifier, ...]:
        return tuple(m for s in self.stages for m in s.modifiers)

    def to_dict(self) -> dict[str, Any]:
        """The recipe in llm-compressor's format (what :func:`load_recipe` reads back)."""
        out: dict[str, Any] = {}
        for stage in self.stages:
            groups: dict[str, dict[str, Any]] = {}
            for m in stage.modifiers:
                groups.setdefault(f"{m.group or m.KIND}_modifiers", {})[m.NAME] = m.to_args()
            out[f"{stage.name}_stage"] = groups
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def load_recipe(source: str | Path | Mapping[str, Any] | Sequence[Modifier] | Modifier | Recipe
                ) -> Recipe:
    """A recipe from a file (``.yaml``/``.yml``/``.json``), a YAML or JSON string, a mapping in
    llm-compressor's format, a modifier or a list of modifiers (one stage), or a recipe."""
    if isinstance(source, Recipe):
        return source
    if isinstance(source, Modifier):
        source = [source]
    if isinstance(source, Sequence) and not isinstance(source, str):
        return Recipe((Stage("default", tuple(source)),))
    if isinstance(source, Mapping):
        return recipe_from_dict(source)
    text = str(source)
    path = Path(text) if isinstance(source, Path) or "\n" not in text else None
    if path is not None and path.suffix.lower() in (".yaml", ".yml", ".json"):
        if not path.is_file():
            raise RecipeError(f"recipe file {path} does not exist")
        text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise RecipeError(f"the recipe is neither JSON nor YAML: {err}") from None
    if not isinstance(data, Mapping):
        raise RecipeError(f"the recipe {text[:80]!r} is not a mapping of stages (or a recipe "
                          "file ending in .yaml, .yml or .json)")
    return recipe_from_dict(data)


def recipe_from_dict(data: Mapping[str, Any]) -> Recipe:
    """Stages ``<name>_stage: {<group>_modifiers: {ModifierName: args}}``, in order."""
    stages = []
    for key, body in data.items():
        if key == "args":
            if body:
                raise RecipeError("args: recipe variables are not implemented by fedcompress: "
                                  "expected the values written in the modifiers")
            continue
        if not (isinstance(key, str) and key.endswith("_stage")):
            raise RecipeError(f"{key}: expected stages named '<name>_stage' (and args)")
        if not isinstance(body, Mapping):
            raise RecipeError(f"{key}: expected a mapping of '<group>_modifiers'")
        stages.append(_stage(key[: -len("_stage")], body, key))
    return Recipe(tuple(stages))


def _stage(name: str, body: Mapping[str, Any], where: str) -> Stage:
    modifiers = []
    for key, group in body.items():
        if key in _STAGE_KEYS:
            if group != "oneshot":
                raise RecipeError(f"{where}.{key}: {group!r}: fedcompress applies a recipe in "
                                  "one shot: expected oneshot")
            continue
        if not (isinstance(key, str) and key.endswith("_modifiers")):
            raise RecipeError(f"{where}.{key}: expected groups named '<name>_modifiers'")
        if not isinstance(group, Mapping):
            raise RecipeError(f"{where}.{key}: expected a mapping of modifier names to their "
                              "arguments")
        for mod_name, args in group.items():
            cls = MODIFIERS.get(mod_name)
            if cls is None:
                raise RecipeError(f"{where}.{key}.{mod_name}: not a modifier fedcompress "
                                  f"implements: expected one of {', '.join(MODIFIERS)}")
            modifiers.append(cls.from_args(args, f"{where}.{key}.{mod_name}",
                                           group=key[: -len("_modifiers")]))
    return Stage(name, tuple(modifiers))
