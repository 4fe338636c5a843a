"""Per-layer (and per-linear) target sparsity: the plan every mask maker and every vote follows.

A :class:`SparsityPlan` names the target ratio of every linear layer of a model: ``default`` (the
global ratio ``p``), optionally one ratio per decoder layer (``layers``), optionally per-linear
overrides (``linears``, keyed ``"<layer>.<linear name>"``, e.g. ``"3.self_attn.q_proj"``). The
uniform plan (no ``layers``, no ``linears``) is the default everywhere and behaves exactly as a
single float did. Inside one linear layer the comparison group (layer/row/column, or N:M) is
unchanged: a group prunes ``floor(ratio x group size)`` weights at that linear's ratio.

**The global ratio is kept.** An allocation rule returns ratios whose mean over the prunable
weights (each layer weighted by its number of weights) is ``p``; :func:`renormalize` shifts any
ratios to that mean (float64, exact to rounding) and refuses a result outside ``[0, 1)``. The
weights actually pruned differ from ``p x total`` only by the flooring inside each group; the
report gives the achieved sparsity of every layer.

**OWL** (outlier-weighted layerwise sparsity, Yin et al. 2024): a layer's outlier ratio ``D_l`` is
the share of its Wanda scores ``|W_ij| * ||X_j||`` (over all its linear layers together) above
``M`` times their mean (:func:`outlier_ratio`); the ratios are min-max scaled to ``[0, 2 lambda]``
and layer ``l`` gets ``p - (scaled_l - mean(scaled))``: layers with more outliers are pruned less,
and the unweighted mean (= the weighted one: decoder layers have equal sizes) stays ``p``
(:func:`owl_ratios`). All outlier ratios equal (e.g. one layer): uniform ``p``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fedcompress.models import CALC_DTYPE
from fedcompress.solver.select import check_sparsity

__all__ = [
    "PROFILES",
    "BoundedRatios",
    "SparsityPlan",
    "bounded_rescale",
    "owl_ratios",
    "outlier_ratio",
    "renormalize",
    "rescale",
]

#: Sparsity profiles: how per-layer ratios are chosen (one ratio everywhere, or OWL's rule).
PROFILES = ("uniform", "owl")


def _ratio(value: object, what: str) -> float:
    try:
        return check_sparsity(value)  # type: ignore[arg-type]
    except ValueError as err:
        raise ValueError(f"{what}: {err}; expected a sparsity in [0, 1)") from None


@dataclass(frozen=True)
class SparsityPlan:
    """Target sparsity of every linear layer (module docstring).

    Attributes:
        default: The ratio of a linear layer no other entry names (the global ratio ``p``).
        layers: One ratio per decoder layer (empty: ``default`` everywhere).
        linears: Per-linear ratios, keyed ``"<layer>.<linear name>"``; they win over ``layers``.
    """

    default: float
    layers: tuple[float, ...] = ()
    linears: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "default", _ratio(self.default, "default sparsity"))
        object.__setattr__(self, "layers", tuple(
            _ratio(r, f"sparsity of layer {i}") for i, r in enumerate(self.layers)))
        linears = {}
        for key, r in dict(self.linears).items():
            layer, _, name = str(key).partition(".")
            if not layer.isdigit() or not name:
                raise ValueError(f"per-linear sparsity key {key!r} is invalid: expected "
                                 "'<layer index>.<linear name>', e.g. '3.self_attn.q_proj'")
            linears[str(key)] = _ratio(r, f"sparsity of {key}")
        object.__setattr__(self, "linears", linears)

    @classmethod
    def uniform(cls, sparsity: float) -> SparsityPlan:
        return cls(sparsity)

    @property
    def is_uniform(self) -> bool:
        return not self.linears and all(r == self.default for r in self.layers)

    def check_layers(self, n_layers: int) -> None:
        """Raise when the plan does not fit a model of ``n_layers`` decoder layers."""
        if self.layers and len(self.layers) != n_layers:
            raise ValueError(f"sparsity plan has {len(self.layers)} per-layer ratios, the model "
                             f"has {n_layers} decoder layers")
        bad = sorted({k for k in self.linears if int(k.split(".", 1)[0]) >= n_layers})
        if bad:
            raise ValueError(f"per-linear sparsity for {bad[:3]}: the model has {n_layers} "
                             "decoder layers")

    def at(self, layer: int, name: str | None = None) -> float:
        """The ratio of linear ``name`` of decoder layer ``layer`` (``name`` None: the layer's)."""
        if name is not None:
            key = f"{layer}.{name}"
            if key in self.linears:
                return self.linears[key]
        if self.layers:
            if not 0 <= layer < len(self.layers):
                raise ValueError(f"layer {layer} has no ratio: the plan covers "
                                 f"{len(self.layers)} layers")
            return self.layers[layer]
        return self.default

    def dense_layers(self, n_layers: int) -> tuple[int, ...]:
        """The decoder layers of a model of ``n_layers`` that the plan leaves dense: ratio 0 for
        the layer and for every per-linear entry of it (a layer whose linears are all set to 0
        one by one over a nonzero layer ratio is not listed: the plan does not name them all)."""
        self.check_layers(n_layers)
        return tuple(i for i in range(n_layers)
                     if self.at(i) == 0 and all(r == 0 for k, r in self.linears.items()
                                                if int(k.split(".", 1)[0]) == i))

    def at_key(self, key: str) -> float:
        """The ratio of a wire key ``"<prefix>.<layer>.<linear name>"`` (FedPrLLM's masks)."""
        _, layer, name = key.split(".", 2)
        return self.at(int(layer), name)

    def global_ratio(self, sizes: Mapping[str, int]) -> float:
        """The weighted mean ratio over linear layers ``{"<layer>.<name>": weights}``."""
        total = sum(sizes.values())
        if total == 0:
            raise ValueError("no weights to prune")
        return math.fsum(self.at(int(k.split(".", 1)[0]), k.split(".", 1)[1]) * n
                         for k, n in sizes.items()) / total

    # -- wire / config text ------------------------------------------------------------------
    def to_text(self) -> str:
        """A config value: ``""`` for uniform, else JSON ``{"layers": [...], "linears": {...}}``
        (floats written with ``repr`` precision, so the round trip is exact)."""
        if not self.layers and not self.linears:
            return ""
        return json.dumps({"layers": list(self.layers), "linears": dict(self.linears)},
                          sort_keys=True)

    @classmethod
    def from_text(cls, text: str, default: float) -> SparsityPlan:
        """Inverse of :meth:`to_text`; also accepts comma-separated per-layer ratios."""
        text = (text or "").strip()
        if not text or text == "uniform":
            return cls(default)
        if text.startswith("{"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"sparsity plan {text[:60]!r} is not valid JSON: {err}") \
                    from None
            unknown = sorted(set(data) - {"layers", "linears"})
            if unknown or not isinstance(data, dict):
                raise ValueError(f"sparsity plan has unknown keys {unknown}: expected 'layers' "
                                 "and/or 'linears'")
            return cls(default, tuple(data.get("layers", ())), dict(data.get("linears", {})))
        try:
            layers = tuple(float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"sparsity plan {text[:60]!r} is invalid: expected comma-separated "
                             "ratios per layer or JSON {\"layers\": [...], \"linears\": {...}}") \
                from None
        return cls(default, layers)

    def to_dict(self) -> dict:
        return {"default": self.default, "layers": list(self.layers),
                "linears": dict(self.linears)}


def renormalize(ratios: Sequence[float], sizes: Sequence[int], target: float) -> list[float]:
    """``ratios`` shifted by one constant so that their mean weighted by ``sizes`` is
    ``target`` (float64); a shifted ratio outside ``[0, 1)`` is an error naming the layer."""
    check_sparsity(target)
    if len(ratios) != len(sizes) or not ratios:
        raise ValueError(f"{len(ratios)} ratios for {len(sizes)} layer sizes")
    r = np.asarray(ratios, dtype=np.float64)
    n = np.asarray(sizes, dtype=np.float64)
    if (n <= 0).any():
        raise ValueError("layer sizes must be positive")
    shifted = r + (target - float(np.dot(r, n) / n.sum()))
    for i, value in enumerate(shifted):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"layer {i}: ratio {value:.4f} after renormalizing to {target} is "
                             "outside [0, 1); lower the spread (OWL's lambda) or the sparsity")
    return [float(x) for x in shifted]


def _scaling_inputs(ratios: Sequence[float], sizes: Sequence[int], target: float
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The checked float64 ratios and sizes of :func:`rescale` / :func:`bounded_rescale`."""
    check_sparsity(target)
    if len(ratios) != len(sizes) or not ratios:
        raise ValueError(f"{len(ratios)} ratios for {len(sizes)} layer sizes")
    r = np.asarray(ratios, dtype=np.float64)
    n = np.asarray(sizes, dtype=np.float64)
    if (n <= 0).any() or (r < 0).any() or not np.isfinite(r).all():
        raise ValueError("layer sizes must be positive and ratios finite and >= 0")
    return r, n


def rescale(ratios: Sequence[float], sizes: Sequence[int], target: float) -> list[float]:
    """``ratios`` multiplied by one constant so that their mean weighted by ``sizes`` is
    ``target`` (float64): the proportions between ratios are kept (Eq. 4 of the personalized
    pruning paper). All-zero ratios cannot reach a positive target; a scaled ratio >= 1 is an
    error naming it."""
    r, n = _scaling_inputs(ratios, sizes, target)
    mean = float(np.dot(r, n) / n.sum())
    if mean == 0:
        if target == 0:
            return [0.0] * len(r)
        raise ValueError(f"every ratio is 0: no scaling reaches the sparsity {target}")
    scaled = r * (target / mean)
    for i, value in enumerate(scaled):
        if value >= 1.0:
            raise ValueError(f"ratio {i}: {value:.4f} after scaling to the sparsity {target} is "
                             "not below 1: this plan cannot reach it (lower the sparsity or "
                             "the spread of the factors)")
    return [float(x) for x in scaled]


@dataclass(frozen=True)
class BoundedRatios:
    """:func:`bounded_rescale`'s answer: the ratios, the constant that multiplied the raw
    ratios, the bound's interval, and where the bound bit (indices clipped to ``low`` /
    ``high``)."""

    ratios: list[float]
    scale: float
    low: float
    high: float
    clipped_low: list[int]
    clipped_high: list[int]

    @property
    def bit(self) -> bool:
        return bool(self.clipped_low or self.clipped_high)


def bounded_rescale(ratios: Sequence[float], sizes: Sequence[int], target: float,
                    bound: float) -> BoundedRatios:
    """``ratios`` multiplied by one constant ``c`` and each clipped to ``[target - bound,
    target + bound]`` (and to ``[0, 1)``), ``c`` chosen so that the mean weighted by ``sizes``
    is ``target`` (float64). Where :func:`rescale` already lands inside the bound the answer is
    the same; otherwise the proportions hold among the ratios the bound did not clip (OWL's
    lambda in spirit: no layer strays further than ``bound`` from ``target``).

    The weighted mean of the clipped ratios is continuous, non-decreasing and piecewise linear
    in ``c``: it is solved exactly on the piece that holds ``target``. A target the bound cannot
    reach (every positive ratio at ``target + bound`` and the mean still below it, e.g. when
    most weights have raw ratio 0) is an error with the numbers."""
    if not (isinstance(bound, (int, float)) and math.isfinite(bound) and bound >= 0):
        raise ValueError(f"ratio bound {bound!r}: expected a number >= 0")
    r, n = _scaling_inputs(ratios, sizes, target)
    low, high = max(0.0, target - bound), target + bound
    if high >= 1.0:
        raise ValueError(f"ratio bound {bound} at sparsity {target} lets a layer reach a ratio "
                         f"of {high:.4f} >= 1: expected a bound below 1 - sparsity = "
                         f"{1 - target:.4f}")
    total = float(n.sum())

    def mean_at(c: float) -> float:
        return float(np.dot(np.clip(c * r, low, high), n) / total)

    ceiling = float(np.dot(np.where(r > 0, high, low), n) / total)  # c -> infinity
    if target > ceiling + 1e-12:
        share = float(n[r > 0].sum() / total)
        raise ValueError(f"the sparsity {target} is out of reach inside the ratio bound "
                         f"{bound}: with every layer that has a positive ratio at "
                         f"{high:.4f} ({share:.1%} of the weights) and the rest at {low:.4f}, "
                         f"the mean is {ceiling:.4f}; raise the bound or the factors of the "
                         "classes at ratio 0")
    if target <= low or not (r > 0).any():  # every ratio at low (= target, or 0)
        c = 0.0
    else:
        positive = r[r > 0]
        breaks = np.unique(np.concatenate([low / positive, high / positive]))
        values = np.array([mean_at(float(b)) for b in breaks])
        k = int(np.searchsorted(values, target))  # first break with mean >= target
        lo_c = float(breaks[k - 1]) if k > 0 else 0.0
        hi_c = float(breaks[min(k, len(breaks) - 1)])
        mid = np.clip(0.5 * (lo_c + hi_c) * r, low, high)
        free = (mid > low) & (mid < high)
        fixed = float(np.dot(np.where(free, 0.0, mid), n))
        slope = float(np.dot(np.where(free, r, 0.0), n))
        c = (target * total - fixed) / slope if slope > 0 else hi_c
    scaled = c * r
    out = np.clip(scaled, low, high)
    return BoundedRatios([float(x) for x in out], float(c), low, high,
                         [i for i, v in enumerate(scaled) if v < low],
                         [i for i, v in enumerate(scaled) if v > high])


def outlier_ratio(scores: Sequence[torch.Tensor], m: float) -> float:
    """OWL's outlier ratio of one decoder layer: the share of its scores (all its linear
    layers' ``|W| * ||X||``, together) above ``m`` times their mean, in float32."""
    if not m > 0:
        raise ValueError(f"OWL's M={m!r} is invalid: expected a number > 0")
    if not scores:
        raise ValueError("no scores: a decoder layer without linear layers")
    flat = torch.cat([s.detach().reshape(-1).to(CALC_DTYPE) for s in scores])
    if not torch.isfinite(flat).all():
        raise ValueError("scores hold NaN or infinite values")
    mean = flat.mean()
    return int((flat > m * mean).sum()) / flat.numel()


def owl_ratios(outliers: Sequence[float], sparsity: float, lam: float,
               sizes: Sequence[int] | None = None) -> list[float]:
    """OWL's layer sparsities from per-layer outlier ratios (module docstring): min-max scaled
    to ``[0, 2 lam]``, ``p - (scaled - mean(scaled))``, then :func:`renormalize`\\ d to ``p``
    over ``sizes`` (equal sizes: a no-op up to rounding)."""
    check_sparsity(sparsity)
    if not (isinstance(lam, (int, float)) and 0 <= lam < 0.5):
        raise ValueError(f"OWL's lambda={lam!r} is invalid: expected [0, 0.5)")
    d = np.asarray(outliers, dtype=np.float64)
    if d.ndim != 1 or d.size == 0 or not np.isfinite(d).all() or (d < 0).any() or (d > 1).any():
        raise ValueError(f"outlier ratios {list(outliers)[:4]}...: expected one share in "
                         "[0, 1] per layer")
    spread = d.max() - d.min()
    scaled = np.zeros_like(d) if spread == 0 else (d - d.min()) / spread * (2 * lam)
    ratios = sparsity - (scaled - scaled.mean())
    return renormalize(list(ratios), list(sizes) if sizes else [1] * len(d), sparsity)
