"""Layer importance and layer removal (plain torch; no Flower import).

* :mod:`~fedcompress.layers.importance`: :class:`LayerImportance`, the result of every score
  (one number per decoder layer, higher = more important), and :func:`sum_importances`.
* :mod:`~fedcompress.layers.influence`: Block Influence (ShortGPT / PPC-GPT Eq. 6-7).
* :mod:`~fedcompress.layers.redundancy`: pairwise cosine redundancy of hidden states
  (PrunePrivyTune Sec. 4.1): the ``(L+1) x (L+1)`` matrix, avg_cos, the greedy removal of Alg. 1.
* :mod:`~fedcompress.layers.removal`: removal plans (lowest score, the "Seq" baseline) applied
  with :func:`~fedcompress.models.adapter.remove_layers`.
"""

from fedcompress.layers.importance import LayerImportance, LayerImportanceFn, sum_importances
from fedcompress.layers.influence import (
    block_influence,
    label_rationale_influence,
    qa_label_pairs,
    row_cosine,
)
from fedcompress.layers.redundancy import (
    CosineMatrix,
    GreedyRemoval,
    cosine_matrix,
    greedy_removal,
    plot_cosine_matrix,
)
from fedcompress.layers.removal import (
    POLICIES,
    RemovalPlan,
    apply_plan,
    layers_to_remove,
    lowest_score_plan,
    make_plan,
    removal_order,
    seq_plan,
)

__all__ = [
    "POLICIES",
    "CosineMatrix",
    "GreedyRemoval",
    "cosine_matrix",
    "greedy_removal",
    "plot_cosine_matrix",
    "LayerImportance",
    "LayerImportanceFn",
    "RemovalPlan",
    "apply_plan",
    "block_influence",
    "label_rationale_influence",
    "layers_to_remove",
    "lowest_score_plan",
    "make_plan",
    "qa_label_pairs",
    "removal_order",
    "row_cosine",
    "seq_plan",
    "sum_importances",
]
