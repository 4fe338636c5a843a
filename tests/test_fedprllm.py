"""FedPrLLM end to end on tiny models: the real ClientApp and strategy (messages handled in
process, without Ray), the iterative mode, bad clients, and one real Flower simulation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import InProcessFederation
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from fedcompress.methods.fedprllm.federated import (
    FedPrLLMConfig,
    InvalidMaskError,
    MaskAggregator,
    ServerConfig,
    client_windows,
    decode_masks,
    encode_masks,
    expected_shapes,
    federation_windows,
    iterative_client_step,
    mask_key,
    public_reference_wire,
)
from fedcompress.models import load_model
from fedcompress.pruning.local import PruneConfig, local_masks
from strategies.fedprllm import FedPrLLM, IterativeFedPrLLM, NotEnoughClientsError, make_strategy


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, device="cpu")


def config_for(tiny_dir, **kw) -> FedPrLLMConfig:
    base = dict(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16, batch_size=2)
    base.update(kw)
    return FedPrLLMConfig(**base)


def windows_for(tiny, config):
    return federation_windows(tiny.tokenizer, config)[0]


class Federation(InProcessFederation):
    """The FedPrLLM ClientApp's messages handled in-process."""

    app = "clients.app"


def run_rounds(strategy, grid):
    for rnd in range(1, strategy.num_rounds + 1):
        replies = grid.send_and_receive(strategy.configure_train(rnd, ArrayRecord(),
                                                                 ConfigRecord(), grid))
        strategy.aggregate_train(rnd, replies)


# -- configuration errors, before any work --------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(sparsity=1.0), r"sparsity=1.0 is invalid: expected a number in \[0, 1\)"),
    (dict(sparsity=-0.1), "sparsity=-0.1"),
    (dict(clients=0), "clients=0 is invalid: expected an integer >= 1"),
    (dict(nm="4:4"), "N:M"), (dict(group="block"), "group='block' is invalid: expected one of"),
    (dict(mode="async"), "mode"), (dict(tie_break="coin"), "tie_break"),
    (dict(partition="dirichlet", alpha=0.0), "alpha"),
    (dict(method="obs"), "method='obs' is invalid: expected one of 'magnitude', 'wanda'"),
    (dict(min_clients=20), "min_clients"), (dict(clients=True), "clients=True"),
    (dict(seqlen=1.5), "seqlen=1.5"),
])
def test_bad_config(kw, message):
    with pytest.raises(ValueError, match=message):
        FedPrLLMConfig(**kw)


def test_more_clients_than_windows():
    with pytest.raises(ValueError, match="more clients"):
        client_windows(torch.arange(1000), 8, 1, 16, total_windows=4)


def test_unknown_setting():
    with pytest.raises(ValueError, match="unknown FedPrLLM setting"):
        FedPrLLMConfig.from_dict({"sparsty": 0.5})


# -- the wire format and validation ----------------------------------------------------------
def test_masks_round_trip_and_validation(tiny):
    shapes = expected_shapes(tiny.model)
    windows = torch.randint(5, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    result = local_masks(tiny.model, windows, PruneConfig("wanda", 0.5, "row"))
    payload = encode_masks(result.masks)
    decoded = decode_masks(payload, shapes, 0.5)
    assert all(torch.equal(decoded[mask_key(i, n)], m)
               for i, layer in enumerate(result.masks) for n, m in layer.items())
    key = mask_key(0, "self_attn.q_proj")
    bad = dict(payload)
    bad[key] = payload[key][:-1]
    with pytest.raises(InvalidMaskError, match="bytes"):
        decode_masks(bad, shapes, 0.5)
    bad[key] = payload[key].astype(np.int32)
    with pytest.raises(InvalidMaskError, match="uint8"):
        decode_masks(bad, shapes, 0.5)
    bad = {k: v for k, v in payload.items() if k != key}
    with pytest.raises(InvalidMaskError, match="missing"):
        decode_masks(bad, shapes, 0.5)
    bad = dict(payload, **{"layers.0.evil": payload[key]})
    with pytest.raises(InvalidMaskError, match="unexpected"):
        decode_masks(bad, shapes, 0.5)
    with pytest.raises(InvalidMaskError, match="sparsity"):
        decode_masks(payload, shapes, 0.7)


# -- ClientApp + strategy, in process ----------------------------------------------------------
def test_oneshot_federation_equals_in_process_vote(tiny_dir, tiny):
    config = config_for(tiny_dir)
    strategy = FedPrLLM(config, tiny.model)
    run_rounds(strategy, Federation(config.clients))
    assert strategy.aggregator.clients == 4 and not strategy.outcome.rejected

    # The same vote computed directly from each client's local masks.
    reference = MaskAggregator(tiny.model, 4)
    for windows in windows_for(tiny, config):
        result = local_masks(tiny.model, windows, config.prune)
        reference.add(decode_masks(encode_masks(result.masks), reference.shapes, 0.5))
    for key, counts in reference.counts().items():
        assert torch.equal(counts, strategy.aggregator.counts()[key])
    pruned = strategy.prune(load_model(tiny_dir, device="cpu").model)
    assert sorted(pruned) == sorted(strategy.shapes)
    assert all(abs(fraction - 0.5) < 1e-3 for fraction in pruned.values())


def test_one_client_equals_local_only(tiny_dir, tiny):
    config = config_for(tiny_dir, clients=1, samples_per_client=4)
    strategy = FedPrLLM(config, tiny.model)
    run_rounds(strategy, Federation(1))
    fed = strategy.aggregator.global_masks(config.server, 0.5)
    local = local_masks(tiny.model, windows_for(tiny, config)[0], config.prune)
    for i, layer in enumerate(local.masks):
        for name, mask in layer.items():
            assert torch.equal(fed[mask_key(i, name)], mask), (i, name)


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_iterative_layer0_equals_oneshot_and_runs_all_layers(tiny_dir, tiny, method):
    config = config_for(tiny_dir, method=method, mode="iterative")
    windows = windows_for(tiny, config)[0]
    oneshot = local_masks(tiny.model, windows, config.prune)
    masks0, hidden, kwargs = iterative_client_step(tiny.model, windows, 0, None, None,
                                                   config.prune)
    for name, mask in masks0.items():
        assert torch.equal(mask, oneshot.masks[0][name])
    if method == "wanda":  # no weight update: own masks as "global" reproduce the one-shot pass
        masks1, _, _ = iterative_client_step(tiny.model, windows, 1, hidden, masks0,
                                             config.prune, kwargs)
        for name, mask in masks1.items():
            assert torch.equal(mask, oneshot.masks[1][name])

    strategy = IterativeFedPrLLM(config, tiny.model)
    run_rounds(strategy, Federation(config.clients))
    assert strategy.num_rounds == 3 and sorted(strategy.global_masks) == [0, 1, 2]
    assert not strategy.outcome.rejected


@pytest.mark.parametrize("reference", ["wiki", "none"])
@pytest.mark.parametrize("mode", ["oneshot", "iterative"])
def test_compressed_wire_gives_the_same_vote_in_fewer_bytes(tiny_dir, tiny, mode, reference):
    packed_cfg = config_for(tiny_dir, mode=mode)
    config = config_for(tiny_dir, mode=mode, wire="compressed", wire_reference=reference)
    reference_wire = public_reference_wire(tiny.model, tiny.tokenizer, config)
    assert (reference_wire == {}) == (reference == "none")
    packed, compressed = (make_strategy(packed_cfg, tiny.model),
                          make_strategy(config, tiny.model, reference_wire))
    run_rounds(packed, Federation(4))
    run_rounds(compressed, Federation(4))
    assert not compressed.outcome.rejected
    for server in (ServerConfig("layer"), ServerConfig("row", scale=True)):
        a, b = load_model(tiny_dir, device="cpu").model, load_model(tiny_dir, device="cpu").model
        packed.prune(a, server if mode == "oneshot" else None)
        compressed.prune(b, server if mode == "oneshot" else None)
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                      b.state_dict().values()))
    up = [m["bytes_up"] for m in compressed.outcome.client_metrics]
    assert sum(up) < sum(m["bytes_up"] for m in packed.outcome.client_metrics)


def test_corrupted_compressed_payload_is_left_out(tiny_dir, tiny):
    config = config_for(tiny_dir, wire="compressed", min_clients=3)
    strategy = make_strategy(config, tiny.model,
                             public_reference_wire(tiny.model, tiny.tokenizer, config))
    grid = Federation(4)
    replies = grid.send_and_receive(strategy.configure_train(1, ArrayRecord(), ConfigRecord(),
                                                             grid))
    masks = {k: a.numpy().copy() for k, a in replies[2].content["masks"].items()}
    key = next(iter(masks))
    masks[key][-1] ^= 0xFF
    replies[2] = Message(RecordDict({"masks": ArrayRecord({k: Array(v) for k, v in masks.items()}),
                                     "metrics": MetricRecord({"seconds": 0.0})}),
                         reply_to=Message(RecordDict(), dst_node_id=replies[2].metadata.src_node_id,
                                          message_type="train.masks"))
    strategy.aggregate_train(1, replies)
    rejected = strategy.outcome.rejected
    assert strategy.aggregator.clients == 3 and "invalid masks" in rejected[0]["reason"]


def _tamper(reply: Message, how: str) -> Message:
    masks = {k: a.numpy() for k, a in reply.content["masks"].items()}
    key = next(iter(masks))
    if how == "shape":
        masks[key] = masks[key][:-3]
    elif how == "dtype":
        masks[key] = masks[key].astype(np.float32)
    elif how == "name":
        masks["layers.0.unknown"] = masks.pop(key)
    elif how == "sparsity":
        masks[key] = np.full_like(masks[key], 255)
    content = RecordDict({"masks": ArrayRecord({k: Array(v) for k, v in masks.items()}),
                          "metrics": MetricRecord({"seconds": 0.0})})
    return Message(content, reply_to=Message(RecordDict(), dst_node_id=reply.metadata.src_node_id,
                                             message_type="train.masks"))


@pytest.mark.parametrize("how", ["shape", "dtype", "name", "sparsity"])
def test_bad_client_is_left_out_and_run_goes_on(tiny_dir, tiny, how, caplog):
    config = config_for(tiny_dir, min_clients=3)
    strategy = FedPrLLM(config, tiny.model)
    grid = Federation(4)
    replies = grid.send_and_receive(strategy.configure_train(1, ArrayRecord(), ConfigRecord(),
                                                             grid))
    replies[1] = _tamper(replies[1], how)
    strategy.aggregate_train(1, replies)
    assert strategy.aggregator.clients == 3
    rejected = strategy.outcome.rejected
    assert len(rejected) == 1 and "invalid masks" in rejected[0]["reason"]
    assert "client node 101 left out: invalid masks" in caplog.text


def test_node_that_fails_at_startup_is_not_asked_again(tiny_dir, tiny):
    config = config_for(tiny_dir, min_clients=3)
    strategy = FedPrLLM(config, tiny.model)
    grid = Federation(4)
    real = grid.send_and_receive
    bad = sorted(grid.get_node_ids())[2]

    def broken_site(messages, timeout=None):
        replies = real(messages)
        return [Message(Error(code=0, reason="data-path /nope does not exist"), reply_to=m)
                if m.metadata.dst_node_id == bad else r for m, r in zip(messages, replies)]

    grid.send_and_receive = broken_site
    strategy.warmup(grid, timeout=60)
    assert strategy.failed_nodes == {bad}
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    assert len(messages) == 3 and bad not in {m.metadata.dst_node_id for m in messages}
    strategy.aggregate_train(1, real(messages))
    assert strategy.aggregator.clients == 3
    assert [r["round"] for r in strategy.outcome.rejected] == [0]  # recorded once, at start-up
    strict = FedPrLLM(config_for(tiny_dir), tiny.model)  # every client needed
    strict.warmup(grid, timeout=60)
    with pytest.raises(NotEnoughClientsError, match="1 failed at start-up"):
        strict.configure_train(1, ArrayRecord(), ConfigRecord(), grid)


def test_too_few_valid_clients_fail_clearly(tiny_dir, tiny):
    config = config_for(tiny_dir)  # min_clients 0: all four must be valid
    strategy = FedPrLLM(config, tiny.model)
    grid = Federation(4)
    replies = grid.send_and_receive(strategy.configure_train(1, ArrayRecord(), ConfigRecord(),
                                                             grid))
    replies[0] = _tamper(replies[0], "shape")
    with pytest.raises(NotEnoughClientsError, match="3 valid client replies, the run needs 4"):
        strategy.aggregate_train(1, replies)


# -- a real Flower simulation (Ray) -----------------------------------------------------------
@pytest.mark.simulation
def test_flower_simulation_four_clients(tiny_dir, tiny, tmp_path):
    import psutil

    from server.simulation import _ray_pids, simulate_method

    before = _ray_pids()
    out = tmp_path / "sim"
    settings = dict(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16, batch_size=2,
                    eval_seqlen=16, eval_windows=4, out=str(out), device="cpu",
                    baselines="dense,centralized,local-only", variants="all",
                    wire="compressed")  # flwr run (test_flwr_run.py) covers the packed format
    simulate_method("fedprllm", settings)
    orphans = [p for p in _ray_pids() - before if psutil.pid_exists(p)
               and psutil.Process(p).ppid() == 1 and psutil.Process(p).status() != "zombie"]
    assert orphans == [], "the simulation left Ray processes behind"
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok" and report["rejected"] == []
    names = [r["name"] for r in report["results"]]
    assert names[0] == "dense" and names[-2:] == ["centralized", "local-only"]
    assert len([n for n in names if n.startswith("fedprllm-oneshot-")]) == 6
    fed = next(r for r in report["results"] if r["name"] == "fedprllm-oneshot-layer")
    assert fed["valid_clients"] == 4 and fed["rounds"] == 1
    assert abs(fed["sparsity"] - 0.5) < 1e-3
    packed = sum((np.prod(s) + 7) // 8 for s in expected_shapes(tiny.model).values())
    assert fed["wire"] == "compressed" and 0 < fed["bytes_up_per_client"] < packed
    assert fed["bits_per_weight_up"] < 1
    assert (out / "model" / "config.json").exists()
    size = report["model_size"]  # a float32 input saved in float32: the mask keeps the size
    assert (size["dtype"], size["dense_dtype"], size["format"]) == ("float32", "float32",
                                                                     "dense")
    assert size["saved_bytes"] > size["weights_bytes"] and 1.0 < size["ratio"] < 1.05

    # The simulated vote (compressed wire, lossless) equals the in-process packed vote.
    config = config_for(tiny_dir)
    strategy = FedPrLLM(config, tiny.model)
    run_rounds(strategy, Federation(4))
    model = load_model(tiny_dir, device="cpu").model
    strategy.prune(model)
    saved = load_model(str(out / "model"), device="cpu").model
    for (k, a), (_, b) in zip(model.state_dict().items(), saved.state_dict().items()):
        assert torch.equal(a, b), k


def test_federation_windows_over_several_corpora(tiny):
    config = FedPrLLMConfig(model="unused", clients=4, samples_per_client=3, seqlen=16,
                            calib_text="wiki+shakespeare", partition="dirichlet", alpha=0.05)
    windows, sources = federation_windows(tiny.tokenizer, config)
    assert sum(len(w) for w in windows) == 12 and all(len(w) >= 1 for w in windows)
    assert sorted(s for part in sources for s in part) == ["shakespeare"] * 6 + ["wiki"] * 6
    # A small alpha concentrates each client on few sources; the split is seeded.
    again, again_sources = federation_windows(tiny.tokenizer, config)
    assert again_sources == sources and all(torch.equal(a, b) for a, b in zip(again, windows))
    with pytest.raises(ValueError, match="twice"):
        federation_windows(tiny.tokenizer, FedPrLLMConfig(model="x", calib_text="wiki+wiki"))


@pytest.mark.parametrize("mode", ["oneshot", "iterative"])
def test_federated_owl_plan_comes_from_the_sites_outlier_ratios(tiny_dir, tiny, tmp_path, mode):
    """sparsity_profile=owl: each site sends its layers' outlier ratios (round 0), the server prunes
    every layer at OWL's ratio of their mean; the global sparsity stays the target; the
    centralized baseline allocates from the union's ratios (centralized OWL)."""
    from fedcompress.pruning.local import outlier_ratios, owl_plan
    from server.fedprllm import run

    out = tmp_path / mode
    settings = dict(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16, batch_size=2,
                    eval_seqlen=16, eval_windows=2, out=str(out), device="cpu", mode=mode,
                    baselines="centralized", sparsity_profile="owl", owl_lambda=0.1, owl_m=2.0)
    run(Federation(4), settings)
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok", report.get("error")
    allocation = report["sparsity_profile"]
    config = config_for(tiny_dir, owl_m=2.0)
    site_windows = windows_for(tiny, config)
    sites = [outlier_ratios(tiny.model, w, 2.0, 2) for w in site_windows]
    assert allocation["sites_outlier_ratios"] == sites  # what each site computed, in order
    mean = [float(np.mean(column)) for column in zip(*sites)]
    plan = owl_plan(mean, 0.5, 0.1, tiny.model)
    assert allocation["plan"]["layers"] == pytest.approx(list(plan.layers), abs=1e-12)
    assert len(set(plan.layers)) > 1  # the tiny model's layers differ in outliers
    fed, central = report["results"]
    assert fed["sparsity_per_layer"] == pytest.approx(list(plan.layers), abs=0.02)
    assert fed["sparsity"] == pytest.approx(0.5, abs=0.01)
    union = owl_plan(outlier_ratios(tiny.model, torch.cat(site_windows), 2.0, 2), 0.5, 0.1,
                     tiny.model)
    assert allocation["baselines"]["centralized"]["plan"]["layers"] == \
        pytest.approx(list(union.layers), abs=1e-12)
    assert central["sparsity_per_layer"] == pytest.approx(list(union.layers), abs=0.02)


def test_owl_outliers_of_a_bad_site_are_left_out(tiny_dir, tiny):
    """A site whose outlier ratios are not one share per layer is named and left out; the
    others' mean decides."""
    config = config_for(tiny_dir, sparsity_profile="owl", min_clients=3)

    class Liar(Federation):
        def send_and_receive(self, messages, timeout=None):
            replies = super().send_and_receive(messages, timeout)
            bad = replies[1].content
            bad["outliers"] = ArrayRecord({"ratios": Array(np.array([0.1, 2.0, 0.1]))})
            return replies

    strategy = FedPrLLM(config, tiny.model)
    sites = strategy.collect_outliers(Liar(4), timeout=60)
    assert len(sites) == 3
    assert "outlier ratios outside [0, 1]" in strategy.outcome.rejected[0]["reason"]
    with pytest.raises(NotEnoughClientsError):
        FedPrLLM(config_for(tiny_dir, sparsity_profile="owl"), tiny.model).collect_outliers(
            Liar(4), timeout=60)


# -- iterative: resync of a site that missed a round, resume of an interrupted run ------------
def test_iterative_resume_equals_an_uninterrupted_run(tiny_dir, tiny, tmp_path):
    """The server is 'killed' after two of three layers: a new strategy resumes from the
    checkpoint with fresh sites (no state: every site resyncs) and prunes the same model."""
    config = config_for(tiny_dir, mode="iterative")
    full = IterativeFedPrLLM(config, tiny.model)
    run_rounds(full, Federation(4))
    reference = load_model(tiny_dir, device="cpu").model
    full.prune(reference)

    first = IterativeFedPrLLM(config, tiny.model, checkpoint=tmp_path / "ckpt")
    grid = Federation(4)
    for rnd in (1, 2):
        replies = grid.send_and_receive(first.configure_train(rnd, ArrayRecord(),
                                                              ConfigRecord(), grid))
        first.aggregate_train(rnd, replies)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "checkpoint.json", "layer-000.npz", "layer-001.npz"]
    resumed = IterativeFedPrLLM(config, tiny.model, checkpoint=tmp_path / "ckpt")
    assert resumed.resume(tmp_path / "ckpt") == 2 and resumed.num_rounds == 1
    run_rounds(resumed, Federation(4))
    assert resumed.resynced == {2: [100, 101, 102, 103]} and not resumed.outcome.rejected
    model = load_model(tiny_dir, device="cpu").model
    resumed.prune(model)
    for (k, a), (_, b) in zip(reference.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), k
    other = IterativeFedPrLLM(config.replace(sparsity=0.6), tiny.model)
    with pytest.raises(ValueError, match="other settings \\(sparsity\\)"):
        other.resume(tmp_path / "ckpt")


def test_a_site_that_missed_a_round_is_resynced(tiny_dir, tiny):
    config = config_for(tiny_dir, mode="iterative", min_clients=3)
    strategy = IterativeFedPrLLM(config, tiny.model)

    class Flaky(Federation):
        def send_and_receive(self, messages, timeout=None):
            layer = int(messages[0].content["round"]["layer"])
            keep = [m for m in messages if not (layer == 1 and m.metadata.dst_node_id == 101)]
            return super().send_and_receive(keep, timeout)

    run_rounds(strategy, Flaky(4))
    assert strategy.resynced == {2: [101]}
    # the round's missing reply is on record (node, round, layer, reason), nothing else
    assert strategy.outcome.rejected == [
        {"stage": "masks", "round": 2, "node": 101, "layer": 1, "partition": 1,
         "reason": "no reply within the round timeout"}]
    assert [strategy.layer_aggregators[i].clients for i in range(3)] == [4, 3, 4]
    # its masks at layer 2 are those of a site that never left (same global masks so far)
    reference = IterativeFedPrLLM(config, tiny.model)
    reference.global_masks = dict(strategy.global_masks)
    reference.layer_nodes = {1: {100, 101, 102, 103}}
    grid = Federation(4)
    for rnd in (1, 2):  # rebuild every site's state with the flaky run's global masks
        grid.send_and_receive(reference.configure_train(rnd, ArrayRecord(), ConfigRecord(),
                                                        grid))
    replies = grid.send_and_receive(reference.configure_train(3, ArrayRecord(), ConfigRecord(),
                                                              grid))
    reference.aggregate_train(3, replies)
    for key, counts in reference.layer_aggregators[2].counts().items():
        assert torch.equal(counts, strategy.layer_aggregators[2].counts()[key])


@pytest.mark.parametrize("fault, reason", [("error", "client error"),
                                           ("corrupt", "invalid masks"), ("slow", None)])
def test_injected_faults_are_left_out_and_the_run_goes_on(tiny_dir, tiny, fault, reason):
    config = config_for(tiny_dir, min_clients=3, fault=fault, faulty=1, fault_seconds=0.2)
    strategy = FedPrLLM(config, tiny.model)
    grid = Federation(4)
    grid.errors_as_replies = True
    replies = grid.send_and_receive(strategy.configure_train(1, ArrayRecord(), ConfigRecord(),
                                                             grid))
    strategy.aggregate_train(1, replies)
    rejected = strategy.outcome.rejected
    if reason is None:  # late but within the (in-process: absent) round timeout
        assert strategy.aggregator.clients == 4 and not rejected
    else:
        assert strategy.aggregator.clients == 3
        assert [r["node"] for r in rejected] == [103] and reason in rejected[0]["reason"]
    with pytest.raises(ValueError, match="faulty=0 is invalid"):
        config_for(tiny_dir, fault="error")
    with pytest.raises(ValueError, match="fault_layer=1 is invalid: expected 0 in one-shot"):
        config_for(tiny_dir, fault="kill", faulty=1, fault_layer=1)
    with pytest.raises(ValueError, match="fault_layer=1 is invalid: expected 0 with fault none"):
        config_for(tiny_dir, mode="iterative", fault_layer=1)


def test_a_fault_from_a_given_layer_on(tiny_dir, tiny):
    """fault_layer=1: the faulty site answers layer 0, then fails every later round (its
    rejection names the node, its partition, the round and the layer)."""
    config = config_for(tiny_dir, mode="iterative", min_clients=3, fault="error", faulty=1,
                        fault_layer=1)
    strategy = IterativeFedPrLLM(config, tiny.model)
    grid = Federation(4)
    grid.errors_as_replies = True
    run_rounds(strategy, grid)
    assert [strategy.layer_aggregators[i].clients for i in range(3)] == [4, 3, 3]
    assert [(r["node"], r["partition"], r["round"], r["layer"]) for r in
            strategy.outcome.rejected] == [(103, 3, 2, 1), (103, 3, 3, 2)]
    assert all("injected fault: partition 3 fails" in r["reason"]
               for r in strategy.outcome.rejected)

