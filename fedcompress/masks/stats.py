"""Statistics of prune masks and vote counts: pure functions on torch tensors, no Flower.

A *mask collection* is any of

* one bool tensor (its key is ``"mask"``);
* a flat mapping ``{key: bool tensor}``, e.g. the wire keys ``"layers.{i}.{linear name}"``;
* the walker's per-decoder-layer list ``[{linear name: bool tensor}, ...]`` (or a ``WalkResult``,
  anything with a ``.masks`` list), flattened to the wire keys ``"layers.{i}.{name}"``.

"Layer" below means one key of the flattened collection (one linear layer); :meth:`Ratio.by`
regroups results, e.g. by decoder layer (:func:`decoder_layer_of`) or by linear name
(:func:`linear_name_of`).

Every count is an exact integer (``int64`` sums); a ratio is computed once, in float64, from the
integer numerator and denominator, per layer and overall (overall = sum of numerators / sum of
denominators, i.e. weighted by the number of weights, not a mean of per-layer ratios).

Definitions (``m`` masks; ``c`` = vote count of a weight = the number of masks pruning it):

* Hamming distance of two masks: the fraction of positions where they differ.
* Mean pairwise Hamming of ``m`` masks: the mean over the ``m(m-1)/2`` pairs of their Hamming
  distances; from the counts alone, ``sum c(m - c) / (numel * m(m-1)/2)`` (a position with count
  ``c`` differs in exactly ``c(m - c)`` pairs).
* Unanimity: the fraction of weights every mask agrees on (``c == 0`` or ``c == m``).
* Mean pairwise Jaccard of the pruned sets: the mean over pairs of ``|A & B| / |A | B|``
  (1.0 for two empty sets); "overall" takes each pair's sets over all layers together.
* Binary entropy ``H(p) = -p log2 p - (1-p) log2 (1-p)`` bits; the entropy of a mask is
  ``H(fraction pruned)`` bits per weight (an entropy coder's size for i.i.d. bits). Overall:
  total bits of the per-layer codes (``sum numel_l H(p_l)``) over the total number of weights.
* Empirical conditional entropy ``H(X | Y)`` of mask ``X`` given mask ``Y``, in bits per weight,
  from the 2x2 table of joint counts (plug-in estimate over positions). Overall pools the tables.
* Vote histogram: ``hist[c]`` = number of weights with count ``c``, for ``c = 0..m`` (int64).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

import numpy as np
import torch

from fedcompress.masks.codec import mask_key

__all__ = [
    "LayerValues",
    "Ratio",
    "VoteHistogram",
    "binary_entropy",
    "conditional_entropy",
    "decoder_layer_of",
    "flatten_masks",
    "hamming",
    "hamming_distance",
    "joint_counts",
    "linear_name_of",
    "mask_entropy",
    "mean_pairwise_hamming",
    "mean_pairwise_jaccard",
    "pairwise_hamming_matrix",
    "unanimity",
    "vote_counts_of",
    "vote_histogram",
]


# ------------------------------------------------------------------------------------------
# Collections and result types
# ------------------------------------------------------------------------------------------

def flatten_masks(masks: Any, first_layer: int = 0) -> dict[str, torch.Tensor]:
    """A mask collection (see the module docstring) as a flat ``{key: tensor}`` dict."""
    if hasattr(masks, "masks") and not isinstance(masks, (torch.Tensor, Mapping)):
        masks = masks.masks
    if isinstance(masks, torch.Tensor):
        return {"mask": masks}
    if isinstance(masks, Mapping):
        return dict(masks)
    if isinstance(masks, Sequence):
        flat: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(masks):
            if not isinstance(layer, Mapping):
                raise TypeError(f"layer {i} of the mask list is a {type(layer).__name__}, "
                                "expected a mapping {linear name: mask}")
            for name, mask in layer.items():
                flat[mask_key(first_layer + i, name)] = mask
        return flat
    raise TypeError(f"not a mask collection: {type(masks).__name__}")


def decoder_layer_of(key: str) -> str:
    """``"layers.3.self_attn.q_proj"`` -> ``"layers.3"`` (other keys are returned unchanged)."""
    parts = key.split(".", 2)
    return ".".join(parts[:2]) if len(parts) == 3 and parts[0] == "layers" else key


def linear_name_of(key: str) -> str:
    """``"layers.3.self_attn.q_proj"`` -> ``"self_attn.q_proj"``."""
    parts = key.split(".", 2)
    return parts[2] if len(parts) == 3 and parts[0] == "layers" else key


@dataclass(frozen=True)
class LayerValues:
    """A value per layer and one overall value."""

    per_layer: dict[str, float]
    overall: float

    def to_dict(self) -> dict:
        return {"per_layer": dict(self.per_layer), "overall": self.overall}


@dataclass(frozen=True)
class Ratio:
    """Exact integer numerators and denominators per layer; ratios in float64."""

    num: dict[str, int]
    den: dict[str, int]

    @property
    def per_layer(self) -> dict[str, float]:
        return {k: (self.num[k] / self.den[k] if self.den[k] else 0.0) for k in self.num}

    @property
    def overall(self) -> float:
        den = sum(self.den.values())
        return sum(self.num.values()) / den if den else 0.0

    def by(self, group: Callable[[str], str]) -> Ratio:
        """Sum numerators and denominators over the keys with the same ``group(key)``."""
        num: dict[str, int] = {}
        den: dict[str, int] = {}
        for k in self.num:
            g = group(k)
            num[g] = num.get(g, 0) + self.num[k]
            den[g] = den.get(g, 0) + self.den[k]
        return Ratio(num, den)

    def by_decoder_layer(self) -> Ratio:
        return self.by(decoder_layer_of)

    def by_linear(self) -> Ratio:
        return self.by(linear_name_of)

    def values(self) -> LayerValues:
        return LayerValues(self.per_layer, self.overall)

    def to_dict(self) -> dict:
        return {"per_layer": self.per_layer, "overall": self.overall,
                "num": dict(self.num), "den": dict(self.den)}


@dataclass(frozen=True)
class VoteHistogram:
    """``hist[c]`` = number of weights pruned by exactly ``c`` of ``n_clients`` masks."""

    n_clients: int
    per_layer: dict[str, np.ndarray]
    overall: np.ndarray = field(repr=False)

    def fractions(self) -> np.ndarray:
        """The overall histogram as fractions of all weights (float64)."""
        total = int(self.overall.sum())
        return self.overall / total if total else self.overall.astype(np.float64)

    def to_dict(self) -> dict:
        return {"n_clients": self.n_clients, "overall": self.overall.tolist(),
                "per_layer": {k: v.tolist() for k, v in self.per_layer.items()}}


# ------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------

def _check_bool(mask: torch.Tensor, key: str) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{key}: expected a bool tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{key}: a prune mask must be bool, got {mask.dtype}")
    return mask


def _paired(a: Any, b: Any) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    fa, fb = flatten_masks(a), flatten_masks(b)
    if set(fa) != set(fb):
        only_a = sorted(set(fa) - set(fb))[:3]
        only_b = sorted(set(fb) - set(fa))[:3]
        raise ValueError(f"the mask collections have different layers: only in the first "
                         f"{only_a}, only in the second {only_b}")
    out = []
    for key in fa:
        x, y = _check_bool(fa[key], key), _check_bool(fb[key], key)
        if x.shape != y.shape:
            raise ValueError(f"{key}: shapes {tuple(x.shape)} and {tuple(y.shape)} differ")
        out.append((key, x, y.to(x.device)))
    return out


def _stack(masks: Sequence[Any]) -> dict[str, list[torch.Tensor]]:
    if len(masks) < 2:
        raise ValueError(f"need at least 2 mask collections, got {len(masks)}")
    flats = [flatten_masks(m) for m in masks]
    keys = list(flats[0])
    for i, f in enumerate(flats[1:], 1):
        if set(f) != set(keys):
            raise ValueError(f"mask collection {i} has different layers than collection 0")
    out = {}
    for key in keys:
        tensors = [_check_bool(f[key], key) for f in flats]
        if any(t.shape != tensors[0].shape for t in tensors):
            raise ValueError(f"{key}: the masks have different shapes")
        out[key] = tensors
    return out


# ------------------------------------------------------------------------------------------
# Hamming distances and agreement
# ------------------------------------------------------------------------------------------

def hamming(a: Any, b: Any) -> Ratio:
    """Hamming distance (fraction of differing bits) per layer and overall."""
    num, den = {}, {}
    for key, x, y in _paired(a, b):
        num[key] = int(torch.count_nonzero(x ^ y))
        den[key] = x.numel()
    return Ratio(num, den)


def hamming_distance(a: Any, b: Any) -> float:
    """Overall Hamming distance of two masks or mask collections (a float in [0, 1])."""
    return hamming(a, b).overall


def pairwise_hamming_matrix(masks: Sequence[Any]) -> np.ndarray:
    """``[m, m]`` float64 matrix of overall Hamming distances (zero diagonal, symmetric)."""
    stacked = _stack(masks)
    m = len(masks)
    diff = np.zeros((m, m), dtype=np.int64)
    total = sum(ts[0].numel() for ts in stacked.values())
    for ts in stacked.values():
        for i, j in combinations(range(m), 2):
            d = int(torch.count_nonzero(ts[i] ^ ts[j]))
            diff[i, j] += d
            diff[j, i] += d
    return diff / total if total else diff.astype(np.float64)


def vote_counts_of(masks: Sequence[Any]) -> dict[str, torch.Tensor]:
    """Per-layer vote counts (int64) of a list of mask collections."""
    return {key: torch.stack([t.to(torch.int64) for t in ts]).sum(0)
            for key, ts in _stack(masks).items()}


def _counts_dict(counts: Any) -> dict[str, torch.Tensor]:
    flat = flatten_masks(counts)
    for key, c in flat.items():
        if not isinstance(c, torch.Tensor) or c.dtype.is_floating_point or c.dtype == torch.bool:
            kind = c.dtype if isinstance(c, torch.Tensor) else type(c).__name__
            raise TypeError(f"{key}: vote counts must be an integer tensor, got {kind}")
    return flat


def _check_counts(c: torch.Tensor, n_clients: int, key: str) -> torch.Tensor:
    if not isinstance(n_clients, int) or n_clients < 1:
        raise ValueError(f"number of clients {n_clients!r} must be a positive integer")
    c = c.to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) > n_clients):
        raise ValueError(f"{key}: vote counts in [{int(c.min())}, {int(c.max())}] are outside "
                         f"[0, {n_clients}]")
    return c


def mean_pairwise_hamming(counts: Any, n_clients: int) -> Ratio:
    """Mean Hamming distance over all pairs of the ``n_clients`` masks behind ``counts``.

    Exact: ``sum c(m - c)`` differing (pair, position) cases over ``numel * m(m-1)/2``.
    """
    if n_clients < 2:
        raise ValueError(f"pairwise statistics need at least 2 clients, got {n_clients}")
    pairs = n_clients * (n_clients - 1) // 2
    num, den = {}, {}
    for key, c in _counts_dict(counts).items():
        c = _check_counts(c, n_clients, key)
        num[key] = int((c * (n_clients - c)).sum())
        den[key] = c.numel() * pairs
    return Ratio(num, den)


def unanimity(counts: Any, n_clients: int) -> Ratio:
    """Fraction of weights all ``n_clients`` masks agree on (count 0 or ``n_clients``)."""
    num, den = {}, {}
    for key, c in _counts_dict(counts).items():
        c = _check_counts(c, n_clients, key)
        num[key] = int(((c == 0) | (c == n_clients)).sum())
        den[key] = c.numel()
    return Ratio(num, den)


def mean_pairwise_jaccard(masks: Sequence[Any]) -> LayerValues:
    """Mean over pairs of the Jaccard index of the pruned sets, per layer and overall."""
    stacked = _stack(masks)
    m = len(masks)
    pairs = list(combinations(range(m), 2))
    inter = {p: 0 for p in pairs}
    union = {p: 0 for p in pairs}
    per_layer = {}
    for key, ts in stacked.items():
        total = 0.0
        for p in pairs:
            a, b = ts[p[0]], ts[p[1]]
            i = int(torch.count_nonzero(a & b))
            u = int(torch.count_nonzero(a | b))
            inter[p] += i
            union[p] += u
            total += i / u if u else 1.0
        per_layer[key] = total / len(pairs)
    overall = sum(inter[p] / union[p] if union[p] else 1.0 for p in pairs) / len(pairs)
    return LayerValues(per_layer, overall)


# ------------------------------------------------------------------------------------------
# Entropy
# ------------------------------------------------------------------------------------------

def binary_entropy(p: float) -> float:
    """``H(p)`` in bits; ``H(0) = H(1) = 0``."""
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"probability {p} outside [0, 1]")
    if p in (0.0, 1.0):
        return 0.0
    return -p * math.log2(p) - (1.0 - p) * math.log2(1.0 - p)


def mask_entropy(masks: Any) -> LayerValues:
    """Bits per weight of each layer's mask, ``H(fraction pruned)``; overall = total bits of the
    per-layer codes over all weights."""
    per_layer, bits, total = {}, 0.0, 0
    for key, mask in flatten_masks(masks).items():
        mask = _check_bool(mask, key)
        n = mask.numel()
        h = binary_entropy(int(torch.count_nonzero(mask)) / n) if n else 0.0
        per_layer[key] = h
        bits += h * n
        total += n
    return LayerValues(per_layer, bits / total if total else 0.0)


def joint_counts(x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """``[2, 2]`` int64 table: ``t[i, j]`` = positions with ``x == i`` and ``y == j``."""
    x, y = _check_bool(x, "x"), _check_bool(y, "y")
    if x.shape != y.shape:
        raise ValueError(f"shapes {tuple(x.shape)} and {tuple(y.shape)} differ")
    n = x.numel()
    n11 = int(torch.count_nonzero(x & y))
    n1_ = int(torch.count_nonzero(x))
    n_1 = int(torch.count_nonzero(y))
    return np.array([[n - n1_ - n_1 + n11, n_1 - n11], [n1_ - n11, n11]], dtype=np.int64)


def _conditional_entropy_of_table(t: np.ndarray) -> float:
    """``H(X | Y)`` in bits per position from a ``[2, 2]`` joint count table (x rows, y cols)."""
    n = int(t.sum())
    if n == 0:
        return 0.0
    h = 0.0
    for j in range(2):
        ny = int(t[:, j].sum())
        if ny:
            h += ny / n * binary_entropy(int(t[1, j]) / ny)
    return h


def conditional_entropy(x: Any, y: Any) -> LayerValues:
    """Empirical ``H(X | Y)`` in bits per weight (X, Y masks or mask collections)."""
    per_layer = {}
    pooled = np.zeros((2, 2), dtype=np.int64)
    for key, a, b in _paired(x, y):
        t = joint_counts(a, b)
        per_layer[key] = _conditional_entropy_of_table(t)
        pooled += t
    return LayerValues(per_layer, _conditional_entropy_of_table(pooled))


# ------------------------------------------------------------------------------------------
# Vote histograms
# ------------------------------------------------------------------------------------------

def vote_histogram(counts: Any, n_clients: int) -> VoteHistogram:
    """Histogram of vote counts ``0..n_clients`` per layer and overall (int64)."""
    if not isinstance(n_clients, int) or n_clients < 1:
        raise ValueError(f"number of clients {n_clients!r} must be a positive integer")
    per_layer = {}
    overall = np.zeros(n_clients + 1, dtype=np.int64)
    for key, c in _counts_dict(counts).items():
        c = _check_counts(c, n_clients, key)
        hist = torch.bincount(c.reshape(-1), minlength=n_clients + 1).numpy().astype(np.int64)
        per_layer[key] = hist
        overall += hist
    return VoteHistogram(n_clients, per_layer, overall)
