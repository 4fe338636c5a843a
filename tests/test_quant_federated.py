"""Federated quantization (``--aggregate stats --quant w4a16``): the sites send their summed
Hessians as for SparseGPT, the server quantizes each layer by GPTQ and broadcasts the
dequantized weights, the sites' next inputs come from the quantized layer. Through the Flower
strategy and ClientApp in process: equal to centralized GPTQ on the union bit for bit (masks,
integers, scales, weights), alone and jointly with SparseGPT; resumed from a checkpoint; over
SecAgg+ (fixed point: nearly all integers equal); with DP; and the settings that do not apply
are refused."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord
from test_stats_mode import Federation, centralized, config_for, run_rounds

from fedcompress.config import SettingsError
from fedcompress.methods.fedprllm.federated import federation_windows
from fedcompress.models import load_model
from fedcompress.pruning.local import apply_masks
from strategies.fedprllm import StatsFedPrLLM, make_strategy

#: the tiny llama's widths are 32 and 64: groups of 16 columns
QUANT = dict(quant="w4a16", quant_group_size=16)
RECIPES = {
    "gptq": dict(method="none", sparsity=0.0, **QUANT),
    "sparsegpt+gptq": dict(method="sparsegpt", **QUANT, quant_symmetric=False),
    "wanda+gptq-w8": dict(method="wanda", quant="w8a16", quant_group_size=0),
}


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, device="cpu")


def _same_quant(a, b, where) -> None:
    for field in ("q", "scale", "zero_point"):
        assert torch.equal(getattr(a, field), getattr(b, field)), (where, field)
    assert (a.g_idx is None) == (b.g_idx is None) and (a.group_size, a.symmetric) == \
        (b.group_size, b.symmetric), where


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_federated_quantization_equals_centralized_gptq_bit_for_bit(tiny_dir, tiny, recipe):
    config = config_for(tiny_dir, **RECIPES[recipe])
    strategy = make_strategy(config, tiny.model)
    assert isinstance(strategy, StatsFedPrLLM) and config.prune.needs_hessian
    run_rounds(strategy, Federation(4))
    assert not strategy.outcome.rejected
    windows = federation_windows(tiny.tokenizer, config)[0]
    central = centralized(tiny.model, windows, config)
    for layer in range(3):
        for name, mask in central.masks[layer].items():
            assert torch.equal(strategy.global_masks[layer][name], mask), (layer, name)
            assert torch.equal(strategy.global_weights[layer][name],
                               central.weights[layer][name]), (layer, name)
            _same_quant(strategy.quantized[layer][name], central.quant[layer][name],
                        (layer, name))
            if config.method == "none":
                assert not mask.any()
    pruned = load_model(tiny_dir, device="cpu").model
    strategy.prune(pruned)
    reference = apply_masks(load_model(tiny_dir, device="cpu").model, central.masks,
                            central.weights)
    for (key, a), (_, b) in zip(reference.state_dict().items(), pruned.state_dict().items()):
        assert torch.equal(a, b), key


def test_resume_keeps_the_integers(tiny_dir, tiny, tmp_path):
    """A checkpointed layer comes back with its integers, scales and zero points, checked
    against its weights; the resumed run equals the uninterrupted one."""
    from flwr.app import ConfigRecord

    config = config_for(tiny_dir, **RECIPES["sparsegpt+gptq"])
    full = make_strategy(config, tiny.model)
    run_rounds(full, Federation(4))
    first = make_strategy(config, tiny.model, checkpoint=tmp_path / "ckpt")
    grid = Federation(4)
    first.aggregate_train(1, grid.send_and_receive(first.configure_train(
        1, ArrayRecord(), ConfigRecord(), grid)))
    resumed = make_strategy(config, tiny.model, checkpoint=tmp_path / "ckpt")
    assert resumed.resume(tmp_path / "ckpt") == 1
    run_rounds(resumed, Federation(4))
    for layer in range(3):
        for name, result in full.quantized[layer].items():
            _same_quant(resumed.quantized[layer][name], result, (layer, name))
    # a checkpoint whose integers do not give its weights is refused
    import numpy as np

    path = tmp_path / "ckpt" / "layer-000.npz"
    arrays = dict(np.load(path))
    key = sorted(k for k in arrays if k.startswith("quant/") and k.endswith("/q"))[0]
    arrays[key] = np.where(arrays[key] == 0, 1, 0).astype(arrays[key].dtype)
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match="integers do not give its saved weights"):
        make_strategy(config, tiny.model, checkpoint=tmp_path / "ckpt").resume(
            tmp_path / "ckpt")


def test_quantization_over_secagg_matches_the_plain_run_up_to_fixed_point(tiny_dir, tiny):
    """The Hessians summed by SecAgg+ in fixed point (2^-26 per entry and site): the server
    quantizes from a sum that differs from the float one in the last bits, so an integer can
    move where a weight sat on a rounding boundary (and GPTQ carries that step's error into
    the row's later columns); nearly all are equal."""
    plain = make_strategy(config_for(tiny_dir, **RECIPES["gptq"]), tiny.model)
    run_rounds(plain, Federation(4))
    secure = make_strategy(config_for(tiny_dir, **RECIPES["gptq"], secagg=True), tiny.model)
    secure.start(Federation(4), ArrayRecord())
    assert not secure.outcome.rejected
    same = total = 0
    for layer in range(3):
        for name, result in plain.quantized[layer].items():
            other = secure.quantized[layer][name]
            assert torch.equal(other.scale, result.scale)  # from the dense weights alone
            same += int((other.q == result.q).sum())
            total += result.q.numel()
    assert same / total > 0.99, same / total


def test_quantization_with_dp_spends_the_stated_epsilon(tiny_dir, tiny):
    """GPTQ from DP Hessians (central placement): the release's epsilon is reported, the
    model is quantized on the grid of its dense scales."""
    from fedcompress.methods.fedprllm.stats import stats_prune

    config = config_for(tiny_dir, **RECIPES["gptq"], dp_epsilon=8.0, dp_placement="central",
                        dp_public_windows=2)
    windows = federation_windows(tiny.tokenizer, config)[0]
    run = stats_prune(tiny.model, windows, config, tokenizer=tiny.tokenizer)
    assert run.dp["epsilon"] == pytest.approx(8.0, rel=1e-6) or run.dp["epsilon"] <= 8.0
    assert len(run.quant) == 3 and all(layer is not None for layer in run.quant)
    exact = stats_prune(tiny.model, windows, config_for(tiny_dir, **RECIPES["gptq"]))
    for layer in range(3):
        for name, result in exact.quant[layer].items():
            assert torch.equal(run.quant[layer][name].scale, result.scale)


@pytest.mark.parametrize("kw, key", [
    (dict(quant="w4a16"), "quant"),  # votes
    (dict(aggregate="stats", method="none", sparsity=0.0), "method"),  # nothing to do
    (dict(aggregate="stats", method="none", quant="w4a16"), "sparsity"),
    (dict(aggregate="stats", method="none", sparsity=0.0, quant="w4a16", quant_method="rtn"),
     "quant_method"),
    (dict(aggregate="stats", quant="w3a16"), "quant"),
])
def test_settings_that_do_not_apply_are_refused(tiny_dir, kw, key):
    base = dict(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16, batch_size=2)
    with pytest.raises(SettingsError, match=f"{key}=.* is invalid"):
        from fedcompress.methods.fedprllm.federated import FedPrLLMConfig

        FedPrLLMConfig(**{**base, **kw})
