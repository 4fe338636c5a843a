"""Layer-removal policies: which decoder layers to drop, as a plan, and applying the plan.

Two policies (PPC-GPT Sec. 3.4 and Table 6):

* ``"lowest"`` (:func:`lowest_score_plan`): remove the layers with the lowest importance (for BI:
  "We arrange the layers in ascending order based on their BI scores and proceed to eliminate
  those with the lower BI scores"). Works with any :class:`LayerImportance`.
* ``"seq"`` (:func:`seq_plan`), the paper's baseline: "The importance is directly correlated with
  the sequence order, where the shallower layers hold greater importance", so the deepest layers
  go: the last ``k`` layers, indices ``L - k .. L - 1``. ``keep_last`` (default 0, the paper's)
  protects the final layers instead, removing the contiguous block just before them.

Counting: a ratio ``r`` in ``[0, 1)`` of ``L`` layers removes ``k = floor(r * L + 1/2)`` layers,
i.e. ``r * L`` rounded to the nearest integer with halves rounded UP (not Python's
round-half-to-even: 0.25 of 10 layers removes 3, 0.25 of 6 removes 2); a ``1e-9`` slack absorbs
binary float error (``0.7 * 30 = 20.999999999999996`` removes 21). At least one layer must stay.

Ties (``"lowest"``): layers with exactly equal scores are removed deepest first (higher index
first), consistently with the ``"seq"`` baseline's premise that deeper layers matter less.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from fedcompress.layers.importance import LayerImportance
from fedcompress.models import num_layers, remove_layers

__all__ = [
    "POLICIES",
    "RemovalPlan",
    "apply_plan",
    "layers_to_remove",
    "lowest_score_plan",
    "make_plan",
    "removal_order",
    "seq_plan",
]

logger = logging.getLogger(__name__)

POLICIES = ("lowest", "seq")

_ROUNDING_SLACK = 1e-9


@dataclass(frozen=True)
class RemovalPlan:
    """Which decoder layers to remove, and why.

    Attributes:
        policy: ``"lowest"``, ``"seq"`` or ``"greedy"`` (:func:`fedcompress.layers.redundancy.
            greedy_removal`, made by a search, not by :func:`make_plan`).
        num_layers: Layers of the model the plan is for (``L``).
        ratio: The requested ratio of layers to remove.
        removed: Indices to remove, ascending.
        scores: The importance per layer the plan was made from (for ``"seq"``: ``L - i``, the
            sequence-order importance).
        method: The importance's method (``"sequence"`` for ``"seq"``).
        order: For ``"lowest"``: every layer index in removal order (most removable first);
            for ``"seq"``: the removed indices from the deepest.
        keep_last: For ``"seq"``: final layers protected from removal.
    """

    policy: str
    num_layers: int
    ratio: float
    removed: tuple[int, ...]
    scores: tuple[float, ...]
    method: str
    order: tuple[int, ...] = ()
    keep_last: int = 0

    @property
    def kept(self) -> tuple[int, ...]:
        """Indices (in the original model) of the layers that stay, ascending."""
        drop = set(self.removed)
        return tuple(i for i in range(self.num_layers) if i not in drop)

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "num_layers": self.num_layers, "ratio": self.ratio,
                "removed": list(self.removed), "kept": list(self.kept),
                "scores": list(self.scores), "method": self.method, "order": list(self.order),
                "keep_last": self.keep_last}


def layers_to_remove(ratio: float, n_layers: int) -> int:
    """``k = floor(ratio * n_layers + 1/2)``: layers a ratio removes (module docstring).

    Raises:
        ValueError: ``ratio`` not a real number in ``[0, 1)``, ``n_layers < 1``, or a ratio that
            would remove every layer.
    """
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers={n_layers!r} is invalid: expected an int >= 1")
    if (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
            or not math.isfinite(ratio) or not 0 <= ratio < 1):
        raise ValueError(f"ratio={ratio!r} is invalid: expected a number in [0, 1)")
    k = math.floor(ratio * n_layers + 0.5 + _ROUNDING_SLACK)
    if k >= n_layers:
        raise ValueError(
            f"ratio={ratio!r} removes round({ratio!r} * {n_layers}) = {k} of {n_layers} layers, "
            f"i.e. all of them: expected a ratio in [0, {(n_layers - 0.5) / n_layers:.4g}) "
            "that leaves at least one layer")
    return k


def removal_order(scores: tuple[float, ...] | list[float]) -> tuple[int, ...]:
    """Layer indices from the most to the least removable: ascending score, ties deepest first."""
    return tuple(sorted(range(len(scores)), key=lambda i: (scores[i], -i)))


def lowest_score_plan(importance: LayerImportance, ratio: float) -> RemovalPlan:
    """Plan removing the ``layers_to_remove(ratio, L)`` layers with the lowest scores.

    Ties between equal scores: the deeper layer goes first (module docstring).
    """
    n = importance.num_layers
    k = layers_to_remove(ratio, n)
    order = removal_order(importance.scores)
    plan = RemovalPlan(policy="lowest", num_layers=n, ratio=float(ratio),
                       removed=tuple(sorted(order[:k])), scores=importance.scores,
                       method=importance.method, order=order)
    logger.info("lowest-%s plan: remove %d of %d layers %s", importance.method, k, n,
                list(plan.removed))
    return plan


def seq_plan(n_layers: int, ratio: float, keep_last: int = 0) -> RemovalPlan:
    """The paper's "Seq" baseline: remove the deepest ``k = layers_to_remove(ratio, L)`` layers.

    With ``keep_last = m`` the last ``m`` layers are protected and the block just before them
    goes instead: indices ``L - m - k .. L - m - 1``.

    Raises:
        ValueError: bad ``ratio`` (see :func:`layers_to_remove`), or ``keep_last`` outside
            ``[0, L - k]``.
    """
    k = layers_to_remove(ratio, n_layers)
    if (isinstance(keep_last, bool) or not isinstance(keep_last, int)
            or not 0 <= keep_last <= n_layers - k):
        raise ValueError(f"keep_last={keep_last!r} is invalid: removing {k} of {n_layers} layers "
                         f"leaves room for keep_last in [0, {n_layers - k}]")
    stop = n_layers - keep_last
    removed = tuple(range(stop - k, stop))
    plan = RemovalPlan(policy="seq", num_layers=n_layers, ratio=float(ratio), removed=removed,
                       scores=tuple(float(n_layers - i) for i in range(n_layers)),
                       method="sequence", order=tuple(reversed(removed)), keep_last=keep_last)
    logger.info("seq plan: remove %d of %d layers %s (keep_last=%d)", k, n_layers, list(removed),
                keep_last)
    return plan


def apply_plan(model: nn.Module, plan: RemovalPlan) -> nn.Module:
    """Remove the plan's layers from ``model`` in place
    (:func:`~fedcompress.models.adapter.remove_layers`).

    The config's ``num_hidden_layers`` (and per-layer lists) follow, so the model round-trips
    through ``save_pretrained``/``from_pretrained``.

    Raises:
        ValueError: the model does not have the plan's number of layers.
    """
    n = num_layers(model)
    if n != plan.num_layers:
        raise ValueError(f"the plan is for a model with {plan.num_layers} layers but this model "
                         f"has {n}: expected the model the plan was made for (not yet pruned)")
    if plan.removed:
        remove_layers(model, list(plan.removed))
    return model


def make_plan(policy: str, ratio: float, importance: LayerImportance | None = None,
              n_layers: int | None = None, keep_last: int = 0) -> RemovalPlan:
    """A plan by policy name (for configs): ``"lowest"`` needs ``importance``; ``"seq"`` needs
    ``n_layers`` (or takes it from ``importance``).

    Raises:
        ValueError: unknown policy, or the input the policy needs is missing.
    """
    if policy == "lowest":
        if importance is None:
            raise ValueError("policy 'lowest' needs a LayerImportance (importance=None given)")
        return lowest_score_plan(importance, ratio)
    if policy == "seq":
        if n_layers is None:
            if importance is None:
                raise ValueError("policy 'seq' needs n_layers or an importance to count layers")
            n_layers = importance.num_layers
        return seq_plan(n_layers, ratio, keep_last)
    raise ValueError(f"policy={policy!r} is invalid: expected one of {POLICIES}")
