"""Federated personalized layer pruning (seed 004 made federated; the paper has no federated
design): the steps as plain functions, used in-process by the benchmark
(``simulations/personalized.py``).

1. **Classify** (each site, on its private calibration windows): Alg. 1
   (:func:`fedcompress.layers.personalized.classify_units`); the site sends only the class of
   each unit (2 bits per unit).
2. **Count** (server): per unit, how many sites found it personalized / generic / others; the
   *global class* is the most frequent one, ties broken towards keeping weights
   (personalized > others > generic) (:func:`global_classes`). The *global plan* is Eq. 4 on
   the global classes, rescaled to the sparsity ``p``.
3. **Vote** (FedPrLLM): each site's local Wanda masks at the global plan, summed by the server
   (:class:`~fedcompress.methods.fedprllm.federated.MaskAggregator`).
4. **Personalize** (each site): the site's plan is Eq. 4 with ITS personalized units at the
   personalized factor and every other unit at its global class, rescaled to ``p`` (so every
   site's model has the overall sparsity ``p``); a linear layer of a unit the site found
   personalized gets a LOCAL Wanda mask (from the site's own data, at the site's ratio); every
   other linear layer gets the GLOBAL mask: the top vote counts of the shared vote at the
   site's ratio for that layer (the server's comparison group and tie-break). One sequential
   pass of the calibration walker (:func:`site_masks`): local masks are computed on the inputs
   the already-pruned layers below produce. Every site ends with its own model sharing the
   global part.

The baselines of the benchmark: uniform FedPrLLM (one global mask at ``p`` everywhere),
local-only (the site's own Wanda masks at ``p``) and the dense model; every model is scored by
the perplexity of the site's own held-out windows (:func:`windows_perplexity`).
"""

from __future__ import annotations

import functools
import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fedcompress.layers.personalized import (
    CLASSES,
    Classification,
    ClassifyConfig,
    mean_lm_loss,
    personalized_plan,
)
from fedcompress.masks.aggregate import global_mask
from fedcompress.models import ModelAdapter, weight_matrix
from fedcompress.pruning.allocation import SparsityPlan
from fedcompress.pruning.local import layer_sizes
from fedcompress.pruning.scores import wanda_scores
from fedcompress.pruning.select import select_prune_mask
from fedcompress.pruning.walker import walk

__all__ = [
    "CLASSES",
    "SparsityPlan",
    "TIE_ORDER",
    "UnitCounts",
    "global_classes",
    "site_classes_plan",
    "masks_by_layer_list",
    "personal_linears",
    "shared_masks",
    "site_masks",
    "site_view",
    "windows_perplexity",
]

logger = logging.getLogger(__name__)

#: Among equally frequent classes the global class keeps the most weights.
TIE_ORDER = ("personalized", "others", "generic")


@dataclass(frozen=True)
class UnitCounts:
    """How many sites put each unit in each class (``counts[unit][cls]``), and the global
    class."""

    counts: dict[str, dict[str, int]]
    classes: dict[str, str]

    def to_dict(self) -> dict:
        return {"counts": self.counts, "classes": self.classes}


def global_classes(sites: Sequence[Mapping[str, str]]) -> UnitCounts:
    """Count the sites' classes per unit; the most frequent is the unit's global class (ties:
    :data:`TIE_ORDER`). Every site must classify the same units into known classes."""
    if not sites:
        raise ValueError("no site sent its unit classes")
    units = list(sites[0])
    for i, site in enumerate(sites):
        if list(site) != units:
            raise ValueError(f"site {i} classified units {sorted(set(site) ^ set(units))[:3]} "
                             "differently: expected the same units from every site")
        bad = sorted(set(site.values()) - set(CLASSES))
        if bad:
            raise ValueError(f"site {i} sent unknown classes {bad}: expected {CLASSES}")
    counts = {u: {c: Counter(s[u] for s in sites)[c] for c in CLASSES} for u in units}
    def rank(unit: str, cls: str) -> tuple[int, int]:
        return counts[unit][cls], -TIE_ORDER.index(cls)

    classes = {u: max(TIE_ORDER, key=functools.partial(rank, u)) for u in units}
    return UnitCounts(counts, classes)


def site_classes_plan(units: Mapping[str, Sequence[str]], unit_classes: Mapping[str, str],
                      model: nn.Module, sparsity: float,
                      factors: Mapping[str, float] | None = None) -> SparsityPlan:
    """Eq. 4's per-linear plan for ``unit_classes`` (unit -> class), rescaled to ``sparsity``
    over ``model``'s prunable weights."""
    linear_classes = {lin: unit_classes[u] for u, lins in units.items() for lin in lins}
    return personalized_plan(linear_classes, layer_sizes(model), sparsity, factors)


def site_view(site: Classification, global_: UnitCounts) -> dict[str, str]:
    """A site's classes for its own plan: its personalized units, the global class elsewhere."""
    return {u: "personalized" if site.classes[u] == "personalized" else global_.classes[u]
            for u in site.units}


def shared_masks(counts: Mapping[str, torch.Tensor], plan: SparsityPlan, personal: set[str],
                 model: nn.Module, group: str = "layer", tie_break: str = "magnitude"
                 ) -> dict[str, torch.Tensor]:
    """The global masks a site receives: for every linear layer outside its ``personal`` set,
    the top ``counts`` (the shared vote, wire keys ``"layers.<layer>.<name>"``) at the site's
    ratio of that layer, in the server's ``group`` with its ``tie_break``."""
    out = {}
    for i, layer in enumerate(ModelAdapter(model).layers):
        for name, module in ModelAdapter.linear_layers(layer).items():
            if f"{i}.{name}" in personal:
                continue
            key = f"layers.{i}.{name}"
            out[key] = global_mask(counts[key], plan.at(i, name), group, tie_break,
                                   weight_matrix(module).detach().cpu())
    return out


def site_masks(model: nn.Module, windows: torch.Tensor, plan: SparsityPlan,
               shared: Mapping[str, torch.Tensor] | None, local_group: str = "row",
               batch_size: int = 4) -> list[dict[str, torch.Tensor]]:
    """A site's masks in one sequential walker pass: a linear layer with a ``shared`` (global)
    mask (wire key ``"layers.<layer>.<name>"``) keeps it; every other one gets a local Wanda
    mask at the plan's ratio (``local_group``), computed on the inputs the already-pruned
    layers below produce. ``shared=None``: every layer local."""
    plan.check_layers(len(ModelAdapter(model)))
    shared = shared or {}

    def prune(index: int, layer: nn.Module, stats):
        masks = {}
        for name, module in ModelAdapter.linear_layers(layer).items():
            key = f"layers.{index}.{name}"
            if key in shared:
                masks[name] = shared[key]
            else:
                masks[name] = select_prune_mask(
                    wanda_scores(weight_matrix(module), stats[name].sq_norm),
                    plan.at(index, name), local_group)
        return masks, None

    return walk(model, windows, prune, batch_size=batch_size).masks


def masks_by_layer_list(flat: Mapping[str, torch.Tensor], model: nn.Module
                        ) -> list[dict[str, torch.Tensor]]:
    """Wire-keyed masks covering every linear layer -> one dict per decoder layer (the form of
    :func:`~fedcompress.pruning.local.apply_masks`)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(len(ModelAdapter(model)))]
    for key, mask in flat.items():
        _, layer, name = key.split(".", 2)
        out[int(layer)][name] = mask
    return out


def personal_linears(site: Classification) -> set[str]:
    """The linear layers (``"<layer>.<name>"``) of the units a site found personalized."""
    return {lin for unit, lins in site.units.items() if site.classes[unit] == "personalized"
            for lin in lins}


def windows_perplexity(model: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> float:
    """``exp`` of the mean token cross-entropy over ``windows`` (float32)."""
    return math.exp(mean_lm_loss(model, windows, batch_size))


def classify_config(k: int, max_iter: int, granularity: str, zero: str, seed: int,
                    partition: int, batch_size: int) -> ClassifyConfig:
    """A site's Alg. 1 settings: its draws seeded by the run seed and its partition."""
    return ClassifyConfig(k=k, max_iter=max_iter, granularity=granularity, zero=zero,
                          seed=seed * 1_000_003 + partition, batch_size=batch_size)
