"""PPC-GPT server strategy: collect perturbed client text (round 1), send the compressed model's
removal plan and LoRA adapter and collect the clients' accuracies (round 2).

The generation, layer removal and distillation between the rounds run in the ServerApp
(:mod:`fedcompress.methods.ppcgpt`). A reply that is an error, or whose content is malformed
(text that is not a list of questions with choices, metrics missing or out of range), is logged
with its reason, recorded in :attr:`PPCGPT.outcome` and left out
(:func:`strategies.common.collect_valid_replies`); a round fails with
:class:`NotEnoughClientsError` when fewer than ``config.required_clients`` valid replies remain.
The clients' metrics are in ``outcome.client_metrics`` with their ``stage`` (``perturb``:
round 1, the privacy budget spent; ``retrain``: round 2, the accuracies).
"""

from __future__ import annotations

import logging
import math
from typing import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedcompress.methods.ppcgpt import PPCGPTConfig, parse_perturbed
from strategies.common import (
    NotEnoughClientsError,
    RecordsReplies,
    StrategyOutcome,
    settings_record,
)

__all__ = ["PPCGPT", "NotEnoughClientsError"]

logger = logging.getLogger(__name__)

ACC_KEYS = ("server_acc", "server_n", "client_acc", "client_n")


class PPCGPT(RecordsReplies, Strategy):
    """Round 1 (:meth:`collect_text`, a query) and round 2 (``start``: one train round)."""

    def __init__(self, config: PPCGPTConfig, node_wait: float = 120.0):
        self.config = config
        self.node_wait = node_wait
        self.outcome = StrategyOutcome()
        self.round2: RecordDict | None = None

    def _config(self) -> ConfigRecord:
        # Empty strings are left out (they are the defaults): Flower's ConfigRecord.count_bytes
        # rejects a zero-length value.
        return settings_record(self.config)

    # -- Round 1 ---------------------------------------------------------------------------------
    def collect_text(self, grid: Grid, timeout: float) -> list[dict]:
        """Every node's perturbed examples (validated), in node order."""
        content = RecordDict({"config": self._config()})
        nodes = self._nodes(grid)
        self.outcome.bytes_down += len(nodes) * sum(r.count_bytes() for r in content.values())
        replies = grid.send_and_receive(
            [Message(content, node, "query.perturb") for node in nodes], timeout=timeout)
        valid = self._keep("perturb", 1, replies, lambda reply: parse_perturbed(
            str(reply.content["text"]["examples"])), what="text")
        return [{**ex, "id": f"node{reply.metadata.src_node_id}-{ex['id']}"}
                for reply, got in valid for ex in got]

    # -- Round 2 (Strategy API) ------------------------------------------------------------------
    def set_model(self, removed: list[int], adapter: dict[str, np.ndarray]) -> None:
        """What round 2 sends: the removal plan and the adapter tensors."""
        self.round2 = RecordDict({
            "config": self._config(),
            "plan": ConfigRecord({"removed": [int(i) for i in removed]}),
            "adapter": ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in
                                    adapter.items()})})

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if self.round2 is None:
            raise RuntimeError("set_model() must be called before round 2")
        messages = [Message(self.round2, node, "train.retrain", group_id=str(server_round))
                    for node in self._nodes(grid)]
        self.outcome.bytes_down += len(messages) * sum(r.count_bytes()
                                                       for r in self.round2.values())
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        def validate(reply: Message) -> None:
            check_accuracy_metrics(dict(reply.content["metrics"]))

        valid = self._keep("retrain", 2, replies, validate, what="metrics")
        return None, MetricRecord({"valid_clients": len(valid)})

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []  # the clients evaluate inside the train round (before and after retraining)

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        logger.info("%s: %s", type(self).__name__, self.config)


def check_accuracy_metrics(metrics: dict) -> None:
    """Round-2 metrics must hold accuracies in [0, 1] and positive example counts."""
    for key in ACC_KEYS:
        if key not in metrics:
            raise KeyError(f"metric {key!r} is missing")
        value = float(metrics[key])
        if not math.isfinite(value):
            raise ValueError(f"{key}={value} is not finite")
        if key.endswith("_acc") and not 0.0 <= value <= 1.0:
            raise ValueError(f"{key}={value} is outside [0, 1]")
        if key.endswith("_n") and (value < 1 or not value.is_integer()):
            raise ValueError(f"{key}={value}: expected a positive integer count")
