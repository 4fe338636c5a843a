"""A malicious server against the deployment of docker/compose.yml, in real containers (``make
deploy-test``; skipped by ``make test``).

In Flower the server ships the code each SuperNode runs. Here the server is hostile: its own app
(``tests/hostile-app``, submitted with ``flwr run``) runs where every site runs the server's
ClientApp (``clientapp-I``) and tries to take the sites' data, keys and ledgers (its module
docstring lists every attempt). The sites keep the default policy (SecAgg+ required, one vote
per input across runs, statistics only with DP), accepting only the tiny public model.

In order, on one Compose project of its own (:class:`test_containers.Stack`):

1. an honest SecAgg+ vote (``flwr run /app``, ``fedprllm.secagg=true``) completes;
2. the same vote again (the server replays it to difference the sums): every site refuses, its
   ledger having recorded the input;
3. the hostile app: no site's canary or key material is in anything it can read (files,
   environment, processes), it sees no site's file, reaches neither the SuperLink nor another
   site nor the internet, cannot list or replace the agent's socket, and every request it makes
   of the agent outside the policy is refused with a reason that names settings only;
4. an honest vote on other windows (another seed) still completes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_containers import APP_UID, SITES, TINY_RUN, Stack, pytestmark  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
#: the image's own files (its code, its virtualenv, the system): public, the same at every site
IMAGE_PATHS = ("/app/", "/opt/venv/", "/usr/")


def _needles(stack: Stack) -> dict[str, str]:
    """What must never reach the attacker: each site's canary and a piece of every private
    key (the base64 body of its PEM file)."""
    needles = {f"canary of site-{i}": c for i, c in stack.canaries.items()}
    keys = [("supernode", private) for private, _ in stack.made["node_keys"]] + [
        ("agent", private) for private, _ in stack.made["agent_keys"]]
    for i, (kind, private) in enumerate(keys):
        body = [line for line in private.read_text().splitlines() if "-----" not in line]
        needles[f"{kind} key {i % SITES}"] = body[1][:48]
    needles["SuperLink TLS key"] = [line for line in stack.made["key"].read_text().splitlines()
                                    if "-----" not in line][1][:48]
    return needles


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    """A stack whose sites keep the default policy (the tiny model accepted), with its first
    honest SecAgg+ vote done."""
    from conftest import build_tiny_model, build_tiny_tokenizer
    from test_containers import _docker

    if _docker("info", check=False, timeout=30).returncode != 0:
        pytest.fail("no Docker engine answers `docker info`: start dockerd")
    root = tmp_path_factory.mktemp("hostile")
    public = root / "public"
    build_tiny_model("llama", n_layers=3).save_pretrained(public / "tiny-llama")
    build_tiny_tokenizer().save_pretrained(public / "tiny-llama")
    for path in [public, *public.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    (root / "project").mkdir()
    stack = Stack(root / "project", public, policy={"models": str(public / "tiny-llama")})
    shutil.copytree(REPO / "tests" / "hostile-app", stack.root / "runs" / "hostile-app",
                    ignore=shutil.ignore_patterns("__pycache__"))
    try:
        stack.start()
        stack.settings = {**TINY_RUN, "model": str(public / "tiny-llama"), "secagg": True}
        stack.first = stack.run("secure", "fedprllm", stack.settings)
        yield stack
    finally:
        stack.close(root / "compose.log")


def test_an_honest_secure_vote_completes(strict):
    record, log, _ = strict.first
    assert record["status"] == "finished:completed", f"{record}\n{log[-4000:]}"
    report = json.loads((strict.root / "out" / "secure" / "report.json").read_text())
    assert report["rejected"] == [] and report["results"][0]["valid_clients"] == SITES
    assert report["secagg"]["sum"]["authenticated"]


def test_the_same_vote_replayed_is_refused_by_every_site(strict):
    """The server runs the very vote again (same windows) to difference the two sums: each
    site's ledger already holds that input, runs-per-input is 1, so every site refuses."""
    record, log, _ = strict.run("replay", "fedprllm", strict.settings)
    assert record["status"] != "finished:completed", f"{record}\n{log[-4000:]}"
    assert "runs-per-input" in log, log[-4000:]
    report = json.loads((strict.root / "out" / "replay" / "report.json").read_text())
    assert report["status"] == "failed" and report["results"] == []  # nothing released
    refusals = report["site_refusals"]
    assert {r["node"] for r in refusals} == set(strict.node_ids), refusals
    for refusal in refusals:
        assert refusal["action"] == "train.secagg_masks", refusal
        assert "runs-per-input=1" in refusal["reason"], refusal


@pytest.fixture(scope="module")
def hostile(strict):
    needles = _needles(strict)
    tables = {"needles": ",".join(needles.values()),
              "model": str(strict.public / "tiny-llama"), "out": "/runs/hostile"}
    record, log, seconds = strict.run("hostile", "", {}, app="/run-config/hostile-app",
                                      tables=tables)
    assert record["status"] == "finished:completed", f"{record}\n{log[-4000:]}"
    reports = json.loads((strict.root / "out" / "hostile" / "report.json").read_text())
    (strict.root.parent / "hostile-report.json").write_text(json.dumps(reports, indent=1))
    return needles, reports, seconds


def test_the_hostile_app_finds_no_site_secret(strict, hostile):
    needles, reports, _ = hostile
    names = list(needles)
    assert sorted(int(n) for n in reports) == sorted(strict.node_ids)
    for node, report in reports.items():
        assert "error" not in report, report
        i = strict.node_ids.index(int(node))
        assert report["uid"] == APP_UID + i
        assert report["node_config"] == {"site-agent": "/agent/agent.sock"}
        files = report["files"]
        assert files["files_read"] > 1000  # it did search the filesystem
        assert files["hits"] == [], [(names[n], path) for n, path in files["hits"]]
        # files named like a site's (ledger, data, keys, agent config) outside the image (the
        # image's bundled public corpora are train.jsonl/test.jsonl files too)
        named = [p for p in files["site_named_paths"] if not p.startswith(IMAGE_PATHS)]
        assert named == [], named
        assert report["environment"]["hits"] == []
        assert not any(k.startswith(("FEDCOMPRESS_STATE", "SECAGG"))
                       for k in report["environment"]["keys"])
        for process in report["processes"]:
            assert not process.get("hits"), process
            assert "site-agent" not in process.get("command", ""), process
        mounts = set(report["mounts"]) - {"/"}
        assert not {"/data", "/keys/agent", "/home/app/state", "/site/agent.toml"} & mounts


def test_the_hostile_app_reaches_only_its_own_supernode(strict, hostile):
    _, reports, _ = hostile
    for node, report in reports.items():
        i = strict.node_ids.index(int(node))
        reached = {target for target, result in report["network"].items()
                   if result == "connected"}
        assert reached == {f"supernode-{i}:9094"}, report["network"]


def test_the_hostile_app_cannot_touch_the_agents_socket_folder(hostile):
    _, reports, _ = hostile
    for report in reports.values():
        folder = report["agent_folder"]
        assert all(result.startswith("refused") for result in folder.values()), folder


def test_every_out_of_policy_request_is_refused_by_the_agent(strict, hostile):
    """Every request is refused by the site's policy (not a crash), and no reason carries a
    needle (a path of the site's, a record, a key)."""
    needles, reports, _ = hostile
    for report in reports.values():
        attempts = report["agent"]
        assert len(attempts) == 7, attempts
        for name, result in attempts.items():
            assert result.startswith("refused: "), (name, result)  # an error reply
            assert not any(n in result for n in needles.values()), (name, result)
            assert "/data" not in result and "Traceback" not in result, (name, result)
        assert "not one of this site's operations" in attempts[
            "an operation the site does not have"]
        for name in ("masks in the clear, after the secure vote", "statistics without DP",
                     "a split outside the data folder", "a model the site does not accept"):
            assert "refused by the site's policy" in attempts[name], (name, attempts[name])
        assert "require-secagg" in attempts["masks in the clear, after the secure vote"]


def test_an_honest_vote_after_the_attacks_completes(strict, hostile):
    settings = {**strict.settings, "seed": 1}  # other windows: another input
    record, log, _ = strict.run("after", "fedprllm", settings)
    assert record["status"] == "finished:completed", f"{record}\n{log[-4000:]}"
    report = json.loads((strict.root / "out" / "after" / "report.json").read_text())
    assert report["rejected"] == [] and report["results"][0]["valid_clients"] == SITES
