"""Weight quantization: the recipe (:class:`QuantConfig`) and the solver of one linear layer
(:mod:`fedcompress.quant.solver`: the scale observer, round-to-nearest, GPTQ, SparseGPT and GPTQ
jointly); no Flower import."""

from fedcompress.quant.config import ACTORDERS, QUANT_METHODS, SCHEMES, QuantConfig
from fedcompress.quant.solver import (
    QuantResult,
    dequantize,
    gptq_quantize,
    observe,
    quant_range,
    rtn_quantize,
    sparsegpt_quantize,
)

__all__ = ["ACTORDERS", "QUANT_METHODS", "SCHEMES", "QuantConfig", "QuantResult", "dequantize",
           "gptq_quantize", "observe", "quant_range", "rtn_quantize", "sparsegpt_quantize"]
