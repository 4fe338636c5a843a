"""Weight quantization's settings (statistics mode): the scheme, the solver and its options.

A piece of a method's settings (:class:`fedcompress.config.Settings`), read as a
:class:`~fedcompress.quant.config.QuantConfig` by :attr:`QuantSettings.quant_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedcompress.config import Settings, setting
from fedcompress.quant.config import (
    ACTORDERS,
    QUANT_METHODS,
    SCALE_DTYPES,
    SCHEMES,
    QuantConfig,
)

#: Weight quantization of statistics mode: none, or a scheme of fedcompress.quant.
QUANT_SCHEMES = ("none", *SCHEMES)
#: GPTQ column orders a saved model can carry (no g_idx since compressed-tensors 0.19).
SAVED_ACTORDERS = tuple(a for a in ACTORDERS if a != "group")


@dataclass(frozen=True)
class QuantSettings(Settings):
    """Quantization of the linear layers of the decoder layers (none by default)."""

    label: ClassVar[str] = "quantization"

    quant: str = setting(
        "none", "Statistics mode: quantize every linear layer of the decoder layers too, from "
        "the summed Hessians (GPTQ) or without data (rtn), layer by layer, the sites' next "
        "inputs coming from the quantized layer: w4a16 (4-bit integer weights) or w8a16; with "
        "sparsegpt, pruned and quantized jointly; saved in the compressed-tensors format "
        "(pack-quantized).", choices=QUANT_SCHEMES)
    quant_method: str = setting("gptq", "Quantization solver: gptq (error compensation from "
                                "the sites' summed Hessians) or rtn (round to nearest, no "
                                "data).", choices=QUANT_METHODS)
    quant_group_size: int = setting(128, "Quantization: columns sharing a scale (it must "
                                    "divide every layer's input width; 0: one scale per "
                                    "output channel).", ge=0)
    quant_symmetric: bool = setting(True, "Quantization: symmetric (zero point 0) or "
                                    "asymmetric integer grids.")
    quant_actorder: str = setting("static", "GPTQ's column order: none or static (by "
                                  "decreasing Hessian diagonal, scales in the weight's own "
                                  "groups; groups formed in that order need a g_idx, which "
                                  "compressed-tensors no longer saves).",
                                  choices=SAVED_ACTORDERS)
    quant_dampening: float = setting(0.01, "GPTQ: fraction of the Hessian's mean diagonal "
                                     "added to its diagonal.", gt=0.0, lt=1.0)
    quant_block_size: int = setting(128, "GPTQ: columns updated together.", ge=1)
    quant_preserve_zeros: bool = setting(
        False, "Quantization alone (method none): keep the zeros of a weight at least 5% zero "
        "(a model pruned before, e.g. by a recipe's earlier stage: no error is pushed into "
        "them, as earlier llm-compressor releases did; 0.14's GPTQ fills some in. A checkpoint "
        "converted from a quantized GGUF may hold such zeros unpruned).")
    quant_scale_dtype: str = setting("bfloat16", "Quantization: dtype of the scales (the "
                                     "dequantized weights are computed in it, as runtimes do "
                                     "from the saved scales).", choices=SCALE_DTYPES)

    @property
    def quant_config(self) -> QuantConfig | None:
        """The quantization recipe (None: no quantization)."""
        if self.quant == "none":
            return None
        return QuantConfig(self.quant, self.quant_method, self.quant_group_size,
                           self.quant_symmetric, self.quant_actorder, self.quant_dampening,
                           self.quant_block_size, scale_dtype=self.quant_scale_dtype,
                           preserve_zeros=self.quant_preserve_zeros)
