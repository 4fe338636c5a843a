"""How much a shared prune mask reveals about a client's calibration data (FedPrLLM App. C).

Pure functions (no model, no Flower); ``simulations/leakage.py`` runs the experiments with them.

Experiment design (``simulations/leakage.py``; every random choice seeded)
--------------------------------------------------------------------------
The calibration stream (e.g. ``wiki`` train, tokenized once) is cut into consecutive,
non-overlapping chunks of ``seqlen`` tokens; :func:`make_plan` draws distinct chunks (so no two
windows share a token position) for the roles below. ``W`` windows per client (4), ``C``
clients, client ``i``'s data ``D_i``, its *target* window ``t_i = D_i[W-1]`` (the last one),
``M(S)`` the local mask (e.g. Wanda 50%, row group) computed from the windows ``S`` in that order.

(a) Information: bits of a mask vs bits of the weights (:func:`mask_information`): 1 bit per
    weight packed; ``numel * H(s)`` (entropy-coded i.i.d. bits at sparsity ``s``); the exact
    count of masks a comparison group allows (:func:`selection_bits`, e.g. ``rows * log2
    C(cols, k)`` for row-wise); dense weights at 16 and 32 bits, and the empirical entropy of the
    float16 values (:func:`value_entropy`, the paper's "13.75 bits"). Conditional entropies
    (:func:`fedcompress.masks.stats.conditional_entropy`) estimate the bits per weight of a
    client mask *not* already fixed by something else: given the data-free magnitude mask, given
    another client's mask. The client's data is at most ``W * seqlen * log2(vocab)`` bits: a
    deterministic function of the data (the mask) cannot carry more about it.
(b) Hamming distances (:func:`fedcompress.masks.stats.hamming`) between masks from the same
    windows (repeat: should be 0, determinism; and the same windows in reverse order), from
    windows overlapping in ``W-1`` and ``W/2`` windows, and from disjoint windows (all client
    pairs).
(c) Sensitivity: ``d(M(D_i), M(D_i[:W-1] + [o]))`` for fresh windows ``o``: one window of
    ``W`` replaced; "other->other" ``d(M(D_i[:W-1] + [o1]), M(D_i[:W-1] + [o2]))``; and with vs
    without the target, ``d(M(D_i), M(D_i[:W-1]))`` (the paper's "MIA signal strength").
(d) Membership of ``t_i`` in client ``i``'s data, from its shared mask ``M_i = M(D_i)``:

    * *knows-the-rest* attacker (the DP neighbouring-dataset setting: it knows ``D_i[:W-1]``
      and tests a candidate ``c``): score ``-d(M(D_i[:W-1] + [c]), M_i)``
      (:func:`closeness_scores`); the member scores exactly 0 when masks are deterministic;
      non-members are the fresh windows of (c).
    * *reference* attacker (knows only public windows ``R``, ``W-1`` of them, disjoint from all
      clients): score of ``c`` = how much adding ``c`` to ``R`` moves the mask toward ``M_i``,
      ``d(M(R), M_i) - d(M(R + [c]), M_i)`` (:func:`approach_scores`). Candidates: every
      client's target (the member for its own client, a non-member for the others) and fresh
      non-member windows.

    :func:`membership_auc` reports the ROC AUC of the scores (member vs non-member, ties count
    1/2), within each client (pairs of the same client) and pooled, and the top-1 rate (the
    member has the highest score of its client's candidates; ties share the credit).

Distances and scores are summarised by :func:`summary` (n, mean, sample std, min, max).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from fedcompress.masks.stats import binary_entropy, hamming_distance

__all__ = [
    "LeakagePlan",
    "approach_scores",
    "auc",
    "closeness_scores",
    "disjoint_windows",
    "log2_binomial",
    "make_plan",
    "mask_information",
    "membership_auc",
    "selection_bits",
    "summary",
    "value_entropy",
]


# ------------------------------------------------------------------------------------------
# (a) information
# ------------------------------------------------------------------------------------------

def log2_binomial(n: int, k: int) -> float:
    """``log2 C(n, k)`` (via ``lgamma``; exact to float precision)."""
    if not 0 <= k <= n:
        raise ValueError(f"C({n}, {k}) is not defined")
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def selection_bits(shape: Sequence[int], sparsity: float, group: str = "row") -> float:
    """``log2`` of the number of masks of ``shape`` that a comparison group allows at
    ``sparsity`` (``k = floor(sparsity * group size)`` pruned per group, as
    :func:`fedcompress.solver.select.select_prune_mask` prunes)."""
    rows, cols = (int(v) for v in shape)
    if group == "layer":
        n = rows * cols
        return log2_binomial(n, int(sparsity * n))
    if group == "row":
        return rows * log2_binomial(cols, int(sparsity * cols))
    if group == "column":
        return cols * log2_binomial(rows, int(sparsity * rows))
    raise ValueError(f"unknown comparison group {group!r}")


def value_entropy(values: torch.Tensor | Iterable[torch.Tensor]) -> float:
    """Entropy (bits per element) of the empirical distribution of the exact values.

    For float16 (or bfloat16) tensors the 16-bit patterns are counted with a 65536-bin
    histogram (any number of tensors, pooled); other dtypes use ``torch.unique``.
    """
    tensors = [values] if isinstance(values, torch.Tensor) else list(values)
    if not tensors:
        raise ValueError("no values")
    if all(t.dtype in (torch.float16, torch.bfloat16) for t in tensors):
        hist = torch.zeros(65536, dtype=torch.int64)
        for t in tensors:
            bits = t.detach().cpu().contiguous().view(torch.int16).reshape(-1).to(torch.int64)
            hist += torch.bincount(bits & 0xFFFF, minlength=65536)
        counts = hist[hist > 0]
    else:
        flat = torch.cat([t.detach().cpu().reshape(-1) for t in tensors])
        counts = torch.unique(flat, return_counts=True)[1]
    p = counts.to(torch.float64) / counts.sum()
    return float(-(p * torch.log2(p)).sum())


def mask_information(shapes: Mapping[str, Sequence[int]], sparsity: float, group: str = "row",
                     weight_bits: Sequence[int] = (16, 32)) -> dict:
    """Bits of one client's masks for linear layers of ``shapes`` vs bits of the dense weights.

    Returns numbers of weights and bits (floats): ``packed_bits`` (1 bit/weight, padded to
    bytes per layer), ``entropy_bits`` (``numel * H(k/group size)``), ``selection_bits``
    (exact count of allowed masks) and ``dense_bits_<b>`` for each ``weight_bits``.
    """
    numel = packed = 0
    entropy = select = 0.0
    for shape in shapes.values():
        rows, cols = (int(v) for v in shape)
        n = rows * cols
        numel += n
        packed += 8 * ((n + 7) // 8)
        if group == "row":
            s = int(sparsity * cols) / cols
        elif group == "column":
            s = int(sparsity * rows) / rows
        else:
            s = int(sparsity * n) / n
        entropy += n * binary_entropy(s)
        select += selection_bits((rows, cols), sparsity, group)
    out = {"layers": len(shapes), "weights": numel, "packed_bits": float(packed),
           "entropy_bits": entropy, "selection_bits": select}
    for b in weight_bits:
        out[f"dense_bits_{b}"] = float(numel * b)
    return out


# ------------------------------------------------------------------------------------------
# windows and the experiment plan
# ------------------------------------------------------------------------------------------

def disjoint_windows(tokens: torch.Tensor, seqlen: int, chunks: Sequence[int]) -> torch.Tensor:
    """Windows ``tokens[k*seqlen:(k+1)*seqlen]`` for each chunk index ``k``: ``[n, seqlen]``.

    Distinct chunk indices never share a token position."""
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    available = tokens.numel() // seqlen
    bad = [k for k in chunks if not 0 <= k < available]
    if bad:
        raise ValueError(f"chunk indices {bad[:3]} outside [0, {available})")
    index = torch.as_tensor(list(chunks), dtype=torch.long).unsqueeze(1) * seqlen + torch.arange(
        seqlen)
    return tokens.to(torch.long)[index]


@dataclass(frozen=True)
class LeakagePlan:
    """Chunk indices for every role of the experiments (all distinct)."""

    clients: list[list[int]]          # D_i, W chunks each; the target is the last
    replacements: list[list[int]]     # fresh windows o_{i,r} replacing client i's target
    half_overlap: list[list[int]]     # fresh windows completing D_i[:W//2] (first H clients)
    reference: list[int]              # the reference attacker's public windows (W - 1)
    nonmembers: list[int]             # fresh candidate windows of the reference attacker

    @property
    def targets(self) -> list[int]:
        return [d[-1] for d in self.clients]

    def all_chunks(self) -> list[int]:
        out = [c for d in self.clients for c in d]
        out += [c for r in self.replacements for c in r]
        out += [c for h in self.half_overlap for c in h]
        return out + list(self.reference) + list(self.nonmembers)

    def to_dict(self) -> dict:
        return asdict(self)


def make_plan(available: int, clients: int = 8, per_client: int = 4, replacements: int = 2,
              half_overlap: int = 4, nonmembers: int = 12, seed: int = 0) -> LeakagePlan:
    """Draw distinct chunk indices from ``range(available)`` with
    ``numpy.random.default_rng(seed)`` for every role (see the module docstring)."""
    if clients < 2 or per_client < 2:
        raise ValueError("need at least 2 clients with at least 2 windows each")
    if half_overlap > clients:
        raise ValueError(f"half_overlap {half_overlap} > clients {clients}")
    if min(replacements, half_overlap, nonmembers) < 0:
        raise ValueError("counts must be >= 0")
    fresh_half = per_client - per_client // 2
    need = (clients * per_client + clients * replacements + half_overlap * fresh_half
            + (per_client - 1) + nonmembers)
    if need > available:
        raise ValueError(f"the plan needs {need} disjoint windows, the stream has {available}")
    drawn = [int(v) for v in np.random.default_rng(seed).choice(available, need, replace=False)]
    it = iter(drawn)

    def take(n: int) -> list[int]:
        return [next(it) for _ in range(n)]

    return LeakagePlan(
        clients=[take(per_client) for _ in range(clients)],
        replacements=[take(replacements) for _ in range(clients)],
        half_overlap=[take(fresh_half) for _ in range(half_overlap)],
        reference=take(per_client - 1),
        nonmembers=take(nonmembers),
    )


# ------------------------------------------------------------------------------------------
# scores, AUC, summaries
# ------------------------------------------------------------------------------------------

def closeness_scores(client_mask: Any, candidate_masks: Sequence[Any]) -> list[float]:
    """``-d(candidate, client)``: higher = closer to the client's mask."""
    return [-hamming_distance(c, client_mask) for c in candidate_masks]


def approach_scores(client_mask: Any, reference_mask: Any,
                    candidate_masks: Sequence[Any]) -> list[float]:
    """``d(reference, client) - d(candidate, client)``: how much a candidate window, added to
    the reference windows, moves the reference mask toward the client's mask."""
    base = hamming_distance(reference_mask, client_mask)
    return [base - hamming_distance(c, client_mask) for c in candidate_masks]


def auc(positives: Sequence[float], negatives: Sequence[float]) -> float:
    """ROC AUC = P(positive score > negative score) + P(equal) / 2 over all pairs."""
    pos = np.asarray(positives, dtype=np.float64)
    neg = np.sort(np.asarray(negatives, dtype=np.float64))
    if pos.size == 0 or neg.size == 0:
        raise ValueError("AUC needs at least one positive and one negative score")
    below = np.searchsorted(neg, pos, side="left")
    below_or_equal = np.searchsorted(neg, pos, side="right")
    wins = below.sum() + 0.5 * (below_or_equal - below).sum()
    return float(wins / (pos.size * neg.size))


def membership_auc(scores: Sequence[Sequence[float]], members: Sequence[Sequence[bool]]) -> dict:
    """Membership test quality from per-client candidate scores.

    ``scores[i][j]``: score of candidate ``j`` against client ``i``'s mask; ``members[i][j]``:
    whether candidate ``j`` is in client ``i``'s data. Returns ``auc_within`` (pairs of a
    member and a non-member of the same client), ``auc_pooled`` (all member/non-member pairs),
    ``top1`` (mean over clients with a member of the fraction of its top-scored candidates that
    are members: ties share the credit), and the counts.
    """
    if len(scores) != len(members):
        raise ValueError("scores and members have different numbers of clients")
    wins = pairs = 0.0
    pos_all: list[float] = []
    neg_all: list[float] = []
    top1 = []
    for i, (s, m) in enumerate(zip(scores, members)):
        if len(s) != len(m):
            raise ValueError(f"client {i}: {len(s)} scores for {len(m)} membership flags")
        pos = [v for v, flag in zip(s, m) if flag]
        neg = [v for v, flag in zip(s, m) if not flag]
        pos_all += pos
        neg_all += neg
        if pos and neg:
            wins += auc(pos, neg) * len(pos) * len(neg)
            pairs += len(pos) * len(neg)
        if pos:
            best = max(s)
            top = [flag for v, flag in zip(s, m) if v == best]
            top1.append(sum(top) / len(top))
    return {
        "auc_within": wins / pairs if pairs else float("nan"),
        "auc_pooled": auc(pos_all, neg_all) if pos_all and neg_all else float("nan"),
        "top1": float(np.mean(top1)) if top1 else float("nan"),
        "members": len(pos_all),
        "nonmembers": len(neg_all),
        "chance_top1": (float(np.mean([sum(m) / len(m) for m in members if len(m)]))
                        if members else float("nan")),
    }


def summary(values: Sequence[float]) -> dict:
    """``n``, ``mean``, ``std`` (sample, ddof=1; 0 for one value), ``min``, ``max``."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {"n": 0, "mean": float("nan"), "std": float("nan"), "min": float("nan"),
                "max": float("nan")}
    return {"n": int(v.size), "mean": float(v.mean()),
            "std": float(v.std(ddof=1)) if v.size > 1 else 0.0,
            "min": float(v.min()), "max": float(v.max())}
