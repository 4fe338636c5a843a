"""The Simulation Engine attached to a running Ray cluster (``--ray-address``): a head node and a
second node on this machine, 1 CPU each, both serving virtual clients; the cluster outlives the
run untouched, and the test stops every process the two ``ray start`` commands created, by PID."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port

psutil = pytest.importorskip("psutil")

RAY = Path(sys.executable).with_name("ray")
pytestmark = [pytest.mark.simulation,
              pytest.mark.skipif(not RAY.exists(), reason="no `ray` command beside python")]


def _free_range(size: int = 40) -> tuple[int, int]:
    """``size`` consecutive free ports (a node's worker ports), away from the other ranges."""
    for _ in range(50):
        base = random.randrange(20000, 30000)
        try:
            for port in range(base, base + size):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base, base + size - 1
    raise RuntimeError("no free port range for Ray workers")


#: Ray's worker entry points: a worker runs one of them until it sets its title to ``ray::...``
#: (a worker caught before that is still a worker, which Ray may stop when it is idle).
WORKER_SCRIPTS = ("default_worker.py", "setup_worker.py")


def _is_worker(argv: list[str]) -> bool:
    """A Ray worker (``ray::IDLE``, ``ray::ClientAppActor...``, or one not yet titled), not a
    node process (GCS, raylet, the agents, whose titles may also start with ``ray::``). The
    raylet's own arguments name the worker script inside one long option, never as argv 1-2."""
    title = " ".join(argv)
    if title.startswith("ray::"):
        return "Agent" not in title
    return any(arg.endswith(WORKER_SCRIPTS) for arg in argv[1:3])


class TwoNodeCluster:
    """``ray start --head`` and ``ray start --address`` on this machine, in a private temp dir
    (its ``ray_current_cluster`` stays there: no other run's ``ray.init`` finds this cluster).
    ``--block`` keeps each ``ray start`` the parent of the processes it starts, so none becomes
    an orphan another run's clean-up could take for its own; a watcher records which processes
    belong to which node while the cluster lives."""

    def __init__(self) -> None:
        # Ray's socket paths (under the temp dir) must stay short.
        self.temp = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.starters: dict[str, subprocess.Popen] = {}
        self.seen: dict[str, dict[int, float]] = {}  # node -> {pid: create time}
        self.argv: dict[int, list[str]] = {}  # core pid -> its command line when first seen
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> None:
        common = ["--num-cpus", "1", "--temp-dir", str(self.temp), "--block",
                  "--node-ip-address", "127.0.0.1", "--disable-usage-stats",
                  "--object-store-memory", str(100 * 2**20)]
        for name, role in (("head", ["--head", "--port", str(self.port),
                                     "--include-dashboard=false",
                                     "--ray-client-server-port", str(free_port())]),
                           ("node2", ["--address", self.address])):
            low, high = _free_range()
            args = [str(RAY), "start", *role, *common,
                    "--node-manager-port", str(free_port()),
                    "--object-manager-port", str(free_port()),
                    "--dashboard-agent-listen-port", str(free_port()),
                    "--min-worker-port", str(low), "--max-worker-port", str(high)]
            log = (self.temp / f"{name}.log").open("w")
            self.starters[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True)
            self.seen[name] = {}
            self._wait_started(name)
            if name == "head":
                self._watcher.start()
        deadline = time.monotonic() + 60
        while self.alive_nodes() != 2:
            assert time.monotonic() < deadline, "the second node never joined"
            time.sleep(1)

    def _wait_started(self, name: str, timeout: float = 90) -> None:
        log, starter = self.temp / f"{name}.log", self.starters[name]
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in log.read_text():
            if starter.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`ray start` ({name}) failed:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    def _snapshot(self) -> None:
        for name, starter in self.starters.items():
            try:
                for child in psutil.Process(starter.pid).children(recursive=True):
                    self.seen[name].setdefault(child.pid, child.create_time())
            except psutil.NoSuchProcess:
                continue

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            self._snapshot()

    def node_of(self, pid: int) -> str | None:
        self._snapshot()
        return next((name for name, pids in self.seen.items() if pid in pids), None)

    def core_pids(self) -> dict[int, float]:
        """The node processes that live as long as the cluster (GCS, raylets, agents)."""
        self._snapshot()
        core = {}
        for pids in self.seen.values():
            for pid, created in pids.items():
                try:
                    argv = psutil.Process(pid).cmdline()
                except psutil.NoSuchProcess:
                    continue
                if not _is_worker(argv):
                    core[pid] = created
                    self.argv[pid] = argv
        return core

    def describe(self, pids) -> str:
        """What the given processes were started as (for a failure's message)."""
        return "; ".join(f"{pid}: {' '.join(self.argv.get(pid, ['?']))[:160]}" for pid in pids)

    def alive_nodes(self) -> int:
        """Alive nodes, asked from a separate driver (this process stays free of Ray)."""
        code = ("import ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
                "print(sum(bool(n['Alive']) for n in ray.nodes()))" % self.address)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
        return int(out.stdout.split()[-1]) if out.returncode == 0 and out.stdout.split() else 0

    def _ours(self) -> dict[int, float]:
        """Every process the two ``ray start`` created: their trees as recorded, plus anything
        naming the private temp dir (in case one left its parent)."""
        self._snapshot()
        procs = {p.pid: p.create_time() for p in map(psutil.Process, (
            s.pid for s in self.starters.values())) if p.is_running()}
        for pids in self.seen.values():
            procs.update(pids)
        for proc in psutil.process_iter(["pid", "cmdline", "create_time"]):
            if str(self.temp) in " ".join(proc.info["cmdline"] or []):
                procs[proc.info["pid"]] = proc.info["create_time"]
        return procs

    @staticmethod
    def _alive(procs: dict[int, float]) -> list[int]:
        left = []
        for pid, created in procs.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                continue
        return sorted(left)

    def stop(self) -> tuple[list[int], list[int]]:
        """SIGTERM both ``ray start --block`` (each then stops its node), SIGKILL by PID what
        outlives a grace period. Returns (killed, still alive)."""
        procs = self._ours()
        self._done.set()
        for name in ("node2", "head"):
            if name in self.starters and self.starters[name].poll() is None:
                self.starters[name].terminate()
        for starter in self.starters.values():
            try:
                starter.wait(30)
            except subprocess.TimeoutExpired:
                starter.kill()
                starter.wait(10)
        deadline = time.monotonic() + 15
        while self._alive(procs) and time.monotonic() < deadline:
            time.sleep(0.5)
        killed = self._alive(procs)
        for pid in killed:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                continue
        time.sleep(1)
        return killed, self._alive(procs)


@pytest.fixture
def ray_cluster():
    import shutil

    cluster = TwoNodeCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        killed, left = cluster.stop()
        shutil.rmtree(cluster.temp, ignore_errors=True)
        assert left == [], f"Ray processes left running: {left}"
        assert killed == [], f"needed SIGKILL: {killed}"


def test_simulation_attached_to_a_two_node_cluster(ray_cluster, tiny_dir, tmp_path):
    from conftest import InProcessFederation
    from flwr.app import ArrayRecord, ConfigRecord

    from fedcompress.cli import run_method
    from fedcompress.methods.fedprllm.federated import FedPrLLMConfig
    from fedcompress.models import load_model
    from strategies.fedprllm import FedPrLLM

    core = ray_cluster.core_pids()
    out = tmp_path / "sim"
    shape = dict(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16, batch_size=2)
    report = run_method("fedprllm", dict(
        shape, eval_seqlen=16, eval_windows=4, baselines="none", device="cpu", out=str(out),
        cpus_per_client=1.0, ray_address=ray_cluster.address))
    assert report["status"] == "ok" and report["rejected"] == []

    # Both nodes served virtual clients (one 1-CPU actor fits on each).
    served = {m["pid"]: ray_cluster.node_of(m["pid"]) for m in report["clients"]}
    assert len(report["clients"]) == 4
    assert set(served.values()) == {"head", "node2"}, served

    # The cluster outlives the run untouched: both nodes alive, no node process stopped.
    assert ray_cluster.alive_nodes() == 2
    gone = sorted(set(core) - set(TwoNodeCluster._alive(core)))
    assert not gone, f"node processes stopped: {ray_cluster.describe(gone)}"

    # Same pruned model as the same federation run in-process.
    class Federation(InProcessFederation):
        app = "clients.app"

    strategy = FedPrLLM(FedPrLLMConfig(**shape), load_model(tiny_dir, device="cpu").model)
    grid = Federation(4)
    for rnd in range(1, strategy.num_rounds + 1):
        strategy.aggregate_train(rnd, grid.send_and_receive(
            strategy.configure_train(rnd, ArrayRecord(), ConfigRecord(), grid)))
    model = load_model(tiny_dir, device="cpu").model
    strategy.prune(model)
    saved = load_model(str(out / "model"), device="cpu").model
    for (key, a), (_, b) in zip(model.state_dict().items(), saved.state_dict().items()):
        assert torch.equal(a, b), key
    assert json.loads((out / "report.json").read_text())["status"] == "ok"


def test_unreachable_ray_address_fails_at_once_by_name(tiny_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from fedcompress import cli
    from server.simulation import RayAddressError

    monkeypatch.setattr(cli, "_setup_logging", lambda level: None)

    def run_simulation(*args, **kwargs):  # "at once": before any Ray work
        raise AssertionError("Ray work started for an address that answers nothing")

    monkeypatch.setattr("flwr.simulation.run_simulation", run_simulation)
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    result = CliRunner().invoke(cli.app, [
        "prune", "--model", tiny_dir, "--clients", "2", "--samples-per-client", "1",
        "--seqlen", "16", "--out", str(tmp_path / "x"), "--ray-address", address])
    assert isinstance(result.exception, RayAddressError), result.output
    assert f"--ray-address {address}: no Ray cluster answers" in str(result.exception)
    with pytest.raises(RayAddressError, match="expected 'auto' or HOST:PORT"):
        cli.run_method("fedprllm", dict(model=tiny_dir, clients=2, cpus_per_client=1.0,
                                        out=str(tmp_path / "y"), ray_address="ray://head"))
