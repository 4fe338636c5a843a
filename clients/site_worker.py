"""A warm site worker: one long-lived process at a site that runs its ClientApp messages.

Flower 1.42's SuperNode starts a fresh ``flwr-clientapp`` process per message, and each pays
torch's and transformers' imports and the model load again (about 3.9 s of SmolLM2's 4.5 s
start-up). A site operator may start, next to its SuperNode, ``fedcompress site-worker --socket
PATH``: a process that imports Flower, torch and fedcompress once and keeps its per-process
caches (model, windows) warm across messages. With ``site-worker="PATH"`` in the SuperNode's
``--node-config``, the ``flwr-clientapp`` process stays thin (no torch, no transformers): the
ClientApp (``clients/app.py``) sends the Message and the Context, serialized with Flower's own
protobuf serde, over the Unix socket, and the worker runs them through the same ClientApp
(:func:`clients.app.local_app`) the process would have run, then sends back the reply and the
updated Context (its state holds a site's secrets between messages, e.g. SecAgg+ keys).

What is protected (the Context carries a site's secrets, e.g. its SecAgg+ keys, so the socket
is a trust boundary between local users of the site's host):

* the socket lives in a folder owned by the site's user with mode 0700 (the worker creates it
  so, or refuses an existing one that is not); both sides refuse a folder or a socket path
  that is a symbolic link (the folder is opened with ``O_NOFOLLOW`` and the socket reached
  through that descriptor, ``/proc/self/fd/N/NAME``, so a swap after the check does not
  redirect it), a socket path that is not a socket (a FIFO, a regular file) or a socket of
  another owner, with an error naming the path and what was expected;
* each side checks the other's uid with ``SO_PEERCRED`` (Linux): the thin process sends
  nothing to a worker of another uid, the worker serves no client of another uid;
* a frame's length is checked against a limit BEFORE anything is allocated
  (:data:`MAX_HEADER_BYTES` for the JSON headers, :data:`MAX_FRAME_BYTES` for a Message or
  Context) and its payload read in chunks of :data:`RECV_CHUNK` bytes, so memory grows with the
  bytes that arrived, never with what a header announced;
* the worker serves at most ``max_connections`` connections at once (more are refused at
  once) and a connection must deliver its request within ``timeout`` seconds (a stalled or
  trickling client is dropped: no slow-loris).

Not protected: root, or any process already running as the site's user (it can read the
worker's memory and the SuperNode's files anyway); the ClientApp code itself (the worker runs
the FAB's code only when it equals its own, see :meth:`_Worker.check`). ``SO_PEERCRED`` is
Linux-only: elsewhere the worker and the thin process refuse to run.

Protocol, one connection per message, every frame ``MAGIC + 8-byte big-endian length +
payload`` (at most :data:`MAX_FRAME_BYTES`; a JSON header at most :data:`MAX_HEADER_BYTES`):

1. thin -> worker: a JSON hello (protocol, the FAB's fedcompress version, its code hash and
   the sha256 of each of its modules, Flower's task identity); worker -> thin: a JSON answer,
   a refusal when the worker's version or code differs from the FAB's;
2. thin -> worker: the Message, then the Context (``flwr.proto`` bytes);
3. worker -> thin: a JSON status, the reply Message (empty if the ClientApp raised), the
   Context after the ClientApp.

The worker serves one message at a time (a lock); a second SuperNode message waits for the
first. Only the standard library and Flower here: the thin process imports this module.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import socket
import stat
import struct
import threading
import time
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any

from clients import startup

logger = logging.getLogger("fedcompress.site_worker")

#: The SuperNode's ``--node-config`` key naming the worker's socket (like ``data-path``).
NODE_CONFIG_KEY = "site-worker"
PROTOCOL = 1
MAGIC = b"FCW1"
_HEADER = struct.Struct(">4sQ")
#: The largest frame either side sends or accepts (a message, a context or a JSON header):
#: 1 GiB, above any mask message of the embedded models (Qwen2.5-1.5B's are ~190 MB).
MAX_FRAME_BYTES = 1 << 30
#: The largest JSON header frame (hello, answer, status): the hello lists the sha256 of each
#: module (~100 bytes each), far below this.
MAX_HEADER_BYTES = 1 << 20
#: A frame's payload is received in pieces of at most this many bytes: its buffer grows with
#: the data that arrived, never with the length its header announced.
RECV_CHUNK = 1 << 20
#: Connections the worker serves at once (one message runs, the others wait for the lock);
#: one more is refused at once (``fedcompress site-worker --max-connections``).
MAX_CONNECTIONS = 4
#: Seconds a client has to deliver its whole request (hello, Message, Context) and the longest
#: a write to a peer may block (``fedcompress site-worker --timeout``); the thin process waits
#: as long for the worker's answer to its hello.
IO_TIMEOUT = 60.0
#: The mode of the socket's folder: the site's user only.
FOLDER_MODE = 0o700
#: A site agent's socket folder when another uid's relay connects (``relay-uid``): traverse
#: only, for that uid; the socket is 0666 inside and ``SO_PEERCRED`` decides who is served.
SHARED_FOLDER_MODE = 0o711
#: The code a ClientApp runs: the worker must hold these modules exactly as the FAB ships them.
CODE_PACKAGES = ("clients", "fedcompress", "server", "strategies")


class SiteWorkerError(RuntimeError):
    """The site worker cannot serve this message (refused, missing, died, bad frame)."""


class ProtocolError(SiteWorkerError):
    """A frame that is not one of this protocol's, or too large."""


# -- frames ------------------------------------------------------------------------------------
def write_frame(sock: socket.socket, payload: bytes) -> None:
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(payload):,} bytes exceeds the site worker's limit "
                            f"MAX_FRAME_BYTES = {MAX_FRAME_BYTES:,}")
    sock.sendall(_HEADER.pack(MAGIC, len(payload)))
    if payload:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, size: int, deadline: float | None = None) -> bytes:
    """``size`` bytes, received in pieces of at most :data:`RECV_CHUNK` (memory grows with the
    bytes that arrived); :class:`TimeoutError` once ``deadline`` (``time.monotonic()``) passes."""
    pieces, got = [], 0
    while got < size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"timed out after {got:,} of {size:,} bytes")
            sock.settimeout(remaining)
        try:
            piece = sock.recv(min(RECV_CHUNK, size - got))
        except TimeoutError:
            raise TimeoutError(f"timed out after {got:,} of {size:,} bytes") from None
        if not piece:
            raise ConnectionResetError(f"connection closed after {got:,} of {size:,} bytes")
        pieces.append(piece)
        got += len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def read_frame(sock: socket.socket, limit: int | None = None,
               deadline: float | None = None) -> bytes:
    """One frame's payload, at most ``limit`` bytes (default :data:`MAX_FRAME_BYTES`).
    :class:`ProtocolError` on a bad magic or an announced length over the limit (refused before
    any allocation), :class:`ConnectionError` when the peer closes the connection,
    :class:`TimeoutError` when ``deadline`` (``time.monotonic()``) passes."""
    limit = MAX_FRAME_BYTES if limit is None else limit
    magic, size = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if magic != MAGIC:
        raise ProtocolError(f"not a site-worker frame: header starts {bytes(magic)!r}, "
                            f"expected {MAGIC!r}")
    if size > limit:
        name = "MAX_FRAME_BYTES" if limit == MAX_FRAME_BYTES else (
            "MAX_HEADER_BYTES" if limit == MAX_HEADER_BYTES else "limit")
        raise ProtocolError(f"frame of {size:,} bytes announced, over the site worker's limit "
                            f"{name} = {limit:,}")
    return _recv_exact(sock, size, deadline) if size else b""


def write_json(sock: socket.socket, value: dict) -> None:
    write_frame(sock, json.dumps(value).encode())


def read_json(sock: socket.socket, deadline: float | None = None) -> dict:
    payload = read_frame(sock, MAX_HEADER_BYTES, deadline)
    try:
        value = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProtocolError(f"garbage where a JSON header was expected: {err}") from err
    if not isinstance(value, dict):
        raise ProtocolError(f"a JSON header must be an object, got {type(value).__name__}")
    return value


# -- Flower's serde ----------------------------------------------------------------------------
def message_to_bytes(message: Any) -> bytes:
    from flwr.common.serde import message_to_proto

    return message_to_proto(message).SerializeToString()


def message_from_bytes(data: bytes) -> Any:
    from flwr.common.serde import message_from_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage

    return message_from_proto(_parse(ProtoMessage, data, "Message"))


def context_to_bytes(context: Any) -> bytes:
    from flwr.common.serde import context_to_proto

    return context_to_proto(context).SerializeToString()


def context_from_bytes(data: bytes) -> Any:
    from flwr.common.serde import context_from_proto
    from flwr.proto.message_pb2 import Context as ProtoContext

    return context_from_proto(_parse(ProtoContext, data, "Context"))


def _parse(proto_class: Any, data: bytes, what: str) -> Any:
    from google.protobuf.message import DecodeError

    try:
        return proto_class.FromString(data)
    except DecodeError as err:
        raise ProtocolError(f"garbage where a Flower {what} was expected: {err}") from err


# -- the code both sides run ---------------------------------------------------------------------
def code_root() -> Path:
    """The folder holding this process's ``clients`` package: the installed FAB in a
    ``flwr-clientapp`` process, the project (or site-packages) in the worker."""
    return Path(__file__).resolve().parents[1]


def code_files(root: Path) -> dict[str, str]:
    """sha256 of each module (``*.py``) of :data:`CODE_PACKAGES` under ``root``."""
    files = {}
    for package in CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            files[path.relative_to(root).as_posix()] = hashlib.sha256(
                path.read_bytes()).hexdigest()
    return files


def code_hash(files: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{p} {h}\n" for p, h in sorted(files.items()))
                          .encode()).hexdigest()


def code_version(root: Path) -> str:
    """fedcompress's version: ``root/pyproject.toml`` (a FAB, a checkout), else the installed
    distribution's."""
    try:
        with open(root / "pyproject.toml", "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        import importlib.metadata

        return importlib.metadata.version("fedcompress")


def _task_identity() -> dict[str, int | None]:
    from flwr.supercore.task_identity import TaskIdentity

    return {name: getattr(TaskIdentity, f"_{name}") for name in ("run_id", "node_id", "task_id")}


# -- the socket's folder, the socket, the peer ---------------------------------------------------
def expected_uid() -> int:
    """The uid both ends must run as: this process's (the site's user)."""
    return os.geteuid()


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket, from the
    kernel (``SO_PEERCRED``), not from anything the peer says."""
    if not hasattr(socket, "SO_PEERCRED"):
        raise SiteWorkerError("the site worker checks its peer's uid with SO_PEERCRED, which "
                              "this platform lacks (Linux only): do not use a site worker here")
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def check_peer(sock: socket.socket, what: str, allowed: Collection[int] = ()) -> None:
    """Refuse a peer (``what``: who it should be) whose uid is neither :func:`expected_uid`
    nor one of ``allowed`` (the site agent's ``relay-uid``)."""
    pid, uid, _ = peer_credentials(sock)
    if uid != expected_uid() and uid not in allowed:
        others = "".join(f" or {u}" for u in sorted(set(allowed) - {expected_uid()}))
        raise SiteWorkerError(f"{what} runs as uid {uid} (pid {pid}), expected uid "
                              f"{expected_uid()} (this process's, the site's user){others}: "
                              "refused")


def _where(path: str, agent: bool = False) -> str:
    kind = "site-agent" if agent else NODE_CONFIG_KEY
    return f"{kind} socket {path!r} (SuperNode --node-config {kind})"


def _open_folder(path: str, create: bool, shared: bool = False) -> tuple[int, str, int]:
    """``(descriptor of the socket's folder, the socket's name, the folder's owner)`` after
    checking the folder: not a symbolic link (``O_NOFOLLOW``), a folder, owned by
    :func:`expected_uid`, no access for group or others. ``create``: make a missing folder
    (its parent must exist). The caller reaches the socket through the descriptor
    (:func:`_fd_path`) and closes it.

    ``shared``: the folder of a site agent that serves another uid's relay (its ``relay-uid``):
    group and others may traverse it (mode 0711, created so) but never write it, and, for the
    relay (``create`` false), its owner may be another uid, whose socket it then expects."""
    path = os.path.abspath(path)
    folder, name = os.path.split(path)
    uid = expected_uid()
    mode_wanted = SHARED_FOLDER_MODE if shared else FOLDER_MODE
    fix = f"make it a folder of uid {uid} with mode {mode_wanted:04o} (mkdir -m {mode_wanted:o})"
    if not name:
        raise SiteWorkerError(f"{_where(path, shared)}: not a socket path (it ends with '/')")
    if create:
        try:
            os.mkdir(folder, mode_wanted)
            os.chmod(folder, mode_wanted)  # the umask may have removed the traverse bits
            logger.info("created the socket folder %s (mode %04o)", folder, mode_wanted)
        except FileExistsError:
            pass
        except OSError as err:
            raise SiteWorkerError(f"{_where(path, shared)}: cannot create its folder {folder}: "
                                  f"{err}") from err
    try:
        # the relay of another uid may only traverse the agent's folder (0711): O_PATH needs
        # no read permission, and a descriptor of it still serves fstat and the *at() calls
        how = os.O_PATH if not create and hasattr(os, "O_PATH") else os.O_RDONLY
        fd = os.open(folder, how | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SiteWorkerError(f"{_where(path, shared)}: its folder {folder} does not exist: {fix}"
                              ) from None
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SiteWorkerError(
                f"{_where(path, shared)}: its folder {folder} is a symbolic link or not a folder; "
                f"refusing to follow it: {fix}") from None
        raise SiteWorkerError(f"{_where(path, shared)}: cannot open its folder {folder}: {err}"
                              ) from err
    try:
        info = os.fstat(fd)
        mode = stat.S_IMODE(info.st_mode)
        if info.st_uid != uid and (create or not shared):
            raise SiteWorkerError(f"{_where(path, shared)}: its folder {folder} is owned by uid "
                                  f"{info.st_uid}, expected uid {uid} (the site's user): {fix}")
        if shared and mode & 0o022:
            raise SiteWorkerError(
                f"{_where(path, shared)}: its folder {folder} has mode {mode:04o}, writable by "
                f"group or others, who could replace the socket; expected at most 0711: "
                f"chmod go-w {folder}")
        if not shared and mode & 0o077:
            raise SiteWorkerError(
                f"{_where(path, shared)}: its folder {folder} has mode {mode:04o}, expected 0700 "
                f"(no access for group or others, who could replace the socket): chmod 700 "
                f"{folder}")
        if create and shared and mode != SHARED_FOLDER_MODE:  # the relay's uid traverses it
            os.fchmod(fd, SHARED_FOLDER_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd, name, info.st_uid


def _fd_path(fd: int, name: str, path: str) -> str:
    """The socket's address through the checked folder's descriptor (Linux ``/proc``), so that
    the folder cannot be swapped between the check and the use; else ``path``."""
    if os.path.isdir(f"/proc/self/fd/{fd}"):
        return f"/proc/self/fd/{fd}/{name}"
    return os.path.abspath(path)


def _check_socket_file(fd: int, name: str, path: str, owner: int | None = None) -> None:
    """The socket file itself (``lstat``): a Unix socket, not a symbolic link, FIFO or regular
    file, owned by ``owner`` (default :func:`expected_uid`). :class:`FileNotFoundError` when
    it is missing."""
    owner = expected_uid() if owner is None else owner
    info = os.stat(name, dir_fd=fd, follow_symlinks=False)
    if stat.S_ISLNK(info.st_mode):
        raise SiteWorkerError(f"{_where(path)} is a symbolic link: refusing to follow it "
                              "(give the socket's real path)")
    if not stat.S_ISSOCK(info.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(info.st_mode) else "a regular file"
                if stat.S_ISREG(info.st_mode) else "a folder" if stat.S_ISDIR(info.st_mode)
                else "not a socket")
        raise SiteWorkerError(f"{_where(path)} is not a Unix socket ({kind})")
    if info.st_uid != owner:
        raise SiteWorkerError(f"{_where(path)} is owned by uid {info.st_uid}, expected uid "
                              f"{owner} (the site's user)")


# -- the thin side (a flwr-clientapp process) ----------------------------------------------------
def _connect(path: str, timeout: float = IO_TIMEOUT, shared: bool = False) -> socket.socket:
    """A connection to the worker at ``path`` after every check: the folder, the socket file,
    then the worker's uid (``SO_PEERCRED``), before anything is sent. ``shared``: a site
    agent's socket, whose folder's owner (who alone can place a socket there) may be another
    uid: the socket file and the process that listens must then be that uid's."""
    fd, name, owner = _open_folder(path, create=False, shared=shared)
    try:
        try:
            _check_socket_file(fd, name, path, owner)
        except FileNotFoundError:
            raise SiteWorkerError(f"{_where(path, shared)} does not exist: start `fedcompress "
                                  f"{'site-agent --config' if shared else 'site-worker --socket'} "
                                  "...` at this site") from None
        except OSError as err:
            raise SiteWorkerError(f"{_where(path, shared)} cannot be used: {err}") from err
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(_fd_path(fd, name, path))
            if owner == expected_uid():
                check_peer(sock, f"the site worker at {path}")
            else:  # exactly the folder's owner, who alone can place the socket there
                pid, uid, _ = peer_credentials(sock)
                if uid != owner:
                    raise SiteWorkerError(f"the site agent at {path} runs as uid {uid} (pid "
                                          f"{pid}), expected uid {owner} (the owner of its "
                                          "folder and socket): refused")
        except OSError as err:
            sock.close()
            raise SiteWorkerError(f"nothing answers at {_where(path, shared)}: {err}") from err
        except BaseException:
            sock.close()
            raise
        return sock
    finally:
        os.close(fd)


def exchange(path: str, message: Any, context: Any, root: Path | None = None
             ) -> tuple[Any, Any, dict]:
    """Run ``message`` in the worker at ``path``: ``(reply or None, context after the
    ClientApp, status)``. ``root``: the code the worker must equal (default: this process's,
    the installed FAB). Raises :class:`SiteWorkerError` on a refusal or a broken exchange
    (:func:`_connect`'s checks come first: nothing is sent to a worker that fails them)."""
    root = root or code_root()
    files = code_files(root)
    hello = {"protocol": PROTOCOL, "version": code_version(root), "code_hash": code_hash(files),
             "files": files, "task": _task_identity()}
    with _connect(path) as sock:
        try:
            # a busy worker writes its refusal and closes without reading: the hello may meet a
            # closed pipe, and the refusal is still there to read (and name the reason)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                write_json(sock, hello)
            answer = read_json(sock, time.monotonic() + IO_TIMEOUT)
            if not answer.get("ok"):
                raise SiteWorkerError(f"the site worker at {path} refused the message: "
                                      f"{answer.get('error')}")
            write_frame(sock, message_to_bytes(message))
            write_frame(sock, context_to_bytes(context))
            sock.settimeout(None)  # the ClientApp may run long (and wait for the lock)
            status = read_json(sock)
            reply_bytes, context_bytes = read_frame(sock), read_frame(sock)
        except ProtocolError as err:
            raise SiteWorkerError(f"the site worker at {path}: {err}") from err
        except TimeoutError as err:
            raise SiteWorkerError(f"the site worker at {path} did not answer within "
                                  f"{IO_TIMEOUT:g} s: {err}") from err
        except OSError as err:  # ConnectionError, BrokenPipeError: the worker went away
            raise SiteWorkerError(
                f"the site worker at {path} closed the connection mid-message (did it stop or "
                f"die? see its log): {err}") from err
    reply = message_from_bytes(reply_bytes) if reply_bytes else None
    return reply, context_from_bytes(context_bytes) if context_bytes else None, status


def forward(path: str, message: Any, context: Any) -> Any:
    """The ClientApp's reply to ``message``, run by the site worker at ``path``; ``context``
    takes the worker's updates. Every reply with metrics carries the start-up split: this
    process's Flower runtime and imports, the worker's imports (what this message made it
    import), loading and compute, and ``startup_worker_seconds`` (the exchange less the
    worker's ClientApp: code check, serde, socket, waiting for the worker's lock)."""
    started = startup.message_started()
    clock = time.perf_counter()
    reply, after, status = exchange(path, message, context)
    if after is not None:
        context.node_config, context.state, context.run_config = (
            after.node_config, after.state, after.run_config)
    if not status.get("ok") or reply is None:
        raise SiteWorkerError(f"{status.get('raised') or 'error'} in the site worker at {path}:"
                              f" {status.get('error')}")
    add_relay_startup(reply, started, clock, status)
    return reply


def add_relay_startup(reply: Any, started: Any, clock: float, status: dict) -> None:
    """Into a reply with metrics that a long-lived process (a worker, an agent) computed: this
    relaying process's imports and loading added to its own, and ``startup_worker_seconds``
    (the exchange since ``clock`` less the handler's ``status["handler_seconds"]``)."""
    if reply.has_error() or "metrics" not in reply.content:
        return
    mine = startup.message_metrics(started)
    metrics = reply.content["metrics"]
    for key in ("startup_import_seconds", "startup_load_seconds"):
        metrics[key] = (float(metrics[key]) if key in metrics else 0.0) + mine[key]
    metrics["client_startup_seconds"] = (metrics["startup_import_seconds"]
                                         + metrics["startup_load_seconds"])
    metrics["startup_worker_seconds"] = max(
        time.perf_counter() - clock - float(status.get("handler_seconds", 0.0)), 0.0)
    if "startup_runtime_seconds" in mine:
        metrics["startup_runtime_seconds"] = mine["startup_runtime_seconds"]


# -- the worker ----------------------------------------------------------------------------------
class _Worker:
    """The worker's state: its code, the one ClientApp, the message lock."""

    def __init__(self, path: str):
        self.path = path
        self.root = code_root()
        self.files = code_files(self.root)
        self.version = code_version(self.root)
        self.hash = code_hash(self.files)
        self.lock = threading.Lock()
        self.served = 0

    def check(self, hello: dict) -> str | None:
        """Why this worker refuses the hello's FAB, or None."""
        if hello.get("protocol") != PROTOCOL:
            return (f"site-worker protocol {hello.get('protocol')!r} of the ClientApp, "
                    f"{PROTOCOL} of the worker")
        if hello.get("version") != self.version:
            return (f"the worker runs fedcompress {self.version}, the FAB is fedcompress "
                    f"{hello.get('version')}: restart the worker with the FAB's version")
        files = hello.get("files")
        if not isinstance(files, dict) or code_hash(files) != hello.get("code_hash"):
            return "the hello's code hash does not match its file list"
        mine = {p: self.files.get(p, "missing") for p in files}
        if mine != files:
            differ = sorted(p for p in files if mine[p] != files[p])
            return (f"the worker's code (hash {code_hash(mine)[:16]}, {self.root}) differs from "
                    f"the FAB's (hash {hello['code_hash'][:16]}) in {len(differ)} module(s): "
                    f"{', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''}; restart the "
                    "worker from the FAB's code")
        return None

    def run(self, hello: dict, message_bytes: bytes, context_bytes: bytes
            ) -> tuple[dict, bytes, bytes]:
        """The ClientApp on one message (under the lock): status, reply and context bytes."""
        from flwr.supercore.task_identity import TaskIdentity

        from clients.app import local_app

        message = message_from_bytes(message_bytes)
        context = context_from_bytes(context_bytes)
        for name, value in hello.get("task", {}).items():
            if name in ("run_id", "node_id", "task_id"):
                setattr(TaskIdentity, name, value)
        kind = message.metadata.message_type
        start = time.perf_counter()
        reply_bytes = b""
        try:
            reply = local_app()(message, context)
            reply_bytes = message_to_bytes(reply)
            status: dict[str, Any] = {"ok": True}
        except Exception as err:  # the ClientApp's error goes to the SuperNode, as in Flower
            logger.exception("message %s (run %s) raised", kind, context.run_id)
            status = {"ok": False, "raised": type(err).__name__, "error": str(err)}
        status["handler_seconds"] = time.perf_counter() - start
        status["worker_pid"] = os.getpid()
        self.served += 1
        logger.info("message %d: %s, run %s, node %s: %s in %.2f s", self.served, kind,
                    context.run_id, context.node_id, "ok" if status["ok"] else "error",
                    status["handler_seconds"])
        return status, reply_bytes, context_to_bytes(context)

    def handle(self, conn: socket.socket, timeout: float = IO_TIMEOUT) -> None:
        """One connection: hello, message, reply. The request (hello, Message, Context) must
        arrive within ``timeout`` seconds; each write may block at most ``timeout``."""
        deadline = time.monotonic() + timeout
        try:
            hello = read_json(conn, deadline)
            refusal = self.check(hello)
            if refusal:
                logger.warning("refused a message: %s", refusal)
                write_json(conn, {"ok": False, "error": refusal})
                return
            write_json(conn, {"ok": True, "version": self.version, "code_hash": self.hash,
                              "pid": os.getpid()})
            message_bytes = read_frame(conn, MAX_FRAME_BYTES, deadline)
            context_bytes = read_frame(conn, MAX_FRAME_BYTES, deadline)
            with self.lock:  # one message at a time
                status, reply, context = self.run(hello, message_bytes, context_bytes)
            conn.settimeout(timeout)
            write_json(conn, status)
            write_frame(conn, reply)
            write_frame(conn, context)
        except ProtocolError as err:
            logger.warning("refused a connection: %s", err)
            _try_refuse(conn, str(err))
        except TimeoutError as err:
            logger.warning("dropped a connection that did not deliver its request within "
                           "%g s (--timeout): %s", timeout, err)
        except OSError as err:
            logger.warning("a ClientApp went away mid-message: %s", err)


def _try_refuse(conn: socket.socket, error: str) -> None:
    """Tell a peer why it is refused, if it still listens (never blocks more than 1 s)."""
    try:
        conn.settimeout(1.0)
        write_json(conn, {"ok": False, "error": error})
    except OSError:
        pass


def _listen(path: str, backlog: int = MAX_CONNECTIONS, shared: bool = False) -> socket.socket:
    """A listening Unix socket at ``path``, mode 0600 from its creation, in a folder of this
    uid with mode 0700 (created so when missing; :func:`_open_folder`). A stale socket file of
    this uid (nobody listening) is replaced; a live one, a symbolic link or any other file is
    refused. ``shared`` (a site agent with a ``relay-uid``): the folder may be 0711 and the
    socket is 0666, so that the relay's uid can connect; who is served is decided by the
    peer's uid (``SO_PEERCRED``, :func:`serve_socket`)."""
    fd, name, _ = _open_folder(path, create=True, shared=shared)
    try:
        address = _fd_path(fd, name, path)
        try:
            _check_socket_file(fd, name, path)
        except FileNotFoundError:
            pass
        else:
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(address)
            except OSError:
                logger.info("removing the stale socket file %s", path)
                os.unlink(name, dir_fd=fd)
            else:
                raise SiteWorkerError(f"another site worker listens on {path}")
            finally:
                probe.close()
        # Bound and listening under a temporary name, then linked to ``name``: the socket file
        # appears only once it accepts connections (whoever waits for it never meets a refusal),
        # and link(2) never replaces a file created meanwhile.
        staging = f".binding-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):  # left by a killed worker of this pid
            os.unlink(staging, dir_fd=fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        umask = os.umask(0o177)
        try:
            sock.bind(_fd_path(fd, staging, os.path.join(os.path.dirname(path), staging)))
        except OSError as err:
            sock.close()
            raise SiteWorkerError(f"cannot create the socket {path}: {err}") from err
        finally:
            os.umask(umask)
        try:
            # bound just now, in our folder that nobody else may write
            os.chmod(staging, 0o666 if shared else 0o600, dir_fd=fd)
            sock.listen(backlog)
            try:
                os.link(staging, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                raise SiteWorkerError(f"{path} was created while this worker started: another "
                                      "site worker listens there, or something else made it"
                                      ) from None
        except BaseException:
            sock.close()
            raise
        finally:
            os.unlink(staging, dir_fd=fd)
        return sock
    finally:
        os.close(fd)


def warm_up() -> float:
    """Import what every message would: the ClientApp with every method's handlers, torch,
    transformers and the model loader. Returns the seconds, which no message is charged."""
    import importlib

    start = time.perf_counter()
    from clients.app import local_app
    from fedcompress.methods import methods

    local_app()
    for method in methods().values():
        importlib.import_module(method.client_module)
    import transformers

    import fedcompress.models  # noqa: F401

    transformers.utils.logging.disable_progress_bar()
    startup.settle()  # the worker's own start-up, no message's
    return time.perf_counter() - start


def serve(path: str, stop: threading.Event | None = None, *,
          max_connections: int = MAX_CONNECTIONS, timeout: float = IO_TIMEOUT,
          warm: bool = True) -> int:
    """Serve ClientApp messages on the Unix socket ``path`` until SIGTERM/SIGINT (or
    ``stop``): the socket is removed at exit. At most ``max_connections`` connections at once
    (more are refused at once), each from a process of this uid (``SO_PEERCRED``), each
    delivering its request within ``timeout`` seconds. ``warm``: import everything a message
    needs first (:func:`warm_up`). Returns the process's exit code."""
    path = os.path.abspath(path)
    worker = _Worker(path)
    logger.info("site worker %d: fedcompress %s, code %s (%s, %d modules)", os.getpid(),
                worker.version, worker.hash[:16], worker.root, len(worker.files))
    return serve_socket(path, "site worker", worker.handle, lambda: worker.served, stop,
                        max_connections=max_connections, timeout=timeout, warm=warm)


def serve_socket(path: str, name: str, handle: Any, served: Any,
                 stop: threading.Event | None = None, *, max_connections: int = MAX_CONNECTIONS,
                 timeout: float = IO_TIMEOUT, warm: bool = True,
                 peer_uids: Collection[int] = ()) -> int:
    """The serving loop of the site worker and the site agent (``name``): listen on ``path``
    (:func:`_listen`), run ``handle(conn, timeout)`` in a thread per connection from a peer of
    this uid (or of ``peer_uids``: the agent's ``relay-uid``, which makes the socket
    ``shared``), at most ``max_connections`` at once, until SIGTERM/SIGINT or ``stop`` (a
    second signal stops at once); ``served()`` counts the messages for the last log line."""
    import signal

    if isinstance(max_connections, bool) or not isinstance(max_connections, int) \
            or max_connections < 1:
        raise SiteWorkerError(f"max_connections={max_connections!r}: expected an integer >= 1")
    if not timeout > 0:
        raise SiteWorkerError(f"timeout={timeout!r}: expected seconds > 0")
    stop = stop or threading.Event()
    seconds = warm_up() if warm else 0.0
    peer_uids = tuple(sorted(set(peer_uids) - {expected_uid()}))
    listener = _listen(path, max_connections, shared=bool(peer_uids))
    inode = os.stat(path).st_ino
    listener.settimeout(0.2)
    slots = threading.BoundedSemaphore(max_connections)

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():  # a second signal: no waiting for the message in flight
            _remove(path, inode)
            os._exit(128 + signum)
        logger.info("signal %d: stopping (the message in flight, if any, finishes)", signum)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, on_signal)
    logger.info("%s ready on %s (%s, uid %d%s) after %.1f s of imports; one message at a "
                "time, at most %d connections, %g s to deliver a request", name, path,
                "mode 0666, folder 0711" if peer_uids else "mode 0600, folder 0700",
                expected_uid(), "".join(f", peer uid {u}" for u in peer_uids), seconds,
                max_connections, timeout)
    threads: list[threading.Thread] = []
    try:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                threads = [t for t in threads if t.is_alive()]
                continue
            if not slots.acquire(blocking=False):
                logger.warning("refused a connection: %d connections open already "
                               "(--max-connections)", max_connections)
                _try_refuse(conn, f"the {name} is busy: {max_connections} connections open "
                            "already (--max-connections)")
                conn.close()
                continue
            thread = threading.Thread(target=_serve_one,
                                      args=(name, handle, conn, slots, timeout, peer_uids),
                                      daemon=True)
            thread.start()
            threads.append(thread)
    finally:
        listener.close()
        _remove(path, inode)
        for thread in threads:
            thread.join()
        logger.info("%s stopped after %d message(s); %s removed", name, served(), path)
    return 0


def _serve_one(name: str, handle: Any, conn: socket.socket,
               slots: threading.BoundedSemaphore, timeout: float,
               peer_uids: Collection[int] = ()) -> None:
    try:
        with conn:
            try:
                check_peer(conn, f"a client of the {name}", peer_uids)
            except SiteWorkerError as err:
                logger.warning("refused a connection: %s", err)
                _try_refuse(conn, str(err))
                return
            handle(conn, timeout)
    finally:
        slots.release()


def _remove(path: str, inode: int) -> None:
    """Remove the socket file if it is still ours."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass
