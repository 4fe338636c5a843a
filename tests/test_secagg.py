"""SecAgg+ of vote counts: lanes, the four stages in process, dropouts within and beyond the
threshold, a server that cheats, and exact equality with the plain vote on real masks."""

from __future__ import annotations

import numpy as np
import pytest

from fedcompress.privacy.secagg import (
    SecAggConfig,
    SecAggError,
    SecAggServer,
    SecAggSite,
    lane_bits,
    pack_lanes,
    unpack_lanes,
)


def test_lanes_round_trip_and_sum_without_carries():
    rng = np.random.default_rng(0)
    bits = lane_bits(9)
    assert bits == 4 and lane_bits(1) == 1 and lane_bits(16) == 5
    votes = [rng.integers(0, 2, 1001) for _ in range(9)]
    packed = [pack_lanes(v, bits) for v in votes]
    assert all(np.array_equal(unpack_lanes(p, bits, 1001), v) for p, v in zip(packed, votes))
    with np.errstate(over="ignore"):
        total = sum(packed[1:], packed[0])
    assert np.array_equal(unpack_lanes(total, bits, 1001), sum(votes))
    with pytest.raises(SecAggError, match=r"values must be a flat vector in \[0, 2\^4\)"):
        pack_lanes(np.array([16]), 4)


def _run(n=5, t=3, numel=777, drop_before_mask=(), drop_before_unmask=(), seed=0):
    rng = np.random.default_rng(seed)
    nodes = tuple(int(x) for x in rng.choice(10**6, n, replace=False))
    config = SecAggConfig(nodes, t, numel)
    sites = {node: SecAggSite(node, config) for node in nodes}
    server = SecAggServer(config)
    server.public = {node: site.advertise() for node, site in sites.items()}
    shares = {node: site.share(server.public) for node, site in sites.items()}
    inbox = server.relay(shares)
    votes = {node: rng.integers(0, 2, numel) for node in nodes}
    masked = {node: sites[node].masked(votes[node], inbox.get(node, {}))
              for node in nodes if node not in drop_before_mask}
    survivors = sorted(masked)
    dropped = [n for n in nodes if n not in masked]
    unmask = {node: sites[node].unmask(survivors, dropped) for node in survivors
              if node not in drop_before_unmask}
    counts = server.aggregate(masked, unmask)
    return counts, sum(votes[n] for n in survivors), masked, votes


def test_the_server_recovers_exactly_the_sum():
    counts, expected, masked, votes = _run()
    assert np.array_equal(counts, expected)
    # a masked vector is not its input
    node = next(iter(masked))
    assert not np.array_equal(masked[node], pack_lanes(votes[node], lane_bits(5)))


def test_dropouts_within_the_threshold_keep_the_sum_exact():
    _, _, _, _ = _run()
    nodes_run = _run(n=6, t=3, seed=1)
    nodes = sorted(nodes_run[2])
    counts, expected, _, _ = _run(n=6, t=3, seed=1, drop_before_mask=nodes[:2])
    assert np.array_equal(counts, expected)  # two sites lost before masking: their pairs undone
    counts, expected, _, _ = _run(n=6, t=3, seed=1, drop_before_mask=nodes[:1],
                                  drop_before_unmask=nodes[1:3])
    assert np.array_equal(counts, expected)  # and two more silent at the last stage


def test_too_many_dropouts_fail_clearly():
    nodes = sorted(_run(n=5, t=3, seed=2)[2])
    with pytest.raises(SecAggError, match="expected at least the threshold 3"):
        _run(n=5, t=3, seed=2, drop_before_mask=nodes[:3])  # the sites refuse to unmask
    with pytest.raises(SecAggError, match="shares of node .*below the threshold 3"):
        _run(n=5, t=3, seed=2, drop_before_unmask=nodes[:3])


def test_sites_refuse_a_cheating_server():
    config = SecAggConfig((1, 2, 3), 2, 10)
    sites = {n: SecAggSite(n, config) for n in (1, 2, 3)}
    public = {n: s.advertise() for n, s in sites.items()}
    with pytest.raises(SecAggError, match="another public key for this site"):
        sites[1].share({**public, 1: public[2]})
    shares = {n: s.share(public) for n, s in sites.items()}
    inbox = SecAggServer(config).relay(shares)
    with pytest.raises(SecAggError, match="unmask before"):
        sites[1].unmask([1, 2], [3])
    # a share addressed to another site, relayed to site 1
    with pytest.raises(SecAggError, match="do not decrypt|relayed wrongly"):
        sites[1].masked(np.zeros(10, int), {2: inbox[3][2]})
    sites[1].masked(np.zeros(10, int), inbox[1])
    with pytest.raises(SecAggError, match="named both survivor and dropped"):
        sites[1].unmask([1, 2], [2])
    with pytest.raises(SecAggError, match="expected at least the threshold"):
        sites[1].unmask([1], [2, 3])


@pytest.mark.parametrize("kw, message", [
    (dict(nodes=(1,), threshold=2, numel=4), "expected >= 2 distinct ids"),
    (dict(nodes=(1, 1), threshold=2, numel=4), "expected >= 2 distinct ids"),
    (dict(nodes=(1, 2, 3), threshold=4, numel=4), "threshold=4: expected 2 <= t <= 3"),
    (dict(nodes=(1, 2, 3), threshold=2, numel=0), "numel=0"),
    (dict(nodes=tuple(range(9)), threshold=2, numel=4, bits=3), "needs 4..32"),
])
def test_bad_config_is_named(kw, message):
    with pytest.raises(SecAggError, match=message):
        SecAggConfig(**kw)


def test_secure_counts_equal_the_plain_vote_bit_for_bit(tiny_dir):
    import torch

    from fedcompress.methods.fedprllm.federated import (
        FedPrLLMConfig,
        MaskAggregator,
        federation_windows,
        mask_key,
    )
    from fedcompress.models import load_model
    from fedcompress.pruning.local import local_masks

    cfg = FedPrLLMConfig(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16)
    loaded = load_model(tiny_dir, device="cpu")
    windows = federation_windows(loaded.tokenizer, cfg)[0]
    plain = MaskAggregator(loaded.model, 4)
    flat = []
    for w in windows:
        masks = {mask_key(i, n): m for i, layer in enumerate(
            local_masks(loaded.model, w, cfg.prune, batch_size=2).masks)
            for n, m in layer.items()}
        plain.add(masks)
        flat.append(torch.cat([masks[k].reshape(-1) for k in sorted(masks)]).numpy())
    config = SecAggConfig((11, 22, 33, 44), 3, flat[0].size)
    sites = [SecAggSite(n, config) for n in config.nodes]
    server = SecAggServer(config, {s.node: s.advertise() for s in sites})
    inbox = server.relay({s.node: s.share(server.public) for s in sites})
    masked = {s.node: s.masked(v.astype(np.int64), inbox[s.node]) for s, v in zip(sites, flat)}
    counts = server.aggregate(masked, {s.node: s.unmask(config.nodes, []) for s in sites})
    expected = torch.cat([plain.counts()[k].reshape(-1) for k in sorted(plain.shapes)])
    assert np.array_equal(counts, expected.numpy().astype(np.int64))
    assert config.upload_bytes == 8 * -(-flat[0].size // (64 // 3))
