"""A modifier's ``targets`` and ``ignore`` against a model's modules.

compressed-tensors' matching rule: an entry ``re:<pattern>`` matches a module whose full name
the regular expression matches from its start (``re.match``); any other entry matches a module
of that full name or of that class name. llm-compressor quantizes every targeted linear layer of
the model not ignored (``lm_head`` too, unless ignored). Its pruning modifiers (0.14) prune the
linear layers of every targeted module, each matched against ``ignore`` by the name
``<target>.<name inside it>``: a targeted linear layer itself by ``<target>.``, with a trailing
dot (:func:`pruned_by_llmcompressor`), so that ``ignore: [lm_head]`` does not keep ``lm_head``
out of ``targets: [Linear]`` (nor, when they are tied, the embeddings) and
``ignore: ["re:.*lm_head"]``, what llm-compressor's own recipes write, does. fedcompress
compresses every linear layer of the decoder layers, nothing else: a recipe that would make
llm-compressor compress another set is refused, naming the modules that differ.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from torch import nn

from fedcompress.models import ModelAdapter, decoder_layers, load_model
from fedcompress.recipe.errors import RecipeError
from fedcompress.recipe.modifiers import Modifier
from fedcompress.recipe.parse import Recipe


def matches(entry: str, name: str, class_name: str) -> bool:
    """Whether a ``targets``/``ignore`` entry matches the module ``name`` of ``class_name``."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry in (name, class_name)


def selected(modifier: Modifier, modules: Mapping[str, str]) -> set[str]:
    """The modules (``{full name: class name}``) ``modifier``'s targets select, less its
    ignored ones."""
    return {name for name, cls in modules.items()
            if any(matches(t, name, cls) for t in modifier.targets)
            and not any(matches(i, name, cls) for i in modifier.ignore)}


#: Module classes llm-compressor's pruning modifiers prune (``PRUNABLE_LAYER_TYPES``, 0.14).
PRUNABLE = ("Linear", "Conv1d", "Conv2d", "Conv3d")


def pruned_by_llmcompressor(modifier: Modifier, modules: Mapping[str, str]) -> set[str]:
    """The modules (``{full name: class name}``) llm-compressor 0.14's pruning modifier would
    prune: the :data:`PRUNABLE` modules inside (or equal to) each targeted module, less those
    ``ignore`` matches by the name llm-compressor gives them, ``f"{target}.{name}"`` (for the
    targeted module itself, ``f"{target}."``)."""
    out = set()
    for target, cls in modules.items():
        if not any(matches(t, target, cls) for t in modifier.targets):
            continue
        for name, kind in modules.items():
            if kind not in PRUNABLE or not (name == target or name.startswith(f"{target}.")):
                continue
            seen_as = f"{target}." if name == target else name
            if not any(matches(i, seen_as, kind) for i in modifier.ignore):
                out.add(name)
    return out


def check_targets(modifier: Modifier, modules: Mapping[str, str],
                  decoder_linears: Iterable[str], where: str) -> None:
    """Refuse ``modifier`` unless it selects exactly the linear layers of the decoder layers
    (``decoder_linears``, full names) among ``modules`` (every module of the model: full name
    -> class name). A pruning modifier is read inside the decoder layers only, as
    llm-compressor's sequential pipeline applies it."""
    linears = set(decoder_linears)
    pruning = modifier.KIND == "pruning"
    chosen = pruned_by_llmcompressor(modifier, modules) if pruning else \
        selected(modifier, modules)
    left_out = sorted(linears - chosen)
    if left_out:
        raise RecipeError(f"{where}: its targets and ignore leave out {len(left_out)} linear "
                          f"layer(s) of the decoder layers ({', '.join(left_out[:3])}"
                          f"{', ...' if len(left_out) > 3 else ''}): fedcompress compresses "
                          "every one of them: expected ignore to name only modules outside "
                          "the decoder layers")
    extra = sorted(chosen - linears)
    if extra and pruning:
        exact = [i for i in modifier.ignore if i in extra]
        raise RecipeError(
            f"{where}: llm-compressor would also prune {', '.join(extra[:3])}"
            f"{', ...' if len(extra) > 3 else ''}, outside the decoder layers (and the "
            "embeddings, when tied to it), and fedcompress prunes the decoder layers' linear "
            "layers only: expected them ignored as llm-compressor's own recipes do, e.g. "
            f"ignore: [\"re:.*{extra[0].rpartition('.')[2]}\"]"
            + (f" (llm-compressor 0.14's pruning modifiers match ignore against "
               f"'{exact[0]}.', with a trailing dot: the exact name {exact[0]!r} does not "
               "keep it out)" if exact else ""))
    if extra:
        raise RecipeError(f"{where}: it would also quantize {', '.join(extra[:3])}"
                          f"{', ...' if len(extra) > 3 else ''}, outside the decoder layers; "
                          "fedcompress quantizes the decoder layers' linear layers only: "
                          f"expected them in ignore (e.g. ignore: [{extra[0]}])")


def model_modules(model: nn.Module) -> tuple[dict[str, str], list[str]]:
    """``({full name: class name} of every module, full names of the decoder layers' linear
    layers)`` of ``model`` (an onloaded skeleton will do: names and classes only)."""
    names = {id(m): name for name, m in model.named_modules()}
    modules = {name: type(m).__name__ for name, m in model.named_modules() if name}
    linears = []
    for layer in decoder_layers(model):
        prefix = names[id(layer)]
        linears += [f"{prefix}.{n}" for n in ModelAdapter.linear_layers(layer)]
    return modules, linears


def check_recipe(recipe: Recipe, spec: str) -> None:
    """Check every modifier's targets and ignore against the model ``spec`` names (its onloaded
    skeleton: the module names without the weights)."""
    loaded = load_model(spec, onload=True)
    modules, linears = model_modules(loaded.model)
    for stage in recipe.stages:
        for modifier in stage.modifiers:
            if modifier.KIND in ("pruning", "quantization"):
                check_targets(modifier, modules, linears,
                              f"{stage.name}_stage.{modifier.NAME}")
