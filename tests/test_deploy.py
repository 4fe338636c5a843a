"""FedPrLLM deployed across sites on loopback: Flower's real deployment runtime with TLS and
SuperNode authentication (no simulation engine, nothing mocked).

Two independent deployments run side by side (each run is mostly waiting on process start-ups,
so together they take little more than one). Each is, as separate processes with their own
FLWR_HOME:

* ``flower-superlink`` with TLS (CA, certificate and key made by ``docker/make_certs.py``) and
  ``--enable-supernode-auth``, never installing packages at run time;
* three SuperNode public keys registered with ``flwr supernode register`` (the CLI, through a
  federation entry of a private FLWR_HOME ``config.toml`` with the CA certificate);
* three ``flower-supernode`` processes, each with its own private key, the CA certificate and
  ``--node-config 'partition-id=I num-partitions=3 data-path="SITE_I/train.jsonl"'``.

``full``: every site holds its data; the pruned model must equal the in-process vote with the
same seeds and node configs. ``missing``: site 2's data file does not exist; its ClientApp must
fail with a clear error that the server logs and records (``rejected`` in report.json), and the
run must go on with the two other sites (``min-clients=2``). An unregistered SuperNode (a fourth
key pair) must be refused by the SuperLink. A deployed site is its agent (``fedcompress
site-agent``, :data:`AGENT_SITES`): its SuperNode's node config names only the agent's socket,
and each message's thin ``flwr-clientapp`` process (the server's code) relays the Message to the
agent, which holds the site's data, keys, policy, ledger and the run's Context (the SecAgg+
keys between stages) and answers with the reply alone. ``missing``'s site 1 has no agent: its
node config says ``site-mode="development"`` and it keeps the fat path (a ``flwr-clientapp``
process that imports torch and runs the operations itself per message), which runs the same
operations (``clients.app.local_app``) as the agents and every method's Simulation Engine test.

Every process started (SuperLinks, SuperNodes, the ``flwr`` CLI, and the SuperExec /
flwr-serverapp / flwr-clientapp processes they start) is stopped by PID at the end, also when a
test fails, and the fixture asserts that none is left.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import tomllib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import free_port

# A deployment test: real SuperLink and SuperNodes on loopback.
pytestmark = pytest.mark.deploy

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WIKI = REPO / "fedcompress" / "data" / "bundled" / "corpora" / "wiki" / "train.jsonl"
CLIENTS = 3
MISSING_SITE = 2
CONNECTION = "deploy"
# Small settings of the tiny model (as tests/test_flwr_run.py); the rest are pyproject's.
RUN = {"clients": CLIENTS, "samples-per-client": 2, "seqlen": 16, "batch-size": 2,
       "eval-seqlen": 16, "eval-windows": 4, "device": "cpu", "baselines": ""}
OFFLINE = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
}
STARTUP_TIMEOUT = 90.0
#: Sites with an agent (``fedcompress site-agent``), by deployment: a deployed site refuses to
#: run without one. The agents also spare the suite a torch import and a model load per message
#: (a fat site of ``full`` started about 40 ``flwr-clientapp`` processes of 3 CPU seconds
#: each); ``missing``'s site 1 keeps the fat path (``site-mode="development"``).
AGENT_SITES = {"full": (0, 1, 2), "missing": (0, 2)}
# A safety net only: a run takes about a minute on 2 cores (more when the machine is busy).
RUN_TIMEOUT = 300.0


def _app_copy(root: Path) -> Path:
    """A copy of this checkout's app, made once: `pyproject.toml`, `.gitignore` and the files its
    `fab-include` patterns match (`fab-exclude` then applies to them when flwr builds the FAB).
    `flwr run REPO` walks every file of the checkout, its `.venv` too (about 84,000 files, 7 CPU
    seconds a run on the reference machine), before its rules keep about 120. The FAB flwr
    builds from the copy must be the FAB it builds from the checkout, byte for byte."""
    from flwr.cli.build import build_fab_from_files, get_user_fab_patterns
    from flwr.cli.utils import build_pathspec, collect_files, filter_paths_for_publish

    files = filter_paths_for_publish(collect_files(REPO))
    include, _ = get_user_fab_patterns(tomllib.loads((REPO / "pyproject.toml").read_text()))
    kept = {"pyproject.toml", ".gitignore", *build_pathspec(include or ["**"]).match_files(files)}
    copy = root / "fedcompress"  # flwr checks the folder's name as a project name
    for name in kept:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / name, copy / name)
    fab, _ = build_fab_from_files(files)
    assert build_fab_from_files(collect_files(copy))[0] == fab, "the copy builds another FAB"
    return copy


def _make_certs():
    """docker/make_certs.py (a script, not a package) as a module."""
    spec = importlib.util.spec_from_file_location("make_certs", REPO / "docker" / "make_certs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Processes:
    """Processes started here, each in its own session, and everything they start: a SuperNode
    starts its SuperExec (which starts flwr-clientapp processes) in its session; a SuperLink
    starts its SuperExec in a new session (which starts flwr-serverapp in it). Those sessions are
    recorded while the SuperLink is alive, so orphans are found and stopped too."""

    def __init__(self, logs: Path):
        import psutil

        self.logs = logs
        self.roots: dict[str, subprocess.Popen] = {}
        self.sessions: set[int] = set()
        self.before = set(psutil.pids())

    def start(self, name: str, argv: list[str], env: dict, cwd: Path | None = None
              ) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=cwd or self.logs, start_new_session=True)
        self.roots[name] = proc
        self.sessions.add(proc.pid)  # start_new_session: session id = pid
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def track(self) -> None:
        """Record the sessions of every live descendant (e.g. a SuperLink's SuperExec)."""
        import psutil

        for proc in list(self.roots.values()):
            try:
                children = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                continue
            for child in children:
                try:
                    if child.pid not in self.before:
                        self.sessions.add(os.getsid(child.pid))
                except OSError:
                    continue

    def ours(self) -> list:
        """Live (non-zombie) processes in our sessions that were started after us."""
        import psutil

        found = []
        for proc in psutil.process_iter(["pid", "status"]):
            pid = proc.info["pid"]
            if pid in self.before or pid == os.getpid():
                continue
            try:
                if os.getsid(pid) in self.sessions and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except OSError:
                continue
        return found

    def stop(self, name: str, grace: float = 15.0) -> None:
        """SIGTERM one root process (Flower's processes stop their children) and wait."""
        proc = self.roots[name]
        self.track()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def stop_all(self, grace: float = 15.0) -> list:
        """SIGTERM every root, then SIGKILL whatever of ours is left (each process and each
        process group); returns the survivors (none, or the test fails)."""
        import psutil

        self.track()
        for proc in list(self.roots.values()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(
                p.poll() is None for p in list(self.roots.values())):
            time.sleep(0.3)
        # What the roots started and has not stopped yet (a SuperExec notices its parent's exit
        # only at its next check): SIGTERM it too, then SIGKILL what remains.
        for proc in self.ours():
            try:
                proc.terminate()
            except psutil.Error:
                continue
        psutil.wait_procs(self.ours(), timeout=5)
        for proc in self.ours():
            try:
                pgid = os.getpgid(proc.pid)
                if pgid in self.sessions:  # the process group of one of our session leaders
                    os.killpg(pgid, signal.SIGKILL)
                proc.kill()
            except (OSError, psutil.Error):
                continue
        psutil.wait_procs(self.ours(), timeout=10)
        for proc in list(self.roots.values()):
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                continue
        return self.ours()


class Deployment:
    """One SuperLink (TLS + SuperNode authentication) and its SuperNodes on loopback."""

    def __init__(self, name: str, root: Path, procs: Processes):
        self.name = name
        self.root = root / name
        self.root.mkdir()
        self.procs = procs
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Key pairs 0-2 for the SuperNodes, 3 never registered.
        self.made = _make_certs().create(self.root / "certs", CLIENTS + 1, [])
        # SecAgg+ between the registered sites: their node-auth keys sign their SecAgg keys,
        # and each site holds the federation's public keys (the registered ones only)
        self.peers = self.root / "certs" / "secagg-peers"
        self.peers.mkdir()
        for _, public in self.made["node_keys"][:CLIENTS]:
            shutil.copy(public, self.peers / public.name)
        self.cli_env = self.env("cli")
        (self.root / "cli" / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{self.address}"\nroot-certificates = "{self.made["ca"]}"\n')
        self.sites = [self.root / f"site-{i}" / "train.jsonl" for i in range(CLIENTS)]
        self.node_ids: list[int] = []
        self.app = REPO  # what `flwr run` builds the FAB from (the fixture: _app_copy)

    def env(self, name: str) -> dict:
        """A process's environment: its own FLWR_HOME, never downloading or installing."""
        home = self.root / name
        home.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(OFFLINE)
        env.update({"PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "FLWR_HOME": str(home),
                    "FEDCOMPRESS_CACHE": str(self.root / "cache")})
        return env

    def proc_name(self, name: str) -> str:
        return f"{self.name}-{name}"

    def log(self, name: str) -> str:
        return self.procs.log(self.proc_name(name))

    def check_alive(self, name: str) -> None:
        proc = self.procs.roots[self.proc_name(name)]
        assert proc.poll() is None, \
            f"{self.name} {name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}"

    # -- processes -----------------------------------------------------------------------------
    def start_superlink(self) -> None:
        self.procs.start(self.proc_name("superlink"), [
            str(BIN / "flower-superlink"),
            "--ssl-ca-certfile", str(self.made["ca"]),
            "--ssl-certfile", str(self.made["cert"]),
            "--ssl-keyfile", str(self.made["key"]),
            "--enable-supernode-auth",
            "--disable-runtime-dependency-installation",
            "--host", "127.0.0.1", "--port", str(self.port),
        ], self.env("superlink"))

    def wait_superlink(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not self.tls_ready():
            self.check_alive("superlink")
            assert time.monotonic() < deadline, self.log("superlink")[-3000:]
            time.sleep(0.3)
        self.procs.track()

    def tls_ready(self, hostname: str = "127.0.0.1") -> bool:
        """A TLS handshake verified against our CA (hostname checked) succeeds."""
        context = ssl.create_default_context(cafile=str(self.made["ca"]))
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
                with context.wrap_socket(sock, server_hostname=hostname):
                    return True
        except (OSError, ssl.SSLError):
            return False

    def register(self, pool: ThreadPoolExecutor) -> list[Future]:
        certs = _make_certs()
        return [pool.submit(lambda k: certs.register([k], CONNECTION, self.cli_env)[0], public)
                for _, public in self.made["node_keys"][:CLIENTS]]

    def start_supernode(self, i: int, node_config: str, name: str | None = None
                        ) -> subprocess.Popen:
        private, _ = self.made["node_keys"][i]
        return self.procs.start(self.proc_name(name or f"supernode-{i}"), [
            str(BIN / "flower-supernode"),
            "--superlink", self.address,
            "--root-certificates", str(self.made["ca"]),
            "--auth-supernode-private-key", str(private),
            "--node-config", node_config,
            "--port", str(free_port()),  # its Runtime API (for its SuperExec), on loopback
        ], self.env(name or f"supernode-{i}"))

    #: the sites' policy keys in their node config (models, corpora, ...; none: the defaults)
    policy: dict = {}

    def node_config(self, i: int) -> dict:
        """Site ``i``'s node config: its partition, its data, its own state folder (ledger),
        its SecAgg+ identity (its node-auth key) and peers, the models its policy accepts."""
        config = {"partition-id": i, "num-partitions": CLIENTS, "data-path": str(self.sites[i]),
                  "state-dir": str(self.root / f"site-{i}" / "state"),
                  "secagg-key": str(self.made["node_keys"][i][0]),
                  "secagg-peers": str(self.peers)}
        return {**config, **self.policy}

    #: the sites' agents: index -> the agent (conftest.Agent) whose socket the SuperNode's
    #: node config names (the site's whole node config is the agent's)
    agents: dict = {}

    def agent_config(self, i: int) -> Path:
        """Site ``i``'s agent config file: its socket and the site's node config."""
        folder = self.root / f"site-{i}" / "agent"
        folder.mkdir(mode=0o700, parents=True)
        path = folder / "agent.toml"
        config = {"socket": str(folder / "run" / "agent.sock"), **self.node_config(i)}
        path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items()))
        path.chmod(0o600)
        return path

    def start_sites(self) -> None:
        for i in range(CLIENTS):
            if i in self.agents:
                self.agents[i].wait_ready()
                config = {"site-agent": str(self.agents[i].path)}
            else:  # no agent: a test bench's fat path, with the site's keys in its node config
                config = {**self.node_config(i), "site-mode": "development"}
            self.start_supernode(i, " ".join(f"{k}={json.dumps(v)}" for k, v in config.items()))

    def wait_sites(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for i in range(CLIENTS):
            while "SuperNode ID:" not in self.log(f"supernode-{i}"):
                self.check_alive(f"supernode-{i}")
                assert time.monotonic() < deadline, self.log(f"supernode-{i}")[-3000:]
                time.sleep(0.3)
        self.procs.track()

    # -- the flwr CLI --------------------------------------------------------------------------
    def flwr(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "flwr"), *args], cwd=REPO, env=self.cli_env,
                              capture_output=True, text=True, timeout=timeout)

    def nodes(self) -> list[dict]:
        proc = self.flwr("supernode", "ls", "--format", "json")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.loads(proc.stdout)["nodes"]

    def run(self, settings: dict, method: str = "fedprllm",
            tables: dict | None = None) -> tuple[dict, str]:
        """``flwr run`` the app on this deployment with ``method`` and its ``settings`` (or the
        run config's ``tables`` as they are), and wait for the end of the run; returns the
        SuperLink's record of the run (``flwr ls``) and the run's log."""
        import tomli_w

        config = self.root / "run-config.toml"
        table = {k.replace("_", "-"): v for k, v in settings.items()}  # pyproject's keys
        config.write_text(tomli_w.dumps({"method": method, method: table}
                                        if tables is None else tables))
        name = self.proc_name("flwr-run")
        proc = self.procs.start(name, [
            str(BIN / "flwr"), "run", str(self.app), CONNECTION, "--run-config", str(config),
            "--stream"], self.cli_env, cwd=REPO)
        try:
            proc.wait(RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name}: no end of run after {RUN_TIMEOUT:.0f} s:\n"
                        f"{self.procs.log(name)[-4000:]}")
        finally:
            self.procs.track()
        log = self.procs.log(name)
        assert proc.returncode == 0, log[-4000:]
        started = re.search(r"started run (\d+)", log)
        assert started, log[-4000:]
        # `flwr run --stream` exits 0 even when the run fails: ask the SuperLink.
        ls = self.flwr("ls", "--run-id", started.group(1), "--format", "json")
        assert ls.returncode == 0, ls.stdout + ls.stderr
        return json.loads(ls.stdout)["runs"][0], log


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """The tiny llama of the other FedPrLLM tests, saved with its tokenizer."""
    from conftest import build_tiny_model, build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model("llama", n_layers=3).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def deployments(tmp_path_factory, tiny_model_dir):
    """Two deployments (``full``, ``missing``: site 2 has no data file), each with its one-shot
    FedPrLLM run started in the background (tests wait for ``dep.result``). The sites of
    :data:`AGENT_SITES` run an agent: every site of ``full``, sites 0 and 2 of ``missing`` (its
    site 1 keeps the fat path, ``site-mode="development"``). Every process, the agents too, is
    stopped by PID at the end, also on failure; none may be left, nor an agent's socket."""
    root = tmp_path_factory.mktemp("deploy")
    procs = Processes(root)
    deps = {name: Deployment(name, root, procs) for name in ("full", "missing")}
    app = _app_copy(root / "app")
    for dep in deps.values():
        dep.app = app
    from conftest import Agent, build_tiny_task

    # The sites' policy accepts the tiny model and task, releases masks in the clear (the
    # plain vote runs here beside the SecAgg+ one; require-secagg=false is the operator's
    # opt-out) and on the same windows in many runs (runs-per-input: the tests run several
    # votes on one site's data), and (research flag: the tests compare a deployed run with the
    # in-process one) draws its secrets from the server's seeds.
    task = build_tiny_task(root / "task")
    for dep in deps.values():
        dep.task = task
        dep.policy = {"models": str(tiny_model_dir), "corpora": f"wiki,strategyqa,{task}",
                      "require-secagg": False, "runs-per-input": 100,
                      "research-reproducible-secrets": True}
    # Every site's data: the first documents of the bundled wiki train split (small: each
    # ClientApp process tokenizes it), a private copy per site.
    documents = WIKI.read_text().splitlines(keepends=True)[:20]
    for dep in deps.values():
        for i, site in enumerate(dep.sites):
            site.parent.mkdir()
            if not (dep.name == "missing" and i == MISSING_SITE):
                site.write_text("".join(documents))
    pool = ThreadPoolExecutor(8)
    for dep in deps.values():
        dep.agents = {}
    try:
        # their start-up (imports) overlaps the SuperLinks' and the registrations; an agent
        # makes its own 0700 folder for its socket
        for name, sites in AGENT_SITES.items():
            dep = deps[name]
            for i in sites:
                config = dep.agent_config(i)
                dep.agents[i] = Agent(config.parent / "run" / "agent.sock", dep.root / "cache",
                                      root / f"agent-{name}-{i}.log",
                                      env=dep.env(f"agent-{i}"), wait=False, config=config)
        for dep in deps.values():
            dep.start_superlink()
        for dep in deps.values():
            dep.wait_superlink()
        registered = {name: dep.register(pool) for name, dep in deps.items()}
        for name, dep in deps.items():
            dep.node_ids = [future.result() for future in registered[name]]
        # Submit the runs first: the ServerApp waits for the sites, which start meanwhile.
        deps["full"].result = pool.submit(deps["full"].run, {
            **RUN, "model": str(tiny_model_dir), "out": str(deps["full"].root / "out")})
        deps["missing"].result = pool.submit(deps["missing"].run, {
            **RUN, "model": str(tiny_model_dir), "out": str(deps["missing"].root / "out"),
            "min-clients": 2})
        for dep in deps.values():
            dep.start_sites()
        for dep in deps.values():
            dep.wait_sites()
        yield deps
    finally:
        left = procs.stop_all()
        pool.shutdown(wait=True, cancel_futures=True)
        codes = {(dep.name, i): (a.stop(), a.path.exists(), a.log())
                 for dep in deps.values() for i, a in dep.agents.items()}
        assert left == [], f"processes left running: {[(p.pid, p.name()) for p in left]}"
        for code, socket_left, log in codes.values():
            assert code == 0 and not socket_left, log


def test_deployed_ppcgpt_equals_in_process(deployments, tiny_model_dir, openai_stub):
    """PPC-GPT on the same deployment (TLS, registered sites), after its FedPrLLM run: the one
    FAB serves both methods; the report equals the same pipeline run in this process."""
    from conftest import (
        ppcgpt_in_process,
        ppcgpt_tiny_settings,
        same_ppcgpt_result,
        yes_no_generator,
    )

    dep = deployments["full"]
    dep.result.result()  # one run at a time on this SuperLink
    with openai_stub(yes_no_generator) as stub:
        settings = ppcgpt_tiny_settings(tiny_model_dir, stub.url, dep.root / "ppcgpt",
                                        clients=CLIENTS)
        run, log = dep.run(settings, method="ppcgpt")
    assert run["status"] == "finished:completed", f"{run}\n{log[-4000:]}"
    report = json.loads((dep.root / "ppcgpt" / "report.json").read_text())
    assert report["rejected"] == [], report["rejected"]
    assert sorted(m["node"] for m in report["privacy"]["clients"]) == sorted(dep.node_ids)
    with openai_stub(yes_no_generator) as stub:
        reference = ppcgpt_in_process({**settings, "synth_url": stub.url,
                                       "out": str(dep.root / "ppcgpt-reference")})
    same_ppcgpt_result(report, reference)


def test_deployed_privytune_equals_in_process(deployments, tiny_model_dir, tmp_path):
    """PrunePrivyTune on the same deployment (TLS, registered sites): each site's cosine matrix,
    a DP-LoRA round under its own accountant, the audit; equal to the in-process pipeline."""
    from conftest import (
        privytune_in_process,
        privytune_tiny_settings,
        same_privytune_result,
    )

    dep = deployments["full"]
    dep.result.result()  # one run at a time on this SuperLink
    # one DP-LoRA round (the rounds' accounting is tested under the Simulation Engine, in
    # tests/test_privytune.py): what this adds is the deployed runtime's path
    settings = privytune_tiny_settings(tiny_model_dir, dep.task, dep.root / "privytune",
                                       clients=CLIENTS, rounds=1)
    run, log = dep.run(settings, method="privytune")
    assert run["status"] == "finished:completed", f"{run}\n{log[-4000:]}"
    report = json.loads((dep.root / "privytune" / "report.json").read_text())
    assert report["rejected"] == [], report["rejected"]
    assert sorted({m["node"] for m in report["sites"]}) == sorted(dep.node_ids)
    reference = privytune_in_process({**settings, "out": str(dep.root / "privytune-ref")})
    same_privytune_result(report, reference)


def test_deployed_personalize_equals_in_process(deployments, tiny_model_dir, tmp_path):
    """Personalized pruning on the same deployment: each site's classes, masks at the global
    plan and its personalized model's scores; equal to the in-process pipeline."""
    from conftest import (
        personalize_in_process,
        personalize_tiny_settings,
        same_personalize_result,
    )

    dep = deployments["full"]
    dep.result.result()  # one run at a time on this SuperLink
    settings = personalize_tiny_settings(tiny_model_dir, dep.root / "personalize",
                                         clients=CLIENTS)
    run, log = dep.run(settings, method="personalize")
    assert run["status"] == "finished:completed", f"{run}\n{log[-4000:]}"
    report = json.loads((dep.root / "personalize" / "report.json").read_text())
    assert report["rejected"] == [], report["rejected"]
    assert sorted(int(n) for n in report["classes"]["sites"]) == sorted(dep.node_ids)
    reference = personalize_in_process({**settings, "out": str(dep.root / "personalize-ref")},
                                       [dep.node_config(i) for i in range(CLIENTS)])
    same_personalize_result(report, reference)


def test_deployed_secure_vote_equals_in_process_vote(deployments, tiny_model_dir):
    """SecAgg+ on the deployment: every stage of a site runs in a new (thin) ClientApp process
    that relays it to the site's agent, the site's keys and shares kept in the agent's Context
    of the run (never in the SuperNode's state) between them; the agents sign their SecAgg
    keys with their sites' keys (agent config secagg-key, secagg-peers) and run the
    consistency round; the model pruned from the secure sum equals the in-process plain
    vote."""
    from fedcompress.models import load_model

    dep = deployments["full"]
    dep.result.result()  # one run at a time on this SuperLink
    out = dep.root / "secagg"
    settings = {**RUN, "model": str(tiny_model_dir), "out": str(out), "secagg": True}
    run, log = dep.run(settings)
    assert run["status"] == "finished:completed", f"{run}\n{log[-4000:]}"
    report = json.loads((out / "report.json").read_text())
    assert report["rejected"] == [], report["rejected"]
    fed = report["results"][0]
    assert fed["valid_clients"] == CLIENTS and fed["rounds"] == 5  # with the consistency round
    assert report["secagg"]["sum"]["dropped"] == 0
    assert report["secagg"]["sum"]["authenticated"]  # keys signed with the node-auth keys
    reference = _reference_model(tiny_model_dir, {**settings, "secagg": False},
                                 [dep.node_config(i) for i in range(CLIENTS)])
    saved = load_model(str(out / "model"), device="cpu").model
    for (key, a), (_, b) in zip(reference.state_dict().items(), saved.state_dict().items()):
        assert torch.equal(a, b), key


def test_tls_and_registered_nodes(deployments):
    """TLS with our CA (the SuperLink certificate's names) and the 3 registered nodes online."""
    from cryptography import x509

    dep = deployments["full"]
    cert = x509.load_pem_x509_certificate(dep.made["cert"].read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "127.0.0.1", "::1", "superlink"} <= {str(n.value) for n in sans}
    assert dep.tls_ready("localhost") and dep.tls_ready("127.0.0.1")
    assert not dep.tls_ready("superlink.example.org")  # not one of the certificate's names
    # A client that does not trust our CA is refused by the TLS handshake.
    with socket.create_connection(("127.0.0.1", dep.port), timeout=5) as sock:
        with pytest.raises(ssl.SSLCertVerificationError):
            ssl.create_default_context().wrap_socket(sock, server_hostname="localhost")

    for dep in deployments.values():
        nodes = dep.nodes()
        assert sorted(int(n["node-id"]) for n in nodes) == sorted(dep.node_ids)
        assert all(n["status"] == "online" for n in nodes), nodes


def test_unregistered_supernode_is_refused(deployments):
    dep = deployments["full"]
    proc = dep.start_supernode(CLIENTS, f"partition-id=0 num-partitions={CLIENTS}",
                               name="unregistered")
    try:
        code = proc.wait(STARTUP_TIMEOUT)
    finally:
        dep.procs.stop(dep.proc_name("unregistered"))
    log = dep.log("unregistered")
    assert code != 0, log
    assert "Failed to activate SuperNode" in log and "SuperNode ID:" not in log, log
    assert "No SuperNode found with the given public key" in dep.log("superlink")
    assert sorted(int(n["node-id"]) for n in dep.nodes()) == sorted(dep.node_ids)


def _reference_model(model_dir: Path, settings: dict, node_configs: list[dict]):
    """The in-process vote with the same settings, seeds and node configs (the reference of
    tests/test_fedprllm.py: the real ClientApp and strategy, messages handled in process; a
    site's error is an error reply, as in a deployment)."""
    from conftest import InProcessFederation
    from flwr.app import ArrayRecord, ConfigRecord

    from fedcompress.models import load_model
    from server.fedprllm import split_settings
    from strategies.fedprllm import FedPrLLM

    class Federation(InProcessFederation):
        app = "clients.app"
        errors_as_replies = True

        def __init__(self, n: int):
            super().__init__(n)
            for context, node_config in zip(self.contexts.values(), node_configs):
                # the site's data, not its state folder: the reference keeps its own ledger
                context.node_config.update({k: v for k, v in node_config.items()
                                            if k != "state-dir"})

    defaults = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    config, _, _ = split_settings({**defaults["config"]["fedprllm"], **settings})
    strategy = FedPrLLM(config, load_model(str(model_dir), device="cpu").model)
    grid = Federation(CLIENTS)
    for rnd in range(1, strategy.num_rounds + 1):
        replies = grid.send_and_receive(strategy.configure_train(rnd, ArrayRecord(),
                                                                 ConfigRecord(), grid))
        strategy.aggregate_train(rnd, replies)
    model = load_model(str(model_dir), device="cpu").model
    strategy.prune(model)
    return model


def test_deployed_run_equals_in_process_vote(deployments, tiny_model_dir):
    from fedcompress.models import load_model

    dep = deployments["full"]
    settings = {**RUN, "model": str(tiny_model_dir), "out": str(dep.root / "out")}
    reference = _reference_model(tiny_model_dir, settings,
                                 [dep.node_config(i) for i in range(CLIENTS)])
    run, log = dep.result.result()
    assert run["status"] == "finished:completed", f"{run}\n{log[-4000:]}"

    out = dep.root / "out"
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok" and report["rejected"] == [], report["rejected"]
    fed = report["results"][0]
    assert fed["name"] == "fedprllm-oneshot-layer"
    assert fed["valid_clients"] == CLIENTS and fed["rounds"] == 1
    assert abs(fed["sparsity"] - 0.5) < 1e-3
    assert sorted(c["node"] for c in report["clients"]) == sorted(dep.node_ids)
    assert sorted(c["partition"] for c in report["clients"]) == list(range(CLIENTS))
    assert {"engine_startup", "federated_pruning"} <= set(report["timings"])
    # Every site relayed its messages to its agent: a reply carries the thin process's
    # runtime and the exchange, and the agent's compute (the fat path's whole start-up is
    # checked on the ``missing`` deployment's site 1).
    split = report["client_startup"]
    by_node = {c["node"]: c for c in report["clients"]}
    for stage in ("warmup", "masks"):
        records = [r for r in split if r["stage"] == stage]
        assert sorted(r["node"] for r in records) == sorted(dep.node_ids), split
        for r in records:
            site = dep.node_ids.index(r["node"])
            assert r["startup_runtime_seconds"] > 0 and r["compute_seconds"] >= 0, r
            assert r["client_startup_seconds"] == pytest.approx(
                r["startup_import_seconds"] + r["startup_load_seconds"])
            assert r["startup_worker_seconds"] >= 0, r
            assert by_node[r["node"]]["pid"] == dep.agents[site].proc.pid
    assert report["client_startup_seconds"] == [r["client_startup_seconds"] for r in split
                                                if r["stage"] == "warmup"]

    saved = load_model(str(out / "model"), device="cpu").model
    for (key, a), (_, b) in zip(reference.state_dict().items(), saved.state_dict().items()):
        assert torch.equal(a, b), key


def test_missing_data_path_is_reported_and_run_goes_on(deployments):
    """Site 2's data file does not exist: its agent refuses with a clear error, the server
    logs it, records it in report.json and prunes with the two other sites (min-clients=2)."""
    dep = deployments["missing"]
    run, log = dep.result.result()
    assert run["status"] == "finished:completed", f"{run}\n{log[-4000:]}"
    report = json.loads((dep.root / "out" / "report.json").read_text())
    assert report["status"] == "ok"
    fed = report["results"][0]
    assert fed["valid_clients"] == CLIENTS - 1
    assert abs(fed["sparsity"] - 0.5) < 1e-3

    site = dep.node_ids[MISSING_SITE]
    rejected = report["rejected"]
    # Left out at start-up (round 0, the warm-up query), and in the pruning round if asked.
    assert 0 in {r["round"] for r in rejected} <= {0, 1}, rejected
    assert {r["node"] for r in rejected} == {site}, rejected
    for record in rejected:  # the site's error: the key, not the path (a site's own detail)
        assert "data-path" in record["reason"] and "does not exist" in record["reason"], record
        assert str(dep.sites[MISSING_SITE]) not in record["reason"], record
    assert sorted(c["node"] for c in report["clients"]) == sorted(set(dep.node_ids) - {site})
    # The server logged it (the run's log streams the ServerApp's), the site's agent logged it
    # with the path (the site's own log), its SuperNode's ClientApp (the server's code) never
    # saw the path.
    assert f"client node {site} left out" in log and "does not exist" in log
    assert f"'{dep.sites[MISSING_SITE]}' does not exist" in dep.agents[MISSING_SITE].log()
    assert str(dep.sites[MISSING_SITE]) not in dep.log(f"supernode-{MISSING_SITE}")


def test_deployed_run_refuses_another_methods_setting(deployments):
    """A run config that sets a key of another method than the one it runs fails the run at
    the ServerApp's start, with the key named (on ``missing``, idle after its one run)."""
    dep = deployments["missing"]
    dep.result.result()  # one run at a time on this SuperLink
    run, log = dep.run({}, tables={"method": "ppcgpt", "fedprllm": {"sparsity": 0.7}})
    assert run["status"].startswith("finished:failed"), f"{run}\n{log[-4000:]}"
    assert "fedprllm.sparsity=0.7 is a setting of method 'fedprllm'" in log, log[-4000:]


def test_deployed_site_with_an_agent_prunes_as_the_fat_path(deployments, tiny_model_dir):
    """The ``missing`` deployment's site 0 relays its messages to its agent: its masks
    come from the agent (the thin per-message process's runtime and imports, the agent's
    loading and compute), the other sites' from their own ClientApp processes, and the pruned
    model equals the in-process vote of fat ClientApps over the same sites (site 2 failing)."""
    from fedcompress.models import load_model

    dep = deployments["missing"]
    agent = dep.agents[0]
    run, log = dep.result.result()
    assert run["status"] == "finished:completed", f"{run}\n{log[-4000:]}"
    report = json.loads((dep.root / "out" / "report.json").read_text())
    by_node = {c["node"]: c for c in report["clients"]}
    assert by_node[dep.node_ids[0]]["pid"] == agent.proc.pid  # site 0: the agent's masks
    assert by_node[dep.node_ids[1]]["pid"] != agent.proc.pid
    split = [r for r in report["client_startup"] if r["node"] == dep.node_ids[0]]
    assert {r["stage"] for r in split} == {"warmup", "masks"}
    for r in split:  # the thin process's runtime and imports, the agent's load/compute
        assert r["startup_runtime_seconds"] > 0 and r["startup_worker_seconds"] >= 0, r
    # site 1, the fat path: each message's own flwr-clientapp process carries its whole
    # start-up (Flower's runtime, torch's imports, the model's loading) and its compute
    fat = [r for r in report["client_startup"] if r["node"] == dep.node_ids[1]]
    assert {r["stage"] for r in fat} == {"warmup", "masks"}
    for r in fat:
        assert r["startup_runtime_seconds"] > 0 and r["startup_import_seconds"] > 0, r
        assert r["startup_load_seconds"] > 0 and r["compute_seconds"] >= 0, r
        assert r["client_startup_seconds"] == pytest.approx(
            r["startup_import_seconds"] + r["startup_load_seconds"])
    assert "message 2: train.masks" in agent.log(), agent.log()
    settings = {**RUN, "model": str(tiny_model_dir), "out": str(dep.root / "out"),
                "min-clients": 2}
    reference = _reference_model(tiny_model_dir, settings,
                                 [dep.node_config(i) for i in range(CLIENTS)])
    saved = load_model(str(dep.root / "out" / "model"), device="cpu").model
    for (key, a), (_, b) in zip(reference.state_dict().items(), saved.state_dict().items()):
        assert torch.equal(a, b), key


def _mount(volume: str) -> tuple[str, str]:
    """``SOURCE:TARGET[:ro]`` (SOURCE may be ``${VAR:-default}``) -> ``(TARGET, SOURCE)``."""
    source, target = re.fullmatch(r"(.+):(/[^:]*)(?::ro|:rw)?", volume).groups()
    return target, source


def test_compose_file_is_the_tested_deployment(tmp_path):
    """docker/compose.yml starts what this module tests: Flower 1.42 accepts every command
    line, TLS and SuperNode authentication are on, each site has its own node key, agent key,
    agent config (partition, data path) and data folder, each SuperNode's ClientApp runs in a
    container that reaches it (``--isolation process``), nothing is installed at run time, and
    make_certs.py makes every mounted key."""
    import yaml
    from flwr.common.config import parse_config_args
    from flwr.supercore.cli.flower_superexec import _parse_args as _parse_args_superexec
    from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink
    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

    from clients.site_agent import NODE_CONFIG_KEY

    compose = yaml.safe_load((REPO / "docker" / "compose.yml").read_text())
    services = compose["services"]
    for service in services.values():
        assert service["environment"]["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"
        assert service["environment"]["HF_HUB_OFFLINE"] == "1"

    link = services["superlink"]["command"]
    assert link[0] == "flower-superlink"
    args = _parse_args_run_superlink().parse_args(link[1:])
    assert args.enable_supernode_auth and not args.insecure
    assert not args.runtime_dependency_install
    assert (args.ssl_ca_certfile, args.ssl_certfile, args.ssl_keyfile) == (
        "/certs/ca.crt", "/certs/server.pem", "/certs/server.key")

    made = _make_certs().create(tmp_path / "certs", CLIENTS, [])
    sites = sorted(name for name in services if name.startswith("supernode-"))
    assert len(sites) == CLIENTS
    seen: dict[str, set] = {"keys": set(), "agent_keys": set(), "partitions": set(),
                            "data": set()}
    for name in sites:
        i = int(name.rsplit("-", 1)[1])
        service = services[name]
        assert service["command"][0] == "flower-supernode"
        args = _parse_args_run_supernode().parse_args(service["command"][1:])
        assert args.superlink == "superlink:8000" and not args.insecure
        assert args.root_certificates == "/certs/ca.crt"
        assert args.isolation == "process" and args.port == 9094
        node_config = parse_config_args([args.node_config])
        assert node_config == {NODE_CONFIG_KEY: "/agent/agent.sock"}, node_config
        mounts = dict(_mount(v) for v in service["volumes"])
        key = mounts[args.auth_supernode_private_key]
        seen["keys"].add(key)
        assert (tmp_path / Path(key)).is_file(), key  # ./certs/keys/supernode-I
        app = services[f"clientapp-{i}"]
        superexec = _parse_args_superexec().parse_args(app["command"][1:])
        assert superexec.runtime_api_address == f"{name}:{args.port}" and superexec.insecure
        agent = services[f"agent-{i}"]
        agent_mounts = dict(_mount(v) for v in agent["volumes"])
        assert (tmp_path / Path(agent_mounts["/keys/agent"])).is_file()  # ./certs/keys/agent-I
        seen["agent_keys"].add(agent_mounts["/keys/agent"])
        config = tomllib.loads((REPO / "docker" / agent_mounts["/site/agent.toml"]).read_text())
        assert config["num-partitions"] == CLIENTS and config["data-path"] == "/data"
        seen["partitions"].add(config["partition-id"])
        default_data = re.fullmatch(r"\$\{SITE\d_DATA:-(.+)\}", agent_mounts["/data"]).group(1)
        # each site its own data folder, under docker/data (never in git nor in the image)
        assert default_data == f"./data/site-{config['partition-id']}", default_data
        seen["data"].add(default_data)
    assert seen["partitions"] == set(range(CLIENTS)) and len(seen["keys"]) == CLIENTS
    assert len(seen["data"]) == CLIENTS and len(seen["agent_keys"]) == CLIENTS
    for ignore in (".gitignore", "docker/Dockerfile.dockerignore", ".dockerignore"):
        assert "docker/data" in (REPO / ignore).read_text(), ignore
    # Docker's legacy builder reads only the context's .dockerignore: the same exclusions
    lines = {x for x in (REPO / "docker/Dockerfile.dockerignore").read_text().splitlines()
             if x and not x.startswith("#")}
    assert lines <= set((REPO / ".dockerignore").read_text().splitlines())
    for volume in services["superlink"]["volumes"] + services["cli"]["volumes"]:
        _, source = _mount(volume)
        if source.startswith("./certs/"):
            assert (tmp_path / source).is_file(), source
    assert {"superlink"} <= set(made["names"])

    flwr_config = tomllib.loads((REPO / "docker" / "flwr-config.toml").read_text())
    connection = flwr_config["superlink"][flwr_config["superlink"]["default"]]
    assert connection["address"] == "superlink:8000"
    assert connection["root-certificates"] == "/certs/ca.crt"
