"""Attacks on a site's deployment, performed as a local user of the site's host (or a curious
neighbour site) would, each asserting that it is refused or fails:

* the site agent's socket (``clients/site_socket.py``): a symlinked socket or folder, a
  socket in a world-writable folder such as /tmp, a folder of the wrong mode or owner, a FIFO,
  regular file or foreign socket at the socket path, a peer of another uid on either end
  (SO_PEERCRED), a frame announcing 1 GiB (no allocation), more connections than the cap, a
  client that stalls or trickles mid-frame (slow-loris);
* the key files of ``docker/make_certs.py``: never readable by group or others at any instant,
  a planted symlink at a key's path not followed;
* Docker Compose (``docker/compose*.yml``): one site's cache, state, data or key mounted in
  another site's or the SuperLink's container, sites sharing a user; the server's ClientApp
  run beside a site's data, keys, ledger or network (it runs in ``clientapp-I`` with the agent's
  socket alone);
* the site agent's shared socket (``relay-uid``): a third uid connecting, a relay that meets a
  socket folder others may write or a listener of another uid than the folder's owner;
* the fixed-point lanes SecAgg+ sums (``encode_fixed``): a value at, or just over, the edge of
  the range, a sum of all sites that would wrap, integer lanes.

The agent here runs in this process (a thread, ``warm=False``: no torch import) so that the
expected uid can be patched: the tests run as one user.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import socket
import stat
import struct
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import yaml

from clients import site_agent as sa
from clients import site_socket as ss

REPO = Path(__file__).resolve().parents[2]
OTHER_UID = 54321


# -- helpers -------------------------------------------------------------------------------------
@pytest.fixture
def private_dir(tmp_path):
    """A folder as the agent wants it: this uid's, mode 0700."""
    folder = tmp_path / "site"
    folder.mkdir(mode=0o700)
    folder.chmod(0o700)
    return folder


def _agent_config(path: Path) -> sa.AgentConfig:
    """A deployed site agent's config with its socket at ``path`` (no data: the attacks here
    never reach an operation)."""
    return sa.AgentConfig(str(path.parent / "agent.toml"), str(path), {
        "partition-id": 0, "num-partitions": 1, "site-mode": "deployment",
        "state-dir": str(path.parent.parent / "agent-state")})


@contextlib.contextmanager
def running_agent(path: Path, **options):
    """``site_agent.serve`` in a thread (no warm-up), stopped at exit; yields the stop event."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run():
        try:
            sa.serve(_agent_config(path), stop, warm=False, **options)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not path.exists():
        assert not errors, errors
        assert time.monotonic() < deadline, "the agent did not start"
        time.sleep(0.02)
    try:
        yield stop
    finally:
        stop.set()
        thread.join(30)
        assert not thread.is_alive()
        assert not errors, errors
        assert not path.exists(), "the agent left its socket behind"


class Listener:
    """A bare Unix-socket listener (an impostor 'agent') recording every byte it receives."""

    def __init__(self, path: Path, hold: bool = False):
        self.hold = hold  # keep every connection open, never answering (a silent agent)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.sock.settimeout(0.2)
        self.received = bytearray()
        self.connections = 0
        self.arrived = threading.Condition()  # notified on every connection and every chunk
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with self.arrived:
                self.connections += 1
                self.arrived.notify_all()
            with conn:
                conn.settimeout(0.5)
                while not self.stop.is_set():
                    try:
                        chunk = conn.recv(65536)
                    except TimeoutError:
                        if self.hold:
                            continue
                        break
                    except OSError:
                        break
                    if not chunk:
                        break
                    with self.arrived:
                        self.received += chunk
                        self.arrived.notify_all()

    def after_everything_before(self, timeout: float = 30) -> tuple[int, bytes]:
        """What reached this listener before now: ``(connections, bytes)``, observed, not
        guessed after a sleep. A marker is sent on a connection of our own, queued behind any
        earlier one (one accept loop serves connections in order, each until it closes); once
        the marker has arrived, everything queued before it has been read."""
        marker = f"marker-{os.getpid()}-{time.monotonic_ns()}".encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(self.sock.getsockname())
            probe.sendall(marker)
        with self.arrived:
            assert self.arrived.wait_for(lambda: self.received.endswith(marker), timeout), (
                "the listener did not receive the marker")
            return self.connections - 1, bytes(self.received[:-len(marker)])

    def close(self):
        self.stop.set()
        self.thread.join(10)
        self.sock.close()


def _message():
    from flwr.app import Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    return Message(RecordDict(), 100, "query.warmup")


def _exchange(path) -> None:
    """The relay's side (the FAB's ClientApp process) of one message to the agent at ``path``."""
    sa.relay(str(path), _message())


def _raw(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    return sock


# -- the socket path ---------------------------------------------------------------------------
def test_symlinked_socket_is_refused_and_gets_nothing(private_dir, tmp_path):
    """A local attacker points the site's agent path at its own listener through a symlink:
    the relay refuses it (lstat) and sends not one byte (the Message may carry a SecAgg+
    stage's shares)."""
    evil_dir = tmp_path / "evil"
    evil_dir.mkdir(mode=0o700)
    evil = Listener(evil_dir / "evil.sock")
    try:
        link = private_dir / "site.sock"
        link.symlink_to(evil_dir / "evil.sock")
        with pytest.raises(ss.SiteSocketError, match=r"site\.sock.* is a symbolic link"):
            _exchange(link)
        assert evil.after_everything_before() == (0, b"")
    finally:
        evil.close()


def test_symlinked_folder_is_refused_on_both_ends(private_dir, tmp_path):
    """The socket's folder is a symlink (to a folder the attacker can swap): refused by the
    relay (O_NOFOLLOW) and by the agent, naming the folder."""
    link = tmp_path / "linked"
    link.symlink_to(private_dir, target_is_directory=True)
    evil = Listener(private_dir / "site.sock")
    try:
        with pytest.raises(ss.SiteSocketError, match=r"folder .*linked is a symbolic link"):
            _exchange(link / "site.sock")
        assert evil.connections == 0
    finally:
        evil.close()
        (private_dir / "site.sock").unlink()
    with pytest.raises(ss.SiteSocketError, match=r"folder .*linked is a symbolic link"):
        ss._listen(str(link / "agent.sock"))
    assert not (private_dir / "agent.sock").exists()


def test_socket_in_world_writable_tmp_is_refused():
    """``/tmp/site.sock``: anyone can create or replace a file in /tmp, so an agent or a relay
    there could talk to another user's process: both refuse /tmp (mode 1777)."""
    path = f"/tmp/fedcompress-attack-{os.getpid()}.sock"
    with pytest.raises(ss.SiteSocketError, match=r"folder /tmp has mode 1777, expected 0700"):
        ss._listen(path)
    assert not os.path.exists(path)
    with pytest.raises(ss.SiteSocketError, match=r"folder /tmp has mode 1777, writable by group "
                                                 r"or others"):
        _exchange(path)


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o711, 0o701])
def test_folder_open_to_group_or_others_is_refused_by_the_agent(tmp_path, mode):
    """An agent without a relay-uid keeps its socket in a folder of mode 0700."""
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(ss.SiteSocketError, match=rf"mode {mode:04o}, expected 0700.*chmod 700"):
        ss._listen(str(folder / "w.sock"))
    assert stat.S_IMODE(folder.stat().st_mode) == mode  # refused, not "fixed" behind our back


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o730, 0o703])
def test_folder_others_may_write_is_refused_by_the_relay(tmp_path, mode):
    """The relay (possibly of another uid, which may only traverse the agent's folder) refuses
    a folder that group or others may write: they could replace the agent's socket."""
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(ss.SiteSocketError, match=rf"mode {mode:04o}, writable by group or "
                                                 "others"):
        _exchange(folder / "w.sock")
    assert stat.S_IMODE(folder.stat().st_mode) == mode


def test_folder_of_another_owner_is_refused_by_the_agent(private_dir, monkeypatch):
    """A folder owned by another user (who could replace the socket): the agent refuses to
    listen there. As root the folder really is chowned; otherwise the expected uid is patched.
    (The relay accepts a folder of another owner, the agent of a ``relay-uid``, and then only
    that owner's socket and listener: test_relay_refuses_a_listener_that_is_not_the_folders_
    owner.)"""
    if os.geteuid() == 0:
        os.chown(private_dir, OTHER_UID, OTHER_UID)
        owner, expected = OTHER_UID, 0
    else:
        monkeypatch.setattr(ss, "expected_uid", lambda: OTHER_UID)
        owner, expected = os.geteuid(), OTHER_UID
    with pytest.raises(ss.SiteSocketError, match=rf"owned by uid {owner}, expected uid "
                                                 rf"{expected}"):
        ss._listen(str(private_dir / "w.sock"))


def test_agent_creates_a_missing_folder_0700(tmp_path):
    path = tmp_path / "new-folder" / "w.sock"
    with running_agent(path):
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("kind", ["fifo", "file", "folder"])
def test_fifo_file_or_folder_at_the_socket_path_is_refused(private_dir, kind):
    path = private_dir / "w.sock"
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "file":
        path.write_text("not a socket")
    else:
        path.mkdir()
    name = {"fifo": "a FIFO", "file": "a regular file", "folder": "a folder"}[kind]
    with pytest.raises(ss.SiteSocketError, match=f"is not a Unix socket \\({name}\\)"):
        _exchange(path)
    with pytest.raises(ss.SiteSocketError, match="is not a Unix socket"):
        ss._listen(str(path))
    assert os.path.lexists(path)  # never replaced


def test_socket_of_another_owner_is_refused(private_dir):
    """A socket file (in the site's folder) owned by another uid is not the site's agent."""
    if os.geteuid() != 0:
        pytest.skip("needs root to chown the socket file")
    evil = Listener(private_dir / "w.sock")
    try:
        os.chown(private_dir / "w.sock", OTHER_UID, OTHER_UID)
        with pytest.raises(ss.SiteSocketError, match=rf"owned by uid {OTHER_UID}, expected"):
            _exchange(private_dir / "w.sock")
        assert evil.connections == 0
    finally:
        evil.close()


def test_folder_swapped_after_the_check_does_not_redirect(tmp_path, monkeypatch):
    """Time-of-check/time-of-use: right after the relay checked the socket's folder,
    the folder is renamed away and an attacker's folder (with its own listener) takes its
    name. The connection goes through the checked folder's descriptor (/proc/self/fd/N/NAME),
    so it still reaches the genuine socket; the attacker gets nothing."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc (Linux)")
    site = tmp_path / "site"
    site.mkdir(mode=0o700)
    genuine = Listener(site / "w.sock")
    evil_dir = tmp_path / "evil"
    evil_dir.mkdir(mode=0o700)
    evil = Listener(evil_dir / "w.sock")
    real_check = ss._check_socket_file

    def check_then_swap(fd, name, path, owner=None):
        real_check(fd, name, path, owner)
        os.rename(site, tmp_path / "moved")
        os.rename(evil_dir, site)

    monkeypatch.setattr(ss, "_check_socket_file", check_then_swap)
    try:
        with ss._connect(str(site / "w.sock")) as sock:
            sock.sendall(b"the context")
        deadline = time.monotonic() + 5
        while genuine.received != b"the context" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert genuine.received == b"the context"
        assert evil.connections == 0 and not evil.received
    finally:
        genuine.close()
        evil.close()


def test_relay_does_not_hang_on_a_silent_agent(private_dir, monkeypatch):
    """A 'agent' (of the right uid) that accepts and never answers the hello: the thin
    process gives up after IO_TIMEOUT with a clear error, instead of hanging the SuperNode's
    ClientApp forever."""
    monkeypatch.setattr(ss, "IO_TIMEOUT", 0.5)
    silent = Listener(private_dir / "w.sock", hold=True)
    try:
        start = time.monotonic()
        with pytest.raises(ss.SiteSocketError, match=r"did not answer within 0\.5 s"):
            _exchange(private_dir / "w.sock")
        assert time.monotonic() - start < 5
    finally:
        silent.close()


def test_a_reply_frame_over_the_limit_is_refused_by_the_relay(private_dir,
                                                                     monkeypatch):
    """An agent answering its hello with a frame announcing more than MAX_HEADER_BYTES: the
    relay refuses it before allocating and sends nothing more (no Message)."""
    sock_path = private_dir / "w.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(sock_path))
    server.listen(1)
    got = bytearray()

    def answer():
        conn, _ = server.accept()
        with conn:
            conn.settimeout(5)
            ss.read_json(conn)
            conn.sendall(struct.pack(">4sQ", ss.MAGIC, 1 << 40))
            with contextlib.suppress(OSError):
                while chunk := conn.recv(65536):
                    got.extend(chunk)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with pytest.raises(ss.SiteSocketError, match="MAX_HEADER_BYTES"):
            _exchange(sock_path)
        thread.join(10)
        assert not got  # the Message did not leave the relay
    finally:
        server.close()


# -- the peer's uid (SO_PEERCRED) ------------------------------------------------------------------
def test_relay_refuses_an_agent_of_another_uid(private_dir, monkeypatch):
    """An agent (here an impostor listener) whose process runs as another uid: the thin
    process checks SO_PEERCRED right after connecting and sends nothing."""
    evil = Listener(private_dir / "w.sock")
    real = ss.peer_credentials
    monkeypatch.setattr(ss, "peer_credentials",
                        lambda sock: (real(sock)[0], OTHER_UID, OTHER_UID))
    try:
        with pytest.raises(ss.SiteSocketError,
                           match=rf"runs as uid {OTHER_UID} \(pid \d+\), expected uid "
                                 rf"{os.geteuid()}"):
            _exchange(private_dir / "w.sock")
        connections, received = evil.after_everything_before()
        assert connections == 1 and received == b""  # it connected (to ask), then sent nothing
    finally:
        evil.close()


def test_peer_credentials_come_from_the_kernel(private_dir):
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        pid, uid, gid = ss.peer_credentials(left)
    assert (pid, uid, gid) == (os.getpid(), os.geteuid(), os.getegid())


def test_agent_refuses_a_client_of_another_uid(private_dir, monkeypatch, caplog):
    """A local user of another uid connects to the agent: refused before its hello is read
    (simulated by making the agent expect another uid once it listens)."""
    path = private_dir / "w.sock"
    with running_agent(path):
        monkeypatch.setattr(ss, "expected_uid", lambda: OTHER_UID)
        with caplog.at_level(logging.WARNING, "fedcompress"), _raw(path) as sock:
            answer = ss.read_json(sock)
        assert not answer["ok"]
        assert f"runs as uid {os.geteuid()}" in answer["error"]
        assert f"expected uid {OTHER_UID}" in answer["error"]
        monkeypatch.undo()


# -- the site agent's shared socket (relay-uid) ----------------------------------------------------
@contextlib.contextmanager
def _serving_shared(path: Path, peer_uids: tuple[int, ...]):
    """``serve_socket`` as a site agent with ``peer_uids`` (its relay-uid) in a thread; every
    served connection answers ``{"ok": true, "uid": PEER}``."""
    stop = threading.Event()

    def handle(conn, timeout):
        ss.write_json(conn, {"ok": True, "uid": ss.peer_credentials(conn)[1]})

    thread = threading.Thread(target=ss.serve_socket, args=(str(path), "site agent", handle,
                                                            lambda: 0, stop),
                              kwargs={"warm": False, "peer_uids": peer_uids}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not path.exists():
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


_CONNECT_AS = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect(sys.argv[1])
data = b""
while chunk := s.recv(4096):
    data += chunk
sys.stdout.write(data.decode("utf-8", "replace"))
"""


def test_agent_socket_serves_its_relay_uid_and_refuses_a_third_uid():
    """The agent's socket is shared with its ClientApp container's uid (``relay-uid``): folder
    0711, socket 0666. A process of that uid is served; a process of a third uid that reaches
    the socket is refused by its kernel-reported uid before anything is read."""
    import subprocess
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("needs root to run processes as other uids")
    # an interpreter other uids may run (this one may live in root's home)
    python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3")
                   if os.access(p, os.X_OK)), None)
    if python is None:
        pytest.skip("needs a system python3 that other uids can run")
    relay, third = OTHER_UID, OTHER_UID + 1
    top = Path(tempfile.mkdtemp(prefix="fedcompress-shared-", dir="/tmp"))
    try:
        top.chmod(0o711)
        path = top / "agent" / "agent.sock"
        with _serving_shared(path, (relay,)):
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o711
            assert stat.S_IMODE(path.stat().st_mode) == 0o666
            answers = {uid: subprocess.run([python, "-c", _CONNECT_AS, str(path)],
                                           user=uid, group=uid, capture_output=True, text=True,
                                           timeout=30, cwd="/")
                       for uid in (relay, third)}
        assert answers[relay].returncode == 0, answers[relay].stderr
        assert f'"uid": {relay}' in answers[relay].stdout, answers[relay].stdout
        refused = answers[third].stdout
        assert f"runs as uid {third}" in refused and '"ok": false' in refused, refused
        assert f"or {relay}" in refused  # the allowed uids are named, no more
    finally:
        import shutil

        shutil.rmtree(top, ignore_errors=True)


def test_relay_refuses_an_agent_folder_others_may_write(tmp_path):
    """The relay meets the agent's socket in a folder that group or others may write (where
    anyone could plant a socket of their own): refused, naming the mode, before connecting."""
    folder = tmp_path / "agent"
    folder.mkdir()
    folder.chmod(0o733)
    evil = Listener(folder / "agent.sock")
    try:
        with pytest.raises(ss.SiteSocketError, match=r"mode 0733, writable by group or others"):
            ss._connect(str(folder / "agent.sock"))
        assert evil.connections == 0
    finally:
        evil.close()
    with pytest.raises(ss.SiteSocketError, match=r"mode 0733, writable by group or others"):
        ss._listen(str(folder / "agent.sock"), shared=True)


def test_relay_refuses_a_listener_that_is_not_the_folders_owner(tmp_path):
    """An agent folder (and socket file) of uid A, but the process listening is another uid's:
    the relay refuses it by the listener's kernel-reported uid."""
    if os.geteuid() != 0:
        pytest.skip("needs root to chown the folder and socket")
    folder = tmp_path / "agent"
    folder.mkdir(mode=0o711)
    folder.chmod(0o711)
    evil = Listener(folder / "agent.sock")
    try:
        os.chown(folder, OTHER_UID, OTHER_UID)
        os.chown(folder / "agent.sock", OTHER_UID, OTHER_UID)
        with pytest.raises(ss.SiteSocketError,
                           match=rf"runs as uid 0 .*expected uid {OTHER_UID} \(the owner"):
            ss._connect(str(folder / "agent.sock"))
    finally:
        evil.close()


# -- frames ---------------------------------------------------------------------------------------
def _peak_while(action) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_frame_announcing_1_gib_allocates_nothing_of_it():
    """A frame header announcing 1 GiB (the Message limit) followed by 1 MiB and a hang-up: the
    reader's memory grows with the 1 MiB that arrived, never to the announced size. Over the
    limit, the frame is refused before any allocation."""
    left, right = socket.socketpair()

    def feed():
        with left:
            left.sendall(struct.pack(">4sQ", ss.MAGIC, ss.MAX_FRAME_BYTES))
            left.sendall(b"x" * (1 << 20))

    feeder = threading.Thread(target=feed)
    with right:
        def read():
            feeder.start()
            with pytest.raises(ConnectionResetError, match="after 1,048,576 of 1,073,741,824"):
                ss.read_frame(right)
        peak = _peak_while(read)
    feeder.join()
    assert peak < 16 << 20, f"peak {peak:,} bytes while reading a 1 GiB announcement"

    left, right = socket.socketpair()
    with left, right:
        left.sendall(struct.pack(">4sQ", ss.MAGIC, (1 << 30) + 1))

        def refuse():
            with pytest.raises(ss.ProtocolError, match="over the site socket's limit"):
                ss.read_frame(right)
        assert _peak_while(refuse) < 1 << 20


def test_agent_refuses_a_1_gib_hello_without_allocating(private_dir):
    """To the agent, a first frame (the JSON hello) announcing 1 GiB: refused at once
    (MAX_HEADER_BYTES = 1 MiB), the agent's memory does not move, and it keeps serving."""
    path = private_dir / "w.sock"
    with running_agent(path):
        def attack():
            with _raw(path) as sock:
                sock.sendall(struct.pack(">4sQ", ss.MAGIC, 1 << 30))
                answer = ss.read_json(sock)
            assert not answer["ok"] and "MAX_HEADER_BYTES = 1,048,576" in answer["error"]
        assert _peak_while(attack) < 4 << 20
        with _raw(path) as sock:  # still serving
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
            assert "not a site-agent frame" in ss.read_json(sock)["error"]


# -- connections --------------------------------------------------------------------------------
def test_connections_beyond_the_cap_are_refused_then_served_again(private_dir):
    path = private_dir / "w.sock"
    with running_agent(path, max_connections=2, timeout=30):
        idle = [_raw(path), _raw(path)]  # hold both slots, send nothing
        time.sleep(0.5)
        try:
            with _raw(path) as third:
                answer = ss.read_json(third)
            assert not answer["ok"]
            assert "busy: 2 connections open already (--max-connections)" in answer["error"]
        finally:
            for sock in idle:
                sock.close()
        deadline = time.monotonic() + 10
        while True:  # the slots come back once the idle ones hang up
            with _raw(path) as sock:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused, closed
                    sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
                error = ss.read_json(sock)["error"]
            if "not a site-agent frame" in error:
                break
            assert time.monotonic() < deadline, error
            time.sleep(0.1)


def test_a_busy_agent_is_named_as_busy_to_the_supernode(private_dir):
    """The SuperNode's side of the exchange: an agent with no free slot writes its refusal and
    closes without reading the hello, so the hello may meet a closed pipe; the error must still
    say the agent is busy (not that it died mid-message), and nothing of the message is sent."""
    path = private_dir / "w.sock"
    with running_agent(path, max_connections=1, timeout=30):
        idle = _raw(path)  # holds the one slot
        try:
            time.sleep(0.5)
            for _ in range(5):  # the closed pipe is a race (the close must beat the hello)
                with pytest.raises(ss.SiteSocketError, match="busy: 1 connections open"):
                    sa.relay(str(path), None)
        finally:
            idle.close()


@pytest.mark.parametrize("how", ["stall", "trickle"])
def test_a_client_stalling_mid_frame_is_dropped(private_dir, caplog, how):
    """Slow-loris: a client sends a frame header and part of its hello, then stalls (or
    trickles one byte every 0.2 s, which a per-read timeout would never catch): the agent
    drops it once its request deadline passes (not before it; the log names that deadline),
    and its slot is free again. No upper bound on when: under load the drop may come late,
    but an agent without a request deadline would never drop a trickling client (30 s)."""
    path = private_dir / "w.sock"
    with caplog.at_level(logging.WARNING, "fedcompress"), \
            running_agent(path, max_connections=1, timeout=1.0):
        # before the connection: the agent's deadline counts from its accept, which a loaded
        # machine may delay from this thread's next step by more than the margin below
        start = time.monotonic()
        with _raw(path) as sock:
            sock.sendall(struct.pack(">4sQ", ss.MAGIC, 1000) + b"{")
            closed = False
            while time.monotonic() - start < 30:
                if how == "trickle":
                    with contextlib.suppress(OSError):
                        sock.sendall(b" ")
                sock.settimeout(0.2)
                try:
                    if sock.recv(1) == b"":
                        closed = True
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed = True
                    break
            elapsed = time.monotonic() - start
        assert closed and elapsed > 0.95, elapsed  # not before the deadline (timer slack: 50 ms)
        # the one slot is free again (the agent frees it just after closing the socket: under
        # load a connection may still find it busy for a moment, so retry for up to 30 s; a busy
        # agent writes its refusal and closes at once, so the request may meet a closed pipe:
        # the refusal is still there to read)
        deadline = time.monotonic() + 30
        while True:
            with _raw(path) as sock:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
                error = ss.read_json(sock)["error"]
            if "busy" not in error or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert "not a site-agent frame" in error, error
    assert "did not deliver its request within 1 s" in caplog.text


def test_agent_options_are_checked(private_dir):
    config = _agent_config(private_dir / "w.sock")
    with pytest.raises(ss.SiteSocketError, match="max_connections=0"):
        sa.serve(config, threading.Event(), warm=False, max_connections=0)
    with pytest.raises(ss.SiteSocketError, match="timeout=0"):
        sa.serve(config, threading.Event(), warm=False, timeout=0)


# -- key files ------------------------------------------------------------------------------------
def _make_certs():
    spec = importlib.util.spec_from_file_location("make_certs", REPO / "docker" / "make_certs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_private_keys_are_never_readable_by_others(tmp_path, monkeypatch):
    """Every private key make_certs writes (CA, SuperLink TLS, each SuperNode) is 0600 when
    its content is written and when it takes its final name, even under umask 0; a planted
    0644 key is replaced by a new 0600 file; a symlink planted at a key's path is replaced,
    its target untouched."""
    certs = _make_certs()
    out = tmp_path / "certs"
    out.mkdir(mode=0o700)
    (out / "server.key").write_text("planted")
    (out / "server.key").chmod(0o644)
    victim = tmp_path / "victim"
    victim.write_text("the attacker's file")
    (out / "keys").mkdir(mode=0o700)
    (out / "keys" / "supernode-1").symlink_to(victim)
    modes: dict[str, int] = {}
    real_replace = os.replace

    def spy(src, dst, *args, **kwargs):
        modes[Path(dst).name] = stat.S_IMODE(os.lstat(src).st_mode)
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(certs.os, "replace", spy)
    old = os.umask(0)
    try:
        made = certs.create(out, 2, [])
    finally:
        os.umask(old)
    private = [out / "ca.key", out / "server.key"] + [p for p, _ in made["node_keys"]]
    for path in private:
        assert modes[path.name] == 0o600, (path, oct(modes[path.name]))
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600 and path.is_file()
        assert not path.is_symlink()
    assert (out / "server.key").read_bytes().startswith(b"-----BEGIN PRIVATE KEY")
    assert victim.read_text() == "the attacker's file"
    for public in [out / "ca.crt", out / "server.pem"] + [q for _, q in made["node_keys"]]:
        assert stat.S_IMODE(public.stat().st_mode) == 0o644
    assert stat.S_IMODE((out / "keys").stat().st_mode) == 0o700
    assert not [p for p in out.rglob(".*.tmp")]


def test_an_exposed_existing_ca_key_is_not_reused(tmp_path):
    """make_certs reuses an existing CA: one whose key is readable by group or others (or a
    symlink) is refused, naming the file and its mode, instead of signing with it."""
    certs = _make_certs()
    out = tmp_path / "certs"
    certs.create(out, 1, [])
    (out / "ca.key").chmod(0o644)
    with pytest.raises(SystemExit, match=r"ca\.key: the existing CA key is mode 0644"):
        certs.create(out, 1, [], first=1)
    (out / "ca.key").chmod(0o600)
    certs.create(out, 1, [], first=1)  # a private one is reused
    assert (out / "keys" / "supernode-1").is_file()


def test_key_writer_is_atomic_and_exclusive(tmp_path, monkeypatch):
    """A failing write leaves neither a partial key nor a temporary file; the temporary file
    is opened O_EXCL|O_NOFOLLOW with mode 0600 from its creation (no chmod after)."""
    certs = _make_certs()
    calls = []
    real_open = os.open

    def spy(path, flags, mode=0o777, *args, **kwargs):
        calls.append((str(path), flags, mode))
        return real_open(path, flags, mode, *args, **kwargs)

    monkeypatch.setattr(certs.os, "open", spy)
    certs._write(tmp_path / "k.key", b"secret", private=True)
    path, flags, mode = calls[-1]
    assert mode == 0o600 and flags & os.O_EXCL and flags & os.O_CREAT and flags & os.O_NOFOLLOW
    assert Path(path).parent == tmp_path and Path(path).name != "k.key"

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(certs.os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        certs._write(tmp_path / "other.key", b"secret", private=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.key"]


# -- fixed point ----------------------------------------------------------------------------------
def test_fixed_point_at_the_edge_never_wraps():
    """Values at the bound encode, and ``n`` sites all at the bound (positive or negative) sum
    to a lane that does not wrap; just over it is refused naming the value, the frac bits and
    the number of sites; so is an integer lane (token count) whose ``n``-fold sum would wrap."""
    from fedcompress.methods.fedprllm.stats import (
        decode_fixed,
        encode_fixed,
        fixed_point_layout,
        fixed_point_limit,
        fixed_point_range,
    )

    for f, n in ((25, 1), (25, 3), (25, 16), (0, 7), (52, 2)):
        edge = fixed_point_range(f, n)
        arrays = {"s.0.a.sq": np.array([edge, -edge, 0.0]),
                  "s.0.tokens": np.array([fixed_point_limit(n)], np.int64)}
        lanes = encode_fixed(arrays, f, n).view(np.int64)
        total = np.zeros(lanes.size, np.uint64)
        for _ in range(n):
            total += lanes.view(np.uint64)  # SecAgg+'s sum, mod 2^64
        summed = decode_fixed(total.view(np.int64), fixed_point_layout(arrays), f,
                              {k: v.dtype for k, v in arrays.items()})
        exact = [int(x) * n for x in lanes]
        assert all(-2**63 <= e <= 2**63 - 1 for e in exact)  # no wrap possible
        assert summed["s.0.tokens"].tolist() == [fixed_point_limit(n) * n]
        assert summed["s.0.a.sq"][0] > 0 > summed["s.0.a.sq"][1]  # signs kept at the edge
        assert abs(summed["s.0.a.sq"][0] - n * edge) <= n * 2.0 ** -(f + 1) + 1e-9 * n * edge

        over = np.nextafter(edge + 2.0 ** -f, np.inf)
        for value in (over, -over):
            with pytest.raises(ValueError, match=rf"exceeds the fixed-point range of {f} "
                                                 rf"fractional bits for {n} sites"):
                encode_fixed({"s.0.a.sq": np.array([value])}, f, n)
        with pytest.raises(ValueError, match=rf"s\.0\.tokens: a value exceeds .* for {n} "
                                             "sites") as refused:
            encode_fixed({"s.0.tokens": np.array([fixed_point_limit(n) + 1], np.uint64)}, f, n)
        assert str(fixed_point_limit(n) + 1) not in str(refused.value)  # private: log only
    for value, dtype in ((2**63, np.uint64), (-2**63, np.int64)):  # uint64 lane, int64 min
        with pytest.raises(ValueError, match=r"t: a value exceeds") as refused:
            encode_fixed({"t": np.array([value], dtype)}, 25, 1)
        assert str(abs(value)) not in str(refused.value)
    with pytest.raises(ValueError, match=r"n_sites=0: expected an integer >= 1"):
        encode_fixed({"t": np.array([1], np.int64)}, 25, 0)
    with pytest.raises(ValueError, match=r"frac_bits=53"):
        encode_fixed({"t": np.array([1.0])}, 53, 2)


# -- compose --------------------------------------------------------------------------------------
COMPOSE_FILES = sorted((REPO / "docker").glob("compose*.yml"))
PUBLIC = re.compile(r"(^|/)(ca\.crt|[^/]*\.pub)$")  # public material: the CA cert, public keys


def _load(path: Path) -> dict:
    """A compose file with its base file's services merged in (``compose.cuda.yml`` overrides
    ``compose.yml``)."""
    data = yaml.safe_load(path.read_text())
    if path.name != "compose.yml":
        base = yaml.safe_load((REPO / "docker" / "compose.yml").read_text())
        for name, service in (data.get("services") or {}).items():
            base["services"].setdefault(name, {}).update(service)
        base["volumes"] = {**(base.get("volumes") or {}), **(data.get("volumes") or {})}
        data = base
    return data


def _mounts(service: dict) -> list[tuple[str, str, bool]]:
    """``(source, target, read_only)`` of each volume or bind mount (short or long syntax)."""
    out = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            out.append((str(volume["source"]), volume["target"], bool(volume.get("read_only"))))
            continue
        parts = volume.split(":")
        # ${VAR:-default} sources contain ':'; the target is the first part starting with '/'
        at = next(i for i, p in enumerate(parts) if i > 0 and p.startswith("/"))
        source, target, opts = ":".join(parts[:at]), parts[at], parts[at + 1:]
        out.append((source, target, "ro" in opts))
    return out


def _owner(name: str, service: dict) -> str:
    labels = service.get("labels") or {}
    if isinstance(labels, list):
        labels = dict(item.split("=", 1) for item in labels)
    owner = labels.get("fedcompress.site")
    if owner is None:  # unlabelled: by its name (supernode-I, agent-I, superlink, cli)
        site = re.fullmatch(r"(?:supernode|agent|clientapp|site)-(\d+)(?:-init)?", name)
        owner = f"site-{site.group(1)}" if site else (
            "superlink" if name.startswith("superlink") else "operator")
    return owner


def _role(service: dict) -> str:
    return str((service.get("labels") or {}).get("fedcompress.role", ""))


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_shares_nothing_private_between_sites(path):
    """The reviewer's attack: from site B's (or the SuperLink's) container, read site A's
    tokenized corpus in a cache volume both mount. Now no named volume or bind mount is
    mounted by services of two different owners (sites, the SuperLink, the operator's CLI),
    except read-only public material (the CA certificate, public keys). Users: a site's agent
    and SuperNode share the site's uid; its ClientApp container (the server's code) has a uid
    of its own; no two owners share one, and none is root or the image's 49999."""
    compose = _load(path)
    services = compose["services"]
    users: dict[str, set[str]] = {}
    owners_of: dict[str, set[str]] = {}
    for name, service in services.items():
        owner = _owner(name, service)
        for source, _target, read_only in _mounts(service):
            if PUBLIC.search(source) and read_only:
                continue
            owners_of.setdefault(source, set()).add(owner)
        if owner.startswith("site-") or owner == "superlink":
            if _role(service) == "init":  # a one-shot chown of this owner's own volumes, root
                assert service.get("restart") == "no", name
                assert service.get("network_mode") == "none", name
                for source, _, _ in _mounts(service):
                    assert source in compose["volumes"], (name, source)  # named volumes only
                continue
            group = f"{owner}:server-code" if _role(service) == "clientapp" else owner
            users.setdefault(group, set()).add(str(service.get("user", "the image's user")))
    shared = {source: owners for source, owners in owners_of.items() if len(owners) > 1}
    assert not shared, f"mounted by services of different owners: {shared}"
    assert all(len(u) == 1 for u in users.values()), users
    flat = [next(iter(u)) for u in users.values()]
    assert len(set(flat)) == len(flat), users
    for user in flat:
        uid = user.split(":")[0]
        assert uid.isdigit() and int(uid) not in (0, 49999), f"{user}: {users}"
    sites = sorted(o for o in users if o.startswith("site-") and ":" not in o)
    assert len(sites) >= 3 and "superlink" in users


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_private_keys_and_site_volumes_stay_home(path):
    """A site's node-auth key (``certs/keys/supernode-I``) is mounted only in its SuperNode,
    its SecAgg+ key (``certs/keys/agent-I``) and its agent config only in its agent; the CA key
    nowhere; the SuperLink's TLS key only in the SuperLink; every site has its own cache, state
    and FLWR_HOME volumes (and the SuperLink its own)."""
    compose = _load(path)
    services = compose["services"]
    for name, service in services.items():
        owner = _owner(name, service)
        for source, _, _ in _mounts(service):
            assert not source.endswith("ca.key"), name
            if source.endswith("server.key"):
                assert owner == "superlink", name
            for kind, role in (("supernode", "supernode"), ("agent", "agent")):
                key = re.search(rf"keys/{kind}-(\d+)$", source)
                if key:
                    assert owner == f"site-{key.group(1)}" and _role(service) == role, (
                        name, source)
            if source.startswith("./sites/"):
                assert _role(service) == "agent" and source == f"./sites/{owner}.toml", name
    for i in range(3):
        agent, node = services[f"agent-{i}"], services[f"supernode-{i}"]
        agent_targets = {t: s for s, t, _ in _mounts(agent)}
        node_targets = {t: s for s, t, _ in _mounts(node)}
        for target, volume in (("/home/app/.cache/fedcompress", "cache"),
                               ("/home/app/state", "state")):
            assert agent_targets.get(target) == f"site-{i}-{volume}", (i, target, agent_targets)
        assert node_targets.get("/home/app/.flwr") == f"site-{i}-home", node_targets
        assert agent["user"] == node["user"]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_the_servers_code_gets_nothing_of_the_site(path):
    """Issue 62's attack: the server ships the ClientApp a SuperNode runs, and in the old compose
    file it ran in the SuperNode's container beside the site's data, its private key and its
    ledger. Now each site's ClientApp runs in ``clientapp-I``, as a uid of its own, with only
    the agent's socket volume (no data, key, cache, state or Flower home; its home a tmpfs),
    on the site's internal network alone; the SuperNode holds only its node-auth key and its
    Flower home, and names only the agent's socket in its node config; the agent has no
    network and is the only service that mounts the site's data, state, cache and keys."""
    compose = _load(path)
    services = compose["services"]
    networks = compose.get("networks") or {}
    for i in range(3):
        app, node = services[f"clientapp-{i}"], services[f"supernode-{i}"]
        agent = services[f"agent-{i}"]
        assert _role(app) == "clientapp" and _owner(f"clientapp-{i}", app) == f"site-{i}"
        assert [(s, t) for s, t, _ in _mounts(app)] == [(f"site-{i}-agent", "/agent")]
        assert [t.split(":")[0] for t in app.get("tmpfs") or []] == ["/home/app"]
        assert app["user"] != agent["user"] and app["user"].split(":")[0] != "0"
        assert app.get("networks") == [f"site-{i}"], app.get("networks")
        assert networks[f"site-{i}"].get("internal") is True
        assert app["command"][0] == "flower-superexec"
        assert f"--runtime-api-address=supernode-{i}:9094" in app["command"]
        # the SuperNode: its node-auth key and Flower home, ClientApps in another container
        node_mounts = {s for s, _, _ in _mounts(node)}
        assert node_mounts == {"./certs/ca.crt", f"./certs/keys/supernode-{i}",
                               f"site-{i}-home"}, node_mounts
        assert "--isolation=process" in node["command"]
        configs = [a for a in node["command"] if a.startswith("--node-config=")]
        assert configs == ['--node-config=site-agent="/agent/agent.sock"'], configs
        assert set(node["networks"]) == {"default", f"site-{i}"}
        # the agent: no network; the site's data, state, cache, its key and its config
        assert agent.get("network_mode") == "none"
        agent_mounts = {t: s for s, t, _ in _mounts(agent)}
        assert agent_mounts["/agent"] == f"site-{i}-agent"
        assert agent_mounts["/keys/agent"] == f"./certs/keys/agent-{i}"
        assert agent_mounts["/site/agent.toml"] == f"./sites/site-{i}.toml"
        assert agent["command"][:3] == ["fedcompress", "site-agent", "--config"]
        # whoever else mounts the site's volumes: its init service alone
        for name, service in services.items():
            if name in (f"agent-{i}", f"site-{i}-init"):
                continue
            for source, _, _ in _mounts(service):
                assert source not in (f"site-{i}-cache", f"site-{i}-state") and \
                    f"data/site-{i}" not in source and f"SITE{i}_" not in source, (name, source)
                if source == f"site-{i}-agent":
                    assert name == f"clientapp-{i}", name


def test_site_agent_configs_match_the_compose_file():
    """Each ``docker/sites/site-I.toml`` is a valid agent config for the compose file's agent-I:
    its socket in the shared volume, its relay uid the ClientApp container's, its keys and
    folders where the agent's container mounts them."""
    import tomllib

    from clients.site_agent import AGENT_KEYS

    services = _load(REPO / "docker" / "compose.yml")["services"]
    for i in range(3):
        config = tomllib.loads((REPO / "docker" / "sites" / f"site-{i}.toml").read_text())
        assert set(AGENT_KEYS) <= set(config)
        agent, app = services[f"agent-{i}"], services[f"clientapp-{i}"]
        targets = {t for _, t, _ in _mounts(agent)}
        assert config["socket"].rsplit("/", 1)[0] in targets
        assert config["relay-uid"] == int(app["user"].split(":")[0])
        assert config["partition-id"] == i and config["num-partitions"] == 3
        assert {config["data-path"], config["state-dir"], config["secagg-key"],
                config["secagg-peers"]} <= targets | {"/peers"}
        assert any(t.startswith("/peers/agent-") for t in targets)
