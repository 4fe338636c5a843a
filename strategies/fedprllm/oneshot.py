"""The one-shot FedPrLLM strategy (:class:`FedPrLLM`: one round in which every site sends every
layer's masks), and what every FedPrLLM strategy builds on: the nodes to ask, start-up, OWL's
outlier round, the validation of a round's masks into an aggregator, and the robust-voting
decisions kept with the nodes they concern."""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedcompress.methods.fedprllm.config import FedPrLLMConfig
from fedcompress.methods.fedprllm.federated import MaskAggregator, decode_wire
from fedcompress.models import ModelAdapter
from strategies.common import (
    NotEnoughClientsError,
    StrategyOutcome,
    StreamingGrid,
    collect_valid_replies,
    reply_metrics,
    require_valid,
    settings_record,
    silent_nodes,
    sort_replies,
    wait_for_nodes,
)

logger = logging.getLogger(__name__)


class FedPrLLM(Strategy):
    """One-shot FedPrLLM: one round in which every client sends every layer's masks."""

    action = "train.masks"

    def __init__(self, config: FedPrLLMConfig, model: torch.nn.Module, node_wait: float = 120.0,
                 reference_wire: dict | None = None, streaming: bool | None = None):
        self.config = config
        #: Count each site's masks as its reply arrives, holding only the running counts
        #: (default: unless the configured defence compares sites, which needs every mask).
        self.streaming = not config.server.rejects if streaming is None else streaming
        # Compressed wire format: the public reference norms sent with every request.
        self.reference_wire = reference_wire
        self.node_wait = node_wait
        self.model = model
        self.outcome = StrategyOutcome()
        self.failed_nodes: set[int] = set()  # failed at start-up: not asked again
        #: per Flower round, the nodes asked (those without a reply are recorded as rejected)
        self.asked: dict[int, list[int]] = {}
        self.round_timeout: float | None = None  # the timeout given to start()
        #: per round, the node of each site in the order its masks were added
        self.site_nodes: dict[int, list[int]] = {}
        #: the robust-voting decisions, per server variant label (and per layer if iterative)
        self.defence: dict[str, Any] = {}
        self.aggregator = self._new_aggregator()
        self.shapes = self.aggregator.shapes

    def _new_aggregator(self, layers: list[int] | None = None) -> MaskAggregator:
        return MaskAggregator(self.model, self.config.clients, layers,
                              streaming=self.streaming)

    # -- Strategy API --------------------------------------------------------------------------
    def _nodes(self, grid: Grid) -> list[int]:
        """The nodes to ask: the first ``clients`` connected, less those that failed at
        start-up (:meth:`warmup`; their error is recorded once, they are not asked again)."""
        nodes = wait_for_nodes(grid, self.config.clients, self.config.required_clients,
                               self.node_wait)
        usable = [n for n in nodes if n not in self.failed_nodes]
        if len(usable) < self.config.required_clients:
            raise NotEnoughClientsError(
                f"{len(usable)} usable node(s) ({len(nodes) - len(usable)} failed at start-up: "
                f"{self.outcome.reasons('warmup')}), the run needs "
                f"{self.config.required_clients}")
        return usable

    def warmup(self, grid: Grid, timeout: float) -> float:
        """Ask every client to load its model and data before the timed rounds (the engine's
        and the sites' one-off start-up); returns its wall time in seconds."""
        start = time.monotonic()
        content = RecordDict({"config": settings_record(self.config)})
        nodes = self._nodes(grid)
        replies = grid.send_and_receive(
            [Message(content, node, "query.warmup") for node in nodes], timeout=timeout)
        def validate(reply: Message) -> dict[str, Any]:
            metrics = dict(reply.content["metrics"])
            float(metrics["seconds"])
            return metrics

        valid, rejected = collect_valid_replies(
            replies, validate, stage="warmup", server_round=0, what="start-up reply",
            asked=nodes, timeout=timeout)
        for record in rejected:
            if record["reason"].startswith("no reply"):
                continue  # slow to start: asked again in the rounds
            self.failed_nodes.add(record["node"])
            record["reason"] = record["reason"].replace("client error:",
                                                        "client error at start-up:", 1)
        self.outcome.add_rejected(rejected)
        for reply, metrics in valid:  # imports + loading; a ClientApp without the split: loading
            self.outcome.startup_seconds.append(
                float(metrics.get("client_startup_seconds", metrics["seconds"])))
            self.outcome.warmup_metrics.append({"stage": "warmup", "round": 0,
                                                "node": reply.metadata.src_node_id, **metrics})
        return time.monotonic() - start

    def collect_outliers(self, grid: Grid, timeout: float) -> list[list[float]]:
        """OWL's round 0: every client's per-layer outlier ratios (validated: one finite share
        in [0, 1] per decoder layer); fewer valid replies than ``required_clients`` end the
        run (:class:`NotEnoughClientsError`)."""
        layers = len(ModelAdapter(self.model))
        content = RecordDict({"config": settings_record(self.config)})
        nodes = self._nodes(grid)
        self.outcome.bytes_down += len(nodes) * sum(r.count_bytes() for r in content.values())
        replies = grid.send_and_receive(
            [Message(content, node, "query.outliers") for node in nodes], timeout=timeout)

        def validate(reply: Message) -> list[float]:
            ratios = reply.content["outliers"]["ratios"].numpy()
            if ratios.shape != (layers,):
                raise ValueError(f"outlier ratios of shape {ratios.shape}: expected ({layers},)")
            if not np.isfinite(ratios).all() or (ratios < 0).any() or (ratios > 1).any():
                raise ValueError("outlier ratios outside [0, 1]")
            return [float(x) for x in ratios]

        valid, rejected = collect_valid_replies(replies, validate, stage="outliers",
                                                server_round=0, what="outlier ratios",
                                                asked=nodes, timeout=timeout)
        self.outcome.add_rejected(rejected)
        require_valid(len(valid), self.config.required_clients, "outlier ratios", 0,
                      [r["reason"] for r in rejected])
        return [ratios for _, ratios in valid]  # (in partition order: their mean, a fixed order)

    def set_plan(self, layer_sparsity: str) -> None:
        """Prune every later round with this per-layer plan (it travels in the config)."""
        self.config = self.config.replace(layer_sparsity=layer_sparsity)

    def _content(self, server_round: int, layers: list[int] | None = None) -> RecordDict:
        content = RecordDict({"config": settings_record(self.config)})
        if self.reference_wire:
            keys = [k for k in self.reference_wire
                    if layers is None or int(k.split(".")[1]) in layers]
            content["reference"] = ArrayRecord({k: Array(self.reference_wire[k]) for k in keys})
        return content

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        content = self._content(server_round)
        messages = [Message(content, node, self.action, group_id=str(server_round))
                    for node in self._nodes(grid)]
        self.asked[server_round] = [m.metadata.dst_node_id for m in messages]
        self.outcome.bytes_down += len(messages) * sum(r.count_bytes() for r in content.values())
        return messages

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn=None) -> Result:
        """Flower's round loop (``Strategy.start``), the round ``timeout`` kept for the
        rejection records of the nodes that did not reply in time; when :attr:`streaming`,
        each round's replies reach :meth:`aggregate_train` as they arrive
        (:class:`~strategies.common.StreamingGrid`)."""
        self.round_timeout = timeout
        return super().start(StreamingGrid(grid) if self.streaming else grid, initial_arrays,
                             num_rounds, timeout, train_config, evaluate_config, evaluate_fn)

    def _collect(self, server_round: int, replies: Iterable[Message],
                 aggregator: MaskAggregator, asked: list[int] | None = None,
                 **where: Any) -> None:
        """Validate a round's masks into ``aggregator``; the rejections (and the ``asked``
        nodes without a reply) are recorded with ``where`` (``layer=``)."""
        def validate(reply: Message) -> dict:
            payload = {k: a.numpy() for k, a in reply.content["masks"].items()}
            return decode_wire(payload, aggregator.shapes, self.model, self.config,
                               self.reference_wire)

        if not aggregator.streaming:  # every payload is kept: count them in node order
            replies = sorted(replies, key=lambda r: r.metadata.src_node_id)
        rejected: list[dict[str, Any]] = []
        nodes: list[int] = []
        metrics: list[dict[str, Any]] = []
        # one reply at a time: with a streaming aggregator and grid (:meth:`start`), a reply is
        # counted and dropped before the next one is pulled
        for reply, packed in sort_replies(replies, validate, stage="masks",
                                          server_round=server_round, what="masks",
                                          rejected=rejected):
            aggregator.add_packed(packed)
            del packed
            nodes.append(reply.metadata.src_node_id)
            metrics.append({"stage": "masks", "round": server_round,
                            "node": reply.metadata.src_node_id, **reply_metrics(reply)})
        rejected.sort(key=lambda r: r["node"])  # (arrival order differs between runs)
        rejected += silent_nodes(asked, nodes + [r["node"] for r in rejected], "masks",
                                 server_round, self.round_timeout)
        self.outcome.add_rejected(rejected, **where)
        order = sorted(range(len(nodes)), key=nodes.__getitem__)
        self.site_nodes.setdefault(server_round, []).extend(nodes[i] for i in order)
        self.outcome.client_metrics += [metrics[i] for i in order]
        require_valid(len(nodes), self.config.required_clients, "masks", server_round,
                      [r["reason"] for r in rejected])

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self._collect(server_round, replies, self.aggregator, self.asked.get(server_round))
        return None, MetricRecord({"valid_clients": self.aggregator.clients,
                                   "rejected": len(self.outcome.rejected)})

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []  # evaluation of the pruned model runs on the server

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        logger.info("%s: %s", type(self).__name__, self.config)

    @property
    def num_rounds(self) -> int:
        return 1

    # -- Result --------------------------------------------------------------------------------
    def prune(self, model: torch.nn.Module, server=None) -> dict[str, float]:
        """Prune a copy of the global model with the vote (``server`` overrides the config's
        server variant: one-shot masks serve every variant); returns each linear layer's
        pruned fraction."""
        server = server or self.config.server
        pruned = self.aggregator.prune(model, server, self.config.prune.plan,
                                       self.config.prune.nm_pattern)
        self._record_defence(server, self.aggregator, self.site_nodes.get(1, []))
        return pruned

    def _record_defence(self, server, aggregator: MaskAggregator, nodes: list[int],
                        layer: int | None = None) -> None:
        """Keep the Hamming defence's decision with the nodes it concerns (the report's)."""
        rejection = aggregator.rejection
        if rejection is None:
            return
        record = {**rejection.to_dict(), "nodes": list(nodes),
                  "rejected_nodes": [nodes[i] for i in rejection.rejected if i < len(nodes)]}
        entry = self.defence.setdefault(server.label, {})
        if layer is None:
            entry.update(record)
        else:
            entry[str(layer)] = record
