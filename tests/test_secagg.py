"""SecAgg+ of vote counts: lanes, the stages in process (unauthenticated, as in simulation, and
authenticated with the consistency round), dropouts at every stage within and beyond the
threshold, a server that cheats, and exact equality with the plain vote on real masks. The
malicious server's attacks are in ``tests/adversarial/test_secagg_attacks.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcompress.privacy.secagg import (
    MASK_CHUNK_WORDS,
    SecAggConfig,
    SecAggError,
    SecAggServer,
    SecAggSite,
    apply_mask,
    lane_bits,
    mask_stream,
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


@pytest.mark.parametrize("sites", [1, 2, 4, 16, 17, 64, 255, 1000])
def test_radix_digits_round_trip_and_sum_without_carries(sites):
    """The narrowest packing: digits of base n + 1 (15 per word for 16 sites, against 12 lanes
    of 5 bits); the sum of n vectors of 0/1 votes, mod 2^64, unpacks to their exact sum, also
    at every digit's maximum (all sites voting 1 everywhere)."""
    from fedcompress.privacy.secagg import pack_radix, radix_lanes, unpack_radix

    radix, lanes = sites + 1, radix_lanes(sites + 1)
    assert radix ** lanes <= 1 << 64 < radix ** (lanes + 1)
    rng = np.random.default_rng(sites)
    numel = 3 * lanes + 2
    votes = [rng.integers(0, 2, numel) for _ in range(min(sites, 20))]
    votes += [np.ones(numel, int)] * (sites - len(votes))
    packed = [pack_radix(v, radix, 1) for v in votes]
    assert packed[0].size == -(-numel // lanes)
    assert all(np.array_equal(unpack_radix(p, radix, numel), v) for p, v in zip(packed, votes))
    with np.errstate(over="ignore"):
        total = sum(packed[1:], packed[0].copy())
    assert np.array_equal(unpack_radix(total, radix, numel), sum(votes))
    with np.errstate(over="ignore"):
        full = pack_radix(np.ones(numel, int), radix, 1) * np.uint64(sites)
    assert np.array_equal(unpack_radix(full, radix, numel), np.full(numel, sites))
    with pytest.raises(SecAggError, match=r"values must be a flat vector in \[0, 1\]"):
        pack_radix(np.array([2]), radix, 1)
    assert radix_lanes(17) == 15 and radix_lanes(65) == 10 and radix_lanes(2) == 64


def test_radix_words_are_the_digits_polynomial_for_every_input_type():
    """The compiled packing is ``sum_l d_l radix^l`` per word (Python's integers as the
    reference) for bools and every integer type; a value out of range, negative or not an
    integer is refused by name, never clipped or truncated."""
    from fedcompress.privacy.secagg import pack_radix, radix_lanes, unpack_radix

    radix, lanes = 17, radix_lanes(17)
    digits = np.random.default_rng(0).integers(0, radix, 2 * lanes + 3)
    expected = [sum(int(d) * radix ** i for i, d in enumerate(digits[w:w + lanes]))
                for w in range(0, digits.size, lanes)]
    for dtype in (np.uint8, np.int16, np.int64, np.uint64):
        words = pack_radix(digits.astype(dtype), radix, radix - 1)
        assert [int(w) for w in words] == expected
        assert np.array_equal(unpack_radix(words, radix, digits.size), digits)
    votes = digits > 8
    assert np.array_equal(unpack_radix(pack_radix(votes, radix, 1), radix, votes.size), votes)
    for bad in (np.array([0, -1]), np.array([0, 1 << 40]), np.array([1, 2], np.uint8)):
        with pytest.raises(SecAggError, match=r"values must be a flat vector in \[0, 1\]"):
            pack_radix(bad, radix, 1)
    for bad in (np.array([0.0, 1.0]), np.ones((2, 2), int)):
        with pytest.raises(SecAggError, match="expected a flat vector of integers in"):
            pack_radix(bad, radix, 1)


def _run(n=5, t=3, numel=777, drop_before_share=(), drop_before_mask=(),
         drop_before_unmask=(), seed=0):
    rng = np.random.default_rng(seed)
    nodes = tuple(int(x) for x in rng.choice(10**6, n, replace=False))
    config = SecAggConfig(nodes, t, numel)
    sites = {node: SecAggSite(node, config) for node in nodes}
    server = SecAggServer(config)
    server.public = {node: site.advertise() for node, site in sites.items()}
    shares = {node: site.share(server.public) for node, site in sites.items()
              if node not in drop_before_share}
    inbox = server.relay(shares)
    votes = {node: rng.integers(0, 2, numel) for node in nodes}
    masked = {node: sites[node].masked(votes[node], inbox.get(node, {}))
              for node in shares if node not in drop_before_mask}
    survivors = sorted(masked)
    unmask = {node: sites[node].unmask(survivors) for node in survivors
              if node not in drop_before_unmask}
    counts = server.aggregate(masked, unmask)
    return counts, sum(votes[n] for n in survivors), masked, votes


@pytest.mark.parametrize("n_words", [0, 1, MASK_CHUNK_WORDS - 1, MASK_CHUNK_WORDS,
                                     MASK_CHUNK_WORDS + 1, 3 * MASK_CHUNK_WORDS + 5])
def test_masks_added_in_place_equal_the_whole_stream(n_words):
    """The protocol adds the keystream piece by piece into the words (no vector-sized
    temporary): the result equals the whole stream added or subtracted modulo 2^64, at every
    piece boundary."""
    rng = np.random.default_rng(n_words)
    words = rng.integers(0, 2**63, n_words, dtype=np.uint64) * np.uint64(2)
    secret, vote = bytes(range(32)), bytes(32)
    stream = mask_stream(secret, vote, b"pair", n_words)
    added, subtracted = words.copy(), words.copy()
    apply_mask(added, secret, vote, b"pair")
    apply_mask(subtracted, secret, vote, b"pair", subtract=True)
    with np.errstate(over="ignore"):
        assert np.array_equal(added, words + stream)
        assert np.array_equal(subtracted, words - stream)
    apply_mask(added, secret, vote, b"pair", subtract=True)
    assert np.array_equal(added, words)
    for threads in (2, 3, 5):  # runs of whole pieces, each from its own place in the stream
        threaded = words.copy()
        apply_mask(threaded, secret, vote, b"pair", threads=threads)
        with np.errstate(over="ignore"):
            assert np.array_equal(threaded, words + stream)


def test_masks_in_place_refuse_what_they_cannot_write():
    secret, vote = bytes(32), bytes(32)
    for bad in (np.zeros(4, dtype=np.int64), np.zeros(8, dtype=np.uint64)[::2]):
        with pytest.raises(SecAggError, match="writable contiguous uint64"):
            apply_mask(bad, secret, vote, b"self")


def test_the_server_recovers_exactly_the_sum():
    counts, expected, masked, votes = _run()
    assert np.array_equal(counts, expected)
    # a masked vector is not its input
    node = next(iter(masked))
    assert not np.array_equal(masked[node], pack_lanes(votes[node], lane_bits(5)))


def test_dropouts_within_the_threshold_keep_the_sum_exact():
    nodes = sorted(_run(n=6, t=4, seed=1)[2])
    counts, expected, _, _ = _run(n=6, t=4, seed=1, drop_before_mask=nodes[:2])
    assert np.array_equal(counts, expected)  # two sites lost before masking: their pairs undone
    seven = sorted(_run(n=7, t=4, seed=1)[2])
    counts, expected, _, _ = _run(n=7, t=4, seed=1, drop_before_mask=seven[:1],
                                  drop_before_unmask=seven[1:3])
    assert np.array_equal(counts, expected)  # and two more silent at the last stage
    # lost between their keys and their shares: not in U2, nobody masks with them
    counts, expected, masked, _ = _run(n=6, t=4, seed=1, drop_before_share=nodes[:2])
    assert np.array_equal(counts, expected) and sorted(masked) == nodes[2:]
    # one at each stage
    counts, expected, masked, _ = _run(n=7, t=4, seed=1, drop_before_share=seven[:1],
                                       drop_before_mask=seven[1:2],
                                       drop_before_unmask=seven[2:3])
    assert np.array_equal(counts, expected) and sorted(masked) == seven[2:]


def test_too_many_dropouts_fail_clearly():
    nodes = sorted(_run(n=5, t=3, seed=2)[2])
    with pytest.raises(SecAggError, match="expected at least the threshold 3"):
        _run(n=5, t=3, seed=2, drop_before_mask=nodes[:3])  # the sites refuse to unmask
    with pytest.raises(SecAggError, match="shares of node .*below the threshold 3"):
        _run(n=5, t=3, seed=2, drop_before_unmask=nodes[:3])
    with pytest.raises(SecAggError, match=r"shares of 2 sites \(U2.*below the threshold 3"):
        _run(n=5, t=3, seed=2, drop_before_share=nodes[:3])


def _three():
    config = SecAggConfig((1, 2, 3), 2, 10)
    sites = {n: SecAggSite(n, config) for n in (1, 2, 3)}
    public = {n: s.advertise() for n, s in sites.items()}
    return config, sites, public


def test_sites_refuse_a_cheating_server():
    config, sites, public = _three()
    with pytest.raises(SecAggError, match="another advertisement for this site"):
        sites[1].share({**public, 1: public[2]})
    with pytest.raises(SecAggError, match="aborted"):  # a refused stage ends the vote
        sites[1].share(public)
    config, sites, public = _three()
    shares = {n: s.share(public) for n, s in sites.items()}
    inbox = SecAggServer(config).relay(shares)
    with pytest.raises(SecAggError, match="out of order"):
        sites[1].unmask([1, 2])
    # a share addressed to another site, relayed to site 1
    with pytest.raises(SecAggError, match="do not decrypt|relayed wrongly"):
        sites[1].masked(np.zeros(10, int), {2: inbox[3][2]})
    sites[2].masked(np.zeros(10, int), inbox[2])
    with pytest.raises(SecAggError, match="a site named twice"):
        sites[2].unmask([1, 2, 2])
    sites[3].masked(np.zeros(10, int), inbox[3])
    with pytest.raises(SecAggError, match="expected at least the threshold"):
        sites[3].unmask([3])


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
    counts = server.aggregate(masked, {s.node: s.unmask(config.nodes) for s in sites})
    expected = torch.cat([plain.counts()[k].reshape(-1) for k in sorted(plain.shapes)])
    assert np.array_equal(counts, expected.numpy().astype(np.int64))
    # 4 sites: digits of base 5, 27 per word (3-bit lanes would hold 21)
    assert config.upload_bytes == 8 * -(-flat[0].size // 27)


def test_a_site_resumes_from_its_stored_state():
    """A deployed site may run each stage in a new process: its state round-trips."""
    config = SecAggConfig((1, 2, 3), 2, 50)
    sites = {n: SecAggSite(n, config) for n in (1, 2, 3)}
    server = SecAggServer(config, {n: s.advertise() for n, s in sites.items()})
    inbox = server.relay({n: s.share(server.public) for n, s in sites.items()})
    sites = {n: SecAggSite.from_state(s.to_state()) for n, s in sites.items()}
    votes = {n: np.arange(50) % 2 for n in sites}
    masked = {n: s.masked(votes[n], inbox[n]) for n, s in sites.items()}
    sites = {n: SecAggSite.from_state(s.to_state()) for n, s in sites.items()}
    counts = server.aggregate(masked, {n: s.unmask([1, 2, 3]) for n, s in sites.items()})
    assert np.array_equal(counts, 3 * (np.arange(50) % 2))
    with pytest.raises(SecAggError, match="stored SecAgg state unusable"):
        SecAggSite.from_state({"node": 1})


# -- through the ClientApp and the strategy (in process; and the Simulation Engine) ------------
def site_keys(folder, n: int) -> list[dict]:
    """``n`` sites' SecAgg node config: node-auth style P-384 keys (OpenSSH) and the folder of
    their public keys, as a deployed site (site-mode deployment) has them."""
    from conftest import write_site_keys

    paths, peers = write_site_keys(folder, n)
    return [{"site-mode": "deployment", "secagg-key": str(path), "secagg-peers": str(peers)}
            for path in paths]


def _flower(tiny_dir, drop: dict | None = None, keys: list[dict] | None = None, **kw):
    """The secure and the plain strategy over the same in-process federation; ``drop`` maps an
    action to the partitions whose reply to it is lost; ``keys``: each site's SecAgg node
    config (authenticated sites; default: unauthenticated simulated sites)."""
    from conftest import InProcessFederation
    from flwr.app import ArrayRecord, ConfigRecord

    from fedcompress.methods.fedprllm.federated import FedPrLLMConfig
    from fedcompress.models import load_model
    from strategies.fedprllm import FedPrLLM, SecureFedPrLLM, make_strategy

    class Federation(InProcessFederation):
        app = "clients.app"
        errors_as_replies = True

        def __init__(self, n):
            super().__init__(n)
            for i, extra in enumerate(keys or []):  # deployed sites accept the tiny model
                self.contexts[100 + i].node_config.update({**extra, "models": tiny_dir})

        def send_and_receive(self, messages, timeout=None):
            lost = {100 + p for p in (drop or {}).get(messages[0].metadata.message_type, ())}
            return super().send_and_receive(
                [m for m in messages if m.metadata.dst_node_id not in lost], timeout)

    config = FedPrLLMConfig(model=tiny_dir, clients=5, samples_per_client=2, seqlen=16,
                            batch_size=2, secagg=True, **kw)
    model = load_model(tiny_dir, device="cpu").model
    secure = make_strategy(config, model)
    assert isinstance(secure, SecureFedPrLLM)
    grid = Federation(5)
    secure.start(grid, ArrayRecord())
    # the reference: the same sites' plain vote, in a federation of its own (the sites that
    # voted securely would refuse their masks in the clear on the same input), whose sites
    # release masks in the clear (require-secagg=false)
    plain = FedPrLLM(config.replace(secagg=False, min_clients=2), model)
    reference = Federation(5)
    for context in reference.contexts.values():
        context.node_config["require-secagg"] = False
    kept = {100 + p for p in (drop or {}).get("train.secagg_masks", ())}
    replies = [r for r in reference.send_and_receive(plain.configure_train(
        1, ArrayRecord(), ConfigRecord(), reference)) if r.metadata.src_node_id not in kept]
    plain.aggregate_train(1, replies)
    return secure, plain


def test_secure_vote_through_flower_equals_the_plain_vote(tiny_dir):
    secure, plain = _flower(tiny_dir)
    for key, counts in plain.aggregator.counts().items():
        assert torch.equal(secure.aggregator.counts()[key], counts)
    assert secure.aggregator.clients == 5 and not secure.aggregator.payloads[key]
    stats = secure.secagg
    assert set(stats) == {"keys", "share", "masked", "unmask", "sum"}
    assert stats["sum"]["threshold"] == 4 and stats["sum"]["dropped"] == 0
    # 5 sites: digits of base 6, 24 weights per word (3-bit lanes would hold 21)
    assert stats["sum"]["bits_per_weight_up"] == pytest.approx(64 / 24)


def test_authenticated_secure_vote_through_flower_runs_the_consistency_round(tiny_dir,
                                                                            tmp_path):
    """Deployed sites (site-mode deployment, keys in their node config): signed keys and the
    consistency round, the same counts as the plain vote; a site lost at the confirm stage
    still counts (4 of 5 signatures >= t); one lost at its keys or between its keys and its
    shares is out."""
    keys = site_keys(tmp_path, 5)
    secure, plain = _flower(tiny_dir, keys=keys)
    for key, counts in plain.aggregator.counts().items():
        assert torch.equal(secure.aggregator.counts()[key], counts)
    stats = secure.secagg
    assert set(stats) == {"keys", "share", "masked", "confirm", "unmask", "sum"}
    assert stats["sum"]["authenticated"] and stats["sum"]["consistency_round"]
    secure, plain = _flower(tiny_dir, {"query.secagg_confirm": [2]}, keys=keys, min_clients=3)
    assert secure.aggregator.clients == 5
    for key, counts in plain.aggregator.counts().items():
        assert torch.equal(secure.aggregator.counts()[key], counts)
    for stage in ("query.secagg_keys", "query.secagg_share"):  # lost before its shares
        secure, plain = _flower(tiny_dir, {stage: [1], "train.secagg_masks": [1]}, keys=keys,
                                min_clients=3)
        assert secure.aggregator.clients == 4  # "dropped": lost after advertising its keys
        assert secure.secagg["sum"]["dropped"] == (stage == "query.secagg_share")
        for key, counts in plain.aggregator.counts().items():
            assert torch.equal(secure.aggregator.counts()[key], counts)


def test_deployed_sites_without_keys_refuse_the_secure_vote(tiny_dir):
    from strategies.fedprllm import NotEnoughClientsError

    with pytest.raises(NotEnoughClientsError, match="SecAgg keys(.|\n)*set the node-config "
                                                    "keys secagg-key"):
        _flower(tiny_dir, keys=[{"site-mode": "deployment"}] * 5)


def test_secure_vote_survives_dropouts_within_the_threshold(tiny_dir):
    # lost before its masked votes: left out of the sum; its pairwise masks undone
    secure, plain = _flower(tiny_dir, {"train.secagg_masks": [3]}, min_clients=3)
    assert secure.aggregator.clients == 4 and secure.secagg["sum"]["dropped"] == 1
    for key, counts in plain.aggregator.counts().items():
        assert torch.equal(secure.aggregator.counts()[key], counts)
    # silent at the last stage: its votes still count (its seed rebuilt from 4 shares)
    secure, plain = _flower(tiny_dir, {"query.secagg_unmask": [1]}, min_clients=3)
    assert secure.aggregator.clients == 5
    for key, counts in plain.aggregator.counts().items():
        assert torch.equal(secure.aggregator.counts()[key], counts)


def test_secure_vote_below_the_threshold_fails_clearly(tiny_dir):
    from strategies.fedprllm import NotEnoughClientsError

    with pytest.raises(NotEnoughClientsError, match="SecAgg masked"):
        _flower(tiny_dir, {"train.secagg_masks": [0, 1]}, min_clients=2)
    with pytest.raises(NotEnoughClientsError, match="SecAgg unmasking failed"):
        _flower(tiny_dir, {"query.secagg_unmask": [0, 1]}, min_clients=2)


@pytest.mark.parametrize("kw, message", [
    (dict(defence="hamming"), "defence='hamming' is invalid: expected none or trim"),
    (dict(wire="compressed"), "wire='compressed' is invalid"),
    (dict(secagg_threshold=1), "secagg_threshold=1 is invalid"),
    (dict(secagg_threshold=9), "secagg_threshold=9 is invalid"),
])
def test_secagg_settings_are_checked(tiny_dir, kw, message):
    from fedcompress.config import SettingsError
    from fedcompress.methods.fedprllm.federated import FedPrLLMConfig

    with pytest.raises((SettingsError, ValueError), match=message):
        FedPrLLMConfig(model=tiny_dir, clients=4, secagg=True, **kw)


def test_the_key_agreement_is_flowers():
    """The library imports no Flower but agrees keys as Flower does: its ECDH key is Flower's
    shared key."""
    import base64

    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key

    from fedcompress.privacy.secagg import CURVE, agree

    a, b = ec.generate_private_key(CURVE), ec.generate_private_key(CURVE)
    assert base64.urlsafe_b64encode(agree(a, b.public_key())) == generate_shared_key(
        a, b.public_key())


@pytest.mark.parametrize("length", [1, 32, 48, 65])
def test_shamir_shares_rebuild_from_any_threshold_and_hide_below_it(length):
    """Any t of n shares rebuild the secret, in any order; t - 1 shares of two different
    secrets are distributed alike (the same share values are possible for both: for each
    secret there is exactly one polynomial through them); bad shares are named."""
    import itertools
    import secrets as pysecrets

    from fedcompress.privacy import shamir
    from fedcompress.privacy.secagg import combine_shares, create_shares

    secret = pysecrets.token_bytes(length)
    shares = create_shares(secret, 3, 6)
    for subset in itertools.combinations(shares, 3):
        assert combine_shares(list(reversed(subset))) == secret
    assert combine_shares(shares) == secret  # more than t: the same polynomial
    assert create_shares(secret, 3, 6) != shares  # fresh coefficients every time
    # t - 1 = 2 shares fit a degree-2 polynomial through ANY constant term: e.g. all zeros
    x1, x2 = (int.from_bytes(s[:4], "little") for s in shares[:2])
    y1, y2 = (int.from_bytes(s[5:], "big") for s in shares[:2])
    p = shamir.PRIME
    inv = pow(x1 * x2 * (x2 - x1) % p, -1, p)  # the 2 x 2 system's determinant
    for c0 in (0, 12345, int.from_bytes(secret, "big")):
        c1 = ((y1 - c0) * x2 * x2 - (y2 - c0) * x1 * x1) * inv % p
        c2 = (x1 * (y2 - c0) - x2 * (y1 - c0)) * inv % p
        assert all((c0 + c1 * x + c2 * x * x) % p == y for x, y in ((x1, y1), (x2, y2)))
    with pytest.raises(SecAggError, match="two shares with one index"):
        combine_shares([shares[0], shares[0], shares[1]])
    with pytest.raises(SecAggError, match="a share of 3 bytes"):
        combine_shares([b"abc"])
    with pytest.raises(SecAggError, match="a secret of 66 bytes"):
        create_shares(bytes(66), 2, 3)


def test_cost_script_on_a_tiny_model(tiny_dir, tmp_path):
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("secagg_cost", "simulations/secagg_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--model", tiny_dir, "--clients", "6", "--windows", "2", "--seqlen", "16",
                 "--drop", "1", "--batch-size", "2", "--neighbours", "4", "--complete",
                 "--stats", "wanda", "sparsegpt", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    secure = report["secure"]
    assert all(r["identical_to_plain"] for r in secure.values())
    assert secure["secagg, authenticated + consistency, 1 dropped"]["survivors"] == 5
    assert report["neighbours"] == 4 == secure["secagg, unauthenticated"]["neighbours"]
    complete = secure["secagg, authenticated + consistency, complete graph"]
    assert complete["neighbours"] == 5
    # a site uploads the same bytes on either graph and sends shares to its neighbours only
    assert complete["masked_bytes"] == secure["secagg, unauthenticated"]["masked_bytes"]
    assert complete["stages"]["share"]["bytes_up"] > secure[
        "secagg, authenticated + consistency"]["stages"]["share"]["bytes_up"]
    auth, plain = secure["secagg, authenticated + consistency"], secure["secagg, unauthenticated"]
    assert auth["authenticated"] and not plain["authenticated"]
    assert auth["stages"]["confirm"]["bytes_up"] > 0 == plain["stages"]["confirm"]["bytes_up"]
    assert auth["stages"]["keys"]["bytes_up"] > plain["stages"]["keys"]["bytes_up"]  # signed
    stats = report["stats_mode"]
    assert set(stats) == {"wanda", "sparsegpt"}
    for r in stats.values():  # one secure vote per decoder layer, its sum the plain one's
        assert r["sums_identical"] and r["layers"] == 3 and r["neighbours"] == 4  # 3 layers
        assert r["secure_round_work_seconds"] > r["vote_site_seconds"] > 0
    assert stats["sparsegpt"]["bytes_up_per_site"] > stats["wanda"]["bytes_up_per_site"]
    text = (tmp_path / "report.md").read_text()
    assert "x packed" in text and "| confirm |" in text
    assert "Statistics mode over SecAgg+" in text
    assert "python simulations/secagg_cost.py --model" in report["command_line"]


def test_a_site_failing_at_its_masked_votes_is_a_dropout(tiny_dir):
    """An injected error at the masked stage (the last partition): the sum is the others'."""
    secure, plain = _flower(tiny_dir, {"train.secagg_masks": [4]}, min_clients=3)
    failed, _ = _flower(tiny_dir, None, min_clients=3, fault="error", faulty=1)
    assert failed.aggregator.clients == 4
    assert [r["stage"] for r in failed.outcome.rejected] == ["secagg-masked"]
    for key, counts in secure.aggregator.counts().items():
        assert torch.equal(failed.aggregator.counts()[key], counts)


def test_iterative_secure_votes_equal_the_plain_iterative_run(tiny_dir):
    """One secure vote per decoder layer (fresh keys each time): every layer's counts and the
    pruned model equal the plain iterative run; a site lost at layer 1 is resynced at layer 2."""
    from conftest import InProcessFederation
    from flwr.app import ArrayRecord, ConfigRecord

    from fedcompress.methods.fedprllm.federated import FedPrLLMConfig
    from fedcompress.models import load_model
    from strategies.fedprllm import IterativeFedPrLLM, SecureIterativeFedPrLLM, make_strategy

    class Federation(InProcessFederation):
        app = "clients.app"

    config = FedPrLLMConfig(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16,
                            batch_size=2, mode="iterative", secagg=True, min_clients=3)
    model = load_model(tiny_dir, device="cpu").model
    secure = make_strategy(config, model)
    assert isinstance(secure, SecureIterativeFedPrLLM)
    secure.start(Federation(4), ArrayRecord())
    plain = IterativeFedPrLLM(config.replace(secagg=False), model)
    grid = Federation(4)
    for rnd in range(1, plain.num_rounds + 1):
        plain.aggregate_train(rnd, grid.send_and_receive(plain.configure_train(
            rnd, ArrayRecord(), ConfigRecord(), grid)))
    for layer, agg in plain.layer_aggregators.items():
        for key, counts in agg.counts().items():
            assert torch.equal(secure.layer_aggregators[layer].counts()[key], counts)
    a, b = (load_model(tiny_dir, device="cpu").model for _ in range(2))
    secure.prune(a)
    plain.prune(b)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))
    assert secure.secagg["sum"]["votes"] == 3

    class Flaky(Federation):
        def send_and_receive(self, messages, timeout=None):
            first = messages[0]
            lost = (first.metadata.message_type == "train.secagg_masks"
                    and int(first.content["round"]["layer"]) == 1)
            return super().send_and_receive(
                [m for m in messages if not (lost and m.metadata.dst_node_id == 102)], timeout)

    flaky = make_strategy(config, model)
    flaky.start(Flaky(4), ArrayRecord())
    assert [flaky.layer_aggregators[i].clients for i in range(3)] == [4, 3, 4]
    assert flaky.resynced == {2: [102]}


def test_iterative_authenticated_votes_one_per_layer(tiny_dir, tmp_path):
    """Deployed, authenticated sites (keys in their node config): one vote per decoder layer,
    each with its consistency round, the counts of the plain iterative run; each site's state
    holds the layers it voted on (a second vote on one is refused)."""
    from conftest import InProcessFederation
    from flwr.app import ArrayRecord, ConfigRecord

    from fedcompress.methods.fedprllm.federated import FedPrLLMConfig
    from fedcompress.models import load_model
    from fedcompress.privacy.secagg import unpack_blobs
    from strategies.fedprllm import IterativeFedPrLLM, make_strategy

    keys = site_keys(tmp_path, 4)

    class Federation(InProcessFederation):
        app = "clients.app"

        def __init__(self, n):
            super().__init__(n)
            for i in range(n):
                self.contexts[100 + i].node_config.update({**keys[i], "models": tiny_dir})

    config = FedPrLLMConfig(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16,
                            batch_size=2, mode="iterative", secagg=True, min_clients=3)
    model = load_model(tiny_dir, device="cpu").model
    secure = make_strategy(config, model)
    grid = Federation(4)
    secure.start(grid, ArrayRecord())
    assert secure.secagg["sum"]["votes"] == 3 and secure.secagg["sum"]["authenticated"]
    assert secure.secagg["confirm"]["valid"] == 12
    plain = IterativeFedPrLLM(config.replace(secagg=False), model)
    other = Federation(4)  # the reference's sites release their masks in the clear
    for context in other.contexts.values():
        context.node_config["require-secagg"] = False
    for rnd in range(1, plain.num_rounds + 1):
        plain.aggregate_train(rnd, other.send_and_receive(plain.configure_train(
            rnd, ArrayRecord(), ConfigRecord(), other)))
    for layer, agg in plain.layer_aggregators.items():
        for key, counts in agg.counts().items():
            assert torch.equal(secure.layer_aggregators[layer].counts()[key], counts)
    state = grid.contexts[100].state["fedprllm_secagg"]
    assert len(unpack_blobs(state["history"])) == 3 and state["seed"] == b"-"


def test_node_auth_keys_are_secagg_identities(tmp_path):
    """The keys a SuperNode registers for node authentication (what docker/make_certs.py and
    ``ssh-keygen -t ecdsa -b 384`` write, OpenSSH) are a site's SecAgg identity and peers as
    they are; Flower's own primitives accept the same keys."""
    import importlib.util

    from flwr.supercore.primitives.asymmetric import uses_nist_ec_curve

    from fedcompress.privacy.secagg import identity_public, load_identity, load_peers

    spec = importlib.util.spec_from_file_location("make_certs", "docker/make_certs.py")
    certs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(certs)
    made = [certs.make_node_keys(tmp_path, f"supernode-{i}") for i in range(3)]
    peers = load_peers(tmp_path)
    assert sorted(peers.values()) == [f"supernode-{i}.pub" for i in range(3)]
    for private, _ in made:
        key = load_identity(private)
        assert identity_public(key) in peers and uses_nist_ec_curve(key.public_key())
