"""The settings pieces of layer removal and personalized layer pruning (on the
:class:`fedcompress.config.Settings` base; a method's settings class composes them, and their
flat names are its options):

* :class:`BlockInfluenceSettings`: PPC-GPT's removal of the least influential layers;
* :class:`RedundancySettings`: PrunePrivyTune's removal of redundant layers (Sec. 4.1, Alg. 1);
* :class:`UnitClassSettings`: a site's unit classification of personalized pruning (Alg. 1 of
  seed 004, :mod:`fedcompress.layers.personalized`);
* :class:`PersonalizedPlanSettings`: the sparsity plan built on the classes (Eq. 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedcompress.config import Settings, setting
from fedcompress.layers.personalized import (
    DEFAULT_RATIO_BOUND,
    GRANULARITIES,
    RULES,
    ZERO_MODES,
)
from fedcompress.layers.redundancy import MEASURES

__all__ = [
    "PRUNE_POLICIES",
    "REMOVALS",
    "SOURCES",
    "BlockInfluenceSettings",
    "PersonalizedPlanSettings",
    "RedundancySettings",
    "UnitClassSettings",
]

#: PPC-GPT's removal: Block Influence, or the deepest layers (the "Seq" baseline).
PRUNE_POLICIES = ("bi", "seq")
#: PrunePrivyTune's removal: a ratio of the most redundant layers, Alg. 1's greedy search, none.
REMOVALS = ("ratio", "greedy", "none")
#: Where PrunePrivyTune's cosine matrix comes from.
SOURCES = ("sites", "public")


@dataclass(frozen=True)
class BlockInfluenceSettings(Settings):
    """PPC-GPT's layer removal: the least influential decoder layers by Block Influence (or the
    deepest ones)."""

    label: ClassVar[str] = "layer removal (Block Influence)"

    prune_ratio: float = setting(0.3, "Fraction of decoder layers removed, in [0, 1).",
                                 ge=0.0, lt=1.0)
    prune_policy: str = setting("bi", "bi (Block Influence) or seq (the deepest layers).",
                                choices=PRUNE_POLICIES)


@dataclass(frozen=True)
class RedundancySettings(Settings):
    """PrunePrivyTune's layer removal by the pairwise cosine redundancy of hidden states."""

    label: ClassVar[str] = "layer removal (redundancy)"

    removal: str = setting("ratio", "ratio (remove --ratio of the layers), greedy (Alg. 1 under "
                           "--max-drop) or none.", choices=REMOVALS)
    measure: str = setting("pairwise", "Redundancy: pairwise (avg_cos, Eq. 5) or adjacent (the "
                           "Cosine baseline).", choices=MEASURES)
    ratio: float = setting(0.2, "Fraction of layers removed (removal ratio), in [0, 1).",
                           ge=0.0, lt=1.0)
    max_drop: float = setting(0.02, "Delta of Alg. 1: the largest allowed drop of validation "
                              "accuracy (or of -log perplexity), >= 0.", ge=0.0)
    tau: float = setting(-1.0, "Eq. 6 threshold: only layers with redundancy above it are "
                         "greedy candidates (-1: all).", ge=-1.0, le=1.0)
    similarity_source: str = setting("public", "Cosine matrix from public text on the server "
                                     "(default: nothing leaves a site before DP training), or "
                                     "from the sites' data (each sends its (L+1)^2 matrix, "
                                     "averaged; not DP-protected).", choices=SOURCES)
    similarity_texts: int = setting(64, "Texts per site (or public) for the cosine matrix.",
                                    ge=1)


@dataclass(frozen=True)
class UnitClassSettings(Settings):
    """How a site classifies the model's units as personalized, generic or others (Alg. 1)."""

    label: ClassVar[str] = "unit classification (Alg. 1)"

    k: int = setting(4, "Units switched off per draw (the paper's Random Number).", ge=1)
    max_iter: int = setting(32, "Draws of Alg. 1 per site.", ge=1)
    granularity: str = setting("sublayer", "Unit: sublayer (attention / MLP of a block), "
                               "linear or layer.", choices=GRANULARITIES)
    zero: str = setting("weights", "Switch a unit off by zeroing its weights or skipping its "
                        "outputs.", choices=ZERO_MODES)
    adapt_steps: int = setting(0, "Alg. 1 line 2: LoRA steps on the site's calibration windows "
                               "before classification (0: classify the shared model as is); "
                               "the adapted copy serves the classification only.", ge=0)
    adapt_lr: float = setting(1e-3, "Learning rate of that adaptation (AdamW, LoRA r 8).",
                              gt=0.0)
    class_rule: str = setting("paper", "Alg. 1's threshold: paper (the untouched model's "
                              "loss: on a pretrained LM nearly every drawn unit ends "
                              "personalized) or relative (the --class-quantile of the draws' "
                              "own losses).", choices=RULES)
    class_quantile: float = setting(0.5, "The relative rule's quantile of the draws' losses.",
                                    gt=0.0, lt=1.0)


@dataclass(frozen=True)
class PersonalizedPlanSettings(Settings):
    """The per-linear sparsity plan of a site from the units' classes (Eq. 4), rescaled to the
    overall sparsity ``p``."""

    label: ClassVar[str] = "sparsity plan (Eq. 4)"

    sparsity: float = setting(0.5, "Overall sparsity p of every site's model, in [0, 1).",
                              ge=0.0, lt=1.0)
    personalized_factor: float = setting(0.5, "Eq. 4: ratio of a personalized unit as a "
                                         "fraction of p (before rescaling to p).", ge=0.0)
    others_factor: float = setting(0.75, "Eq. 4: ratio of an undecided unit as a fraction of "
                                   "p (generic: 1).", ge=0.0)
    ratio_bound: float = setting(DEFAULT_RATIO_BOUND, "No unit's ratio strays more than this "
                                 "from p (Eq. 4's proportions kept inside it; it binds only "
                                 "where Eq. 4 alone would go further); 1: no bound.",
                                 ge=0.0, le=1.0)

    def validate(self) -> None:
        if self.ratio_bound < 1 and self.sparsity + self.ratio_bound >= 1:
            raise self.invalid("ratio_bound", f"below 1 - sparsity = {1 - self.sparsity:g} "
                               "(a unit's ratio would reach 1), or 1 for no bound")

    @property
    def bound(self) -> float | None:
        """The ratio bound of the plans (None: Eq. 4 alone)."""
        return None if self.ratio_bound >= 1 else self.ratio_bound

    @property
    def factors(self) -> dict[str, float]:
        return {"generic": 1.0, "personalized": self.personalized_factor,
                "others": self.others_factor}
