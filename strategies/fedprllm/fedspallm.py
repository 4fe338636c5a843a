"""FedSpaLLM, the peer system, as a strategy (``--aggregate fedspallm``): one round in which
each site prunes the decoder layers the server assigned it with SparseGPT and sends their masks
and kept weights; the server's l0-norm average and mask expansion
(:mod:`fedcompress.methods.fedspallm`) give the global model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedcompress.methods.fedprllm.config import FedPrLLMConfig
from fedcompress.methods.fedspallm import (
    L0Sum,
    SiteRelease,
    assign_layers,
    decode_release,
)
from fedcompress.models import ModelAdapter
from strategies.common import (
    collect_valid_replies,
    reply_metrics,
    require_valid,
    settings_record,
)
from strategies.fedprllm.oneshot import FedPrLLM

logger = logging.getLogger(__name__)


class FedSpaLLMStrategy(FedPrLLM):
    """FedSpaLLM: the server assigns each asked node its decoder layers
    (:func:`~fedcompress.methods.fedspallm.assign_layers`, ``fedspallm_layers`` per site, seeded
    by the run's seed: a public choice, in the order the nodes are asked) and sends them with
    the request; a reply is its release (:func:`~fedcompress.methods.fedspallm.decode_release`:
    exactly its layers, valid masks, one finite value per kept weight), else it is rejected
    with its reason. The valid releases are added to one :class:`~fedcompress.methods.fedspallm.
    L0Sum` as they come, in node order, and dropped (the server holds the sum, not the
    releases; ``spill``: a folder that holds the sum on disk instead); :meth:`prune` expands it,
    for the configured server comparison group or another one (the releases serve every
    group)."""

    action = "train.fedspallm"

    def __init__(self, config: FedPrLLMConfig, model: torch.nn.Module, node_wait: float = 120.0,
                 spill: Path | None = None):
        super().__init__(config, model, node_wait, reference_wire=None, streaming=False)
        self.n_layers = len(ModelAdapter(model))
        budget = config.fedspallm_layers or self.n_layers
        if budget > self.n_layers:
            raise ValueError(f"fedspallm_layers={budget}: the model has {self.n_layers} decoder "
                             "layers")
        #: every node's assigned layers, in the order the nodes were asked
        self.assignment = assign_layers(self.n_layers, [budget] * config.clients, config.seed)
        self.node_layers: dict[int, list[int]] = {}
        #: the server's l0 sum of the valid releases, and their nodes in the order added
        self.total = L0Sum(model, spill)
        self.released: list[int] = []

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        settings = settings_record(self.config)
        messages = []
        for node, layers in zip(self._nodes(grid), self.assignment):
            self.node_layers[node] = layers
            content = RecordDict({"config": settings,
                                  "layers": ConfigRecord({"layers": list(layers)})})
            self.outcome.bytes_down += sum(r.count_bytes() for r in content.values())
            messages.append(Message(content, node, self.action, group_id=str(server_round)))
        self.asked[server_round] = [m.metadata.dst_node_id for m in messages]
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        def validate(reply: Message) -> SiteRelease:
            layers = self.node_layers.get(reply.metadata.src_node_id)
            if layers is None:
                raise ValueError("a release from a node that was not asked")
            if reply.metadata.src_node_id in self.released:
                raise ValueError("a second release from a node already in the sum")
            payload = {k: a.numpy() for k, a in reply.content["masks"].items()}
            return decode_release(payload, layers, self.shapes)  # every layer's shapes

        valid, rejected = collect_valid_replies(
            replies, validate, stage="release", server_round=server_round, what="release",
            asked=self.asked.get(server_round), timeout=self.round_timeout)
        self.outcome.add_rejected(rejected)
        for reply, release in valid:  # (in partition order: float sums in a fixed order)
            node = reply.metadata.src_node_id
            self.total.add(release)
            self.released.append(node)
            self.site_nodes.setdefault(server_round, []).append(node)
            self.outcome.client_metrics.append({"stage": "release", "round": server_round,
                                                "node": node, "layers": len(release.layers),
                                                **reply_metrics(reply)})
        require_valid(len(valid), self.config.required_clients, "releases", server_round,
                      [r["reason"] for r in rejected])
        return None, MetricRecord({"valid_clients": len(valid), "rejected": len(rejected)})

    def prune(self, model: torch.nn.Module, server: Any = None) -> dict[str, float]:
        """Prune (and set the weights of) ``model`` with the l0 average and mask expansion of
        the valid releases' sum, one decoder layer at a time, within the comparison group of
        ``server`` (default: the configured one); returns each linear layer's pruned
        fraction."""
        from fedcompress.masks.codec import mask_key
        from fedcompress.pruning.local import apply_layer_masks

        fractions: dict[str, float] = {}
        for index, masks, weights in self.total.layers(self.config.sparsity,
                                                      (server or self.config.server).group):
            apply_layer_masks(model, index, masks, weights)
            fractions.update({mask_key(index, name): float(m.float().mean())
                              for name, m in masks.items()})
        return fractions
