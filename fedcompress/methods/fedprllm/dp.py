"""FedPrLLM's statistics mode with differential privacy: what a site and the server do (no Flower).

The mechanism and its accounting are :mod:`fedcompress.privacy.dp_stats`'s; this module is the
method's glue:

* the server announces a :class:`DpRequest` (epsilon, delta, placement, unit, clip setting,
  the number of layer releases, the SecAgg+ threshold and the calibration budget) with every
  round;
* a site turns it into its mechanism with :func:`site_plan`: ITS policy decides
  (:class:`~fedcompress.privacy.policy.SitePolicy`: an epsilon above ``max-epsilon``, a delta
  above ``max-delta``, a placement outside ``dp-placements``, no DP without ``allow-no-dp``, a
  SecAgg+ threshold below its floor, fewer releases than the model has layers: refused), the
  clip bounds (and the scales the inputs are normalized by) come from public text
  (:func:`public_calibration`, the same at every party) and the
  noise from its own accountant; each release is checked and recorded by its ledger
  (:func:`record_release`: the run's first release fixes the mechanism, at most ``L``
  releases);
* :func:`site_release` clips the site's windows and, for the distributed placement, adds its
  Skellam share in the fixed-point lanes (:func:`noisy_fixed`); :func:`server_finish` adds the
  central noise (central placement) and post-processes the sum (square sums floored at 0, the
  Hessian made positive definite) before the layer is pruned.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from torch import nn

from fedcompress.methods.fedprllm.config import FedPrLLMConfig
from fedcompress.privacy import dp_stats as dps
from fedcompress.privacy.dp_stats import DpStatsPlan
from fedcompress.privacy.policy import PolicyError, SitePolicy

logger = logging.getLogger(__name__)

#: The method's name in a site's ledger.
METHOD = "fedprllm"


@dataclass(frozen=True)
class DpRequest:
    """What the server announces (every field is checked by each site, none is trusted).

    Attributes:
        epsilon: Epsilon asked for the run (0: no DP).
        delta: Delta asked for the run.
        placement: ``central`` or ``distributed``.
        unit: Privacy unit (``window``).
        clip: A fixed clip bound for every block (0: the public default).
        normalize: ``public`` (inputs normalized by their public scales before clipping) or
            ``none``.
        clip_quantile: Quantile of the public per-window norms (the default bounds).
        public_windows: Public windows the default bounds are measured on.
        public_text: The public text the public windows come from (checked by each site: one
            of :data:`~fedcompress.privacy.dp_stats.PUBLIC_CORPORA`, or a pinned file's
            digest, which a site reads only from the files its own policy lists:
            :func:`public_files`).
        releases: Layer releases of the run (the model's decoder layers).
        sites: Sites of the federation.
        threshold: SecAgg+ threshold (distributed placement), else 0.
        windows: Calibration windows per site (public).
        seqlen: Tokens per window (public).
    """

    epsilon: float
    delta: float
    placement: str
    unit: str
    clip: float
    normalize: str
    clip_quantile: float
    public_windows: int
    public_text: str
    releases: int
    sites: int
    threshold: int
    windows: int
    seqlen: int

    @classmethod
    def from_config(cls, config: FedPrLLMConfig, releases: int, sites: int) -> DpRequest:
        threshold = config.threshold_for(sites) if config.dp_placement == "distributed" else 0
        return cls(float(config.dp_epsilon), float(config.dp_delta), config.dp_placement,
                   config.dp_unit, float(config.dp_clip), config.dp_normalize,
                   float(config.dp_clip_quantile),
                   int(config.dp_public_windows), str(config.dp_public_text), int(releases),
                   int(sites), int(threshold),
                   int(config.samples_per_client), int(config.seqlen))

    def to_record(self) -> dict[str, Any]:
        """As a flat dict of numbers and strings (a message's ``ConfigRecord``)."""
        return {f"dp_{k}": v for k, v in asdict(self).items()}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> DpRequest:
        names = cls.__dataclass_fields__
        missing = sorted(f"dp_{k}" for k in names if f"dp_{k}" not in record)
        if missing:
            raise ValueError(f"DP request without {missing}")
        kinds = {"placement": str, "unit": str, "normalize": str, "public_text": str,
                 "epsilon": float,
                 "delta": float,
                 "clip": float, "clip_quantile": float}
        return cls(**{k: kinds.get(k, int)(record[f"dp_{k}"]) for k in names})


def public_files(policy: SitePolicy, request: DpRequest, config: FedPrLLMConfig
                 ) -> tuple[str, ...]:
    """The files a site may read ``request.public_text`` from: none for a bundled corpus; for a
    pinned file's digest, the one of ITS node config ``dp-public-files`` with that SHA-256
    (:class:`~fedcompress.privacy.policy.PolicyError` if it lists none: the site reads no
    path the server names). In simulation (the server runs the sites) the server's own
    ``dp_public_file`` too."""
    if not dps.is_digest(request.public_text):
        return ()
    if policy.simulation:
        return (*policy.dp_public_files, config.dp_public_file)
    return (policy.public_file(request.public_text),)


def public_calibration(model: nn.Module, tokenizer: Any, request: DpRequest, hessian: bool,
                       batch_size: int = 8, files: Sequence[str] = ()
                       ) -> dps.PublicCalibration:
    """Each decoder layer's clip bound per block (``request.clip`` for every block when set)
    and, with ``request.normalize == "public"``, each block's public scales:
    :func:`~fedcompress.privacy.dp_stats.public_calibration` on
    :func:`~fedcompress.privacy.dp_stats.public_windows` (public text only: every party
    computes the same values; ``request.public_text`` is checked to be a bundled corpus, or a
    digest one of ``files`` matches byte for byte)."""
    from fedcompress.methods.fedprllm.stats_wire import layer_in_features, layer_sharing
    from fedcompress.models import ModelAdapter

    if request.normalize not in dps.NORMALIZATIONS:
        raise ValueError(f"dp_normalize={request.normalize!r}: expected one of "
                         f"{dps.NORMALIZATIONS}")
    calib = None
    if request.clip <= 0 or request.normalize == "public":
        if tokenizer is None:
            raise ValueError("public clip bounds or scales need the model's tokenizer (for "
                             "the public windows): expected a tokenizer, or dp_clip > 0 with "
                             "dp_normalize 'none'")
        windows = dps.public_windows(tokenizer, request.seqlen, request.public_windows,
                                     corpus=request.public_text, files=files)
        calib = dps.public_calibration(model, windows, hessian, request.clip_quantile,
                                       batch_size, request.normalize)
    if request.clip <= 0:
        assert calib is not None
        return calib
    out = []
    for layer in range(len(ModelAdapter(model))):
        shared = layer_sharing(model, layer)
        out.append({name: float(request.clip) for name in layer_in_features(model, layer)
                    if name not in shared})
    return dps.PublicCalibration(out, calib.scales if calib is not None else None)


def block_dims(model: nn.Module, bounds: Sequence[Mapping[str, float]], hessian: bool
               ) -> list[dict[str, int]]:
    """Noised coordinates of each block: ``d`` square sums, or the Hessian's ``d (d+1) / 2``."""
    from fedcompress.methods.fedprllm.stats_wire import layer_in_features

    out = []
    for layer, blocks in enumerate(bounds):
        features = layer_in_features(model, layer)
        out.append({k: (features[k] * (features[k] + 1) // 2 if hessian else features[k])
                    for k in blocks})
    return out


def plan(request: DpRequest, calib: dps.PublicCalibration,
         dims: Sequence[Mapping[str, int]]) -> DpStatsPlan:
    """The run's mechanism for ``request`` (the server's and every site's own computation:
    deterministic, from public values)."""
    text = ("" if request.public_text == dps.PUBLIC_CORPUS
            else f"{request.public_text[:len(dps.DIGEST_PREFIX) + 12]}-")
    clip = "fixed" if request.clip > 0 else f"public-{text}q{request.clip_quantile:g}"
    if calib.normalize != request.normalize:
        raise ValueError(f"public calibration normalized {calib.normalize!r}: the request "
                         f"asks {request.normalize!r}")
    bounds = calib.bounds
    if request.placement == "central":
        return dps.plan_dp_stats(request.epsilon, request.delta, "central", bounds, clip=clip,
                                 normalize=calib.normalize, scales=calib.scales)
    gaussian = dps.gaussian_sigma(request.epsilon, request.delta, len(bounds))
    frac_bits = dps.dp_frac_bits(gaussian, bounds, request.windows, request.sites)
    return dps.plan_dp_stats(request.epsilon, request.delta, "distributed", bounds, dims,
                             frac_bits, request.threshold, clip=clip,
                             normalize=calib.normalize, scales=calib.scales)


def site_plan(policy: SitePolicy, request: DpRequest, n_layers: int,
              calib: dps.PublicCalibration, dims: Sequence[Mapping[str, int]]
              ) -> DpStatsPlan | None:
    """This site's mechanism for ``request`` under ITS policy (None: no DP, which only a policy
    with ``allow-no-dp`` accepts); :class:`~fedcompress.privacy.policy.PolicyError` for a
    request it refuses."""
    epsilon = policy.check_epsilon(request.epsilon or None, "dp_epsilon")
    if epsilon is None:
        return None
    policy.check_delta(request.delta)
    policy.check_dp_placement(request.placement)
    try:
        dps.check_public_text(request.public_text)
    except ValueError as err:
        raise PolicyError(f"dp_public_text: this site takes its clip bounds and scales from a "
                          f"bundled public corpus or a public file it holds, anything else "
                          f"could be private text: {err}") from err
    if dps.is_digest(request.public_text) and not policy.simulation:
        policy.public_file(request.public_text)  # a file its own operator listed as public
    if request.unit != dps.UNIT:
        raise PolicyError(f"dp_unit={request.unit!r}: this site protects one calibration "
                          f"window ({dps.UNIT!r})")
    if request.releases < n_layers:
        raise PolicyError(f"dp_releases={request.releases}: the model has {n_layers} decoder "
                          "layers, each a release; the noise must be set for all of them")
    if request.placement == "distributed":
        floor = policy.min_secagg_threshold(request.sites)
        if request.threshold < floor and not policy.simulation:
            raise PolicyError(f"dp_threshold={request.threshold} is below this site's SecAgg+ "
                              f"floor {floor} of {request.sites} sites (node config "
                              "secagg-min-fraction, secagg-max-colluders): fewer honest sites' "
                              "noise would reach the sum")
    if len(calib.bounds) != request.releases:
        # more releases than layers: the bounds of the model's layers, the noise for all
        extra = request.releases - len(calib.bounds)
        calib = dps.PublicCalibration(
            list(calib.bounds) + [calib.bounds[-1]] * extra,
            None if calib.scales is None else list(calib.scales) + [calib.scales[-1]] * extra)
        dims = list(dims) + [dims[-1]] * (request.releases - len(dims))
    return plan(request, calib, dims)


def record_release(ledger: Any, run_id: int | str, the_plan: DpStatsPlan, layer: int) -> Any:
    """Check and record layer ``layer``'s release in the site's ledger (before it is sent)."""
    return ledger.dp_stats(str(run_id), METHOD, f"stats layer {layer}", the_plan,
                           {"layer": int(layer)})


def site_release(model: nn.Module, inputs: Any, the_plan: DpStatsPlan, layer: int,
                 hessian: bool, batch_size: int = 8) -> dps.ClippedStats:
    """A site's clipped statistics of layer ``layer`` (each window's blocks clipped to the
    plan's bounds before summing), their token count checked to be the public one."""
    from fedcompress.models import ModelAdapter

    with ModelAdapter(model).onloaded(inputs.layer) as module:
        clipped = dps.clipped_layer_stats(module, inputs, hessian, the_plan.bounds[layer],
                                          batch_size, the_plan.layer_scales(layer))
    windows, seqlen = int(inputs.hidden.shape[0]), int(inputs.hidden.shape[1])
    for st in clipped.stats.values():
        dps.check_public_tokens(st.tokens, windows, seqlen)
    return clipped


def noisy_fixed(arrays: Mapping[str, np.ndarray], layer: int, the_plan: DpStatsPlan,
                hessian: bool, n_sites: int, rng: np.random.Generator,
                threshold: int | None = None) -> np.ndarray:
    """Distributed placement: the site's statistics (:func:`~fedcompress.methods.fedprllm.
    stats.encode_stats` of its clipped sums) as SecAgg+'s fixed-point vector at the plan's
    fractional bits, with its Skellam share (variance ``V_j / t``) added to every noised lane;
    with a Hessian, the square-sum lanes are half its noisy diagonal lanes (nothing un-noised
    leaves the site). ``threshold``: the SecAgg+ threshold of this very sum when it differs
    from the plan's (fewer sites answered): the share is ``V_j / threshold``."""
    t = int(threshold or the_plan.threshold)
    if t < 1:
        raise ValueError(f"threshold={t}: expected >= 1")
    from fedcompress.methods.fedprllm.stats_wire import encode_fixed, stat_key

    noise: dict[str, np.ndarray] = {}
    derived: dict[str, str] = {}
    for owner, std in the_plan.noise_std(layer).items():
        key = stat_key(layer, owner, "h" if hessian else "sq")
        if key not in arrays:
            raise ValueError(f"layer {layer}: no statistic {key} to noise")
        variance = (std * 2.0 ** the_plan.frac_bits) ** 2 / t
        noise[key] = dps.skellam_noise(np.asarray(arrays[key]).shape, variance, rng)
        if hessian:
            derived[stat_key(layer, owner, "sq")] = key
    return encode_fixed(arrays, the_plan.frac_bits, n_sites, noise=noise, sq_from_diag=derived)


def server_finish(stats: dict[str, Any], shared: Mapping[str, str], the_plan: DpStatsPlan,
                  layer: int, hessian: bool, sites: int,
                  rng: np.random.Generator | None = None,
                  released: dict[str, Any] | None = None,
                  prior: str = "none",
                  prior_stats: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The server's step on the sites' summed statistics of layer ``layer``: sharers get their
    owner's object (one noise draw per block), the central placement's Gaussian noise is added
    (``rng``: a secret one by default), then post-processing: with normalization and
    ``prior="shrink"`` the shrinkage toward the public prior
    (:func:`~fedcompress.privacy.dp_stats.shrink`; ``prior="public"``: toward public text's own
    statistics of the layer, ``prior_stats``, from :class:`PublicPrior`), the floor and
    positive-definite Hessian,
    and the map back to the inputs' units (:func:`~fedcompress.privacy.dp_stats.denormalize`).
    Returns ``stats``.
    ``released``: filled with a copy of each block's statistics (by its owner's name) as the
    server holds them after the noise and before post-processing (what the DP release is, in
    normalized units with normalization; the attacks of :mod:`fedcompress.privacy.dp_attacks`
    score it)."""
    for name, owner in shared.items():
        stats[name] = stats[owner]
    std = the_plan.noise_std(layer)
    if the_plan.placement == "central":
        dps.add_gaussian(stats, std, hessian, rng or dps.secret_rng())
    else:  # all honest: sites / t shares of the target variance
        std = {k: s * float(np.sqrt(max(sites, 1) / the_plan.threshold)) for k, s in std.items()}
    if released is not None:
        released.update({owner: copy_stats(stats[owner]) for owner in std})
    if prior not in dps.PRIORS:
        raise ValueError(f"prior={prior!r}: expected one of {dps.PRIORS}")
    scales = the_plan.layer_scales(layer)
    if prior == "public" and (scales is None or prior_stats is None):
        raise ValueError("prior='public' needs normalized statistics and public text's own "
                         "(prior_stats, from PublicPrior)")
    if prior == "shrink" and scales is not None:
        # the floor stays at the whole noise: the flat prior's one off-diagonal value is no
        # estimate of the inputs' correlations, and the floor's pull toward a diagonal
        # Hessian is what keeps SparseGPT's updates sane on it
        dps.shrink(stats, std, hessian)
    elif prior == "public":  # the floor at the noise the shrinkage left: the prior is a Hessian
        assert scales is not None and prior_stats is not None
        z = dps.spread_z(2 * len(std) * the_plan.releases)  # every block of the run, twice
        std = dps.shrink(stats, std, hessian, dps.normalized_prior(prior_stats, scales, hessian),
                         z)
    dps.postprocess(stats, std, hessian)
    if scales is not None:
        dps.denormalize(stats, scales, hessian)
    return stats


class PublicPrior:
    """The server's public prior of each layer (``dp_prior="public"``): public text's own
    statistics of the layer's inputs (the windows of the run's public text, ``corpus``, as for
    the clip bounds), through the model as the server has pruned it so far:
    the sites' walker (:func:`~fedcompress.methods.fedprllm.federated.advance_to_layer`) with
    the global masks (and SparseGPT's weights) of the layers before. Public text and the
    server's own model only: the shrinkage toward it is post-processing, free.

    Layers are asked for in order; any other order (a resumed run) recomputes the public
    inputs from the global masks (:func:`~fedcompress.methods.fedprllm.federated.resync_inputs`).
    """

    def __init__(self, model: nn.Module, tokenizer: Any, seqlen: int, windows: int,
                 batch_size: int = 8, corpus: str = dps.PUBLIC_CORPUS,
                 files: Sequence[str] = ()):
        if tokenizer is None:
            raise ValueError("dp_prior 'public' needs the model's tokenizer (for the public "
                             "windows): expected a tokenizer")
        self.model = model
        self.windows = dps.public_windows(tokenizer, seqlen, windows, corpus=corpus, files=files)
        self.batch_size = batch_size
        self._layer = -1
        self._hidden = None
        self._kwargs: list[dict] | None = None

    def layer_stats(self, layer: int, global_masks: Mapping[int, Mapping[str, Any]],
                    global_weights: Mapping[int, Mapping[str, Any]], hessian: bool
                    ) -> dict[str, Any]:
        """Public text's statistics of decoder layer ``layer``'s inputs (by linear name, as a
        site's :func:`~fedcompress.methods.fedprllm.federated.site_layer_stats`)."""
        from fedcompress.methods.fedprllm.federated import (
            advance_to_layer,
            resync_inputs,
            site_layer_stats,
        )

        hidden, kwargs = self._hidden, self._kwargs
        if layer > 0 and layer != self._layer + 1:
            hidden, kwargs = resync_inputs(self.model, self.windows, layer, global_masks,
                                           self.batch_size, global_weights)
        prev = layer - 1
        inputs = advance_to_layer(self.model, self.windows, layer, hidden,
                                  dict(global_masks.get(prev, {})) if layer else None, kwargs,
                                  self.batch_size,
                                  dict(global_weights.get(prev, {})) or None if layer else None)
        self._hidden, self._kwargs, self._layer = inputs.hidden, inputs.layer_kwargs, layer
        return site_layer_stats(self.model, inputs, hessian, self.batch_size)


def copy_stats(st: Any) -> Any:
    """An independent copy of a :class:`~fedcompress.pruning.walker.LayerStats`."""
    from fedcompress.pruning.walker import LayerStats

    out = LayerStats(st.in_features, hessian=st.hessian_sum is not None)
    out.sq_sum = st.sq_sum.clone()
    if st.hessian_sum is not None:
        out.hessian_sum = st.hessian_sum.clone()
    out.tokens = st.tokens
    return out


def report(the_plan: DpStatsPlan | None, site_epsilons: Sequence[float] = ()) -> dict[str, Any]:
    """What a run's report says of its DP statistics."""
    if the_plan is None:
        return {"dp": False}
    return {"dp": True, "epsilon": the_plan.epsilon, "delta": the_plan.delta,
            "placement": the_plan.placement, "unit": the_plan.unit,
            "mechanism": the_plan.mechanism, "sigma": the_plan.sigma,
            "releases": the_plan.releases, "clip": the_plan.clip,
            "normalize": the_plan.normalize,
            "frac_bits": the_plan.frac_bits, "threshold": the_plan.threshold,
            "epsilon_spent": the_plan.epsilon_after(the_plan.releases),
            "site_epsilon": [float(e) for e in site_epsilons]}


#: Public calibrations computed in this process: ``{(model id, request fields): calibration}``
#: (public values; a warm site worker keeps them across messages, a per-message process
#: recomputes).
_BOUNDS: dict[tuple, dps.PublicCalibration] = {}


def cached_calibration(model: nn.Module, tokenizer: Any, request: DpRequest, hessian: bool,
                       batch_size: int = 8, files: Sequence[str] = ()
                       ) -> dps.PublicCalibration:
    """:func:`public_calibration`, computed once per process for a model and request (a pinned
    text's digest fixes its content, whichever of ``files`` holds it)."""
    key = (id(model), request.clip, request.normalize, request.clip_quantile,
           request.public_windows, request.public_text, request.seqlen, hessian)
    if key not in _BOUNDS:
        _BOUNDS[key] = public_calibration(model, tokenizer, request, hessian, batch_size,
                                          files)
    return _BOUNDS[key]


@dataclass
class SiteStep:
    """A site's DP release of one layer: its plan, its clipped statistics, what the reply
    carries of its ledger and of the mechanism."""

    plan: DpStatsPlan
    clipped: dps.ClippedStats
    metrics: dict[str, float]


def site_step(policy: SitePolicy, ledger: Any, run_id: int | str, config: FedPrLLMConfig,
              model: nn.Module, tokenizer: Any, inputs: Any, layer: int) -> SiteStep | None:
    """Everything a site does for a DP release of layer ``layer`` (the ClientApp's and the
    site worker's one call): the request from the server's settings, ITS plan under ITS policy
    (None: no DP, allowed by the policy), the release checked and recorded in its ledger BEFORE
    anything is computed for the reply, then its clipped statistics. The request counts the
    federation's ``clients`` (as the server's :func:`server_plan`), whoever answers a round, so
    that both derive the same fixed-point bits."""
    from fedcompress.models import ModelAdapter
    from fedcompress.privacy.site import ledger_metrics

    n_layers = len(ModelAdapter(model))
    request = DpRequest.from_config(config, n_layers, config.clients)
    policy.check_epsilon(request.epsilon or None, "dp_epsilon")  # refuse before any work
    hessian = config.prune.needs_hessian
    files = public_files(policy, request, config)  # refuses a digest it holds no file of
    calib = cached_calibration(model, tokenizer, request, hessian, config.batch_size, files)
    the_plan = site_plan(policy, request, n_layers, calib,
                         block_dims(model, calib.bounds, hessian))
    if the_plan is None:
        return None
    shape = (int(inputs.hidden.shape[0]), int(inputs.hidden.shape[1]))
    if shape != (request.windows, request.seqlen):
        raise ValueError(f"this site holds {shape[0]} windows of {shape[1]} tokens: the run "
                         f"announced {request.windows} x {request.seqlen} (the public token "
                         "count a DP release relies on)")
    grant = record_release(ledger, run_id, the_plan, layer)
    clipped = site_release(model, inputs, the_plan, layer, hessian, config.batch_size)
    metrics = {**ledger_metrics(policy, grant, dp=True), "dp_epsilon": the_plan.epsilon,
               "dp_delta": the_plan.delta, "dp_sigma": the_plan.sigma,
               "dp_distributed": 1 if the_plan.placement == "distributed" else 0,
               "dp_clipped_windows": float(sum(clipped.clipped.values()))}
    if not policy.simulation:
        # how many windows the (server-chosen) clip bound cut is computed from the site's
        # windows and not noised: a threshold oracle, so a deployed site does not send it
        del metrics["dp_clipped_windows"]
    return SiteStep(the_plan, clipped, metrics)


def server_plan(config: FedPrLLMConfig, model: nn.Module, tokenizer: Any
                ) -> DpStatsPlan | None:
    """The server's copy of the run's mechanism (the sites compute their own): for the central
    noise, the post-processing and the report. None without DP."""
    from fedcompress.models import ModelAdapter

    if not config.dp:
        return None
    request = DpRequest.from_config(config, len(ModelAdapter(model)), config.clients)
    hessian = config.prune.needs_hessian
    calib = cached_calibration(model, tokenizer, request, hessian, config.batch_size,
                               (config.dp_public_file,))
    return plan(request, calib, block_dims(model, calib.bounds, hessian))


def describe(the_plan: DpStatsPlan) -> str:
    """One sentence of a report on the run's DP statistics mechanism."""
    where = ("central: the server added Gaussian noise to the sites' clipped sum and was "
             "trusted with the un-noised sum" if the_plan.placement == "central" else
             f"distributed: each site added a Skellam share in its SecAgg+ lanes (target noise "
             f"whenever at least {the_plan.threshold} sites are honest), accounted as Skellam")
    return (f"statistics of each site clipped per calibration window (privacy unit: one "
            f"window; bounds {the_plan.clip}; input normalization {the_plan.normalize}), "
            f"noise multiplier {the_plan.sigma:.3g} over "
            f"{the_plan.releases} layer releases for epsilon {the_plan.epsilon:g} "
            f"(accountant: {the_plan.epsilon_after(the_plan.releases):.3g}), delta "
            f"{the_plan.delta:g} per site; {where}")
