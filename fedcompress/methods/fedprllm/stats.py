"""Statistics mode of federated pruning: the centralized result from summed statistics, no Flower.

Wanda's column norms and SparseGPT's Hessian are sums over tokens. In this mode each site sends,
for one decoder layer per round, the SUMS of its inputs' statistics
(:class:`~fedcompress.pruning.walker.LayerStats`: ``sum_t x_tj^2`` and ``sum_t 2 x_t x_t^T`` in
float64, the token count); the server adds them up, which gives the statistics of
the union of the sites' windows, and prunes the layer exactly as the centralized pass does
(:func:`~fedcompress.pruning.local.layer_prune_fn`: the same masks, SparseGPT's weight update
included). It broadcasts the layer's global masks (and SparseGPT's updated weights) with the
next round's request, and the sites forward their inputs through the pruned layer. After L
rounds the global model is the centralized model:

* Wanda: identical masks. The float64 sums of float32 squares agree with the centralized
  accumulation to about 1e-16 relative, far below float32's resolution, so the float32 norms
  and the masks are the same (``tests/test_stats_mode.py`` checks every mask bit).
* SparseGPT: each site's Hessian sum is float64 (as the centralized pass accumulates it,
  :data:`~fedcompress.models.common.HESSIAN_DTYPE`), and the server adds them in float64: the
  products of float32 inputs are exact, so the only difference from the centralized Hessian is
  float64 rounding of partial sums in another order (~1e-16 relative), which the float32 factor of
  the inverse almost never sees (measured: ``simulations/stats_mode.py``). With float32 sums it was
  1.8% of the mask bits on SmolLM2.

Wire (:func:`encode_stats`, :func:`decode_stats`): per linear layer ``in`` float64 square sums
and, for SparseGPT, the upper triangle of the Hessian sum (``in (in + 1) / 2`` float64: it is
symmetric); linear layers fed by the same tensor (q/k/v, gate/up) are sent once, the others
name it (``shared``). Every received statistic is validated (names, shapes, dtypes, finite,
non-negative squares, a positive token count, the Hessian's diagonal equal to twice the square
sums) before it counts.

The wire's keys, the layers' widths and shared inputs and SecAgg+'s fixed-point lanes
(:func:`encode_fixed`, :func:`decode_fixed`) are defined in
:mod:`fedcompress.methods.fedprllm.stats_wire`, which the mode's DP
(:mod:`fedcompress.methods.fedprllm.dp`) imports too; they are re-exported here.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
import torch
from torch import nn

from fedcompress.methods.fedprllm.config import FedPrLLMConfig

# the wire, a module of its own (dp.py imports it too); its public names re-exported here,
# where they were first defined
from fedcompress.methods.fedprllm.stats_wire import (  # noqa: F401 (this module's public names)
    FRAC_BITS,
    InvalidStatsError,
    decode_fixed,
    encode_fixed,
    fixed_point_layout,
    fixed_point_limit,
    fixed_point_range,
    layer_in_features,
    layer_sharing,
    stat_key,
    tokens_key,
    triu_indices,
)
from fedcompress.models import HESSIAN_DTYPE, ModelAdapter
from fedcompress.privacy.dp_stats import PublicCalibration
from fedcompress.privacy.ledger import Ledger
from fedcompress.privacy.policy import SitePolicy
from fedcompress.pruning.local import STATS_METHODS, PruneConfig
from fedcompress.pruning.walker import LayerStats
from fedcompress.quant.solver import QuantResult

logger = logging.getLogger(__name__)

#: Largest relative gap accepted between a Hessian's diagonal and twice the square sums (both
#: are sums of the same squares, in float64; SecAgg+'s fixed point adds at most n 2^-(f+1)).
DIAG_TOLERANCE = 1e-3


#: dtype of a site's Hessian sum on the wire (the upper triangle): HESSIAN_DTYPE's
_WIRE_HESSIAN = torch.empty(0, dtype=HESSIAN_DTYPE).numpy().dtype


@functools.lru_cache(maxsize=32)
def _triu_diagonal(n: int) -> np.ndarray:
    """Where the diagonal sits in the wire's upper triangle: entry ``(i, i)`` at
    ``i n - i (i - 1) / 2``."""
    i = np.arange(n, dtype=np.int64)
    return i * n - i * (i - 1) // 2


def _unpack_hessian(h: np.ndarray, n: int) -> torch.Tensor:
    """The symmetric ``n x n`` matrix whose upper triangle is ``h`` (the values copied, not
    recomputed: both triangles hold the same floats)."""
    full = torch.zeros(n, n, dtype=torch.from_numpy(h[:0]).dtype)
    rows, cols = triu_indices(n)
    values = torch.from_numpy(np.ascontiguousarray(h))
    full[rows, cols] = values
    full[cols, rows] = values
    return full


@dataclass
class PackedStats:
    """One linear layer's statistics as they travel: float64 square sums, the Hessian sum's
    upper triangle (row-major, or None) and the token count. Sums of these are sums of the
    matrices, entry by entry (the server adds sites' statistics in this form and unpacks the
    total once per layer: :class:`StatsAggregator`)."""

    in_features: int
    tokens: int
    sq_sum: np.ndarray
    hessian_upper: np.ndarray | None

    @classmethod
    def from_layer_stats(cls, st: LayerStats) -> PackedStats:
        h = None
        if st.hessian_sum is not None:
            rows, cols = triu_indices(st.in_features)
            h = st.hessian_sum[rows, cols].cpu().numpy()
        return cls(st.in_features, st.tokens, st.sq_sum.cpu().numpy().astype(np.float64), h)

    def unpack(self) -> LayerStats:
        st = LayerStats(self.in_features, hessian=self.hessian_upper is not None)
        st.sq_sum = torch.from_numpy(self.sq_sum.copy())
        st.tokens = self.tokens
        if self.hessian_upper is not None:
            st.hessian_sum = _unpack_hessian(self.hessian_upper, self.in_features)
        return st


def _same(a: LayerStats, b: LayerStats) -> bool:
    if a is b:
        return True
    if a.tokens != b.tokens or a.in_features != b.in_features:
        return False
    if not torch.equal(a.sq_sum, b.sq_sum):
        return False
    if a.hessian_sum is None or b.hessian_sum is None:
        return a.hessian_sum is None and b.hessian_sum is None
    return torch.equal(a.hessian_sum, b.hessian_sum)


def encode_stats(stats: Mapping[str, LayerStats], layer: int
                 ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """One site's statistics of decoder layer ``layer`` for the wire: ``({key: array},
    shared)`` where ``shared[name]`` names the linear layer whose (bit-identical) statistics
    ``name`` shares (sent once)."""
    if not stats:
        raise ValueError(f"no statistics of layer {layer} to send")
    tokens = {st.tokens for st in stats.values()}
    if len(tokens) != 1 or next(iter(tokens)) <= 0:
        raise ValueError(f"layer {layer}: the linear layers saw {sorted(tokens)} tokens: "
                         "expected one positive count")
    arrays: dict[str, np.ndarray] = {tokens_key(layer): np.array([tokens.pop()], np.int64)}
    shared: dict[str, str] = {}
    sent: list[str] = []
    for name in sorted(stats):
        st = stats[name]
        owner = next((s for s in sent if _same(stats[s], st)), None)
        if owner is not None:
            shared[name] = owner
            continue
        sent.append(name)
        packed = PackedStats.from_layer_stats(st)
        arrays[stat_key(layer, name, "sq")] = packed.sq_sum
        if packed.hessian_upper is not None:
            arrays[stat_key(layer, name, "h")] = packed.hessian_upper
    return arrays, shared


def decode_stats(arrays: Mapping[str, np.ndarray], shared: Mapping[str, str],
                 in_features: Mapping[str, int], layer: int, hessian: bool, dp: bool = False
                 ) -> dict[str, LayerStats]:
    """A site's statistics of decoder layer ``layer`` from the wire, validated against the
    layer's linear layers (``in_features``, :func:`layer_in_features`); linear layers that share
    statistics get the same object. :class:`InvalidStatsError` says what is wrong.
    Also decodes the sites' sum rebuilt from SecAgg+ (:func:`decode_fixed`: float64 too).
    ``dp``: a sum carrying DP noise, whose square sums may be negative (post-processing floors
    them, :func:`fedcompress.privacy.dp_stats.postprocess`). The checks are
    :func:`validate_stats`'s; a server summing many sites adds the validated packed form
    instead (:meth:`StatsAggregator.add`) and unpacks once."""
    unpacked: dict[int, LayerStats] = {}
    out: dict[str, LayerStats] = {}
    for name, packed in validate_stats(arrays, shared, in_features, layer, hessian,
                                       dp).items():
        if id(packed) not in unpacked:
            unpacked[id(packed)] = packed.unpack()
        out[name] = unpacked[id(packed)]
    return out


def validate_stats(arrays: Mapping[str, np.ndarray], shared: Mapping[str, str],
                   in_features: Mapping[str, int], layer: int, hessian: bool, dp: bool = False
                   ) -> dict[str, PackedStats]:
    """:func:`decode_stats`'s checks, the statistics left in their wire form
    (:class:`PackedStats`; linear layers that share statistics get the same object): names,
    shapes, dtypes, finite values, non-negative square sums (unless ``dp``), one positive token
    count, the Hessian's diagonal twice the square sums."""
    names = set(in_features)
    unknown = sorted(set(shared) - names)
    if unknown:
        raise InvalidStatsError(f"layer {layer}: shared statistics of unknown linear layers "
                                f"{unknown[:3]}")
    sent = sorted(names - set(shared))
    expected = {tokens_key(layer)} | {stat_key(layer, n, "sq") for n in sent}
    if hessian:
        expected |= {stat_key(layer, n, "h") for n in sent}
    got = set(arrays)
    if got != expected:
        missing, extra = sorted(expected - got), sorted(got - expected)
        raise InvalidStatsError(f"layer {layer}: statistics missing {missing[:3]}, unexpected "
                                f"{extra[:3]}")
    tokens_arr = np.asarray(arrays[tokens_key(layer)])
    if tokens_arr.dtype != np.int64 or tokens_arr.shape != (1,) or int(tokens_arr[0]) <= 0:
        raise InvalidStatsError(f"layer {layer}: token count {tokens_arr!r}: expected one "
                                "positive int64")
    tokens = int(tokens_arr[0])
    out: dict[str, PackedStats] = {}
    for name in sent:
        n = in_features[name]
        sq = np.asarray(arrays[stat_key(layer, name, "sq")])
        if sq.dtype != np.float64 or sq.shape != (n,):
            raise InvalidStatsError(f"{stat_key(layer, name, 'sq')}: {sq.dtype} {sq.shape}, "
                                    f"expected float64 ({n},)")
        if not np.isfinite(sq).all() or (not dp and (sq < 0).any()):
            raise InvalidStatsError(f"{stat_key(layer, name, 'sq')}: square sums must be finite "
                                    "and non-negative")
        h = None
        if hessian:
            h = np.asarray(arrays[stat_key(layer, name, "h")])
            size = n * (n + 1) // 2
            if h.dtype != _WIRE_HESSIAN or h.shape != (size,):
                raise InvalidStatsError(f"{stat_key(layer, name, 'h')}: {h.dtype} {h.shape}, "
                                        f"expected {_WIRE_HESSIAN} ({size},) (upper triangle)")
            if not np.isfinite(h).all():
                raise InvalidStatsError(f"{stat_key(layer, name, 'h')}: not finite")
            diag = h[_triu_diagonal(n)].astype(np.float64)
            gap = np.abs(diag - 2 * sq).max() / max(float(np.abs(diag).max()), 1e-30)
            if float(gap) > DIAG_TOLERANCE:
                raise InvalidStatsError(f"{stat_key(layer, name, 'h')}: the Hessian's diagonal "
                                        "is not twice the square sums (relative gap "
                                        f"{float(gap):.3g})")
            h = h.copy()
        out[name] = PackedStats(n, tokens, sq.copy(), h)
    for name, owner in shared.items():
        if owner not in sent:
            raise InvalidStatsError(f"layer {layer}: {name} shares the statistics of {owner!r}, "
                                    "which were not sent")
        if in_features[name] != in_features[owner]:
            raise InvalidStatsError(f"layer {layer}: {name} ({in_features[name]} inputs) cannot "
                                    f"share the statistics of {owner} ({in_features[owner]})")
        out[name] = out[owner]
    return out


def stats_layout(in_features: Mapping[str, int], shared: Mapping[str, str], hessian: bool,
                 layer: int) -> tuple[list[tuple[str, int]], dict[str, np.dtype]]:
    """The :func:`fixed_point_layout` of a layer's statistics as :func:`encode_stats` sends
    them (``shared``: :func:`layer_sharing`), and each statistic's wire dtype."""
    sizes: dict[str, int] = {tokens_key(layer): 1}
    dtypes: dict[str, np.dtype] = {tokens_key(layer): np.dtype(np.int64)}
    for name, n in in_features.items():
        if name in shared:
            continue
        sizes[stat_key(layer, name, "sq")] = n
        dtypes[stat_key(layer, name, "sq")] = np.dtype(np.float64)
        if hessian:
            sizes[stat_key(layer, name, "h")] = n * (n + 1) // 2
            dtypes[stat_key(layer, name, "h")] = _WIRE_HESSIAN
    return [(key, sizes[key]) for key in sorted(sizes)], dtypes


def stats_nbytes(in_features: Mapping[str, int], hessian: bool,
                 shared: Mapping[str, str] = {}) -> int:  # noqa: B006 - read only
    """Bytes of one site's statistics of a layer on the wire (arrays only)."""
    total = 8  # token count
    for name, n in in_features.items():
        if name in shared:
            continue
        total += 8 * n + (_WIRE_HESSIAN.itemsize * n * (n + 1) // 2 if hessian else 0)
    return total


@dataclass
class StatsAggregator:
    """The sum of the sites' statistics of one decoder layer (float64 at the server), kept in
    the wire's packed form (:class:`PackedStats`: the Hessian's upper triangle) and unpacked
    once, by :meth:`layer_stats`: the same additions, entry by entry, as summing the full
    matrices, without rebuilding each site's matrix."""

    in_features: dict[str, int]
    hessian: bool
    sites: int = 0
    sums: dict[str, PackedStats] = field(default_factory=dict)

    def __post_init__(self):
        self.sums = {name: PackedStats(n, 0, np.zeros(n, np.float64),
                                       np.zeros(n * (n + 1) // 2, _WIRE_HESSIAN)
                                       if self.hessian else None)
                     for name, n in self.in_features.items()}

    def add(self, stats: Mapping[str, LayerStats | PackedStats]) -> None:
        """One site's validated statistics (:func:`validate_stats`, or :func:`decode_stats`'s
        unpacked ones)."""
        if set(stats) != set(self.sums):
            raise InvalidStatsError("statistics do not name the layer's linear layers")
        packed: dict[int, PackedStats] = {}
        for name, st in stats.items():
            if id(st) not in packed:
                packed[id(st)] = (st if isinstance(st, PackedStats)
                                  else PackedStats.from_layer_stats(st))
            part, total = packed[id(st)], self.sums[name]
            if part.in_features != total.in_features:
                raise ValueError(f"statistics of {part.in_features} input features cannot be "
                                 f"added to statistics of {total.in_features}")
            if (part.hessian_upper is None) != (total.hessian_upper is None):
                raise ValueError("statistics with and without a Hessian cannot be added")
        for name, st in stats.items():
            part, total = packed[id(st)], self.sums[name]
            np.add(total.sq_sum, part.sq_sum, out=total.sq_sum)
            if total.hessian_upper is not None and part.hessian_upper is not None:
                np.add(total.hessian_upper, part.hessian_upper, out=total.hessian_upper)
            total.tokens += part.tokens
        self.sites += 1

    def layer_stats(self) -> dict[str, LayerStats]:
        """The summed statistics, unpacked (fresh objects on every call: the server's
        post-processing may change them in place)."""
        if not self.sites:
            raise ValueError("no site's statistics were aggregated")
        return {name: total.unpack() for name, total in self.sums.items()}


def prune_layer(model: nn.Module, layer: int, stats: Mapping[str, LayerStats], prune
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """The global masks (and SparseGPT's updated weights, or the quantized weights) of decoder
    layer ``layer`` from the summed statistics: the centralized pass's own per-layer function
    (:func:`quantize_layer` also returns the quantization's integers)."""
    masks, weights, _ = quantize_layer(model, layer, stats, prune)
    return masks, weights


def quantize_layer(model: nn.Module, layer: int, stats: Mapping[str, LayerStats], prune
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None,
                              dict[str, QuantResult] | None]:
    """:func:`prune_layer` and, when the recipe quantizes (``prune.quant``), each linear
    layer's :class:`~fedcompress.quant.solver.QuantResult` (integers, scales, zero points: what
    the server saves), else None."""
    from fedcompress.pruning.local import layer_prune_fn

    module = ModelAdapter(model).layers[layer]
    fn = layer_prune_fn(prune)
    masks, weights = fn(layer, module, dict(stats))
    quant = fn.quantized.get(layer)
    return ({k: v.cpu() for k, v in masks.items()},
            {k: v.cpu() for k, v in weights.items()} if weights else None,
            {k: v.to("cpu") for k, v in quant.items()} if quant is not None else None)


def check_stats_prune(prune) -> None:
    """A recipe statistics mode runs: wanda or sparsegpt, or quantization alone (method
    none with GPTQ: the Hessians are the statistics)."""
    if prune.method in STATS_METHODS:
        return
    if prune.method == "none" and prune.quant is not None and prune.quant.needs_hessian:
        return
    raise ValueError(f"aggregate=stats with method {prune.method!r}"
                     f"{' and ' + prune.quant.method if prune.quant else ''}: expected one of "
                     f"{', '.join(STATS_METHODS)}, or none with GPTQ quantization")


def check_stats_config(config: FedPrLLMConfig) -> None:
    check_stats_prune(config.prune)


@dataclass
class StatsRun:
    """What an in-process statistics-mode run produced: every layer's global masks and
    (SparseGPT) updated weights, and per layer the bytes one site sent and the seconds; with
    DP, ``dp`` (:func:`fedcompress.methods.fedprllm.dp.report`: epsilon, delta, placement,
    each site's ledger epsilon). ``released`` (only with ``keep_release``): per layer, the
    summed statistics the server saw, one copy per block (by its owner's name): with DP the
    noisy sum BEFORE post-processing, without DP the plain sum."""

    masks: list[dict[str, torch.Tensor]] = field(default_factory=list)
    weights: list[dict[str, torch.Tensor] | None] = field(default_factory=list)
    bytes_up_per_site: list[int] = field(default_factory=list)
    site_seconds: list[float] = field(default_factory=list)
    server_seconds: list[float] = field(default_factory=list)
    dp: dict = field(default_factory=dict)
    released: list[dict[str, LayerStats]] = field(default_factory=list)
    quant: list[dict[str, QuantResult] | None] = field(default_factory=list)


@dataclass
class DpSite:
    """A site of an in-process DP run: its policy and its ledger (``None``: no ledger, a
    research run whose epsilon is the plan's)."""

    policy: SitePolicy
    ledger: Ledger | None = None


def stats_prune(model: nn.Module, windows: list[torch.Tensor], config: FedPrLLMConfig,
                batch_size: int | None = None, frac_bits: int | None = None, *,
                tokenizer=None, dp_sites: list[DpSite] | None = None, run_id: str = "local",
                dp_seed: int | None = None, keep_release: bool = False,
                dp_calibration: PublicCalibration | None = None,
                prune: PruneConfig | None = None,
                sum_fixed: Callable[[int, list[np.ndarray]], np.ndarray] | None = None,
                site_threads: int | None = None) -> StatsRun:
    """Statistics-mode federated pruning in one process (tests, benchmarks): the same site
    steps, wire round trip and server step as the Flower strategy, sites one after another.
    ``frac_bits``: the sites' statistics are summed as SecAgg+ sums them (fixed point, 64-bit
    lanes, mod 2^64: the unmasked sum is that sum exactly), without the cryptography.

    With ``config.dp`` (:mod:`fedcompress.methods.fedprllm.dp`): ``tokenizer`` for the public
    clip windows (unless ``config.dp_clip`` is set); each of ``dp_sites`` (default: simulated
    sites without a ledger) admits the request under its policy and records every release in
    its ledger; the distributed placement sums fixed-point lanes at the plan's fractional bits
    (``frac_bits`` is then ignored). ``dp_seed``: seeded noise (tests only). ``keep_release``:
    keep what the server saw of each layer in :attr:`StatsRun.released` (research: the attacks
    of :mod:`fedcompress.bench.dp_leakage`). ``dp_calibration``: the clip bounds and scales
    when already computed for this model and request (public values,
    :func:`fedcompress.methods.fedprllm.dp.public_calibration`; default: computed here).
    ``prune``: the recipe, instead of ``config.prune`` (e.g. one that quantizes,
    :attr:`~fedcompress.pruning.local.PruneConfig.quant`; not with DP, whose request is built
    from ``config``); the quantization's integers are in :attr:`StatsRun.quant`.
    ``sum_fixed(layer, vectors)``: the sum of the sites' fixed-point vectors of a layer, mod
    2^64 (default: added here; e.g. a SecAgg+ vote over them, which must give the same sum).
    ``site_threads``: torch's threads for the sites' steps (None: this process's; 1: a
    Simulation Engine actor's, the floats a ``prune`` run's sites compute, bit for bit; the
    server's step keeps this process's threads, as the ServerApp does)."""
    from fedcompress.methods.fedprllm import dp as dpm
    from fedcompress.methods.fedprllm.federated import advance_to_layer, site_layer_stats
    from fedcompress.models.common import torch_threads
    from fedcompress.privacy.dp_stats import secret_rng

    if prune is not None and config.dp:
        raise ValueError("a recipe other than config.prune with DP: expected the recipe in the "
                         "config (the DP request and its clip bounds are built from it)")
    prune = config.prune if prune is None else prune
    check_stats_prune(prune)
    n_layers = len(ModelAdapter(model))
    prune.plan.check_layers(n_layers)
    prune.check_widths(model)
    batch = batch_size or config.batch_size
    hessian = prune.needs_hessian
    plan = None
    site_plans: list = []
    if config.dp:
        request = dpm.DpRequest.from_config(config, n_layers, len(windows))
        calib = (dp_calibration if dp_calibration is not None
                 else dpm.public_calibration(model, tokenizer, request, hessian, batch,
                                             (config.dp_public_file,)))
        dims = dpm.block_dims(model, calib.bounds, hessian)
        plan = dpm.plan(request, calib, dims)
        sites = dp_sites or [DpSite(SitePolicy(simulation=True)) for _ in windows]
        if len(sites) != len(windows):
            raise ValueError(f"{len(sites)} DP sites for {len(windows)} sites' windows")
        site_plans = [dpm.site_plan(site.policy, request, n_layers, calib, dims)
                      for site in sites]
        if plan.placement == "distributed":
            frac_bits = plan.frac_bits
    public_prior = (dpm.PublicPrior(model, tokenizer, config.seqlen, config.dp_public_windows,
                                    batch, config.dp_public_text, (config.dp_public_file,))
                    if config.dp and config.dp_prior == "public" else None)

    def rng(*salt: int):  # a fresh generator per release, seeded from the OS (or dp_seed)
        return secret_rng(None if dp_seed is None else
                          int(np.random.SeedSequence([dp_seed, *salt]).generate_state(1)[0]))
    state: list[tuple[torch.Tensor | None, list[dict] | None]] = [(None, None)] * len(windows)
    run = StatsRun()
    site_eps = [0.0] * len(windows)
    for layer in range(n_layers):
        features = layer_in_features(model, layer)
        aggregator = StatsAggregator(features, hessian)
        prev_masks = run.masks[layer - 1] if layer else None
        prev_weights = run.weights[layer - 1] if layer else None
        site_seconds = 0.0
        sent = 0
        fixed: np.ndarray | None = None
        vectors: list[np.ndarray] = []
        for site, site_windows in enumerate(windows):
            start = time.perf_counter()
            with torch_threads(site_threads):  # a site's arithmetic
                hidden, kwargs = state[site]
                inputs = advance_to_layer(model, site_windows, layer, hidden, prev_masks, kwargs,
                                          batch, prev_weights)
                site_plan = site_plans[site] if plan is not None else None
                if site_plan is not None:
                    ledger = dp_sites[site].ledger if dp_sites else None
                    if ledger is not None:
                        site_eps[site] = dpm.record_release(ledger, run_id, site_plan,
                                                            layer).run_epsilon
                    else:
                        site_eps[site] = site_plan.epsilon_after(layer + 1)
                    stats = dpm.site_release(model, inputs, site_plan, layer, hessian,
                                             batch).stats
                else:
                    stats = site_layer_stats(model, inputs, hessian, batch)
                arrays, shared = encode_stats(stats, layer)
                state[site] = (inputs.hidden, inputs.layer_kwargs)
            site_seconds += time.perf_counter() - start
            sent = max(sent, sum(int(a.nbytes) for a in arrays.values()))
            if frac_bits is None:
                aggregator.add(validate_stats(arrays, shared, features, layer, hessian))
                continue
            if site_plan is not None and site_plan.placement == "distributed":
                vector = dpm.noisy_fixed(arrays, layer, site_plan, hessian, len(windows),
                                         rng(layer, site))
            else:
                vector = encode_fixed(arrays, frac_bits, len(windows))
            if sum_fixed is not None:
                vectors.append(vector)
            else:
                with np.errstate(over="ignore"):
                    fixed = vector if fixed is None else fixed + vector
            layout, dtypes = fixed_point_layout(arrays), {k: a.dtype for k, a in arrays.items()}
        if sum_fixed is not None and vectors:
            fixed = sum_fixed(layer, vectors)
        if frac_bits is not None and fixed is not None:
            summed = decode_fixed(fixed.view(np.int64), layout, frac_bits, dtypes)
            aggregator.add(decode_stats(summed, shared, features, layer, hessian,
                                        dp=plan is not None))
            aggregator.sites = len(windows)
        start = time.perf_counter()
        layer_stats = aggregator.layer_stats()
        released: dict[str, LayerStats] | None = {} if keep_release else None
        if plan is not None:
            prior_stats = (None if public_prior is None else public_prior.layer_stats(
                layer, dict(enumerate(run.masks)), dict(enumerate(run.weights)), hessian))
            layer_stats = dpm.server_finish(dict(layer_stats), layer_sharing(model, layer),
                                            plan, layer, hessian, len(windows),
                                            rng(layer, len(windows)), released,
                                            config.dp_prior, prior_stats)
        elif released is not None:
            shared_names = layer_sharing(model, layer)
            released.update({name: dpm.copy_stats(st) for name, st in layer_stats.items()
                             if name not in shared_names})
        if released is not None:
            run.released.append(released)
        masks, weights, quant = quantize_layer(model, layer, layer_stats, prune)
        run.server_seconds.append(time.perf_counter() - start)
        run.masks.append(masks)
        run.weights.append(weights)
        if prune.quant is not None:
            run.quant.append(quant)
        run.bytes_up_per_site.append(sent)
        run.site_seconds.append(site_seconds / max(len(windows), 1))
    run.dp = dpm.report(plan, site_eps if plan is not None else ())
    return run
