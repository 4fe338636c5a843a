"""The deployment of docker/compose.yml in real containers (``make deploy-test``; skipped by
``make test``, which runs the same deployment as processes on loopback in tests/test_deploy.py).

What it starts, from the CPU image of this checkout (``make images``) and the compose file as
shipped (a small override adds only what a test needs, listed below), as a Compose project of
its own (``fedcompress-test-<random>``) in a temporary project folder:

* the SuperLink (uid 50000) with TLS (``docker/make_certs.py``'s CA, certificate and key) and
  SuperNode authentication, its own volumes;
* three SuperNodes, one per site, each under its own uid (5010I) with its own private key,
  its own data (a bind mount of the site's folder, mode 0700, owned by the site's uid) and its
  own named volumes (Flower home, cache with the tokenized corpus, ledger, worker socket);
  sites 1 and 2 hand their messages to their own warm site worker (``site-worker-I``, the
  compose file's ``site-worker`` profile), site 0 starts a ClientApp process per message;
* the ``cli`` container (the operator) for ``flwr supernode register`` and ``flwr run``.

The override (``compose.test.yml``, written by :class:`Stack`): a read-only bind mount of public
material (the tiny test model and task, at the same absolute path as on the host, so that the
in-process reference runs on the very same paths), each site's policy in its node config (the
models and corpora it accepts, ``research-reproducible-secrets`` so that the deployed run can be
compared with the in-process one) and no host port (the project's network only).

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
#: sites whose SuperNode hands its messages to its warm site worker (the compose file's
#: ``site-worker`` profile); site 0 keeps the fat path (a ClientApp process per message)
WORKER_SITES = (1, 2)
SITE_UID = 50100
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
                 workers: tuple[int, ...] = WORKER_SITES, documents: list[str] | None = None):
        """``public``: a folder of public material every container mounts read only at the
        same path (or none); ``policy``: node-config keys added to every site's (the models and
        corpora it accepts, ...); ``workers``: the sites with a warm site worker;
        ``documents``: JSONL lines of each site's train split (default: the first 20 wiki
        documents), to which a canary line of the site's own is added."""
        from test_deploy import WIKI, _make_certs

        self.root = root
        self.project = f"fedcompress-test-{secrets.token_hex(4)}"
        self.public, self.policy, self.workers = public, dict(policy or {}), tuple(workers)
        shutil.copy(REPO / "docker" / "compose.yml", root / "compose.yml")
        shutil.copy(REPO / "docker" / "flwr-config.toml", root / "flwr-config.toml")
        made = _make_certs().create(root / "certs", SITES, [])
        os.chown(made["key"], SUPERLINK_UID, SUPERLINK_UID)
        for i, (private, _) in enumerate(made["node_keys"]):
            os.chown(private, SITE_UID + i, SITE_UID + i)
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
        self.write_override()

    # -- the override ------------------------------------------------------------------------
    def node_config(self, i: int, data_path: str = "/data") -> dict:
        """Site ``i``'s node config: compose.yml's, plus the stack's ``policy`` and, for a site
        with a worker, its socket."""
        config = {"partition-id": i, "num-partitions": SITES, "data-path": data_path,
                  "state-dir": "/home/app/state", "secagg-key": "/keys/supernode",
                  "secagg-peers": "/peers", **self.policy}
        if i in self.workers:
            config["site-worker"] = "/home/app/worker/site.sock"
        return config

    def write_override(self) -> None:
        import yaml

        base = yaml.safe_load((self.root / "compose.yml").read_text())["services"]
        lines = ["services:"]
        for name, service in base.items():
            if name.endswith("-init"):
                continue
            lines.append(f"  {name}:")
            if self.public is not None:
                public = f"{self.public}:{self.public}:ro"
                lines += ["    volumes:", f"      - {_yaml_string(public)}"]
            if name == "superlink":
                lines.append("    ports: !reset []")
            match = re.fullmatch(r"supernode-(\d)", name)
            if match:
                i = int(match.group(1))
                node_config = " ".join(f"{k}={json.dumps(v)}"
                                       for k, v in self.node_config(i).items())
                command = [a for a in service["command"] if not a.startswith("--node-config")]
                lines.append("    command:")
                lines += [f"      - {_yaml_string(a)}"
                          for a in [*command, f"--node-config={node_config}"]]
        (self.root / "compose.test.yml").write_text("\n".join(lines) + "\n")

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
        if self.workers:
            self.compose("--profile", "site-worker", "up", "-d", "--pull", "never",
                         *(f"site-worker-{i}" for i in self.workers), timeout=STARTUP_TIMEOUT)
        self.compose("up", "-d", "--pull", "never",
                     *(f"supernode-{i}" for i in range(SITES)), timeout=STARTUP_TIMEOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            nodes = json.loads(self.flwr("supernode", "ls", "--format", "json").stdout)["nodes"]
            online = sorted(int(n["node-id"]) for n in nodes if n["status"] == "online")
            if online == sorted(self.node_ids):
                return
            assert time.monotonic() < deadline, (nodes, self.compose("logs").stdout[-5000:])
            time.sleep(2)

    def run(self, name: str, method: str, settings: dict) -> tuple[dict, str, float]:
        """``flwr run /app`` from the operator's container with ``method`` and its
        ``settings`` (the run's output in the SuperLink's ``/runs/NAME``), copied out to
        ``ROOT/out/NAME``; returns the SuperLink's record of the run, its log, its seconds."""
        import tomli_w

        table = {k.replace("_", "-"): v for k, v in
                 {**settings, "out": f"/runs/{name}"}.items()}
        (self.root / "runs" / f"{name}.toml").write_text(
            tomli_w.dumps({"method": method, method: table}))
        started = time.perf_counter()
        proc = self.flwr("run", "/app", "docker", "--run-config", f"/run-config/{name}.toml",
                         "--stream", timeout=RUN_TIMEOUT)
        seconds = time.perf_counter() - started
        log = proc.stdout + proc.stderr
        run_id = re.search(r"started run (\d+)", log)
        assert run_id, log[-4000:]
        ls = self.flwr("ls", "--run-id", run_id.group(1), "--format", "json")
        record = json.loads(ls.stdout[ls.stdout.index("{"):])["runs"][0]
        out = self.root / "out"
        out.mkdir(exist_ok=True)
        self.compose("cp", f"superlink:/runs/{name}", str(out / name))
        return record, log, seconds

    def stop(self) -> list[str]:
        """Remove everything the project started; returns what is left (nothing)."""
        self.compose("--profile", "site-worker", "--profile", "cli", "down", "-v",
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
        logs = stack.compose("--profile", "site-worker", "logs", "--no-color", check=False)
        (root / "compose.log").write_text(logs.stdout + logs.stderr)
        left = stack.stop()
        assert left == [], f"left by the project {stack.project}: {left}"


TINY_RUN = {"clients": SITES, "samples-per-client": 2, "seqlen": 16, "batch-size": 2,
            "eval-seqlen": 16, "eval-windows": 4, "device": "cpu", "baselines": ""}


def _host_node_configs(stack: Stack) -> list[dict]:
    """The sites' node configs with their data where the host has it, and no site worker (the
    in-process reference: the ClientApp's handlers called in this process)."""
    configs = [stack.node_config(i, str(stack.root / "data" / f"site-{i}"))
               for i in range(SITES)]
    return [{k: v for k, v in c.items() if k != "site-worker"} for c in configs]


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
    # site 0 ran each message in its own flwr-clientapp process; sites 1 and 2 in their warm
    # workers (another container, same uid and volumes)
    split = {(r["node"], r["stage"]): r for r in report["client_startup"]}
    for i, node in enumerate(stack.node_ids):
        r = split[(node, "masks")]
        if i in stack.workers:
            assert r["startup_worker_seconds"] >= 0, r
        else:
            assert r["startup_import_seconds"] > 0 and r["startup_load_seconds"] > 0, r
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
    """After a run (each site's corpus tokenized in its own cache): from inside every site's
    SuperNode and worker, only its own canary is in any readable file outside the image, its
    mounts are its own volumes, its data, its key and public material; the SuperLink's
    container (the ServerApp and its outputs) holds no site's canary."""
    canaries = {f"site-{i}": c for i, c in stack.canaries.items()}
    public_mounts = {"/certs/ca.crt", "/peers/supernode-0.pub", "/peers/supernode-1.pub",
                     "/peers/supernode-2.pub", str(stack.public), "/etc/hosts",
                     "/etc/hostname", "/etc/resolv.conf"}
    own = {"/data", "/keys/supernode", "/home/app/.flwr", "/home/app/.cache/fedcompress",
           "/home/app/state", "/home/app/worker"}
    services = [f"supernode-{i}" for i in range(SITES)] + [f"site-worker-{i}"
                                                           for i in stack.workers]
    mounts = {service: stack.mounts(service) for service in ["superlink", *services]}
    for service in services:
        i = int(service[-1])
        seen = _inside(stack, service, canaries, ["/data/train.jsonl"])
        assert seen["uid"] == SITE_UID + i, seen
        assert set(seen["found"]) == {f"site-{i}"}, (service, seen["found"])
        assert seen["readable"]["/data/train.jsonl"], seen
        extra = {m for m in seen["mounts"] if not m.startswith(("/proc", "/sys", "/dev"))}
        assert extra <= own | public_mounts, (service, extra - own - public_mounts)
        # the named volumes it mounts are its own (by name) and nobody else's
        volumes = {m["Name"] for m in mounts[service] if m["Type"] == "volume"}
        assert volumes and all(v.startswith(f"{stack.project}_site-{i}-") for v in volumes), \
            volumes
    link = _inside(stack, "superlink", canaries, [])
    assert link["uid"] == SUPERLINK_UID and link["found"] == {}, link["found"]
    assert "/data" not in link["mounts"], link["mounts"]
    # and the other way round: a site's own volumes are mounted by its containers only
    for service, mounted in mounts.items():
        for m in mounted:
            if m["Type"] == "volume" and "_site-" in m["Name"]:
                owner = re.search(r"_site-(\d)-", m["Name"]).group(1)
                assert service.endswith(owner) and service != "superlink", (service, m["Name"])
