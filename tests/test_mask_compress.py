"""The compressed (context-coded) mask wire format: lossless round trips, validation, size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcompress.masks import compress as mc
from fedcompress.masks import reference as mref
from fedcompress.masks.codec import MaskDecodeError
from fedcompress.masks.compress import (
    CompressedMaskError,
    ReferenceMismatchError,
    decode_mask_ctx,
    decode_masks_ctx,
    encode_mask_ctx,
    encode_masks_ctx,
)
from fedcompress.solver.select import select_prune_mask

HEADER = mc._HEADER.size


def _problem(rows=48, cols=80, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen)
    norm = torch.rand(cols, generator=gen) + 0.1
    return weight, norm, gen


def _roundtrip(mask, weight, norm, **options):
    payload = encode_mask_ctx(mask, weight, norm, **options)
    assert payload.dtype == np.uint8 and payload.ndim == 1
    decoded = decode_mask_ctx(payload, weight, norm)
    assert decoded.dtype == torch.bool
    assert torch.equal(decoded, mask)
    return payload


def _flag(payload):
    return int(payload[5])


# ------------------------------------------------------------------------------------------
# Round trips
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("factors", [False, True, "auto"])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.3, 0.5, 0.9, 1.0])
def test_random_masks_roundtrip_and_never_exceed_raw(density, factors):
    weight, norm, gen = _problem()
    mask = torch.rand(weight.shape, generator=gen) < density
    payload = _roundtrip(mask, weight, norm, factors=factors)
    assert payload.size <= HEADER + (mask.numel() + 7) // 8  # bit-packed fallback bounds it


@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (9, 1), (3, 2), (0, 5), (4, 0), (7, 300)])
def test_odd_shapes_roundtrip(shape):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(shape, generator=gen)
    norm = torch.rand(shape[1], generator=gen)
    for density in (0.0, 0.5, 1.0):
        _roundtrip(torch.rand(shape, generator=gen) < density, weight, norm)


@pytest.mark.parametrize("group", ["row", "layer", "column"])
@pytest.mark.parametrize("sparsity", [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99])
def test_structured_masks_of_every_sparsity(sparsity, group):
    weight, norm, gen = _problem(64, 96)
    client_norm = norm * (1 + 0.3 * torch.rand(96, generator=gen))
    mask = select_prune_mask(weight.abs() * client_norm, sparsity, group)
    payload = _roundtrip(mask, weight, norm)
    if group == "row" and sparsity > 0:
        assert payload.size < (mask.numel() + 7) // 8


def test_all_pruned_and_all_kept_cost_a_header():
    weight, norm, _ = _problem(64, 128)
    for value in (True, False):
        mask = torch.full(weight.shape, value)
        payload = _roundtrip(mask, weight, norm)
        assert payload.size <= HEADER + 16


def test_n_m_masks_and_magnitude_reference():
    weight, norm, _ = _problem(32, 64)
    mask = select_prune_mask(weight.abs() * norm, 0.0, nm=(2, 4))
    _roundtrip(mask, weight, norm)
    _roundtrip(mask, weight, None)
    magnitude = select_prune_mask(weight.abs(), 0.5, "row")
    assert _roundtrip(magnitude, weight, None).size <= HEADER + 16


def test_ties_are_deterministic():
    """Quantized weights: many equal reference scores; ties go by the lower column index."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randint(-3, 4, (40, 64), generator=gen).float()
    norm = torch.ones(64)
    mask = select_prune_mask(weight.abs() * norm, 0.5, "row")  # same stable tie rule
    payload = _roundtrip(mask, weight, norm)
    assert payload.size <= HEADER + 16
    noisy = torch.rand(weight.shape, generator=gen) < 0.5
    first = encode_mask_ctx(noisy, weight, norm)
    assert np.array_equal(first, encode_mask_ctx(noisy, weight, norm))
    assert torch.equal(decode_mask_ctx(first, weight, norm), noisy)


def test_low_precision_weights():
    weight, norm, gen = _problem(32, 48)
    for dtype in (torch.float16, torch.bfloat16):
        w = weight.to(dtype)
        mask = select_prune_mask(w.float().abs() * norm * (1 + 0.2 * torch.rand(48, generator=gen)),
                                 0.5, "row")
        _roundtrip(mask, w, norm)


# ------------------------------------------------------------------------------------------
# Size
# ------------------------------------------------------------------------------------------

def test_mask_equal_to_reference_mask_is_tiny():
    weight, norm, _ = _problem(256, 512)
    mask = select_prune_mask(mref.reference_scores(weight, norm), 0.5, "row")
    payload = _roundtrip(mask, weight, norm)
    assert payload.size <= HEADER + 16
    assert mc.bits_per_weight(payload, mask.shape) < 0.005


def test_column_factors_recover_client_norms():
    """A Wanda mask from other column norms: the factors make it nearly free."""
    weight, norm, gen = _problem(256, 256)
    client = norm * torch.exp(0.5 * torch.randn(256, generator=gen))
    mask = select_prune_mask(weight.abs() * client, 0.5, "row")
    plain = _roundtrip(mask, weight, norm, factors=False)
    fitted = _roundtrip(mask, weight, norm, factors=True)
    assert _flag(fitted) & mc._FLAG_FACTORS
    assert fitted.size < plain.size / 2
    assert mc.bits_per_weight(fitted, mask.shape) < 0.06
    auto = encode_mask_ctx(mask, weight, norm)
    assert auto.size == min(plain.size, fitted.size)


def test_layer_wise_masks_send_row_counts():
    weight, norm, _ = _problem(64, 64)
    mask = select_prune_mask(weight.abs() * norm, 0.5, "layer")
    payload = _roundtrip(mask, weight, norm, factors=False)
    assert _flag(payload) & mc._FLAG_ROW_COUNTS
    assert payload.size <= HEADER + 48


@pytest.mark.parametrize("values", [
    [0], [0] * 50, [1, 2, 3], list(range(100)), [5, 0, 0, 1 << 20, 7], [(1 << 40) + 3, 0]])
def test_integer_side_codes_roundtrip(values):
    data = mc._encode_ints(np.array(values, dtype=np.int64))
    reader = mc._Reader(data, "x")
    assert mc._decode_ints(reader, len(values)).tolist() == values
    assert reader.pos == len(data)
    signed = np.array([0, -1, 1, -1000, 1000], dtype=np.int64)
    assert mc._unzigzag(mc._zigzag(signed)).tolist() == signed.tolist()


def test_log_buckets_are_monotone_and_exact_for_small_values():
    a = np.arange(5000)
    for octave_log2 in range(0, 5):
        b = mc._log_bucket(a, octave_log2)
        assert (np.diff(b) >= 0).all() and (np.diff(b) <= 1).all()
        assert b[: 1 << octave_log2].tolist() == list(range(1 << octave_log2))


# ------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------

def _real_payload():
    weight, norm, gen = _problem(64, 96, seed=5)
    mask = select_prune_mask(weight.abs() * norm * (1 + 0.5 * torch.rand(96, generator=gen)),
                             0.5, "row")
    return mask, weight, norm, encode_mask_ctx(mask, weight, norm)


def test_errors_are_value_errors_of_the_codec_family():
    assert issubclass(CompressedMaskError, MaskDecodeError)
    assert issubclass(ReferenceMismatchError, CompressedMaskError)
    assert issubclass(CompressedMaskError, ValueError)


def test_wrong_payload_dtype_or_rank():
    mask, weight, norm, payload = _real_payload()
    with pytest.raises(CompressedMaskError, match="uint8"):
        decode_mask_ctx(payload.astype(np.int8), weight, norm)
    with pytest.raises(CompressedMaskError, match="uint8"):
        decode_mask_ctx(payload.tolist(), weight, norm)
    with pytest.raises(CompressedMaskError, match="flat"):
        decode_mask_ctx(payload.reshape(1, -1), weight, norm)


def test_truncated_or_extended_payload():
    mask, weight, norm, payload = _real_payload()
    for cut in (0, 3, HEADER - 1, HEADER, payload.size - 1):
        with pytest.raises(CompressedMaskError, match="truncated"):
            decode_mask_ctx(payload[:cut], weight, norm)
    with pytest.raises(CompressedMaskError, match="truncated or corrupted"):
        decode_mask_ctx(np.concatenate([payload, np.zeros(4, np.uint8)]), weight, norm)


def test_header_fields_are_checked():
    mask, weight, norm, payload = _real_payload()
    bad = payload.copy()
    bad[0] ^= 0xFF
    with pytest.raises(CompressedMaskError, match="magic"):
        decode_mask_ctx(bad, weight, norm)
    bad = payload.copy()
    bad[4] = 99
    with pytest.raises(CompressedMaskError, match="version"):
        decode_mask_ctx(bad, weight, norm)
    with pytest.raises(CompressedMaskError, match="shape"):
        decode_mask_ctx(payload, weight[:-1], norm)
    with pytest.raises(CompressedMaskError, match="shape"):
        decode_mask_ctx(payload, weight.T.contiguous(), torch.ones(weight.shape[0]))


def _payload_of_kind(kind):
    weight, norm, gen = _problem(64, 96, seed=6)
    if kind == "factors":
        mask = select_prune_mask(weight.abs() * norm * torch.exp(torch.randn(96, generator=gen)),
                                 0.5, "row")
        payload = encode_mask_ctx(mask, weight, norm, factors=True)
        assert _flag(payload) == mc._FLAG_FACTORS
    elif kind == "row_counts":
        mask = select_prune_mask(weight.abs() * norm * (1 + 0.3 * torch.rand(96, generator=gen)),
                                 0.5, "layer")
        payload = encode_mask_ctx(mask, weight, norm, factors=False)
        assert _flag(payload) == mc._FLAG_ROW_COUNTS
    else:
        mask = torch.rand(weight.shape, generator=gen) < 0.5
        payload = encode_mask_ctx(mask, weight, norm)
        assert _flag(payload) == mc._FLAG_RAW
    return mask, weight, norm, payload


@pytest.mark.parametrize("kind", ["factors", "row_counts", "raw"])
def test_every_single_byte_corruption_is_detected(kind):
    mask, weight, norm, payload = _payload_of_kind(kind)
    assert torch.equal(decode_mask_ctx(payload, weight, norm), mask)
    rng = np.random.default_rng(0)
    for pos in range(payload.size):
        bad = payload.copy()
        bad[pos] ^= np.uint8(1 << int(rng.integers(8))) if pos % 2 else np.uint8(0xFF)
        try:
            decoded = decode_mask_ctx(bad, weight, norm)
        except CompressedMaskError:
            continue
        # a flip in padding bits or an unused field may leave the mask intact: never wrong
        assert torch.equal(decoded, mask), f"byte {pos}: silently mis-decoded"


def test_reference_mismatch_is_detected():
    mask, weight, norm, payload = _real_payload()
    other = norm.clone()
    other[3] = torch.nextafter(other[3], torch.tensor(10.0))  # one ulp
    with pytest.raises(ReferenceMismatchError, match="reference"):
        decode_mask_ctx(payload, weight, other)
    with pytest.raises(ReferenceMismatchError):
        decode_mask_ctx(payload, weight, None)
    with pytest.raises(ReferenceMismatchError):
        decode_mask_ctx(payload, weight, norm[:-1])
    changed = weight.clone()
    changed[0, 0] += 1
    with pytest.raises(ReferenceMismatchError, match="model"):
        decode_mask_ctx(payload, changed, norm)


def test_encoder_validates_its_inputs():
    weight, norm, _ = _problem(8, 8)
    with pytest.raises(TypeError, match="bool"):
        encode_mask_ctx(torch.zeros(8, 8), weight, norm)
    with pytest.raises(ValueError, match="shape"):
        encode_mask_ctx(torch.zeros(8, 7, dtype=torch.bool), weight, norm)
    with pytest.raises(ValueError, match="non-negative"):
        encode_mask_ctx(torch.zeros(8, 8, dtype=torch.bool), weight, -norm)
    with pytest.raises(ValueError, match="factors"):
        encode_mask_ctx(torch.zeros(8, 8, dtype=torch.bool), weight, norm, factors="yes")
    with pytest.raises(ValueError, match="power of two"):
        encode_mask_ctx(torch.zeros(8, 8, dtype=torch.bool), weight, norm, octave_bins=3)


# ------------------------------------------------------------------------------------------
# Whole (tiny) models: public reference, grouped payloads, real Wanda masks
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_setup():
    from conftest import build_tiny_model

    from fedcompress.masks.stats import flatten_masks
    from fedcompress.pruning.local import PruneConfig, column_norms, local_masks

    model = build_tiny_model("llama", n_layers=2)
    gen = torch.Generator().manual_seed(0)
    public = torch.randint(0, 128, (4, 16), generator=gen)
    private = torch.randint(0, 128, (2, 16), generator=gen)
    reference = flatten_masks(column_norms(model, public))
    masks = local_masks(model, private, PruneConfig("wanda", 0.5, "row")).masks
    flat = {f"layers.{i}.{name}": m for i, layer in enumerate(masks) for name, m in layer.items()}
    return model, reference, flat


def test_public_reference_and_wire_form(tiny_setup):
    from fedcompress.masks.stats import flatten_masks
    from fedcompress.methods.fedprllm.federated import expected_shapes
    from fedcompress.pruning.local import PruneConfig, column_norms

    model, reference, _ = tiny_setup
    shapes = expected_shapes(model)
    assert set(reference) == set(shapes)
    for key, norm in reference.items():
        assert norm.dtype == torch.float32 and norm.shape == (shapes[key][1],)
        assert bool((norm >= 0).all())
    wire = mref.reference_to_wire(reference)
    assert all(a.dtype == np.float16 for a in wire.values())
    assert mref.reference_nbytes(wire) == 2 * sum(s[1] for s in shapes.values())
    back = mref.reference_from_wire(wire)
    assert all(torch.equal(back[k], torch.from_numpy(wire[k].astype(np.float32))) for k in wire)
    pruned = flatten_masks(column_norms(model, torch.randint(0, 128, (2, 16)),
                                        PruneConfig("wanda", 0.5)))
    assert set(pruned) == set(shapes)


def test_groups_follow_shared_inputs(tiny_setup):
    model, reference, flat = tiny_setup
    groups = mc.input_groups(flat, reference)
    names = [[k.split(".", 2)[2] for k in g] for g in groups if g[0].startswith("layers.0.")]
    assert ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"] in names
    assert ["mlp.gate_proj", "mlp.up_proj"] in names
    assert mc.input_groups(flat, None) == [[k] for k in flat]


@pytest.mark.parametrize("use_reference", [True, False])
@pytest.mark.parametrize("group", [True, False])
def test_real_masks_of_a_tiny_model_roundtrip(tiny_setup, use_reference, group):
    model, reference, flat = tiny_setup
    ref = mref.reference_from_wire(mref.reference_to_wire(reference)) if use_reference else None
    weights = mref.linear_weights(model)
    payload = encode_masks_ctx(flat, weights, ref, group=group)
    assert any("+" in k for k in payload) == (group and use_reference)
    decoded = decode_masks_ctx(payload, weights, ref)
    assert list(decoded) == list(weights)
    assert all(torch.equal(decoded[k], flat[k]) for k in flat)
    total = sum(p.size for p in payload.values())
    assert total < sum((m.numel() + 7) // 8 for m in flat.values())


def test_model_level_validation(tiny_setup):
    model, reference, flat = tiny_setup
    weights = mref.linear_weights(model)
    payload = encode_masks_ctx(flat, weights, reference)
    first = next(iter(payload))
    with pytest.raises(CompressedMaskError, match="missing"):
        decode_masks_ctx({k: v for k, v in payload.items() if k != first}, weights, reference)
    with pytest.raises(CompressedMaskError, match="unexpected"):
        decode_masks_ctx({**payload, "layers.9.mlp.up_proj": payload[first]}, weights, reference)
    key = first.split("+")[0]
    with pytest.raises(CompressedMaskError, match="two payloads"):
        decode_masks_ctx({**payload, key: payload[first]}, weights, reference)
    with pytest.raises(ReferenceMismatchError):
        decode_masks_ctx(payload, weights, None)
    with pytest.raises(KeyError, match="reference"):
        encode_masks_ctx(flat, weights, {k: v for k, v in reference.items() if k != key})
