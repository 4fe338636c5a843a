"""Byzantine sites for simulations: what an adversarial site sends instead of its honest masks.

The attackers are the first ``attackers`` partitions (0 .. n-1), so a run is reproducible; the
models (``attack``):

* ``random``: a uniformly random mask at each layer's target ratio, in the site's local
  comparison group (seeded by the run seed and the site);
* ``inverted``: prunes the weights with the HIGHEST scores of the site's own local pass
  (Wanda scores; magnitude for the magnitude method), at the target ratios: the most harmful
  mask a single site can compute;
* ``keep``: prunes nothing (a site trying to keep every weight);
* ``collude``: every attacker sends ONE inverted mask, computed on the first attacker's windows
  (a colluding group concentrating its votes);
* ``sparsity``: a site lying about its sparsity: its honest method at ``p + 0.25`` (capped at
  0.95) while the run asks ``p``.

``keep`` and ``sparsity`` are stopped by the server's payload check (a mask's sparsity must be
within ``mask_tolerance`` of the target); the others pass it and are for robust voting
(:mod:`fedcompress.masks.robust`) to handle.
"""

from __future__ import annotations

import torch
from torch import nn

from fedcompress.models import ModelAdapter, weight_matrix
from fedcompress.pruning.local import PruneConfig, local_masks
from fedcompress.pruning.scores import magnitude_scores, wanda_scores
from fedcompress.pruning.walker import unpruned_masks, walk
from fedcompress.solver.select import select_prune_mask

#: How far above the requested sparsity a lying site prunes (``sparsity`` attack).
LIE = 0.25


def is_attacker(partition: int, attackers: int) -> bool:
    return 0 <= partition < attackers


def random_masks(model: nn.Module, prune: PruneConfig, seed: int, site: int
                 ) -> list[dict[str, torch.Tensor]]:
    """Uniformly random masks at the plan's ratios in ``prune.group`` (seeded)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + site)
    out = []
    for index, layer in enumerate(ModelAdapter(model).layers):
        masks = {}
        for name, module in ModelAdapter.linear_layers(layer).items():
            scores = torch.rand(weight_matrix(module).shape, generator=generator)
            masks[name] = select_prune_mask(scores, prune.plan.at(index, name), prune.group)
        out.append(masks)
    return out


def inverted_masks(model: nn.Module, windows: torch.Tensor, prune: PruneConfig,
                   batch_size: int = 8) -> list[dict[str, torch.Tensor]]:
    """Masks pruning the highest scores (Wanda, or magnitude for the magnitude method) at the
    plan's ratios, from one walker pass that forwards each layer pruned by this mask."""
    magnitude = prune.method == "magnitude"

    def fn(index: int, layer: nn.Module, stats):
        masks = {}
        for name, module in ModelAdapter.linear_layers(layer).items():
            w = weight_matrix(module)
            scores = magnitude_scores(w) if magnitude else wanda_scores(w, stats[name].sq_norm)
            masks[name] = select_prune_mask(-scores, prune.plan.at(index, name), prune.group)
        return masks, None

    return walk(model, windows, fn, batch_size=batch_size).masks


def keep_masks(model: nn.Module) -> list[dict[str, torch.Tensor]]:
    """Masks that prune nothing."""
    return [unpruned_masks(layer) for layer in ModelAdapter(model).layers]


def attack_masks(attack: str, model: nn.Module, windows: torch.Tensor, prune: PruneConfig,
                 seed: int, site: int, batch_size: int = 8,
                 first_attacker_windows: torch.Tensor | None = None
                 ) -> list[dict[str, torch.Tensor]]:
    """What adversarial site ``site`` sends under ``attack`` (module docstring); ``windows`` are
    its own, ``first_attacker_windows`` those of partition 0 (``collude``)."""
    if attack == "random":
        return random_masks(model, prune, seed, site)
    if attack == "inverted":
        return inverted_masks(model, windows, prune, batch_size)
    if attack == "collude":
        if first_attacker_windows is None:
            raise ValueError("collude: expected the first attacker's windows")
        return inverted_masks(model, first_attacker_windows, prune, batch_size)
    if attack == "keep":
        return keep_masks(model)
    if attack == "sparsity":
        lie = min(prune.sparsity + LIE, 0.95)
        return local_masks(model, windows, PruneConfig(prune.method, lie, prune.group,
                                                      onload=prune.onload),
                           batch_size=batch_size).masks
    raise ValueError(f"attack={attack!r} is invalid: expected random, inverted, keep, collude "
                     "or sparsity")
