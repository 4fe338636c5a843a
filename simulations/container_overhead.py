"""A one-shot FedPrLLM run in real containers against the same run on loopback, side by side.

    python simulations/container_overhead.py --out simulations/results/container-overhead

Two deployments of the same three sites, up at the same time, each with TLS and SuperNode
authentication, every site an agent of its own (``fedcompress site-agent``) to which each
message's ``flwr-clientapp`` process relays the Message:

* ``loopback``: processes on this machine, as ``tests/test_deploy.py`` starts them (its
  ``Deployment``), the agents as ``simulations/site_startup.py`` starts them;
* ``containers``: ``docker/compose.yml`` as ``tests/test_containers.py`` starts it (its
  ``Stack``: per site an agent, a SuperNode and a ClientApp container, own uids, volumes, data
  and keys), from the image ``--image`` (build it from the measured checkout first: ``make
  images``).

The same settings (``--model``, each site's first ``--site-docs`` wiki documents,
``--samples-per-client`` windows of ``--seqlen`` tokens, Wanda 50%, no saved model) run
``--runs`` times on each, alternating (loopback, containers, loopback, ...) so that a change of
the machine's load hits both alike. ``--paths agent,fat`` also times, in each run and on both
deployments, a process per message (``fat``: the layout the agent replaced, measured only:
each message's ClientApp process runs the operation itself, as the site's uid with its data,
keys and cache, ``site-mode="development"``; in containers ``Stack.use`` recreates the
SuperNode and ClientApp containers so, with a ledger of their own); the SuperNodes are
restarted between the paths, each keeping its key. Per run: the wall time of ``flwr run
--stream`` (submit to end; in containers it includes starting the operator's ``cli``
container) and, per site and
message (the warm-up, the masks), the start-up its reply reports (Flower's runtime in the
per-message process, imports, model and windows loaded, the exchange with the agent) and its
compute. Run 1 is cold (a new app install, empty window caches) and is reported apart. A timing
measurement: run it alone on an idle machine; the load average is recorded.
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
import time
from pathlib import Path

from fedcompress.report import RunReport, markdown_table

logger = logging.getLogger("container_overhead")
REPO = Path(__file__).resolve().parents[1]
DEPLOYMENTS = ("loopback", "containers")
STARTUP_KEYS = ("startup_runtime_seconds", "startup_import_seconds", "startup_load_seconds",
                "startup_worker_seconds")


#: the agent (the shipped layout) and a process per message (``fat``, measured only)
PATHS = ("agent", "fat")


def _messages(report: dict, node_ids: list[int], path: str = "agent") -> list[dict]:
    """One record per site and message of a run's report.json (its ``client_startup``)."""
    site_of = {node: i for i, node in enumerate(node_ids)}
    out = []
    for r in report.get("client_startup", []):
        site = site_of[r["node"]]
        startup = sum(float(r.get(k, 0.0)) for k in STARTUP_KEYS)
        out.append({"site": site, "message": r["stage"],
                    "path": path,
                    "startup_seconds": startup,
                    "compute_seconds": float(r.get("compute_seconds", 0.0)),
                    **{k: float(r[k]) for k in STARTUP_KEYS if k in r}})
    return out


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="simulations/results/container-overhead")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--image", default="fedcompress:cpu",
                        help="The image the containers run (make images builds it).")
    parser.add_argument("--runs", type=int, default=4,
                        help="Runs per deployment, alternating (the first one cold).")
    parser.add_argument("--site-docs", type=int, default=200,
                        help="Documents of the bundled wiki train split in each site's data.")
    parser.add_argument("--samples-per-client", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--paths", default="agent",
                        help="The sites' paths to time, comma-separated: agent (the shipped "
                             "layout), fat (a process per message, the layout the agent "
                             "replaced).")
    opts = parser.parse_args(argv)
    paths = [p.strip() for p in opts.paths.split(",") if p.strip()]
    if not paths or set(paths) - set(PATHS) or paths[0] != "agent":
        parser.error(f"--paths {opts.paths!r}: expected agent first, then optionally fat")
    if opts.runs < 2:
        parser.error(f"--runs {opts.runs}: expected 2 or more (run 1 is cold)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ["FEDCOMPRESS_IMAGE"] = opts.image
    sys.path.insert(0, str(REPO / "tests"))
    sys.path.insert(0, str(REPO / "simulations"))
    import test_containers
    from site_startup import Sites, _deploy_module, _git, _prepare_cache

    deploy = _deploy_module()
    test_containers.IMAGE = opts.image
    report = RunReport.for_script(Path(__file__).resolve().relative_to(REPO), opts)
    report.extra["measured_code"] = {
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no"))}
    image = json.loads(subprocess.run(["docker", "image", "inspect", opts.image],
                                      capture_output=True, text=True, check=True).stdout)[0]
    report.extra["image"] = {"name": opts.image, "id": image["Id"], "created": image["Created"],
                             "size_bytes": image["Size"]}
    report.extra["load_average_before"] = [round(x, 2) for x in os.getloadavg()]
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"container-overhead-{os.getpid()}"
    work.mkdir(parents=True)
    docs = deploy.WIKI.read_text().splitlines(keepends=True)[:opts.site_docs]
    settings = {"model": opts.model, "clients": deploy.CLIENTS,
                "samples-per-client": opts.samples_per_client, "seqlen": opts.seqlen,
                "batch-size": 4, "eval-seqlen": opts.seqlen, "eval-windows": 2,
                "device": "cpu", "baselines": "", "save-model": False}
    report.extra["run_settings"] = settings
    procs = deploy.Processes(work)
    dep = deploy.Deployment("loopback", work, procs)
    # the plain one-shot vote, measured over several runs on the same windows
    dep.policy = {"models": opts.model, "require-secagg": False, "runs-per-input": 1000}
    (work / "containers").mkdir()
    stack = test_containers.Stack(work / "containers",
                                  policy={"models": opts.model, "require-secagg": False,
                                          "runs-per-input": 1000},
                                  documents=docs)
    with report:
        try:
            # loopback: the same data as the containers' sites (their canary line included)
            _prepare_cache(work / "loopback" / "cache", opts.model)
            for i, site in enumerate(dep.sites):
                site.parent.mkdir(parents=True)
                shutil.copy(stack.root / "data" / f"site-{i}" / "train.jsonl", site)
            dep.start_superlink()
            dep.wait_superlink()
            dep.node_ids = [deploy._make_certs().register([public], deploy.CONNECTION,
                                                           dep.cli_env)[0]
                            for _, public in dep.made["node_keys"][:deploy.CLIENTS]]
            sites = Sites(deploy, dep, procs)
            sites.start_agents()
            sites.use("agent")
            with report.phase("containers up"):
                stack.start()
            using = {"loopback": "agent", "containers": "agent"}
            for run, kind, path in ((r, k, p) for r in range(1, opts.runs + 1)
                                    for k in DEPLOYMENTS for p in paths):
                if using[kind] != path:  # restart the SuperNodes in the other layout
                    with report.phase(f"switch {kind} to {path}"):
                        if kind == "loopback":
                            sites.use(path)
                        else:
                            stack.use(path)
                    using[kind] = path
                name = f"run-{run}-{kind}" + ("" if path == "agent" else f"-{path}")
                with report.phase(f"run {run} {kind} {path}"):
                    if kind == "loopback":
                        started = time.perf_counter()
                        record, log = dep.run({**settings, "out": str(work / name)})
                        seconds = time.perf_counter() - started
                        out, nodes = work / name, dep.node_ids
                    else:
                        record, log, seconds = stack.run(name, "fedprllm", settings)
                        out, nodes = stack.root / "out" / name, stack.node_ids
                if record["status"] != "finished:completed":
                    raise RuntimeError(f"{name}: {record}\n{log[-3000:]}")
                run_report = json.loads((out / "report.json").read_text())
                messages = _messages(run_report, nodes, path)
                report.add_result({"name": f"run {run} {kind}"
                                   + ("" if path == "agent" else f" {path}"),
                                   "deployment": kind, "path": path,
                                   "run": run, "seconds": seconds,
                                   "perplexity": run_report["results"][0].get("perplexity"),
                                   "messages": messages,
                                   "load_average_after": [round(x, 2)
                                                          for x in os.getloadavg()]})
                logger.info("run %d %s %s: %.1f s", run, kind, path, seconds)
        finally:
            left_containers = stack.stop()
            left = procs.stop_all()
            report.extra["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
            if left or left_containers:
                logger.error("left running: processes %s, containers %s",
                             [p.pid for p in left], left_containers)
            shutil.rmtree(work, ignore_errors=True)
        warm = [r for r in report.results if r["run"] > 1]
        rows = []
        summary: dict = {}
        for kind in DEPLOYMENTS:
            # the run's seconds: the agent's (the shipped layout); each path's apart
            mine = [r for r in warm if r["deployment"] == kind
                    and r.get("path", "agent") == "agent"]
            cold = [r["seconds"] for r in report.results if r["deployment"] == kind
                    and r["run"] == 1 and r.get("path", "agent") == "agent"]
            entry = {"warm_runs": len(mine), "run_seconds": _median([r["seconds"] for r in mine]),
                     "cold_run_seconds": cold[0] if cold else None}
            for path in paths[1:]:
                entry[f"{path}/run_seconds"] = _median(
                    [r["seconds"] for r in warm if r["deployment"] == kind
                     and r.get("path") == path])
            mine = [r for r in warm if r["deployment"] == kind]
            for path in paths:
                for message in ("warmup", "masks"):
                    values = [m for r in mine for m in r["messages"]
                              if m["path"] == path and m["message"] == message]
                    entry[f"{path}/{message}"] = {
                        "startup_seconds": _median([m["startup_seconds"] for m in values]),
                        "compute_seconds": _median([m["compute_seconds"] for m in values]),
                        "messages": len(values)}
            summary[kind] = entry
        summary["ratio_run_seconds"] = (summary["containers"]["run_seconds"]
                                        / summary["loopback"]["run_seconds"])
        report.extra["summary"] = summary
        rows.append(["run, submit to end (median of warm runs)",
                     *(f"{summary[k]['run_seconds']:.1f}" for k in DEPLOYMENTS),
                     f"{summary['ratio_run_seconds']:.2f}"])
        rows.append(["cold run 1", *(f"{summary[k]['cold_run_seconds']:.1f}"
                                     for k in DEPLOYMENTS),
                     f"{summary['containers']['cold_run_seconds'] / summary['loopback']['cold_run_seconds']:.2f}"])  # noqa: E501
        for path in paths[1:]:
            lb, ct = (summary[k][f"{path}/run_seconds"] for k in DEPLOYMENTS)
            rows.append([f"run, {path} (median of warm runs)", f"{lb:.1f}", f"{ct:.1f}",
                         f"{ct / lb:.2f}"])
        for path in paths:
            for message in ("warmup", "masks"):
                key = f"{path}/{message}"
                lb, ct = (summary[k][key]["startup_seconds"] for k in DEPLOYMENTS)
                rows.append([f"start-up per message, {path}, {message}", f"{lb:.2f}",
                             f"{ct:.2f}", f"{ct / lb:.2f}" if lb > 0 else "-"])
        report.sections.append(("Containers against loopback (seconds, medians)", markdown_table(
            ["", "loopback", "containers", "containers / loopback"], rows) + (
            f"\n\n{deploy.CLIENTS} sites, TLS and SuperNode authentication, one-shot FedPrLLM "
            f"on {opts.model} (Wanda 50%, {opts.samples_per_client} x {opts.seqlen} tokens per "
            f"site, {len(docs)} wiki documents of data per site); every site an agent"
            + ("" if paths == ["agent"] else ", and in the same runs (restarted between) a "
               "process per message (fat: its ClientApp process runs the operation itself, as "
               "the site's uid, the layout the agent replaced)") + ". "
            f"{opts.runs} runs per deployment, alternating; run 1 cold. Start-up per message: "
            "what its reply reports (Flower's runtime in the per-message process, imports, "
            "model and windows, the exchange with the agent), median over the warm runs' "
            "sites and messages of that path. The containers: image "
            f"{report.extra['image']['id'][7:19]} ({report.extra['image']['size_bytes'] / 1e9:.2f}"
            f" GB). Load average (1, 5, 15 min) before {report.extra['load_average_before']}, "
            f"after {report.extra['load_average_after']}, after each run: "
            f"{[r['load_average_after'][0] for r in report.results]}.")))
    print(report.markdown())
    print(f"reproduce: {report.reproduce}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
