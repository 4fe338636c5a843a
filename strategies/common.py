"""What every fedcompress strategy shares: waiting for nodes, checking replies, the outcome.

:func:`collect_valid_replies` is the one place where a round's replies are sorted into valid
ones and rejected ones (as Flower's ``FedAvg._check_and_log_replies`` does): a reply that is
an error, or whose content fails the method's validation, is logged with its reason and left
out, in one record shape (:func:`rejection`); :func:`require_valid` ends the run with
:class:`NotEnoughClientsError` when too few valid replies remain.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from flwr.app import ConfigRecord, Message
from flwr.serverapp import Grid

logger = logging.getLogger(__name__)

T = TypeVar("T")


class NotEnoughClientsError(RuntimeError):
    """Fewer valid client replies (or connected nodes) than the run requires."""


@dataclass
class StrategyOutcome:
    """What a strategy gathered during a run, every field present from the start.

    ``rejected``: one :func:`rejection` record per reply left out; ``client_metrics``: the
    metrics of every valid reply (with ``stage``, ``round``, ``node``); ``bytes_down``: bytes of
    every message content the server sent; ``startup_seconds``: per node, its start-up (when the
    strategy asks for one)."""

    rejected: list[dict[str, Any]] = field(default_factory=list)
    client_metrics: list[dict[str, Any]] = field(default_factory=list)
    bytes_down: int = 0
    startup_seconds: list[float] = field(default_factory=list)

    def reasons(self, stage: str) -> list[str]:
        return [r["reason"] for r in self.rejected if r["stage"] == stage]

    def stage_metrics(self, stage: str) -> list[dict[str, Any]]:
        """The valid replies' metrics of one stage."""
        return [m for m in self.client_metrics if m["stage"] == stage]

    def keep(self, replies: Iterable[Message], validate: Callable[[Message], T], *,
             stage: str, server_round: int, what: str, required: int
             ) -> list[tuple[Message, T]]:
        """:func:`collect_valid_replies`, recording the rejections and every valid reply's
        metrics (with ``stage``, ``round``, ``node``); fewer than ``required`` valid replies is
        :class:`NotEnoughClientsError`."""
        valid, rejected = collect_valid_replies(replies, validate, stage=stage,
                                                server_round=server_round, what=what)
        self.rejected += rejected
        for reply, _ in valid:
            self.client_metrics.append({"stage": stage, "round": server_round,
                                        "node": reply.metadata.src_node_id,
                                        **reply_metrics(reply)})
        require_valid(len(valid), required, stage, server_round,
                      [r["reason"] for r in rejected])
        return valid


class RecordsReplies:
    """Mixin of a method's strategy: the nodes it asks and its validated replies. Needs
    ``self.config`` (``clients``, ``required_clients``), ``self.node_wait`` and
    ``self.outcome`` (a :class:`StrategyOutcome`)."""

    config: Any
    node_wait: float
    outcome: StrategyOutcome

    def _nodes(self, grid: Grid) -> list[int]:
        return wait_for_nodes(grid, self.config.clients, self.config.required_clients,
                              self.node_wait)

    def stage_metrics(self, stage: str) -> list[dict[str, Any]]:
        """The valid replies' metrics of one stage."""
        return self.outcome.stage_metrics(stage)

    def _keep(self, stage: str, server_round: int, replies: Iterable[Message],
              validate: Callable[[Message], Any], what: str) -> list:
        return self.outcome.keep(replies, validate, stage=stage, server_round=server_round,
                                 what=what, required=self.config.required_clients)


def settings_record(settings: Any, **extra: Any) -> ConfigRecord:
    """A method's settings (``Settings.to_dict()``) as the ``config`` record of a message, plus
    ``extra`` values. An empty string is left out when it is the setting's default (Flower
    1.41's ``ConfigRecord.count_bytes`` refuses empty strings; the receiver's ``from_dict``
    restores the default); any other empty value is an error naming it."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(settings)}
    values = {**settings.to_dict(), **extra}
    for key, value in values.items():
        if value == "" and defaults.get(key) != "":
            raise ValueError(f"{key}='' cannot travel in a Flower message (its default is "
                             f"{defaults.get(key)!r}): expected a non-empty value")
    return ConfigRecord({k: v for k, v in values.items() if v != ""})


def rejection(stage: str, server_round: int, node: int, reason: str) -> dict[str, Any]:
    """The one record of a reply left out (logged at WARNING)."""
    logger.warning("%s (round %d): client node %s left out: %s", stage, server_round, node,
                   reason)
    return {"stage": stage, "round": server_round, "node": node, "reason": reason}


def collect_valid_replies(replies: Iterable[Message], validate: Callable[[Message], T], *,
                          stage: str, server_round: int, what: str = "reply",
                          errors: tuple[type[BaseException], ...] = (KeyError, TypeError,
                                                                     ValueError)
                          ) -> tuple[list[tuple[Message, T]], list[dict[str, Any]]]:
    """Sort ``replies`` (in node order) into ``(reply, validate(reply))`` pairs and rejection
    records: an error reply is rejected as ``client error: ...``; a reply whose ``validate``
    raises one of ``errors`` as ``invalid <what>: ...``."""
    valid: list[tuple[Message, T]] = []
    rejected: list[dict[str, Any]] = []
    for reply in sorted(replies, key=lambda r: r.metadata.src_node_id):
        node = reply.metadata.src_node_id
        if reply.has_error():
            rejected.append(rejection(stage, server_round, node,
                                      f"client error: {reply.error.reason}"))
            continue
        try:
            valid.append((reply, validate(reply)))
        except errors as err:
            rejected.append(rejection(stage, server_round, node, f"invalid {what}: {err}"))
    return valid, rejected


def require_valid(valid: int, required: int, stage: str, server_round: int,
                  reasons: list[str]) -> None:
    """:class:`NotEnoughClientsError` unless ``valid >= required``."""
    if valid < required:
        raise NotEnoughClientsError(
            f"{stage} (round {server_round}): {valid} valid client "
            f"repl{'y' if valid == 1 else 'ies'}, the run needs {required} (rejected: "
            f"{reasons})")


def reply_metrics(reply: Message) -> dict[str, Any]:
    """A reply's ``metrics`` record as a dict (empty when it has none)."""
    return dict(reply.content["metrics"]) if "metrics" in reply.content else {}


def wait_for_nodes(grid: Grid, wanted: int, required: int, node_wait: float) -> list[int]:
    """The first ``wanted`` connected nodes (sorted ids: the same nodes every round), waiting up
    to ``node_wait`` seconds for them to connect; fewer than ``required`` is an error."""
    deadline = time.monotonic() + node_wait
    while len(nodes := sorted(grid.get_node_ids())) < wanted:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if len(nodes) < required:
        raise NotEnoughClientsError(f"{len(nodes)} nodes connected, the run needs {required}")
    return nodes[:wanted]
