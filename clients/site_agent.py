"""The site agent: the one process of a site that holds its data, keys, policy and ledger.

In Flower the server ships the ClientApp that a SuperNode runs (the FAB), so the server's code
is as untrusted as its messages. A site that runs ``fedcompress site-agent --config SITE.toml``
keeps everything a guarantee depends on out of that code's reach:

* the agent is started by the site, from the fedcompress the site installed, as the site's user;
  its config file (the site's node config: ``partition-id``, ``data-path``, ``state-dir``, the
  policy keys, ``secagg-key`` and ``secagg-peers``; plus the agent's ``socket``) is the site's,
  checked like a policy file (:func:`load_config`);
* the SuperNode's ClientApp process (the server's code) gets only ``site-agent="PATH"`` in its
  node config and relays each Message over the agent's Unix socket (:func:`relay`): the
  Message goes in, the reply comes out, nothing else. The Flower Context, whose state holds a
  site's SecAgg+ keys and shares between messages, is the agent's own (one per run, kept in
  the agent's memory) and never leaves it; so are the node config, the model and the windows;
* the agent runs only the operations of its own registry (:func:`operations`: every method's
  actions, :data:`OPERATIONS_VERSION`), each through :func:`run_operation`, which the
  in-process ClientApp of a simulation runs too: the site's policy first, the ledger, the
  release, and an error that names settings and bounds but no private value (both defined in
  :mod:`clients.operations`, re-exported here).

Protocol, one connection per message, every frame ``MAGIC + 8-byte length + payload`` (the
frames of :mod:`clients.site_socket`):

1. relay -> agent: a JSON hello (``protocol``, the ``operations`` version the FAB expects,
   Flower's task identity); agent -> relay: its answer, a refusal when the versions differ;
2. relay -> agent: the Message (``flwr.proto`` bytes);
3. agent -> relay: a JSON status, then the reply Message.

What is protected: the server's code never holds the site's data, keys, ledger or the
Context's secrets, provided the process that runs it cannot read the agent's files (in the
shipped deployment, ``docker/compose.yml``, the ClientApp runs in a container of its own, as a
uid of its own, ``relay-uid``, that mounts none of them: only the agent's socket folder). It
can still send the agent any Message: the agent's policy decides what is answered. Who may
connect: a process of the agent's uid or of its ``relay-uid`` (``SO_PEERCRED``,
:mod:`clients.site_socket`); the socket folder is then 0711 and the socket 0666, so that
anything which can reach the folder can try, and is refused by uid. Not protected: root, or any
process that can read the agent's files or memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import tomllib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from clients import site_socket as frames
from clients import startup

# the operations, a module of their own (the in-process ClientApp runs them too); re-exported
# here, where they were first defined
from clients.operations import (  # noqa: F401 (this module's public names)
    Operation,
    error_reply,
    operations,
    run_operation,
)

logger = logging.getLogger("fedcompress.site_agent")

#: The relay's ``--node-config`` key naming the agent's socket.
NODE_CONFIG_KEY = "site-agent"
PROTOCOL = 2
#: The version of the site operations' wire contract (message types, record keys): a relay
#: from a FAB that expects another version is refused with both versions named.
OPERATIONS_VERSION = 1
#: The agent's own keys in its config file; every other key is the site's node config.
AGENT_KEYS = ("socket", "relay-uid")
#: Runs whose Context the agent keeps (a SecAgg+ vote's keys live there between messages).
CONTEXTS_KEPT = 8


class SiteAgentError(frames.SiteSocketError):
    """The agent cannot serve this message, or its config is invalid (named)."""


# -- the agent's config ----------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentConfig:
    """The agent's socket and the site's node config, from the site's own file."""

    path: str
    socket: str
    node_config: dict[str, Any]
    #: the uid of the relay (the SuperNode's ClientApp process) when it is not the agent's own:
    #: the socket is then shared with it (:func:`clients.site_socket._listen`), and only the
    #: agent's uid and this one are served
    relay_uid: int | None = None


def load_config(path: str | os.PathLike[str]) -> AgentConfig:
    """The agent's config file (TOML): ``socket`` and the site's node-config keys (policy keys,
    ``partition-id``, ``num-partitions``, ``data-path``, ``state-dir``, ...). Refused: a file
    (or folder) another user could change, an unknown key (with the nearest known one), a key
    that names another agent or the retired site worker, a missing ``socket``; the node
    config's policy is read once here, so a bad value fails at start, not at the first
    message."""
    from fedcompress.privacy.policy import (
        POLICY_KEYS,
        PolicyError,
        check_private_files,
        site_policy,
    )

    path = os.path.abspath(path)
    try:
        check_private_files(_file_only_policy(), path)
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except PolicyError as err:
        raise SiteAgentError(f"site-agent --config {path}: {err}") from err
    except OSError as err:
        raise SiteAgentError(f"site-agent --config {path}: cannot read it "
                             f"({err.strerror or err})") from err
    except tomllib.TOMLDecodeError as err:
        raise SiteAgentError(f"site-agent --config {path} is not valid TOML: {err}") from err
    known = (*AGENT_KEYS, *POLICY_KEYS, "policy", "site-mode", "partition-id",
             "num-partitions", "data-path")
    for key in data:
        if key == NODE_CONFIG_KEY:
            raise SiteAgentError(f"site-agent --config {path}: key {key!r} belongs in the "
                                 "SuperNode's node config, not in the agent's")
        if key == "site-worker":
            raise SiteAgentError(f"site-agent --config {path}: key {key!r} names the retired "
                                 "site worker; the agent serves the site itself: remove it")
        if key not in known:
            import difflib

            close = difflib.get_close_matches(key, known, n=1)
            raise SiteAgentError(f"site-agent --config {path}: unknown key {key!r}"
                                 + (f" (did you mean {close[0]!r}?)" if close else "")
                                 + f"; expected one of {', '.join(known)}")
    if not isinstance(data.get("socket"), str) or not data["socket"]:
        raise SiteAgentError(f"site-agent --config {path}: 'socket' (the path of the agent's "
                             "Unix socket, which the SuperNode's node config names as "
                             f"{NODE_CONFIG_KEY}) is missing")
    relay_uid = data.get("relay-uid")
    if relay_uid is not None and (isinstance(relay_uid, bool) or not isinstance(relay_uid, int)
                                  or not 0 < relay_uid < 2**31 or relay_uid == os.geteuid()):
        raise SiteAgentError(f"site-agent --config {path}: relay-uid={relay_uid!r} is invalid: "
                             "expected the uid of the SuperNode's ClientApp process, an integer "
                             f"> 0 other than root's and the agent's own ({os.geteuid()})")
    node_config = {k: v for k, v in data.items() if k not in AGENT_KEYS}
    if node_config.get("site-mode") in ("simulation", "development"):
        raise SiteAgentError(f"site-agent --config {path}: site-mode="
                             f"{node_config['site-mode']!r} is for a harness that plays the "
                             "sites or a SuperNode without an agent, never for an agent")
    node_config.setdefault("site-mode", "deployment")
    try:
        site_policy(node_config)
    except PolicyError as err:
        raise SiteAgentError(f"site-agent --config {path}: {err}") from err
    return AgentConfig(path, os.path.abspath(data["socket"]), node_config, relay_uid)


def _file_only_policy() -> Any:
    from fedcompress.privacy.policy import SitePolicy

    return SitePolicy(state_dir="", ephemeral_state=True)


# -- the agent -------------------------------------------------------------------------------------
class SiteAgent:
    """A site's operations over its own node config, with one Flower Context per run kept in
    memory (its state holds a SecAgg+ vote's keys between messages)."""

    def __init__(self, node_config: dict[str, Any]) -> None:
        self.node_config = dict(node_config)
        self.operations = operations()
        self.contexts: OrderedDict[int, Any] = OrderedDict()
        self.served = 0

    def context_for(self, message: Any) -> Any:
        """The agent's Context of the message's run (the last :data:`CONTEXTS_KEPT` runs)."""
        from flwr.app import Context, RecordDict

        run = int(message.metadata.run_id)
        if run not in self.contexts:
            if len(self.contexts) >= CONTEXTS_KEPT:
                self.contexts.popitem(last=False)
            self.contexts[run] = Context(run_id=run, node_id=int(message.metadata.dst_node_id),
                                         node_config=dict(self.node_config),
                                         state=RecordDict(), run_config={})
        self.contexts.move_to_end(run)
        return self.contexts[run]

    def handle(self, message: Any) -> Any:
        """The reply to ``message``: an operation of this agent's registry, or a refusal."""
        action = message.metadata.message_type
        op = self.operations.get(action)
        if op is None:
            logger.warning("refused an unknown operation %r", action)
            return error_reply(message, f"refused by the site's policy: operation {action!r} "
                               f"is not one of this site's operations (fedcompress site "
                               f"operations v{OPERATIONS_VERSION}: "
                               f"{', '.join(sorted(self.operations))})")
        self.served += 1
        logger.info("message %d: %s (run %d)", self.served, action, message.metadata.run_id)
        return run_operation(op, message, self.context_for(message))


# -- the relay (the FAB's ClientApp process) -------------------------------------------------------
def relay(path: str, message: Any) -> Any:
    """The agent's reply to ``message``; nothing else crosses (no Context, no node config)."""
    started = startup.message_started()
    clock = time.perf_counter()
    hello = {"protocol": PROTOCOL, "operations": OPERATIONS_VERSION,
             "task": frames._task_identity()}
    with frames._connect(path) as sock:
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                frames.write_json(sock, hello)
            answer = frames.read_json(sock, time.monotonic() + frames.IO_TIMEOUT)
            if not answer.get("ok"):
                raise SiteAgentError(f"the site agent at {path} refused the message: "
                                     f"{answer.get('error')}")
            frames.write_frame(sock, frames.message_to_bytes(message))
            sock.settimeout(None)  # an operation may run long (and wait for the lock)
            status = frames.read_json(sock)
            reply_bytes = frames.read_frame(sock)
        except frames.ProtocolError as err:
            raise SiteAgentError(f"the site agent at {path}: {err}") from err
        except TimeoutError as err:
            raise SiteAgentError(f"the site agent at {path} did not answer within "
                                 f"{frames.IO_TIMEOUT:g} s: {err}") from err
        except OSError as err:
            raise SiteAgentError(f"the site agent at {path} closed the connection "
                                 f"mid-message (did it stop? see its log): {err}") from err
    if not status.get("ok") or not reply_bytes:
        raise SiteAgentError(f"the site agent at {path}: {status.get('error')}")
    reply = frames.message_from_bytes(reply_bytes)
    frames.add_relay_startup(reply, started, clock, status)
    return reply


# -- serving ---------------------------------------------------------------------------------------
class _Server:
    def __init__(self, agent: SiteAgent) -> None:
        self.agent = agent
        self.lock = threading.Lock()

    def check(self, hello: dict) -> str | None:
        if hello.get("protocol") != PROTOCOL:
            return (f"site-agent protocol {hello.get('protocol')!r} of the relay, {PROTOCOL} of "
                    "the agent")
        if hello.get("operations") != OPERATIONS_VERSION:
            return (f"the FAB expects site operations v{hello.get('operations')!r}, this agent "
                    f"serves v{OPERATIONS_VERSION}: install the fedcompress version the run's "
                    "FAB was built from, or run a FAB of this one")
        return None

    def handle(self, conn: socket.socket, timeout: float) -> None:
        from flwr.supercore.task_identity import TaskIdentity

        deadline = time.monotonic() + timeout
        try:
            hello = frames.read_json(conn, deadline)
            refusal = self.check(hello)
            if refusal:
                logger.warning("refused a relay: %s", refusal)
                frames.write_json(conn, {"ok": False, "error": refusal})
                return
            frames.write_json(conn, {"ok": True, "operations": OPERATIONS_VERSION,
                                     "pid": os.getpid()})
            message_bytes = frames.read_frame(conn, frames.MAX_FRAME_BYTES, deadline)
            with self.lock:  # one message at a time
                start = time.perf_counter()
                status: dict[str, Any] = {"ok": True}
                reply_bytes = b""
                try:
                    message = frames.message_from_bytes(message_bytes)
                    for name, value in (hello.get("task") or {}).items():
                        if name in ("run_id", "node_id", "task_id") and (
                                value is None or isinstance(value, int)):
                            setattr(TaskIdentity, name, value)
                    reply_bytes = frames.message_to_bytes(self.agent.handle(message))
                except Exception as err:  # an error of the agent itself, not an operation's
                    logger.exception("a message could not be served")
                    status = {"ok": False, "error": f"the site agent could not serve the "
                              f"message ({type(err).__name__}); its log has the details"}
                status["handler_seconds"] = time.perf_counter() - start
            conn.settimeout(timeout)
            frames.write_json(conn, status)
            frames.write_frame(conn, reply_bytes)
        except frames.ProtocolError as err:
            logger.warning("refused a connection: %s", err)
            frames._try_refuse(conn, str(err))
        except TimeoutError as err:
            logger.warning("dropped a connection that did not deliver its request within "
                           "%g s: %s", timeout, err)
        except OSError as err:
            logger.warning("a relay went away mid-message: %s", err)


def serve(config: AgentConfig, stop: threading.Event | None = None, *,
          max_connections: int = frames.MAX_CONNECTIONS, timeout: float = frames.IO_TIMEOUT,
          warm: bool = True) -> int:
    """Serve the site's operations on ``config.socket`` until SIGTERM/SIGINT (or ``stop``);
    the socket (mode 0600, in a folder of mode 0700, both of this uid; with ``relay-uid``,
    0666 in a folder of 0711, and that uid served too) is removed at exit
    (:func:`clients.site_socket.serve_socket`)."""
    server = _Server(SiteAgent(config.node_config))
    logger.info("site agent %d: %d operations (v%d), node config from %s", os.getpid(),
                len(server.agent.operations), OPERATIONS_VERSION, config.path)
    return frames.serve_socket(config.socket, "site agent", server.handle,
                               lambda: server.agent.served, stop,
                               max_connections=max_connections, timeout=timeout, warm=warm,
                               peer_uids=() if config.relay_uid is None else (config.relay_uid,))
