"""The site agent's socket (clients/site_socket.py): frames and Flower's serde, garbage and
oversized frames, the socket file's rules (a stale socket replaced, a live one or another file
never; the file appears only once it listens), the relay's clear errors (a missing socket, not a
socket, nobody listening, an agent that closes mid-message). The attacks on the socket (symbolic
links, modes, owners, peers of other uids, 1 GiB frames, slow-loris) are in
tests/adversarial/test_isolation_attacks.py; the agent itself in tests/test_site_agent.py."""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from clients import site_agent as sa
from clients import site_socket as ss


def _message(kind: str = "query.warmup") -> Message:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    return Message(RecordDict({"config": ConfigRecord({"model": "tiny", "seqlen": 16})}), 100,
                   kind)


# -- frames and serde -----------------------------------------------------------------------------
def test_frames_and_flower_serde_round_trip():
    message = _message("train.masks")
    message.content["arrays"] = ArrayRecord({"w": Array(np.arange(12, dtype=np.uint8)
                                                        .reshape(3, 4))})
    left, right = socket.socketpair()
    with left, right:
        for payload in (ss.message_to_bytes(message), b""):
            ss.write_frame(left, payload)
        got = ss.message_from_bytes(ss.read_frame(right))
        assert ss.read_frame(right) == b""
    assert isinstance(got, Message)
    assert got.metadata == message.metadata
    assert dict(got.content["config"]) == dict(message.content["config"])
    assert np.array_equal(got.content["arrays"]["w"].numpy(),
                          message.content["arrays"]["w"].numpy())


def test_garbage_and_oversized_frames_are_refused(monkeypatch):
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"GET / HTTP/1.1\r\n\r\n")
        with pytest.raises(ss.ProtocolError, match="not a site-agent frame"):
            ss.read_frame(right)
    left, right = socket.socketpair()
    with left, right:
        left.sendall(struct.pack(">4sQ", ss.MAGIC, ss.MAX_FRAME_BYTES + 1))
        with pytest.raises(ss.ProtocolError, match=f"MAX_FRAME_BYTES = {ss.MAX_FRAME_BYTES:,}"):
            ss.read_frame(right)
    left, right = socket.socketpair()
    with left, right:
        ss.write_frame(left, b"\xff not json")
        with pytest.raises(ss.ProtocolError, match="garbage where a JSON header"):
            ss.read_json(right)
        with pytest.raises(ss.ProtocolError, match="garbage where a Flower Message"):
            ss.message_from_bytes(b"\xff\xff\xff\xff")
    left, right = socket.socketpair()
    with right:  # the peer goes away mid-frame
        left.sendall(struct.pack(">4sQ", ss.MAGIC, 100) + b"abc")
        left.close()
        with pytest.raises(ConnectionError):
            ss.read_frame(right)
    monkeypatch.setattr(ss, "MAX_FRAME_BYTES", 8)  # a sender never sends more than the limit
    left, right = socket.socketpair()
    with left, right:
        with pytest.raises(ss.ProtocolError, match="exceeds the site socket's limit"):
            ss.write_frame(left, b"123456789")


# -- the socket file ------------------------------------------------------------------------------
def test_socket_file_rules(tmp_path):
    """A stale socket file (nobody listening) is replaced; a live socket or another file is
    never replaced; the socket is created with mode 0600."""
    path = str(tmp_path / "s.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    listener = ss._listen(path)
    try:
        mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        with pytest.raises(ss.SiteSocketError, match="another site agent listens"):
            ss._listen(path)
    finally:
        listener.close()
        os.unlink(path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ss.SiteSocketError, match="is not a Unix socket"):
        ss._listen(str(tmp_path / "file"))


def test_socket_file_appears_only_once_it_listens(tmp_path, monkeypatch):
    """Whoever waits for the socket file to appear (a test, a start-up script) can connect at
    once: when the socket starts listening its final name does not exist yet, and afterwards
    the folder holds that one file (no staging name left)."""
    path = tmp_path / "s.sock"
    seen = []
    listen = socket.socket.listen

    def spy(sock, *args):
        seen.append(path.exists())
        return listen(sock, *args)

    monkeypatch.setattr(socket.socket, "listen", spy)
    listener = ss._listen(str(path))
    try:
        assert seen == [False]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["s.sock"]
    finally:
        listener.close()
        path.unlink()


def test_a_file_made_while_the_agent_starts_is_never_replaced(tmp_path, monkeypatch):
    """A file appearing at the socket's path between the stale-socket check and the agent's
    publishing its socket is kept, and the agent refuses to start (no staging file left)."""
    path = tmp_path / "s.sock"
    listen = socket.socket.listen

    def race(sock, *args):
        path.write_text("made meanwhile")
        return listen(sock, *args)

    monkeypatch.setattr(socket.socket, "listen", race)
    with pytest.raises(ss.SiteSocketError, match="was created while this agent started"):
        ss._listen(str(path))
    assert path.read_text() == "made meanwhile"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.sock"]


# -- the relay's errors ---------------------------------------------------------------------------
def test_missing_socket_or_not_a_socket_is_a_clear_error(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    with pytest.raises(ss.SiteSocketError, match=r"does not exist: start `fedcompress "
                                                 r"site-agent --config"):
        sa.relay(str(folder / "nope.sock"), _message())
    (folder / "file").write_text("x")
    with pytest.raises(ss.SiteSocketError, match="is not a Unix socket"):
        sa.relay(str(folder / "file"), _message())
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(folder / "stale.sock"))
    stale.close()
    with pytest.raises(ss.SiteSocketError, match="nothing answers at site-agent socket"):
        sa.relay(str(folder / "stale.sock"), _message())


def test_an_agent_closing_mid_message_is_a_clear_error(tmp_path):
    """An agent that goes away while it runs a message (killed, out of memory) gives the relay
    an error naming the agent's socket and its log, not a hang or a protocol traceback."""
    path = tmp_path / "run" / "agent.sock"

    def dies(conn: socket.socket, timeout: float) -> None:  # answers the hello, reads, leaves
        ss.read_json(conn)
        ss.write_json(conn, {"ok": True, "operations": sa.OPERATIONS_VERSION})
        ss.read_frame(conn)

    stop = threading.Event()
    thread = threading.Thread(target=ss.serve_socket, args=(str(path), "site agent", dies,
                                                            lambda: 0, stop),
                              kwargs={"warm": False}, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if path.exists():
                break
            threading.Event().wait(0.05)
        with pytest.raises(sa.SiteAgentError, match="closed the connection mid-message"):
            sa.relay(str(path), _message())
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive() and not path.exists()
