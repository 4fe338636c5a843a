"""The attacker's ClientApp: what a malicious server's code can try where a fedcompress site runs
the server's ClientApp (``docker/compose.yml``'s ``clientapp-I``, a uid of its own beside the
SuperNode). It reports what it got; tests/test_hostile_app.py asserts that it got nothing.

1. every readable file of its filesystem (``/proc``, ``/sys`` and ``/dev`` aside) searched for
   each needle (each site's canary, pieces of every private key), and every path named like a
   site's file (its ledger, data, agent config, keys);
2. its environment, every process it can see (``/proc/PID/cmdline``, ``environ``, ``mem``) and
   its mounts;
3. the network: the SuperLink, every site's SuperNode, hosts outside;
4. the site agent's socket: its folder (list, replace), and requests the site's policy must
   refuse: an operation it does not have, masks in the clear (the vote's input after a secure
   vote), a clear release in a run whose settings say SecAgg+, a split outside the data folder,
   a model the site does not accept, statistics without DP, a SecAgg+ threshold below the
   site's colluder bound.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()

SKIP = ("/proc", "/sys", "/dev")
CHUNK = 1 << 20
#: names of a site's own files (ledger, data, agent config, keys)
SITE_FILES = ("ledger.jsonl", "ledger.head", "ledger.json", "agent.toml", "train.jsonl",
              "test.jsonl", "agent", "supernode", "agent-0", "agent-1", "agent-2")


def search_files(needles: list[bytes]) -> dict[str, Any]:
    hits: set[tuple[int, str]] = set()
    names, files, nbytes, unreadable = [], 0, 0, 0
    tail = max((len(n) for n in needles), default=1) - 1
    for base, dirs, entries in os.walk("/", onerror=lambda err: None):
        dirs[:] = [d for d in dirs if os.path.join(base, d) not in SKIP]
        for entry in entries:
            path = os.path.join(base, entry)
            if entry in SITE_FILES:
                names.append(path)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            except OSError:
                unreadable += 1
                continue
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                previous = b""
                try:
                    while chunk := f.read(CHUNK):
                        data = previous + chunk
                        for i, needle in enumerate(needles):
                            if needle in data:
                                hits.add((i, path))
                        previous = data[-tail:] if tail else b""
                        nbytes += len(chunk)
                except OSError:
                    unreadable += 1
                    continue
            files += 1
    return {"hits": sorted(hits), "site_named_paths": sorted(names), "files_read": files,
            "bytes_read": nbytes, "unreadable": unreadable}


def search_processes(needles: list[bytes]) -> dict[str, Any]:
    seen = []
    for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
        record: dict[str, Any] = {"pid": int(pid)}
        for name in ("cmdline", "environ", "mem"):
            try:
                with open(f"/proc/{pid}/{name}", "rb") as f:
                    data = f.read(1 << 16) if name != "mem" else b""
                record[name] = "readable"
                if name == "cmdline":
                    record["command"] = data.replace(b"\0", b" ").decode(errors="replace")
                record.setdefault("hits", []).extend(
                    i for i, needle in enumerate(needles) if needle in data)
            except OSError as err:
                record[name] = f"refused ({err.strerror})"
        seen.append(record)
    with open("/proc/self/mountinfo") as f:
        mounts = sorted({line.split()[4] for line in f})
    return {"processes": seen, "mounts": mounts}


def try_network(sites: int) -> dict[str, str]:
    targets = [("superlink", 8000), *((f"supernode-{j}", 9094) for j in range(sites)),
               ("1.1.1.1", 443), ("8.8.8.8", 53), ("pypi.org", 443)]
    out = {}
    for host, port in targets:
        try:
            with socket.create_connection((host, port), timeout=3):
                out[f"{host}:{port}"] = "connected"
        except OSError as err:
            out[f"{host}:{port}"] = f"failed ({type(err).__name__}: {err})"
    return out


def try_agent_folder(path: str) -> dict[str, str]:
    folder = os.path.dirname(path)
    out = {}
    for name, action in (("list", lambda: os.listdir(folder)),
                         ("replace", lambda: os.rename(path, path + ".stolen")),
                         ("plant", lambda: open(os.path.join(folder, "planted"), "w").close())):
        try:
            action()
            out[name] = "done"
        except OSError as err:
            out[name] = f"refused ({err.strerror})"
    return out


def _fp(model: str, sites: int, **extra: Any) -> dict[str, Any]:
    return {"model": model, "clients": sites, "samples_per_client": 2, "seqlen": 16,
            "batch_size": 2, **extra}


def try_agent(path: str, model: str, sites: int, node_id: int) -> dict[str, str]:
    from clients.site_agent import relay  # the image's relay: the agent's own protocol

    attempts = {
        "an operation the site does not have": (
            "query.read_file", {"config": {"path": "/data/train.jsonl"}}),
        "masks in the clear, after the secure vote": (
            "train.masks", {"config": _fp(model, sites)}),
        "a clear release in a SecAgg+ run": (
            "train.masks", {"config": _fp(model, sites, secagg=True)}),
        "a split outside the data folder": (
            "train.masks", {"config": _fp(model, sites, calib_split="../../etc/passwd")}),
        "a model the site does not accept": (
            "train.masks", {"config": _fp("/etc", sites)}),
        "statistics without DP": (
            "train.layer_stats", {"config": _fp(model, sites, aggregate="stats")}),
        "a SecAgg+ threshold below the colluder bound": (
            "query.secagg_keys", {
                "config": _fp(model, sites, secagg=True),
                "secagg": {"sites": sites, "threshold": 2, "numel": 64, "bits": 2, "index": 0,
                           "neighbours": 0, "group": "1", "layer": -1}}),
    }
    out = {}
    for name, (message_type, content) in attempts.items():
        try:
            message = Message(RecordDict({k: ConfigRecord(v) for k, v in content.items()}),
                              dst_node_id=node_id, message_type=message_type)
            reply = relay(path, message)
            out[name] = (f"refused: {reply.error.reason}" if reply.has_error()
                         else f"answered: {sorted(reply.content.keys())}")
        except Exception as err:  # an attacker records, never stops
            out[name] = f"failed: {type(err).__name__}: {err}"
    return out


@app.query("attack")
def attack(message: Message, context: Context) -> Message:
    config = message.content["config"]
    needles = [n.encode() for n in str(config["needles"]).split(",") if n]
    model, sites = str(config["model"]), int(config["sites"])
    started = time.monotonic()
    agent = str(context.node_config.get("site-agent", ""))
    report: dict[str, Any] = {
        "uid": os.getuid(), "gid": os.getgid(), "hostname": socket.gethostname(),
        "node_config": dict(context.node_config),
        "environment": {"keys": sorted(os.environ), "hits": [
            i for i, n in enumerate(needles) if any(n in v.encode() for v in os.environ.values())]},
        "files": search_files(needles),
        **search_processes(needles),
        "network": try_network(sites),
        "agent_folder": try_agent_folder(agent) if agent else {},
        "agent": try_agent(agent, model, sites, context.node_id) if agent else {},
    }
    report["seconds"] = time.monotonic() - started
    return Message(RecordDict({"report": ConfigRecord({"json": json.dumps(report)})}),
                   reply_to=message)
