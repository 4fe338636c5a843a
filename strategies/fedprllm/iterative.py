"""The iterative FedPrLLM strategy (:class:`IterativeFedPrLLM`): one round per decoder layer,
each layer's global mask sent with the next round's request; the resync of sites that missed a
round, and per-layer checkpoints from which an interrupted run resumes."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedcompress.methods.fedprllm.config import FedPrLLMConfig
from fedcompress.methods.fedprllm.federated import (
    MaskAggregator,
    decode_masks,
    encode_masks,
    masks_by_layer,
)
from fedcompress.models import ModelAdapter
from strategies.fedprllm.oneshot import FedPrLLM

logger = logging.getLogger(__name__)


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
