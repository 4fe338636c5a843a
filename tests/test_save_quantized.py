"""The compressed-tensors writer: a tiny llama with hand-made integers and scales, written as a
``pack-quantized`` folder and loaded back by ``transformers`` in a process that never imports
fedcompress (as a user or vLLM would), both as transformers runs it (compressed, each linear
layer's weight rebuilt at every forward) and decompressed on load.

Exactness: the hand-made scales are small multiples of 2^-8, numbers of every save dtype, so the
saved scale is the scale; the loaded weight is then ``(q - zero_point) * scale`` rounded once to
the save dtype (compressed-tensors computes it in the scale's dtype, one rounding per product),
which is what the in-memory reference holds, and the logits agree bit for bit (same weights,
same kernels, same thread count). A solver's float32 scales saved in bfloat16 are rounded to
bfloat16 first: the loaded weights are those of the rounded scales (the module docstring)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer

from fedcompress.models import save_model
from fedcompress.quant.compressed_tensors import (
    PackedLinear,
    pack_int32,
    quantization_config,
    save_quantized,
)
from fedcompress.quant.config import QuantConfig

TOKENS = [[1, 5, 9, 17, 33, 65, 100, 2], [4, 8, 15, 16, 23, 42, 3, 7]]

#: Runs in a fresh interpreter: loads each folder with transformers only (no fedcompress), and
#: saves the linear weights (decompressed on load) and the logits of both loads.
LOADER = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    torch.set_num_threads(int(sys.argv[2]))
    jobs = json.loads(sys.argv[1])
    tokens = torch.tensor(jobs["tokens"])
    out = {}
    for folder in jobs["folders"]:
        dense = AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
        with torch.no_grad():
            out[folder] = {
                "dense_logits": dense(tokens).logits,
                "weights": {n: m.weight.detach().clone() for n, m in dense.named_modules()
                            if isinstance(m, torch.nn.Linear)},
                "dtype": str(dense.dtype)}
            try:
                compressed = AutoModelForCausalLM.from_pretrained(folder).eval()
            except RuntimeError as err:  # transformers 5.23 + compressed-tensors 0.20: asym
                out[folder]["compressed_error"] = str(err)
                continue
            layer = compressed.model.layers[0].mlp.up_proj
            out[folder]["packed_on_load"] = hasattr(layer, "weight_packed")
            out[folder]["compressed_logits"] = compressed(tokens).logits
            out[folder]["packed_after_forward"] = hasattr(layer, "weight_packed")
    assert not any(name.startswith("fedcompress") for name in sys.modules)
    torch.save(out, jobs["result"])
""")

CASES = [  # (symmetric, bits, group size, save dtype)
    (True, 4, 16, torch.bfloat16),
    (False, 4, 16, torch.bfloat16),
    (True, 8, 0, torch.bfloat16),
    (False, 8, 32, torch.float32),
]


def _case_id(case) -> str:
    symmetric, bits, group, dtype = case
    return (f"{'sym' if symmetric else 'asym'}-{bits}bit-"
            f"{f'group{group}' if group else 'channel'}-{str(dtype)[6:]}")


def hand_made(model, config: QuantConfig, seed: int = 0) -> dict[str, PackedLinear]:
    """Random integers in range, scales that are small multiples of 2^-8, for every linear
    layer of the decoder layers."""
    generator = torch.Generator().manual_seed(seed)
    low, high = -(1 << (config.bits - 1)), (1 << (config.bits - 1)) - 1
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            out, width = module.weight.shape
            groups = width // config.group_size if config.group_size else 1
            q = torch.randint(low, high + 1, (out, width), generator=generator, dtype=torch.int8)
            scale = torch.randint(1, 8, (out, groups), generator=generator).float() / 256
            zero = None if config.symmetric else torch.randint(
                low, high + 1, (out, groups), generator=generator, dtype=torch.int8)
            layers[name] = PackedLinear(q, scale, zero)
    return layers


def reference_model(model, layers: dict[str, PackedLinear], config: QuantConfig, dtype):
    """The in-memory model with the dequantized weights, built in the save dtype as
    ``from_pretrained`` builds it (``model.to(dtype)`` would also cast the rotary frequencies,
    which transformers keeps in float32)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), dtype=dtype)
    reference.load_state_dict(model.state_dict())
    modules = dict(reference.named_modules())
    with torch.no_grad():
        for name, layer in layers.items():
            modules[name].weight.copy_(layer.dequantize(config.group_size).to(dtype))
    return reference.eval()


def test_packing_is_compressed_tensors():
    """Our packer gives compressed-tensors' words, bit for bit (rows whose length is not a
    multiple of the values per word too; zero points packed along the output dimension)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    generator = torch.Generator().manual_seed(1)
    for bits in (4, 8):
        low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        for shape in ((5, 64), (7, 37), (33, 3)):
            values = torch.randint(low, high + 1, shape, generator=generator, dtype=torch.int8)
            for dim in (0, 1):
                assert torch.equal(pack_int32(values, bits, dim), pack_to_int32(values, bits, dim))


def test_quantization_config_is_what_compressed_tensors_parses():
    """The config parses as compressed-tensors' QuantizationConfig (what transformers and vLLM
    read) and keeps the values we wrote; its keys are llm-compressor 0.14's."""
    from compressed_tensors.quantization import QuantizationConfig

    for config in (QuantConfig(group_size=64), QuantConfig(scheme="w8a16", group_size=0,
                                                           symmetric=False, actorder="none")):
        written = quantization_config(config, ["lm_head"])
        parsed = QuantizationConfig.model_validate(written)
        weights = parsed.config_groups["group_0"].weights
        assert (weights.num_bits, weights.symmetric, weights.type) == (
            config.bits, config.symmetric, "int")
        assert weights.strategy == ("group" if config.group_size else "channel")
        assert weights.group_size == (config.group_size or None)
        assert parsed.format == "pack-quantized" and parsed.ignore == ["lm_head"]
        assert set(written) == {"config_groups", "format", "global_compression_ratio", "ignore",
                                "kv_cache_scheme", "quant_method", "quantization_status",
                                "sparsity_config", "transform_config", "version"}
        assert set(written["config_groups"]["group_0"]["weights"]) == {
            "actorder", "block_structure", "dynamic", "group_size", "num_bits", "observer",
            "observer_kwargs", "scale_dtype", "strategy", "symmetric", "type", "zp_dtype"}


def test_transformers_loads_the_packed_model(tmp_path):
    """Every case written, then loaded in one fedcompress-free subprocess: the decompressed
    weights are (q - zero_point) * scale exactly, the logits of the compressed and of the
    decompressed load are those of the in-memory model, bit for bit, and the folder is smaller
    than the dense model's in bfloat16."""
    model = build_tiny_model("llama", n_layers=2)
    tokenizer = build_tiny_tokenizer()
    dense = save_model(model, tmp_path / "dense-bf16", tokenizer, torch.bfloat16)
    folders, expected = [], {}
    for case in CASES:
        symmetric, bits, group, dtype = case
        config = QuantConfig(scheme=f"w{bits}a16", group_size=group, symmetric=symmetric)
        layers = hand_made(model, config)
        folder = str(tmp_path / _case_id(case))
        saved = save_quantized(model, folder, layers, config, tokenizer, dtype)
        assert saved.format == "pack-quantized" and saved.dtype == str(dtype)[6:]
        assert (saved.weights_bytes < dense.weights_bytes) == (dtype == torch.bfloat16)
        written = json.loads((tmp_path / _case_id(case) / "config.json").read_text())
        assert written["dtype"] == str(dtype)[6:]
        assert written["quantization_config"]["ignore"] == ["lm_head"]
        reference = reference_model(model, layers, config, dtype)
        with torch.no_grad():
            logits = reference(torch.tensor(TOKENS)).logits
        expected[folder] = (layers, config, dtype, logits)
        folders.append(folder)
    result = tmp_path / "loaded.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", LOADER,
                    json.dumps({"folders": folders, "tokens": TOKENS, "result": str(result)}),
                    str(torch.get_num_threads())], check=True, cwd=tmp_path, env=env,
                   timeout=300)
    loaded = torch.load(result)
    for folder in folders:
        layers, config, dtype, logits = expected[folder]
        got = loaded[folder]
        assert got["dtype"] == str(dtype)
        for name, layer in layers.items():
            assert torch.equal(got["weights"][name],
                               layer.dequantize(config.group_size).to(dtype)), (folder, name)
        assert torch.equal(got["weights"]["lm_head"], model.lm_head.weight.detach().to(dtype))
        assert torch.equal(got["dense_logits"], logits), folder
        if "compressed_error" in got:
            # transformers 5.23 with compressed-tensors 0.20 builds an asymmetric layer's zero
            # point unpacked ([out, groups]) when it runs the model compressed, and refuses the
            # packed one that llm-compressor 0.14 writes too (its own output fails the same
            # way; 5.17 with 0.19 loads it): the decompressing load above works.
            assert not config.symmetric, got["compressed_error"]
            assert "weight_zero_point" in got["compressed_error"] or "mismatch" in \
                got["compressed_error"], got["compressed_error"]
            continue
        # transformers keeps the packed integers when it loads and decompresses each layer at
        # its first forward (then keeps the dense weight: dense speed and memory).
        assert got["packed_on_load"] and not got["packed_after_forward"]
        assert torch.equal(got["compressed_logits"], logits), folder


def test_trivial_g_idx_is_written_and_a_permuted_one_refused(tmp_path):
    model = build_tiny_model("llama", n_layers=1)
    config = QuantConfig(group_size=16)
    layers = hand_made(model, config)
    name = "model.layers.0.mlp.down_proj"
    width = layers[name].q.shape[1]
    layers[name].g_idx = (torch.arange(width) // 16).to(torch.int32)
    save_quantized(model, tmp_path / "own", layers, config)
    layers[name].g_idx = layers[name].g_idx.flip(0)
    with pytest.raises(ValueError, match="g_idx that permutes"):
        save_quantized(model, tmp_path / "permuted", layers, config)
    with pytest.raises(ValueError, match="removed activation ordering by group"):
        save_quantized(model, tmp_path / "group", hand_made(model, config),
                       QuantConfig(group_size=16, actorder="group"))


@pytest.mark.parametrize("change, message", [
    (lambda layer: setattr(layer, "q", layer.q + 8), r"q in \[.*\]: expected 4-bit integers"),
    (lambda layer: setattr(layer, "q", layer.q.float()), "q of dtype torch.float32"),
    (lambda layer: setattr(layer, "scale", layer.scale[:, :1]), "scale of dtype"),
    (lambda layer: setattr(layer, "scale", layer.scale * 1e39), "not all finite"),
    (lambda layer: setattr(layer, "zero_point", torch.ones_like(layer.scale, dtype=torch.int8)),
     "nonzero zero points with symmetric"),
])
def test_bad_layers_are_refused_with_their_name(tmp_path, change, message):
    model = build_tiny_model("llama", n_layers=1)
    config = QuantConfig(group_size=16)
    layers = hand_made(model, config)
    change(layers["model.layers.0.self_attn.q_proj"])
    with pytest.raises(ValueError, match=message) as err:
        save_quantized(model, tmp_path / "bad", layers, config)
    assert "model.layers.0.self_attn.q_proj" in str(err.value)


def test_layer_names_and_group_size_are_checked(tmp_path):
    model = build_tiny_model("llama", n_layers=1)
    config = QuantConfig(group_size=16)
    layers = hand_made(model, config)
    with pytest.raises(ValueError, match="not linear layers"):
        save_quantized(model, tmp_path / "x", {"model.norm": layers[next(iter(layers))]},
                       config)
    with pytest.raises(ValueError, match="group size 128 does not divide the 32"):
        save_quantized(model, tmp_path / "x", layers, QuantConfig(group_size=128))
    asymmetric = QuantConfig(group_size=16, symmetric=False)
    with pytest.raises(ValueError, match="no zero points with asymmetric"):
        save_quantized(model, tmp_path / "x", layers, asymmetric)
