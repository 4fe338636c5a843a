"""What every fedcompress strategy shares: waiting for nodes, checking replies, the outcome.

:func:`collect_valid_replies` is the one place where a round's replies are sorted into valid
ones and rejected ones (as Flower's ``FedAvg._check_and_log_replies`` does): a reply that is
an error, or whose content fails the method's validation, and a node asked that did not reply
within the round timeout, is logged with its reason and left out, in one record shape
(:func:`rejection`); :func:`require_valid` ends the run with :class:`NotEnoughClientsError`
when too few valid replies remain.

A ClientApp whose process dies mid-message (crash, OOM killer) under Flower 1.42's Simulation
Engine: the Ray actor running it dies, ``ray.get`` raises at once (ActorDiedError, or
ActorUnavailableError when Ray restarts the actor) and the engine replies with an error
(``ErrorCode.UNKNOWN``, reason ``<class '...'>:<'...'>``): no hang. :func:`error_reason` names
it. Flower's ``RayBackend`` puts the dead actor back into its pool: ``server/simulation.py``
sets ``max_restarts`` in the client resources so that Ray restarts it; should a run go without
(another backend config), :meth:`StrategyOutcome.add_rejected` tells the site that died from
the sites whose messages were then sent to the dead actor.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from flwr.app import ConfigRecord, Message
from flwr.serverapp import Grid

logger = logging.getLogger(__name__)

T = TypeVar("T")


#: What a ClientApp reply's metrics say of its process's start-up (``clients/startup.py``):
#: Flower's runtime before the app (a ``flwr-clientapp`` process's first reply only), imports,
#: loading (model, tokenizer, windows), import + load, the handler's own work, and at a site
#: with a site agent (``clients/site_agent.py``) the relay's exchange with it (the key's name is
#: the retired site worker's).
STARTUP_KEYS = ("startup_runtime_seconds", "startup_import_seconds", "startup_load_seconds",
                "client_startup_seconds", "compute_seconds", "startup_worker_seconds")


class NotEnoughClientsError(RuntimeError):
    """Fewer valid client replies (or connected nodes) than the run requires."""


@dataclass
class StrategyOutcome:
    """What a strategy gathered during a run, every field present from the start.

    ``rejected``: one :func:`rejection` record per reply left out; ``client_metrics``: the
    metrics of every valid reply (with ``stage``, ``round``, ``node``); ``bytes_down``: bytes of
    every message content the server sent; ``startup_seconds``: per node, its start-up (when the
    strategy asks for one: the warm-up reply's imports + loading); ``warmup_metrics``: the
    metrics of those warm-up replies (with ``stage``, ``round``, ``node``)."""

    rejected: list[dict[str, Any]] = field(default_factory=list)
    client_metrics: list[dict[str, Any]] = field(default_factory=list)
    bytes_down: int = 0
    startup_seconds: list[float] = field(default_factory=list)
    warmup_metrics: list[dict[str, Any]] = field(default_factory=list)
    #: Ray actor processes seen dead, ``(actor id, pid)`` -> where ("masks round 1")
    dead_actors: dict[tuple[str, str], str] = field(default_factory=dict)

    def add_rejected(self, records: list[dict[str, Any]], **where: Any) -> None:
        """Record rejections (``where``: e.g. ``layer=3``, added to each), with the node's
        partition when an earlier valid reply named it. A reply from a Ray actor process
        already seen dead, or from one that failed several messages of this batch, says that
        its message was sent to a dead actor (Flower 1.42's RayBackend returns a dead actor to
        its pool) rather than that this site's own process died."""
        partitions = {m["node"]: m["partition"] for m in self.client_metrics
                      if "partition" in m}
        batch: dict[tuple[str, str], int] = {}
        for record in records:
            if "actor" in record and "pid" in record:
                key = (record["actor"], record["pid"])
                batch[key] = batch.get(key, 0) + 1
        for record in records:
            record.update(where)
            if record["node"] in partitions:
                record.setdefault("partition", partitions[record["node"]])
            key = (record.get("actor", ""), record.get("pid", ""))
            if key in self.dead_actors:
                record["reason"] = (
                    f"message sent to a dead process: Ray actor {key[0][:12]} (pid {key[1]}) "
                    f"had died at {self.dead_actors[key]} (not this site's fault: {_DEAD_POOL})")
            elif batch.get(key, 0) > 1:
                record["reason"] = (
                    f"client process died mid-message, or its message went to that dead "
                    f"process: Ray actor {key[0][:12]} (pid {key[1]}) failed {batch[key]} "
                    f"messages of {record['stage']} round {record['round']} ({_DEAD_POOL})")
            else:
                continue
            logger.warning("%s (round %s): client node %s: %s", record["stage"],
                           record["round"], record["node"], record["reason"])
        for key in batch:
            first = next(r for r in records if (r.get("actor"), r.get("pid")) == key)
            self.dead_actors.setdefault(key, f"{first['stage']} round {first['round']}")
        self.rejected += records

    def startup_split(self) -> list[dict[str, Any]]:
        """The start-up split of every valid reply that carried one (``clients/startup.py``:
        :data:`STARTUP_KEYS`), warm-up replies first: its ``stage``, ``round``, ``node`` (and
        ``partition``) and those keys."""
        out = []
        for metrics in [*self.warmup_metrics, *self.client_metrics]:
            split = {k: metrics[k] for k in STARTUP_KEYS if k in metrics}
            if split:
                where = {k: metrics[k] for k in ("stage", "round", "node", "partition")
                         if k in metrics}
                out.append({**where, **split})
        return out

    def reasons(self, stage: str) -> list[str]:
        return [r["reason"] for r in self.rejected if r["stage"] == stage]

    def stage_metrics(self, stage: str) -> list[dict[str, Any]]:
        """The valid replies' metrics of one stage."""
        return [m for m in self.client_metrics if m["stage"] == stage]

    def keep(self, replies: Iterable[Message], validate: Callable[[Message], T], *,
             stage: str, server_round: int, what: str, required: int,
             asked: Iterable[int] | None = None, timeout: float | None = None
             ) -> list[tuple[Message, T]]:
        """:func:`collect_valid_replies`, recording the rejections (with the ``asked`` nodes
        that did not reply) and every valid reply's metrics (with ``stage``, ``round``,
        ``node``); fewer than ``required`` valid replies is :class:`NotEnoughClientsError`."""
        valid, rejected = collect_valid_replies(replies, validate, stage=stage,
                                                server_round=server_round, what=what,
                                                asked=asked, timeout=timeout)
        self.add_rejected(rejected)
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
              validate: Callable[[Message], Any], what: str,
              asked: Iterable[int] | None = None, timeout: float | None = None) -> list:
        return self.outcome.keep(replies, validate, stage=stage, server_round=server_round,
                                 what=what, required=self.config.required_clients,
                                 asked=asked, timeout=timeout)


def settings_record(settings: Any, **extra: Any) -> ConfigRecord:
    """A method's settings (``Settings.to_dict()``) as the ``config`` record of a message, plus
    ``extra`` values. An empty string is left out when it is the setting's default (Flower
    1.42's ``ConfigRecord.count_bytes`` refuses empty strings; the receiver's ``from_dict``
    restores the default); any other empty value is an error naming it."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(settings)}
    values = {**settings.to_dict(), **extra}
    for key, value in values.items():
        if value == "" and defaults.get(key) != "":
            raise ValueError(f"{key}='' cannot travel in a Flower message (its default is "
                             f"{defaults.get(key)!r}): expected a non-empty value")
    return ConfigRecord({k: v for k, v in values.items() if v != ""})


def rejection(stage: str, server_round: int, node: int, reason: str, **extra: Any
              ) -> dict[str, Any]:
    """The one record of a reply left out (logged at WARNING); ``extra``: more fields (a dead
    Ray actor's ``actor`` id and ``pid``)."""
    logger.warning("%s (round %d): client node %s left out: %s", stage, server_round, node,
                   reason)
    return {"stage": stage, "round": server_round, "node": node, "reason": reason, **extra}


#: Ray's errors for a message whose actor process died (ActorUnavailableError: Ray is
#: restarting it), as Flower's Simulation Engine names them in an error reply.
_DEAD_PROCESS = ("ActorDiedError", "ActorUnavailableError", "RayActorError",
                 "WorkerCrashedError", "OutOfMemoryError")
_FLOWER_REASON = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>:<'(.*)'>\Z", re.S)
_DEAD_POOL = ("Flower 1.42's RayBackend returns a dead actor to its pool; Ray restarts it "
              "only when the backend's client_resources set max_restarts, as "
              "server/simulation.py does")


def error_reason(reason: str) -> tuple[str, dict[str, str]]:
    """The rejection reason of an error reply whose error reason is ``reason``, and the dead
    Ray actor's ``actor`` id and ``pid`` when its ClientApp's process died mid-message (any
    other error: ``client error: <reason>``)."""
    match = _FLOWER_REASON.match(reason)
    if match is None or match.group(1) not in _DEAD_PROCESS:
        return f"client error: {reason}", {}
    name, text = match.groups()
    found = {key: m.group(1) for key, pattern in (("actor", r"actor(?:_id:| ) ?([0-9a-f]{16,})"),
                                                  ("pid", r"\bpid:? ?(\d+)"))
             if (m := re.search(pattern, text))}
    where = ", ".join(f"{k} {v[:12]}" for k, v in found.items())
    return (f"client process died mid-message ({name}: the Ray actor running its ClientApp "
            f"exited{'; ' + where if where else ''})"), found


def sort_replies(replies: Iterable[Message], validate: Callable[[Message], T], *,
                 stage: str, server_round: int, what: str = "reply",
                 errors: tuple[type[BaseException], ...] = (KeyError, TypeError, ValueError),
                 rejected: list[dict[str, Any]]) -> Iterator[tuple[Message, T]]:
    """Yield ``(reply, validate(reply))`` for each valid reply of ``replies``, in the order they
    come (a stream of replies is consumed one at a time, nothing kept), appending a rejection
    record to ``rejected`` for each other one: an error reply as ``client error: ...`` (a dead
    ClientApp process: :func:`error_reason`), a reply whose ``validate`` raises one of
    ``errors`` as ``invalid <what>: ...``."""
    for reply in replies:
        node = reply.metadata.src_node_id
        if reply.has_error():
            reason, extra = error_reason(reply.error.reason)
            rejected.append(rejection(stage, server_round, node, reason, **extra))
            continue
        try:
            value = validate(reply)
        except errors as err:
            rejected.append(rejection(stage, server_round, node, f"invalid {what}: {err}"))
            continue
        yield reply, value


def silent_nodes(asked: Iterable[int] | None, replied: Iterable[int], stage: str,
                 server_round: int, timeout: float | None) -> list[dict[str, Any]]:
    """A rejection record for each node of ``asked`` (the nodes a round asked) not in
    ``replied``: ``no reply within the round timeout (<timeout> s)``."""
    limit = "" if timeout is None else f" ({timeout:g} s)"
    return [rejection(stage, server_round, node, f"no reply within the round timeout{limit}")
            for node in sorted(set(asked or ()) - set(replied))]


def collect_valid_replies(replies: Iterable[Message], validate: Callable[[Message], T], *,
                          stage: str, server_round: int, what: str = "reply",
                          errors: tuple[type[BaseException], ...] = (KeyError, TypeError,
                                                                     ValueError),
                          asked: Iterable[int] | None = None, timeout: float | None = None
                          ) -> tuple[list[tuple[Message, T]], list[dict[str, Any]]]:
    """:func:`sort_replies` of every reply, in node order, into the valid ``(reply,
    validate(reply))`` pairs (returned :func:`in_partition_order`, the order a strategy adds
    their values in) and the rejection records, then those of the :func:`silent_nodes` of
    ``asked``."""
    replies = sorted(replies, key=lambda r: r.metadata.src_node_id)
    rejected: list[dict[str, Any]] = []
    valid = list(sort_replies(replies, validate, stage=stage, server_round=server_round,
                              what=what, errors=errors, rejected=rejected))
    rejected += silent_nodes(asked, [r.metadata.src_node_id for r in replies], stage,
                             server_round, timeout)
    return in_partition_order(valid), rejected


def in_partition_order(valid: list[tuple[Message, T]]) -> list[tuple[Message, T]]:
    """``valid`` (:func:`collect_valid_replies`' pairs) in the order of the sites' partitions
    (each reply's ``partition`` metric, then node IDs): the order in which a strategy adds the
    sites' floating-point values. Node IDs are no fixed order: the Simulation Engine draws them
    anew each run, and a float64 sum in another order rounds differently, a difference that
    SparseGPT's masks amplify layer after layer (docs/stats-mode.md); in partition order a
    simulation sums as the in-process runs do (sites 0, 1, ...), run after run. A reply with
    no integer ``partition`` metric comes after the others, by node. The metric is the site's
    own word: a site that lies about it moves only its place in the sum's rounding."""
    def key(pair: tuple[Message, T]) -> tuple[float, int]:
        partition = reply_metrics(pair[0]).get("partition")
        return (float(partition) if isinstance(partition, int) else float("inf"),
                pair[0].metadata.src_node_id)
    return sorted(valid, key=key)


def stream_replies(grid: Any, messages: Iterable[Message], timeout: float | None
                   ) -> Iterator[Message]:
    """Send ``messages`` and yield each reply as it arrives, until every message has its reply
    or ``timeout`` seconds have passed (Flower's ``Grid.send_and_receive``, lazily: the replies
    of a round are never all held at once; the Grid's ``push_messages`` and
    ``pull_messages``). A grid without them (an in-process test federation): its
    ``send_and_receive``."""
    if not (hasattr(grid, "push_messages") and hasattr(grid, "pull_messages")):
        yield from grid.send_and_receive(messages, timeout=timeout)
        return
    pending = set(grid.push_messages(messages))
    del messages
    end = None if timeout is None else time.monotonic() + timeout
    interval = float(getattr(grid, "pull_interval", 0.5))  # (a SuperLink over gRPC: 0.5 s)
    while pending and (end is None or time.monotonic() < end):
        arrived = False
        for reply in grid.pull_messages(pending):
            pending.discard(reply.metadata.reply_to_message_id)
            arrived = True
            yield reply
        if pending and not arrived:
            time.sleep(interval)


class StreamingGrid:
    """A Grid whose ``send_and_receive`` is :func:`stream_replies`: given to Flower's
    ``Strategy.start``, the strategy's ``aggregate_train`` receives a round's replies as they
    arrive; everything else is the wrapped Grid's."""

    def __init__(self, grid: Grid):
        self._grid = grid

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None
                         ) -> Iterable[Message]:
        return stream_replies(self._grid, messages, timeout)


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
