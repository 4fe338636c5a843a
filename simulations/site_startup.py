"""Per-message start-up of a site on the loopback deployment: import, load, compute.

    nice -n 10 python simulations/site_startup.py --out simulations/results/site-startup/after

Flower 1.42 starts a fresh ``flwr-clientapp`` process for every message a SuperNode receives,
so a site pays the Python start-up, its imports (torch, transformers), the model load and the
calibration windows again for every message. This script deploys FedPrLLM on the embedded
model as ``tests/test_deploy.py`` does (its ``Deployment`` and ``Processes``): one
``flower-superlink`` with TLS and SuperNode authentication, three registered
``flower-supernode`` processes on loopback, each site with its own data file (``--site-docs``
documents of the bundled wiki train split) and its own ``FLWR_HOME``; one site cache
(``FEDCOMPRESS_CACHE``) whose converted model is prepared once before the runs. It then runs
``--runs`` one-shot runs one after the other (per site: the warm-up query, then its masks) and
watches every ``flwr-clientapp`` process the SuperNodes start (``/proc``, every ``--poll``
seconds; the site from the process's session).

Per message (site x run x message) it reports:

* ``process_seconds``: the ``flwr-clientapp`` process's wall time, creation to exit (what the
  message costs the site; +- one poll interval);
* ``compute_seconds``: the handler's own work (from the reply's metrics: ``compute_seconds``;
  a ClientApp that does not report it: the masks reply's ``seconds``, 0 for the warm-up);
* ``startup_seconds`` = process - compute: everything else the message pays (Python, Flower's
  runtime, imports, model, windows, pushing the reply, exiting);
* when the ClientApp reports them: ``startup_runtime_seconds`` (process start to the
  ClientApp module: the interpreter, Flower's imports, pulling the message and the FAB),
  ``startup_import_seconds``, ``startup_load_seconds`` (model + windows) and
  ``client_startup_seconds`` (import + load).

Run 1 is cold (a new app install: Python compiles the FAB's modules; an empty site cache of
windows); the summary gives run 1 and the later (warm) runs apart. The three sites start their
processes at the same time on this 2-core machine, as in a real round.

Then, the deployment stopped, ``--alone`` warm-up messages of one site, each in a fresh process
on the same site cache and data with nothing else of the deployment running: the imports a
``flwr-clientapp`` process has made before the ClientApp (``startup_runtime_seconds`` here:
Flower's imports only), the ClientApp module, the warm-up through ``app`` (the split from its
reply when the code reports one, and its ``seconds``: the warm-up's loading, what
``client_startup_seconds`` meant before the split); ``startup_seconds`` is their sum. Writes
``report.json`` and ``report.md``; ``--before DIR`` adds the summary of an earlier report (the
same script run on the code before a change) side by side.

Without an agent, a site runs in ``site-mode="development"`` (a deployed site refuses to run
the operations in the SuperNode's process): a process per message. ``--site-agent`` measures
the same with the site agent too (``fedcompress site-agent``, ``clients/site_agent.py``,
started from the measured checkout on the sites' cache): one per site, its config the site's
node config, the SuperNode's node config naming only its socket. The runs alternate without /
with it (the SuperNodes restarted between, each keeping its key, data and installed app), and
so do the alone messages (an agent of their own; its first message, which loads the model, is
reported apart). The agent's rows are labelled ``agent: ...``; ``startup_worker_seconds`` (the
name is the retired site worker's) is the relay's exchange with the agent less the agent's
operation.

    python simulations/site_startup.py --site-agent --runs 4 \
        --out simulations/results/site-startup/agent

(The earlier results in ``site-startup/worker`` and ``site-startup/agent`` also measured the
retired site worker, ``--site-worker``, which this script had until that worker was removed;
their reports name the commit that measured them.)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fedcompress.report import RunReport, markdown_table

logger = logging.getLogger("site_startup")
REPO = Path(__file__).resolve().parents[1]
KINDS = ("warmup", "masks")  # the messages of a one-shot run, in the order a site gets them
SPLIT = ("startup_runtime_seconds", "startup_import_seconds", "startup_load_seconds",
         "client_startup_seconds", "startup_worker_seconds")
#: a process per message (``site-mode="development"``), the site agent (clients/site_agent.py)
MODES = ("fat", "agent")
#: the modes an earlier report may hold (``--before``): the retired site worker's too
REPORT_MODES = ("fat", "worker", "agent")


def _deploy_module():
    """``tests/test_deploy.py`` (its Deployment and Processes), with a longer run timeout."""
    sys.path.insert(0, str(REPO / "tests"))
    import test_deploy

    test_deploy.RUN_TIMEOUT = 1200.0  # a real model on a busy 2-core machine
    # and its `flwr ls` (60 s there), which a machine at load 10+ can exceed
    test_deploy.Deployment.flwr.__kwdefaults__ = {"timeout": 300.0}
    test_deploy.STARTUP_TIMEOUT = 600.0  # a SuperLink's start-up took over 90 s at load 9
    return test_deploy


class ClientAppWatcher:
    """Every ``flwr-clientapp`` process in the given sessions: its start (the kernel's) and end
    (the first poll that finds it gone or a zombie). Reads ``/proc`` only (cheap polls)."""

    def __init__(self, sessions: dict[int, int], poll: float):
        self.sessions = sessions  # session id (a SuperNode's pid) -> site
        self.poll = poll
        self.seen: dict[int, dict] = {}
        self.ignored: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _stat(pid: int) -> list[str] | None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                text = f.read()
        except OSError:
            return None
        return text[text.rindex(")") + 2:].split()  # fields from the state (field 3) on

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            now = time.time()
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) in self.seen or int(name) in self.ignored:
                    continue
                pid = int(name)
                try:
                    sid = os.getsid(pid)
                    with open(f"/proc/{pid}/comm") as f:
                        comm = f.read().strip()
                except OSError:
                    continue
                if sid not in self.sessions:
                    self.ignored.add(pid)
                    continue
                if comm != "flwr-clientapp":  # maybe forked, not yet exec'd: look again
                    continue
                stat = self._stat(pid)
                try:
                    with open(f"/proc/{stat[1] if stat else 0}/comm") as f:
                        parent = f.read().strip()
                except OSError:
                    parent = ""
                if parent == "flwr-clientapp":  # a helper it forked (ldconfig, ...): no message
                    self.ignored.add(pid)
                    continue
                try:
                    created = psutil.Process(pid).create_time()
                except psutil.Error:
                    created = now
                self.seen[pid] = {"pid": pid, "site": self.sessions[sid], "start": created,
                                  "end": None}
            for record in self.seen.values():
                if record["end"] is None:
                    stat = self._stat(record["pid"])
                    if stat is None or stat[0] in "ZX":
                        record["end"] = now
            self._stop.wait(self.poll)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> list[dict]:
        return sorted((r for r in self.seen.values() if start <= r["start"] <= end),
                      key=lambda r: r["start"])


# One site's warm-up message in a fresh process with no deployment around it (`--alone`): the
# imports a flwr-clientapp process has made before the ClientApp, the ClientApp module, then the
# warm-up query (read with Flower's serde, as a flwr-clientapp process receives it) through
# `app` (what Flower calls), in this process or relayed to a site agent; run in the measured
# checkout (cwd).
ALONE = r"""
import json, os, sys, time
t0 = time.perf_counter()
import flwr.cli.install, flwr.clientapp.utils, flwr.supernode.runtime.run_clientapp
t1 = time.perf_counter()
import clients.app
t2 = time.perf_counter()
from flwr.app import Context, RecordDict
from flwr.common.serde import message_from_proto
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.supercore.task_identity import TaskIdentity

message_file, data, sites, agent = sys.argv[1:5]
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
if agent:  # the relay: the agent's socket is all this process knows of the site
    node_config = {"site-agent": agent}
else:  # no agent: the operations in this process, as a test bench's SuperNode runs them
    # (the site's own state folder, its privacy ledger, beside its data; the plain one-shot
    # vote is what is timed, many times on the same windows)
    node_config = {"partition-id": 0, "data-path": data, "num-partitions": int(sites),
                   "state-dir": os.path.join(os.path.dirname(os.path.abspath(data)), "state"),
                   "require-secagg": False, "runs-per-input": 1000,
                   "site-mode": "development"}
context = Context(run_id=1, node_id=100, node_config=node_config, state=RecordDict(),
                  run_config={}, series_id=0)
with open(message_file, "rb") as f:
    message = message_from_proto(ProtoMessage.FromString(f.read()))
t3 = time.perf_counter()
reply = clients.app.app(message, context)
t4 = time.perf_counter()
print(json.dumps({"flower_import_seconds": t1 - t0, "app_import_seconds": t2 - t1,
                  "warmup_handler_seconds": t4 - t3, "app": clients.app.__file__,
                  "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules),
                  "metrics": dict(reply.content["metrics"])}))
"""


def _warmup_message(opts: argparse.Namespace, clients: int, path: Path) -> None:
    """The warm-up query of one-shot FedPrLLM with the run's settings, as Flower's protobuf."""
    from flwr.app import Message, RecordDict
    from flwr.common.serde import message_to_proto
    from flwr.supercore.task_identity import TaskIdentity

    from fedcompress.methods.fedprllm.config import FedPrLLMConfig
    from strategies.common import settings_record

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    config = FedPrLLMConfig(model=opts.model, clients=clients,
                            samples_per_client=opts.samples_per_client, seqlen=opts.seqlen,
                            batch_size=4)
    message = Message(RecordDict({"config": settings_record(config)}), 100, "query.warmup")
    path.write_bytes(message_to_proto(message).SerializeToString())


def _alone(i: int, opts: argparse.Namespace, data: Path, cache: Path, clients: int,
           message: Path, agent: Path | None = None, name: str = "") -> dict:
    """One site's warm-up message alone in a fresh process (:data:`ALONE`), relayed to the
    site agent at ``agent`` if given."""
    env = {**os.environ, "FEDCOMPRESS_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", ALONE, str(message), str(data), str(clients),
                          str(agent or "")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"alone {i}: {out.stderr[-3000:]}")
    found = json.loads(out.stdout.strip().splitlines()[-1])
    metrics = found.pop("metrics")
    heavy = found.pop("heavy")
    if not Path(found.pop("app")).is_relative_to(REPO):
        raise RuntimeError(f"alone {i}: the ClientApp came from outside {REPO}")
    if agent and heavy:
        raise RuntimeError(f"alone {i}: the relay imported {heavy}")
    mode = "agent" if agent else "fat"
    record = {"name": name or f"alone {mode} {i}", "run": i, "message": "alone", "mode": mode,
              **found, "startup_seconds": sum(found.values()),
              "startup_runtime_seconds": found["flower_import_seconds"],
              "compute_seconds": float(metrics["compute_seconds"]),
              "warmup_setup_seconds": float(metrics["seconds"])}
    for key in SPLIT:
        if key in metrics:
            record[key] = float(metrics[key])
    return record


def _git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    return out.stdout.strip()


def _prepare_cache(cache: Path, model: str) -> None:
    """The embedded model converted once (in this user's cache) and linked into the sites'
    cache, so that no message pays the one-off conversion."""
    from fedcompress.models import embedded_model_dir

    source, _ = embedded_model_dir(model)
    (cache / "models").mkdir(parents=True, exist_ok=True)
    link = cache / "models" / source.name
    if not link.exists():
        link.symlink_to(source, target_is_directory=True)


def _site_metrics(report: dict, node_ids: list[int]) -> dict[tuple[int, str], dict]:
    """(site, message kind) -> the metrics its reply carried, from a run's report.json: the
    masks round's ``clients`` records; the warm-up's split records (``client_startup``) or,
    from a ClientApp that did not report them, its ``client_startup_seconds`` (node order)."""
    site_of = {node: i for i, node in enumerate(node_ids)}
    out: dict[tuple[int, str], dict] = {}
    for record in report.get("clients", []):
        out[(site_of[record["node"]], "masks")] = record
    split = [r for r in report.get("client_startup", []) if r.get("stage") == "warmup"]
    if split:
        for record in split:
            out[(site_of[record["node"]], "warmup")] = record
    else:  # the warm-up's seconds of loading, one per valid node in node order
        for node, seconds in zip(sorted(node_ids), report.get("client_startup_seconds", [])):
            out[(site_of[node], "warmup")] = {"seconds": seconds}
    return out


def _message_record(run: int, kind: str, proc: dict, metrics: dict, mode: str = "fat") -> dict:
    process = (proc["end"] or proc["start"]) - proc["start"]
    if "compute_seconds" in metrics:
        compute = float(metrics["compute_seconds"])
    else:  # a ClientApp without the split: the masks' own seconds; the warm-up does no work
        compute = float(metrics.get("seconds", 0.0)) if kind == "masks" else 0.0
    record = {"name": f"run {run} site {proc['site']} {kind}"
              + ("" if mode == "fat" else f" ({mode})"), "run": run, "mode": mode,
              "site": proc["site"], "message": kind, "pid": proc["pid"],
              "process_seconds": process, "compute_seconds": compute,
              "startup_seconds": process - compute}
    for key in SPLIT:
        if key in metrics:
            record[key] = float(metrics[key])
    if kind == "warmup" and "compute_seconds" not in metrics and "seconds" in metrics:
        # the former client_startup_seconds: the warm-up's model load and windows, without the
        # imports done when the ClientApp module loaded
        record["warmup_setup_seconds"] = float(metrics["seconds"])
    return record


def wait_for(procs, name: str, text: str, timeout: float = 600.0) -> None:
    """Until ``text`` is in the log of the process ``name`` (which must stay alive)."""
    deadline = time.monotonic() + timeout
    while text not in procs.log(name):
        proc = procs.roots[name]
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} (exit {proc.poll()}): no {text!r}:\n"
                               f"{procs.log(name)[-3000:]}")
        time.sleep(0.3)


def _load(report, phase: str) -> None:
    """The load average (1, 5, 15 min) after ``phase``: the machine is shared."""
    report.extra.setdefault("load_average", []).append(
        {"phase": phase, "load": [round(x, 2) for x in os.getloadavg()]})


class Sites:
    """The deployment's SuperNodes, without (``fat``) or with a site agent each (``agent``:
    only ``site-agent`` in its node config): :meth:`use` restarts them in the other mode, each
    site keeping its key, data and FLWR_HOME (its installed app)."""

    def __init__(self, deploy, dep, procs):
        self.deploy, self.dep, self.procs = deploy, dep, procs
        self.mode: str | None = None
        self.names: list[str] = []
        self.restarts = 0
        self.agents: dict[int, Path] = {}

    def start_agents(self) -> None:
        """One ``fedcompress site-agent`` per site: its config the site's node config and its
        socket (mode 0600, a folder of its own), on the sites' cache (stopped by PID with the
        deployment)."""
        for i in range(len(self.dep.sites)):
            config = self.dep.agent_config(i)  # tests/test_deploy.py's: socket in run/
            self.agents[i] = config.parent / "run" / "agent.sock"
            self.procs.start(self.dep.proc_name(f"agent-{i}"), [
                sys.executable, "-m", "fedcompress.cli", "site-agent", "--config", str(config)],
                self.dep.env(f"supernode-{i}"), cwd=REPO)
        for i in self.agents:
            wait_for(self.procs, self.dep.proc_name(f"agent-{i}"), "site agent ready")

    def agent_pid(self, i: int) -> int:
        return self.procs.roots[self.dep.proc_name(f"agent-{i}")].pid

    def agent_logs(self) -> dict[int, list[str]]:
        """Each agent's log lines of the messages it served."""
        return {i: [line for line in self.dep.log(f"agent-{i}").splitlines()
                    if "message" in line] for i in self.agents}

    def use(self, mode: str) -> dict[int, int]:
        """The SuperNodes in ``mode`` (restarted if they are not); their sessions -> site."""
        if mode != self.mode:
            for name in self.names:
                self.procs.stop(self.dep.proc_name(name))
            self.restarts += self.mode is not None
            self.names = [f"supernode-{i}-{mode}-{self.restarts}"
                          for i in range(len(self.dep.sites))]
            for i, name in enumerate(self.names):
                config = ({"site-agent": str(self.agents[i])} if mode == "agent" else
                          {**self.dep.node_config(i), "site-mode": "development"})
                private, _ = self.dep.made["node_keys"][i]
                self.procs.start(self.dep.proc_name(name), [
                    str(self.deploy.BIN / "flower-supernode"),
                    "--superlink", self.dep.address,
                    "--root-certificates", str(self.dep.made["ca"]),
                    "--auth-supernode-private-key", str(private),
                    "--node-config", " ".join(f"{k}={json.dumps(v)}" for k, v in config.items()),
                    "--port", str(self.deploy.free_port())], self.dep.env(f"supernode-{i}"))
            for name in self.names:
                wait_for(self.procs, self.dep.proc_name(name), "SuperNode ID:")
            self.procs.track()
            self.mode = mode
        return {self.procs.roots[self.dep.proc_name(name)].pid: i
                for i, name in enumerate(self.names)}


def _deployed_run(report, dep, watcher, sites: Sites, settings: dict, run: int, mode: str,
                  out: Path, poll: float) -> None:
    """One one-shot run on the deployment; one record per site and message, from the watched
    flwr-clientapp processes and the replies' metrics."""
    start = time.time()
    with report.phase(f"run {run} {mode}"):
        record, log = dep.run({**settings, "out": str(out)})
    time.sleep(3 * poll)  # the last processes' exits
    if record["status"] != "finished:completed":
        raise RuntimeError(f"run {run} {mode}: {record}\n{log[-3000:]}")
    run_report = json.loads((out / "report.json").read_text())
    metrics = _site_metrics(run_report, dep.node_ids)
    found = watcher.between(start, time.time())
    mine_now = []
    for site in range(len(dep.sites)):
        mine = [p for p in found if p["site"] == site]
        if len(mine) != len(KINDS):
            # e.g. a starved process missed Flower's task heartbeats (2 x 30 s): its token was
            # revoked and the SuperNode started another one; its messages are not attributable
            logger.warning("run %d %s site %d: %d flwr-clientapp processes for %d messages: "
                           "not recorded", run, mode, site, len(mine), len(KINDS))
            report.extra.setdefault("unattributed", []).append(
                {"run": run, "mode": mode, "site": site, "processes": len(mine)})
            continue
        for kind, proc in zip(KINDS, mine):
            mine_now.append(_message_record(run, kind, proc, metrics.get((site, kind), {}),
                                            mode))
    # who computed the masks: the site's own flwr-clientapp process, or its agent
    masks_pids = {m["pid"] for m in run_report.get("clients", []) if "pid" in m}
    expected = ({r["pid"] for r in mine_now if r["message"] == "masks"} if mode == "fat" else
                {sites.agent_pid(i) for i in range(len(dep.sites))})
    if masks_pids and masks_pids != expected and not report.extra.get("unattributed"):
        raise RuntimeError(f"run {run} {mode}: the masks replies came from {masks_pids}, "
                           f"expected {expected}")
    for r in mine_now:
        report.add_result(r)
    _load(report, f"run {run} {mode}")
    logger.info("run %d %s: %s", run, mode, ", ".join(
        f"{r['name']}: {r['startup_seconds']:.2f}+{r['compute_seconds']:.2f} s"
        for r in mine_now))


COLUMNS = ("process_seconds", "compute_seconds", "startup_seconds", *SPLIT,
           "warmup_setup_seconds")


def summarize(results: list[dict]) -> dict:
    """Per mode (a process per message, a site agent; an earlier report's site worker), message
    kind, cold (run 1) and warm (later runs), and the warm-ups alone: mean, min, max of each
    column. An agent's rows are labelled ``agent: ...`` (results without a mode: ``fat``)."""
    groups = [(f"{phase} {kind}", kind, first) for phase, first in (("cold", True), ("warm", False))
              for kind in KINDS]
    groups += [("alone warmup", "alone", None),
               ("alone warmup, the agent's first message", "alone first", None)]
    out: dict = {}
    for mode in REPORT_MODES:
        for label, kind, first in groups:
            rows = [r for r in results if r["message"] == kind and r.get("mode", "fat") == mode
                    and (first is None or (r["run"] == 1) == first)]
            if rows:
                out[label if mode == "fat" else f"{mode}: {label}"] = {
                    "messages": len(rows),
                    **{col: {"mean": statistics.mean(v), "min": min(v), "max": max(v)}
                       for col in COLUMNS if (v := [r[col] for r in rows if col in r])}}
    return out


def summary_table(summary: dict, label: str = "") -> list[list[str]]:
    rows = []
    for key, cols in summary.items():
        cells = []
        for col in COLUMNS:
            c = cols.get(col)
            cells.append("-" if c is None else
                         f"{c['mean']:.2f} ({c['min']:.2f}-{c['max']:.2f})")
        rows.append([label, key, str(cols["messages"]), *cells])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="simulations/results/site-startup")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--runs", type=int, default=3, help="One-shot runs, one after another.")
    parser.add_argument("--site-docs", type=int, default=0,
                        help="Documents of the bundled wiki train split in each site's data "
                             "file (0: all of them).")
    parser.add_argument("--samples-per-client", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--alone", type=int, default=3,
                        help="Then this many warm-up messages of one site, each in a fresh "
                             "process with nothing else of the deployment running.")
    parser.add_argument("--site-agent", action="store_true",
                        help="Measure with a site agent per site too (fedcompress site-agent, "
                             "the SuperNode's node config naming only its socket): the runs "
                             "and the alone messages alternate without / with it.")
    parser.add_argument("--poll", type=float, default=0.05,
                        help="Seconds between two looks at the sites' processes.")
    parser.add_argument("--before", default="",
                        help="report.json (or its folder) of the same script on earlier code: "
                             "its summary is shown beside this one.")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    deploy = _deploy_module()
    # (the script's path inside its checkout: the same command in a worktree of other code)
    report = RunReport.for_script(Path(__file__).resolve().relative_to(REPO), opts)
    report.extra["measured_code"] = {
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no"))}
    report.extra["load_average_before"] = [round(x, 2) for x in os.getloadavg()]
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"site-startup-{os.getpid()}"
    work.mkdir(parents=True)
    procs = deploy.Processes(work)
    dep = deploy.Deployment("bench", work, procs)
    # the sites' policy accepts the measured model and the plain one-shot vote's clear masks,
    # many runs on the same windows
    dep.policy = {"models": opts.model, "require-secagg": False, "runs-per-input": 1000}
    watcher = None
    pool = ThreadPoolExecutor(4)
    with report:
        try:
            _prepare_cache(work / "bench" / "cache", opts.model)
            docs = deploy.WIKI.read_text().splitlines(keepends=True)
            docs = docs[:opts.site_docs] if opts.site_docs else docs
            for site in dep.sites:
                site.parent.mkdir(parents=True)
                site.write_text("".join(docs))
            report.extra["site_data"] = {"documents": len(docs),
                                         "bytes": dep.sites[0].stat().st_size}
            dep.start_superlink()
            dep.wait_superlink()
            dep.node_ids = [f.result() for f in dep.register(pool)]
            modes = [m for m, on in zip(MODES, (True, opts.site_agent)) if on]
            sites = Sites(deploy, dep, procs)
            if opts.site_agent:
                sites.start_agents()
            watcher = ClientAppWatcher({}, opts.poll)
            watcher.start()
            settings = {"model": opts.model, "clients": deploy.CLIENTS,
                        "samples-per-client": opts.samples_per_client, "seqlen": opts.seqlen,
                        "batch-size": 4, "eval-seqlen": opts.seqlen, "eval-windows": 2,
                        "device": "cpu", "baselines": "", "save-model": False}
            report.extra["run_settings"] = settings
            for run in range(1, opts.runs + 1):
                for mode in modes:  # interleaved: a change of load hits both alike
                    watcher.sessions.update(sites.use(mode))
                    _deployed_run(report, dep, watcher, sites, settings, run, mode,
                                  work / f"run-{run}-{mode}", opts.poll)
            report.extra["site_agents"] = sites.agent_logs()
        finally:
            if watcher is not None:
                watcher.stop()
            left = procs.stop_all()
            pool.shutdown(wait=True, cancel_futures=True)
            report.extra["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
            if left:
                logger.error("processes left running: %s", [p.pid for p in left])
        # The deployment stopped: one site's warm-up alone in fresh processes, without and
        # (--site-agent) with site 0's agent, interleaved.
        message, cache = work / "warmup.bin", work / "bench" / "cache"
        _warmup_message(opts, deploy.CLIENTS, message)
        alone_procs = deploy.Processes(work)
        agent = None
        try:
            if opts.site_agent and opts.alone:
                config = dep.root / "site-0" / "agent" / "agent.toml"  # site 0's, as deployed
                agent = config.parent / "run" / "agent.sock"
                alone_procs.start("alone-agent", [
                    sys.executable, "-m", "fedcompress.cli", "site-agent", "--config",
                    str(config)], {**os.environ, "FEDCOMPRESS_CACHE": str(cache),
                                   **deploy.OFFLINE}, cwd=REPO)
                wait_for(alone_procs, "alone-agent", "site agent ready")
                with report.phase("alone agent first"):  # the agent loads the model
                    report.add_result({**_alone(0, opts, dep.sites[0], cache, deploy.CLIENTS,
                                                message, agent, "alone agent first"),
                                       "message": "alone first"})
            for i in range(1, opts.alone + 1):
                for path in (None, agent) if agent is not None else (None,):
                    with report.phase("alone"):
                        report.add_result(_alone(i, opts, dep.sites[0], cache,
                                                 deploy.CLIENTS, message, path))
                    _load(report, f"alone {i} {'agent' if path else 'fat'}")
        finally:
            left = alone_procs.stop_all()
            if left:
                logger.error("processes left running: %s", [p.pid for p in left])
        shutil.rmtree(work, ignore_errors=True)  # kept when the runs failed: the logs
        summary = summarize(report.results)
        report.extra["summary"] = summary
        header = ["code", "runs, message", "messages", "process s", "compute s",
                  "start-up s (process - compute)", "runtime s", "import s", "load s",
                  "import + load s", "relay s",
                  "warm-up setup s (the former client_startup_seconds)"]
        rows = summary_table(summary, "this")
        if opts.before:
            path = Path(opts.before)
            before = json.loads((path / "report.json" if path.is_dir() else path).read_text())
            report.extra["before"] = {"measured_code": before.get("measured_code"),
                                      "load_average": [before.get("load_average_before"),
                                                       before.get("load_average_after")],
                                      "summary": summarize(before["results"])}
            rows = summary_table(report.extra["before"]["summary"], "before") + rows
        report.sections.append(("Per message at a site (mean (min-max), seconds)",
                                markdown_table(header, rows) + (
            f"\n\n{deploy.CLIENTS} sites on loopback (TLS, authenticated SuperNodes), "
            f"{opts.model}, one-shot FedPrLLM (Wanda 50%, {opts.samples_per_client} x "
            f"{opts.seqlen} tokens per site); each site's data file: "
            f"{report.extra['site_data']['documents']} wiki documents "
            f"({report.extra['site_data']['bytes']} bytes). Run 1 is cold (new app install, "
            "empty window cache); the sites start their processes at the same time on "
            f"{os.cpu_count()} CPU cores. Alone: one site's warm-up in a fresh process, nothing "
            "else of the deployment running (runtime: Flower's imports only; start-up: those, "
            "the ClientApp module and the warm-up). "
            + ("agent: each site's SuperNode with only site-agent in its node config (its "
               "flwr-clientapp processes relay the Message alone to the site's agent, which "
               "holds the site's node config, data, ledger and Context; runs alternate without "
               "/ with, the SuperNodes restarted between); relay s: the exchange with the "
               "agent less its operation (startup_worker_seconds); the alone agent's first "
               "message loads the model, the others find it loaded. " if opts.site_agent
               else "")
            + "'-': not reported by that ClientApp. Load average (1, 5, 15 min) before "
            f"{report.extra['load_average_before']}, after "
            f"{report.extra['load_average_after']}, after each run: "
            f"{[x['load'][0] for x in report.extra.get('load_average', [])]}; the machine "
            "is shared with other jobs.")))
    print(report.markdown())
    print(f"reproduce: {report.reproduce}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
