"""FedSpaLLM (``aggregate=fedspallm``) through Flower's strategy and ClientApp in process: the
sites' releases over the wire give the library's run exactly; a layer budget deals every layer;
a bad release is left out with its reason; the ServerApp reports the run with its wire cost;
settings that apply to FedPrLLM's votes or statistics are refused. Under `flwr run`, against a
hand-computed aggregation: tests/test_flwr_run.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import InProcessFederation
from flwr.app import Array, ArrayRecord, ConfigRecord

from fedcompress.config import SettingsError
from fedcompress.masks.codec import MaskDecodeError
from fedcompress.methods.fedprllm.federated import (
    FedPrLLMConfig,
    expected_shapes,
    federation_windows,
)
from fedcompress.methods.fedspallm import (
    decode_release,
    encode_release,
    fedspallm_prune,
    site_release,
)
from fedcompress.models import load_model
from fedcompress.pruning.local import apply_masks
from strategies.fedprllm import FedSpaLLMStrategy, make_strategy


class Federation(InProcessFederation):
    app = "clients.app"


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, device="cpu")


def config_for(tiny_dir, **kw) -> FedPrLLMConfig:
    base = dict(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16, batch_size=2,
                method="sparsegpt", aggregate="fedspallm")
    base.update(kw)
    return FedPrLLMConfig(**base)


def one_round(strategy, grid):
    replies = grid.send_and_receive(strategy.configure_train(1, ArrayRecord(), ConfigRecord(),
                                                             grid))
    strategy.aggregate_train(1, replies)


@pytest.mark.parametrize("layers,group", [(0, "layer"), (2, "row")])
def test_strategy_round_equals_the_library(tiny_dir, tiny, layers, group):
    config = config_for(tiny_dir, fedspallm_layers=layers, group=group)
    strategy = make_strategy(config, tiny.model)
    assert isinstance(strategy, FedSpaLLMStrategy) and strategy.num_rounds == 1
    one_round(strategy, Federation(4))
    assert not strategy.outcome.rejected
    windows = federation_windows(tiny.tokenizer, config)[0]
    run = fedspallm_prune(tiny.model, windows, 0.5, [layers or 3] * 4, "row", group, seed=0,
                          batch_size=2)
    assert [strategy.node_layers[100 + i] for i in range(4)] == run.assignment
    assert all(len(a) == (layers or 3) for a in run.assignment)
    assert sorted({i for a in run.assignment for i in a}) == [0, 1, 2]
    pruned = load_model(tiny_dir, device="cpu").model
    fractions = strategy.prune(pruned)
    reference = apply_masks(load_model(tiny_dir, device="cpu").model, run.masks, run.weights)
    for (key, a), (_, b) in zip(reference.state_dict().items(), pruned.state_dict().items()):
        assert torch.equal(a, b), key
    assert all(f == pytest.approx(0.5, abs=0.01) for f in fractions.values())
    up = [m["bytes_up"] for m in strategy.outcome.client_metrics]
    assert up == run.bytes_up_per_site


def test_release_round_trip_and_refusals(tiny_dir, tiny):
    config = config_for(tiny_dir)
    windows = federation_windows(tiny.tokenizer, config)[0][0]
    release = site_release(tiny.model, windows, [0, 2], 0.5, "row", 2)
    payload = encode_release(release)
    assert sum(a.nbytes for a in payload.values()) == release.nbytes()
    shapes = expected_shapes(tiny.model)
    back = decode_release(payload, [0, 2], shapes)
    for layer in (0, 2):
        for name, mask in release.masks[layer].items():
            assert torch.equal(back.masks[layer][name], mask)
            assert torch.equal(back.values[layer][name], release.values[layer][name])
    key = sorted(k for k in payload if k.endswith(".values"))[0]
    bad = [({k: v for k, v in payload.items() if k != key}, "missing"),
           ({**payload, key: payload[key][:-1]}, "float32 values"),
           ({**payload, key: payload[key].astype(np.float64)}, "float32 values"),
           ({**payload, key: np.full_like(payload[key], np.nan)}, "not finite")]
    for broken, match in bad:
        with pytest.raises(MaskDecodeError, match=match):
            decode_release(broken, [0, 2], shapes)
    with pytest.raises(MaskDecodeError, match="assigned layers"):
        decode_release(payload, [0, 1], shapes)


def test_a_bad_release_is_left_out_with_its_reason(tiny_dir, tiny):
    config = config_for(tiny_dir, min_clients=3)
    strategy = make_strategy(config, tiny.model)

    class Liar(Federation):
        def send_and_receive(self, messages, timeout=None):
            replies = super().send_and_receive(messages, timeout)
            record = replies[1].content["masks"]
            key = sorted(k for k in record if k.endswith(".values"))[0]
            record[key] = Array(record[key].numpy()[:-3])
            return replies

    one_round(strategy, Liar(4))
    assert [r["node"] for r in strategy.outcome.rejected] == [101]
    assert "float32 values" in strategy.outcome.rejected[0]["reason"]
    assert strategy.released == [100, 102, 103] and strategy.total.releases == 3
    strategy.prune(load_model(tiny_dir, device="cpu").model)  # every layer is still held


def test_a_layer_no_valid_site_holds_is_an_error(tiny_dir, tiny):
    strategy = make_strategy(config_for(tiny_dir, clients=3, fedspallm_layers=1,
                                        min_clients=2), tiny.model)

    class Silent(Federation):
        def send_and_receive(self, messages, timeout=None):
            return super().send_and_receive(messages, timeout)[1:]

    one_round(strategy, Silent(3))
    with pytest.raises(ValueError, match=r"decoder layers \[\d\] are in no valid site"):
        strategy.prune(load_model(tiny_dir, device="cpu").model)


@pytest.mark.parametrize("kw,key", [
    (dict(method="wanda"), "method"), (dict(mode="iterative"), "mode"),
    (dict(scale=True), "scale"), (dict(secagg=True), "secagg"),
    (dict(sparsity_profile="owl"), "sparsity_profile"), (dict(nm="2:4"), "nm"),
    (dict(aggregate="votes", fedspallm_layers=2), "fedspallm_layers"),
])
def test_settings_that_do_not_apply_are_refused(tiny_dir, kw, key):
    with pytest.raises(SettingsError, match=f"{key}=.* is invalid"):
        config_for(tiny_dir, **kw)


def test_a_budget_above_the_layers_is_refused(tiny_dir, tiny):
    with pytest.raises(ValueError, match="fedspallm_layers=4: the model has 3"):
        make_strategy(config_for(tiny_dir, fedspallm_layers=4), tiny.model)


def test_server_app_reports_fedspallm(tiny_dir, tmp_path):
    from server.fedprllm import run

    out = tmp_path / "run"
    settings = dict(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16, batch_size=2,
                    eval_seqlen=16, eval_windows=2, out=str(out), device="cpu",
                    method="sparsegpt", aggregate="fedspallm", fedspallm_layers=2,
                    baselines="local-only")
    run(Federation(4), settings)
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok", report.get("error")
    fed, local = report["results"]
    assert fed["name"] == "fedspallm-layer" and fed["rounds"] == 1
    assert abs(fed["sparsity"] - 0.5) < 1e-3
    assert sorted(len(v) for v in report["fedspallm_layers"].values()) == [2] * 4
    assert fed["bytes_up_per_client"] > 0 and local["name"] == "local-only"
    with pytest.raises(ValueError, match="variants 'all' with aggregate fedspallm"):
        run(Federation(4), {**settings, "variants": "all", "out": str(tmp_path / "x")})
