"""The site agent (clients/site_agent.py): a real ``fedcompress site-agent`` process holding the
site's node config, data, ledger and Flower Context; the relay (the FAB's ClientApp) sends only
the Message. Its answers equal the in-process operation's; unknown operations, other protocol or
operation versions and bad config files are refused with their names."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from clients import site_agent as sa
from clients import site_socket as frames


def _fp(tiny_dir, **extra) -> dict:
    return {"model": tiny_dir, "clients": 2, "samples_per_client": 2, "seqlen": 16,
            "batch_size": 2, **extra}


def _write_config(folder, **keys) -> tuple:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    config = folder / "agent.toml"
    lines = [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    config.write_text("\n".join(lines) + "\n")
    config.chmod(0o600)
    return config


@pytest.fixture(scope="module")
def agent(tmp_path_factory, tiny_dir):
    """One agent for the module, deployed (its own state folder, the tiny model accepted,
    masks in the clear allowed, one partition of two); at the end SIGTERM stops it cleanly."""
    from conftest import Agent

    root = tmp_path_factory.mktemp("agent")
    (root / "run").mkdir(mode=0o700)
    config = _write_config(root / "etc", socket=str(root / "run" / "agent.sock"),
                           **{"partition-id": 0, "num-partitions": 2,
                              "state-dir": str(root / "state"), "models": tiny_dir,
                              "require-secagg": False, "runs-per-input": 100})
    process = Agent(root / "run" / "agent.sock", root / "cache", root / "agent.log",
                    config=config)
    process.state = root / "state"
    try:
        yield process
    finally:
        code = process.stop()
        assert code == 0, process.log()
        assert not process.path.exists(), process.log()
        assert "site agent stopped" in process.log()


def _message(message_type: str, content: dict, run: int = 1) -> Message:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run, 0, 1
    return Message(RecordDict({k: ConfigRecord(v) for k, v in content.items()}),
                   dst_node_id=100, message_type=message_type)


def test_the_relay_gets_the_agents_answer_and_nothing_else(agent, tiny_dir, tmp_path):
    """train.masks through the agent equals the same operation in process with the agent's node
    config; the relay's own context (what the server's code holds) gains nothing."""
    relay_context = Context(run_id=1, node_id=100,
                            node_config={sa.NODE_CONFIG_KEY: str(agent.path)},
                            state=RecordDict(), run_config={})
    from clients.app import app

    message = _message("train.masks", {"config": _fp(tiny_dir)})
    reply = app(message, relay_context)
    assert not reply.has_error(), reply.error.reason
    assert reply.content["metrics"]["ledger_dp"] == 0
    assert relay_context.node_config == {sa.NODE_CONFIG_KEY: str(agent.path)}
    assert len(relay_context.state) == 0
    local = sa.SiteAgent({"partition-id": 0, "num-partitions": 2, "site-mode": "deployment",
                          "state-dir": str(tmp_path / "state"), "models": tiny_dir,
                          "require-secagg": False})
    expected = local.handle(_message("train.masks", {"config": _fp(tiny_dir)}))
    for key, array in expected.content["masks"].items():
        assert np.array_equal(reply.content["masks"][key].numpy(), array.numpy()), key
    journal = (agent.state / "ledger.jsonl").read_text()
    assert '"action":"train.masks"' in journal  # the agent's ledger recorded the release


def test_a_deployed_site_without_an_agent_refuses_every_message(tiny_dir, tmp_path):
    """The FAB's ClientApp at a deployed site whose node config names no agent refuses (its
    SuperNode's process would hold the data, keys and ledger beside the server's code), naming
    the key; ``site-mode="development"`` (a test bench) runs the operation in process."""
    from clients.app import app

    config = {"partition-id": 0, "num-partitions": 2, "state-dir": str(tmp_path / "state"),
              "models": tiny_dir, "require-secagg": False}
    for mode in ("deployment", ""):
        context = Context(run_id=1, node_id=100, node_config={**config, "site-mode": mode},
                          state=RecordDict(), run_config={})
        reply = app(_message("train.masks", {"config": _fp(tiny_dir)}), context)
        assert reply.has_error(), mode
        assert "names no site agent (site-agent=" in reply.error.reason
        assert 'site-mode="development"' in reply.error.reason
        assert not (tmp_path / "state").exists()  # nothing ran, nothing was recorded
    context = Context(run_id=1, node_id=100, node_config={**config, "site-mode": "development"},
                      state=RecordDict(), run_config={})
    reply = app(_message("train.masks", {"config": _fp(tiny_dir)}), context)
    assert not reply.has_error(), reply.error.reason
    assert reply.content["metrics"]["ledger_dp"] == 0


_DEPLOYED_PATH = """
import json, sys
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from clients import site_agent as sa
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
agent = sa.SiteAgent(json.loads(sys.argv[1]))
out = {}
for name, config in json.loads(sys.argv[2]).items():
    reply = agent.handle(Message(RecordDict({"config": ConfigRecord(config)}), dst_node_id=100,
                                 message_type="train.masks"))
    out[name] = reply.error.reason if reply.has_error() else "answered"
out["simulated imported"] = "clients.simulated" in sys.modules
print(json.dumps(out))
"""


def test_the_deployed_path_never_imports_the_simulations_faults_and_attacks(tiny_dir, tmp_path):
    """An agent (a fresh process) answers an honest operation and refuses an attack model's
    switch, and never imports clients/simulated.py, where faults and attacks live."""
    import subprocess
    import sys

    node_config = {"partition-id": 0, "num-partitions": 2, "site-mode": "deployment",
                   "state-dir": str(tmp_path / "state"), "models": tiny_dir,
                   "require-secagg": False}
    configs = {"honest": _fp(tiny_dir), "attacker": _fp(tiny_dir, attackers=2, attack="random"),
               "faulty": _fp(tiny_dir, faulty=1, fault="corrupt")}
    proc = subprocess.run([sys.executable, "-c", _DEPLOYED_PATH, json.dumps(node_config),
                           json.dumps(configs)], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["honest"] == "answered", out
    for name in ("attacker", "faulty"):
        assert "simulation-only switch" in out[name], out
    assert out["simulated imported"] is False


def test_an_operation_the_agent_does_not_know_is_refused(agent):
    reply = sa.relay(str(agent.path), _message("query.read_file", {"config": {"path": "/"}}))
    assert reply.has_error()
    assert "operation 'query.read_file' is not one of this site's operations" in (
        reply.error.reason)


def test_another_protocol_or_operations_version_is_refused(agent):
    for hello, words in (({"protocol": 1}, "protocol 1 of the relay"),
                         ({"protocol": sa.PROTOCOL, "operations": 99},
                          "expects site operations v99")):
        with frames._connect(str(agent.path)) as sock:
            frames.write_json(sock, hello)
            answer = frames.read_json(sock)
        assert not answer["ok"] and words in answer["error"], answer


def test_garbage_to_the_agent_is_refused_and_it_keeps_serving(agent, tiny_dir):
    import socket
    import struct

    for garbage in (b"GET / HTTP/1.1\r\n\r\n",
                    struct.pack(">4sQ", frames.MAGIC, frames.MAX_FRAME_BYTES + 1)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(agent.path))
            sock.sendall(garbage)
            answer = frames.read_json(sock)
        assert not answer["ok"]
        assert "not a site-agent frame" in answer["error"] or \
            f"MAX_HEADER_BYTES = {frames.MAX_HEADER_BYTES:,}" in answer["error"]
    reply = sa.relay(str(agent.path), _message("query.warmup", {"config": _fp(tiny_dir)}))
    assert not reply.has_error(), reply.error.reason


def test_a_node_config_naming_the_retired_site_worker_is_refused(tiny_dir, tmp_path):
    """``site-worker`` (the warm worker that ran the ClientApp at the SuperNode's uid) is gone:
    a SuperNode still naming it gets a refusal that says what to start instead, and nothing
    runs, whatever its site mode."""
    from clients.app import app

    for mode in ("deployment", "development"):
        context = Context(run_id=1, node_id=100, node_config={
            "partition-id": 0, "num-partitions": 2, "site-mode": mode, "site-worker": "/x.sock",
            "state-dir": str(tmp_path / "state"), "models": tiny_dir}, state=RecordDict(),
            run_config={})
        reply = app(_message("train.masks", {"config": _fp(tiny_dir)}), context)
        assert reply.has_error(), mode
        assert "site worker (site-worker)" in reply.error.reason
        assert "fedcompress site-agent" in reply.error.reason
        assert not (tmp_path / "state").exists()


# A flwr-clientapp process's imports, then the ClientApp module and two messages through `app`
# with an agent named in the node config; prints what got imported and the replies.
_THIN = r"""
import hashlib, json, sys
import flwr.cli.install, flwr.clientapp.utils, flwr.supernode.runtime.run_clientapp
from flwr.app import Context, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from clients.app import app
from clients.site_socket import message_from_bytes

TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
socket_path, *messages = sys.argv[1:]
context = Context(run_id=1, node_id=100, node_config={"site-agent": socket_path},
                  state=RecordDict(), run_config={}, series_id=0)
replies = []
for path in messages:
    reply = app(message_from_bytes(open(path, "rb").read()), context)
    replies.append({"error": reply.error.reason} if reply.has_error() else
                   dict(reply.content["metrics"]))
print(json.dumps({"replies": replies, "modules": sorted(sys.modules)}))
"""


def test_the_relay_imports_no_torch_and_gets_the_agents_start_up_split(agent, tiny_dir,
                                                                      tmp_path):
    """The relay (a fresh process, as a ``flwr-clientapp`` one) imports neither torch nor
    transformers; the agent's replies carry the start-up split: the relay's imports added to
    the agent's, ``startup_worker_seconds`` the exchange, no load for a warm model."""
    import subprocess
    import sys

    files = []
    for kind in ("query.warmup", "train.masks"):
        files.append(tmp_path / f"{kind}.bin")
        files[-1].write_bytes(frames.message_to_bytes(
            _message(kind, {"config": _fp(tiny_dir)}, run=11)))  # a run of its own
    sa.relay(str(agent.path), _message("query.warmup", {"config": _fp(tiny_dir)}))  # warm
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _THIN, str(agent.path), *map(str, files)],
                         cwd=repo, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    thin = json.loads(out.stdout.strip().splitlines()[-1])
    heavy = {m for m in thin["modules"] if m.split(".")[0] in ("torch", "transformers")}
    assert not heavy, sorted(heavy)[:10]
    for reply in thin["replies"]:
        assert "error" not in reply, reply
        assert reply["startup_worker_seconds"] >= 0 and reply["compute_seconds"] >= 0
        assert reply["client_startup_seconds"] == pytest.approx(
            reply["startup_import_seconds"] + reply["startup_load_seconds"])
    assert thin["replies"][1]["startup_load_seconds"] == 0.0  # model and windows warm


def test_an_agent_without_keys_refuses_the_secure_vote_and_the_relay_keeps_nothing(agent,
                                                                                   tiny_dir):
    """Through the real agent process: a deployed agent without SecAgg+ keys refuses the
    vote's first stage, and the relay's Context (the server's code) stays empty (the retired
    site worker sent its Context, secrets included, back to the FAB's process)."""
    from clients.app import app

    relay_context = Context(run_id=3, node_id=100,
                            node_config={sa.NODE_CONFIG_KEY: str(agent.path)},
                            state=RecordDict(), run_config={})
    message = _message("query.secagg_keys", {
        "config": _fp(tiny_dir, secagg=True),
        "secagg": {"sites": 2, "threshold": 2, "numel": 64, "bits": 2, "index": 0,
                   "neighbours": 0, "group": "1", "layer": -1}}, run=3)
    reply = app(message, relay_context)
    assert reply.has_error() and "secagg-key" in reply.error.reason, reply.error.reason
    assert len(relay_context.state) == 0


def test_a_bad_config_file_is_refused(tmp_path):
    good = {"socket": str(tmp_path / "run" / "a.sock"), "partition-id": 0,
            "state-dir": str(tmp_path / "state")}
    assert sa.load_config(_write_config(tmp_path / "a", **good)).node_config["site-mode"] == (
        "deployment")
    shared = sa.load_config(_write_config(tmp_path / "s", **good, **{"relay-uid": 50200}))
    assert shared.relay_uid == 50200 and "relay-uid" not in shared.node_config
    for keys, words in (
            ({**good, "data_path": "/data"}, "unknown key 'data_path' (did you mean "
                                             "'data-path'?)"),
            ({k: v for k, v in good.items() if k != "socket"}, "'socket'"),
            ({**good, "site-worker": "/x"}, "names the retired site worker"),
            ({**good, "site-mode": "simulation"}, "never for an agent"),
            ({**good, "site-mode": "development"}, "never for an agent"),
            ({**good, "relay-uid": 0}, "relay-uid=0 is invalid"),
            ({**good, "relay-uid": "50200"}, "relay-uid='50200' is invalid"),
            ({**good, "relay-uid": os.geteuid()}, f"relay-uid={os.geteuid()} is invalid"),
            ({**good, "max-epsilon": -1}, "max-epsilon=-1.0 is invalid")):
        with pytest.raises(sa.SiteAgentError, match=re.escape(words)):
            sa.load_config(_write_config(tmp_path / f"b{len(words)}", **keys))
    loose = _write_config(tmp_path / "c", **good)
    os.chmod(loose, 0o620)
    with pytest.raises(sa.SiteAgentError, match="writable by group or others"):
        sa.load_config(loose)


def test_an_authenticated_secure_vote_through_agents_keeps_its_secrets_in_them(tiny_dir,
                                                                               tmp_path):
    """The five SecAgg+ stages through each site's agent (in process: the same SiteAgent the
    agent process runs): the vote's keys and shares live in the agents' Contexts between the
    stages, the counts equal the plain vote's, and no message the server receives carries a
    Context."""
    import torch
    from conftest import write_site_keys
    from flwr.app import ArrayRecord, ConfigRecord

    from fedcompress.methods.fedprllm.federated import FedPrLLMConfig
    from fedcompress.models import load_model
    from strategies.fedprllm import FedPrLLM, make_strategy

    keys, peers = write_site_keys(tmp_path, 4)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1

    class Agents:
        def __init__(self, **policy):
            self.agents = {100 + i: sa.SiteAgent({
                "partition-id": i, "num-partitions": 4, "site-mode": "deployment",
                "state-dir": str(tmp_path / f"state-{len(policy)}-{i}"), "models": tiny_dir,
                "secagg-key": str(keys[i]), "secagg-peers": str(peers), **policy})
                for i in range(4)}

        def get_node_ids(self):
            return list(self.agents)

        def send_and_receive(self, messages, timeout=None):
            return [self.agents[m.metadata.dst_node_id].handle(m) for m in messages]

    config = FedPrLLMConfig(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16,
                            batch_size=2, secagg=True)
    model = load_model(tiny_dir, device="cpu").model
    secure, grid = make_strategy(config, model), Agents()
    secure.start(grid, ArrayRecord())
    assert secure.secagg["sum"]["authenticated"] and secure.secagg["sum"]["consistency_round"]
    states = [agent.contexts[1].state for agent in grid.agents.values()]
    assert all("fedprllm_secagg" in state for state in states)  # kept by each agent
    plain, reference = FedPrLLM(config.replace(secagg=False), model), Agents(
        **{"require-secagg": False})
    plain.aggregate_train(1, reference.send_and_receive(plain.configure_train(
        1, ArrayRecord(), ConfigRecord(), reference)))
    for key, counts in plain.aggregator.counts().items():
        assert torch.equal(secure.aggregator.counts()[key], counts)


def test_the_policy_is_read_once_per_message(tiny_dir, tmp_path, monkeypatch):
    """The runner admits a message under the policy it reads, and its handler uses that same
    policy (``site.policy``): one read per message, so a policy file changed mid-message
    cannot make the admission and the handler's checks disagree."""
    from fedcompress.privacy import site

    reads = []
    read = site.site_policy

    def counting(node_config):
        reads.append(1)
        return read(node_config)

    monkeypatch.setattr(site, "site_policy", counting)
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text(f'models = "{tiny_dir}"\nrequire-secagg = false\n')
    policy_file.chmod(0o600)
    agent = sa.SiteAgent({"partition-id": 0, "num-partitions": 2, "site-mode": "deployment",
                          "state-dir": str(tmp_path / "state"), "policy": str(policy_file)})
    for run, action in enumerate(("query.warmup", "train.masks"), start=20):
        reads.clear()
        reply = agent.handle(_message(action, {"config": _fp(tiny_dir)}, run=run))
        assert not reply.has_error(), reply.error.reason
        assert len(reads) == 1, (action, len(reads))
    assert site.policy({"state-dir": str(tmp_path / "other")}).state_dir  # outside: read now
