"""Federated quantization (``--aggregate stats --quant w4a16``): the sites send their summed
Hessians as for SparseGPT, the server quantizes each layer by GPTQ and broadcasts the
dequantized weights, the sites' next inputs come from the quantized layer. Through the Flower
strategy and ClientApp in process: equal to centralized GPTQ on the union bit for bit (masks,
integers, scales, weights), alone and jointly with SparseGPT; resumed from a checkpoint; over
SecAgg+ (fixed point: nearly all integers equal); with DP; and the settings that do not apply
are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

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


def test_quantization_with_dp_adds_the_accountants_noise_and_spends_its_epsilon(tiny_dir, tiny):
    """GPTQ from DP Hessians (central placement). The epsilon spent is opacus's RDP account of
    the run's sigma over its releases, within the target 8; the noise is there at the planned
    scale: layer 0's inputs are the same in two runs with different noise seeds (the
    embeddings), so their two releases differ by two noise draws alone, N(0, 2 std^2) on every
    coordinate of each block's Hessian (upper triangle); the model is quantized on the grid of
    its dense scales."""
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    from fedcompress.methods.fedprllm import dp as dpm
    from fedcompress.methods.fedprllm.stats import stats_prune
    from fedcompress.privacy.accounting import RDP_ALPHAS

    config = config_for(tiny_dir, **RECIPES["gptq"], dp_epsilon=8.0, dp_placement="central",
                        dp_public_windows=2)
    windows = federation_windows(tiny.tokenizer, config)[0]
    runs = [stats_prune(tiny.model, windows, config, tokenizer=tiny.tokenizer, dp_seed=seed,
                        keep_release=True) for seed in (1, 2)]
    dp = runs[0].dp
    assert dp["dp"] and dp["placement"] == "central" and dp["mechanism"] == "gaussian"
    assert dp["releases"] == 3 and dp["sigma"] > 0
    rdp = compute_rdp(q=1.0, noise_multiplier=dp["sigma"], steps=dp["releases"],
                      orders=RDP_ALPHAS)
    opacus_eps = get_privacy_spent(orders=RDP_ALPHAS, rdp=rdp, delta=dp["delta"])[0]
    assert dp["epsilon_spent"] == pytest.approx(opacus_eps, rel=1e-6)
    assert 8.0 - 0.05 <= dp["epsilon_spent"] <= 8.0

    request = dpm.DpRequest.from_config(config, 3, len(windows))
    calib = dpm.public_calibration(tiny.model, tiny.tokenizer, request, True, config.batch_size,
                                   (config.dp_public_file,))
    plan = dpm.plan(request, calib, dpm.block_dims(tiny.model, calib.bounds, True))
    assert plan.sigma == dp["sigma"]
    z = []
    for name, std in plan.noise_std(0).items():
        a, b = (run.released[0][name].hessian_sum for run in runs)
        rows, cols = torch.triu_indices(a.shape[0], a.shape[1])
        z.append((a - b)[rows, cols].double() / (std * 2 ** 0.5))
    z = torch.cat(z)
    assert z.numel() > 1000
    assert abs(float(z.mean())) < 0.1 and abs(float(z.std()) - 1.0) < 0.1, (z.mean(), z.std())

    assert len(runs[0].quant) == 3 and all(layer is not None for layer in runs[0].quant)
    exact = stats_prune(tiny.model, windows, config_for(tiny_dir, **RECIPES["gptq"]))
    for layer in range(3):
        for name, result in exact.quant[layer].items():
            assert torch.equal(runs[0].quant[layer][name].scale, result.scale)


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


#: Runs in a fresh interpreter without fedcompress: transformers loads the saved folder
#: (compressed-tensors decompresses it) in float32 and computes the perplexity of the given
#: windows as fedcompress.eval.perplexity defines it (per window, every next token).
PERPLEXITY = textwrap.dedent("""
    import json, math, sys
    import torch
    from transformers import AutoModelForCausalLM

    job = json.loads(sys.argv[1])
    torch.set_num_threads(job["threads"])  # the run's: float sums in the same order
    model = AutoModelForCausalLM.from_pretrained(job["folder"], dtype=torch.float32).eval()
    assert hasattr(model.model.layers[0].mlp.up_proj, "weight_packed")  # loaded packed
    nll, n = 0.0, 0
    with torch.no_grad():
        for window in job["windows"]:
            ids = torch.tensor([window])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            nll += float(-logp.gather(1, ids[0, 1:, None]).sum())
            n += len(window) - 1
    assert not any(name.startswith("fedcompress") for name in sys.modules)
    print(json.dumps({"perplexity": math.exp(nll / n)}))
""")


def test_server_app_saves_what_transformers_loads_with_the_reported_perplexity(tmp_path):
    """The ServerApp (in process) quantizes with GPTQ, evaluates the federated model next to
    centralized GPTQ (equal) and round-to-nearest, and saves a compressed-tensors folder,
    smaller than the dense model, that transformers alone loads back with the perplexity the
    run reported. The tiny model's weights are bfloat16 numbers, as the embedded models'
    are, so the bfloat16 save of its other tensors is exact too."""
    from conftest import build_tiny_model, build_tiny_tokenizer

    from fedcompress.data import corpus_text, load_corpus
    from server.fedprllm import run

    model_dir = tmp_path / "tiny-bf16"
    model = build_tiny_model("llama", n_layers=3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(model_dir)
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "run"
    settings = dict(model=str(model_dir), clients=4, samples_per_client=2, seqlen=16,
                    batch_size=2, eval_seqlen=16, eval_windows=3, out=str(out), device="cpu",
                    aggregate="stats", method="none", sparsity=0.0, quant="w4a16",
                    quant_group_size=16, baselines="centralized,rtn")
    run(Federation(4), settings)
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok", report.get("error")
    fed, central, rtn = report["results"]
    assert (fed["name"], central["name"], rtn["name"]) == (
        "fedprllm-stats-row+w4a16-gptq", "centralized", "rtn-w4a16")
    assert fed["perplexity"] == central["perplexity"] != rtn["perplexity"]
    size = report["model_size"]
    assert size["format"] == "pack-quantized" and size["dtype"] == "bfloat16"
    assert size["weights_bytes"] < size["dense_bytes"], size
    written = json.loads((out / "model" / "config.json").read_text())["quantization_config"]
    assert written["format"] == "pack-quantized"
    weights = written["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 16, True)

    ids = tokenizer(corpus_text(load_corpus("wiki", "test")), add_special_tokens=False,
                    return_tensors="pt").input_ids[0]
    windows = ids[:3 * 16].reshape(3, 16).tolist()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", PERPLEXITY,
                           json.dumps({"folder": str(out / "model"), "windows": windows,
                                       "threads": torch.get_num_threads()})],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])["perplexity"]
    assert loaded == pytest.approx(fed["perplexity"], rel=1e-6), (loaded, fed["perplexity"])
