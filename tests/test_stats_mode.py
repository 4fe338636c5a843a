"""Statistics mode of federated pruning (``aggregate=stats``): the sites' summed input statistics
give the centralized result (Wanda: every mask bit; SparseGPT: every mask bit and weights up to
float64 summation order), through the library, the Flower strategy and ClientApp in process,
and the ServerApp; bad statistics are rejected with their reason; resync and resume as in the
iterative vote."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import InProcessFederation
from flwr.app import Array, ArrayRecord, ConfigRecord

from fedcompress.config import SettingsError
from fedcompress.methods.fedprllm.federated import FedPrLLMConfig, federation_windows
from fedcompress.methods.fedprllm.stats import (
    InvalidStatsError,
    StatsAggregator,
    decode_stats,
    encode_stats,
    layer_in_features,
    stats_nbytes,
    stats_prune,
    validate_stats,
)
from fedcompress.models import ModelAdapter, load_model
from fedcompress.pruning.local import apply_masks, local_masks
from fedcompress.pruning.walker import LayerStats, capture_layer_inputs, collect_stats
from strategies.fedprllm import StatsFedPrLLM, make_strategy

#: Linear layers of a llama block fed by the same tensor: sent once (the first in name order).
SHARED = {"self_attn.q_proj": "self_attn.k_proj", "self_attn.v_proj": "self_attn.k_proj",
          "mlp.up_proj": "mlp.gate_proj"}


class Federation(InProcessFederation):
    app = "clients.app"


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, device="cpu")


def config_for(tiny_dir, **kw) -> FedPrLLMConfig:
    base = dict(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16, batch_size=2,
                aggregate="stats")
    base.update(kw)
    return FedPrLLMConfig(**base)


def run_rounds(strategy, grid):
    for rnd in range(1, strategy.num_rounds + 1):
        replies = grid.send_and_receive(strategy.configure_train(rnd, ArrayRecord(),
                                                                 ConfigRecord(), grid))
        strategy.aggregate_train(rnd, replies)


def centralized(model, windows, config):
    """The centralized pass on the union, in other batches than any site's."""
    return local_masks(model, torch.cat(windows), config.prune, batch_size=3, keep_weights=True)


# -- statistics are sums ----------------------------------------------------------------------
def test_layer_stats_of_split_tokens_add_up_to_the_union():
    torch.manual_seed(0)
    x = torch.randn(3, 40, 8)
    whole = LayerStats(8, hessian=True)
    whole.add(x)
    parts = LayerStats(8, hessian=True)
    for chunk in (x[:1], x[1:, :17], x[1:, 17:]):
        part = LayerStats(8, hessian=True)
        part.add(chunk)
        parts.merge(part)
    assert parts.tokens == whole.tokens == 120
    assert torch.equal(parts.sq_norm, whole.sq_norm)  # float64 sums: same float32 norms
    # float64 sums of exact float64 products: any grouping agrees to float64 rounding
    assert parts.hessian.dtype == whole.hessian.dtype == torch.float64
    torch.testing.assert_close(parts.hessian, whole.hessian, rtol=1e-13, atol=0)
    expected = x.reshape(-1, 8).double()
    assert torch.allclose(whole.sq_sum, expected.pow(2).sum(0))
    torch.testing.assert_close(whole.hessian, 2 * expected.T @ expected / 120, rtol=1e-13, atol=0)
    with pytest.raises(ValueError, match="4 input features"):
        whole.merge(LayerStats(4, hessian=True))
    with pytest.raises(ValueError, match="without a Hessian"):
        whole.merge(LayerStats(8))
    with pytest.raises(ValueError, match="no tokens"):
        LayerStats(8).sq_norm  # noqa: B018


def test_collect_stats_computes_a_shared_input_once_and_equals_per_linear_sums(tiny, monkeypatch):
    """q/k/v (and gate/up) are fed one tensor: its sums are computed once per batch, and every
    linear's statistics equal those of its own inputs added one by one."""
    from fedcompress.pruning import walker

    model = tiny.model
    inputs = capture_layer_inputs(model, torch.randint(0, 100, (3, 12)))
    layer = ModelAdapter(model).layers[0]
    calls = []
    real = walker.input_sums
    monkeypatch.setattr(walker, "input_sums", lambda x, h: calls.append(x) or real(x, h))
    stats = collect_stats(layer, inputs, hessian=True, batch_size=2)
    linears = ModelAdapter.linear_layers(layer)
    assert len(calls) == 2 * 4  # 2 batches x 4 distinct inputs (qkv, o, gate/up, down)
    seen: dict = {name: LayerStats(stats[name].in_features, hessian=True) for name in linears}
    monkeypatch.setattr(walker, "input_sums", real)
    handles = [m.register_forward_pre_hook(lambda _m, a, name=name: seen[name].add(a[0]))
               for name, m in linears.items()]
    try:
        with torch.no_grad():
            for rows in (slice(0, 2), slice(2, 3)):
                walker._call_layer(layer, inputs.hidden[rows], inputs.layer_kwargs[0])
    finally:
        for h in handles:
            h.remove()
    for name in linears:
        assert stats[name].tokens == seen[name].tokens == 36
        assert torch.equal(stats[name].sq_sum, seen[name].sq_sum), name
        assert torch.equal(stats[name].hessian_sum, seen[name].hessian_sum), name
    assert stats["self_attn.q_proj"] is not stats["self_attn.k_proj"]  # own objects


# -- the library's in-process run equals centralized pruning ----------------------------------
@pytest.mark.parametrize("method", ["wanda", "ria", "sparsegpt"])
@pytest.mark.parametrize("group", ["row", "layer"])
def test_stats_mode_equals_centralized_pruning_on_the_union(tiny_dir, tiny, method, group):
    config = config_for(tiny_dir, method=method, local_group=group)
    windows = federation_windows(tiny.tokenizer, config)[0]
    run = stats_prune(tiny.model, windows, config)
    central = centralized(tiny.model, windows, config)
    for layer, masks in enumerate(central.masks):
        for name, mask in masks.items():
            assert torch.equal(run.masks[layer][name], mask), (layer, name)
        if method != "sparsegpt":
            assert run.weights[layer] is None
            continue
        for name, weight in central.weights[layer].items():  # float64 Hessians: the same
            assert torch.equal(run.weights[layer][name], weight), (layer, name)
    features = layer_in_features(tiny.model, 0)
    assert run.bytes_up_per_site[0] == stats_nbytes(features, method == "sparsegpt", SHARED)


def test_stats_mode_takes_a_per_layer_plan_and_nm(tiny_dir, tiny):
    for kw in (dict(layer_sparsity="0.4,0.5,0.6"), dict(nm="2:4")):
        config = config_for(tiny_dir, **kw)
        windows = federation_windows(tiny.tokenizer, config)[0]
        run = stats_prune(tiny.model, windows, config)
        central = centralized(tiny.model, windows, config)
        for layer, masks in enumerate(central.masks):
            for name, mask in masks.items():
                assert torch.equal(run.masks[layer][name], mask), (kw, layer, name)


# -- wire ------------------------------------------------------------------------------------
def _site_stats(tiny, hessian: bool):
    windows = torch.randint(4, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    inputs = capture_layer_inputs(tiny.model, windows)
    return collect_stats(ModelAdapter(tiny.model).layers[0], inputs, hessian=hessian)


@pytest.mark.parametrize("hessian", [False, True])
def test_stats_round_trip_sends_shared_inputs_once(tiny, hessian):
    stats = _site_stats(tiny, hessian)
    arrays, shared = encode_stats(stats, 0)
    assert shared == SHARED
    features = layer_in_features(tiny.model, 0)
    back = decode_stats(arrays, shared, features, 0, hessian)
    assert back["self_attn.k_proj"] is back["self_attn.q_proj"]
    for name, st in stats.items():
        assert back[name].tokens == st.tokens
        assert torch.equal(back[name].sq_sum, st.sq_sum)
        if hessian:
            assert torch.equal(back[name].hessian_sum, st.hessian_sum)
    assert sum(a.nbytes for a in arrays.values()) == stats_nbytes(features, hessian, shared)


def test_packed_sum_equals_the_sum_of_the_full_matrices(tiny):
    """The server adds the sites' statistics in their wire form and unpacks once: every entry
    is the same float64 sum, in the same order, as merging the sites' full matrices (the
    bit-for-bit equality with centralized GPTQ / SparseGPT rests on it)."""
    features = layer_in_features(tiny.model, 0)
    aggregator = StatsAggregator(features, True)
    merged: dict = {}
    for seed in range(3):
        windows = torch.randint(4, 100, (2, 16), generator=torch.Generator().manual_seed(seed))
        stats = collect_stats(ModelAdapter(tiny.model).layers[0],
                              capture_layer_inputs(tiny.model, windows), hessian=True)
        arrays, shared = encode_stats(stats, 0)
        aggregator.add(validate_stats(arrays, shared, features, 0, True) if seed != 1
                       else decode_stats(arrays, shared, features, 0, True))  # either form
        decoded = decode_stats(arrays, shared, features, 0, True)
        for name in features:
            if name not in merged:
                merged[name] = LayerStats(features[name], hessian=True)
            merged[name].merge(decoded[name])
    summed = aggregator.layer_stats()
    assert aggregator.sites == 3 and summed is not aggregator.layer_stats()  # fresh objects
    for name, st in merged.items():
        assert summed[name].tokens == st.tokens
        assert torch.equal(summed[name].sq_sum, st.sq_sum)
        assert torch.equal(summed[name].hessian_sum, st.hessian_sum)
        assert torch.equal(summed[name].hessian_sum, summed[name].hessian_sum.T)
    with pytest.raises(ValueError, match="without a Hessian"):
        aggregator.add(decode_stats(*encode_stats(_site_stats(tiny, False), 0), features, 0,
                                    False))


def _mutations(arrays):
    sq = "stats.0.self_attn.k_proj.sq"
    yield "missing", {k: v for k, v in arrays.items() if k != sq}
    yield "unexpected", {**arrays, "stats.0.extra.sq": arrays[sq]}
    yield "expected float64", {**arrays, sq: arrays[sq].astype(np.float32)}
    yield "expected float64", {**arrays, sq: arrays[sq][:-1]}
    yield "non-negative", {**arrays, sq: -arrays[sq]}
    yield "finite", {**arrays, sq: np.full_like(arrays[sq], np.nan)}
    yield "positive int64", {**arrays, "stats.0.tokens": np.array([0], np.int64)}
    yield "positive int64", {**arrays, "stats.0.tokens": np.array([3.0])}
    h = "stats.0.self_attn.k_proj.h"
    yield "upper triangle", {**arrays, h: arrays[h][:-1]}
    yield "not twice the square sums", {**arrays, h: arrays[h] * 2}
    yield "not finite", {**arrays, h: np.full_like(arrays[h], np.inf)}


def test_bad_statistics_are_rejected_with_their_reason(tiny):
    stats = _site_stats(tiny, hessian=True)
    arrays, shared = encode_stats(stats, 0)
    features = layer_in_features(tiny.model, 0)
    for reason, bad in _mutations(arrays):
        with pytest.raises(InvalidStatsError, match=reason):
            decode_stats(bad, shared, features, 0, True)
    with pytest.raises(InvalidStatsError, match="unknown linear layers"):
        decode_stats(arrays, {**shared, "x_proj": "self_attn.k_proj"}, features, 0, True)
    with pytest.raises(InvalidStatsError, match="were not sent"):
        decode_stats({k: v for k, v in arrays.items() if ".o_proj." not in k},
                     {**shared, "self_attn.o_proj": "self_attn.q_proj"}, features, 0, True)
    with pytest.raises(InvalidStatsError, match="inputs\\) cannot share"):
        decode_stats({k: v for k, v in arrays.items() if ".down_proj." not in k},
                     {**shared, "mlp.down_proj": "self_attn.k_proj"}, features, 0, True)
    aggregator = StatsAggregator(features, True)
    with pytest.raises(InvalidStatsError, match="do not name"):
        aggregator.add({"self_attn.q_proj": stats["self_attn.q_proj"]})


# -- Flower strategy and ClientApp (in process) -----------------------------------------------
@pytest.mark.parametrize("method", ["wanda", "ria", "sparsegpt"])
def test_strategy_rounds_equal_the_library_and_centralized(tiny_dir, tiny, method):
    config = config_for(tiny_dir, method=method)
    strategy = make_strategy(config, tiny.model)
    assert isinstance(strategy, StatsFedPrLLM) and strategy.num_rounds == 3
    run_rounds(strategy, Federation(4))
    assert not strategy.outcome.rejected
    run = stats_prune(tiny.model, federation_windows(tiny.tokenizer, config)[0], config)
    for layer in range(3):
        for name, mask in run.masks[layer].items():
            assert torch.equal(strategy.global_masks[layer][name], mask)
        if method == "sparsegpt":
            for name, w in run.weights[layer].items():
                assert torch.equal(strategy.global_weights[layer][name], w)
    pruned = load_model(tiny_dir, device="cpu").model
    strategy.prune(pruned)
    windows = federation_windows(tiny.tokenizer, config)[0]
    central = centralized(tiny.model, windows, config)
    reference = apply_masks(load_model(tiny_dir, device="cpu").model, central.masks,
                            central.weights)
    for (key, a), (_, b) in zip(reference.state_dict().items(), pruned.state_dict().items()):
        assert torch.equal(a, b), key
    up = {m["bytes_up"] for m in strategy.outcome.client_metrics if m["layer"] == 0}
    assert up == {run.bytes_up_per_site[0]}


def test_the_sites_statistics_are_summed_in_partition_order_not_node_order(tiny_dir, tiny,
                                                                            monkeypatch):
    """Float64 sums round by their order, and SparseGPT's masks amplify the difference; the
    Simulation Engine draws node IDs anew each run, so the server adds the sites' statistics
    in the order of their partitions: node IDs that reverse the partitions sum as the
    in-process run does, site 0 first, bit for bit."""
    from fedcompress.methods.fedprllm import stats as stats_module

    config = config_for(tiny_dir, method="sparsegpt")

    class Reversed(Federation):  # node 100 holds the last partition
        def __init__(self, n):
            super().__init__(n)
            for i, context in enumerate(self.contexts.values()):
                context.node_config["partition-id"] = n - 1 - i

    added: list[float] = []
    add = stats_module.StatsAggregator.add

    def recording(self, stats):
        added.append(float(next(iter(stats.values())).sq_sum.sum()))
        return add(self, stats)

    strategy = make_strategy(config, tiny.model)
    monkeypatch.setattr(stats_module.StatsAggregator, "add", recording)
    run_rounds(strategy, Reversed(4))
    assert strategy.site_nodes[1] == [103, 102, 101, 100]
    served = added[:4]
    added.clear()
    run = stats_prune(tiny.model, federation_windows(tiny.tokenizer, config)[0], config)
    assert served == added[:4] and len(set(served)) == 4  # the same sites, in the same order
    for layer in range(3):
        for name, w in run.weights[layer].items():
            assert torch.equal(strategy.global_weights[layer][name], w)


def test_site_threads_hold_for_the_sites_steps_only(tiny_dir, tiny, monkeypatch):
    """``site_threads=1``: the sites' steps with a Simulation Engine actor's one thread (the
    floats a ``prune`` run's sites compute), the server's step and the caller with theirs."""
    import fedcompress.methods.fedprllm.federated as federated

    before = torch.get_num_threads()
    seen: list[int] = []
    original = federated.site_layer_stats

    def counting(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(federated, "site_layer_stats", counting)
    config = config_for(tiny_dir, method="sparsegpt")
    windows = federation_windows(tiny.tokenizer, config)[0]
    run = stats_prune(tiny.model, windows, config, site_threads=1)
    assert seen == [1] * 12 and torch.get_num_threads() == before  # 4 sites x 3 layers
    again = stats_prune(tiny.model, windows, config)
    assert all(torch.equal(run.masks[i][k], again.masks[i][k]) for i in range(3)
               for k in run.masks[i])


def test_a_site_with_garbage_statistics_is_left_out(tiny_dir, tiny):
    config = config_for(tiny_dir, min_clients=3)
    strategy = make_strategy(config, tiny.model)

    class Liar(Federation):
        def send_and_receive(self, messages, timeout=None):
            replies = super().send_and_receive(messages, timeout)
            record = replies[2].content["stats"]
            key = sorted(k for k in record if k.endswith(".sq"))[0]
            record[key] = Array(-record[key].numpy())
            return replies

    run_rounds(strategy, Liar(4))
    assert [r["node"] for r in strategy.outcome.rejected] == [102] * 3
    assert "non-negative" in strategy.outcome.rejected[0]["reason"]
    assert strategy.layer_sites == {0: 3, 1: 3, 2: 3}


def test_a_site_that_missed_a_round_is_resynced_with_the_updated_weights(tiny_dir, tiny):
    """SparseGPT: the returning site rebuilds its inputs through the earlier layers' masks AND
    updated weights, so the sum of the last layer is that of a site that never left."""
    config = config_for(tiny_dir, method="sparsegpt", min_clients=3)

    class Flaky(Federation):
        def send_and_receive(self, messages, timeout=None):
            layer = int(messages[0].content["round"]["layer"])
            keep = [m for m in messages if not (layer == 1 and m.metadata.dst_node_id == 101)]
            return super().send_and_receive(keep, timeout)

    flaky = make_strategy(config, tiny.model)
    run_rounds(flaky, Flaky(4))
    assert flaky.resynced == {2: [101]} and flaky.layer_sites == {0: 4, 1: 3, 2: 4}
    # Layer 2's statistics are those of four never-absent sites given the same layers 0-1.
    reference = make_strategy(config, tiny.model)
    reference.global_masks = {i: flaky.global_masks[i] for i in (0, 1)}
    reference.global_weights = {i: flaky.global_weights[i] for i in (0, 1)}
    reference.first_layer = 2
    run_rounds(reference, Federation(4))  # every site resyncs (no state), as after a resume
    for name, w in reference.global_weights[2].items():
        assert torch.equal(w, flaky.global_weights[2][name])


def test_resume_equals_an_uninterrupted_run(tiny_dir, tiny, tmp_path):
    config = config_for(tiny_dir, method="sparsegpt")
    full = make_strategy(config, tiny.model)
    run_rounds(full, Federation(4))
    first = make_strategy(config, tiny.model, checkpoint=tmp_path / "ckpt")
    grid = Federation(4)
    replies = grid.send_and_receive(first.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    first.aggregate_train(1, replies)
    resumed = make_strategy(config, tiny.model, checkpoint=tmp_path / "ckpt")
    assert resumed.resume(tmp_path / "ckpt") == 1 and resumed.num_rounds == 2
    run_rounds(resumed, Federation(4))
    a, b = (load_model(tiny_dir, device="cpu").model for _ in range(2))
    full.prune(a)
    resumed.prune(b)
    for (key, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), key


# -- settings and the ServerApp ---------------------------------------------------------------
@pytest.mark.parametrize("kw, key", [(dict(method="magnitude"), "method"),
                                     (dict(group="row"), "group"),
                                     (dict(scale=True), "scale"),
                                     (dict(defence="trim", trim=1), "defence"),
                                     (dict(attack="random", attackers=1), "attack")])
def test_settings_that_apply_to_votes_are_refused(tiny_dir, kw, key):
    with pytest.raises(SettingsError, match=f"{key}=.* is invalid"):
        config_for(tiny_dir, **kw)


def test_server_app_reports_stats_mode_next_to_centralized(tiny_dir, tmp_path):
    from server.fedprllm import run

    out = tmp_path / "run"
    settings = dict(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16, batch_size=2,
                    eval_seqlen=16, eval_windows=2, out=str(out), device="cpu",
                    aggregate="stats", baselines="centralized")
    run(Federation(4), settings)
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok", report.get("error")
    fed, central = report["results"]
    assert fed["name"] == "fedprllm-stats-row" and fed["rounds"] == 3
    assert fed["perplexity"] == central["perplexity"]
    assert sorted(report["stats_layers"]) == ["0", "1", "2"]
    assert (out / "checkpoint" / "checkpoint.json").exists()
    with pytest.raises(ValueError, match="variants 'all' with aggregate stats"):
        run(Federation(4), {**settings, "variants": "all", "out": str(tmp_path / "x")})


# -- statistics summed by SecAgg+ (fixed point) -------------------------------------------------
def test_fixed_point_sums_are_exact_up_to_the_stated_rounding():
    """Sites' fixed-point vectors summed mod 2^64 (what SecAgg+'s unmasking returns) decode to
    the float64 sum within n 2^-(f+1) per value, negative values included; token counts exact;
    a value beyond the range is refused, never clipped."""
    from fedcompress.methods.fedprllm.stats import (
        decode_fixed,
        encode_fixed,
        fixed_point_layout,
        fixed_point_range,
    )

    rng = np.random.default_rng(0)
    n, f = 5, 25
    sites = [{"stats.0.tokens": np.array([7 + i], np.int64),
              "stats.0.a.sq": rng.random(33) * 10.0 ** rng.integers(-6, 8, 33),
              "stats.0.a.h": (rng.standard_normal(21) * 1e3).astype(np.float32)}
             for i in range(n)]
    total = np.zeros(33 + 21 + 1, np.uint64)
    for arrays in sites:
        total += encode_fixed(arrays, f, n)  # wraps mod 2^64 as SecAgg+'s sum does
    layout = fixed_point_layout(sites[0])
    dtypes = {k: v.dtype for k, v in sites[0].items()}
    got = decode_fixed(total.view(np.int64), layout, f, dtypes)
    assert got["stats.0.tokens"].tolist() == [7 + 8 + 9 + 10 + 11]
    for key in ("stats.0.a.sq", "stats.0.a.h"):
        exact = sum(a[key].astype(np.float64) for a in sites)
        assert got[key].dtype == np.float64
        assert np.abs(got[key] - exact).max() <= n * 2.0 ** -(f + 1)
    big = dict(sites[0], **{"stats.0.a.sq": np.array([fixed_point_range(f, n) * 1.01] * 33)})
    with pytest.raises(ValueError, match="exceeds the fixed-point range .* lower secagg-frac"):
        encode_fixed(big, f, n)
    with pytest.raises(ValueError, match="not finite"):
        encode_fixed(dict(sites[0], **{"stats.0.a.h": np.full(21, np.nan, np.float32)}), f, n)


def test_secagg_sums_signed_64_bit_lanes_exactly():
    """SecAgg+ with 64-bit lanes: the masked vectors of 4 sites (one lost before masking)
    unmask to the exact signed sum of the others'."""
    from fedcompress.privacy.secagg import SecAggConfig, SecAggServer, SecAggSite

    rng = np.random.default_rng(1)
    config = SecAggConfig((0, 1, 2, 3), 3, 9, 64)
    sites = [SecAggSite(i, config) for i in range(4)]
    server = SecAggServer(config)
    server.public = {s.node: s.advertise() for s in sites}
    inbox = server.relay({s.node: s.share(server.public) for s in sites})
    values = {i: rng.integers(-2**40, 2**40, 9).view(np.uint64) for i in range(3)}
    masked = {i: sites[i].masked(values[i], inbox.get(i, {})) for i in range(3)}
    shares = {i: sites[i].unmask([0, 1, 2]) for i in range(3)}
    total = server.aggregate(masked, shares)
    assert total.dtype == np.int64
    assert total.tolist() == sum(v.view(np.int64) for v in values.values()).tolist()


def test_layer_sharing_follows_the_architecture(tiny):
    from fedcompress.methods.fedprllm.stats import layer_sharing

    assert all(layer_sharing(tiny.model, layer) == SHARED for layer in range(3))


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_secure_stats_mode_equals_the_plain_one_up_to_fixed_point(tiny_dir, tiny, method):
    """--aggregate stats --secagg (4 sites, in process): the server learns only each layer's
    sum; the masks equal the plain statistics mode's (Wanda: every bit) and SparseGPT's
    weights agree within 1e-4 (the fixed-point rounding of the Hessian, 2^-26 per entry and
    site, moves the tiny model's weights by up to 3e-5); a site lost before masking is left
    out of the sum."""
    from strategies.fedprllm import SecureStatsFedPrLLM

    plain = make_strategy(config_for(tiny_dir, method=method), tiny.model)
    run_rounds(plain, Federation(4))
    config = config_for(tiny_dir, method=method, secagg=True)
    secure = make_strategy(config, tiny.model)
    assert isinstance(secure, SecureStatsFedPrLLM)
    secure.start(Federation(4), ArrayRecord())
    assert not secure.outcome.rejected and secure.secagg["sum"]["votes"] == 3
    for layer in range(3):
        assert secure.layer_sites[layer] == 4
        for name, mask in plain.global_masks[layer].items():
            if method == "wanda":
                assert torch.equal(secure.global_masks[layer][name], mask), (layer, name)
            else:
                assert (secure.global_masks[layer][name] != mask).float().mean() < 1e-3
        for name, w in plain.global_weights.get(layer, {}).items():
            torch.testing.assert_close(secure.global_weights[layer][name], w, rtol=0,
                                       atol=1e-4)
    assert "stats" not in {m.get("stage") for m in secure.outcome.client_metrics}

    class Flaky(Federation):  # the last site is lost before it masks, at every layer
        def send_and_receive(self, messages, timeout=None):
            keep = [m for m in messages if not (m.metadata.message_type == "train.secagg_masks"
                                                and m.metadata.dst_node_id == 103)]
            return super().send_and_receive(keep, timeout)

    lost = make_strategy(config_for(tiny_dir, method=method, secagg=True, min_clients=3),
                         tiny.model)
    lost.start(Flaky(4), ArrayRecord())
    assert [lost.layer_sites[i] for i in range(3)] == [3, 3, 3]
    assert lost.secagg["sum"]["dropped"] == 3


@pytest.mark.parametrize("secagg", [False, True])
def test_plain_stats_mode_warns_that_the_server_sees_each_sites_statistics(tiny_dir, tiny,
                                                                           caplog, secagg):
    config = config_for(tiny_dir, method="sparsegpt", secagg=secagg)
    with caplog.at_level("WARNING", logger="strategies.fedprllm"):
        make_strategy(config, tiny.model)
    warned = [r.getMessage() for r in caplog.records if "in the clear" in r.getMessage()]
    if secagg:
        assert warned == []
    else:
        assert len(warned) == 1 and "X^T X" in warned[0] and "--secagg" in warned[0]
