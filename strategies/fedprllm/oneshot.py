"""FedPrLLM server strategies: collect client prune masks, validate them, vote.

:class:`FedPrLLM` (one-shot: one round, every layer) and :class:`IterativeFedPrLLM` (one round
per decoder layer; the global mask of each layer is broadcast with the next round's request)
are Flower :class:`~flwr.serverapp.strategy.Strategy` subclasses; the math lives in
:mod:`fedcompress.methods.fedprllm.federated` and :mod:`fedcompress.masks.aggregate`.

A reply that is an error, or whose masks fail validation (names, shapes, dtype, sparsity), is
logged with its reason and left out of the vote (:func:`strategies.common.collect_valid_replies`);
the round fails with :class:`NotEnoughClientsError` when fewer than ``config.required_clients``
valid masks remain. What a run gathered is in :attr:`FedPrLLM.outcome`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedcompress.methods.fedprllm.config import FedPrLLMConfig
from fedcompress.methods.fedprllm.federated import (
    MaskAggregator,
    decode_masks,
    decode_wire,
    encode_masks,
    mask_key,
    masks_by_layer,
)
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

__all__ = ["FedPrLLM", "IterativeFedPrLLM", "NotEnoughClientsError", "SecureFedPrLLM",
           "SecureIterativeFedPrLLM", "SecureStatsFedPrLLM", "StatsFedPrLLM", "make_strategy"]

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
        return [ratios for _, ratios in valid]

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


class IterativeFedPrLLM(FedPrLLM):
    """Iterative FedPrLLM: round ``r`` aggregates decoder layer ``r - 1``; its global mask goes
    to the clients with the next round's request.

    A site that did not send valid masks in the previous round (it dropped, failed, or joined
    late) gets every earlier global mask with its request (``resync``) and recomputes its
    activations from its windows, so it votes as if it had never left. With a ``checkpoint``
    folder every aggregated layer (its global mask and vote counts) is saved as it completes,
    and :meth:`resume` continues an interrupted run from the first missing layer (every site
    resyncs in that round)."""

    action = "train.layer_mask"

    def __init__(self, config: FedPrLLMConfig, model: torch.nn.Module, node_wait: float = 120.0,
                 reference_wire: dict | None = None, checkpoint: Path | None = None):
        super().__init__(config, model, node_wait, reference_wire)
        self.layer_aggregators: dict[int, MaskAggregator] = {}
        self.global_masks: dict[int, dict[str, torch.Tensor]] = {}
        self.layer_nodes: dict[int, set[int]] = {}  # nodes whose masks counted, per layer
        self.first_layer = 0  # > 0 after resume()
        self.checkpoint = checkpoint
        self.resynced: dict[int, list[int]] = {}  # per layer, the nodes sent a resync

    def _new_aggregator(self, layers: list[int] | None = None) -> MaskAggregator:
        return MaskAggregator(self.model, self.config.clients, layers if layers else [0],
                              streaming=self.streaming)

    @property
    def num_rounds(self) -> int:
        return len(ModelAdapter(self.model)) - self.first_layer

    def _layer(self, server_round: int) -> int:
        return server_round - 1 + self.first_layer

    def _content(self, server_round: int) -> RecordDict:  # type: ignore[override]
        layer = self._layer(server_round)
        content = super()._content(server_round, [layer])
        content["round"] = ConfigRecord({"layer": layer})
        if layer > 0:
            packed = encode_masks([self.global_masks[layer - 1]], first_layer=layer - 1)
            content["global"] = ArrayRecord({k: Array(v) for k, v in packed.items()})
        return content

    def _layer_contents(self, server_round: int, nodes: list[int]) -> dict[int, RecordDict]:
        """Each node's request for this round's layer: with every earlier global mask for the
        nodes whose masks did not count in the previous round (resync)."""
        layer = self._layer(server_round)
        content = self._content(server_round)
        behind = ([n for n in nodes if n not in self.layer_nodes.get(layer - 1, set())]
                  if layer > 0 else [])
        if not behind:
            return {node: content for node in nodes}
        resync = RecordDict({**content, **self._resync_records(layer)})
        self.resynced[layer] = list(behind)
        logger.info("layer %d: resync for %d node(s) that missed the previous round", layer,
                    len(behind))
        return {node: resync if node in behind else content for node in nodes}

    def _resync_records(self, layer: int) -> dict[str, ArrayRecord]:
        """What a site that missed rounds needs to rebuild its inputs of ``layer``: every
        global mask before layer ``layer - 1``."""
        earlier = [self.global_masks[i] for i in range(layer - 1)]
        packed = encode_masks(earlier, first_layer=0) if earlier else {}
        return {"resync": ArrayRecord({k: Array(v) for k, v in packed.items()})}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        contents = self._layer_contents(server_round, self._nodes(grid))
        self.asked[server_round] = list(contents)
        messages = []
        for node, body in contents.items():
            self.outcome.bytes_down += sum(r.count_bytes() for r in body.values())
            messages.append(Message(body, node, self.action, group_id=str(server_round)))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        layer = self._layer(server_round)
        aggregator = self._new_aggregator([layer])
        self._collect(layer + 1, replies, aggregator, self.asked.get(server_round), layer=layer)
        self._finish_layer(layer, aggregator)
        return None, MetricRecord({"layer": layer, "valid_clients": aggregator.clients})

    def _finish_layer(self, layer: int, aggregator: MaskAggregator) -> None:
        """The layer's vote is in: its global mask (sent with the next request), who counted,
        and its checkpoint."""
        self.layer_aggregators[layer] = aggregator
        self.layer_nodes[layer] = set(self.site_nodes.get(layer + 1, []))
        flat = aggregator.global_masks(self.config.server, self.config.prune.plan,
                                       self.config.prune.nm_pattern)
        self.global_masks[layer] = masks_by_layer(flat)[layer]
        if self.checkpoint is not None:
            self._save(layer, aggregator)

    # -- checkpoint / resume -------------------------------------------------------------------
    def _save(self, layer: int, aggregator: MaskAggregator) -> None:
        """Layer ``layer``'s global mask and vote counts, then the index naming it done (each
        file written whole then renamed: a kill leaves the previous state readable)."""
        assert self.checkpoint is not None
        self.checkpoint.mkdir(parents=True, exist_ok=True)
        arrays = {f"mask/{k}": v for k, v in
                  encode_masks([self.global_masks[layer]], first_layer=layer).items()}
        arrays.update(self._checkpoint_arrays(layer, aggregator))
        tmp = self.checkpoint / f"layer-{layer:03d}.tmp.npz"
        np.savez(tmp, **arrays)
        tmp.replace(self.checkpoint / f"layer-{layer:03d}.npz")
        index = self.checkpoint / "checkpoint.json"
        done = json.loads(index.read_text())["layers"] if index.exists() else {}
        done[str(layer)] = {"clients": self._sites_of(aggregator),
                            "nodes": sorted(self.layer_nodes.get(layer, set()))}
        tmp_index = self.checkpoint / "checkpoint.tmp.json"
        tmp_index.write_text(json.dumps({"settings": self.config.to_dict(), "layers": done},
                                        indent=1))
        tmp_index.replace(index)

    def _checkpoint_arrays(self, layer: int, aggregator) -> dict[str, np.ndarray]:
        """What the checkpoint keeps of a layer besides its global mask: the vote counts."""
        return {f"counts/{k}": c.numpy() for k, c in aggregator.counts().items()}

    @staticmethod
    def _sites_of(aggregator) -> int:
        return aggregator.clients

    def _restore_layer(self, layer: int, arrays: dict[str, np.ndarray], sites: int) -> None:
        counts = {k[7:]: torch.from_numpy(v) for k, v in arrays.items()
                  if k.startswith("counts/")}
        self.layer_aggregators[layer] = MaskAggregator.from_counts(self.model, counts, sites,
                                                                   [layer])

    def resume(self, folder: Path) -> int:
        """Load the layers an interrupted run finished (``folder``: its checkpoint) and start
        from the next; returns how many. The run's settings must be the checkpoint's."""
        index = folder / "checkpoint.json"
        if not index.exists():
            return 0
        stored = json.loads(index.read_text())
        if stored["settings"] != self.config.to_dict():
            differ = sorted(k for k, v in self.config.to_dict().items()
                            if stored["settings"].get(k) != v)
            raise ValueError(f"{folder}: the checkpoint was made with other settings "
                             f"({', '.join(differ)}): expected the interrupted run's")
        layers = sorted(int(k) for k in stored["layers"])
        if layers != list(range(len(layers))):
            raise ValueError(f"{folder}: checkpointed layers {layers}: expected 0..n-1")
        for layer in layers:
            with np.load(folder / f"layer-{layer:03d}.npz") as data:
                masks = {k[5:]: data[k] for k in data.files if k.startswith("mask/")}
                self._restore_layer(layer, {k: data[k] for k in data.files},
                                    int(stored["layers"][str(layer)]["clients"]))
            shapes = MaskAggregator(self.model, 1, [layer]).shapes
            self.global_masks[layer] = masks_by_layer(
                decode_masks(masks, shapes, self.config.prune.plan, 1.0))[layer]
        self.first_layer = len(layers)
        logger.info("resumed from %s: layers 0..%d done", folder, len(layers) - 1)
        return len(layers)

    def prune(self, model: torch.nn.Module, server=None) -> dict[str, float]:
        if server is not None and server != self.config.server:
            raise ValueError("iterative masks depend on the server variant used in the rounds; "
                             f"this run used {self.config.server}")
        pruned = {}
        for layer, aggregator in self.layer_aggregators.items():
            pruned.update(aggregator.prune(model, self.config.server,
                                          self.config.prune.plan,
                                          self.config.prune.nm_pattern))
            self._record_defence(self.config.server, aggregator,
                                 self.site_nodes.get(layer + 1, []), layer)
        return pruned


class _SecureVote:
    """SecAgg+ of one vote (:mod:`fedcompress.privacy.secagg`): five exchanges (keys, shares,
    masked votes, the consistency round when the sites are authenticated, unmasking); the
    server ends with the vote counts of the linear layers in ``shapes`` and no site's mask. A
    site lost before its shares is not in the vote (nobody masks with it); one lost before its
    masked votes is left out of the sum (its pairwise masks undone from the others' shares);
    one lost later still counts; fewer than ``max(threshold, required clients)`` at any stage
    end the run clearly. The sites check everything a guarantee depends on themselves. Mixed
    into a FedPrLLM strategy (its config, nodes, outcome)."""

    config: FedPrLLMConfig
    model: torch.nn.Module
    outcome: StrategyOutcome
    site_nodes: dict[int, list[int]]

    def _init_secure(self) -> None:
        #: per stage, summed over the votes: seconds, bytes down and up, valid replies
        self.secagg: dict[str, dict[str, float]] = {}

    def _exchange(self, grid: Grid, stage: str, action: str, contents: dict[int, RecordDict],
                  timeout: float, validate, server_round: int) -> dict[int, Any]:
        start = time.monotonic()
        down = sum(sum(r.count_bytes() for r in c.values()) for c in contents.values())
        replies = list(grid.send_and_receive(
            [Message(c, node, action, group_id=str(server_round))
             for node, c in contents.items()], timeout=timeout))
        valid, rejected = collect_valid_replies(replies, validate, stage=f"secagg-{stage}",
                                                server_round=server_round,
                                                what=f"SecAgg {stage} reply",
                                                asked=list(contents), timeout=timeout)
        self.outcome.add_rejected(rejected)
        up = sum(sum(r.count_bytes() for r in reply.content.values()) for reply, _ in valid)
        self.outcome.bytes_down += down
        total = self.secagg.setdefault(stage, {"seconds": 0.0, "bytes_down": 0, "bytes_up": 0,
                                               "valid": 0})
        for key, value in (("seconds", time.monotonic() - start), ("bytes_down", down),
                           ("bytes_up", up), ("valid", len(valid))):
            total[key] += value
        for reply, _ in valid:
            if "metrics" in reply.content:
                self.outcome.client_metrics.append({"round": server_round, "stage": stage,
                                                    "node": reply.metadata.src_node_id,
                                                    **reply_metrics(reply)})
        return {reply.metadata.src_node_id: value for reply, value in valid}

    def _secure_counts(self, grid: Grid, nodes: list[int], shapes: dict[str, tuple],
                       mask_content, timeout: float, server_round: int, layer: int = -1
                       ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The vote counts of ``shapes``' layers over ``nodes`` (``mask_content(node)``: the
        request of a site's masked votes); and the nodes whose votes count."""
        keys = sorted(shapes)
        numel = sum(int(np.prod(shapes[k])) for k in keys)
        total, sites = self._secure_sum(grid, nodes, numel, 0, mask_content, timeout,
                                        server_round, layer)
        counts, offset = {}, 0
        for key in keys:
            size = int(np.prod(shapes[key]))
            counts[key] = torch.from_numpy(total[offset:offset + size].reshape(shapes[key]))
            offset += size
        return counts, sites

    def _secure_sum(self, grid: Grid, nodes: list[int], numel: int, bits: int,
                    mask_content, timeout: float, server_round: int, layer: int = -1
                    ) -> tuple[np.ndarray, list[int]]:
        """The sum (int64, ``numel``) of the sites' vectors over ``nodes`` in ``bits``-bit
        lanes (0: wide enough for 0/1 votes; 64: fixed-point statistics), each site's request
        ``mask_content(node)``, for decoder layer ``layer`` (-1: every layer); and the nodes
        whose vectors count. Five exchanges: keys, shares, masked vectors, the consistency
        round (authenticated sites only) and the unmasking shares."""
        from fedcompress.privacy.secagg import (
            Advert,
            SecAggConfig,
            SecAggError,
            SecAggServer,
            pack_blobs,
            pack_ints,
            unpack_blobs,
            unpack_ints,
        )

        nodes = sorted(nodes)
        index = {node: i for i, node in enumerate(nodes)}
        threshold = self.config.threshold_for(len(nodes))
        agg_config = SecAggConfig(tuple(range(len(nodes))), threshold, numel, bits)
        server = SecAggServer(agg_config)
        need = max(threshold, self.config.required_clients)

        def enough(stage: str, got: int) -> None:
            require_valid(got, need, f"SecAgg {stage}", server_round, self.outcome.reasons(
                f"secagg-{stage}"))

        def unset(value: bytes) -> bytes:
            return b"" if value == b"-" else value

        def advert_of(reply: Message) -> tuple[Advert, bool, bytes]:
            rec = reply.content["secagg"]
            return (Advert(bytes(rec["c"]), bytes(rec["s"]), unset(bytes(rec["signature"])),
                           unset(bytes(rec["signer"]))), bool(rec["authenticated"]),
                    bytes(rec["vote"]))

        base = {"sites": len(nodes), "threshold": threshold, "numel": numel,
                "bits": agg_config.bits, "layer": layer}
        keyed = self._exchange(grid, "keys", "query.secagg_keys", {
            n: RecordDict({"secagg": ConfigRecord({**base, "index": index[n]})}) for n in nodes},
            timeout, advert_of, server_round)
        enough("keys", len(keyed))
        votes = {vote for _, _, vote in keyed.values()}
        if len(votes) != 1:
            raise NotEnoughClientsError(f"round {server_round}: the sites derived "
                                        f"{len(votes)} different SecAgg vote ids")
        server.vote_id = votes.pop()
        authenticated = all(auth for _, auth, _ in keyed.values())
        server.public = {index[n]: advert for n, (advert, _, _) in keyed.items()}
        listed = sorted(server.public)
        adverts = [Advert(*server.public[i]) for i in listed]
        advert = ConfigRecord({"nodes": pack_ints(listed), "layer": layer,
                               "c": pack_blobs([a.c for a in adverts]),
                               "s": pack_blobs([a.s for a in adverts]),
                               "signature": pack_blobs([a.signature or b"-" for a in adverts]),
                               "signer": pack_blobs([a.signer or b"-" for a in adverts])})

        def pairs(ids: str, blobs: str):
            """A reply's ``{site index: bytes}`` from its packed ids and byte strings."""
            def read(reply: Message) -> dict[int, bytes]:
                record = reply.content["secagg"]
                return dict(zip(unpack_ints(record[ids]), unpack_blobs(record[blobs]),
                                strict=True))
            return read

        shares = self._exchange(grid, "share", "query.secagg_share",
                                {n: RecordDict({"secagg": advert}) for n in keyed},
                                timeout, pairs("dst", "blob"), server_round)
        enough("share", len(shares))
        inbox = server.relay({index[n]: s for n, s in shares.items()})

        def masked_of(reply: Message) -> np.ndarray:
            words = reply.content["masked"]["words"].numpy()
            if words.dtype != np.uint64 or words.shape != (agg_config.n_words,):
                raise ValueError(f"masked votes of {words.dtype} {words.shape}: expected "
                                 f"({agg_config.n_words},) uint64")
            return words

        def request(n: int) -> RecordDict:
            mine = inbox.get(index[n], {})
            return RecordDict({**mask_content(n), "secagg": ConfigRecord({
                "layer": layer, "src": pack_ints(sorted(mine)),
                "blob": pack_blobs([mine[s] for s in sorted(mine)])})})

        masked = self._exchange(grid, "masked", "train.secagg_masks",
                                {n: request(n) for n in shares}, timeout, masked_of,
                                server_round)
        enough("masked", len(masked))
        survivors = sorted(index[n] for n in masked)
        ask = {"layer": layer, "survivors": pack_ints(survivors)}
        asked = list(masked)
        if authenticated:  # the consistency round: every survivor signs the survivor set
            signed = self._exchange(
                grid, "confirm", "query.secagg_confirm",
                {n: RecordDict({"secagg": ConfigRecord(ask)}) for n in masked}, timeout,
                lambda r: bytes(r.content["secagg"]["signature"]), server_round)
            enough("confirm", len(signed))
            signers = sorted(signed)
            ask.update(signers=pack_ints([index[n] for n in signers]),
                       signatures=pack_blobs([signed[n] for n in signers]))
            asked = signers
        unmask = self._exchange(grid, "unmask", "query.secagg_unmask",
                                {n: RecordDict({"secagg": ConfigRecord(ask)}) for n in asked},
                                timeout, pairs("of", "share"), server_round)
        start = time.monotonic()
        try:
            total = server.aggregate({index[n]: w for n, w in masked.items()},
                                     {index[n]: s for n, s in unmask.items()})
        except SecAggError as err:
            raise NotEnoughClientsError(f"SecAgg unmasking failed: {err}") from err
        summary = self.secagg.setdefault("sum", {"seconds": 0.0, "votes": 0, "dropped": 0})
        summary["seconds"] += time.monotonic() - start
        summary["votes"] += 1
        summary["dropped"] += len(set(listed) - set(survivors))
        summary.update({"sites": len(masked), "threshold": threshold,
                        "authenticated": authenticated,
                        "consistency_round": authenticated,
                        "bits_per_weight_up": 64 / (64 // agg_config.bits)})
        summary["bytes_up_per_site"] = summary.get("bytes_up_per_site", 0) \
            + agg_config.upload_bytes
        if not authenticated:
            logger.warning("SecAgg+ without authenticated sites (simulation): the keys are "
                           "unsigned and there is no consistency round, so only an "
                           "honest-but-curious server is covered")
        return total, sorted(masked)


class SecureFedPrLLM(_SecureVote, FedPrLLM):
    """One-shot FedPrLLM whose vote is summed by SecAgg+ (:class:`_SecureVote`)."""

    def __init__(self, config: FedPrLLMConfig, model: torch.nn.Module, node_wait: float = 120.0,
                 reference_wire: dict | None = None):
        super().__init__(config, model, node_wait, reference_wire)
        self._init_secure()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 1,
              timeout: float = 3600, **_ignored) -> None:
        content = self._content(1)
        counts, sites = self._secure_counts(grid, self._nodes(grid), self.shapes,
                                            lambda _node: content, timeout, 1)
        self.aggregator = MaskAggregator.from_counts(self.model, counts, len(sites))
        self.site_nodes[1] = sites


class SecureIterativeFedPrLLM(_SecureVote, IterativeFedPrLLM):
    """Iterative FedPrLLM whose every layer's vote is summed by SecAgg+ (fresh keys and seeds
    per layer: four exchanges per decoder layer); resync and checkpoints as in the plain
    iterative mode."""

    def __init__(self, config: FedPrLLMConfig, model: torch.nn.Module, node_wait: float = 120.0,
                 reference_wire: dict | None = None, checkpoint: Path | None = None):
        super().__init__(config, model, node_wait, reference_wire, checkpoint)
        self._init_secure()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 1,
              timeout: float = 3600, **_ignored) -> None:
        for server_round in range(1, self.num_rounds + 1):
            layer = self._layer(server_round)
            contents = self._layer_contents(server_round, self._nodes(grid))
            counts, sites = self._secure_counts(
                grid, list(contents), MaskAggregator(self.model, 1, [layer]).shapes,
                contents.__getitem__, timeout, layer + 1, layer)
            self.site_nodes[layer + 1] = sites
            self._finish_layer(layer, MaskAggregator.from_counts(self.model, counts, len(sites),
                                                                 [layer]))
            logger.info("layer %d: secure vote of %d sites", layer, len(sites))


class StatsFedPrLLM(IterativeFedPrLLM):
    """Statistics mode (:mod:`fedcompress.methods.fedprllm.stats`): round ``r`` sums the
    sites' input statistics of decoder layer ``r - 1`` and prunes it exactly as centralized
    pruning on the union of their windows; its global masks (and SparseGPT's updated weights)
    go out with the next request. Invalid statistics are rejected with their reason; resync of
    returning sites and checkpoints as in the iterative vote."""

    action = "train.layer_stats"

    def __init__(self, config: FedPrLLMConfig, model: torch.nn.Module, node_wait: float = 120.0,
                 reference_wire: dict | None = None, checkpoint: Path | None = None):
        super().__init__(config, model, node_wait, reference_wire, checkpoint)
        # Float sums depend on their order: a layer's statistics are summed in node order,
        # after the round (one round holds one decoder layer's statistics per site).
        self.streaming = False
        self.global_weights: dict[int, dict[str, torch.Tensor]] = {}
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
            decode_stats,
            layer_in_features,
        )

        layer = self._layer(server_round)
        features = layer_in_features(self.model, layer)
        hessian = self.config.prune.needs_hessian
        aggregator = StatsAggregator(features, hessian)

        def validate(reply: Message):
            arrays = {k: a.numpy() for k, a in reply.content["stats"].items()}
            shared = {str(k): str(v) for k, v in reply.content["shared"].items()}
            return decode_stats(arrays, shared, features, layer, hessian)

        valid, rejected = collect_valid_replies(replies, validate, stage="stats",
                                                server_round=layer + 1, what="statistics",
                                                asked=self.asked.get(server_round),
                                                timeout=self.round_timeout)
        self.outcome.add_rejected(rejected, layer=layer)
        for reply, stats in valid:
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
        from fedcompress.methods.fedprllm.stats import prune_layer

        start = time.monotonic()
        masks, weights = prune_layer(self.model, layer, aggregator.layer_stats(),
                                     self.config.prune)
        self.layer_cost[layer] = {"server_seconds": time.monotonic() - start,
                                  "sites": aggregator.sites}
        self.global_masks[layer] = masks
        if weights:
            self.global_weights[layer] = weights
        self.layer_sites[layer] = aggregator.sites
        self.layer_nodes[layer] = set(self.site_nodes.get(layer + 1, []))
        if self.checkpoint is not None:
            self._save(layer, aggregator)

    def _checkpoint_arrays(self, layer: int, aggregator) -> dict[str, np.ndarray]:
        return {f"weight/{mask_key(layer, name)}": w.numpy()
                for name, w in self.global_weights.get(layer, {}).items()}

    @staticmethod
    def _sites_of(aggregator) -> int:
        return aggregator.sites

    def _restore_layer(self, layer: int, arrays: dict[str, np.ndarray], sites: int) -> None:
        weights = {k[7:]: torch.from_numpy(v.copy()) for k, v in arrays.items()
                   if k.startswith("weight/")}
        if weights:
            self.global_weights[layer] = masks_by_layer(weights)[layer]
        self.layer_sites[layer] = sites

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
                 reference_wire: dict | None = None, checkpoint: Path | None = None):
        super().__init__(config, model, node_wait, reference_wire, checkpoint)
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
                stats = decode_stats(summed, shared, features, layer, hessian)
            except ValueError as err:  # only the sum is visible: no site can be left out
                raise NotEnoughClientsError(f"layer {layer}: the securely summed statistics "
                                            f"are invalid ({err})") from err
            aggregator = StatsAggregator(features, hessian)
            aggregator.add(stats)
            aggregator.sites = len(sites)
            self.site_nodes[layer + 1] = sites
            self._finish_stats_layer(layer, aggregator)
            logger.info("layer %d: statistics of %d sites summed securely", layer, len(sites))


def make_strategy(config: FedPrLLMConfig, model: torch.nn.Module,
                  reference_wire: dict | None = None, checkpoint: Path | None = None
                  ) -> FedPrLLM:
    if config.aggregate == "stats":
        if not config.secagg:
            logger.warning("statistics mode without --secagg: the server sees each site's "
                           "per-layer input statistics (column square sums%s) in the clear; "
                           "with --secagg it sees only their sum",
                           ", and the Hessian X^T X of its activations"
                           if config.prune.needs_hessian else "")
        return (SecureStatsFedPrLLM if config.secagg else StatsFedPrLLM)(
            config, model, reference_wire=reference_wire, checkpoint=checkpoint)
    if config.secagg and config.mode == "iterative":
        return SecureIterativeFedPrLLM(config, model, reference_wire=reference_wire,
                                       checkpoint=checkpoint)
    if config.secagg:
        return SecureFedPrLLM(config, model, reference_wire=reference_wire)
    if config.mode == "iterative":
        return IterativeFedPrLLM(config, model, reference_wire=reference_wire,
                                 checkpoint=checkpoint)
    return FedPrLLM(config, model, reference_wire=reference_wire)
