"""The pruning rule's settings: what each site (or the server, in statistics mode) prunes.

A piece of a method's settings (:class:`fedcompress.config.Settings`): FedPrLLM's
:class:`~fedcompress.methods.fedprllm.config.FedPrLLMConfig` is composed of it and the other
pieces (federation, aggregation, votes, quantization, SecAgg+, DP statistics, simulation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedcompress.config import Settings, setting
from fedcompress.pruning.allocation import PROFILES
from fedcompress.pruning.local import METHODS, NO_PRUNING
from fedcompress.pruning.scores import SPARSEGPT_BLOCKSIZE, SPARSEGPT_PERCDAMP
from fedcompress.solver.select import GROUPS


@dataclass(frozen=True)
class PruningSettings(Settings):
    """The local pruning rule, its sparsity and its comparison group."""

    label: ClassVar[str] = "pruning"

    method: str = setting("wanda", "Local pruning: magnitude, wanda, ria (relative importance "
                          "times input norm^0.5, Wanda's statistics), sparsegpt, gradient "
                          "(first-order Taylor |W * dL/dW|, one backward pass; one-shot only), "
                          "or none (quantization alone: --quant with --aggregate stats and "
                          "--sparsity 0).", choices=(*METHODS, NO_PRUNING))
    sparsity: float = setting(0.5, "Fraction of weights pruned in each linear layer, in "
                              "[0, 1).", ge=0.0, lt=1.0)
    nm: str = setting("none", "N:M semi-structured pattern, e.g. 2:4 (overrides --sparsity), "
                      "or none.")
    sparsity_profile: str = setting(
        "uniform", "Per-layer sparsity: uniform, or owl (outlier-weighted layerwise sparsity: "
        "each site sends the per-layer outlier ratios of its Wanda scores, the server averages "
        "them and sets each layer's ratio; the global ratio stays --sparsity).",
        choices=PROFILES)
    owl_lambda: float = setting(0.08, "OWL's lambda: layer ratios lie within sparsity +- lambda.",
                                ge=0.0, lt=0.5)
    owl_m: float = setting(5.0, "OWL's M: a score is an outlier above M times its layer's "
                           "mean score.", gt=0.0)
    layer_sparsity: str = setting("", "Per-layer sparsity plan: comma-separated ratios, one per "
                                  "decoder layer, or JSON {\"layers\": [...], \"linears\": "
                                  "{\"3.mlp.up_proj\": 0.4}}; its mean over the prunable "
                                  "weights must be --sparsity (empty: uniform, or set by the "
                                  "server under --sparsity-profile owl).")
    local_group: str = setting("row", "Clients' comparison group: layer, row, column.",
                               choices=GROUPS)

    sparsegpt_block_size: int = setting(SPARSEGPT_BLOCKSIZE, "SparseGPT: columns pruned "
                                        "together (a block's mask is chosen over the block; "
                                        "with --quant gptq, its --quant-block-size).", ge=1)
    sparsegpt_dampening: float = setting(SPARSEGPT_PERCDAMP, "SparseGPT: fraction of the "
                                         "Hessian's mean diagonal added to its diagonal (with "
                                         "--quant gptq, its --quant-dampening).", gt=0.0, lt=1.0)

    def validate(self) -> None:
        if self.method == NO_PRUNING and self.sparsity != 0:
            raise self.invalid("sparsity", "0 with method none (it prunes nothing)")
        if self.nm not in ("", "none") and (self.sparsity_profile != "uniform"
                                            or self.layer_sparsity):
            raise self.invalid("nm", "none with a per-layer sparsity profile or plan (N:M fixes "
                               "every layer's ratio)")
        if self.method != "sparsegpt":
            for key, default in (("sparsegpt_block_size", SPARSEGPT_BLOCKSIZE),
                                 ("sparsegpt_dampening", SPARSEGPT_PERCDAMP)):
                if getattr(self, key) != default:
                    raise self.invalid(key, f"{default} (its default) with method "
                                       f"{self.method} (it applies to sparsegpt)")
