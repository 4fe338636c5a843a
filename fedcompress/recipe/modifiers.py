"""The modifiers of a recipe fedcompress implements, in llm-compressor's format.

llm-compressor's (0.14) ``SparseGPTModifier``, ``WandaPruningModifier``, ``GPTQModifier`` and
``QuantizationModifier``, with the fields their recipes use, and fedcompress's own
``RIAPruningModifier`` and ``FedPrLLMVoteModifier`` in the same format. Each parses its
arguments strictly (:meth:`Modifier.from_args`: an unknown field, or a field fedcompress does
not implement set to anything but llm-compressor's default, is refused by name) and says what
it asks of a run as the settings of :class:`~fedcompress.methods.fedprllm.config.FedPrLLMConfig`
(:meth:`Modifier.settings`).

Where the arithmetic is llm-compressor's and where it differs:

* ``WandaPruningModifier``: Wanda's scores ``|W| * ||X_j||``, the ``floor(sparsity * in)``
  lowest of every output row, ties in index order (a stable sort, as Wanda's code sorts);
* ``SparseGPTModifier``: the OBS sweep in blocks of ``block_size`` columns (and
  ``dampening_frac``, as GPTQ's; in one stage with ``GPTQModifier``, one joint sweep: the two
  must agree); a block's mask is
  chosen over the whole block (``layer`` comparison within the block, as SparseGPT's reference
  and llm-compressor do); fedcompress prunes ``floor(sparsity * size)`` of each matrix in
  running totals over its blocks where llm-compressor prunes every score at or below the
  block's ``int(sparsity * size)``-th (one weight more per block, ties included);
* ``GPTQModifier``: :func:`fedcompress.quant.gptq_quantize` (llm-compressor 0.14's math, the
  Hessian in float64 up to its inverse's Cholesky factor); ``QuantizationModifier``:
  round-to-nearest with the same min-max scales.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from fedcompress.recipe.errors import RecipeError, refuse_unknown
from fedcompress.recipe.schemes import WeightScheme, check_linear_targets, weight_scheme

#: Lifecycle fields every llm-compressor modifier has: a one-shot recipe leaves them unset.
_LIFECYCLE = {"index": (None,), "start": (None, -1), "end": (None, -1), "update": (None,)}
#: The OBS sweep's defaults (SparseGPT's and GPTQ's, llm-compressor's as fedcompress's).
SWEEP_DEFAULTS = {"block_size": 128, "dampening_frac": 0.01}


def _float(value: Any, where: str, low: float, high: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not low <= float(value) < high:
        raise RecipeError(f"{where}: {value!r}: expected {what}")
    return float(value)


def _block_and_dampening(args: dict[str, Any], where: str) -> dict[str, Any]:
    """An OBS sweep's ``block_size`` (columns per block) and ``dampening_frac`` (of the
    Hessian's mean diagonal), taken out of ``args``."""
    block = args.pop("block_size", SWEEP_DEFAULTS["block_size"])
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise RecipeError(f"{where}.block_size: {block!r}: expected a positive integer")
    damp = _float(args.pop("dampening_frac", SWEEP_DEFAULTS["dampening_frac"]),
                  f"{where}.dampening_frac", 1e-12, 1.0, "a fraction in (0, 1)")
    return {"block_size": block, "dampening_frac": damp}


def _names(value: Any, where: str) -> tuple[str, ...]:
    """``targets``/``ignore``: a name or a list of names (``re:`` for a regular expression)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise RecipeError(f"{where}: {value!r}: expected a module name, a class name or "
                          "'re:<regular expression>', or a list of them")
    return tuple(items)


@dataclass(frozen=True)
class Modifier:
    """A step of a recipe. ``group``: llm-compressor's label of the modifier's group (from the
    ``<group>_modifiers`` key), kept for the report; ``targets``/``ignore``: the modules it
    applies to (:mod:`fedcompress.recipe.targets` resolves them against the model)."""

    NAME: ClassVar[str]
    KIND: ClassVar[str]  # "pruning", "quantization" or "aggregation"
    #: Fields fedcompress does not implement, accepted at these values only (llm-compressor's
    #: defaults: what fedcompress does anyway).
    DEFAULT_ONLY: ClassVar[Mapping[str, tuple]] = {}

    group: str | None = None
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()

    @classmethod
    def fields_known(cls) -> tuple[str, ...]:
        return (*(f.name for f in fields(cls)), *cls.DEFAULT_ONLY, *_LIFECYCLE)

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None, where: str,
                  group: str | None = None) -> Modifier:
        """This modifier from its recipe arguments at ``where``; nothing unknown passes."""
        if args is not None and not isinstance(args, Mapping):
            raise RecipeError(f"{where}: {args!r}: expected the modifier's arguments as a "
                              "mapping")
        args = dict(args or {})
        refuse_unknown(args, cls.fields_known(), where)
        for key, allowed in {**_LIFECYCLE, **cls.DEFAULT_ONLY}.items():
            value = args.pop(key, allowed[0])
            if value not in allowed:
                raise RecipeError(f"{where}.{key}: {value!r} is not implemented by fedcompress: "
                                  "expected " + " or ".join(repr(v) for v in allowed)
                                  + " (llm-compressor's default)")
        label = args.pop("group", group)
        if label is not None and not isinstance(label, str):
            raise RecipeError(f"{where}.group: {label!r}: expected a name")
        targets = _names(args.pop("targets", "Linear"), f"{where}.targets")
        check_linear_targets(list(targets), f"{where}.targets")
        ignore = _names(args.pop("ignore", None), f"{where}.ignore")
        return cls._parse(args, where, group=label, targets=targets, ignore=ignore)

    @classmethod
    def _parse(cls, args: dict[str, Any], where: str, **common: Any) -> Modifier:
        return cls(**common, **args)

    def settings(self) -> dict[str, Any]:
        """What this modifier sets of a FedPrLLM run (flat ``FedPrLLMConfig`` keys)."""
        raise NotImplementedError

    def to_args(self) -> dict[str, Any]:
        """Its recipe arguments, as a recipe file would hold them."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "group"}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


@dataclass(frozen=True)
class _Pruning(Modifier):
    """The fields llm-compressor's pruning modifiers share."""

    KIND: ClassVar[str] = "pruning"
    METHOD: ClassVar[str]
    COMPARISON: ClassVar[str] = "row"
    DEFAULT_ONLY: ClassVar[Mapping[str, tuple]] = {"sequential_targets": (None,),
                                                   "sequential_update": (False,)}

    sparsity: float = 0.5
    mask_structure: str = "0:0"
    sparsity_profile: str | None = None
    owl_m: float | None = None
    owl_lmbda: float | None = None

    @classmethod
    def _parse(cls, args: dict[str, Any], where: str, **common: Any) -> Modifier:
        if "sparsity" not in args:
            raise RecipeError(f"{where}.sparsity: expected the fraction of weights to prune")
        sparsity = args.pop("sparsity")
        if isinstance(sparsity, (list, tuple)):
            raise RecipeError(f"{where}.sparsity: a list of per-layer ratios is not implemented "
                              "in a recipe: expected one fraction (per-layer ratios: "
                              "sparsity_profile owl, or fedcompress's --layer-sparsity)")
        sparsity = _float(sparsity, f"{where}.sparsity", 0.0, 1.0, "a fraction in [0, 1)")
        structure = str(args.pop("mask_structure", "0:0"))
        try:
            n, m = (int(v) for v in structure.split(":"))
        except ValueError:
            raise RecipeError(f"{where}.mask_structure: {structure!r}: expected '0:0' "
                              "(unstructured) or 'N:M' such as '2:4'") from None
        if (n, m) != (0, 0):
            if not 0 < n < m:
                raise RecipeError(f"{where}.mask_structure: {structure!r}: expected 0 < N < M")
            if abs(sparsity - n / m) > 1e-9:
                raise RecipeError(f"{where}.sparsity: {sparsity} with mask_structure "
                                  f"{structure}: expected {n / m:g} (N:M prunes N of every M)")
        profile = args.pop("sparsity_profile", None)
        if profile not in (None, "owl"):
            raise RecipeError(f"{where}.sparsity_profile: {profile!r}: expected owl or none")
        owl_m, owl_lmbda = args.pop("owl_m", None), args.pop("owl_lmbda", None)
        if profile is None and (owl_m is not None or owl_lmbda is not None):
            raise RecipeError(f"{where}: owl_m and owl_lmbda apply to sparsity_profile owl: "
                              "expected them absent")
        if (n, m) != (0, 0) and profile is not None:
            raise RecipeError(f"{where}.sparsity_profile: {profile!r} with mask_structure "
                              f"{structure}: N:M fixes every layer's ratio")
        if owl_m is not None:
            owl_m = _float(owl_m, f"{where}.owl_m", 1e-12, float("inf"), "a number > 0")
        if owl_lmbda is not None:
            owl_lmbda = _float(owl_lmbda, f"{where}.owl_lmbda", 0.0, 0.5, "a number in [0, 0.5)")
        return cls(**common, sparsity=sparsity, mask_structure=structure,
                   sparsity_profile=profile, owl_m=owl_m, owl_lmbda=owl_lmbda,
                   **cls._parse_more(args, where))

    @classmethod
    def _parse_more(cls, args: dict[str, Any], where: str) -> dict[str, Any]:
        return args

    @property
    def nm(self) -> str:
        return "none" if self.mask_structure == "0:0" else self.mask_structure

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.METHOD, "sparsity": self.sparsity, "nm": self.nm,
                               "local_group": self.COMPARISON,
                               "sparsity_profile": self.sparsity_profile or "uniform"}
        if self.owl_m is not None:
            out["owl_m"] = self.owl_m
        if self.owl_lmbda is not None:
            out["owl_lambda"] = self.owl_lmbda
        return out


@dataclass(frozen=True)
class WandaPruningModifier(_Pruning):
    """Wanda (Sun et al., 2024): ``|W| * ||X_j||``, the lowest of every output row."""

    NAME: ClassVar[str] = "WandaPruningModifier"
    METHOD: ClassVar[str] = "wanda"


@dataclass(frozen=True)
class RIAPruningModifier(_Pruning):
    """fedcompress's modifier for RIA (Zhang et al., ICLR 2024: relative importance times
    ``||X_j||^0.5``, from Wanda's statistics), the lowest of every output row."""

    NAME: ClassVar[str] = "RIAPruningModifier"
    METHOD: ClassVar[str] = "ria"


@dataclass(frozen=True)
class SparseGPTModifier(_Pruning):
    """SparseGPT (Frantar and Alistarh, 2023): the OBS sweep with weight updates, a block's
    mask chosen over the whole block."""

    NAME: ClassVar[str] = "SparseGPTModifier"
    METHOD: ClassVar[str] = "sparsegpt"
    COMPARISON: ClassVar[str] = "layer"
    DEFAULT_ONLY: ClassVar[Mapping[str, tuple]] = {
        "sequential_targets": (None,), "sequential_update": (False,),
        "preserve_sparsity_mask": (False,), "offload_hessians": (False,)}

    block_size: int = 128
    dampening_frac: float = 0.01

    @classmethod
    def _parse_more(cls, args: dict[str, Any], where: str) -> dict[str, Any]:
        return _block_and_dampening(args, where)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "sparsegpt_block_size": self.block_size,
                "sparsegpt_dampening": self.dampening_frac}


@dataclass(frozen=True)
class _Quantization(Modifier):
    """The fields of llm-compressor's quantization modifiers (``QuantizationMixin``)."""

    KIND: ClassVar[str] = "quantization"
    SOLVER: ClassVar[str]
    DEFAULT_ONLY: ClassVar[Mapping[str, tuple]] = {
        "kv_cache_scheme": (None,), "weight_observer": (None, "minmax", "memoryless_minmax"),
        "input_observer": (None,), "output_observer": (None,),
        "observer": (None, "minmax", "memoryless_minmax"),
        "bypass_divisibility_checks": (False,), "requires_calibration_data": (None, True, False),
        "sequential_targets": (None,), "batched_quantization": (None, "auto")}

    scheme: WeightScheme = WeightScheme(4)

    @classmethod
    def fields_known(cls) -> tuple[str, ...]:
        return (*super().fields_known(), "config_groups")

    @classmethod
    def _parse(cls, args: dict[str, Any], where: str, **common: Any) -> Modifier:
        scheme = weight_scheme(args.pop("scheme", None), args.pop("config_groups", None), where)
        return cls(**common, scheme=scheme, **cls._parse_more(args, where, scheme))

    @classmethod
    def _parse_more(cls, args: dict[str, Any], where: str, scheme: WeightScheme
                    ) -> dict[str, Any]:
        return args

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"quant": self.scheme.name, "quant_method": self.SOLVER,
                               "quant_group_size": self.scheme.group_size,
                               "quant_symmetric": self.scheme.symmetric}
        if self.scheme.scale_dtype is not None:
            out["quant_scale_dtype"] = self.scheme.scale_dtype
        return out

    def to_args(self) -> dict[str, Any]:
        out = super().to_args()
        s = out.pop("scheme")
        weights = {"num_bits": s.bits, "type": "int", "symmetric": s.symmetric,
                   "strategy": "group" if s.group_size else "channel",
                   "group_size": s.group_size or None}
        if s.actorder is not None:
            weights["actorder"] = s.actorder
        out["config_groups"] = {"group_0": {"targets": ["Linear"], "weights": weights}}
        return out


@dataclass(frozen=True)
class QuantizationModifier(_Quantization):
    """Round-to-nearest with min-max scales (no data)."""

    NAME: ClassVar[str] = "QuantizationModifier"
    SOLVER: ClassVar[str] = "rtn"


@dataclass(frozen=True)
class GPTQModifier(_Quantization):
    """GPTQ (Frantar et al., 2023) from the Hessians the sites' statistics sum."""

    NAME: ClassVar[str] = "GPTQModifier"
    SOLVER: ClassVar[str] = "gptq"

    block_size: int = 128
    dampening_frac: float = 0.01
    actorder: str = "static"

    @classmethod
    def _parse_more(cls, args: dict[str, Any], where: str, scheme: WeightScheme
                    ) -> dict[str, Any]:
        sweep = _block_and_dampening(args, where)
        order = args.pop("actorder", "static")
        names = {"static": "static", "weight": "static", None: "none", "none": "none",
                 "group": "group"}
        if order not in names:
            raise RecipeError(f"{where}.actorder: {order!r}: expected static, weight, group or "
                              "none")
        order = scheme.actorder or names[order]
        if order == "group":
            raise RecipeError(f"{where}.actorder: group needs a g_idx in the saved model, which "
                              "compressed-tensors 0.19 no longer writes: expected static or none")
        return {**sweep, "actorder": order}

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "quant_block_size": self.block_size,
                "quant_dampening": self.dampening_frac, "quant_actorder": self.actorder}


#: FedPrLLM's vote options (the paper's server comparison, scaling and rounds).
VOTE_FIELDS = ("comparison", "scale", "tie_break", "mode")


@dataclass(frozen=True)
class FedPrLLMVoteModifier(Modifier):
    """fedcompress's modifier for FedPrLLM's vote (with ``--aggregate votes``): the server's
    ``comparison`` group of the vote counts (layer, row, column), ``scale`` (kept weights times
    ``(m - votes) / m``), ``tie_break`` (magnitude, random, index) and ``mode`` (oneshot, or
    iterative: one round per decoder layer)."""

    NAME: ClassVar[str] = "FedPrLLMVoteModifier"
    KIND: ClassVar[str] = "aggregation"

    comparison: str = "layer"
    scale: bool = False
    tie_break: str = "magnitude"
    mode: str = "oneshot"

    @classmethod
    def _parse(cls, args: dict[str, Any], where: str, **common: Any) -> Modifier:
        choices = {"comparison": ("layer", "row", "column"),
                   "tie_break": ("magnitude", "random", "index"),
                   "mode": ("oneshot", "iterative")}
        for key, allowed in choices.items():
            if key in args and args[key] not in allowed:
                raise RecipeError(f"{where}.{key}: {args[key]!r}: expected one of "
                                  f"{', '.join(allowed)}")
        if "scale" in args and not isinstance(args["scale"], bool):
            raise RecipeError(f"{where}.scale: {args['scale']!r}: expected true or false")
        return cls(**common, **args)

    def settings(self) -> dict[str, Any]:
        return {"group": self.comparison, "scale": self.scale, "tie_break": self.tie_break,
                "mode": self.mode}


MODIFIERS: dict[str, type[Modifier]] = {
    cls.NAME: cls for cls in (SparseGPTModifier, WandaPruningModifier, RIAPruningModifier,
                              GPTQModifier, QuantizationModifier, FedPrLLMVoteModifier)}
