"""Property tests of the server's wire decoders (``hypothesis``): random, truncated and mutated
payloads (bit-packed and compressed masks, OWL outlier ratios, unit classes) are rejected with a
clear error of the decoder's own type, never another exception, and never reach the vote. A
mutated bit-packed payload that still decodes is another valid mask; a mutated compressed one
decodes only to the client's own mask (its CRC is checked)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcompress.masks.codec import MaskDecodeError
from fedcompress.masks.stats import flatten_masks
from fedcompress.methods.fedprllm.federated import (
    FedPrLLMConfig,
    InvalidMaskError,
    MaskAggregator,
    decode_wire,
    encode_masks,
    encode_wire,
    expected_shapes,
)
from fedcompress.models import load_model
from fedcompress.pruning.local import PruneConfig, local_masks

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, device="cpu")


@pytest.fixture(scope="module")
def valid(tiny, tiny_dir):
    """One client's honest payload in both wire formats, with the decoding context."""
    windows = torch.randint(5, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    masks = local_masks(tiny.model, windows, PruneConfig("wanda", 0.5, "row"), 2).masks
    out = {}
    for wire in ("packed", "compressed"):
        config = FedPrLLMConfig(model=tiny_dir, clients=2, seqlen=16, wire=wire,
                                wire_reference="none")
        payload = (encode_masks(masks) if wire == "packed" else
                   encode_wire(flatten_masks(masks), tiny.model, config, {}))
        out[wire] = (config, payload)
    return out


def _decode(tiny, config, payload):
    shapes = expected_shapes(tiny.model)
    return decode_wire(payload, shapes, tiny.model, config, {} if config.wire == "compressed"
                       else None)


def _must_reject_or_be_valid(tiny, config, payload):
    """The decoder either raises InvalidMaskError (clear message) or returns a payload that
    the aggregator accepts as one valid site."""
    try:
        decoded = _decode(tiny, config, payload)
    except InvalidMaskError as err:
        assert str(err)
        return False
    agg = MaskAggregator(tiny.model, 1)
    agg.add_packed(decoded)
    return True


@pytest.mark.parametrize("wire", ["packed", "compressed"])
def test_honest_payload_decodes(tiny, valid, wire):
    config, payload = valid[wire]
    assert _must_reject_or_be_valid(tiny, config, payload)


@pytest.mark.parametrize("wire", ["packed", "compressed"])
@FUZZ
@given(data=st.data())
def test_truncated_and_extended_payloads_are_rejected(tiny, valid, wire, data):
    config, payload = valid[wire]
    key = data.draw(st.sampled_from(sorted(payload)))
    size = payload[key].size
    cut = data.draw(st.integers(0, size - 1) | st.integers(size + 1, size + 64))
    body = (payload[key][:cut] if cut < size else
            np.concatenate([payload[key], np.zeros(cut - size, np.uint8)]))
    bad = {**payload, key: body}
    assert not _must_reject_or_be_valid(tiny, config, bad)


@FUZZ
@given(data=st.data())
def test_mutated_compressed_payloads_never_decode_to_garbage(tiny, valid, data):
    config, payload = valid["compressed"]
    key = data.draw(st.sampled_from(sorted(payload)))
    body = payload[key].copy()
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, body.size - 1))
        body[i] ^= data.draw(st.integers(1, 255))
    bad = {**payload, key: body}
    if _must_reject_or_be_valid(tiny, config, bad):
        # a header field the decoder does not need for this mask (e.g. a coding parameter of an
        # absent section) was hit: the mask's CRC held, so it is exactly the client's mask
        original, decoded = _decode(tiny, config, payload), _decode(tiny, config, bad)
        assert all(np.array_equal(original[k], decoded[k]) for k in original)


@FUZZ
@given(data=st.data())
def test_mutated_packed_payloads_are_valid_masks_or_rejected(tiny, valid, data):
    """A flipped bit of a packed mask is another mask: accepted only if its sparsity stays in
    the tolerance (padding bits and sparsity are checked); never an exception of another kind."""
    config, payload = valid["packed"]
    key = data.draw(st.sampled_from(sorted(payload)))
    body = payload[key].copy()
    for _ in range(data.draw(st.integers(1, 64))):
        i = data.draw(st.integers(0, body.size - 1))
        body[i] ^= data.draw(st.integers(1, 255))
    _must_reject_or_be_valid(tiny, config, {**payload, key: body})


@pytest.mark.parametrize("wire", ["packed", "compressed"])
@FUZZ
@given(data=st.data())
def test_random_payloads_are_rejected(tiny, valid, wire, data):
    config, payload = valid[wire]
    key = data.draw(st.sampled_from(sorted(payload)))
    dtype = data.draw(st.sampled_from([np.uint8, np.int8, np.int32, np.float32, np.float64]))
    n = data.draw(st.integers(0, 256))
    raw = data.draw(st.binary(min_size=n * np.dtype(dtype).itemsize,
                              max_size=n * np.dtype(dtype).itemsize))
    body = np.frombuffer(raw, dtype=dtype).copy()
    if data.draw(st.booleans()):
        body = body.reshape(1, -1)
    bad = {**payload, key: body}
    if body.dtype == np.uint8 and body.ndim == 1 and body.size == payload[key].size \
            and wire == "packed":
        _must_reject_or_be_valid(tiny, config, bad)  # right size: a mask, checked by sparsity
    else:
        assert not _must_reject_or_be_valid(tiny, config, bad)


@pytest.mark.parametrize("wire", ["packed", "compressed"])
@FUZZ
@given(names=st.lists(st.text(min_size=1, max_size=30), max_size=3))
def test_unknown_or_missing_layers_are_rejected(tiny, valid, wire, names):
    config, payload = valid[wire]
    bad = dict(payload)
    if names:
        for name in names:
            bad[name] = next(iter(payload.values()))
    else:
        bad.pop(next(iter(bad)))
    if set(bad) == set(payload):
        return
    assert not _must_reject_or_be_valid(tiny, config, bad)


def test_decoder_errors_are_one_family():
    """Every decoder error the server catches is a ValueError (InvalidMaskError wraps the
    codecs' MaskDecodeError), so ``collect_valid_replies`` leaves the reply out with its reason."""
    assert issubclass(InvalidMaskError, ValueError) and issubclass(MaskDecodeError, ValueError)


# -- SecAgg+ messages -------------------------------------------------------------------------
@FUZZ
@given(data=st.binary(max_size=200))
def test_packed_lists_decode_or_fail_clearly(data):
    from fedcompress.privacy.secagg import SecAggError, unpack_blobs, unpack_ints

    for fn in (unpack_ints, unpack_blobs):
        try:
            fn(data)
        except SecAggError as err:
            assert str(err)


@pytest.fixture(scope="module")
def secagg_round():
    """Three sites after the key shares: what a cheating relay or site could garble."""
    from fedcompress.privacy.secagg import SecAggConfig, SecAggServer, SecAggSite

    config = SecAggConfig((0, 1, 2), 2, 40)
    sites = {n: SecAggSite(n, config) for n in (0, 1, 2)}
    server = SecAggServer(config, {n: s.advertise() for n, s in sites.items()})
    inbox = server.relay({n: s.share(server.public) for n, s in sites.items()})
    return config, sites, server, inbox


@FUZZ
@given(blob=st.binary(max_size=400))
def test_garbled_share_ciphertexts_are_refused(secagg_round, blob):
    from fedcompress.privacy.secagg import SecAggError, SecAggSite

    _, sites, _, inbox = secagg_round
    site = SecAggSite.from_state(sites[0].to_state())  # a fresh copy per example
    with pytest.raises(SecAggError):
        site.masked(np.zeros(40, dtype=np.int64), {**inbox[0], 1: blob})


@FUZZ
@given(share=st.binary(max_size=120), words=st.binary(min_size=8, max_size=80))
def test_garbled_shares_and_masked_votes_are_refused(secagg_round, share, words):
    from fedcompress.privacy.secagg import SecAggError, SecAggSite

    config, sites, server, inbox = secagg_round
    copies = {n: SecAggSite.from_state(s.to_state()) for n, s in sites.items()}
    masked = {n: s.masked(np.ones(40, dtype=np.int64), inbox[n]) for n, s in copies.items()}
    shares = {n: s.unmask([0, 1, 2]) for n, s in copies.items()}
    bad_words = np.frombuffer(words[:len(words) // 8 * 8], dtype=np.uint64).copy()
    for garbled_masked, garbled_shares in (
            ({**masked, 1: bad_words}, shares),
            (masked, {0: {**shares[0], 1: share}, 2: {**shares[2], 1: share}})):
        try:
            counts = server.aggregate(garbled_masked, garbled_shares)
        except SecAggError as err:
            assert str(err)
            continue
        assert counts.shape == (40,)  # a well-formed but wrong input sums to something
