"""FedPrLLM's ClientApp handlers: this node's local prune masks on its private calibration windows.

The one ClientApp of the FAB (``clients/app.py``) calls these for the message types the method
declares (``fedcompress.methods.fedprllm.METHOD.actions``):

* ``train.masks`` (one-shot): every layer's masks in one reply;
* ``train.layer_mask`` (iterative): one layer per round; this node keeps its activations in its
  Flower context state and first applies the server's global mask of the previous layer;
* ``query.outliers`` (``sparsity_profile=owl``, before the pruning rounds): OWL's outlier ratio of
  every decoder layer on this node's windows (L numbers, nothing else).

The dense model is loaded once per process (cached) and never mutated across calls.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict

from clients.common import cached_model, site_partition, with_data_path
from fedcompress.masks.stats import flatten_masks
from fedcompress.methods.fedprllm.attacks import attack_masks, is_attacker
from fedcompress.methods.fedprllm.federated import (
    FedPrLLMConfig,
    decode_masks,
    encode_wire,
    expected_shapes,
    federation_windows,
    iterative_client_step,
    masks_by_layer,
)
from fedcompress.pruning.local import local_masks, outlier_ratios

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _windows(config: FedPrLLMConfig, data_path: str | None) -> list[torch.Tensor]:
    """All clients' windows (a seeded pool split by partition); cheap next to pruning."""
    _, tokenizer = cached_model(config.model, config.dtype)
    return federation_windows(tokenizer, config, data_path)[0]


_KWARGS: dict[tuple, list[dict]] = {}


def _setup(message: Message, context: Context, partition_of: int | None = None):
    """The run's settings, this node's partition, the model and the windows of this node (or,
    simulating collusion, of partition ``partition_of``)."""
    config = FedPrLLMConfig.from_dict(dict(message.content["config"]))
    partition = site_partition(context, config.clients)
    model, _ = cached_model(config.model, config.dtype)
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


def oneshot_masks(message: Message, context: Context) -> Message:
    """All local masks from one sequential pass over this node's windows."""
    config, partition, model, windows = _setup(message, context)
    start = time.perf_counter()
    if is_attacker(partition, config.attackers):  # a simulated Byzantine site
        first = (_setup(message, context, partition_of=0)[3] if config.attack == "collude"
                 else None)
        masks = attack_masks(config.attack, model, windows, config.prune, config.seed,
                             partition, config.batch_size, first)
        logger.warning("partition %d attacks (%s)", partition, config.attack)
    else:
        masks = local_masks(model, windows, config.prune, batch_size=config.batch_size).masks
    return _reply(message, encode_wire(flatten_masks(masks), model, config,
                                       _reference(message)),
                  {"seconds": time.perf_counter() - start, "windows": len(windows),
                   "partition": partition})


def iterative_layer_mask(message: Message, context: Context) -> Message:
    """Masks of one decoder layer, after applying the global mask of the previous one."""
    config, partition, model, windows = _setup(message, context)
    layer = int(message.content["round"]["layer"])
    start = time.perf_counter()
    prev_hidden = prev_global = None
    if layer > 0:
        if "fedprllm" not in context.state:
            raise RuntimeError(f"round for layer {layer}: this node holds no activations of "
                               f"layer {layer - 1} (did it miss the previous round?)")
        prev_hidden = torch.from_numpy(context.state["fedprllm"]["hidden"].numpy())
        payload = {key: arr.numpy() for key, arr in message.content["global"].items()}
        decoded = decode_masks(payload, expected_shapes(model, [layer - 1]),
                               config.prune.plan, config.mask_tolerance)
        prev_global = masks_by_layer(decoded)[layer - 1]
    cache_key = (config.model, config.dtype, config.seqlen)
    masks, hidden, kwargs = iterative_client_step(
        model, windows, layer, prev_hidden, prev_global, config.prune,
        _KWARGS.get(cache_key), config.batch_size)
    _KWARGS[cache_key] = kwargs
    context.state["fedprllm"] = ArrayRecord({"hidden": Array(hidden.contiguous().numpy())})
    return _reply(message, encode_wire(flatten_masks([masks], layer), model, config,
                                       _reference(message)),
                  {"seconds": time.perf_counter() - start, "layer": layer,
                   "partition": partition})
