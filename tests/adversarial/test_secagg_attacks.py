"""A malicious server against SecAgg+ (:mod:`fedcompress.privacy.secagg`): every attack is
performed as the server would (it holds every message, may drop, replay, reorder or forge any of
them, and may add its own keys) against sites with the default policy (a threshold above half
the federation; authenticated keys outside simulation), and must be refused or fail.

Each attack is also shown to WORK once the defence it targets is turned off, where that is
possible (a control: the attack code is real, not a test that passes by construction).
"""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedcompress.privacy.secagg import (
    CURVE,
    Advert,
    SecAggConfig,
    SecAggError,
    SecAggServer,
    SecAggSite,
    advert_payload,
    agree,
    combine_shares,
    identity_public,
    load_identity,
    load_peers,
    mask_stream,
    pack_lanes,
    survivors_payload,
    unpack_lanes,
)

NUMEL = 64


def sa_key(scalar: bytes):
    """A mask key rebuilt from its shares (its 48-byte scalar)."""
    from fedcompress.privacy.secagg import _key_from_scalar

    return _key_from_scalar(scalar, "a rebuilt key")


class Federation:
    """``n`` authenticated sites (long-term P-384 keys, each holding the others' public keys)
    in one vote, and the values they sum; the server is the test."""

    def __init__(self, n=5, t=3, layer=0, run=7, rnd=1, identities=None, authenticated=True,
                 min_threshold=None):
        self.identities = identities or {i: ec.generate_private_key(CURVE) for i in range(n)}
        self.peers = ({identity_public(k): f"site-{i}.pub" for i, k in self.identities.items()}
                      if authenticated else None)
        self.config = SecAggConfig(tuple(range(n)), t, NUMEL, run=run, round=rnd, layer=layer)
        self.sites = {i: SecAggSite(i, self.config, identity=self.identities[i] if
                                    authenticated else None, peers=self.peers,
                                    min_threshold=min_threshold) for i in range(n)}
        rng = np.random.default_rng(layer + 10 * run)
        self.values = {i: rng.integers(0, 2, NUMEL) for i in range(n)}
        self.public = {i: s.advertise() for i, s in self.sites.items()}
        self.server = SecAggServer(self.config, dict(self.public))

    def share(self):
        self.shares = {i: s.share(self.public) for i, s in self.sites.items()}
        self.inbox = self.server.relay(self.shares)
        return self

    def mask(self, who=None):
        self.masked = {i: self.sites[i].masked(self.values[i], self.inbox.get(i, {}))
                       for i in (self.sites if who is None else who)}
        return self

    def confirm(self, survivors=None):
        survivors = sorted(self.masked) if survivors is None else survivors
        self.signatures = {i: self.sites[i].confirm(survivors) for i in survivors}
        return survivors


def _forged_site(fed: Federation, index: int, signer: ec.EllipticCurvePrivateKey) -> Advert:
    """An advertisement the server makes for ``index`` with its own keys, signed by ``signer``."""
    c, s = (ec.generate_private_key(CURVE).public_key().public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
        for _ in range(2))
    return Advert(c, s, signer.sign(advert_payload(fed.config.vote_id, index, c, s),
                                    ec.ECDSA(hashes.SHA384())),
                  identity_public(signer))


# -- 1. the double request ------------------------------------------------------------------
def test_a_second_masked_request_in_one_vote_is_refused():
    fed = Federation().share().mask()
    with pytest.raises(SecAggError, match="repeated masked stage"):
        fed.sites[0].masked(np.zeros(NUMEL, int), fed.inbox[0])  # "sparsity=0"


def test_a_second_vote_on_the_same_layer_is_refused():
    """The server restarts the vote on the same input (same run and layer, another round) to
    difference two uploads or two sums: the site refuses to begin it."""
    fed = Federation()
    history = fed.sites[0].history
    again = SecAggConfig(fed.config.nodes, 3, NUMEL, run=7, round=2, layer=0)
    with pytest.raises(SecAggError, match="already took part in a vote on this input"):
        SecAggSite(0, again, identity=fed.identities[0], peers=fed.peers, history=history)
    stored = fed.sites[0].to_state()
    with pytest.raises(SecAggError, match="already took part"):
        SecAggSite.begin(0, again, stored, identity=fed.identities[0], peers=fed.peers)
    # another layer is another input: allowed, with fresh keys and seed
    other = SecAggSite.begin(0, SecAggConfig(fed.config.nodes, 3, NUMEL, run=7, round=2,
                                             layer=1), stored, identity=fed.identities[0],
                             peers=fed.peers)
    assert other.advertise().c != fed.public[0].c


def test_mask_streams_are_bound_to_the_vote():
    """The reviewer's attack needed two uploads under one stream (AES-CTR, zero nonce, same
    seed). Even from one secret, two votes' streams are independent, and the self and pairwise
    purposes too."""
    secret = bytes(range(32))
    a = mask_stream(secret, SecAggConfig((0, 1), 2, 8, layer=0).vote_id, b"self", 16)
    b = mask_stream(secret, SecAggConfig((0, 1), 2, 8, layer=1).vote_id, b"self", 16)
    c = mask_stream(secret, SecAggConfig((0, 1), 2, 8, layer=0).vote_id, b"pair", 16)
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    # and two votes of one site on the same input: the difference of the uploads is no input
    x = np.random.default_rng(0).integers(0, 2, NUMEL)
    ups = []
    for layer in (0, 1):
        fed = Federation(layer=layer).share()
        fed.values[0] = x
        ups.append(fed.mask().masked[0])
    with np.errstate(over="ignore"):
        diff = ups[0] - ups[1]
    assert not np.array_equal(diff, np.zeros_like(diff))
    assert not np.array_equal(fed.config.unpack(diff), x)


# -- 2. split views (different survivor sets to different sites) -----------------------------
def _split_view(fed: Federation, victim: int):
    """The reviewer's attack: tell some sites that ``victim`` survived (they reveal its seed
    share) and others that it dropped (they reveal its mask-key share); rebuild both and
    unmask the victim's vector alone. Returns the victim's vector, or raises."""
    t = fed.config.threshold
    others = [i for i in fed.sites if i != victim]
    with_v = sorted([victim, *others[:t - 1]])   # told: the victim survived
    without_v = others                           # told: the victim dropped
    signed_with = {i: fed.sites[i].confirm(with_v) for i in with_v}
    signed_without = {}
    for i in without_v:
        try:  # a site that confirmed the other set signs no second one
            signed_without[i] = fed.sites[i].confirm(without_v)
        except SecAggError:
            continue
    seed_shares = [fed.sites[i].unmask(with_v, signed_with)[victim] for i in with_v[:t]]
    key_shares = [fed.sites[i].unmask(without_v, signed_without)[victim]
                  for i in without_v if i not in with_v]
    seed = combine_shares(seed_shares)
    key = sa_key(combine_shares(key_shares))
    vote = fed.config.vote_id
    words = fed.masked[victim].copy()
    with np.errstate(over="ignore"):
        words -= mask_stream(seed, vote, b"self", words.size)
        for j in fed.sites:
            if j == victim:
                continue
            pair = mask_stream(agree(key, ec.EllipticCurvePublicKey.from_encoded_point(
                CURVE, fed.public[j].s)), vote, b"pair", words.size)
            words = words - pair if victim < j else words + pair
    return fed.config.unpack(words)


def test_split_views_fail_with_the_consistency_round():
    fed = Federation(n=5, t=3).share().mask()
    with pytest.raises(SecAggError, match="2 survivors signed the survivor set, below the "
                                          "threshold 3"):
        _split_view(fed, victim=0)


def test_split_views_unmask_a_site_without_the_defences():
    """Control: the same attack against what the reviewer attacked (unauthenticated, no
    consistency round, a threshold of 2 of 5 taken from the server) recovers the vector."""
    fed = Federation(n=5, t=2, authenticated=False, min_threshold=2).share().mask()
    assert np.array_equal(_split_view(fed, victim=0), fed.values[0])


def test_a_threshold_below_the_sites_minimum_is_refused():
    """The split view needs 2t <= n: the site's own floor (more than half the federation)
    rules it out, whatever the server asks."""
    with pytest.raises(SecAggError, match="threshold=2 is below this site's minimum 3"):
        Federation(n=5, t=2)
    with pytest.raises(SecAggError, match="threshold=2 is below this site's minimum 3"):
        Federation(n=5, t=2, authenticated=False)  # simulation: a majority of the vote


# -- 3. swapped keys (man in the middle) ----------------------------------------------------
def test_swapped_channel_keys_are_refused():
    """The server puts its own channel key in place of site 1's, to read the shares sent to
    it: site 1's signature does not cover the server's key."""
    fed = Federation()
    mitm = ec.generate_private_key(CURVE).public_key().public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    forged = {**fed.public, 1: fed.public[1]._replace(c=mitm)}
    with pytest.raises(SecAggError, match="node 1's signature .* does not verify"):
        fed.sites[0].share(forged)


def test_keys_swapped_between_two_sites_are_refused():
    fed = Federation()
    swapped = {**fed.public, 1: fed.public[2], 2: fed.public[1]}
    with pytest.raises(SecAggError, match="does not verify"):
        fed.sites[0].share(swapped)


def test_stripped_signatures_are_refused():
    """Downgrade: the server relays the keys without their signatures."""
    fed = Federation()
    bare = {i: Advert(a.c, a.s) if i else a for i, a in fed.public.items()}
    with pytest.raises(SecAggError, match="node 1's keys are not signed"):
        fed.sites[0].share(bare)


def test_this_sites_own_advertisement_must_come_back_unchanged():
    fed = Federation()
    with pytest.raises(SecAggError, match="another advertisement for this site"):
        fed.sites[0].share({**fed.public, 0: _forged_site(fed, 0, fed.identities[0])})


# -- 4. a server-invented (Sybil) site, duplicate identities ---------------------------------
def test_a_sybil_site_is_refused():
    """The server replaces a site by one it controls (its own long-term key)."""
    fed = Federation()
    server_key = ec.generate_private_key(CURVE)
    with pytest.raises(SecAggError, match="signed by a key that is not one of the federation"):
        fed.sites[0].share({**fed.public, 4: _forged_site(fed, 4, server_key)})


def test_a_vote_larger_than_the_federation_is_refused():
    """More sites than the federation has authenticated members: some are the server's."""
    identities = {i: ec.generate_private_key(CURVE) for i in range(3)}
    peers = {identity_public(k): str(i) for i, k in identities.items()}
    with pytest.raises(SecAggError, match="a vote of 5 sites in a federation of 3"):
        SecAggSite(0, SecAggConfig(tuple(range(5)), 3, NUMEL), identity=identities[0],
                   peers=peers)


def test_one_identity_twice_is_refused():
    """A peer's key under two indices (one identity counted as two sites)."""
    fed = Federation()
    twice = {**fed.public, 4: _forged_site(fed, 4, fed.identities[3])}
    with pytest.raises(SecAggError, match="nodes 3 and 4 are one identity"):
        fed.sites[0].share(twice)


def test_a_peer_folder_with_one_key_twice_is_refused(tmp_path):
    key = ec.generate_private_key(CURVE).public_key()
    for name in ("a.pub", "b.pub"):
        (tmp_path / name).write_bytes(key.public_bytes(serialization.Encoding.OpenSSH,
                                                       serialization.PublicFormat.OpenSSH))
    with pytest.raises(SecAggError, match="are the same key"):
        load_peers(tmp_path)


def test_a_site_whose_own_key_is_not_a_peer_refuses():
    fed = Federation()
    with pytest.raises(SecAggError, match="own identity key is not among"):
        SecAggSite(0, SecAggConfig(fed.config.nodes, 3, NUMEL, layer=5),
                   identity=ec.generate_private_key(CURVE), peers=fed.peers)


# -- 5. replayed and out-of-order messages ---------------------------------------------------
def test_replayed_keys_from_another_vote_are_refused():
    """Site 1's genuine, signed keys of layer 0 replayed into the vote of layer 1 (the server
    knows nothing of site 1's layer-1 secrets but could hope to reuse layer-0 material)."""
    identities = {i: ec.generate_private_key(CURVE) for i in range(5)}
    old, new = Federation(layer=0, identities=identities), Federation(layer=1,
                                                                       identities=identities)
    with pytest.raises(SecAggError, match="node 1's signature .* does not verify"):
        new.sites[0].share({**new.public, 1: old.public[1]})


def test_replayed_survivor_signatures_from_another_vote_are_refused():
    identities = {i: ec.generate_private_key(CURVE) for i in range(5)}
    old = Federation(layer=0, identities=identities).share().mask()
    survivors = old.confirm()
    new = Federation(layer=1, identities=identities).share().mask()
    new.confirm()
    with pytest.raises(SecAggError, match="signature on the survivor set does not verify"):
        new.sites[0].unmask(survivors, old.signatures)


def test_replayed_share_ciphertexts_are_refused():
    identities = {i: ec.generate_private_key(CURVE) for i in range(5)}
    old = Federation(layer=0, identities=identities).share()
    new = Federation(layer=1, identities=identities).share()
    with pytest.raises(SecAggError, match="do not decrypt"):
        new.sites[0].masked(new.values[0], {**new.inbox[0], 1: old.inbox[0][1]})


def test_repeated_stages_are_refused():
    fed = Federation().share()
    with pytest.raises(SecAggError, match="repeated share stage"):
        fed.sites[0].share(fed.public)
    fed.mask()
    survivors = fed.confirm()
    with pytest.raises(SecAggError, match="repeated confirm stage"):
        fed.sites[0].confirm(survivors)
    fed.sites[0].unmask(survivors, fed.signatures)
    with pytest.raises(SecAggError, match="repeated unmask stage"):
        fed.sites[0].unmask(survivors, fed.signatures)


@pytest.mark.parametrize("stage", ["masked", "confirm", "unmask"])
def test_out_of_order_stages_are_refused(stage):
    fed = Federation()
    site = fed.sites[0]
    with pytest.raises(SecAggError, match="out of order"):
        if stage == "masked":
            site.masked(fed.values[0], {})
        elif stage == "confirm":
            site.confirm([0, 1, 2])
        else:
            site.unmask([0, 1, 2], {})


def test_unmasking_without_the_consistency_round_is_refused():
    """An authenticated site never skips the consistency round."""
    fed = Federation().share().mask()
    with pytest.raises(SecAggError, match="unmask stage after 'masked'.*expected confirm"):
        fed.sites[0].unmask(sorted(fed.masked), {})


def test_a_stage_for_another_vote_or_layer_is_refused():
    fed = Federation(layer=3, run=7, rnd=4).share()
    site = fed.sites[0]
    for run, rnd, layer in ((7, 4, 2), (7, 5, 3), (8, 4, 3)):
        with pytest.raises(SecAggError, match="this site is in the vote of run 7, round 4, "
                                              "layer 3: refused"):
            site.expect("masked", run, rnd, layer)
    site.expect("masked", 7, 4, 3)  # its own vote: the next stage


# -- 6. the survivor set ---------------------------------------------------------------------
def test_a_survivor_set_signed_by_too_few_is_refused():
    fed = Federation().share().mask()
    survivors = fed.confirm()
    two = dict(list(fed.signatures.items())[:2])
    with pytest.raises(SecAggError, match="2 survivors signed the survivor set, below"):
        fed.sites[0].unmask(survivors, two)


def test_forged_survivor_signatures_are_refused():
    fed = Federation().share().mask()
    survivors = fed.confirm()
    server_key = ec.generate_private_key(CURVE)
    forged = {**fed.signatures, 1: server_key.sign(
        survivors_payload(fed.sites[1]._view, survivors),
        ec.ECDSA(hashes.SHA384()))}
    with pytest.raises(SecAggError, match="node 1's signature on the survivor set does not "
                                          "verify"):
        fed.sites[0].unmask(survivors, forged)


def test_signatures_on_another_set_are_refused():
    """The server gathers signatures on a set, then asks for shares on another."""
    fed = Federation().share().mask()
    fed.confirm([0, 1, 2, 3, 4])
    with pytest.raises(SecAggError, match="this site confirmed .*split view"):
        fed.sites[0].unmask([0, 1, 2, 3], fed.signatures)


def test_signatures_of_non_survivors_are_refused():
    fed = Federation().share().mask()
    fed.confirm([0, 1, 2, 3, 4])
    sigs = fed.signatures
    fed2 = Federation().share().mask()
    fed2.confirm([0, 1, 2])
    with pytest.raises(SecAggError, match="not survivors"):
        fed2.sites[0].unmask([0, 1, 2], {**fed2.signatures, 3: sigs[3]})


def test_a_survivor_that_never_shared_is_refused():
    """Site 4 drops before its shares (not in U2); the server names it a survivor to learn
    the others' shares of a seed it then pairs with its own stand-in for site 4."""
    fed = Federation()
    fed.shares = {i: fed.sites[i].share(fed.public) for i in range(4)}
    fed.inbox = fed.server.relay(fed.shares)
    fed.mask(who=range(4))
    with pytest.raises(SecAggError, match=r"sites \[4\] whose shares never reached this site"):
        fed.sites[0].confirm([0, 1, 2, 3, 4])


def test_a_survivor_set_without_this_site_is_refused():
    """Name the site itself dropped: it would reveal its own mask key next to its upload."""
    fed = Federation().share().mask()
    with pytest.raises(SecAggError, match="this site not in them"):
        fed.sites[0].confirm([1, 2, 3, 4])


def test_an_aborted_vote_stays_aborted():
    """After a refusal the site answers nothing more in that vote (the server cannot retry
    the stage with other inputs)."""
    fed = Federation().share().mask()
    with pytest.raises(SecAggError):
        fed.sites[0].confirm([1, 2, 3, 4])
    with pytest.raises(SecAggError, match="aborted at this site"):
        fed.sites[0].unmask([0, 1, 2, 3, 4], {})
    assert fed.sites[0].to_state()["seed"] == b"-"  # its secrets are gone


def test_an_identity_change_mid_vote_is_refused():
    """The stored state of an authenticated vote reloaded without keys (a downgrade) or with
    another identity."""
    fed = Federation().share()
    state = fed.sites[0].to_state()
    with pytest.raises(SecAggError, match="identity changed"):
        SecAggSite.from_state(state)
    with pytest.raises(SecAggError, match="identity changed"):
        SecAggSite.from_state(state, fed.identities[1], fed.peers)
    SecAggSite.from_state(state, fed.identities[0], fed.peers).expect("masked")


def test_the_honest_authenticated_vote_sums_exactly_with_a_dropout_at_each_stage():
    """The defences leave the protocol working: 7 sites, t = 4; one lost after its keys,
    one after its shares, one after its masked vector (it still counts)."""
    fed = Federation(n=7, t=4)
    fed.shares = {i: fed.sites[i].share(fed.public) for i in range(1, 7)}  # 0 lost
    fed.inbox = fed.server.relay(fed.shares)
    fed.mask(who=range(2, 7))  # 1 lost
    survivors = fed.confirm()
    shares = {i: fed.sites[i].unmask(survivors, fed.signatures) for i in range(3, 7)}  # 2 lost
    total = fed.server.aggregate(fed.masked, shares)
    assert np.array_equal(total, sum(fed.values[i] for i in range(2, 7)))


# -- 7. through the ClientApp: what a deployed site answers ----------------------------------
def _keys(tmp_path, n):
    """``n`` sites' node-auth style keys: OpenSSH private keys and a folder of .pub."""
    from conftest import write_site_keys

    return write_site_keys(tmp_path, n)


def _keys_message(run=1, group="1", layer=-1, sites=5, threshold=4, index=0, numel=NUMEL):
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run, 0, 1

    msg = Message(RecordDict({"secagg": ConfigRecord({
        "sites": sites, "threshold": threshold, "numel": numel, "bits": 0, "index": index,
        "neighbours": 0,
        "layer": layer})}), 100, "query.secagg_keys", group_id=group)
    return msg


def _context(node_config):
    from flwr.app import Context, RecordDict

    return Context(run_id=1, node_id=100, node_config=node_config, state=RecordDict(),
                   run_config={}, series_id=0)


def test_a_deployed_site_without_keys_refuses_secagg():
    from clients.fedprllm import secagg_keys

    context = _context({"partition-id": 0, "site-mode": "deployment"})
    with pytest.raises(SecAggError, match="set the node-config keys secagg-key .* and "
                                          "secagg-peers"):
        secagg_keys(_keys_message(), context)


def test_a_site_takes_its_threshold_floor_from_its_policy_not_the_message(tmp_path):
    from clients.fedprllm import secagg_keys

    keys, peers = _keys(tmp_path, 5)
    config = {"partition-id": 0, "site-mode": "deployment", "secagg-key": str(keys[0]),
              "secagg-peers": str(peers)}
    with pytest.raises(SecAggError, match="threshold=3 is below this site's minimum 4 for a "
                                          "federation of 5"):  # one colluder by default
        secagg_keys(_keys_message(threshold=3), _context(config))
    # a vote over 3 of the 5 sites still needs 4 (the federation's floor, not the vote's)
    with pytest.raises(SecAggError, match="threshold=3 is below this site's minimum 4"):
        secagg_keys(_keys_message(sites=3, threshold=3), _context(config))
    reply = secagg_keys(_keys_message(threshold=4), _context(config))
    record = reply.content["secagg"]
    assert record["authenticated"] and identity_public(load_identity(keys[0])) == bytes(
        record["signer"])


def test_the_handlers_refuse_a_double_request_and_a_stage_of_another_layer(tmp_path):
    """Through the ClientApp handlers, as the server sends them: a second keys message for
    the same layer, and a share message naming another layer."""
    from flwr.app import ConfigRecord, Message, RecordDict

    from clients.fedprllm import secagg_keys, secagg_share
    from fedcompress.privacy.secagg import pack_blobs, pack_ints

    _keys_message()  # sets the message identity
    keys, peers = _keys(tmp_path, 5)
    context = _context({"partition-id": 0, "site-mode": "deployment",
                        "secagg-key": str(keys[0]), "secagg-peers": str(peers)})
    secagg_keys(_keys_message(layer=2, group="3"), context)
    with pytest.raises(SecAggError, match="already took part in a vote on this input"):
        secagg_keys(_keys_message(layer=2, group="4"), context)  # the same layer, later round
    share = Message(RecordDict({"secagg": ConfigRecord({
        "layer": 1, "nodes": pack_ints([]), "c": pack_blobs([]), "s": pack_blobs([]),
        "signature": pack_blobs([]), "signer": pack_blobs([])})}), 100, "query.secagg_share",
        group_id="3")
    with pytest.raises(SecAggError, match="this site is in the vote of run 1, round 3, layer 2"):
        secagg_share(share, context)


def test_an_unauthenticated_simulated_site_says_so():
    from clients.fedprllm import secagg_keys

    reply = secagg_keys(_keys_message(), _context({"partition-id": 0,
                                                   "site-mode": "simulation"}))
    assert reply.content["secagg"]["authenticated"] is False


def test_public_keys_load_in_both_formats(tmp_path):
    key = ec.generate_private_key(CURVE)
    (tmp_path / "a.pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    other = ec.generate_private_key(CURVE)
    (tmp_path / "b.pub").write_bytes(other.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b" site-b\n")
    assert set(load_peers(tmp_path)) == {identity_public(key), identity_public(other)}
    (tmp_path / "c.pub").write_bytes(ec.generate_private_key(ec.SECP256R1()).public_key()
                                     .public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat
                                                   .SubjectPublicKeyInfo))
    with pytest.raises(SecAggError, match="expected a P-384"):
        load_peers(tmp_path)


def test_packing_is_what_was_summed():
    """Sanity of the helpers the attacks use."""
    x = np.arange(NUMEL) % 2
    assert np.array_equal(unpack_lanes(pack_lanes(x, 3), 3, NUMEL), x)


# -- 8. attacks of our own -------------------------------------------------------------------
def test_different_vote_parameters_per_site_are_refused():
    """The server tells sites different thresholds (or sizes) in one round, hoping one of them
    accepts a weaker vote with the others' keys: the vote id differs, so no signature
    verifies across the two."""
    identities = {i: ec.generate_private_key(CURVE) for i in range(5)}
    strong = Federation(n=5, t=4, identities=identities)
    weak = Federation(n=5, t=3, identities=identities)
    mixed = {**weak.public, 1: strong.public[1]}
    with pytest.raises(SecAggError, match="node 1's signature .* does not verify"):
        weak.sites[0].share(mixed)


def test_a_shrunken_u2_does_not_isolate_a_site():
    """The server forwards to the victim only the shares of two sites (its U2 = {v, 1, 2}),
    then names 1 and 2 dropped so that the others reveal their mask keys: with the victim's
    seed that would unmask it. The victim refuses to confirm a survivor set outside its U2, and
    the others alone are too few to sign it."""
    fed = Federation(n=5, t=3).share()
    fed.inbox[0] = {j: fed.inbox[0][j] for j in (1, 2)}
    fed.mask()
    survivors = [0, 3, 4]
    with pytest.raises(SecAggError, match=r"names sites \[3, 4\] whose shares never reached"):
        fed.sites[0].confirm(survivors)
    signatures = {i: fed.sites[i].confirm(survivors) for i in (3, 4)}
    with pytest.raises(SecAggError, match="2 survivors signed the survivor set, below the "
                                          "threshold 3"):
        fed.sites[3].unmask(survivors, signatures)


# -- split views with colluding sites (Bonawitz et al. 2017: t must exceed (n + k) / 2) ------
def _split_view_attack(t: int, min_threshold: int | None = None) -> bool:
    """n = 5 authenticated sites, site 4 colludes with the server; the server tells {0, 1, 4}
    that victim 0 survived and {2, 3, 4} that it dropped, and completes each group's signatures
    with the colluder's. True when the victim's vector comes out alone."""
    import numpy as np
    from cryptography.hazmat.primitives.asymmetric import ec

    from fedcompress.privacy import secagg as sa

    n, numel, victim, colluder = 5, 64, 0, 4
    ids = {i: ec.generate_private_key(sa.CURVE) for i in range(n)}
    peers = {sa.identity_public(k): f"s{i}.pub" for i, k in ids.items()}
    cfg = sa.SecAggConfig(tuple(range(n)), t, numel, run=7, round=1, layer=0)
    sites = {i: sa.SecAggSite(i, cfg, identity=ids[i], peers=peers, min_threshold=min_threshold)
             for i in range(n)}
    values = {i: np.random.default_rng(i).integers(0, 2, numel) for i in range(n)}
    public = {i: s.advertise() for i, s in sites.items()}
    inbox = sa.SecAggServer(cfg, dict(public)).relay({i: s.share(public)
                                                      for i, s in sites.items()})
    masked = {i: sites[i].masked(values[i], inbox.get(i, {})) for i in sites}
    honest = [i for i in range(n) if i != colluder]
    group_a = [victim, *[i for i in honest if i != victim][:t - 2]]  # victim survived
    group_b = [i for i in honest if i not in group_a][:t - 1]  # victim dropped
    if len(group_b) < t - 1:
        return False  # not enough honest sites for a second, disjoint confirmation
    seeds, keys = [], []
    for group, out in ((group_a, seeds), (group_b, keys)):
        survivors = sorted([*group, colluder])
        signatures = {i: sites[i].confirm(survivors) for i in group}
        signatures[colluder] = sa._sign(ids[colluder], sa.survivors_payload(
            sites[colluder]._view, survivors))
        out += [sites[i].unmask(survivors, signatures)[victim] for i in group]
    seeds.append(sites[colluder]._received[victim][0])
    keys.append(sites[colluder]._received[victim][1])
    seed = sa.combine_shares(seeds[:t])
    key = sa._key_from_scalar(sa.combine_shares(keys[:t]), "key")
    words = masked[victim].copy()
    with np.errstate(over="ignore"):
        words -= sa.mask_stream(seed, cfg.vote_id, b"self", words.size)
        for j in sites:
            if j != victim:
                pair = sa.mask_stream(sa.agree(key, ec.EllipticCurvePublicKey.from_encoded_point(
                    sa.CURVE, public[j].s)), cfg.vote_id, b"pair", words.size)
                words = words - pair if victim < j else words + pair
    return np.array_equal(cfg.unpack(words), values[victim])


def test_split_view_with_one_colluder_needs_the_colluder_bound():
    """With one colluding site, a majority threshold (t = 3 of 5) is NOT enough: the split view
    unmasks the victim (the control: the attack is real). A site whose policy declares one
    colluder (secagg-max-colluders = 1, the default) asks for t >= 4 and refuses t = 3; at t = 4
    no two disjoint groups of honest sites exist, so the split view cannot be confirmed."""
    from fedcompress.privacy.policy import SitePolicy, site_policy

    assert _split_view_attack(t=3)  # a majority floor (a site trusting every other) admits it
    assert SitePolicy(secagg_max_colluders=0).min_secagg_threshold(5) == 3
    policy = site_policy({"site-mode": "deployment", "state-dir": "/nonexistent-not-used"})
    assert policy.min_secagg_threshold(5) == 4 == SitePolicy().min_secagg_threshold(5)
    with pytest.raises(SecAggError, match="below this site's minimum 4"):
        _split_view_attack(t=3, min_threshold=4)
    assert not _split_view_attack(t=4, min_threshold=4)


# -- the sparse masking graph (Bell et al. 2020) ---------------------------------------------
def _ring(n=8, t=5, colluders=1, seed=0):
    """``n`` authenticated sites in a vote whose masking graph is a ring (degree 2; the sites'
    floor lowered to 2 so that they take part), keys relayed and shares exchanged."""
    ids = {i: ec.generate_private_key(CURVE) for i in range(n)}
    peers = {identity_public(k): f"s{i}.pub" for i, k in ids.items()}
    cfg = SecAggConfig(tuple(range(n)), t, NUMEL, run=9, round=1, layer=0, neighbours=2)
    sites = {i: SecAggSite(i, cfg, identity=ids[i], peers=peers, min_neighbours=2,
                           max_colluders=colluders) for i in range(n)}
    public = {i: s.advertise() for i, s in sites.items()}
    shares = {i: s.share(public) for i, s in sites.items()}
    inbox = SecAggServer(cfg, dict(public)).relay(shares)
    values = {i: np.random.default_rng(seed + i).integers(0, 2, NUMEL) for i in range(n)}
    return cfg, ids, sites, public, inbox, values


def _isolate(colluders: int) -> np.ndarray:
    """The server isolates a victim behind a colluder: of the victim's two neighbours on the
    ring, one is dropped before its masked votes and the other colludes (hands the server its
    mask key). It announces the other 7 sites as survivors (at least t = 5), gathers their
    signatures and shares, and unmasks the victim alone. Returns the victim's vector as the
    server rebuilds it (SecAggError when the sites refuse)."""
    cfg, ids, sites, public, inbox, values = _ring(colluders=colluders)
    victim = 0
    dropped, colluder = sorted(sites[victim].neighbours)
    masked = {i: sites[i].masked(values[i], inbox.get(i, {})) for i in sites if i != dropped}
    survivors = sorted(masked)
    key_c = sites[colluder]._s  # the colluder's own mask key
    signatures = {i: sites[i].confirm(survivors) for i in survivors}
    unmask = {i: sites[i].unmask(survivors, signatures) for i in survivors}
    seed = combine_shares([unmask[i][victim] for i in (victim, colluder)])
    key_d = combine_shares([unmask[i][dropped] for i in sorted(sites[dropped].neighbours)])
    key_d = sa_key(key_d)
    words = masked[victim].copy()
    with np.errstate(over="ignore"):
        words -= mask_stream(seed, cfg.vote_id, b"self", words.size)
        for other, key in ((dropped, key_d), (colluder, key_c)):
            pair = mask_stream(agree(key, ec.EllipticCurvePublicKey.from_encoded_point(
                CURVE, public[victim].s)), cfg.vote_id, b"pair", words.size)
            words = words - pair if victim < other else words + pair
    out = cfg.unpack(words)
    assert np.array_equal(out, values[victim])
    return out


def test_a_victim_cut_off_by_a_colluder_and_a_drop_is_refused():
    """The control: sites that trust every other site (secagg-max-colluders = 0) reveal their
    shares and the server reads the victim's vector alone. With the default bound of one
    colluder every site finds the cut (the colluder) before it signs the survivor set."""
    _isolate(colluders=0)  # the attack is real
    with pytest.raises(SecAggError, match=r"without sites \[\d\] .* falls apart"):
        _isolate(colluders=1)


def test_shares_from_a_site_that_is_not_a_neighbour_are_refused():
    cfg, ids, sites, public, inbox, values = _ring()
    stranger = next(i for i in sites if i != 0 and i not in sites[0].neighbours)
    neighbour = min(sites[0].neighbours)
    forged = {**inbox[0], stranger: inbox[0][neighbour]}
    with pytest.raises(SecAggError, match=f"node {stranger}, which is not this site's "
                                          "neighbour"):
        sites[0].masked(values[0], forged)


def test_too_few_neighbours_shares_are_refused():
    """The server withholds all but one of a site's neighbours' shares (it would mask with one
    site only): below its neighbourhood's threshold, refused."""
    n = 12
    cfg = SecAggConfig(tuple(range(n)), 8, NUMEL, neighbours=4)
    sites = {i: SecAggSite(i, cfg, min_neighbours=4) for i in range(n)}
    public = {i: s.advertise() for i, s in sites.items()}
    inbox = SecAggServer(cfg, dict(public)).relay({i: s.share(public) for i, s in sites.items()})
    one = dict(list(inbox[0].items())[:1])
    with pytest.raises(SecAggError, match="shares of 2 sites .* below the threshold 3"):
        sites[0].masked(np.zeros(NUMEL, int), one)


def test_a_split_view_of_the_advertised_keys_is_refused():
    """The server shows site 0 every advertisement but one (so site 0 derives another graph)
    and the others all of them: the shares of site 0 name its graph's seed, which no other site
    derived, and are refused wherever they land."""
    n = 10
    cfg = SecAggConfig(tuple(range(n)), 6, NUMEL, neighbours=4)
    sites = {i: SecAggSite(i, cfg, min_neighbours=4) for i in range(n)}
    public = {i: s.advertise() for i, s in sites.items()}
    partial = {i: a for i, a in public.items() if i != 9}
    shares = {0: sites[0].share(partial), **{i: sites[i].share(public) for i in range(1, n)}}
    inbox = SecAggServer(cfg, dict(public)).relay(shares)
    hit = [i for i in range(1, n) if 0 in inbox.get(i, {}) and 0 in sites[i].neighbours]
    assert hit  # site 0's shares reach a site that also counts it as a neighbour
    for i in hit:
        with pytest.raises(SecAggError, match="another vote, pair or set of advertised keys"):
            sites[i].masked(np.zeros(NUMEL, int), inbox[i])


def test_a_survivor_set_that_names_a_site_without_keys_is_refused():
    cfg, ids, sites, public, inbox, values = _ring()
    masked = {i: sites[i].masked(values[i], inbox.get(i, {})) for i in sites}
    with pytest.raises(SecAggError, match=r"names sites \[11\] that advertised no keys"):
        sites[0].confirm([*sorted(masked), 11])
