"""The site agent's Unix socket: its frames, Flower's serde, the folder and peer checks, the
serving loop (:mod:`clients.site_agent` runs the site's operations behind it).

The socket is a trust boundary between local users of the site's host, so both ends check
everything before a byte of a message crosses:

* the socket lives in a folder owned by the agent's user with mode 0700 (the agent creates it
  so, or refuses an existing one that is not); with a ``relay-uid`` (the ClientApp runs as
  another uid, as in ``docker/compose.yml``) the folder is 0711 and the socket 0666, and the
  folder must never be writable by group or others. Both sides refuse a folder or a socket path
  that is a symbolic link (the folder is opened with ``O_NOFOLLOW``, or ``O_PATH`` by a relay
  that may only traverse it, and the socket reached through that descriptor,
  ``/proc/self/fd/N/NAME``, so a swap after the check does not redirect it), a socket path
  that is not a socket (a FIFO, a regular file) or a socket of another owner than the folder's,
  with an error naming the path and what was expected;
* each side checks the other's uid with ``SO_PEERCRED`` (Linux): the relay sends nothing to a
  listener that is not the folder's owner, the agent serves no peer but its own uid and its
  ``relay-uid``;
* a frame's length is checked against a limit BEFORE anything is allocated
  (:data:`MAX_HEADER_BYTES` for the JSON headers, :data:`MAX_FRAME_BYTES` for a Message) and
  its payload read in chunks of :data:`RECV_CHUNK` bytes, so memory grows with the bytes that
  arrived, never with what a header announced;
* the agent serves at most ``max_connections`` connections at once (more are refused at once)
  and a connection must deliver its request within ``timeout`` seconds (a stalled or
  trickling client is dropped: no slow-loris).

Not protected: root, or any process running as the agent's user (it can read the agent's memory
and files anyway). ``SO_PEERCRED`` is Linux-only: elsewhere both ends refuse to run.

Every frame is ``MAGIC + 8-byte big-endian length + payload`` (at most
:data:`MAX_FRAME_BYTES`; a JSON header at most :data:`MAX_HEADER_BYTES`); the exchange itself
is the agent's (:mod:`clients.site_agent`). Only the standard library and Flower here: the
relay (the FAB's ``flwr-clientapp`` process) imports this module.

This module was the warm site worker's (``fedcompress site-worker``, the same uid's ClientApp
kept warm) until the site agent replaced it: a worker ran the server's code, the agent runs
only the site's own.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Collection
from typing import Any

from clients import startup

logger = logging.getLogger("fedcompress.site_socket")

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
#: Connections the agent serves at once (one message runs, the others wait for its lock);
#: one more is refused at once (``fedcompress site-agent --max-connections``).
MAX_CONNECTIONS = 4
#: Seconds a client has to deliver its whole request (hello, Message, Context) and the longest
#: a write to a peer may block (``fedcompress site-agent --timeout``); the relay waits as long
#: for the agent's answer to its hello.
IO_TIMEOUT = 60.0
#: The mode of the socket's folder: the site's user only.
FOLDER_MODE = 0o700
#: A site agent's socket folder when another uid's relay connects (``relay-uid``): traverse
#: only, for that uid; the socket is 0666 inside and ``SO_PEERCRED`` decides who is served.
SHARED_FOLDER_MODE = 0o711


class SiteSocketError(RuntimeError):
    """The agent's socket cannot be used (refused, missing, died, bad frame), named."""


class ProtocolError(SiteSocketError):
    """A frame that is not one of this protocol's, or too large."""


# -- frames ------------------------------------------------------------------------------------
def write_frame(sock: socket.socket, payload: bytes) -> None:
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(payload):,} bytes exceeds the site socket's limit "
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
        raise ProtocolError(f"not a site-agent frame: header starts {bytes(magic)!r}, "
                            f"expected {MAGIC!r}")
    if size > limit:
        name = "MAX_FRAME_BYTES" if limit == MAX_FRAME_BYTES else (
            "MAX_HEADER_BYTES" if limit == MAX_HEADER_BYTES else "limit")
        raise ProtocolError(f"frame of {size:,} bytes announced, over the site socket's limit "
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


def _parse(proto_class: Any, data: bytes, what: str) -> Any:
    from google.protobuf.message import DecodeError

    try:
        return proto_class.FromString(data)
    except DecodeError as err:
        raise ProtocolError(f"garbage where a Flower {what} was expected: {err}") from err


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
        raise SiteSocketError("the site agent checks its peer's uid with SO_PEERCRED, which "
                              "this platform lacks (Linux only): run the site elsewhere")
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def check_peer(sock: socket.socket, what: str, allowed: Collection[int] = ()) -> None:
    """Refuse a peer (``what``: who it should be) whose uid is neither :func:`expected_uid`
    nor one of ``allowed`` (the site agent's ``relay-uid``)."""
    pid, uid, _ = peer_credentials(sock)
    if uid != expected_uid() and uid not in allowed:
        others = "".join(f" or {u}" for u in sorted(set(allowed) - {expected_uid()}))
        raise SiteSocketError(f"{what} runs as uid {uid} (pid {pid}), expected uid "
                              f"{expected_uid()} (this process's, the site's user){others}: "
                              "refused")


def _where(path: str) -> str:
    return f"site-agent socket {path!r} (the agent's config 'socket', the SuperNode's " \
        "--node-config site-agent)"


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
        raise SiteSocketError(f"{_where(path)}: not a socket path (it ends with '/')")
    if create:
        try:
            os.mkdir(folder, mode_wanted)
            os.chmod(folder, mode_wanted)  # the umask may have removed the traverse bits
            logger.info("created the socket folder %s (mode %04o)", folder, mode_wanted)
        except FileExistsError:
            pass
        except OSError as err:
            raise SiteSocketError(f"{_where(path)}: cannot create its folder {folder}: "
                                  f"{err}") from err
    try:
        # the relay of another uid may only traverse the agent's folder (0711): O_PATH needs
        # no read permission, and a descriptor of it still serves fstat and the *at() calls
        how = os.O_PATH if not create and hasattr(os, "O_PATH") else os.O_RDONLY
        fd = os.open(folder, how | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SiteSocketError(f"{_where(path)}: its folder {folder} does not exist: {fix}"
                              ) from None
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SiteSocketError(
                f"{_where(path)}: its folder {folder} is a symbolic link or not a folder; "
                f"refusing to follow it: {fix}") from None
        raise SiteSocketError(f"{_where(path)}: cannot open its folder {folder}: {err}"
                              ) from err
    try:
        info = os.fstat(fd)
        mode = stat.S_IMODE(info.st_mode)
        if info.st_uid != uid and (create or not shared):
            raise SiteSocketError(f"{_where(path)}: its folder {folder} is owned by uid "
                                  f"{info.st_uid}, expected uid {uid} (the site's user): {fix}")
        if shared and mode & 0o022:
            raise SiteSocketError(
                f"{_where(path)}: its folder {folder} has mode {mode:04o}, writable by "
                f"group or others, who could replace the socket; expected at most 0711: "
                f"chmod go-w {folder}")
        if not shared and mode & 0o077:
            raise SiteSocketError(
                f"{_where(path)}: its folder {folder} has mode {mode:04o}, expected 0700 "
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
        raise SiteSocketError(f"{_where(path)} is a symbolic link: refusing to follow it "
                              "(give the socket's real path)")
    if not stat.S_ISSOCK(info.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(info.st_mode) else "a regular file"
                if stat.S_ISREG(info.st_mode) else "a folder" if stat.S_ISDIR(info.st_mode)
                else "not a socket")
        raise SiteSocketError(f"{_where(path)} is not a Unix socket ({kind})")
    if info.st_uid != owner:
        raise SiteSocketError(f"{_where(path)} is owned by uid {info.st_uid}, expected uid "
                              f"{owner} (the site's user)")


# -- the thin side (a flwr-clientapp process) ----------------------------------------------------
def _connect(path: str, timeout: float = IO_TIMEOUT) -> socket.socket:
    """A connection to the agent at ``path`` after every check: the folder, the socket file,
    then the agent's uid (``SO_PEERCRED``), before anything is sent. The folder's owner (who
    alone can place a socket there) may be another uid than this process's (the relay of a
    ``relay-uid``): the socket file and the process that listens must then be that uid's."""
    fd, name, owner = _open_folder(path, create=False, shared=True)
    try:
        try:
            _check_socket_file(fd, name, path, owner)
        except FileNotFoundError:
            raise SiteSocketError(f"{_where(path)} does not exist: start `fedcompress site-agent "
                                  "--config ...` at this site") from None
        except OSError as err:
            raise SiteSocketError(f"{_where(path)} cannot be used: {err}") from err
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(_fd_path(fd, name, path))
            if owner == expected_uid():
                check_peer(sock, f"the site agent at {path}")
            else:  # exactly the folder's owner, who alone can place the socket there
                pid, uid, _ = peer_credentials(sock)
                if uid != owner:
                    raise SiteSocketError(f"the site agent at {path} runs as uid {uid} (pid "
                                          f"{pid}), expected uid {owner} (the owner of its "
                                          "folder and socket): refused")
        except OSError as err:
            sock.close()
            raise SiteSocketError(f"nothing answers at {_where(path)}: {err}") from err
        except BaseException:
            sock.close()
            raise
        return sock
    finally:
        os.close(fd)


def add_relay_startup(reply: Any, started: Any, clock: float, status: dict) -> None:
    """Into a reply with metrics that the agent (a long-lived process) computed: this relaying
    process's imports and loading added to its own, and ``startup_worker_seconds`` (the
    exchange since ``clock`` less the handler's ``status["handler_seconds"]``; the key's name is
    the site worker's, kept for the reports)."""
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
                raise SiteSocketError(f"another site agent listens on {path}")
            finally:
                probe.close()
        # Bound and listening under a temporary name, then linked to ``name``: the socket file
        # appears only once it accepts connections (whoever waits for it never meets a refusal),
        # and link(2) never replaces a file created meanwhile.
        staging = f".binding-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):  # left by a killed agent of this pid
            os.unlink(staging, dir_fd=fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        umask = os.umask(0o177)
        try:
            sock.bind(_fd_path(fd, staging, os.path.join(os.path.dirname(path), staging)))
        except OSError as err:
            sock.close()
            raise SiteSocketError(f"cannot create the socket {path}: {err}") from err
        finally:
            os.umask(umask)
        try:
            # bound just now, in our folder that nobody else may write
            os.chmod(staging, 0o666 if shared else 0o600, dir_fd=fd)
            sock.listen(backlog)
            try:
                os.link(staging, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                raise SiteSocketError(f"{path} was created while this agent started: another "
                                      "site agent listens there, or something else made it"
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
    from clients.local import local_app
    from fedcompress.methods import methods

    local_app()
    for method in methods().values():
        importlib.import_module(method.client_module)
    import transformers

    import fedcompress.models  # noqa: F401

    transformers.utils.logging.disable_progress_bar()
    startup.settle()  # the agent's own start-up, no message's
    return time.perf_counter() - start


def serve_socket(path: str, name: str, handle: Any, served: Any,
                 stop: threading.Event | None = None, *, max_connections: int = MAX_CONNECTIONS,
                 timeout: float = IO_TIMEOUT, warm: bool = True,
                 peer_uids: Collection[int] = ()) -> int:
    """The site agent's serving loop (``name`` for its log): listen on ``path``
    (:func:`_listen`), run ``handle(conn, timeout)`` in a thread per connection from a peer of
    this uid (or of ``peer_uids``: the agent's ``relay-uid``, which makes the socket
    ``shared``), at most ``max_connections`` at once, until SIGTERM/SIGINT or ``stop`` (a
    second signal stops at once); ``served()`` counts the messages for the last log line."""
    import signal

    if isinstance(max_connections, bool) or not isinstance(max_connections, int) \
            or max_connections < 1:
        raise SiteSocketError(f"max_connections={max_connections!r}: expected an integer >= 1")
    if not timeout > 0:
        raise SiteSocketError(f"timeout={timeout!r}: expected seconds > 0")
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
            except SiteSocketError as err:
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
