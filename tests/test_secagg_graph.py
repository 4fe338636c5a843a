"""SecAgg+'s sparse masking graph (fedcompress.privacy.secagg_graph) and the vote on it."""

from __future__ import annotations

import hashlib
from itertools import combinations

import numpy as np
import pytest
import torch

from fedcompress.privacy.secagg import SecAggConfig, SecAggError, SecAggServer, SecAggSite
from fedcompress.privacy.secagg_graph import (
    check_neighbours,
    cut_of,
    default_neighbours,
    graph_seed,
    masking_graph,
    share_threshold,
)


def _seed(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


@pytest.mark.parametrize("sites,k", [(2, 1), (3, 2), (4, 3), (5, 4), (8, 6), (16, 8), (64, 12),
                                     (1000, 20)])
def test_the_default_degree_is_logarithmic(sites, k):
    assert default_neighbours(sites) == k


@pytest.mark.parametrize("sites,k", [(16, 8), (16, 2), (9, 4), (64, 12), (7, 4)])
def test_the_graph_is_k_regular_symmetric_and_k_connected(sites, k):
    graph = masking_graph(_seed(sites), range(sites), k)
    assert sorted(graph) == list(range(sites))
    assert all(len(nbrs) == k and n not in nbrs for n, nbrs in graph.items())
    assert all(n in graph[m] for n, nbrs in graph.items() for m in nbrs)
    # Harary H(k, m): no k - 1 sites cut it, some k do (it is no denser than it must be)
    if sites <= 16:
        assert cut_of(graph, range(sites), k - 1) is None
        assert cut_of(graph, range(sites), k) is not None


def test_the_graph_follows_the_seed_and_nothing_else():
    a = masking_graph(_seed(1), range(16), 4)
    assert a == masking_graph(_seed(1), reversed(range(16)), 4)
    assert a != masking_graph(_seed(2), range(16), 4)
    keys = {i: (bytes([i]) * 97, bytes([i + 1]) * 97) for i in range(5)}
    seed = graph_seed(b"d", b"v" * 32, keys)
    assert seed == graph_seed(b"d", b"v" * 32, dict(reversed(list(keys.items()))))
    assert seed != graph_seed(b"d", b"w" * 32, keys)  # another vote
    assert seed != graph_seed(b"d", b"v" * 32, {**keys, 2: (keys[2][1], keys[2][0])})
    assert seed != graph_seed(b"d", b"v" * 32, {i: keys[i] for i in range(4)})  # one left out


def test_a_degree_at_least_n_minus_1_is_the_complete_graph():
    for k in (4, 5, 9):
        graph = masking_graph(_seed(0), range(5), k)
        assert all(nbrs == set(range(5)) - {n} for n, nbrs in graph.items())
    assert share_threshold(4, 5, 4) == 4 and share_threshold(4, 9, 5) == 3


@pytest.mark.parametrize("k,sites,ok", [(2, 16, True), (8, 16, True), (15, 16, True),
                                        (40, 16, True), (3, 16, False), (1, 16, False),
                                        (0, 16, False), (3, 4, True)])
def test_degrees_are_checked(k, sites, ok):
    assert (check_neighbours(k, sites) == "") is ok
    if not ok:
        assert f"neighbours={k}" in check_neighbours(k, sites)
    if not ok and k:  # 0 in a vote's config is the default degree
        with pytest.raises(SecAggError, match=f"neighbours={k}"):
            SecAggConfig(tuple(range(sites)), 9, 8, neighbours=k)


def test_cut_of_finds_what_isolates_a_site():
    ring = masking_graph(_seed(3), range(8), 2)
    assert cut_of(ring, range(8), 1) is None  # a ring minus one site is a path
    survivors = [n for n in range(8) if n != 0]  # one site dropped: a path
    cut = cut_of(ring, survivors, 1)
    assert cut is not None and len(cut) == 1 and cut[0] not in ring[0]
    assert cut_of(ring, survivors, 0) is None


def _vote(n, k, t, lost=(), floor=None, colluders=1, numel=333, seed=0):
    rng = np.random.default_rng(seed)
    values = {i: rng.integers(0, 2, numel) for i in range(n)}
    config = SecAggConfig(tuple(range(n)), t, numel, run=1, round=1, neighbours=k)
    sites = {i: SecAggSite(i, config, min_neighbours=floor, max_colluders=colluders)
             for i in range(n)}
    server = SecAggServer(config, {i: s.advertise() for i, s in sites.items()})
    shares = {i: s.share(server.public) for i, s in sites.items()}
    inbox = server.relay(shares)
    masked = {i: sites[i].masked(values[i], inbox.get(i, {})) for i in sites if i not in lost}
    survivors = sorted(masked)
    unmask = {i: sites[i].unmask(survivors) for i in survivors}
    total = server.aggregate(masked, unmask)
    return total, sum(values[i] for i in survivors), sites, shares


@pytest.mark.parametrize("n,k,lost", [(16, 8, ()), (16, 8, (3, 11)), (12, 4, ()),
                                      (12, 4, (5,)), (9, 8, (0, 1))])
def test_the_sparse_vote_sums_exactly(n, k, lost):
    t = n // 2 + 2
    total, expected, sites, shares = _vote(n, k, t, lost, floor=2)
    assert np.array_equal(total, expected)
    degree = min(k, n - 1)
    # each site shares with and masks with its neighbours only: k ciphertexts up
    assert all(len(out) == degree and set(out) == sites[i].neighbours
               for i, out in shares.items())


def test_a_site_refuses_a_degree_below_its_floor():
    config = SecAggConfig(tuple(range(16)), 10, 8, neighbours=4)
    with pytest.raises(SecAggError, match="degree 4 is below this site's minimum 8 .*"
                                          "secagg-min-neighbours"):
        SecAggSite(0, config)  # the default floor: 2 * ceil(log2 16)
    SecAggSite(0, config, min_neighbours=4)


def test_a_site_refuses_a_neighbourhood_its_colluders_could_unmask():
    """k = 2 shares each secret with threshold 2: two colluders hold two shares."""
    config = SecAggConfig(tuple(range(16)), 10, 8, neighbours=2)
    SecAggSite(0, config, min_neighbours=2, max_colluders=1)
    with pytest.raises(SecAggError, match="threshold 2, which 2 colluding sites could reach.*"
                                          "secagg-max-colluders"):
        SecAggSite(0, config, min_neighbours=2, max_colluders=2)


def test_the_site_policy_sets_the_floor():
    from fedcompress.privacy.policy import PolicyError, SitePolicy

    assert SitePolicy().min_secagg_neighbours(16) == 8
    assert SitePolicy().min_secagg_neighbours(64) == 12
    assert SitePolicy(secagg_min_neighbours=4).min_secagg_neighbours(64) == 4
    assert SitePolicy(secagg_min_neighbours=2, secagg_max_colluders=3
                      ).min_secagg_neighbours(64) == 6
    with pytest.raises(PolicyError, match="secagg-min-neighbours=-1"):
        SitePolicy(secagg_min_neighbours=-1)


def test_state_round_trip_keeps_the_graph():
    n, config = 10, SecAggConfig(tuple(range(10)), 7, 64, neighbours=4)
    sites = {i: SecAggSite(i, config, min_neighbours=4) for i in range(n)}
    public = {i: s.advertise() for i, s in sites.items()}
    for s in sites.values():
        s.share(public)
    again = SecAggSite.from_state(sites[0].to_state())
    assert again.neighbours == sites[0].neighbours and len(again.neighbours) == 4
    assert again.share_threshold == 3 and again.max_colluders == 1


def _flower(tiny_dir, drop=None, **kw):
    from test_secagg import _flower as flower

    floors = [{"secagg-min-neighbours": 2}] * 5
    return flower(tiny_dir, drop, keys=floors, **kw)


def test_a_sparse_vote_through_flower_equals_the_plain_vote(tiny_dir):
    secure, plain = _flower(tiny_dir, secagg_neighbours=2)
    for key, counts in plain.aggregator.counts().items():
        assert torch.equal(secure.aggregator.counts()[key], counts)
    assert secure.secagg["sum"]["neighbours"] == 2


def test_a_drop_that_leaves_the_ring_cuttable_fails_the_vote(tiny_dir, caplog):
    """k = 2 on 5 sites is a ring; one site lost before its masked votes leaves a path, which
    one colluder (each site's default bound) would cut: the sites refuse to unmask."""
    from strategies.common import NotEnoughClientsError

    with pytest.raises(NotEnoughClientsError, match="SecAgg unmasking failed"):
        _flower(tiny_dir, {"train.secagg_masks": [3]}, secagg_neighbours=2, min_clients=3)
    assert "the survivors' masking graph falls apart" in caplog.text


def test_at_the_defaults_no_survivor_set_the_server_may_announce_can_be_cut():
    """16 sites, the default degree 8 and threshold 11, one colluder: whichever 5 sites the
    server drops (the most it may: 11 must survive), no one site cuts the survivors' graph
    (H(8, 16) less 5 sites is still 3-connected), so the default vote never fails the check."""
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig

    config = FedPrLLMConfig(clients=16, secagg=True)
    k, t = config.neighbours_for(16), config.threshold_for(16)
    assert (k, t) == (8, 11)
    graph = masking_graph(_seed(16), range(16), k)
    for lost in combinations(range(16), 16 - t):
        assert cut_of(graph, [n for n in range(16) if n not in lost], 1) is None
