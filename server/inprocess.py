"""A Flower Grid whose nodes run a ClientApp in this process, one message after another (no
Ray, no SuperLink): the bench's federation (:mod:`server.bench`) and the tests' reference runs.

:class:`InProcessGrid` implements flwr 1.42's :class:`flwr.serverapp.Grid` (``set_run``,
``run``, ``create_message``, ``get_node_ids``, ``push_messages``, ``pull_messages``,
``send_and_receive``). Each node is a simulated site as the Simulation Engine makes it: its
Context carries the node config ``partition-id`` / ``num-partitions`` (node ``i`` of the grid
is partition ``i``, and node ids grow with the partition) and ``site-mode="simulation"`` (the
Simulation Engine's sites are recognised by their Ray actor; this process is none), and its
Context state lives for one run (:meth:`new_run`), as the engine keeps one Context per node
and run. A pushed message is handled at once by the ClientApp (the one of ``clients/local.py``
by default: the real ``run_operation`` handlers, with the simulation's faults and attacks);
an exception becomes an error reply worded as the Simulation Engine words it.

Floats: a Ray actor of the Simulation Engine computes with the threads Ray gives it (one per
``num_cpus``, 1 by default); here the ClientApp runs in the main process with torch's threads
unless ``threads`` is given (``threads=1``: the actor's arithmetic, bit for bit where the
thread count changes a reduction's order).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

logger = logging.getLogger(__name__)

#: The first node id (node ``i`` is ``FIRST_NODE + i``): increasing with the partition.
FIRST_NODE = 1000


class ReplyCache(Protocol):
    """Replies kept across runs: ``get`` a kept reply of ``message`` at the site of
    ``context`` (None: the ClientApp computes it), ``put`` a computed one."""

    def get(self, message: Message, context: Context) -> Message | None: ...

    def put(self, message: Message, context: Context, reply: Message) -> None: ...


class InProcessGrid(Grid):
    """``num_nodes`` simulated sites whose ClientApp runs in this process (module docstring).
    ``node_config``: more node config for every site; ``cache``: a :class:`ReplyCache`;
    ``threads``: torch's threads while a ClientApp runs (None: this process's)."""

    pull_interval = 0.0  # every reply is ready once its message is pushed

    def __init__(self, num_nodes: int, client_app: Callable[[Message, Context], Message]
                 | None = None, node_config: dict[str, Any] | None = None,
                 cache: ReplyCache | None = None, threads: int | None = None):
        if num_nodes < 1:
            raise ValueError(f"num_nodes={num_nodes}: expected at least 1")
        self.num_nodes = num_nodes
        self._app = client_app
        self.node_config = dict(node_config or {})
        self.cache = cache
        self.threads = threads
        self._replies: dict[str, Message] = {}
        self._contexts: dict[int, Context] = {}
        self._run: Run | None = None
        #: seconds spent in the ClientApp (cached replies excluded), over every run
        self.client_seconds = 0.0
        #: replies served by :attr:`cache`, over every run
        self.cached_replies = 0
        self.new_run()

    # -- runs ----------------------------------------------------------------------------------
    def new_run(self, run_id: int | None = None) -> int:
        """Start a run (default: the next run id): fresh Contexts for every node, and the
        run's identity for the messages the ServerApp creates. Returns its id."""
        run_id = run_id if run_id is not None else (self._run.run_id + 1 if self._run else 1)
        self.set_run(Run.create_empty(run_id))
        return run_id

    def set_run(self, run: Run) -> None:
        if not isinstance(run, Run):
            raise TypeError(f"run must be a flwr Run, got {type(run).__name__}")
        self._run = run
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = (
            run.run_id, SUPERLINK_NODE_ID, run.run_id)
        self._replies.clear()
        self._contexts = {
            FIRST_NODE + i: Context(run_id=run.run_id, node_id=FIRST_NODE + i,
                                    node_config={"partition-id": i,
                                                 "num-partitions": self.num_nodes,
                                                 "site-mode": "simulation",
                                                 **self.node_config},
                                    state=RecordDict(), run_config={})
            for i in range(self.num_nodes)}

    @property
    def run(self) -> Run:  # type: ignore[override]
        assert self._run is not None
        return self._run

    def context(self, node_id: int) -> Context:
        """The Context of node ``node_id`` in the current run."""
        return self._contexts[node_id]

    # -- the Grid ------------------------------------------------------------------------------
    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Handle each message at its node now (its reply is kept for :meth:`pull_messages`);
        returns the messages' ids."""
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid4())
            if message.metadata.dst_node_id not in self._contexts:
                raise ValueError(f"no node {message.metadata.dst_node_id} in this grid")
            reply = self._handle(message)
            reply.metadata.__dict__["_message_id"] = str(uuid4())
            self._replies[message.metadata.message_id] = reply
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None
                         ) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))

    # -- a site --------------------------------------------------------------------------------
    def _handle(self, message: Message) -> Message:
        from fedcompress.models.common import torch_threads

        context = self._contexts[message.metadata.dst_node_id]
        if self.cache is not None:
            kept = self.cache.get(message, context)
            if kept is not None:
                self.cached_replies += 1
                return kept
        start = time.perf_counter()
        try:
            with torch_threads(self.threads):
                reply = self._client_app()(message, context)
        except Exception as err:  # the Simulation Engine's error reply (flwr 1.42 vce_api)
            logger.error("node %d (%s): %s", message.metadata.dst_node_id,
                         message.metadata.message_type, err)
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                 reason=f"{type(err)}:<'{err}'>"), reply_to=message)
        finally:
            self.client_seconds += time.perf_counter() - start
        if self.cache is not None and not reply.has_error():
            self.cache.put(message, context, reply)
        return reply

    def _client_app(self) -> Callable[[Message, Context], Message]:
        if self._app is None:
            from clients.local import local_app

            self._app = local_app()
        return self._app

