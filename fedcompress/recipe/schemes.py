"""Weight quantization schemes of a recipe: llm-compressor's presets and ``config_groups``.

A ``GPTQModifier`` or ``QuantizationModifier`` names its scheme either by a preset
(``scheme: W4A16``) or spells it out (``config_groups: {group_0: {targets: [Linear], weights:
{num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}}}``). Both reduce
to one :class:`WeightScheme`, which fedcompress runs as its integer schemes
(:data:`fedcompress.quant.config.SCHEMES`): weight-only, integer, 4 or 8 bits, symmetric or
not, one scale per group of input columns or per output channel, scales from the minimum and
maximum of the weights. Anything else (activations, floats, blocks, other observers) is refused
by its name, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedcompress.recipe.errors import RecipeError, refuse_unknown

#: compressed-tensors' weight-only integer presets (``PRESET_SCHEMES``) fedcompress runs.
PRESETS: dict[str, dict[str, Any]] = {
    "W4A16": dict(num_bits=4, symmetric=True, strategy="group", group_size=128),
    "W4A16_ASYM": dict(num_bits=4, symmetric=False, strategy="group", group_size=128),
    "W8A16": dict(num_bits=8, symmetric=True, strategy="group", group_size=128),
}
#: ``QuantizationArgs`` fields and the only values fedcompress runs where it has a choice of one
#: (None: llm-compressor's default, the same thing).
_FIXED_ARGS = {
    "type": ("int",),
    "dynamic": (False,),
    "block_structure": (None,),
    "observer": (None, "minmax", "memoryless_minmax"),
    "observer_kwargs": (None, {}),
    "zp_dtype": (None, "int8", "torch.int8"),
}
_ARGS = ("num_bits", "symmetric", "strategy", "group_size", "actorder", "scale_dtype",
         *_FIXED_ARGS)
#: A scheme's column order (``actorder``) as fedcompress names it.
ACTORDERS = {None: None, "static": "static", "weight": "static", "group": "group"}
SCALE_DTYPES = {"bfloat16": "bfloat16", "torch.bfloat16": "bfloat16", "float16": "float16",
                "torch.float16": "float16", "float32": "float32", "torch.float32": "float32"}


@dataclass(frozen=True)
class WeightScheme:
    """One weight quantization scheme: ``bits`` (4 or 8), ``symmetric``, ``group_size`` (0:
    one scale per output channel), ``actorder`` (None: the modifier's), ``scale_dtype`` (None:
    the run's setting)."""

    bits: int
    symmetric: bool = True
    group_size: int = 128
    actorder: str | None = None
    scale_dtype: str | None = None

    @property
    def name(self) -> str:
        """fedcompress's scheme name (``w4a16``, ``w8a16``)."""
        return f"w{self.bits}a16"


def weight_scheme(scheme: Any, config_groups: Any, where: str) -> WeightScheme:
    """The one weight scheme of a quantization modifier at ``where`` (its path in the recipe),
    from ``scheme`` (a preset name, or ``{preset: targets}``) or ``config_groups`` (exactly
    one of them)."""
    if (scheme is None) == (config_groups is None):
        raise RecipeError(f"{where}: expected exactly one of scheme (a preset such as W4A16) "
                          "and config_groups")
    if scheme is not None:
        if isinstance(scheme, Mapping):
            if len(scheme) != 1:
                raise RecipeError(f"{where}.scheme: expected one preset, got {sorted(scheme)}")
            (name, targets), = scheme.items()
            check_linear_targets(targets, f"{where}.scheme.{name}")
        else:
            name = scheme
        if not isinstance(name, str) or name.upper() not in PRESETS:
            raise RecipeError(f"{where}.scheme: {name!r} is not a scheme fedcompress runs: "
                              f"expected one of {', '.join(PRESETS)} (weight-only integers)")
        return _scheme_from_args(PRESETS[name.upper()], f"{where}.scheme")
    if not isinstance(config_groups, Mapping) or len(config_groups) != 1:
        raise RecipeError(f"{where}.config_groups: expected one group (one scheme for every "
                          f"targeted linear layer), got {config_groups!r}")
    (group, body), = config_groups.items()
    path = f"{where}.config_groups.{group}"
    if not isinstance(body, Mapping):
        raise RecipeError(f"{path}: expected a mapping with targets and weights")
    refuse_unknown(body, ("targets", "weights", "input_activations", "output_activations",
                          "format"), path)
    check_linear_targets(body.get("targets"), f"{path}.targets")
    for key in ("input_activations", "output_activations", "format"):
        if body.get(key) is not None:
            raise RecipeError(f"{path}.{key}: fedcompress quantizes weights only (W4A16, W8A16): "
                              "expected it absent")
    if not isinstance(body.get("weights"), Mapping):
        raise RecipeError(f"{path}.weights: expected the weights' quantization arguments")
    return _scheme_from_args(body["weights"], f"{path}.weights")


def _scheme_from_args(args: Mapping[str, Any], where: str) -> WeightScheme:
    refuse_unknown(args, _ARGS, where)
    for key, allowed in _FIXED_ARGS.items():
        if key in args and args[key] not in allowed:
            raise RecipeError(f"{where}.{key}: {args[key]!r} is not implemented: expected "
                              + " or ".join(repr(v) for v in allowed))
    bits = args.get("num_bits", 8)
    if isinstance(bits, bool) or bits not in (4, 8):
        raise RecipeError(f"{where}.num_bits: {bits!r}: expected 4 or 8")
    symmetric = args.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise RecipeError(f"{where}.symmetric: {symmetric!r}: expected true or false")
    strategy = args.get("strategy", "tensor")
    group_size = args.get("group_size")
    if strategy == "group":
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise RecipeError(f"{where}.group_size: {group_size!r}: expected a positive "
                              "integer with strategy group")
    elif strategy == "channel":
        if group_size is not None:
            raise RecipeError(f"{where}.group_size: {group_size!r}: expected none with "
                              "strategy channel")
        group_size = 0
    else:
        raise RecipeError(f"{where}.strategy: {strategy!r} is not implemented: expected group "
                          "or channel")
    actorder = args.get("actorder")
    if actorder not in ACTORDERS:
        raise RecipeError(f"{where}.actorder: {actorder!r}: expected one of "
                          f"{', '.join(str(a) for a in ACTORDERS if a)} or none")
    scale_dtype = args.get("scale_dtype")
    if scale_dtype is not None and str(scale_dtype) not in SCALE_DTYPES:
        raise RecipeError(f"{where}.scale_dtype: {scale_dtype!r}: expected one of "
                          "bfloat16, float16, float32 or none (the run's setting)")
    return WeightScheme(bits, symmetric, group_size, ACTORDERS[actorder],
                        None if scale_dtype is None else SCALE_DTYPES[str(scale_dtype)])


def check_linear_targets(targets: Any, where: str) -> None:
    """A scheme's (or modifier's) ``targets``: the linear layers (``Linear``; llm-compressor's
    default), the only ones fedcompress compresses."""
    names = [targets] if isinstance(targets, str) else targets
    if not isinstance(names, (list, tuple)) or list(names) != ["Linear"]:
        raise RecipeError(f"{where}: {targets!r}: expected Linear (fedcompress compresses the "
                          "linear layers of the decoder layers; leave some out with ignore)")
