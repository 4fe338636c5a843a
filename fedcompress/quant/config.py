"""A weight-quantization recipe: the scheme, the solver and their settings.

The schemes are the weight-only integer schemes that serving runtimes load from the
compressed-tensors format: ``w4a16`` (4-bit integers, activations in the model's dtype) and
``w8a16``. The solver is GPTQ (Frantar et al., 2023), which needs each linear layer's Hessian
``2 X X^T`` (the statistic that SparseGPT and statistics mode already sum), or round-to-nearest
(``rtn``), the data-free baseline. The defaults are llm-compressor's (``GPTQModifier`` and its
``W4A16`` preset): group size 128, symmetric, dampening 1% of the Hessian's mean diagonal,
blocks of 128 columns, scales and zero points from the dense weights' per-group minimum and
maximum.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: Weight schemes and their integer width.
SCHEMES = {"w4a16": 4, "w8a16": 8}
#: Solvers: GPTQ (error compensation from the Hessian) or round-to-nearest (no data).
QUANT_METHODS = ("gptq", "rtn")
#: Column orders of the GPTQ sweep (llm-compressor's names): ``none`` (the weight's own),
#: ``static`` (by decreasing Hessian diagonal, groups keep their columns), ``group`` (by
#: decreasing Hessian diagonal, groups formed in that order: the saved model carries ``g_idx``).
ACTORDERS = ("none", "static", "group")
#: How the scale and zero point of a group are chosen from its dense weights.
OBSERVERS = ("minmax",)
#: dtypes of the scales (the dequantized weight ``(q - zero_point) * scale`` is computed in it,
#: as the runtime computes it from the saved scales).
SCALE_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize the linear layers of the decoder layers.

    ``group_size``: columns sharing one scale (and zero point); ``0``: one per output channel.
    It must divide the input width of every quantized layer (:meth:`check_width`).
    ``dampening``: fraction of the Hessian's mean diagonal added to its diagonal before it is
    inverted. ``block_size``: columns updated together in the GPTQ sweep (the result does not
    depend on it beyond float rounding). ``scale_dtype``: the dtype of the scales, whatever the
    dtype the model runs in: the dequantized weights are computed in it, so a model saved with
    its scales in that dtype (or a wider one) loads back with exactly the weights the run
    evaluated (bfloat16 by default: what W4A16 kernels take). ``preserve_zeros``: quantization
    alone keeps the zeros of a weight at least 5% zero (a model pruned before: no error is
    pushed into them; :func:`fedcompress.pruning.local.preserved_zeros`): earlier llm-compressor
    releases did so; 0.14's GPTQ does not, and neither does a recipe unless asked.
    """

    scheme: str = "w4a16"
    method: str = "gptq"
    group_size: int = 128
    symmetric: bool = True
    actorder: str = "static"
    dampening: float = 0.01
    block_size: int = 128
    observer: str = "minmax"
    scale_dtype: str = "bfloat16"
    preserve_zeros: bool = False

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown quantization scheme {self.scheme!r}: expected one of "
                             f"{', '.join(SCHEMES)}")
        if self.method not in QUANT_METHODS:
            raise ValueError(f"unknown quantization method {self.method!r}: expected one of "
                             f"{', '.join(QUANT_METHODS)}")
        if (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                or self.group_size < 0):
            raise ValueError(f"quantization group size {self.group_size!r}: expected a "
                             "positive integer, or 0 for one scale per output channel")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric={self.symmetric!r}: expected true or false")
        if self.actorder not in ACTORDERS:
            raise ValueError(f"unknown activation ordering {self.actorder!r}: expected one of "
                             f"{', '.join(ACTORDERS)}")
        if not isinstance(self.dampening, (int, float)) or not 0.0 < float(self.dampening) < 1.0:
            raise ValueError(f"dampening {self.dampening!r}: expected a fraction of the "
                             "Hessian's mean diagonal in (0, 1)")
        if (isinstance(self.block_size, bool) or not isinstance(self.block_size, int)
                or self.block_size < 1):
            raise ValueError(f"GPTQ block size {self.block_size!r}: expected a positive integer")
        if self.observer not in OBSERVERS:
            raise ValueError(f"unknown scale observer {self.observer!r}: expected one of "
                             f"{', '.join(OBSERVERS)}")
        if not isinstance(self.preserve_zeros, bool):
            raise ValueError(f"preserve_zeros={self.preserve_zeros!r}: expected true or false")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale dtype {self.scale_dtype!r}: expected one of "
                             f"{', '.join(SCALE_DTYPES)}")

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme]

    @property
    def torch_scale_dtype(self):
        """:attr:`scale_dtype` as a torch dtype."""
        import torch

        return getattr(torch, self.scale_dtype)

    @property
    def needs_hessian(self) -> bool:
        return self.method == "gptq"

    def check_width(self, name: str, in_features: int) -> None:
        """Refuse a layer whose input width the group size does not divide, naming the group
        sizes that would (a remainder group is not what runtimes load)."""
        if self.group_size and in_features % self.group_size:
            fits = ", ".join(str(g) for g in (256, 128, 64, 32, 16) if in_features % g == 0)
            raise ValueError(
                f"quantization group size {self.group_size} does not divide the {in_features} "
                f"input features of {name}: expected a group size that divides every "
                f"quantized layer's input width (here: {fits or 'none of 256 to 16'}), or 0 for "
                "one scale per output channel")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> QuantConfig:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown quantization settings {sorted(unknown)}: expected "
                             f"{sorted(cls.__dataclass_fields__)}")
        return cls(**data)
