"""Robust mask voting against Byzantine sites: pure functions.

Two defences, usable together (:data:`DEFENCES`):

* **Outlier rejection** (``"hamming"``): each site's distance to the coordinate-wise majority
  mask (a weight is in the majority mask when MORE than half of the sites vote to prune it; an
  exact half does not count), as the fraction of all voted weights where the site's mask
  differs, counted on the bit-packed masks (XOR and popcount, never unpacked). A site is
  rejected when its distance exceeds ``median + z * max(1.4826 * MAD, floor)`` of all sites'
  distances (the median absolute deviation scaled to a standard deviation under normality;
  ``floor`` keeps a tight honest cluster from rejecting honest sites for tiny differences),
  and at most ``max_reject`` sites are rejected (the farthest first; ties: the lower index is
  kept). The distances are reported for every site. The majority is taken once, over all
  sites: a single pass, not an iterated re-centring.
* **Trimmed votes per weight** (``"trim"``): the ``b`` highest and ``b`` lowest of the ``m``
  votes of every weight are dropped. For 0/1 votes with ``c`` votes to prune this gives
  ``clamp(c - b, 0, m - 2b)``: a monotone map of ``c`` that only merges the most extreme
  counts, so a top-k selection changes only where it falls among those merged counts (broken
  by the server's tie-break, e.g. the smaller magnitude first). It bounds what ``b`` colluders
  add to one weight's count only when the honest sites already agree on it; it cannot undo
  targeted votes in the middle of the range. Reported as measured, kept because it is the
  textbook coordinate-wise defence.

Under secure aggregation only the sum of the masks is visible: neither per-site distances nor
per-weight order statistics exist, so neither defence applies (range proofs are out of scope).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedcompress.masks.aggregate import payload_words

DEFENCES = ("none", "trim", "hamming", "both")
#: Scales the median absolute deviation to a standard deviation (normal data).
MAD_SCALE = 1.4826
#: Default rejection threshold in robust standard deviations (Iglewicz and Hoaglin's 3.5).
DEFAULT_Z = 3.5
#: Default floor of the robust deviation, as a fraction of the weights (1%).
DEFAULT_FLOOR = 0.01


def check_defence(defence: str) -> str:
    if defence not in DEFENCES:
        raise ValueError(f"defence={defence!r} is invalid: expected one of {', '.join(DEFENCES)}")
    return defence


def trimmed_counts(counts: torch.Tensor, m: int, b: int) -> torch.Tensor:
    """Per-weight trimmed votes of ``m`` binary votes with ``counts`` votes to prune: the ``b``
    highest and ``b`` lowest votes dropped, i.e. ``clamp(c - b, 0, m - 2b)``."""
    if isinstance(b, bool) or not isinstance(b, int) or b < 0 or 2 * b >= m:
        raise ValueError(f"trim={b!r} votes per side of {m} sites: expected 0 <= trim < m/2")
    if b == 0:
        return counts
    wide = counts.to(torch.int32)
    return (wide - b).clamp_(0, m - 2 * b).to(counts.dtype)


def majority_words(counts: torch.Tensor, m: int) -> np.ndarray:
    """The majority mask (``2 * count > m``) of one layer, bit-packed as :func:`payload_words`
    (the sites' format, so it XORs with them word by word)."""
    bits = (counts.reshape(-1).to(torch.int32) * 2 > m).numpy()
    packed = np.packbits(bits)
    return payload_words(packed, packed.size)


def hamming_to_majority(words: Mapping[str, Sequence[np.ndarray]],
                        counts: Mapping[str, torch.Tensor], m: int) -> np.ndarray:
    """Each site's fraction of weights (over every layer in ``words``) where its mask differs
    from the majority mask. ``words[key][i]`` is site ``i``'s :func:`payload_words` of layer
    ``key``; ``counts[key]`` the layer's vote counts of those ``m`` sites. float64 ``[m]``
    (differing bits are counted exactly in int64 first)."""
    differ = np.zeros(m, dtype=np.int64)
    total = 0
    for key, sites in words.items():
        if len(sites) != m:
            raise ValueError(f"{key}: {len(sites)} masks, expected {m}")
        majority = majority_words(counts[key], m)
        for i, w in enumerate(sites):
            differ[i] += int(np.bitwise_count(np.bitwise_xor(w, majority)).sum(dtype=np.int64))
        total += counts[key].numel()
    if total == 0:
        raise ValueError("no weights to compare")
    return differ / total


@dataclass(frozen=True)
class Rejection:
    """Which sites outlier rejection keeps (``rejected`` are indices), and why."""

    distances: tuple[float, ...]
    threshold: float
    rejected: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"distances": list(self.distances), "threshold": self.threshold,
                "rejected": list(self.rejected)}


def reject_outliers(distances: Sequence[float], z: float = DEFAULT_Z,
                    floor: float = DEFAULT_FLOOR, max_reject: int | None = None) -> Rejection:
    """The sites whose distance exceeds ``median + z * max(MAD_SCALE * MAD, floor)`` (module
    docstring), at most ``max_reject`` (default: fewer than half of the sites), the farthest
    first (equal distances: the higher index goes first)."""
    d = np.asarray(distances, dtype=np.float64)
    if d.ndim != 1 or d.size == 0 or not np.all(np.isfinite(d)):
        raise ValueError(f"distances {list(distances)[:4]}: expected finite numbers, one per "
                         "site")
    if not (z > 0 and np.isfinite(z)) or not floor >= 0:
        raise ValueError(f"z={z!r}, floor={floor!r}: expected z > 0 and floor >= 0")
    limit = (d.size - 1) // 2 if max_reject is None else max_reject
    if limit < 0:
        raise ValueError(f"max_reject={max_reject!r}: expected >= 0")
    median = float(np.median(d))
    mad = float(np.median(np.abs(d - median)))
    threshold = median + z * max(MAD_SCALE * mad, floor)
    order = sorted(range(d.size), key=lambda i: (-d[i], -i))
    rejected = sorted(i for i in order[:limit] if d[i] > threshold)
    return Rejection(tuple(float(x) for x in d), threshold, tuple(rejected))
