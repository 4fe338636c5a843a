"""The result every layer-importance score returns, whatever computed it.

A score (Block Influence here; PrunePrivyTune's pairwise cosine redundancy later) is one number
per decoder layer with ONE orientation: **higher means more important**. A redundancy-like
measure is turned into an importance before it is wrapped in a :class:`LayerImportance` (e.g.
``1 - redundancy``), so the removal policies of :mod:`fedcompress.layers.removal` work on any of
them unchanged: they remove the layers with the lowest scores.

Adding a new score: write a function returning a :class:`LayerImportance` with its own
``method`` name (and ``components`` when it is a sum of other scores); nothing else changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["LayerImportance", "LayerImportanceFn", "sum_importances"]


@dataclass(frozen=True)
class LayerImportance:
    """One importance score per decoder layer (higher: more important).

    Attributes:
        method: Name of the score, e.g. ``"block_influence"`` or
            ``"block_influence:label+rationale"``.
        scores: ``scores[i]`` is the importance of decoder layer ``i`` (finite floats).
        n_examples: Examples the score was computed on (0 for data-free scores).
        n_tokens: Token positions averaged over, per layer (0 for data-free scores).
        components: For a sum of scores (:func:`sum_importances`), the summed parts.
        info: Free-form settings of the computation (max length, positions, seconds, ...).
            Not compared in ``==``.
    """

    method: str
    scores: tuple[float, ...]
    n_examples: int = 0
    n_tokens: int = 0
    components: tuple[LayerImportance, ...] = ()
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        scores = tuple(float(s) for s in self.scores)
        if not scores:
            raise ValueError(f"{self.method}: scores is empty; expected one score per layer")
        bad = [i for i, s in enumerate(scores) if not math.isfinite(s)]
        if bad:
            raise ValueError(f"{self.method}: non-finite scores at layers {bad}: "
                             f"{[scores[i] for i in bad]}; expected finite floats")
        object.__setattr__(self, "scores", scores)

    @property
    def num_layers(self) -> int:
        return len(self.scores)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (components nested)."""
        return {"method": self.method, "scores": list(self.scores),
                "n_examples": self.n_examples, "n_tokens": self.n_tokens,
                "components": [c.to_dict() for c in self.components], "info": dict(self.info)}


class LayerImportanceFn(Protocol):
    """A data-driven layer-importance score: model, tokenizer, data -> :class:`LayerImportance`."""

    def __call__(self, model: Any, tokenizer: Any, pairs: Sequence[tuple[str, str]],
                 **kwargs: Any) -> LayerImportance: ...


def sum_importances(parts: Sequence[LayerImportance], method: str | None = None
                    ) -> LayerImportance:
    """Layer-wise sum of importance scores: ``scores[i] = sum_k parts[k].scores[i]``.

    This is PPC-GPT's Eq. 7 when the parts are BI on labels and BI on rationales. The result
    keeps the parts in ``components``; ``n_examples`` and ``n_tokens`` are the parts' totals.

    Raises:
        ValueError: no parts, or parts with different layer counts.
    """
    if not parts:
        raise ValueError("sum_importances needs at least one LayerImportance, got none")
    sizes = {p.num_layers for p in parts}
    if len(sizes) != 1:
        raise ValueError(f"cannot sum importances over different layer counts "
                         f"{[p.num_layers for p in parts]}; expected one model's layers")
    scores = tuple(math.fsum(p.scores[i] for p in parts) for i in range(parts[0].num_layers))
    return LayerImportance(method=method or "+".join(p.method for p in parts), scores=scores,
                           n_examples=sum(p.n_examples for p in parts),
                           n_tokens=sum(p.n_tokens for p in parts), components=tuple(parts))
