"""Saving in the smallest faithful form (fedcompress.models.saving): which dtype, what the
report says about sizes, and what a 16-bit save keeps exactly (a mask's zeros; the weights of a
16-bit input) or rounds (SparseGPT's updated weights)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import InProcessFederation, build_tiny_model, build_tiny_tokenizer

from fedcompress.eval.perplexity import perplexity
from fedcompress.models import (
    LoadedModel,
    load_model,
    model_size,
    parameter_bytes,
    save_dtype,
    save_model,
    source_dtype,
)
from fedcompress.models.adapter import ModelAdapter, weight_matrix
from fedcompress.pruning.local import PruneConfig, apply_masks, local_masks
from fedcompress.report import RunReport


class Federation(InProcessFederation):
    app = "clients.app"


def _loaded(source: str, spec: str, path: str = "", model=None) -> LoadedModel:
    return LoadedModel(model, None, spec, source, path)


def test_save_dtype_is_the_input_models_unless_told(tmp_path):
    model = build_tiny_model("llama", n_layers=1)
    half = tmp_path / "half"
    save_model(model, half, dtype="float16")
    assert json.loads((half / "config.json").read_text())["dtype"] == "float16"
    local = _loaded("local", str(half), str(half))
    embedded = _loaded("embedded", "smollm2-135m", "/cache/smollm2")
    gguf = _loaded("gguf", "x.gguf", "/cache/x")
    assert source_dtype(local) == torch.float16
    assert source_dtype(embedded) == source_dtype(gguf) == torch.bfloat16
    assert source_dtype(_loaded("hub", "org/not-cached", "org/not-cached")) == torch.float32
    assert save_dtype("auto", "float32", embedded) == torch.bfloat16  # the run computed in fp32
    assert save_dtype("auto", "float32", local) == torch.float16
    assert save_dtype("auto", "bfloat16", local) == torch.bfloat16  # the run's 16-bit weights
    assert save_dtype("float32", "float32", embedded) == torch.float32  # the user's choice
    with pytest.raises(ValueError, match="save_dtype 'int8'"):
        save_dtype("int8", "float32", local)


def test_sizes_and_the_report_table(tmp_path):
    model = build_tiny_model("llama", n_layers=2)
    saved = save_model(model, tmp_path / "m", build_tiny_tokenizer(), torch.bfloat16)
    assert saved.dtype == "bfloat16" and saved.format == "dense"
    assert set(saved.files) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert saved.bytes == sum(p.stat().st_size for p in (tmp_path / "m").iterdir())
    bf16 = parameter_bytes(model, torch.bfloat16)
    assert parameter_bytes(model) == 2 * bf16  # float32 in memory, tied tensors once
    assert bf16 < saved.weights_bytes < bf16 + 4096  # the safetensors header
    size = model_size(saved, model, torch.float32)
    assert size["dense_bytes"] == 2 * bf16 and size["ratio"] == pytest.approx(0.5, abs=0.02)
    report = RunReport(tmp_path / "run", "prune", {})
    report.add_model_size(size)
    assert json.loads((tmp_path / "run" / "report.json").read_text())["model_size"] == size
    text = (tmp_path / "run" / "report.md").read_text()
    assert "## Saved model" in text and "| bfloat16 | float32 | dense |" in text


def test_wanda_pruned_model_saved_from_a_bf16_input_is_bit_identical(tmp_path):
    """The prune command on a bfloat16 input, computing in float32 (the default): the model is
    saved in bfloat16, every weight either exactly zero (the mask, kept exactly) or exactly the
    input's; the file is the dense model's size (an unstructured mask stores its zeros)."""
    from server.fedprllm import run

    source = build_tiny_model("llama", n_layers=2)
    save_model(source, tmp_path / "input", build_tiny_tokenizer(), torch.bfloat16)
    out = tmp_path / "run"
    run(Federation(2), dict(model=str(tmp_path / "input"), clients=2, samples_per_client=2,
                            seqlen=16, batch_size=2, eval_seqlen=16, eval_windows=2,
                            out=str(out), device="cpu", baselines="", method="wanda"))
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok", report.get("error")
    size = report["model_size"]
    assert (size["dtype"], size["dense_dtype"], size["format"]) == ("bfloat16", "bfloat16",
                                                                     "dense")
    assert 1.0 < size["ratio"] < 1.05  # zeros and all: the dense model's size
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out / "model")
    assert saved.dtype == torch.bfloat16
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "input")
    zeros = total = 0
    for (name, got), (_, want) in zip(saved.state_dict().items(),
                                      reference.state_dict().items(), strict=True):
        kept = got != 0
        assert torch.equal(got[kept], want[kept]), name
        zeros += int((~kept).sum()) if ".layers." in name and got.dim() == 2 else 0
        total += got.numel() if ".layers." in name and got.dim() == 2 else 0
    assert zeros / total == pytest.approx(report["results"][0]["sparsity"], abs=1e-9)


def test_sparsegpt_updates_are_rounded_by_a_bf16_save(tmp_path):
    """SparseGPT updates the kept weights in float32; a bfloat16 save rounds them (relative
    error <= 2^-9 each) and keeps the zeros. Measured on the tiny random llama (8 windows of 16
    tokens): dense 129.2733, SparseGPT 50% in float32 129.4836, its bfloat16 save read back in
    float32 129.4870 (+2.6e-5 relative), far less than pruning itself moves it."""
    model = build_tiny_model("llama", n_layers=2)
    generator = torch.Generator().manual_seed(0)
    windows = torch.randint(4, 128, (8, 16), generator=generator)
    text = torch.randint(4, 128, (8 * 16,), generator=generator)
    dense_ppl = perplexity(model, None, text, 16, progress=False).perplexity
    result = local_masks(model, windows, PruneConfig(method="sparsegpt", sparsity=0.5),
                         batch_size=4, keep_weights=True)
    apply_masks(model, result.masks, result.weights)
    saved = save_model(model, tmp_path / "m", build_tiny_tokenizer(), torch.bfloat16)
    assert saved.dtype == "bfloat16"
    reread = load_model(str(tmp_path / "m"), device="cpu", dtype="float32").model
    for layer, again in zip(ModelAdapter(model).layers, ModelAdapter(reread).layers):
        for name, module in ModelAdapter.linear_layers(layer).items():
            w = weight_matrix(module)
            back = weight_matrix(ModelAdapter.linear_layers(again)[name])
            assert torch.equal(back == 0, w == 0), name  # the mask, exactly
            assert torch.equal(back, w.to(torch.bfloat16).float()), name  # one rounding
    fp32_ppl = perplexity(model, None, text, 16, progress=False).perplexity
    bf16_ppl = perplexity(reread, None, text, 16, progress=False).perplexity
    assert abs(bf16_ppl / fp32_ppl - 1) < 1e-3
    assert abs(bf16_ppl - fp32_ppl) < abs(fp32_ppl - dense_ppl)


def test_a_run_saves_a_quantized_model_and_reports_its_size(tmp_path):
    """server.common.save_run_model with the solver's layers: a pack-quantized folder in the
    input model's dtype, its size in the report next to the dense model's."""
    from test_save_quantized import hand_made

    from fedcompress.quant.config import QuantConfig
    from server.common import save_run_model

    model = build_tiny_model("llama", n_layers=2)
    save_model(model, tmp_path / "input", build_tiny_tokenizer(), torch.bfloat16)
    loaded = load_model(str(tmp_path / "input"), device="cpu")  # computes in float32
    config = QuantConfig(group_size=16)
    report = RunReport(tmp_path / "run", "quantize", {})
    save_run_model(report, loaded.model, tmp_path / "run" / "model", loaded.tokenizer, loaded,
                   loaded.model, "auto", "float32",
                   quantized=(hand_made(loaded.model, config), config))
    size = json.loads((tmp_path / "run" / "report.json").read_text())["model_size"]
    assert (size["format"], size["dtype"], size["dense_dtype"]) == ("pack-quantized",
                                                                     "bfloat16", "bfloat16")
    assert 0.5 < size["ratio"] < 0.8  # the tiny model's embeddings stay 16-bit
    written = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert written["quantization_config"]["format"] == "pack-quantized"
