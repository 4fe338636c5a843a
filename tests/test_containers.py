"""The deployment of docker/compose.yml in real containers (``make deploy-test``; skipped by
``make test``, which runs the same deployment as processes on loopback in tests/test_deploy.py).

What it starts, from the CPU image of this checkout (``make images``) and the compose file as
shipped (a small override adds only what a test needs, listed below), as a Compose project of
its own (``fedcompress-test-<random>``) in a temporary project folder:

* the SuperLink (uid 50000) with TLS (``docker/make_certs.py``'s CA, certificate and key) and
  SuperNode authentication, its own volumes;
* three sites, each the compose file's four services: its agent (``agent-I``, uid 5010I, no
  network: its data, a bind mount of the site's folder, mode 0700, owned by the site's uid; its
  SecAgg+ key; its agent config ``sites/site-I.toml`` with the site's policy; its cache with the
  tokenized corpus and its ledger), its SuperNode (``supernode-I``: its node-auth key, its
  Flower home, ``--isolation process``), its ClientApp container (``clientapp-I``, uid 5020I:
  Flower's SuperExec running the FAB's ClientApp, which relays each message to the agent over
  the one volume it mounts) and its one-shot ``site-I-init``;
* the ``cli`` container (the operator) for ``flwr supernode register`` and ``flwr run``.

The override (``compose.test.yml``, written by :class:`Stack`): a read-only bind mount of public
material (the tiny test model and task, at the same absolute path as on the host, so that the
in-process reference runs on the very same paths) in the SuperLink and the agents, and no host
port (the project's network only). Each site's policy (the models and corpora it accepts,
``research-reproducible-secrets`` so that the deployed run can be compared with the in-process
one) is in its agent config, which the stack writes where the compose file expects it.

Then, with ``flwr run`` from the ``cli`` container and the FAB it builds from the image's
``/app``: FedPrLLM one-shot, FedPrLLM with ``secagg``, and personalized layer pruning; each
result equals the same run in this process (the pruned model tensor for tensor; the
personalized report's decisions and perplexities). From inside every container: its mounts are
its own or public, no other site's data (a random canary line per site) is in any file it can
read outside the image, and the server's outputs hold no site's text. Everything the project
started (containers, networks, named volumes) is removed at the end, also when a test fails.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.containers,
    pytest.mark.skipif(os.environ.get("FEDCOMPRESS_CONTAINER_TEST") != "1",
                       reason="real containers: `make deploy-test` runs this module (a Docker "
                              "engine and the image of `make images` needed)"),
]

REPO = Path(__file__).resolve().parents[1]
IMAGE = os.environ.get("FEDCOMPRESS_IMAGE", "fedcompress:cpu")
SITES = 3
SITE_UID = 50100
#: the uid of each site's ClientApp container (5020I): the server's code
APP_UID = 50200
SUPERLINK_UID = 50000
#: a safety net: one tiny run takes well under a minute on 2 cores
RUN_TIMEOUT = 600
STARTUP_TIMEOUT = 180


def _docker(*args: str, timeout: float = 120, check: bool = True, **kw
            ) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                          **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _yaml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a YAML flow scalar


class Stack:
    """One Compose project of docker/compose.yml in ``root`` (certificates, data, public
    material, the override), with helpers to run ``docker compose`` on it."""

    def __init__(self, root: Path, public: Path | None = None, policy: dict | None = None,
                 documents: list[str] | None = None):
        """``public``: a folder of public material the SuperLink and the agents mount read
        only at the same path (or none); ``policy``: node-config keys added to every site's
        agent config (the models and corpora it accepts, ...); ``documents``: JSONL lines of
        each site's train split (default: the first 20 wiki documents), to which a canary line
        of the site's own is added."""
        from test_deploy import WIKI, _make_certs

        self.root = root
        self.project = f"fedcompress-test-{secrets.token_hex(4)}"
        self.public, self.policy = public, dict(policy or {})
        shutil.copy(REPO / "docker" / "compose.yml", root / "compose.yml")
        shutil.copy(REPO / "docker" / "flwr-config.toml", root / "flwr-config.toml")
        made = _make_certs().create(root / "certs", SITES, [])
        os.chown(made["key"], SUPERLINK_UID, SUPERLINK_UID)
        for i, ((node, _), (agent, _)) in enumerate(zip(made["node_keys"], made["agent_keys"])):
            os.chown(node, SITE_UID + i, SITE_UID + i)
            os.chown(agent, SITE_UID + i, SITE_UID + i)
        self.made = made
        # each site's private text (a folder with its train and test splits: personalized
        # pruning evaluates each site on its own held-out text) and a canary line of its own
        wiki = WIKI.read_text().splitlines(keepends=True)
        train = documents if documents is not None else wiki[:20]
        self.canaries = {}
        for i in range(SITES):
            folder = root / "data" / f"site-{i}"
            folder.mkdir(parents=True)
            canary = f"site-{i}-canary-{secrets.token_hex(8)}"
            self.canaries[i] = canary
            (folder / "train.jsonl").write_text(
                "".join(train) + json.dumps({"text": f"{canary} is private text."}) + "\n")
            (folder / "test.jsonl").write_text("".join(wiki[20:30]))
            for path in (folder, folder / "train.jsonl", folder / "test.jsonl"):
                os.chown(path, SITE_UID + i, SITE_UID + i)
                path.chmod(0o700 if path.is_dir() else 0o600)
        (root / "runs").mkdir()
        self.write_sites()
        self.write_override()

    # -- the sites' agent configs and the override ---------------------------------------------
    def agent_config(self, i: int) -> dict:
        """Site ``i``'s agent config: docker/sites/site-I.toml's, plus the stack's ``policy``."""
        import tomllib

        shipped = tomllib.loads((REPO / "docker" / "sites" / f"site-{i}.toml").read_text())
        return {**shipped, **self.policy}

    def node_config(self, i: int, data_path: str = "/data") -> dict:
        """Site ``i``'s node config (its agent config less the agent's own keys)."""
        from clients.site_agent import AGENT_KEYS

        config = {k: v for k, v in self.agent_config(i).items() if k not in AGENT_KEYS}
        return {**config, "data-path": data_path}

    def write_sites(self) -> None:
        """``sites/site-I.toml`` where the compose file mounts it: the site's, mode 0600."""
        import tomli_w

        (self.root / "sites").mkdir(exist_ok=True)
        for i in range(SITES):
            path = self.root / "sites" / f"site-{i}.toml"
            path.write_text(tomli_w.dumps(self.agent_config(i)))
            os.chown(path, SITE_UID + i, SITE_UID + i)
            path.chmod(0o600)

    def write_override(self, process_per_message: bool = False) -> None:
        """``compose.test.yml``: the public material mounted, no published port.
        ``process_per_message``: the layout a measurement compares the agent with (never a
        site's): each site's ClientApp container runs the operations itself, as the site's uid
        with its data, keys, cache and state mounted, its SuperNode's node config the site's
        own in ``site-mode="development"`` (:meth:`use`)."""
        import yaml

        base = yaml.safe_load((self.root / "compose.yml").read_text())["services"]
        lines = ["services:"]
        for name in base:
            site = name.rsplit("-", 1)[-1]
            fat = process_per_message and name.startswith(("supernode-", "clientapp-"))
            if name != "superlink" and not name.startswith("agent-") and not fat:
                continue
            lines.append(f"  {name}:")
            mounts = [f"{self.public}:{self.public}:ro"] if self.public is not None and (
                name == "superlink" or name.startswith(("agent-", "clientapp-"))) else []
            if fat and name.startswith("supernode-"):
                # a ledger of its own (the agent, idle meanwhile, keeps the volume's journal)
                config = {**self.node_config(int(site)), "site-mode": "development",
                          "state-dir": "/home/app/fat-state"}
                command = [*base[name]["command"][:-1], "--node-config=" + " ".join(
                    f"{k}={json.dumps(v)}" for k, v in config.items())]
                lines += ["    command: !override", *(f"      - {_yaml_string(c)}"
                                                     for c in command)]
            if fat and name.startswith("clientapp-"):
                i, uid = int(site), SITE_UID + int(site)
                agent = base[f"agent-{i}"]
                mounts += [m for m in agent["volumes"] if not m.startswith("./sites/")
                           and not m.endswith((":/agent", ":/home/app/state"))]
                lines += [f'    user: "{uid}:{uid}"',
                          "    tmpfs: !override",
                          f"      - /home/app:uid={uid},gid={uid},mode=0700",
                          "    environment:",
                          "      FEDCOMPRESS_CACHE: /home/app/.cache/fedcompress",
                          "      FEDCOMPRESS_STATE: /home/app/state",
                          "      HF_HOME: /home/app/.cache/fedcompress/huggingface"]
            if mounts:
                lines += ["    volumes:", *(f"      - {_yaml_string(m)}" for m in mounts)]
            if name == "superlink":
                lines.append("    ports: !reset []")
        (self.root / "compose.test.yml").write_text("\n".join(lines) + "\n")

    def use(self, path: str) -> None:
        """The sites' SuperNode and ClientApp containers recreated for ``path``: ``agent``
        (the shipped layout) or ``fat`` (a process per message at the site's uid,
        :meth:`write_override`); each SuperNode keeps its key, so its node id."""
        if path not in ("agent", "fat"):
            raise ValueError(f"path={path!r}: expected 'agent' or 'fat'")
        self.write_override(process_per_message=path == "fat")
        self.compose("up", "-d", "--pull", "never",
                     *(f"{kind}-{i}" for i in range(SITES) for kind in ("supernode", "clientapp")),
                     timeout=STARTUP_TIMEOUT)
        self.wait_online()

    # -- docker compose ----------------------------------------------------------------------
    def compose(self, *args: str, timeout: float = 300, check: bool = True
                ) -> subprocess.CompletedProcess:
        env = {**os.environ, "FEDCOMPRESS_IMAGE": IMAGE}
        return _docker("compose", "-p", self.project, "--project-directory", str(self.root),
                       "-f", str(self.root / "compose.yml"),
                       "-f", str(self.root / "compose.test.yml"), *args,
                       timeout=timeout, check=check, env=env)

    def flwr(self, *args: str, timeout: float = 120, check: bool = True
             ) -> subprocess.CompletedProcess:
        """The ``flwr`` CLI in the operator's container (``runs/`` mounted read only)."""
        return self.compose("run", "--rm", "-T", "-v", f"{self.root / 'runs'}:/run-config:ro",
                            "cli", *args, timeout=timeout, check=check)

    def mounts(self, service: str) -> list[dict]:
        """What Docker mounted in the service's one container (``docker inspect``)."""
        out = self.compose("ps", "-q", service).stdout.split()
        assert len(out) == 1, f"{service}: containers {out}"
        return json.loads(_docker("inspect", out[0]).stdout)[0]["Mounts"]

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.compose("up", "-d", "--wait", "--pull", "never", "superlink",
                     timeout=STARTUP_TIMEOUT)
        self.node_ids = []
        for i in range(SITES):
            proc = self.flwr("supernode", "register", f"/keys/supernode-{i}.pub", "--format",
                             "json")
            reply = json.loads(proc.stdout[proc.stdout.index("{"):])
            assert reply.get("success"), reply
            self.node_ids.append(int(reply["node-id"]))
        self.compose("up", "-d", "--wait", "--pull", "never",
                     *(f"agent-{i}" for i in range(SITES)), timeout=STARTUP_TIMEOUT)
        self.compose("up", "-d", "--pull", "never",
                     *(f"{kind}-{i}" for i in range(SITES) for kind in ("supernode", "clientapp")),
                     timeout=STARTUP_TIMEOUT)
        self.wait_online()

    def wait_online(self) -> None:
        """Until the SuperLink lists every site's SuperNode online."""
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            nodes = json.loads(self.flwr("supernode", "ls", "--format", "json").stdout)["nodes"]
            online = sorted(int(n["node-id"]) for n in nodes if n["status"] == "online")
            if online == sorted(self.node_ids):
                return
            assert time.monotonic() < deadline, (nodes, self.compose("logs").stdout[-5000:])
            time.sleep(2)

    def run(self, name: str, method: str, settings: dict, app: str = "/app",
            tables: dict | None = None) -> tuple[dict, str, float]:
        """``flwr run APP`` from the operator's container with ``method`` and its
        ``settings`` (the run's output in the SuperLink's ``/runs/NAME``), or the run config's
        ``tables`` as they are, copied out to ``ROOT/out/NAME``; returns the SuperLink's record
        of the run, its log, its seconds."""
        import tomli_w

        table = {k.replace("_", "-"): v for k, v in
                 {**settings, "out": f"/runs/{name}"}.items()}
        (self.root / "runs" / f"{name}.toml").write_text(
            tomli_w.dumps({"method": method, method: table} if tables is None else tables))
        started = time.perf_counter()
        proc = self.flwr("run", app, "docker", "--run-config", f"/run-config/{name}.toml",
                         "--stream", timeout=RUN_TIMEOUT)
        seconds = time.perf_counter() - started
        log = proc.stdout + proc.stderr
        run_id = re.search(r"started run (\d+)", log)
        assert run_id, log[-4000:]
        ls = self.flwr("ls", "--run-id", run_id.group(1), "--format", "json")
        record = json.loads(ls.stdout[ls.stdout.index("{"):])["runs"][0]
        out = self.root / "out"
        out.mkdir(exist_ok=True)
        self.compose("cp", f"superlink:/runs/{name}", str(out / name), check=False)
        return record, log, seconds

    def close(self, log: Path) -> None:
        """The project's logs into ``log``, then everything it started removed (asserted)."""
        logs = self.compose("logs", "--no-color", check=False)
        log.write_text(logs.stdout + logs.stderr)
        left = self.stop()
        assert left == [], f"left by the project {self.project}: {left}"

    def stop(self) -> list[str]:
        """Remove everything the project started; returns what is left (nothing)."""
        self.compose("--profile", "cli", "down", "-v",
                     "--remove-orphans", "--timeout", "20", timeout=300, check=False)
        label = f"label=com.docker.compose.project={self.project}"
        left = []
        for kind in ("ps -a", "volume ls", "network ls"):
            proc = _docker(*kind.split(), "-q", "--filter", label, check=False)
            left += proc.stdout.split()
        return left


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from conftest import build_tiny_model, build_tiny_task, build_tiny_tokenizer

    if _docker("info", check=False, timeout=30).returncode != 0:
        pytest.fail("no Docker engine answers `docker info`: start dockerd (make deploy-test "
                    "needs one)")
    if _docker("image", "inspect", IMAGE, check=False).returncode != 0:
        pytest.fail(f"no image {IMAGE}: `make images` builds it from this checkout")
    root = tmp_path_factory.mktemp("containers")
    public = root / "public"
    build_tiny_model("llama", n_layers=3).save_pretrained(public / "tiny-llama")
    build_tiny_tokenizer().save_pretrained(public / "tiny-llama")
    task = build_tiny_task(public / "task")
    for path in [public, *public.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    (root / "project").mkdir()
    # the sites' policy accepts the public tiny model and task, releases masks in the clear
    # (the plain one-shot and personalized runs; require-secagg=false is the operators'
    # opt-out) and on the same windows in several runs (runs-per-input), and (research flag:
    # the tests compare a deployed run with the in-process one) draws its secrets from the
    # server's seeds
    stack = Stack(root / "project", public,
                  policy={"models": str(public / "tiny-llama"),
                          "corpora": f"wiki,strategyqa,{task}", "require-secagg": False,
                          "runs-per-input": 100, "research-reproducible-secrets": True})
    try:
        stack.start()
        yield stack
    finally:
        stack.close(root / "compose.log")


TINY_RUN = {"clients": SITES, "samples-per-client": 2, "seqlen": 16, "batch-size": 2,
            "eval-seqlen": 16, "eval-windows": 4, "device": "cpu", "baselines": ""}


def _host_node_configs(stack: Stack) -> list[dict]:
    """The sites' node configs with their data where the host has it (the in-process
    reference: the operations called in this process)."""
    return [stack.node_config(i, str(stack.root / "data" / f"site-{i}")) for i in range(SITES)]


def _same_model(reference, saved_dir: Path) -> None:
    from fedcompress.models import load_model

    saved = load_model(str(saved_dir), device="cpu").model
    pairs = zip(reference.state_dict().items(), saved.state_dict().items(), strict=True)
    for (key, a), (_, b) in pairs:
        assert torch.equal(a, b), key


@pytest.fixture(scope="module")
def oneshot(stack):
    settings = {**TINY_RUN, "model": str(stack.public / "tiny-llama")}
    return settings, *stack.run("oneshot", "fedprllm", settings)


def test_containerized_oneshot_equals_in_process(stack, oneshot):
    from test_deploy import _reference_model

    settings, record, log, seconds = oneshot
    assert record["status"] == "finished:completed", f"{record}\n{log[-4000:]}"
    report = json.loads((stack.root / "out" / "oneshot" / "report.json").read_text())
    assert report["status"] == "ok" and report["rejected"] == [], report["rejected"]
    fed = report["results"][0]
    assert fed["valid_clients"] == SITES and fed["rounds"] == 1
    assert sorted(c["node"] for c in report["clients"]) == sorted(stack.node_ids)
    # every site's ClientApp (its own container, a flwr-clientapp process per message) relayed
    # its messages to the site's agent (another container, another uid)
    split = {(r["node"], r["stage"]): r for r in report["client_startup"]}
    for node in stack.node_ids:
        r = split[(node, "masks")]
        assert r["startup_worker_seconds"] >= 0 and r["startup_runtime_seconds"] > 0, r
    reference = _reference_model(stack.public / "tiny-llama", {**settings, "out": "unused"},
                                 _host_node_configs(stack))
    _same_model(reference, stack.root / "out" / "oneshot" / "model")


def test_containerized_secagg_equals_in_process(stack, oneshot):
    from test_deploy import _reference_model

    settings = {**TINY_RUN, "model": str(stack.public / "tiny-llama"), "secagg": True}
    record, log, _ = stack.run("secagg", "fedprllm", settings)
    assert record["status"] == "finished:completed", f"{record}\n{log[-4000:]}"
    report = json.loads((stack.root / "out" / "secagg" / "report.json").read_text())
    assert report["rejected"] == [], report["rejected"]
    assert report["results"][0]["valid_clients"] == SITES
    assert report["secagg"]["sum"]["dropped"] == 0
    assert report["secagg"]["sum"]["authenticated"]
    reference = _reference_model(stack.public / "tiny-llama",
                                 {**settings, "secagg": False, "out": "unused"},
                                 _host_node_configs(stack))
    _same_model(reference, stack.root / "out" / "secagg" / "model")


def test_containerized_personalize_equals_in_process(stack, oneshot, tmp_path):
    from conftest import personalize_in_process, personalize_tiny_settings, same_personalize_result

    settings = personalize_tiny_settings(stack.public / "tiny-llama", "unused", clients=SITES)
    settings.pop("out")
    record, log, _ = stack.run("personalize", "personalize", settings)
    assert record["status"] == "finished:completed", f"{record}\n{log[-4000:]}"
    report = json.loads((stack.root / "out" / "personalize" / "report.json").read_text())
    assert report["rejected"] == [], report["rejected"]
    assert sorted(int(n) for n in report["classes"]["sites"]) == sorted(stack.node_ids)
    reference = personalize_in_process({**settings, "out": str(tmp_path / "reference")},
                                       _host_node_configs(stack))
    same_personalize_result(report, reference)


#: Run inside a container by its own user: its mount points (from /proc/self/mountinfo), which
#: of the given canaries any readable file under them holds, and what it can read of paths.
_INSIDE = r"""
import json, os, sys
canaries, probes = json.loads(sys.argv[1]), json.loads(sys.argv[2])
skip = ("/proc", "/sys", "/dev")
mounts = sorted({line.split()[4] for line in open("/proc/self/mountinfo")} - {"/"})
roots = [m for m in mounts if not m.startswith(skip)] + ["/tmp", "/runs", "/home"]
found, seen = {}, set()
for top in roots:
    for base, dirs, files in os.walk(top):
        for f in files:
            p = os.path.join(base, f)
            if p in seen or os.path.islink(p):
                continue
            seen.add(p)
            try:
                data = open(p, "rb").read(50_000_000)
            except OSError:
                continue
            for name, c in canaries.items():
                if c.encode() in data:
                    found.setdefault(name, []).append(p)
readable = {p: os.access(p, os.R_OK) for p in probes}
print(json.dumps({"uid": os.getuid(), "mounts": mounts, "found": found, "readable": readable}))
"""


def _inside(stack: Stack, service: str, canaries: dict, probes: list[str]) -> dict:
    proc = stack.compose("exec", "-T", service, "python", "-c", _INSIDE, json.dumps(canaries),
                         json.dumps(probes), timeout=600)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_container_reads_another_sites_data(stack, oneshot):
    """After a run (each site's corpus tokenized in its agent's cache): from inside every site's
    agent, only its own canary is in any readable file outside the image; from inside its
    SuperNode and its ClientApp container (the server's code) none is; each mounts its own
    volumes and public material only (the agent its data, key and config too); the SuperLink's
    container (the ServerApp and its outputs) holds no site's canary."""
    canaries = {f"site-{i}": c for i, c in stack.canaries.items()}
    public_mounts = {"/certs/ca.crt", *(f"/peers/agent-{j}.pub" for j in range(SITES)),
                     str(stack.public), "/etc/hosts", "/etc/hostname", "/etc/resolv.conf"}
    own = {"agent": {"/data", "/keys/agent", "/site/agent.toml", "/home/app/.cache/fedcompress",
                     "/home/app/state", "/agent"},
           "supernode": {"/keys/supernode", "/home/app/.flwr"},
           "clientapp": {"/agent", "/home/app"}}
    services = [f"{kind}-{i}" for i in range(SITES) for kind in own]
    mounts = {service: stack.mounts(service) for service in ["superlink", *services]}
    for service in services:
        kind, i = service.rsplit("-", 1)[0], int(service[-1])
        seen = _inside(stack, service, canaries, ["/data/train.jsonl"])
        assert seen["uid"] == (APP_UID if kind == "clientapp" else SITE_UID) + i, seen
        expected = {f"site-{i}"} if kind == "agent" else set()
        assert set(seen["found"]) == expected, (service, seen["found"])
        assert seen["readable"]["/data/train.jsonl"] == (kind == "agent"), seen
        extra = {m for m in seen["mounts"] if not m.startswith(("/proc", "/sys", "/dev"))}
        assert extra <= own[kind] | public_mounts, (service, extra - own[kind] - public_mounts)
        # the named volumes it mounts are its own site's (by name) and nobody else's
        volumes = {m["Name"] for m in mounts[service] if m["Type"] == "volume"}
        assert volumes and all(v.startswith(f"{stack.project}_site-{i}-") for v in volumes), \
            volumes
        if kind == "clientapp":
            assert volumes == {f"{stack.project}_site-{i}-agent"}, volumes
    link = _inside(stack, "superlink", canaries, [])
    assert link["uid"] == SUPERLINK_UID and link["found"] == {}, link["found"]
    assert "/data" not in link["mounts"], link["mounts"]
    # and the other way round: a site's own volumes are mounted by its containers only
    for service, mounted in mounts.items():
        for m in mounted:
            if m["Type"] == "volume" and "_site-" in m["Name"]:
                owner = re.search(r"_site-(\d)-", m["Name"]).group(1)
                assert service.endswith(owner) and service != "superlink", (service, m["Name"])
