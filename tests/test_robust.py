"""Byzantine sites and robust mask voting: exact tiny examples of the pure functions, the
attack models on a tiny model, and both through the real ClientApp and strategy (in process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import InProcessFederation
from flwr.app import ArrayRecord, ConfigRecord

from fedcompress.config import SettingsError
from fedcompress.masks.aggregate import global_mask, payload_words
from fedcompress.masks.codec import encode_mask
from fedcompress.masks.robust import (
    hamming_to_majority,
    majority_words,
    reject_outliers,
    trimmed_counts,
)
from fedcompress.methods.fedprllm.attacks import attack_masks
from fedcompress.methods.fedprllm.federated import (
    FedPrLLMConfig,
    InvalidMaskError,
    MaskAggregator,
    ServerConfig,
    check_payload,
    encode_masks,
    federation_windows,
    mask_key,
)
from fedcompress.models import ModelAdapter, load_model, weight_matrix
from fedcompress.pruning.local import PruneConfig, local_masks
from fedcompress.pruning.scores import wanda_scores
from strategies.fedprllm import FedPrLLM


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, device="cpu")


# -- pure functions ----------------------------------------------------------------------------
def test_trimmed_counts_drop_the_extreme_votes():
    counts = torch.tensor([0, 1, 2, 3, 4, 5], dtype=torch.uint8)  # of m = 5 sites
    assert trimmed_counts(counts, 5, 1).tolist() == [0, 0, 1, 2, 3, 3]
    assert trimmed_counts(counts, 5, 2).tolist() == [0, 0, 0, 1, 1, 1]
    assert trimmed_counts(counts, 5, 0) is counts
    assert trimmed_counts(counts, 5, 1).dtype == torch.uint8
    for bad in (3, -1, True):
        with pytest.raises(ValueError, match="expected 0 <= trim < m/2"):
            trimmed_counts(counts, 5, bad)


def _words(mask: torch.Tensor) -> np.ndarray:
    packed = encode_mask(mask)
    return payload_words(packed, packed.size)


def test_hamming_to_majority_counts_differing_bits_exactly():
    rng = np.random.default_rng(0)
    masks = [torch.from_numpy(rng.random((3, 70)) < 0.5) for _ in range(5)]
    counts = sum(m.to(torch.uint8) for m in masks)
    majority = counts.to(torch.int32) * 2 > 5
    assert np.array_equal(majority_words(counts, 5), _words(majority))
    got = hamming_to_majority({"a": [_words(m) for m in masks]}, {"a": counts}, 5)
    expected = [int((m != majority).sum()) / m.numel() for m in masks]
    assert got.tolist() == pytest.approx(expected, abs=0)
    # over two layers: differing bits over all weights
    other = [torch.zeros(2, 8, dtype=torch.bool)] * 5
    two = hamming_to_majority({"a": [_words(m) for m in masks], "b": [_words(m) for m in other]},
                              {"a": counts, "b": torch.zeros(2, 8, dtype=torch.uint8)}, 5)
    assert two.tolist() == pytest.approx([e * 210 / 226 for e in expected])
    # an exact half is not a majority
    half = torch.tensor([[True, False]])
    assert not majority_words(half.to(torch.uint8) * 1, 2).any()


def test_reject_outliers_by_robust_deviation():
    d = [0.10, 0.11, 0.09, 0.10, 0.12, 0.55, 0.60]
    r = reject_outliers(d)
    assert r.rejected == (5, 6) and r.distances == tuple(d)
    # median 0.11, MAD 0.01 -> 1.4826 * 0.01 > floor 0.01
    assert r.threshold == pytest.approx(0.11 + 3.5 * 1.4826 * 0.01)
    assert reject_outliers(d, max_reject=1).rejected == (6,)
    # identical honest sites: the floor keeps them; an outlier still goes
    assert reject_outliers([0.1, 0.1, 0.1, 0.1]).rejected == ()
    assert reject_outliers([0.1, 0.1, 0.1, 0.1, 0.3]).rejected == (4,)
    # two far sites of five; with two of four there is no majority to defend
    assert reject_outliers([0.0, 0.0, 0.0, 0.9, 0.9]).rejected == (3, 4)
    assert reject_outliers([0.0, 0.0, 0.9, 0.9]).rejected == ()
    with pytest.raises(ValueError, match="expected finite numbers"):
        reject_outliers([0.1, float("nan")])
    with pytest.raises(ValueError, match="expected z > 0"):
        reject_outliers([0.1], z=0)


# -- settings ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(attack="random", attackers=5), "attackers=5 is invalid: expected at most clients=4"),
    (dict(attack="random"), "attackers=0 is invalid: expected 0 with attack none, and >= 1"),
    (dict(attackers=1), "attackers=1 is invalid"),
    (dict(attack="flip", attackers=1), "attack='flip' is invalid"),
    (dict(defence="trim"), "trim"),
    (dict(defence="both", trim=2), "trim=2 is invalid: expected between 1 and fewer than half"),
    (dict(defence="hamming", trim=1), "trim=1 is invalid: expected 0 with defence 'hamming'"),
    (dict(defence="median"), "defence='median' is invalid"),
    (dict(attack="random", attackers=1, mode="iterative"), "attack='random' is invalid"),
])
def test_bad_attack_and_defence_settings_are_named(tiny_dir, kw, message):
    with pytest.raises((SettingsError, ValueError), match=message):
        FedPrLLMConfig(model=tiny_dir, clients=4, **kw)


def test_server_label_names_the_defence():
    assert ServerConfig().label == "layer"
    assert ServerConfig("row", defence="hamming").label == "row+hamming"
    assert ServerConfig(defence="both", trim=2).label == "layer+hamming+trim2"


# -- attack models -----------------------------------------------------------------------------
def _windows(tiny, n=4):
    config = FedPrLLMConfig(model="x", clients=n, samples_per_client=2, seqlen=16)
    return federation_windows(tiny.tokenizer, config)[0]


def test_attack_models_on_a_tiny_model(tiny):
    windows = _windows(tiny)
    prune = PruneConfig("wanda", 0.5, "row")
    honest = local_masks(tiny.model, windows[0], prune, batch_size=2).masks
    shapes = {mask_key(i, n): tuple(m.shape) for i, layer in enumerate(honest)
              for n, m in layer.items()}
    random_a = attack_masks("random", tiny.model, windows[1], prune, 0, 1)
    random_b = attack_masks("random", tiny.model, windows[1], prune, 0, 1)
    assert all(torch.equal(random_a[i][n], random_b[i][n]) for i in range(3) for n in honest[i])
    for layer in random_a:  # exact ratio per row
        for mask in layer.values():
            assert (mask.sum(1) == mask.shape[1] // 2).all()
    # inverted: the highest Wanda scores of the FIRST layer's inputs (the same inputs as the
    # honest pass there): at 50% row-wise, exactly the honest mask's complement
    inverted = attack_masks("inverted", tiny.model, windows[0], prune, 0, 0)
    for name, mask in honest[0].items():
        assert torch.equal(inverted[0][name], ~mask)
    colluded = [attack_masks("collude", tiny.model, windows[i], prune, 0, i, 2, windows[0])
                for i in (1, 2)]
    assert all(torch.equal(colluded[0][i][n], colluded[1][i][n]) for i in range(3)
               for n in honest[i])
    # keep and sparsity attacks do not pass the server's payload check
    for attack in ("keep", "sparsity"):
        payload = encode_masks(attack_masks(attack, tiny.model, windows[1], prune, 0, 1, 2))
        with pytest.raises(InvalidMaskError, match="sparsity"):
            check_payload(payload, shapes, 0.5, 0.05)
    check_payload(encode_masks(inverted), shapes, 0.5, 0.05)
    check_payload(encode_masks(random_a), shapes, 0.5, 0.05)


def test_inverted_masks_prune_the_highest_scores(tiny):
    windows = _windows(tiny)[0]
    prune = PruneConfig("wanda", 0.3, "layer")
    inverted = attack_masks("inverted", tiny.model, windows, prune, 0, 0)
    from fedcompress.pruning.walker import walk

    seen = {}

    def record(index, layer, stats):
        if index == 0:
            for name, module in ModelAdapter.linear_layers(layer).items():
                seen[name] = wanda_scores(weight_matrix(module), stats[name].sq_norm)
        return {}, None

    walk(tiny.model, windows, record, batch_size=2)
    for name, scores in seen.items():
        mask = inverted[0][name]
        assert scores[mask].min() >= scores[~mask].max()


# -- aggregation with a defence ----------------------------------------------------------------
def _aggregator(tiny, masks_per_site):
    agg = MaskAggregator(tiny.model, len(masks_per_site))
    for masks in masks_per_site:
        agg.add({mask_key(i, n): m for i, layer in enumerate(masks) for n, m in layer.items()})
    return agg


def test_hamming_defence_rejects_an_inverted_site_and_votes_with_the_rest(tiny):
    windows = _windows(tiny, 6)
    prune = PruneConfig("wanda", 0.5, "row")
    honest = [local_masks(tiny.model, w, prune, batch_size=2).masks for w in windows]
    bad = attack_masks("inverted", tiny.model, windows[0], prune, 0, 0)
    agg = _aggregator(tiny, [bad, *honest[1:]])
    server = ServerConfig(defence="hamming")
    kept, rejection = agg.defended(server)
    assert rejection.rejected == (0,) and kept.clients == 5
    assert rejection.distances[0] > 0.4 > max(rejection.distances[1:])
    clean = _aggregator(tiny, honest[1:])
    masks = agg.global_masks(server, 0.5)
    assert agg.rejection is not None and agg.rejection.rejected == (0,)
    expected = clean.global_masks(ServerConfig(), 0.5)
    assert all(torch.equal(masks[k], expected[k]) for k in masks)
    a, b = load_model_copy(tiny), load_model_copy(tiny)
    agg.prune(a, server, 0.5)
    clean.prune(b, ServerConfig(), 0.5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))
    # no defence: every site counts
    assert agg.defended(ServerConfig())[0] is agg


def load_model_copy(tiny):
    import copy

    return copy.deepcopy(tiny.model)


def test_trim_defence_selects_on_trimmed_counts(tiny):
    windows = _windows(tiny, 5)
    prune = PruneConfig("wanda", 0.5, "row")
    agg = _aggregator(tiny, [local_masks(tiny.model, w, prune, batch_size=2).masks
                             for w in windows])
    server = ServerConfig(defence="trim", trim=1)
    for key, counts in agg.counts().items():
        weight = agg._weight(key).detach()
        expected = global_mask(trimmed_counts(counts, 5, 1), 0.5, "layer", "magnitude", weight)
        assert torch.equal(agg.global_mask(key, server, 0.5), expected)


# -- through the ClientApp and the strategy (in process) ---------------------------------------
class Federation(InProcessFederation):
    app = "clients.app"


def test_simulated_attackers_and_the_defence_through_the_client_app(tiny_dir, tiny):
    config = FedPrLLMConfig(model=tiny_dir, clients=6, samples_per_client=2, seqlen=16,
                            batch_size=2, attack="inverted", attackers=1, defence="hamming")
    strategy = FedPrLLM(config, tiny.model)
    grid = Federation(config.clients)
    replies = grid.send_and_receive(strategy.configure_train(1, ArrayRecord(), ConfigRecord(),
                                                             grid))
    strategy.aggregate_train(1, replies)
    pruned = strategy.prune(load_model_copy(tiny))
    assert all(abs(f - 0.5) < 1e-3 for f in pruned.values())
    decision = strategy.defence["layer+hamming"]
    partitions = {m["node"]: m["partition"] for m in strategy.outcome.client_metrics}
    assert [partitions[n] for n in decision["rejected_nodes"]] == [0]
    assert len(decision["distances"]) == 6
    # a keep-everything attacker is stopped by the payload check before any vote
    keep = FedPrLLM(config.replace(attack="keep", attackers=2, defence="none", min_clients=4),
                    tiny.model)
    replies = grid.send_and_receive(keep.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    keep.aggregate_train(1, replies)
    assert keep.aggregator.clients == 4 and len(keep.outcome.rejected) == 2
    assert all("sparsity" in r["reason"] for r in keep.outcome.rejected)
