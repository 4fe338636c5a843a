"""FedSpaLLM (Bai et al., NAACL 2025): federated pruning where the sites send their pruned
layers' WEIGHTS, the server averages each weight over the sites that kept it (l0-norm
aggregation), then expands the global mask to the exact target sparsity; each site prunes only
the decoder layers its resources allow (layer sampling). Plain torch/numpy, no Flower.

What the paper states (abstract and Figure 1; its method section was not readable where this
was written, so every choice below that the abstract leaves open is named as such):

* **Sites** (:func:`site_release`): each runs SparseGPT on its own windows over the layers
  assigned to it and keeps every other layer dense (the cached pre-trained model); it sends, per
  linear layer of its assigned layers, its prune mask and the values of the weights it kept
  (SparseGPT's updated weights): weights, not masks alone (:meth:`SiteRelease.nbytes`).
* **l0-norm aggregation** (:func:`l0_average`): each weight is the mean of the values the sites
  that KEPT it sent; a weight no site kept is 0.
* **Adaptive mask expansion** (:func:`aggregate_layer`): the l0 average keeps every weight any
  site kept, so the average alone is denser than the target. The global mask prunes, within the
  comparison group, the weights the most sites pruned (a weight every site pruned first), and
  among equal counts the smallest averaged magnitude, until the group reaches the target
  exactly; the FedPrLLM paper describes this step as pruning "based on an aggregated mask
  matrix". The count order is the open reading of "mask expansion" (a third-party
  reimplementation reads it the same way); the magnitude tie-break is this module's choice.
* **Layer sampling** (:func:`assign_layers`): the server gives each site as many decoder layers
  as its resources allow: every layer first goes to some site (one shuffled order, dealt in
  turn), then each site's budget is filled uniformly at random (the paper's sampling
  distribution was not readable: this is this module's choice, and it refuses budgets that
  leave a layer unassigned).
* One round (one-shot).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedcompress.masks.aggregate import count_dtype, global_mask
from fedcompress.masks.codec import (
    MaskDecodeError,
    check_packed,
    decode_mask,
    encode_mask,
    mask_key,
)
from fedcompress.models import ModelAdapter, weight_matrix
from fedcompress.pruning.allocation import SparsityPlan
from fedcompress.pruning.local import PruneConfig, local_masks

#: Bytes a site sends per kept weight (float32 values) and per weight of its mask (one bit).
VALUE_BYTES = 4


def assign_layers(n_layers: int, budgets: Sequence[int], seed: int) -> list[list[int]]:
    """Each site's decoder layers: site ``i`` gets ``budgets[i]`` distinct layers (what its
    resources allow). First every layer, in one uniformly shuffled order, goes to a site in
    turn (skipping the sites whose budget is full), so that every layer is pruned by at least
    one site; then each site fills the rest of its budget with layers drawn uniformly from the
    ones it does not have. Seeded: the server's public choice. Refuses a budget outside
    ``1..n_layers`` or budgets that add up to fewer than ``n_layers`` (a layer no site prunes
    would stay dense)."""
    if n_layers < 1:
        raise ValueError(f"{n_layers} decoder layers: expected at least 1")
    budgets = [int(b) for b in budgets]
    if not budgets:
        raise ValueError("no site to assign layers to")
    bad = [b for b in budgets if not 1 <= b <= n_layers]
    if bad:
        raise ValueError(f"layer budgets {bad}: expected each in 1..{n_layers}")
    if sum(budgets) < n_layers:
        raise ValueError(f"layer budgets {budgets} add up to {sum(budgets)} < {n_layers} "
                         "layers: a layer no site prunes would stay dense")
    rng = np.random.default_rng(seed)
    sets: list[set[int]] = [set() for _ in budgets]
    site = 0
    for layer in rng.permutation(n_layers):
        while len(sets[site]) == budgets[site]:
            site = (site + 1) % len(budgets)
        sets[site].add(int(layer))
        site = (site + 1) % len(budgets)
    for own, budget in zip(sets, budgets):
        rest = [i for i in range(n_layers) if i not in own]
        own.update(int(i) for i in rng.choice(rest, size=budget - len(own), replace=False))
    return [sorted(own) for own in sets]


@dataclass
class SiteRelease:
    """What one site sends: per assigned decoder layer, per linear layer, its prune mask (bool,
    True = pruned) and the values of the weights it kept (float32, in row-major order of the
    kept positions)."""

    layers: list[int]
    masks: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    values: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes on the wire: one bit per weight of each mask, :data:`VALUE_BYTES` per kept
        value."""
        return sum(-(-m.numel() // 8) + VALUE_BYTES * v.numel()
                   for layer in self.masks for m, v in zip(self.masks[layer].values(),
                                                            self.values[layer].values()))


def site_release(model: nn.Module, windows: torch.Tensor, layers: Sequence[int],
                 sparsity: float, group: str = "row", batch_size: int = 8,
                 onload: bool = False) -> SiteRelease:
    """A site's release: SparseGPT at ``sparsity`` (local comparison ``group``) on its
    ``windows`` over its assigned ``layers``, every other layer dense (ratio 0: its weights
    unchanged), in one sequential pass (the assigned layers' inputs come through the layers
    before them as the site holds them); ``onload``: one decoder layer in memory at a time
    (:func:`~fedcompress.pruning.local.local_masks`)."""
    n_layers = len(ModelAdapter(model))
    assigned = sorted(set(int(i) for i in layers))
    if not assigned or assigned[0] < 0 or assigned[-1] >= n_layers:
        raise ValueError(f"assigned layers {list(layers)}: expected some of 0..{n_layers - 1}")
    ratios = [sparsity if i in assigned else 0.0 for i in range(n_layers)]
    plan = SparsityPlan(sparsity, tuple(ratios))
    config = PruneConfig("sparsegpt", sparsity, group, layer_sparsity=plan.to_text(),
                         onload=onload)
    result = local_masks(model, windows, config, batch_size=batch_size, keep_weights=True)
    release = SiteRelease(assigned)
    for i in assigned:
        weights = result.weights[i]
        assert weights is not None
        release.masks[i] = {n: m.clone() for n, m in result.masks[i].items()}
        release.values[i] = {n: weights[n].detach().float()[~m].clone()
                             for n, m in result.masks[i].items()}
    return release


#: Wire-key suffixes of a site's release: each linear layer's packed mask and kept values.
MASK_SUFFIX, VALUES_SUFFIX = ".mask", ".values"


def encode_release(release: SiteRelease) -> dict[str, np.ndarray]:
    """A site's release as Flower arrays: per linear layer of its assigned layers,
    ``layers.L.NAME.mask`` (bit-packed, :func:`~fedcompress.masks.codec.encode_mask`) and
    ``layers.L.NAME.values`` (float32, its kept weights in row-major order)."""
    out: dict[str, np.ndarray] = {}
    for layer in release.layers:
        for name, mask in release.masks[layer].items():
            key = mask_key(layer, name)
            out[key + MASK_SUFFIX] = encode_mask(mask)
            out[key + VALUES_SUFFIX] = (release.values[layer][name].detach().cpu()
                                        .to(torch.float32).numpy())
    return out


def decode_release(payload: dict[str, np.ndarray], layers: Sequence[int],
                   shapes: dict[str, tuple[int, ...]]) -> SiteRelease:
    """A site's release from its arrays, checked against the layers it was asked to prune and
    the model's shapes (``shapes``: wire key -> ``[out, in]``, every layer's): exactly the
    assigned layers' keys, valid packed masks, as many finite float32 values as kept weights;
    :class:`~fedcompress.masks.codec.MaskDecodeError` naming the first problem."""
    assigned = sorted(set(int(i) for i in layers))
    wanted = {k for k in shapes if int(k.split(".")[1]) in assigned}
    expected = {k + suffix for k in wanted for suffix in (MASK_SUFFIX, VALUES_SUFFIX)}
    missing, extra = sorted(expected - set(payload)), sorted(set(payload) - expected)
    if missing or extra:
        raise MaskDecodeError(f"release keys do not match the assigned layers {assigned}: "
                              f"missing {missing[:3]}, unexpected {extra[:3]}")
    release = SiteRelease(assigned)
    for key in sorted(wanted):
        layer, name = int(key.split(".")[1]), key.split(".", 2)[2]
        packed, values = payload[key + MASK_SUFFIX], payload[key + VALUES_SUFFIX]
        pruned = check_packed(packed, shapes[key], key)
        kept = int(np.prod(shapes[key])) - pruned
        if not isinstance(values, np.ndarray) or values.dtype != np.float32 \
                or values.ndim != 1 or values.size != kept:
            got = (f"{values.dtype} {values.shape}" if isinstance(values, np.ndarray)
                   else type(values).__name__)
            raise MaskDecodeError(f"{key}: values {got}: expected {kept} float32 values (one "
                                  "per kept weight)")
        if not np.isfinite(values).all():
            raise MaskDecodeError(f"{key}: values that are not finite")
        release.masks.setdefault(layer, {})[name] = decode_mask(packed, shapes[key], key)
        release.values.setdefault(layer, {})[name] = torch.from_numpy(values.copy())
    return release


def aggregate_releases(model: nn.Module, releases: Iterable[SiteRelease], sparsity: float,
                       group: str = "layer"
                       ) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """The server's step over the sites' releases, in their order: their :class:`L0Sum`, then
    per decoder layer and linear layer the mask expansion (:meth:`L0Sum.aggregate`)."""
    total = L0Sum(model)
    for release in releases:
        total.add(release)
    return total.aggregate(sparsity, group)


def _check_site(mask: torch.Tensor, values: torch.Tensor, shape: tuple[int, ...],
                site: object) -> None:
    if tuple(mask.shape) != tuple(shape) or mask.dtype != torch.bool:
        raise ValueError(f"site {site}: mask {tuple(mask.shape)} {mask.dtype}, expected bool "
                         f"{tuple(shape)}")
    kept = int((~mask).sum())
    if values.dim() != 1 or values.numel() != kept:
        raise ValueError(f"site {site}: {values.numel()} values for {kept} kept weights")
    if not torch.isfinite(values).all():
        raise ValueError(f"site {site}: values that are not finite")


def _add_site(total: torch.Tensor, keepers: torch.Tensor, mask: torch.Tensor,
              values: torch.Tensor) -> None:
    """One site's kept values into a matrix's float64 ``total`` and its ``keepers`` count."""
    kept = ~mask
    total[kept] += values.to(torch.float64)
    keepers += kept


def _average(total: torch.Tensor, keepers: torch.Tensor) -> torch.Tensor:
    return torch.where(keepers > 0, total / keepers.clamp(min=1), 0.0).to(torch.float32)


def _expand(average: torch.Tensor, keepers: torch.Tensor, sites: int, sparsity: float,
            group: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask expansion of one matrix held by ``sites`` sites (see :func:`aggregate_layer`)."""
    pruners = (sites - keepers.to(torch.int64)).to(count_dtype(sites))
    mask = global_mask(pruners, sparsity, group, "magnitude", average)
    kept_unheld = int(((keepers == 0) & ~mask).sum())
    if kept_unheld:
        raise ValueError(f"{kept_unheld} weights kept that no site kept: the sites pruned more "
                         f"than the target {sparsity} in a {group} group")
    return mask, average.masked_fill(mask, 0.0)


def l0_average(masks: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The l0-norm aggregation of one weight matrix: ``(average, keepers)``, where ``keepers``
    counts the sites that kept each weight and ``average`` is the mean of their values (float64
    sums, returned float32), 0 where no site kept it. ``masks``: each site's prune mask (True =
    pruned); ``values``: its kept values in row-major order of its kept positions."""
    if not masks or len(masks) != len(values):
        raise ValueError(f"{len(masks)} masks and {len(values)} value vectors: expected one of "
                         "each per site, at least one site")
    shape = tuple(masks[0].shape)
    total = torch.zeros(shape, dtype=torch.float64)
    keepers = torch.zeros(shape, dtype=torch.int64)
    for i, (mask, vals) in enumerate(zip(masks, values)):
        _check_site(mask, vals, shape, i)
        _add_site(total, keepers, mask, vals)
    return _average(total, keepers), keepers


def aggregate_layer(masks: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                    sparsity: float, group: str = "layer") -> tuple[torch.Tensor, torch.Tensor]:
    """One weight matrix's global ``(mask, weight)``: the l0 average (:func:`l0_average`), then
    the mask expansion: within each comparison ``group``, the target share of the weights with
    the most sites that pruned them (ties: the smallest averaged ``|W|``, then the index), the
    kept ones at their average."""
    average, keepers = l0_average(masks, values)
    return _expand(average, keepers, len(masks), sparsity, group)


#: The count dtype of :class:`L0Sum` (sites that kept a weight): at most this many releases.
KEEPER_DTYPE = torch.int16


class L0Sum:
    """The server's l0-norm aggregation, one release at a time: per decoder layer and linear
    layer, the float64 sum of the values the sites kept and how many kept each weight
    (:data:`KEEPER_DTYPE`), and how many releases hold the layer. A release need not stay in
    memory once added: for Qwen2.5-0.5B one is about 1.1 GB (a byte per mask entry, float32
    kept values) and the sum about 3.6 GB, whatever the number of sites (ten bytes per linear
    weight: about 13 GB for Qwen2.5-1.5B).

    ``spill``: a directory to hold the sums in instead of memory: each layer's arrays are
    memory-mapped files created there on its first release and unlinked at once, so the page
    cache holds what fits, the disk the rest, and nothing is left behind however the process
    ends (POSIX; the space is freed when the sum is). The sums are the same bit for bit either
    way. Adding the releases in one order gives :func:`l0_average`'s sums bit for bit;
    :meth:`aggregate` and :meth:`layers` can be called for several comparison groups."""

    def __init__(self, model: nn.Module, spill: str | os.PathLike | None = None) -> None:
        adapter = ModelAdapter(model)
        self.shapes = [{name: tuple(weight_matrix(m).shape)
                        for name, m in ModelAdapter.linear_layers(layer).items()}
                       for layer in adapter.layers]
        self.dtypes = [{name: weight_matrix(m).dtype
                        for name, m in ModelAdapter.linear_layers(layer).items()}
                       for layer in adapter.layers]
        if spill is not None and not Path(spill).is_dir():
            raise ValueError(f"spill directory {str(spill)!r}: expected an existing directory")
        self.spill = None if spill is None else Path(spill)
        self.holders = [0] * len(self.shapes)
        self.releases = 0  # added so far
        self.totals: dict[int, dict[str, torch.Tensor]] = {}
        self.keepers: dict[int, dict[str, torch.Tensor]] = {}

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero array of the sum: in memory, or a memory-mapped file under :attr:`spill`,
        unlinked as soon as it is mapped (a fresh sparse file reads as zeros)."""
        if self.spill is None:
            return torch.zeros(shape, dtype=dtype)
        fd, path = tempfile.mkstemp(prefix="l0sum-", dir=self.spill)
        try:
            os.close(fd)
            array = np.memmap(path, dtype=torch.empty(0, dtype=dtype).numpy().dtype,
                              mode="w+", shape=shape)
        finally:
            os.unlink(path)
        return torch.from_numpy(array)

    def add(self, release: SiteRelease) -> None:
        """Add one site's release, checked whole first (its layers and linear layers exactly
        the model's, each mask bool of the matrix's shape, one finite value per kept weight):
        a ValueError naming the problem leaves the sum unchanged."""
        site = f"release {self.releases}"
        bad = [i for i in release.masks if not 0 <= i < len(self.shapes)]
        if bad or set(release.masks) != set(release.values):
            raise ValueError(f"{site}: layers {sorted(release.masks)} (values for "
                             f"{sorted(release.values)}): expected the same layers, each in "
                             f"0..{len(self.shapes) - 1}")
        for i in release.masks:
            if set(release.masks[i]) != set(self.shapes[i]) \
                    or set(release.values[i]) != set(self.shapes[i]):
                raise ValueError(f"{site}: layer {i} holds {sorted(release.masks[i])}: "
                                 f"expected the linear layers {sorted(self.shapes[i])}")
            for name, shape in self.shapes[i].items():
                _check_site(release.masks[i][name], release.values[i][name], shape,
                            f"{site}, layer {i} {name}")
        full = [i for i in release.masks if self.holders[i] == torch.iinfo(KEEPER_DTYPE).max]
        if full:
            raise ValueError(f"layers {full} already hold {torch.iinfo(KEEPER_DTYPE).max} "
                             "releases: the most an L0Sum counts")
        for i in sorted(release.masks):
            if i not in self.totals:
                self.totals[i] = {n: self._zeros(s, torch.float64)
                                  for n, s in self.shapes[i].items()}
                self.keepers[i] = {n: self._zeros(s, KEEPER_DTYPE)
                                   for n, s in self.shapes[i].items()}
            for name in self.shapes[i]:
                _add_site(self.totals[i][name], self.keepers[i][name],
                          release.masks[i][name], release.values[i][name])
            self.holders[i] += 1
        self.releases += 1

    def layers(self, sparsity: float, group: str = "layer"
               ) -> Iterator[tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
        """Per decoder layer in order, ``(index, masks, weights)``: each linear layer's global
        mask and weight (in the model's dtype), the l0 average of the releases that hold it and
        its mask expansion (:func:`aggregate_layer`), one decoder layer in memory at a time;
        ValueError naming the layers no release holds (they would stay dense), before any."""
        unheld = [i for i, n in enumerate(self.holders) if n == 0]
        if unheld:
            raise ValueError(f"decoder layers {unheld} are in no valid site's release: "
                             "expected every layer pruned by at least one site")
        for i, shapes in enumerate(self.shapes):
            layer_masks, layer_weights = {}, {}
            for name in shapes:
                keepers = self.keepers[i][name]
                mask, weight = _expand(_average(self.totals[i][name], keepers), keepers,
                                       self.holders[i], sparsity, group)
                layer_masks[name] = mask
                layer_weights[name] = weight.to(self.dtypes[i][name])
            yield i, layer_masks, layer_weights

    def aggregate(self, sparsity: float, group: str = "layer"
                  ) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
        """Every decoder layer's :meth:`layers` at once: ``(masks, weights)``, lists by
        decoder layer."""
        masks: list[dict[str, torch.Tensor]] = []
        weights: list[dict[str, torch.Tensor]] = []
        for _, layer_masks, layer_weights in self.layers(sparsity, group):
            masks.append(layer_masks)
            weights.append(layer_weights)
        return masks, weights


@dataclass
class FedSpaLLMRun:
    """A one-shot run: per decoder layer, the global masks and weights; each site's assigned
    layers and bytes sent."""

    masks: list[dict[str, torch.Tensor]]
    weights: list[dict[str, torch.Tensor]]
    assignment: list[list[int]]
    bytes_up_per_site: list[int]


@dataclass
class SiteRuns:
    """Every site's release in one process, summed as it came (:class:`L0Sum`, in site order):
    each site's layers, bytes sent and seconds."""

    assignment: list[list[int]]
    total: L0Sum
    bytes_up: list[int]
    seconds: list[float]


def run_sites(model: nn.Module, windows: Sequence[torch.Tensor], sparsity: float,
              budgets: Sequence[int] | None = None, local_group: str = "row", seed: int = 0,
              batch_size: int = 8, onload: bool = False,
              wrap: Callable[[Iterable], Iterable] | None = None,
              spill: str | os.PathLike | None = None) -> SiteRuns:
    """Every site's release in one process: the layer assignment (``budgets``: layers per
    site; default all), each site's :func:`site_release` on its ``windows`` added to one
    :class:`L0Sum` and dropped (one release in memory at a time), its bytes and seconds
    (``wrap``: e.g. a progress bar around the sites' windows; ``spill``: a directory to hold
    the sum in instead of memory, :class:`L0Sum`)."""
    n_layers = len(ModelAdapter(model))
    budgets = [n_layers] * len(windows) if budgets is None else list(budgets)
    if len(budgets) != len(windows):
        raise ValueError(f"{len(budgets)} layer budgets for {len(windows)} sites")
    assignment = assign_layers(n_layers, budgets, seed)
    runs = SiteRuns(assignment, L0Sum(model, spill), [], [])
    for w, layers in zip(wrap(windows) if wrap else windows, assignment):
        start = time.perf_counter()
        release = site_release(model, w, layers, sparsity, local_group, batch_size, onload)
        runs.seconds.append(time.perf_counter() - start)
        runs.bytes_up.append(release.nbytes())
        runs.total.add(release)
        del release
    return runs


def fedspallm_prune(model: nn.Module, windows: Sequence[torch.Tensor], sparsity: float,
                    budgets: Sequence[int] | None = None, local_group: str = "row",
                    group: str = "layer", seed: int = 0, batch_size: int = 8,
                    onload: bool = False, spill: str | os.PathLike | None = None
                    ) -> FedSpaLLMRun:
    """FedSpaLLM in one process (benchmarks): every site's release on its ``windows`` over
    its assigned layers (:func:`run_sites`), then the server's l0 average and mask
    expansion per linear layer (comparison ``group``). The model is not changed: apply the
    result with :func:`~fedcompress.pruning.local.apply_masks`."""
    runs = run_sites(model, windows, sparsity, budgets, local_group, seed, batch_size, onload,
                     spill=spill)
    masks, weights = runs.total.aggregate(sparsity, group)
    return FedSpaLLMRun(masks, weights, runs.assignment, runs.bytes_up)
