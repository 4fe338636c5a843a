"""Weight quantization: the recipe (:class:`QuantConfig`); no Flower import."""

from fedcompress.quant.config import ACTORDERS, QUANT_METHODS, SCHEMES, QuantConfig

__all__ = ["ACTORDERS", "QUANT_METHODS", "SCHEMES", "QuantConfig"]
