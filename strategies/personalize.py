"""Federated personalized pruning's server side: three exchanges with the sites, validated.

:class:`PersonalizeServer` asks every site for its unit classes (``query.classify``), counts
them, sends the global plan and sums the sites' masks at it (``train.plan_masks``: the shared
vote, and the uniform FedPrLLM vote of the baseline), then sends each site its own plan with
the global masks of every layer outside its personalized units (``query.personalize``) and
collects only the sites' scores. Every reply is validated (class codes, mask names, shapes and
sparsity); a bad reply is recorded with its reason and left out
(:class:`strategies.common.StrategyOutcome`); fewer valid sites than ``required_clients`` end
the run. The math lives in :mod:`fedcompress.methods.personalize`.
"""

from __future__ import annotations

import logging
import math

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from torch import nn

from fedcompress.layers.personalized import CLASSES, Classification, units_of
from fedcompress.masks.codec import encode_mask
from fedcompress.methods import personalize as pz
from fedcompress.methods.fedprllm.federated import (
    MaskAggregator,
    check_payload,
    expected_shapes,
)
from fedcompress.pruning.allocation import SparsityPlan
from strategies.common import RecordsReplies, StrategyOutcome, settings_record

__all__ = ["PersonalizeServer"]

logger = logging.getLogger(__name__)


class PersonalizeServer(RecordsReplies):
    """The server's three exchanges (module docstring)."""

    def __init__(self, config: pz.PersonalizeConfig, model: nn.Module, node_wait: float = 120.0):
        self.config = config
        self.model = model
        self.node_wait = node_wait
        self.outcome = StrategyOutcome()
        self.units = units_of(model, config.granularity)
        self.shapes = expected_shapes(model)
        self.site_plans: dict[int, dict] = {}  # node -> its plan's summary (round 3)

    def _send(self, grid: Grid, contents: dict[int, RecordDict], action: str, timeout: float
              ) -> list[Message]:
        self.outcome.bytes_down += sum(sum(r.count_bytes() for r in c.values())
                                       for c in contents.values())
        return list(grid.send_and_receive(
            [Message(content, node, action) for node, content in contents.items()],
            timeout=timeout))

    def collect_classes(self, grid: Grid, timeout: float) -> dict[int, Classification]:
        """Round 1: every site's unit classes (one valid code per unit)."""
        content = RecordDict({"config": settings_record(self.config)})
        replies = self._send(grid, {n: content for n in self._nodes(grid)}, "query.classify",
                             timeout)
        names = list(self.units)

        def validate(reply: Message) -> Classification:
            codes = reply.content["classes"]["classes"].numpy()
            if codes.shape != (len(names),) or codes.dtype != np.uint8:
                raise ValueError(f"class codes of shape {codes.shape} and dtype {codes.dtype}: "
                                 f"expected uint8 ({len(names)},)")
            if int(codes.max(initial=0)) >= len(CLASSES):
                raise ValueError(f"class code {int(codes.max())}: expected < {len(CLASSES)}")
            threshold = float(reply.content["metrics"]["threshold"])
            if not math.isfinite(threshold):
                raise ValueError(f"threshold loss {threshold} is not finite")
            return Classification({u: CLASSES[int(c)] for u, c in zip(names, codes)},
                                  self.units, threshold)

        valid = self._keep("classify", 1, replies, validate, what="classes")
        return {reply.metadata.src_node_id: c for reply, c in valid}

    def collect_masks(self, grid: Grid, nodes: list[int], plan: SparsityPlan,
                      baselines: list[str], timeout: float
                      ) -> tuple[MaskAggregator, MaskAggregator | None]:
        """Round 2: the sites' masks at the global plan, summed; and at the uniform ratio
        (the uniform FedPrLLM vote) when that baseline or the sites' guard needs it, else
        None. A site keeps
        its uniform masks as its local-only model when that baseline is asked for."""
        uniform_wanted = "fedprllm" in baselines or self.config.guard != "off"
        content = RecordDict({"config": settings_record(self.config),
                              "plan": ConfigRecord({"layer_sparsity": plan.to_text(),
                                                    "uniform": uniform_wanted,
                                                    "local-only": "local-only" in baselines})})
        replies = self._send(grid, {n: content for n in nodes}, "train.plan_masks", timeout)
        targets = [("masks", plan)]
        if uniform_wanted:
            targets.append(("uniform", SparsityPlan(self.config.sparsity)))

        def validate(reply: Message) -> list[dict]:
            return [check_payload({k: a.numpy() for k, a in reply.content[key].items()},
                                  self.shapes, target, tolerance=0.02)
                    for key, target in targets]

        valid = self._keep("masks", 2, replies, validate, what="masks")
        votes = [MaskAggregator(self.model, len(valid)) for _ in targets]
        for _, payloads in valid:
            for aggregator, payload in zip(votes, payloads):
                aggregator.add_packed(payload)
        return votes[0], (votes[1] if uniform_wanted else None)

    def personalize(self, grid: Grid, sites: dict[int, Classification], counts: pz.UnitCounts,
                    voted: MaskAggregator, uniform: MaskAggregator | None, baselines: list[str],
                    timeout: float) -> list[dict]:
        """Round 3: each site's plan and shared masks; its scores back."""
        contents = {}
        uniform_record = None
        if uniform is not None:
            masks = uniform.global_masks(self.config.server, self.config.sparsity)
            uniform_record = _record(masks)
        votes = voted.counts()
        for node, site in sites.items():
            view = pz.site_view(site, counts)
            plan = pz.site_classes_plan(self.units, view, self.model, self.config.sparsity,
                                        self.config.factors, self.config.bound)
            self.site_plans[node] = pz.site_plan_summary(
                self.units, view, self.model, self.config.sparsity, self.config.factors,
                self.config.bound)
            shared = pz.shared_masks(votes, plan, pz.personal_linears(site),
                                     self.model, self.config.group, self.config.tie_break)
            content = RecordDict({
                "config": settings_record(self.config),
                "plan": ConfigRecord({"layer_sparsity": plan.to_text(),
                                      "local-only": "local-only" in baselines,
                                      "dense": "dense" in baselines}),
                "shared": _record(shared)})
            if uniform_record is not None:
                content["uniform"] = uniform_record
            contents[node] = content
        replies = self._send(grid, contents, "query.personalize", timeout)

        def validate(reply: Message) -> None:
            metrics = dict(reply.content["metrics"])
            for key, value in metrics.items():
                if isinstance(value, float) and not math.isfinite(value):
                    raise ValueError(f"{key}={value} is not finite")
            if "personalized" not in metrics:
                raise ValueError("no perplexity of the personalized model")
            if self.config.guard != "off" and metrics.get("kept_fedprllm") not in (0, 1):
                raise ValueError("the site's guard named no kept model (kept_fedprllm "
                                 f"{metrics.get('kept_fedprllm')!r}: expected 0 or 1)")

        self._keep("personalize", 3, replies, validate, what="scores")
        return self.stage_metrics("personalize")


def _record(masks) -> ArrayRecord:
    """Wire-keyed bool masks, bit-packed, as a message record."""
    return ArrayRecord({k: Array(encode_mask(m)) for k, m in masks.items()})
