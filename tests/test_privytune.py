"""PrunePrivyTune as a method: site data, FedAvg over adapters, the 2-site Flower simulation."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedcompress.methods import get_method
from fedcompress.methods import privytune as ppt


@pytest.fixture(scope="module")
def tiny_task(tmp_path_factory):
    from conftest import build_tiny_task

    return build_tiny_task(tmp_path_factory.mktemp("task"))


def test_sites_partition_the_training_split(tiny_task):
    config = ppt.PrivyTuneConfig.from_dict({"task": tiny_task, "clients": 3})
    sites = [ppt.site_data(config, p) for p in range(3)]
    union = ppt.site_data(config, -1)
    assert sorted(t for s in sites for t in s.train_texts) == sorted(union.train_texts)
    assert len(union.train_texts) == 48 and union.label_names == ("king", "queen")
    assert ppt.site_data(config, 1) == sites[1]  # seeded
    with pytest.raises(ValueError, match="partition 3 is outside"):
        ppt.site_data(config, 3)


def test_removed_plan_round_trips_through_a_message_value():
    assert ppt.parse_removed(ppt.removed_text([3, 7])) == [3, 7]
    assert ppt.parse_removed(ppt.removed_text([])) == []
    with pytest.raises(ValueError, match="removed='x' is invalid"):
        ppt.parse_removed("x")


def _reply(arrays: dict, metrics: dict, node: int) -> Message:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                          "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=Message(RecordDict(), dst_node_id=node,
                                             message_type="train.dplora"))


def test_fedavg_over_adapters_is_the_weighted_mean_and_garbage_is_left_out():
    from strategies.privytune import PrivyTuneFedAvg

    config = ppt.PrivyTuneConfig.from_dict({"clients": 3, "min_clients": 2, "epsilon": 1.0})
    shapes = {"a": (2, 3), "b": (4,)}
    strategy = PrivyTuneFedAvg(config, shapes, [1])
    rng = np.random.default_rng(0)
    sites = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
             for _ in range(3)]
    weights = [10, 30, 5]
    replies = [_reply(sites[i], {"num-examples": weights[i], "epsilon_spent": 0.5}, i + 1)
               for i in range(3)]
    replies[2] = _reply({"a": sites[2]["a"]}, {"num-examples": 5, "epsilon_spent": 0.5}, 3)
    arrays, _ = strategy.aggregate_train(1, replies)
    for key in shapes:
        expected = (10 * sites[0][key] + 30 * sites[1][key]) / 40
        # Flower averages in float32: equal up to its rounding
        np.testing.assert_allclose(arrays[key].numpy(), expected, rtol=1e-6, atol=1e-7)
    assert [r["node"] for r in strategy.outcome.rejected] == [3]
    assert "missing" in strategy.outcome.rejected[0]["reason"]
    over = [_reply(sites[i], {"num-examples": 10, "epsilon_spent": 5.0}, i + 1) for i in range(3)]
    with pytest.raises(Exception, match="epsilon_spent=5.0"):
        strategy.aggregate_train(2, over)


def test_server_learning_rate_scales_the_average_update():
    """server_lr (Flower's FedAvgM, no momentum) moves the global weights by eta times the
    average update: eta = 2 doubles FedAvg's step from the global weights the round sent;
    central DP refuses it (Flower's wrapper takes plain FedAvg)."""
    from strategies.privytune import PrivyTuneFedAvg

    shapes = {"a": (2, 3)}
    rng = np.random.default_rng(1)
    start = {"a": rng.standard_normal((2, 3)).astype(np.float32)}
    sites = [{"a": rng.standard_normal((2, 3)).astype(np.float32)} for _ in range(2)]
    results = {}
    for eta in (1.0, 2.0):
        config = ppt.PrivyTuneConfig.from_dict({"clients": 2, "epsilon": 1.0, "server_lr": eta})
        strategy = PrivyTuneFedAvg(config, shapes, [])
        strategy.configure_train(1, ArrayRecord({"a": Array(start["a"])}), ConfigRecord(),
                                 _Grid([1, 2]))
        arrays, _ = strategy.aggregate_train(1, [
            _reply(sites[i], {"num-examples": 10, "epsilon_spent": 0.5}, i + 1)
            for i in range(2)])
        results[eta] = arrays["a"].numpy()
    mean = (sites[0]["a"] + sites[1]["a"]) / 2
    np.testing.assert_allclose(results[1.0], mean, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(results[2.0], start["a"] + 2 * (mean - start["a"]), rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(ValueError, match="server_lr=4.0 is invalid: expected 1"):
        ppt.PrivyTuneConfig.from_dict({"server_lr": 4.0, "central_dp": "server",
                                       "central_noise": 1.0})


def test_two_site_flower_simulation_end_to_end(tiny_dir, tiny_task, tmp_path):
    """The whole method on the Simulation Engine: sites' cosines, DP-LoRA rounds with FedAvg,
    per-site epsilon, the audit, the central baseline, the saved model reloads."""
    from conftest import privytune_in_process, privytune_tiny_settings, same_privytune_result
    from transformers import AutoModelForCausalLM

    from server.simulation import simulate_method

    out = tmp_path / "run"
    simulate_method("privytune", privytune_tiny_settings(tiny_dir, tiny_task, out))
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok"
    fed, central = report["results"]
    assert fed["name"] == "federated" and central["name"] == "central"
    assert fed["layers"] == 2 and fed["sites"] == 2
    assert 0 <= fed["accuracy"] <= 1 and 0 <= central["accuracy"] <= 1
    sites = report["sites"]
    assert sorted((m["round"], m["partition"]) for m in sites) == [(1, 0), (1, 1), (2, 0),
                                                                    (2, 1)]
    for m in sites:  # each site's accountant: half the budget spent after round 1 of 2
        assert 0 < m["epsilon_spent"] <= 8.0 + 1e-6
    last = [m["epsilon_spent"] for m in sites if m["round"] == 2]
    first = [m["epsilon_spent"] for m in sites if m["round"] == 1]
    assert all(b > a for a, b in zip(first, last)) and max(last) == fed["epsilon_spent_max"]
    assert [r["round"] for r in report["rounds"]] == [0, 1, 2]
    assert report["dp_noise"].startswith("reproducible from dp_noise_seed=0")
    assert len(report["redundancy"]["matrix"]) == 4
    assert len(report["attack_sites"]) == 2 and 0 <= fed["auc"] <= 1
    assert (out / "cosine_matrix.png").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out / "model")
    assert reloaded.config.num_hidden_layers == 2
    size = report["model_size"]  # a float32 input saved in float32, 2 of its 3 layers
    assert (size["dtype"], size["dense_dtype"], str(reloaded.dtype)) == (
        "float32", "float32", "torch.float32")
    assert 2 / 3 < size["ratio"] < 1
    # the same run with the ClientApp called in this process: the same decisions
    same_privytune_result(report, privytune_in_process(privytune_tiny_settings(
        tiny_dir, tiny_task, tmp_path / "reference")))


def test_method_is_registered_with_its_flower_files():
    method = get_method("privytune")
    assert method.command == "privytune"
    assert set(method.actions) == {"query.cosines", "train.dplora", "query.attack"}


def test_bad_settings_are_named(tiny_task):
    for values, match in (({"epsilon": -1.0}, "epsilon=-1.0 is invalid"),
                          ({"dp_delta": 1.0}, "dp_delta=1.0 is invalid"),
                          ({"max_drop": -0.1}, "max_drop=-0.1 is invalid"),
                          ({"ratio": 1.0}, "ratio=1.0 is invalid")):
        with pytest.raises(ValueError, match=match):
            ppt.PrivyTuneConfig.from_dict({"task": tiny_task, **values})


def test_settings_are_composed_of_pieces():
    """Five pieces (the federation, redundancy removal, DP-SGD, the rounds with central DP, the
    audit) with the 42 flat settings in piece order; the DP-SGD piece makes the fine-tuning
    settings on its own; old imports keep working."""
    from fedcompress.layers.settings import RedundancySettings
    from fedcompress.privacy.settings import DPSGDSettings, ExtractionAttackSettings

    pieces = (ppt.PrivyTuneFederationSettings, RedundancySettings, DPSGDSettings,
              ppt.FederatedDPSettings, ExtractionAttackSettings)
    assert ppt.PrivyTuneConfig.pieces() == pieces
    assert ppt.PrivyTuneConfig.names() == [n for p in pieces for n in p.names()]
    assert len(ppt.PrivyTuneConfig.names()) == 42 and max(len(p.names()) for p in pieces) <= 20
    assert ppt.PrivyTuneConfig.owner("dp_noise_seed") is DPSGDSettings
    assert ppt.PrivyTuneConfig.owner("central_clip") is ppt.FederatedDPSettings
    config = ppt.PrivyTuneConfig(epsilon=2.0, dp_noise_seed=7, mode="full", labels="b,a")
    dp = config.piece(DPSGDSettings)
    assert dp == DPSGDSettings(epsilon=2.0, dp_noise_seed=7, mode="full")
    assert dp.private and dp.noise_note() == config.noise_note()
    assert "dp_noise_seed=7" in dp.noise_note()
    assert config.finetune_config(1.0, 3).lr == dp.full_lr and config.label_subset() == ("b", "a")
    assert not ppt.PrivyTuneConfig(epsilon=0.0).private
    assert ppt.REMOVALS == ("ratio", "greedy", "none") and ppt.SOURCES == ("sites", "public")


@pytest.mark.parametrize("values, match, piece", [
    ({"clients": 2, "min_clients": 3}, "min_clients=3 is invalid: expected at most clients=2",
     "PrivyTuneFederationSettings"),
    ({"central_dp": "server"}, "central_noise=0.0 is invalid", "FederatedDPSettings"),
    ({"central_dp": "client", "central_noise": 1.0, "server_momentum": 0.5},
     "server_lr=1.0 is invalid: expected 1", "FederatedDPSettings"),
])
def test_each_piece_checks_its_settings_alone_and_in_the_composition(values, match, piece):
    with pytest.raises(ValueError, match=match):
        getattr(ppt, piece)(**values)
    with pytest.raises(ValueError, match=match):
        ppt.PrivyTuneConfig.from_dict(values)


def test_the_composition_checks_across_its_pieces():
    """Central DP counts every site: a check across the federation and the rounds' pieces,
    which each accept their half."""
    ppt.PrivyTuneFederationSettings(clients=4, min_clients=3)
    ppt.FederatedDPSettings(central_dp="client", central_noise=1.0)
    with pytest.raises(ValueError, match="min_clients=3 is invalid: expected 0 or clients=4"):
        ppt.PrivyTuneConfig(clients=4, min_clients=3, central_dp="client", central_noise=1.0)
    assert ppt.PrivyTuneConfig(clients=4, min_clients=4, central_dp="client",
                               central_noise=1.0).central


PRIVYTUNE_STUDY = """
[bench]
model = "{model}"

[study.tiny]
kind = "privytune"
title = "tiny"
tasks = ["{task}"]
epsilon = 8.0
ratios = [0.34, 0.67]
compare_ratio = 0.67
batch_size = 8
lr = 0.01
max_length = 32
similarity_texts = 8
rounds = 1
attack_samples = 0

[study.tiny.attack]
objective = "lm"
corpus = "{corpus}"
train_examples = 8
max_length = 32
ratio = 0.34
rounds = 1
batch_size = 4
similarity_texts = 4
attack_samples = 2
epsilons = [8.0, 0.0]
"""


def test_study_plan_names_bad_keys_and_shares_cells(tiny_task):
    from fedcompress.bench.privytune_study import Layout
    from fedcompress.bench.sweep import BenchConfigError, plan

    def study(**table):
        return plan({"bench": {"model": "m"}, "study": {"p": {
            "kind": "privytune", "tasks": [tiny_task], **table}}})[0]

    planned = study(ratios=[0.34, 0.67], attack={"objective": "lm", "epsilons": [1.0, 0.0]})
    assert planned.kind == "privytune"
    kinds = [c.kind for c in planned.cells]
    # Table 1 (2 measures x 2 modes x DP or not) at the smallest ratio, whose pairwise cells
    # Tables 2-3 share, and the other ratio's 4; two audit cells
    assert kinds.count("privytune-classify") == 8 + 4 and kinds.count("privytune-attack") == 2
    assert len({c.id for c in planned.cells}) == len(planned.cells)
    layout = Layout.from_options(planned.options)
    assert layout.classify_cell((tiny_task, ""), "pairwise", "lora", True, 0.67).id in {
        c.id for c in planned.cells}
    assert dict(planned.cells[0].client)["model"] == "m"  # [bench] settings apply
    for table, message in (({"epsilonn": 1.0}, r"unknown setting\(s\) \['epsilonn'\]; "
                            r"expected some of .*'epsilon'"),
                           ({"attack": {"epsilon_list": [1]}}, r"study 'p.attack' .*unknown "
                            r"setting\(s\) \['epsilon_list'\]; expected some of .*'epsilons'"),
                           ({"ratios": [1.5]}, "study 'p': ratio=1.5 is invalid")):
        with pytest.raises(BenchConfigError, match=message):
            study(**table)


def test_study_writes_the_papers_tables_and_resumes(tiny_dir, tiny_task, tmp_path,
                                                     monkeypatch):
    from fedcompress.bench.privytune_study import fig2_name
    from fedcompress.bench.run import run_bench

    corpus = tmp_path / "private.jsonl"  # private text: the task's questions as documents
    with open(corpus, "w") as f:
        for line in open(f"{tiny_task}/train.jsonl"):
            f.write(json.dumps({"text": json.loads(line)["question"]}) + "\n")
    config = tmp_path / "study.toml"
    config.write_text(PRIVYTUNE_STUDY.format(model=tiny_dir, task=tiny_task, corpus=corpus))
    out = tmp_path / "out"
    planned = run_bench(config, out, dry_run=True, progress=False)
    assert planned.status == "planned" and planned.extra["plan"]["cells"] == 8 + 4 + 2
    real = ppt.central_run

    def audit_fails_without_dp(config, *args, **kwargs):
        if config.objective == "lm" and not config.private:
            raise RuntimeError("audit broke")
        return real(config, *args, **kwargs)

    monkeypatch.setattr(ppt, "central_run", audit_fails_without_dp)
    report = run_bench(config, out, progress=False)
    assert report.status == "incomplete"  # the failed cell is recorded, the others ran
    failed = [r for r in report.results if r["status"] != "ok"]
    assert [(r["kind"], r["epsilon"]) for r in failed] == [("privytune-attack", 0.0)]
    assert "RuntimeError: audit broke" in failed[0]["error"]
    md = (out / "report.md").read_text()
    for title in ("Table 1", "Table 2", "Table 3", "Table 4", "Table 6", "Wall time per cell"):
        assert f"#### {title}" in md
    table1 = md.split("#### Table 1")[1].split("####")[0]
    assert "ratio 0.67" in table1 and table1.count("(-L") == 8  # 2 of 3 layers removed
    assert (out / fig2_name(tiny_task)).exists() and fig2_name(tiny_task) == "fig2-task0.png"
    assert "fig2-task0.png" in md  # in the report's plots
    by_id = {r["id"]: r for r in report.results}
    for record in report.results:  # a reused cell carries its twin's result
        if "same_plan_as" in record:
            twin = by_id[record["same_plan_as"]]
            assert record["removed_layers"] == twin["removed_layers"]
            assert record.get("accuracy") == twin.get("accuracy")
    monkeypatch.setattr(ppt, "central_run", real)
    again = run_bench(config, out, progress=False)  # resumed: only the failed cell runs
    assert again.status == "ok" and again.extra["plan"]["pending"] == 1
    assert len((out / "results.jsonl").read_text().splitlines()) == 14 + 1
    from fedcompress.report_html import render_run

    assert "Table 6: extraction audit by epsilon" in render_run(out)


def test_a_former_privytune_study_cell_is_read_back(tmp_path):
    """A cell of the former ``privytune-study`` folder (OUT/cells/<id>.json) is the bench's
    cell of the same settings."""
    from fedcompress.bench.privytune_study import cell_of
    from fedcompress.bench.sweep import load_results

    settings = {"model": "m", "task": "t", "labels": "", "measure": "pairwise", "mode": "lora",
                "ratio": 0.1, "removal": "ratio", "epsilon": 1.0}
    (tmp_path / "cells").mkdir()
    (tmp_path / "cells" / "abc.json").write_text(json.dumps(
        {"status": "ok", "table": "classify", "settings": settings, "removed_layers": [3],
         "accuracy": 0.75, "epsilon": 1.0, "wall_seconds": 9.0}))
    results = load_results(tmp_path / "results.jsonl")
    cell = cell_of("classify", settings)
    assert list(results) == [cell.id]
    assert results[cell.id]["accuracy"] == 0.75 and results[cell.id]["kind"] == \
        "privytune-classify"


class _Grid:
    """The nodes FedAvg samples from (``configure_train`` asks for nothing else)."""

    def __init__(self, nodes):
        self.nodes = list(nodes)

    def get_node_ids(self):
        return self.nodes


def _central_setup(central_dp: str, sites: int = 3, noise: float = 0.5, clip: float = 0.1):
    from flwr.supercore.task_identity import TaskIdentity

    from strategies.privytune import PrivyTuneFedAvg, training_strategy

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1

    config = ppt.PrivyTuneConfig.from_dict({"clients": sites, "epsilon": 1.0,
                                            "central_dp": central_dp, "central_noise": noise,
                                            "central_clip": clip, "seed": 3,
                                            "central_noise_seed": 3})
    shapes = {"a": (2, 3), "b": (4,)}
    strategy = PrivyTuneFedAvg(config, shapes, [])
    rng = np.random.default_rng(1)
    current = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    sites_w = [{k: current[k] + rng.standard_normal(s).astype(np.float32) * (i + 1) * 0.05
                for k, s in shapes.items()} for i in range(sites)]
    return config, strategy, training_strategy(strategy), current, sites_w


def test_central_dp_server_side_is_the_clipped_mean_plus_seeded_noise():
    """Flower's server-side wrapper: each site's update clipped to C (L2 over all its arrays),
    equal weights (not num-examples), noise of std z*C/n from the round's seed; Flower's RDP
    accountant reports the site-level epsilon, growing with the rounds."""
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    from strategies.privytune import central_noise_seed

    config, strategy, dp, current, sites = _central_setup("server")
    assert isinstance(dp, DifferentialPrivacyServerSideFixedClipping)
    arrays = ArrayRecord({k: Array(v) for k, v in current.items()})
    spent = []
    for server_round in (1, 2):
        messages = list(dp.configure_train(server_round, arrays, ConfigRecord({}),
                                           _Grid([1, 2, 3])))
        assert {m.metadata.message_type for m in messages} == {"train.dplora"}
        replies = [_reply(sites[i], {"num-examples": 10 * (i + 1), "site-weight": 1,
                                     "epsilon_spent": 0.5}, i + 1) for i in range(3)]
        out, _ = dp.aggregate_train(server_round, replies)
        clipped = []
        for site in sites:
            update = {k: site[k].astype(np.float64) - current[k] for k in current}
            norm = np.sqrt(sum((u ** 2).sum() for u in update.values()))
            clipped.append({k: u * min(1.0, 0.1 / norm) for k, u in update.items()})
        noise_rng = np.random.RandomState(central_noise_seed(3, server_round))
        for key in current:  # Flower adds noise array by array, in the record's order
            mean = current[key] + sum(c[key] for c in clipped) / 3
            noise = noise_rng.normal(0, 0.5 * 0.1 / 3, current[key].shape).astype(np.float32)
            np.testing.assert_allclose(out[key].numpy(), mean + noise, rtol=1e-5, atol=1e-6)
        spent.append(dp.central_spent[-1]["epsilon"])
    assert 0 < spent[0] < spent[1] and dp.central_spent[-1]["releases"] == 2
    assert len(strategy.stage_metrics("train")) == 6  # validated by the PrivyTune strategy


def test_central_dp_needs_every_site_and_equal_weights():
    from strategies.common import NotEnoughClientsError

    config, strategy, dp, current, sites = _central_setup("server")
    arrays = ArrayRecord({k: Array(v) for k, v in current.items()})
    list(dp.configure_train(1, arrays, ConfigRecord({}), _Grid([1, 2, 3])))
    replies = [_reply(sites[i], {"num-examples": 10, "site-weight": 1, "epsilon_spent": 0.5},
                      i + 1) for i in range(2)]
    replies.append(_reply(sites[2], {"num-examples": 10, "site-weight": 5,
                                     "epsilon_spent": 0.5}, 3))
    with pytest.raises(NotEnoughClientsError, match="2 valid client replies, the run needs 3"):
        dp.aggregate_train(1, replies)
    assert "site-weight=5" in strategy.outcome.rejected[0]["reason"]
    for values, match in (({"central_dp": "server"}, "central_noise=0.0 is invalid"),
                          ({"central_dp": "client", "central_noise": 1.0, "clients": 4,
                            "min_clients": 3}, "min_clients=3 is invalid"),
                          ({"central_dp": "both"}, "central_dp='both' is invalid")):
        with pytest.raises(ValueError, match=match):
            ppt.PrivyTuneConfig.from_dict(values)


def test_central_dp_client_side_clips_the_update_at_the_site(monkeypatch):
    """Client-side wrapper: the server sends the clipping norm; the site's reply passes through
    Flower's fixedclipping_mod, which clips its update to that norm."""
    from flwr.app import Context
    from flwr.supercore.task_identity import TaskIdentity

    import clients.privytune as site

    config, strategy, dp, current, sites = _central_setup("client", clip=0.01)
    arrays = ArrayRecord({k: Array(v) for k, v in current.items()})
    settings = {k: v for k, v in config.to_dict().items() if v != ""}
    message = next(iter(dp.configure_train(1, arrays, ConfigRecord(settings), _Grid([1, 2, 3]))))
    assert message.content["config"]["clipping_norm"] == 0.01

    def fake_train(msg, context):  # the site's training: far from the global weights
        return Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in
                                                          sites[2].items()}),
                                   "metrics": MetricRecord({"num-examples": 1})}),
                       reply_to=msg)

    monkeypatch.setattr(site, "_train", fake_train)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    reply = site.train(message, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                                        run_config={}))
    update = [reply.content["arrays"][k].numpy() - current[k] for k in current]
    assert np.sqrt(sum((u.astype(np.float64) ** 2).sum() for u in update)) == pytest.approx(
        0.01, rel=1e-4)
    content = message.content
    del content["config"]["clipping_norm"]
    with pytest.raises(ValueError, match="carries no 'clipping_norm'"):
        site.train(Message(content, dst_node_id=1, message_type="train.dplora"), None)


def test_central_dp_run_reports_the_site_level_epsilon_per_round(tiny_dir, tiny_task, tmp_path):
    """The whole pipeline (ClientApp handlers in-process) under client-side central DP: every
    round's site-level epsilon from Flower's accountant in the report, next to each site's
    record-level epsilon."""
    from conftest import privytune_in_process, privytune_tiny_settings

    report = privytune_in_process(privytune_tiny_settings(
        tiny_dir, tiny_task, tmp_path / "run", attack_samples=0, baselines="",
        central_dp="client", central_noise=2.0, central_clip=0.5, dp_noise_seed=-1))
    assert report["status"] == "ok"
    assert report["dp_noise"].startswith("secret")  # the sites' DP-SGD noise: the default
    central = report["central_dp"]
    assert central["wrapper"] == "client" and [r["round"] for r in central["rounds"]] == [1, 2]
    assert central["noise"].startswith("secret")  # no seed a reader could replay
    assert 0 < central["rounds"][0]["epsilon"] < central["rounds"][1]["epsilon"]
    fed = report["results"][0]
    assert fed["central_epsilon"] == central["rounds"][1]["epsilon"]
    assert 0 < fed["epsilon_spent_max"] <= 8.0 + 1e-6


def test_study_cells_with_the_same_plan_share_one_result():
    """Two cells that remove the same layers with every other setting equal (e.g. both
    redundancy measures picking the same layers) train the same model: one run serves both."""
    from fedcompress.bench.privytune_study import CellRunner, cell_of

    adjacent = cell_of("classify", {"task": "t", "measure": "adjacent", "ratio": 0.1,
                                    "mode": "lora"})
    pairwise = cell_of("classify", {"task": "t", "measure": "pairwise", "ratio": 0.2,
                                    "mode": "lora"})
    full = cell_of("classify", {"task": "t", "measure": "pairwise", "ratio": 0.1,
                                "mode": "full"})
    key = CellRunner.plan_key
    assert key(adjacent, (1, 2)) == key(pairwise, (1, 2))
    assert key(adjacent, (1, 2)) != key(pairwise, (1, 3))
    assert key(pairwise, (1, 2)) != key(full, (1, 2))


def test_central_dp_noise_is_secret_by_default():
    """Without central_noise_seed the noise comes from fresh OS entropy: two aggregations of the
    same replies differ (a seed in the report would let its readers remove the noise), and the
    report says which kind of noise the run had."""
    from strategies.privytune import central_noise_seed

    outs = []
    for _ in range(2):
        config, strategy, dp, current, sites = _central_setup("server")
        dp.validator.config = config.replace(central_noise_seed=-1)
        arrays = ArrayRecord({k: Array(v) for k, v in current.items()})
        list(dp.configure_train(1, arrays, ConfigRecord({}), _Grid([1, 2, 3])))
        replies = [_reply(sites[i], {"num-examples": 10, "site-weight": 1,
                                     "epsilon_spent": 0.5}, i + 1) for i in range(3)]
        outs.append(dp.aggregate_train(1, replies)[0]["a"].numpy())
    assert not np.array_equal(outs[0], outs[1])
    assert central_noise_seed(-1, 1) != central_noise_seed(-1, 1)
    assert central_noise_seed(3, 1) == central_noise_seed(3, 1)
