"""The warm site worker (clients/site_worker.py, ``fedcompress site-worker``): frames and
Flower's serde, the refusals (missing socket, not a socket, other fedcompress version or code,
garbage or oversized frames), a thin ClientApp process that imports neither torch nor
transformers and gets the masks of the fat path, the Context's state kept across messages
(SecAgg+) and a worker dying mid-message. A SuperNode of the loopback deployment using a worker
is tested in tests/test_deploy.py (its ``missing`` deployment's site 0). Every worker is started
and stopped by PID (``conftest.Worker``); its socket is removed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import Worker

from clients import site_worker as sw

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """One worker for the module; at the end, SIGTERM must stop it cleanly (exit 0, its socket
    removed)."""
    root = tmp_path_factory.mktemp("worker")
    w = Worker(root / "site.sock", root / "cache", root / "worker.log")
    try:
        yield w
    finally:
        code = w.stop()
        if w.path.exists():
            w.path.unlink()
            pytest.fail(f"the worker left its socket behind:\n{w.log()}")
        assert code == 0, w.log()
        assert "site worker stopped" in w.log()


def _masks_config(model: str, **extra):
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig

    return FedPrLLMConfig(model=model, clients=2, samples_per_client=2, seqlen=16, batch_size=2,
                          **extra)


def _message(config, kind: str):
    from flwr.app import Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from strategies.common import settings_record

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    return Message(RecordDict({"config": settings_record(config)}), 100, kind)


def _context(partition: int = 0, **node_config):
    """A site's Context: a simulated site (its ledger in a temporary folder; these tests are
    about the worker, the policy has its own in tests/adversarial)."""
    from flwr.app import Context, RecordDict

    return Context(run_id=1, node_id=100, node_config={"partition-id": partition,
                                                       "num-partitions": 2,
                                                       "site-mode": "simulation", **node_config},
                   state=RecordDict(), run_config={}, series_id=0)


def _masks_sha(reply) -> str:
    return hashlib.sha256(b"".join(a.numpy().tobytes()
                                   for _, a in sorted(reply.content["masks"].items()))).hexdigest()


# -- frames and serde -----------------------------------------------------------------------------
def test_frames_and_flower_serde_round_trip():
    import numpy as np
    from flwr.app import (
        Array,
        ArrayRecord,
        ConfigRecord,
        Context,
        Message,
        MetricRecord,
        RecordDict,
    )

    message = _message(_masks_config("tiny"), "train.masks")
    message.content["arrays"] = ArrayRecord({"w": Array(np.arange(12, dtype=np.uint8)
                                                        .reshape(3, 4))})
    state = RecordDict({"keys": ConfigRecord({"secret": b"\x00\x01", "nodes": [1, 2]}),
                        "m": MetricRecord({"x": 1.5})})
    context = Context(run_id=7, node_id=9, node_config={"partition-id": 1, "site-worker": "/s"},
                      state=state, run_config={"a": "b"}, series_id=0)
    left, right = socket.socketpair()
    with left, right:
        for payload in (sw.message_to_bytes(message), sw.context_to_bytes(context), b""):
            sw.write_frame(left, payload)
        got_message = sw.message_from_bytes(sw.read_frame(right))
        got_context = sw.context_from_bytes(sw.read_frame(right))
        assert sw.read_frame(right) == b""
    assert isinstance(got_message, Message)
    assert got_message.metadata == message.metadata
    assert dict(got_message.content["config"]) == dict(message.content["config"])
    assert np.array_equal(got_message.content["arrays"]["w"].numpy(),
                          message.content["arrays"]["w"].numpy())
    assert (got_context.run_id, got_context.node_id, got_context.node_config,
            got_context.run_config) == (7, 9, context.node_config, {"a": "b"})
    assert dict(got_context.state["keys"]) == {"secret": b"\x00\x01", "nodes": [1, 2]}
    assert dict(got_context.state["m"]) == {"x": 1.5}


def test_garbage_and_oversized_frames_are_refused(monkeypatch):
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"GET / HTTP/1.1\r\n\r\n")
        with pytest.raises(sw.ProtocolError, match="not a site-worker frame"):
            sw.read_frame(right)
    left, right = socket.socketpair()
    with left, right:
        left.sendall(struct.pack(">4sQ", sw.MAGIC, sw.MAX_FRAME_BYTES + 1))
        with pytest.raises(sw.ProtocolError, match=f"MAX_FRAME_BYTES = {sw.MAX_FRAME_BYTES:,}"):
            sw.read_frame(right)
    left, right = socket.socketpair()
    with left, right:
        sw.write_frame(left, b"\xff not json")
        with pytest.raises(sw.ProtocolError, match="garbage where a JSON header"):
            sw.read_json(right)
        with pytest.raises(sw.ProtocolError, match="garbage where a Flower Message"):
            sw.message_from_bytes(b"\xff\xff\xff\xff")
    left, right = socket.socketpair()
    with right:  # the peer goes away mid-frame
        left.sendall(struct.pack(">4sQ", sw.MAGIC, 100) + b"abc")
        left.close()
        with pytest.raises(ConnectionError):
            sw.read_frame(right)
    monkeypatch.setattr(sw, "MAX_FRAME_BYTES", 8)  # a sender never sends more than the limit
    left, right = socket.socketpair()
    with left, right:
        with pytest.raises(sw.ProtocolError, match="exceeds the site worker's limit"):
            sw.write_frame(left, b"123456789")


def test_socket_file_rules(tmp_path):
    """A stale socket file (nobody listening) is replaced; a live socket or another file is
    never replaced; the socket is created with mode 0600."""
    path = str(tmp_path / "s.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    listener = sw._listen(path)
    try:
        mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        with pytest.raises(sw.SiteWorkerError, match="another site worker listens"):
            sw._listen(path)
    finally:
        listener.close()
        os.unlink(path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(sw.SiteWorkerError, match="is not a Unix socket"):
        sw._listen(str(tmp_path / "file"))


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
    listener = sw._listen(str(path))
    try:
        assert seen == [False]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["s.sock"]
    finally:
        listener.close()
        path.unlink()


def test_a_file_made_while_the_worker_starts_is_never_replaced(tmp_path, monkeypatch):
    """A file appearing at the socket's path between the stale-socket check and the worker's
    publishing its socket is kept, and the worker refuses to start (no staging file left)."""
    path = tmp_path / "s.sock"
    listen = socket.socket.listen

    def race(sock, *args):
        path.write_text("made meanwhile")
        return listen(sock, *args)

    monkeypatch.setattr(socket.socket, "listen", race)
    with pytest.raises(sw.SiteWorkerError, match="was created while this worker started"):
        sw._listen(str(path))
    assert path.read_text() == "made meanwhile"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.sock"]


# -- refusals -------------------------------------------------------------------------------------
def test_missing_socket_or_not_a_socket_is_a_clear_error(tmp_path):
    message, context = _message(_masks_config("tiny"), "query.warmup"), _context()
    missing = tmp_path / "nope.sock"
    with pytest.raises(sw.SiteWorkerError, match=r"does not exist: start `fedcompress "
                                                 r"site-worker --socket"):
        sw.exchange(str(missing), message, context)
    (tmp_path / "file").write_text("x")
    with pytest.raises(sw.SiteWorkerError, match="is not a Unix socket"):
        sw.exchange(str(tmp_path / "file"), message, context)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "stale.sock"))
    stale.close()
    with pytest.raises(sw.SiteWorkerError, match="nothing answers at site-worker socket"):
        sw.exchange(str(tmp_path / "stale.sock"), message, context)


def _code_copy(root: Path) -> Path:
    """This checkout's code as a FAB holds it (the packages' modules and pyproject.toml)."""
    for package in sw.CODE_PACKAGES:
        shutil.copytree(REPO / package, root / package,
                        ignore=shutil.ignore_patterns("__pycache__", "bench"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def test_other_version_or_code_is_refused_naming_both(worker, tmp_path):
    message, context = _message(_masks_config("tiny"), "query.warmup"), _context()
    fab = _code_copy(tmp_path / "fab")
    version = sw.code_version(REPO)
    pyproject = fab / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(f'version = "{version}"',
                                                       'version = "9.9.9"', 1))
    with pytest.raises(sw.SiteWorkerError,
                       match=rf"runs fedcompress {version}, the FAB is fedcompress 9\.9\.9"):
        sw.exchange(str(worker.path), message, context, root=fab)
    shutil.copy(REPO / "pyproject.toml", pyproject)
    fab_files, ours = sw.code_files(fab), sw.code_files(REPO)
    assert all(ours[p] == h for p, h in fab_files.items())  # the FAB's modules are ours
    fab_hash = sw.code_hash(fab_files)  # the worker's hash of the FAB's modules
    edited = fab / "clients" / "fedprllm.py"
    edited.write_text(edited.read_text() + "\n# edited\n")
    with pytest.raises(sw.SiteWorkerError) as refused:
        sw.exchange(str(worker.path), message, context, root=fab)
    text = str(refused.value)
    assert f"hash {fab_hash[:16]}" in text  # the worker's (this checkout's)
    assert f"hash {sw.code_hash(sw.code_files(fab))[:16]}" in text  # the FAB's
    assert "clients/fedprllm.py" in text and "restart the worker" in text
    assert "refused a message" in worker.log()


def test_garbage_to_the_worker_is_refused_and_it_keeps_serving(worker, tiny_dir):
    for garbage in (b"GET / HTTP/1.1\r\n\r\n",
                    struct.pack(">4sQ", sw.MAGIC, sw.MAX_FRAME_BYTES + 1)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(worker.path))
            sock.sendall(garbage)
            answer = sw.read_json(sock)
        assert not answer["ok"]
        assert "not a site-worker frame" in answer["error"] or \
            f"MAX_HEADER_BYTES = {sw.MAX_HEADER_BYTES:,}" in answer["error"]
    reply, _, status = sw.exchange(str(worker.path), _message(_masks_config(tiny_dir),
                                                              "query.warmup"), _context())
    assert status["ok"] and not reply.has_error()


# -- the thin process ---------------------------------------------------------------------------
# A flwr-clientapp process's imports, then the ClientApp module and two messages through `app`
# with a worker named in the node config; prints what got imported and the replies.
THIN = r"""
import hashlib, json, sys
import flwr.cli.install, flwr.clientapp.utils, flwr.supernode.runtime.run_clientapp
from flwr.app import Context, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from clients.app import app
from clients.site_worker import message_from_bytes

TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
socket_path, *messages = sys.argv[1:]
context = Context(run_id=1, node_id=100, node_config={"partition-id": 0, "num-partitions": 2,
                  "site-worker": socket_path, "site-mode": "simulation"}, state=RecordDict(),
                  run_config={}, series_id=0)
replies = []
for path in messages:
    reply = app(message_from_bytes(open(path, "rb").read()), context)
    replies.append(dict(reply.content["metrics"]))
    if "masks" in reply.content:
        replies[-1]["masks_sha256"] = hashlib.sha256(b"".join(
            a.numpy().tobytes() for _, a in sorted(reply.content["masks"].items()))).hexdigest()
print(json.dumps({"replies": replies, "modules": sorted(sys.modules)}))
"""


def test_thin_process_imports_no_torch_and_gets_the_fat_paths_masks(worker, tiny_dir, tmp_path,
                                                                    fedcompress_cache):
    from clients.app import app

    config = _masks_config(tiny_dir)
    files = []
    for kind in ("query.warmup", "train.masks"):
        files.append(tmp_path / f"{kind}.bin")
        files[-1].write_bytes(sw.message_to_bytes(_message(config, kind)))
    out = subprocess.run([sys.executable, "-c", THIN, str(worker.path), *map(str, files)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    thin = json.loads(out.stdout.strip().splitlines()[-1])
    heavy = {m for m in thin["modules"] if m.split(".")[0] in ("torch", "transformers")}
    assert not heavy, sorted(heavy)[:10]

    fat = app(_message(config, "train.masks"), _context())  # the fat path, in this process
    warmup, masks = thin["replies"]
    assert masks["masks_sha256"] == _masks_sha(fat)
    assert masks["pid"] == worker.proc.pid  # the worker computed them
    for reply in (warmup, masks):  # the split: this process's imports + the worker's
        assert reply["startup_worker_seconds"] >= 0 and reply["compute_seconds"] >= 0
        assert reply["client_startup_seconds"] == pytest.approx(
            reply["startup_import_seconds"] + reply["startup_load_seconds"])
    assert masks["startup_load_seconds"] == 0.0  # model and windows warm in the worker


def test_context_state_round_trips_through_the_worker(worker, tiny_dir, tmp_path,
                                                      fedcompress_cache):
    """A SecAgg+ vote keeps each site's keys and shares in its Context's state between its
    messages: through the worker the pruned model equals the fat path's. The sites are
    deployed ones (site-mode deployment): authenticated by their P-384 keys (node config
    secagg-key, secagg-peers), with the consistency round."""
    from conftest import InProcessFederation, write_site_keys

    from fedcompress.models import load_model
    from server.fedprllm import run

    keys, peers = write_site_keys(tmp_path, 3)

    class Federation(InProcessFederation):
        app = "clients.app"

        def __init__(self, n: int, path: str | None):
            super().__init__(n)
            for i, context in enumerate(self.contexts.values()):
                context.node_config.update({"site-mode": "deployment", "models": tiny_dir,
                                            "secagg-key": str(keys[i]),
                                            "secagg-peers": str(peers)})
                if path:
                    context.node_config["site-worker"] = path

    models = {}
    for name, path in (("worker", str(worker.path)), ("fat", None)):
        out = tmp_path / name
        run(Federation(3, path), dict(model=tiny_dir, clients=3, samples_per_client=2,
                                      seqlen=16, batch_size=2, eval_seqlen=16, eval_windows=2,
                                      out=str(out), device="cpu", baselines="", secagg=True))
        report = json.loads((out / "report.json").read_text())
        assert report["status"] == "ok" and report["rejected"] == [], report
        assert report["results"][0]["valid_clients"] == 3
        assert "confirmed the survivor set" in (out / "report.md").read_text()
        models[name] = load_model(str(out / "model"), device="cpu").model.state_dict()
    assert all(torch.equal(models["worker"][k], models["fat"][k]) for k in models["fat"])
    assert report["secagg"]["sum"]["authenticated"], report["secagg"]
    assert "train.secagg_masks" in worker.log()  # the secure vote went through the worker
    assert "query.secagg_confirm" in worker.log()


def test_worker_dying_mid_message_is_a_clear_error(tiny_dir, tmp_path):
    """A worker that dies while it runs a message (here the ``kill`` fault: os._exit, as the
    OOM killer would) gives the ClientApp a clear error; its stale socket is cleaned up."""
    w = Worker(tmp_path / "dying.sock", tmp_path / "cache", tmp_path / "dying.log")
    try:
        config = _masks_config(tiny_dir, fault="kill", faulty=1)
        with pytest.raises(sw.SiteWorkerError, match="closed the connection mid-message"):
            sw.forward(str(w.path), _message(config, "train.masks"), _context(partition=1))
        assert w.proc.wait(30) == 1
    finally:
        w.stop(signal.SIGKILL)
        if w.path.exists():  # os._exit left it: nobody removes a dead worker's socket
            w.path.unlink()
