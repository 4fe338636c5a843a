"""FedPrLLM's statistics mode (:class:`StatsFedPrLLM`): each round sums the sites' input
statistics of one decoder layer and prunes it as centralized pruning would; and the same with
the statistics summed by SecAgg+ (:class:`SecureStatsFedPrLLM`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedcompress.methods.fedprllm.config import FedPrLLMConfig
from fedcompress.methods.fedprllm.federated import mask_key, masks_by_layer
from fedcompress.models import ModelAdapter
from strategies.common import (
    NotEnoughClientsError,
    collect_valid_replies,
    reply_metrics,
    require_valid,
)
from strategies.fedprllm.iterative import IterativeFedPrLLM
from strategies.fedprllm.secure import _SecureVote

logger = logging.getLogger(__name__)


class StatsFedPrLLM(IterativeFedPrLLM):
    """Statistics mode (:mod:`fedcompress.methods.fedprllm.stats`): round ``r`` sums the
    sites' input statistics of decoder layer ``r - 1`` and prunes it exactly as centralized
    pruning on the union of their windows; its global masks (and SparseGPT's updated weights)
    go out with the next request. Invalid statistics are rejected with their reason; resync of
    returning sites and checkpoints as in the iterative vote."""

    action = "train.layer_stats"

    def __init__(self, config: FedPrLLMConfig, model: torch.nn.Module, node_wait: float = 120.0,
                 reference_wire: dict | None = None, checkpoint: Path | None = None,
                 tokenizer=None):
        from fedcompress.methods.fedprllm.dp import server_plan

        super().__init__(config, model, node_wait, reference_wire, checkpoint)
        #: the run's DP mechanism (the server's copy; every site computes and enforces its own)
        self.dp_plan = server_plan(config, model, tokenizer)
        #: public text's own statistics at each layer (``dp_prior="public"``)
        self.public_prior = None
        if self.dp_plan is not None and config.dp_prior == "public":
            from fedcompress.methods.fedprllm.dp import PublicPrior

            self.public_prior = PublicPrior(model, tokenizer, config.seqlen,
                                            config.dp_public_windows, config.batch_size,
                                            config.dp_public_text,
                                            (config.dp_public_file,))
        # Float sums depend on their order: a layer's statistics are summed in node order,
        # after the round (one round holds one decoder layer's statistics per site).
        self.streaming = False
        self.global_weights: dict[int, dict[str, torch.Tensor]] = {}
        #: with quantization (``config.quant``): every layer's integers, scales and zero points
        #: (what the saved model holds; its global weights are their dequantized values)
        self.quantized: dict[int, dict] = {}
        self.layer_sites: dict[int, int] = {}
        #: per layer: seconds of the server's pruning step, bytes of one site's statistics
        self.layer_cost: dict[int, dict[str, float]] = {}

    def _weights_record(self, layers: Iterable[int]) -> ArrayRecord:
        return ArrayRecord({mask_key(i, name): Array(w.numpy()) for i in layers
                            for name, w in self.global_weights.get(i, {}).items()})

    def _content(self, server_round: int) -> RecordDict:  # type: ignore[override]
        content = super()._content(server_round)
        layer = self._layer(server_round)
        if layer > 0 and self.global_weights.get(layer - 1):
            content["global_weights"] = self._weights_record([layer - 1])
        return content

    def _resync_records(self, layer: int) -> dict[str, ArrayRecord]:
        records = super()._resync_records(layer)
        if any(self.global_weights.get(i) for i in range(layer - 1)):
            records["resync_weights"] = self._weights_record(range(layer - 1))
        return records

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        from fedcompress.methods.fedprllm.stats import (
            StatsAggregator,
            layer_in_features,
            validate_stats,
        )

        layer = self._layer(server_round)
        features = layer_in_features(self.model, layer)
        hessian = self.config.prune.needs_hessian
        aggregator = StatsAggregator(features, hessian)

        def validate(reply: Message):
            arrays = {k: a.numpy() for k, a in reply.content["stats"].items()}
            shared = {str(k): str(v) for k, v in reply.content["shared"].items()}
            return validate_stats(arrays, shared, features, layer, hessian)

        valid, rejected = collect_valid_replies(replies, validate, stage="stats",
                                                server_round=layer + 1, what="statistics",
                                                asked=self.asked.get(server_round),
                                                timeout=self.round_timeout)
        self.outcome.add_rejected(rejected, layer=layer)
        for reply, stats in valid:  # (in partition order: float64 sums in a fixed order)
            aggregator.add(stats)
            self.site_nodes.setdefault(layer + 1, []).append(reply.metadata.src_node_id)
            self.outcome.client_metrics.append({"stage": "stats", "round": layer + 1,
                                                "node": reply.metadata.src_node_id,
                                                **reply_metrics(reply)})
        require_valid(len(valid), self.config.required_clients, "statistics", layer + 1,
                      [r["reason"] for r in rejected])
        self._finish_stats_layer(layer, aggregator)
        return None, MetricRecord({"layer": layer, "valid_clients": aggregator.sites})

    def _finish_stats_layer(self, layer: int, aggregator) -> None:
        from fedcompress.methods.fedprllm.stats import quantize_layer

        start = time.monotonic()
        stats = aggregator.layer_stats()
        if self.dp_plan is not None:  # central noise (central placement), post-processing
            from fedcompress.methods.fedprllm.dp import server_finish
            from fedcompress.methods.fedprllm.stats import layer_sharing

            hessian = self.config.prune.needs_hessian
            prior_stats = (None if self.public_prior is None else self.public_prior.layer_stats(
                layer, self.global_masks, self.global_weights, hessian))
            stats = server_finish(dict(stats), layer_sharing(self.model, layer), self.dp_plan,
                                  layer, hessian, aggregator.sites, prior=self.config.dp_prior,
                                  prior_stats=prior_stats)
        masks, weights, quantized = quantize_layer(self.model, layer, stats, self.config.prune)
        self.layer_cost[layer] = {"server_seconds": time.monotonic() - start,
                                  "sites": aggregator.sites}
        self.global_masks[layer] = masks
        if weights:
            self.global_weights[layer] = weights
        if quantized is not None:
            self.quantized[layer] = quantized
        self.layer_sites[layer] = aggregator.sites
        self.layer_nodes[layer] = set(self.site_nodes.get(layer + 1, []))
        if self.checkpoint is not None:
            self._save(layer, aggregator)

    def _checkpoint_arrays(self, layer: int, aggregator) -> dict[str, np.ndarray]:
        arrays = {f"weight/{mask_key(layer, name)}": w.numpy()
                  for name, w in self.global_weights.get(layer, {}).items()}
        for name, result in self.quantized.get(layer, {}).items():
            key = mask_key(layer, name)
            arrays.update({f"quant/{key}/q": result.q.numpy(),
                           f"quant/{key}/scale": result.scale.float().numpy(),
                           f"quant/{key}/zero_point": result.zero_point.numpy()})
            if result.g_idx is not None:
                arrays[f"quant/{key}/g_idx"] = result.g_idx.numpy()
        return arrays

    @staticmethod
    def _sites_of(aggregator) -> int:
        return aggregator.sites

    def _restore_layer(self, layer: int, arrays: dict[str, np.ndarray], sites: int) -> None:
        weights = {k[7:]: torch.from_numpy(v.copy()) for k, v in arrays.items()
                   if k.startswith("weight/")}
        if weights:
            self.global_weights[layer] = masks_by_layer(weights)[layer]
        quant = self.config.quant_config
        if quant is not None:
            self.quantized[layer] = self._restore_quantized(layer, arrays, quant)
        self.layer_sites[layer] = sites

    def _restore_quantized(self, layer: int, arrays: dict[str, np.ndarray], quant) -> dict:
        """A checkpointed layer's quantization, checked against its global weights (each must
        be its integers' dequantized value, bit for bit)."""
        from fedcompress.quant.solver import QuantResult

        restored = {}
        weight_dtype = next(self.model.parameters()).dtype  # the dequantization's (solver)
        for name, weight in self.global_weights.get(layer, {}).items():
            key = f"quant/{mask_key(layer, name)}"
            if f"{key}/q" not in arrays:
                raise ValueError(f"checkpoint of layer {layer}: no quantized {name} (expected "
                                 "the integers of every quantized linear layer)")
            g_idx = arrays.get(f"{key}/g_idx")
            result = QuantResult(
                torch.from_numpy(arrays[f"{key}/q"].copy()),
                torch.from_numpy(arrays[f"{key}/scale"].copy()).to(quant.torch_scale_dtype),
                torch.from_numpy(arrays[f"{key}/zero_point"].copy()),
                None if g_idx is None else torch.from_numpy(g_idx.copy()),
                quant.group_size, quant.symmetric, weight_dtype)
            if not torch.equal(result.weight, weight):
                raise ValueError(f"checkpoint of layer {layer}: {name}'s integers do not give "
                                 "its saved weights (expected an unchanged checkpoint)")
            restored[name] = result
        return restored

    @torch.no_grad()
    def prune(self, model: torch.nn.Module, server=None) -> dict[str, float]:
        """Apply every layer's global masks (and updated weights) to ``model``."""
        from fedcompress.models import weight_matrix

        if server is not None and server != self.config.server:
            raise ValueError("statistics mode has no server variants")
        layers = ModelAdapter(model).layers
        pruned = {}
        for layer, masks in sorted(self.global_masks.items()):
            linears = ModelAdapter.linear_layers(layers[layer])
            for name, mask in masks.items():
                w = weight_matrix(linears[name])
                if layer in self.global_weights and name in self.global_weights[layer]:
                    w.copy_(self.global_weights[layer][name].to(w.dtype))
                w.masked_fill_(mask.to(w.device), 0)
                pruned[mask_key(layer, name)] = float(mask.float().mean())
        return pruned


class SecureStatsFedPrLLM(_SecureVote, StatsFedPrLLM):
    """Statistics mode whose every layer's statistics are summed by SecAgg+: each site sends
    its statistics as one fixed-point vector (:func:`~fedcompress.methods.fedprllm.stats.
    encode_fixed`, ``secagg_frac_bits``) masked in 64-bit lanes, and the server learns only
    the sum, from which it prunes the layer as the plain statistics mode does (four exchanges
    per decoder layer, fresh keys each time). Which linear layers share their inputs (sent
    once) follows from the architecture (:func:`~fedcompress.methods.fedprllm.stats.
    layer_sharing`) and is announced; a site whose statistics do not match refuses."""

    def __init__(self, config: FedPrLLMConfig, model: torch.nn.Module, node_wait: float = 120.0,
                 reference_wire: dict | None = None, checkpoint: Path | None = None,
                 tokenizer=None):
        super().__init__(config, model, node_wait, reference_wire, checkpoint, tokenizer)
        self._init_secure()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 1,
              timeout: float = 3600, **_ignored) -> None:
        from fedcompress.methods.fedprllm.stats import (
            StatsAggregator,
            decode_fixed,
            decode_stats,
            layer_in_features,
            layer_sharing,
            stats_layout,
        )

        hessian = self.config.prune.needs_hessian
        frac_bits = self.config.secagg_frac_bits
        dp = self.dp_plan is not None
        if self.dp_plan is not None and self.dp_plan.placement == "distributed":
            frac_bits = self.dp_plan.frac_bits  # the sites' Skellam lanes
        for server_round in range(1, self.num_rounds + 1):
            layer = self._layer(server_round)
            features = layer_in_features(self.model, layer)
            shared = layer_sharing(self.model, layer)
            layout, dtypes = stats_layout(features, shared, hessian, layer)
            contents = self._layer_contents(server_round, self._nodes(grid))
            for content in contents.values():
                content["shared"] = ConfigRecord(dict(shared))
            numel = sum(size for _, size in layout)
            total, sites = self._secure_sum(grid, list(contents), numel, 64,
                                            contents.__getitem__, timeout, layer + 1, layer)
            summed = decode_fixed(total, layout, frac_bits, dtypes)
            try:
                stats = decode_stats(summed, shared, features, layer, hessian, dp=dp)
            except ValueError as err:  # only the sum is visible: no site can be left out
                raise NotEnoughClientsError(f"layer {layer}: the securely summed statistics "
                                            f"are invalid ({err})") from err
            aggregator = StatsAggregator(features, hessian)
            aggregator.add(stats)
            aggregator.sites = len(sites)
            self.site_nodes[layer + 1] = sites
            self._finish_stats_layer(layer, aggregator)
            logger.info("layer %d: statistics of %d sites summed securely", layer, len(sites))
