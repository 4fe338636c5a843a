"""FedPrLLM's ClientApp handlers: this node's local prune masks on its private calibration windows.

The one ClientApp of the FAB (``clients/app.py``) calls these for the message types the method
declares (``fedcompress.methods.fedprllm.METHOD.actions``):

* ``train.masks`` (one-shot): every layer's masks in one reply;
* ``train.layer_mask`` (iterative): one layer per round; this node keeps its activations in its
  Flower context state and first applies the server's global mask of the previous layer;
* ``train.fedspallm`` (``aggregate=fedspallm``, the peer system): the masks and kept weights of
  the decoder layers the server assigned this node;
* ``query.outliers`` (``sparsity_profile=owl``, before the pruning rounds): OWL's outlier ratio of
  every decoder layer on this node's windows (L numbers, nothing else).

The dense model is loaded once per process (cached, memory-mapped from the site's safetensors
cache) and never mutated across calls. The site's tokenized calibration corpus is kept in its
cache folder (``$FEDCOMPRESS_CACHE/tokens``), so a message only cuts its windows from it (Flower
1.42 starts a new process for every message at a SuperNode).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import time
from collections.abc import Callable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from clients import startup
from clients.common import cached_model, site_partition, with_data_path
from fedcompress.masks.stats import flatten_masks
from fedcompress.methods.fedprllm.federated import (
    FedPrLLMConfig,
    advance_to_layer,
    decode_masks,
    encode_wire,
    expected_shapes,
    federation_windows,
    masks_by_layer,
    resync_inputs,
    site_layer_masks,
    site_layer_stats,
)
from fedcompress.methods.fedprllm.stats import encode_stats
from fedcompress.privacy.secagg import (
    SecAggError,
    SecAggSite,
    pack_blobs,
    pack_ints,
    unpack_blobs,
    unpack_ints,
)
from fedcompress.pruning.local import local_masks, outlier_ratios

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _windows(config: FedPrLLMConfig, data_path: str | None) -> list[torch.Tensor]:
    """All clients' windows (a seeded pool split by partition), cut from this site's token
    stream of its data, tokenized once and kept in its cache folder."""
    from fedcompress.models import cache_dir

    _, tokenizer = cached_model(config.model, config.dtype, config.onload)
    with startup.timed(startup.LOAD):
        return federation_windows(tokenizer, config, data_path, cache=cache_dir() / "tokens")[0]


_KWARGS: dict[tuple, list[dict]] = {}


def _check_release(message: Message, context: Context, config: FedPrLLMConfig) -> None:
    """What this site's policy says about the release a message asks for, beyond
    :func:`fedcompress.privacy.site.admit`: a release in the clear in a run whose settings say
    SecAgg+ (the settings checked for one protocol, the message asking another) is refused;
    statistics need DP unless the site allows otherwise (node config ``allow-no-dp``), and
    distributed DP noise only ever leaves under SecAgg+ (a site's share alone is not the
    noise)."""
    from fedcompress.methods.fedprllm import METHOD
    from fedcompress.privacy import site
    from fedcompress.privacy.policy import PolicyError

    action = message.metadata.message_type
    clear = action in METHOD.clear_releases
    if clear and config.secagg:
        raise PolicyError(f"{action} is a release in the clear, but the run's settings ask for "
                          "SecAgg+ (secagg=true): refused")
    if config.aggregate == "stats" and action in ("train.layer_stats", "train.secagg_masks"):
        policy = site.policy(context.node_config)
        if not config.dp:
            policy.check_epsilon(None, "dp_epsilon (statistics)")
        elif clear and config.dp_placement == "distributed":
            raise PolicyError("dp_placement='distributed' asks for this site's share of the "
                              f"noise on {action}, a release in the clear: a share is not the "
                              "noise, so the statistics would leave without DP; refused")


def _record_input(message: Message, context: Context, config: FedPrLLMConfig, windows,
                  layer: int, what: str) -> None:
    """Before computing ``what`` (masks, statistics without DP) of ``layer`` (-1: every layer)
    on this site's windows: the ledger's one-release-per-input rule
    (:func:`fedcompress.privacy.site.record_input`)."""
    from fedcompress.privacy import site

    policy = site.policy(context.node_config)
    site.record_input(policy, context.run_id, "fedprllm", message.metadata.message_type,
                      site.input_key(config.model, what, windows), layer)


def _setup(message: Message, context: Context, partition_of: int | None = None):
    """The run's settings (checked against the release asked, :func:`_check_release`), this
    node's partition, the model and the windows of this node (or, simulating collusion, of
    partition ``partition_of``)."""
    config = FedPrLLMConfig.from_dict(dict(message.content["config"]))
    _check_release(message, context, config)
    partition = site_partition(context, config.clients)
    model, _ = cached_model(config.model, config.dtype, config.onload)
    which = partition if partition_of is None else partition_of
    windows = with_data_path(context, lambda path: _windows(config, path))[which]
    return config, partition, model, windows


def _reference(message: Message) -> dict | None:
    """The public reference norms the server sent for the compressed wire format, if any."""
    if "reference" not in message.content:
        return None
    return {key: arr.numpy() for key, arr in message.content["reference"].items()}


def _reply(message: Message, payload: dict, metrics: dict) -> Message:
    arrays = ArrayRecord({key: Array(value) for key, value in payload.items()})
    metrics["bytes_up"] = sum(int(v.nbytes) for v in payload.values())
    metrics["pid"] = os.getpid()  # the process that served it: a Ray worker, a SuperNode's app
    return Message(RecordDict({"masks": arrays, "metrics": MetricRecord(metrics)}),
                   reply_to=message)


def warmup(message: Message, context: Context) -> Message:
    """Load the model and cut the windows (what a site does at start-up), reply when ready."""
    start = time.perf_counter()
    _setup(message, context)
    return Message(RecordDict({"metrics": MetricRecord(
        {"seconds": time.perf_counter() - start})}), reply_to=message)


def outliers(message: Message, context: Context) -> Message:
    """OWL's per-layer outlier ratios of this node's Wanda scores (one dense pass)."""
    config, partition, model, windows = _setup(message, context)
    start = time.perf_counter()
    ratios = outlier_ratios(model, windows, config.owl_m, config.batch_size)
    return Message(RecordDict({
        "outliers": ArrayRecord({"ratios": Array(torch.tensor(ratios, dtype=torch.float64)
                                                 .numpy())}),
        "metrics": MetricRecord({"seconds": time.perf_counter() - start,
                                 "windows": len(windows), "partition": partition})}),
        reply_to=message)


#: A simulated site's attack model (:mod:`clients.simulated` sets it around one operation):
#: ``attack(message, context, config, partition, model, windows)`` -> masks, or None for the
#: honest pass. Unset at a deployed site, whose agent never imports the simulation's code.
SIMULATED_MASKS: contextvars.ContextVar[Callable[..., list | None] | None] = \
    contextvars.ContextVar("fedprllm_simulated_masks", default=None)


def _site_masks(message: Message, context: Context, config, partition: int, model, windows):
    """This node's one-shot masks: its local pass (at a simulated attacker, the attack's:
    :data:`SIMULATED_MASKS`)."""
    attack = SIMULATED_MASKS.get()
    masks = attack(message, context, config, partition, model, windows) if attack else None
    if masks is not None:
        return masks
    return local_masks(model, windows, config.prune, batch_size=config.batch_size).masks


def oneshot_masks(message: Message, context: Context) -> Message:
    """All local masks from one sequential pass over this node's windows."""
    config, partition, model, windows = _setup(message, context)
    _record_input(message, context, config, windows, -1, "masks")
    start = time.perf_counter()
    masks = _site_masks(message, context, config, partition, model, windows)
    return _reply(message, encode_wire(flatten_masks(masks), model, config,
                                       _reference(message)),
                  {"seconds": time.perf_counter() - start, "windows": len(windows),
                   "partition": partition})


def fedspallm_release(message: Message, context: Context) -> Message:
    """FedSpaLLM: SparseGPT on this node's windows over the decoder layers the server assigned
    it (``layers``), the others dense; its masks and kept weights
    (:func:`fedcompress.methods.fedspallm.site_release`, :func:`~fedcompress.methods.fedspallm.
    encode_release`)."""
    from fedcompress.methods.fedspallm import encode_release, site_release

    config, partition, model, windows = _setup(message, context)
    _record_input(message, context, config, windows, -1, "masks")
    layers = [int(i) for i in message.content["layers"]["layers"]]
    start = time.perf_counter()
    release = site_release(model, windows, layers, config.sparsity, config.local_group,
                           config.batch_size, config.onload)
    return _reply(message, encode_release(release),
                  {"seconds": time.perf_counter() - start, "windows": len(windows),
                   "partition": partition})


# -- secure aggregation (SecAgg+, fedcompress.privacy.secagg): five messages per vote --------
SECAGG_STATE = "fedprllm_secagg"


def _vote_of(message: Message) -> tuple[int, int, int]:
    """The vote a SecAgg message belongs to: its run, round (group id) and layer."""
    group = message.metadata.group_id or "0"
    if not group.isdigit():
        raise SecAggError(f"a SecAgg message of group {group!r}: expected the round number")
    return (int(message.metadata.run_id), int(group), int(message.content["secagg"]["layer"]))


def _credentials(context: Context):
    """This site's policy, identity key and peers' keys: from its own node config only."""
    from fedcompress.privacy import site
    from fedcompress.privacy.secagg import site_credentials

    policy = site.policy(context.node_config)
    return (policy, *site_credentials(policy.secagg_key, policy.secagg_peers,
                                      policy.simulation))


def _secagg_site(message: Message, context: Context, stage: str) -> SecAggSite:
    """This site's state of the current vote; refuses (SecAggError) a stage that is not the
    next one of this very vote."""
    _, identity, peers = _credentials(context)
    if SECAGG_STATE not in context.state:
        raise SecAggError(f"a SecAgg {stage} stage before any keys stage at this site: refused")
    site = SecAggSite.from_state(dict(context.state[SECAGG_STATE]), identity, peers)
    site.expect(stage, *_vote_of(message))
    return site


def _keep_secagg(context: Context, site: SecAggSite) -> None:
    context.state[SECAGG_STATE] = ConfigRecord(site.to_state())


def _previous_vote(context: Context) -> dict | None:
    return dict(context.state[SECAGG_STATE]) if SECAGG_STATE in context.state else None


def secagg_keys(message: Message, context: Context) -> Message:
    """Stage 1: a new vote (bound to this message's run, round and layer; its threshold at
    least this site's own minimum): fresh key pairs and self-mask seed; the public keys go out,
    signed with this site's identity key (unsigned only in simulation, and the reply says so).
    The server names the sites by their index in this vote (0..n-1)."""
    from fedcompress.privacy.secagg import SecAggConfig

    policy, identity, peers = _credentials(context)
    agg = message.content["secagg"]
    run, rnd, layer = _vote_of(message)
    sites = int(agg["sites"])
    config = SecAggConfig(tuple(range(sites)), int(agg["threshold"]), int(agg["numel"]),
                          int(agg["bits"]), run, rnd, layer, int(agg["neighbours"]))
    federation = len(peers) if peers else sites
    site = SecAggSite.begin(int(agg["index"]), config, _previous_vote(context),
                            min_threshold=policy.min_secagg_threshold(federation),
                            min_neighbours=policy.min_secagg_neighbours(max(federation, 2)),
                            max_colluders=policy.secagg_max_colluders,
                            identity=identity, peers=peers)
    _keep_secagg(context, site)
    advert = site.advertise()
    return Message(RecordDict({"secagg": ConfigRecord({
        "c": advert.c, "s": advert.s, "signature": advert.signature or b"-",
        "signer": advert.signer or b"-", "authenticated": site.authenticated,
        "vote": config.vote_id})}),
        reply_to=message)


def secagg_share(message: Message, context: Context) -> Message:
    """Stage 2: check the relayed advertisements, then this site's encrypted shares for every
    other site (the server relays them)."""
    from fedcompress.privacy.secagg import Advert

    site = _secagg_site(message, context, "share")
    agg = message.content["secagg"]
    public = {n: Advert(c, s, b"" if sig == b"-" else sig, b"" if who == b"-" else who)
              for n, c, s, sig, who in zip(
                  unpack_ints(agg["nodes"]), unpack_blobs(agg["c"]), unpack_blobs(agg["s"]),
                  unpack_blobs(agg["signature"]), unpack_blobs(agg["signer"]), strict=True)}
    try:
        out = site.share(public)
    finally:
        _keep_secagg(context, site)
    nodes = sorted(out)
    return Message(RecordDict({"secagg": ConfigRecord(
        {"dst": pack_ints(nodes), "blob": pack_blobs([out[n] for n in nodes])})}),
        reply_to=message)


def secagg_confirm(message: Message, context: Context) -> Message:
    """Stage 4 (consistency round): this site's signature on the announced survivor set."""
    site = _secagg_site(message, context, "confirm")
    try:
        signature = site.confirm(unpack_ints(message.content["secagg"]["survivors"]))
    finally:
        _keep_secagg(context, site)
    return Message(RecordDict({"secagg": ConfigRecord({"signature": signature or b"-"})}),
                   reply_to=message)


def _votes(flat: dict[str, torch.Tensor], shapes: dict) -> np.ndarray:
    """A site's masks as 0/1 votes in the order of the sorted wire keys."""
    keys = sorted(shapes)
    if sorted(flat) != keys:
        raise RuntimeError("this site's masks do not name the model's layers")
    return np.concatenate([flat[k].reshape(-1).numpy().astype(np.uint8) for k in keys])


def _fixed_point_stats(message: Message, context: Context, config: FedPrLLMConfig, model,
                       windows, sites: int, threshold: int | None = None
                       ) -> tuple[np.ndarray, dict[str, float]]:
    """Statistics mode under SecAgg+: this node's statistics of the round's layer as one
    fixed-point vector; its sharing of inputs must be the one the server announced. With DP:
    its clipped statistics, with its Skellam share in the lanes (distributed placement), and
    the reply's ledger metrics."""
    from fedcompress.methods.fedprllm.stats import encode_fixed

    inputs, layer = _layer_inputs(message, context, config, model, windows)
    step = _dp_step(context, config, model, inputs, layer) if config.dp else None
    stats = (step.clipped.stats if step is not None else
             site_layer_stats(model, inputs, config.prune.needs_hessian, config.batch_size))
    arrays, shared = encode_stats(stats, layer)
    announced = {str(k): str(v) for k, v in message.content["shared"].items()}
    if shared != announced:
        raise ValueError(f"layer {layer}: this site's linear layers share inputs as {shared}, "
                         f"the server announced {announced}")
    if step is not None and step.plan.placement == "distributed":
        from fedcompress.methods.fedprllm.dp import noisy_fixed
        from fedcompress.privacy.dp_stats import secret_rng

        return noisy_fixed(arrays, layer, step.plan, config.prune.needs_hessian, sites,
                           secret_rng(), threshold), step.metrics
    return encode_fixed(arrays, config.secagg_frac_bits, sites), (step.metrics if step else {})


def _dp_step(context: Context, config: FedPrLLMConfig, model, inputs, layer: int):
    """This site's DP release of the round's layer under ITS policy and ledger
    (:func:`fedcompress.methods.fedprllm.dp.site_step`; None: no DP, which its policy allows)."""
    from fedcompress.methods.fedprllm.dp import site_step
    from fedcompress.privacy import site

    policy = site.policy(context.node_config)
    _, tokenizer = cached_model(config.model, config.dtype, config.onload)
    return site_step(policy, site.ledger(policy, context.run_id), context.run_id, config,
                     model, tokenizer, inputs, layer)


def secagg_masks(message: Message, context: Context) -> Message:
    """Stage 3: this site's masks (or, simulated, its attack; iterative: the round's layer), as
    0/1 votes in the order of the sorted wire keys, masked."""
    site = _secagg_site(message, context, "masked")  # before any work: a repeat is refused
    computed = int(message.content["round"]["layer"]) if "round" in message.content else -1
    if computed != site.config.layer:  # the input summed must be the vote's own
        raise SecAggError(f"masked votes of layer {computed} asked in the "
                          f"{site.config.describe()}: refused")
    config, partition, model, windows = _setup(message, context)
    if not (config.aggregate == "stats" and config.dp):  # DP statistics: the DP ledger's
        _record_input(message, context, config, windows, site.config.layer,
                      "statistics" if config.aggregate == "stats" else "masks")
    start = time.perf_counter()
    dp_metrics: dict[str, float] = {}
    if config.aggregate == "stats":  # the round's layer statistics, fixed point
        votes, dp_metrics = _fixed_point_stats(message, context, config, model, windows,
                                               len(site.config.nodes), site.config.threshold)
    elif "round" in message.content:  # iterative: this round's layer only
        layer_masks, layer = _layer_masks(message, context, config, model, windows)
        votes = _votes(flatten_masks([layer_masks], layer), expected_shapes(model, [layer]))
    else:
        votes = _votes(flatten_masks(_site_masks(message, context, config, partition, model,
                                                 windows)), expected_shapes(model))
    agg = message.content["secagg"]
    inbox = dict(zip(unpack_ints(agg["src"]), unpack_blobs(agg["blob"]), strict=True))
    try:
        masked = site.masked(votes, inbox)
    finally:
        _keep_secagg(context, site)
    return Message(RecordDict({
        "masked": ArrayRecord({"words": Array(masked)}),
        "metrics": MetricRecord({"seconds": time.perf_counter() - start,
                                 "windows": len(windows), "partition": partition,
                                 "bytes_up": int(masked.nbytes), **dp_metrics})}),
        reply_to=message)


def secagg_unmask(message: Message, context: Context) -> Message:
    """Stage 5: shares of the survivors' seeds and of the dropped sites' mask keys, only for
    the survivor set this site confirmed, signed by at least the threshold of survivors."""
    site = _secagg_site(message, context, "unmask")
    agg = message.content["secagg"]
    signatures = (dict(zip(unpack_ints(agg["signers"]), unpack_blobs(agg["signatures"]),
                           strict=True)) if "signers" in agg else {})
    try:
        out = site.unmask(unpack_ints(agg["survivors"]), signatures)
    finally:
        _keep_secagg(context, site)  # its secrets wiped; its history kept
    nodes = sorted(out)
    return Message(RecordDict({"secagg": ConfigRecord(
        {"of": pack_ints(nodes), "share": pack_blobs([out[n] for n in nodes])})}),
        reply_to=message)


def _weights_of(record, shapes: dict[str, tuple]) -> dict[int, dict[str, torch.Tensor]]:
    """The server's updated weights (statistics mode, SparseGPT) by layer, checked against the
    model's shapes."""
    arrays = {key: arr.numpy() for key, arr in record.items()}
    if set(arrays) != set(shapes):
        raise ValueError(f"updated weights for {sorted(arrays)[:3]}: expected {sorted(shapes)[:3]}")
    for key, value in arrays.items():
        if tuple(value.shape) != tuple(shapes[key]) or not np.isfinite(value).all():
            raise ValueError(f"updated weight {key}: {value.shape}, expected finite "
                             f"{shapes[key]}")
    return masks_by_layer({k: torch.from_numpy(v.copy()) for k, v in arrays.items()})


def _layer_inputs(message: Message, context: Context, config: FedPrLLMConfig, model, windows):
    """A layer-per-round run: this node's inputs of the round's layer, after the previous
    layer's global mask (and updated weights, statistics mode with SparseGPT), from its kept
    activations, or recomputed when the server sends a resync; the new activations are kept in
    the context state. Returns ``(inputs, layer)``."""
    layer = int(message.content["round"]["layer"])
    prev_hidden = prev_global = prev_weights = None
    cache_key = (config.model, config.dtype, config.seqlen)
    if layer > 0:
        payload = {key: arr.numpy() for key, arr in message.content["global"].items()}
        decoded = decode_masks(payload, expected_shapes(model, [layer - 1]),
                               config.prune.plan, config.mask_tolerance)
        prev_global = masks_by_layer(decoded)[layer - 1]
        weights = (_weights_of(message.content["global_weights"],
                               expected_shapes(model, [layer - 1]))
                   if "global_weights" in message.content else {})
        prev_weights = weights.get(layer - 1)
        if "resync" in message.content:  # this site missed rounds, or the server resumed
            earlier = list(range(layer - 1))
            packed = {key: arr.numpy() for key, arr in message.content["resync"].items()}
            globals_ = masks_by_layer(decode_masks(
                packed, expected_shapes(model, earlier), config.prune.plan,
                config.mask_tolerance)) if earlier else {}
            earlier_weights = (_weights_of(message.content["resync_weights"],
                                           expected_shapes(model, earlier))
                               if earlier and "resync_weights" in message.content else None)
            prev_hidden, _KWARGS[cache_key] = resync_inputs(model, windows, layer, globals_,
                                                            config.batch_size, earlier_weights)
        elif "fedprllm" in context.state:
            prev_hidden = torch.from_numpy(context.state["fedprllm"]["hidden"].numpy())
        else:
            raise RuntimeError(f"round for layer {layer}: this node holds no activations of "
                               f"layer {layer - 1} (did it miss the previous round?)")
    inputs = advance_to_layer(model, windows, layer, prev_hidden, prev_global,
                              _KWARGS.get(cache_key), config.batch_size, prev_weights)
    _KWARGS[cache_key] = inputs.layer_kwargs
    context.state["fedprllm"] = ArrayRecord({"hidden": Array(inputs.hidden.contiguous().numpy())})
    return inputs, layer


def _layer_masks(message: Message, context: Context, config: FedPrLLMConfig, model, windows
                 ) -> tuple[dict, int]:
    """Iterative mode: this node's masks of the round's layer (:func:`_layer_inputs`)."""
    inputs, layer = _layer_inputs(message, context, config, model, windows)
    return site_layer_masks(model, inputs, config.prune, config.batch_size), layer


def layer_stats(message: Message, context: Context) -> Message:
    """Statistics mode: the sums of this node's input statistics of the round's layer (after
    the previous layer's global masks and updated weights), nothing else."""
    config, partition, model, windows = _setup(message, context)
    if not config.dp:  # DP statistics are bounded by the DP ledger
        _record_input(message, context, config, windows,
                      int(message.content["round"]["layer"]), "statistics")
    start = time.perf_counter()
    inputs, layer = _layer_inputs(message, context, config, model, windows)
    step = _dp_step(context, config, model, inputs, layer) if config.dp else None
    stats = (step.clipped.stats if step is not None else
             site_layer_stats(model, inputs, config.prune.needs_hessian, config.batch_size))
    arrays, shared = encode_stats(stats, layer)
    metrics = {"seconds": time.perf_counter() - start, "layer": layer, "partition": partition,
               "windows": len(windows), "bytes_up": sum(int(v.nbytes) for v in arrays.values()),
               **(step.metrics if step is not None else {})}
    return Message(RecordDict({
        "stats": ArrayRecord({key: Array(value) for key, value in arrays.items()}),
        "shared": ConfigRecord(dict(shared)), "metrics": MetricRecord(metrics)}),
        reply_to=message)


def iterative_layer_mask(message: Message, context: Context) -> Message:
    """Masks of one decoder layer, after applying the global mask of the previous one."""
    config, partition, model, windows = _setup(message, context)
    _record_input(message, context, config, windows, int(message.content["round"]["layer"]),
                  "masks")
    start = time.perf_counter()
    masks, layer = _layer_masks(message, context, config, model, windows)
    return _reply(message, encode_wire(flatten_masks([masks], layer), model, config,
                                       _reference(message)),
                  {"seconds": time.perf_counter() - start, "layer": layer,
                   "partition": partition})
