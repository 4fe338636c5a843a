"""Sequential onloading: the calibration walker reads one decoder layer at a time from the
safetensors files and gives the same masks (and SparseGPT weights) as the whole model."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, build_tiny_model, build_tiny_tokenizer, save_tiny_llama

from fedcompress.models import (
    ModelAdapter,
    OnloadError,
    load_model,
    onloader_of,
)
from fedcompress.pruning.local import PruneConfig, layer_prune_fn, local_masks
from fedcompress.pruning.walker import walk


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory, n_layers=4)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    build_tiny_model("qwen2", n_layers=3, seed=1).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


def _windows(n: int = 6, seqlen: int = 24, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY_VOCAB, (n, seqlen), generator=gen)


def _same(a: list[dict | None], b: list[dict | None]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return False
        if x is not None and y is not None and (
                x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x)):
            return False
    return True


@pytest.mark.parametrize("method", ["wanda", "sparsegpt", "magnitude"])
@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_onloaded_walk_gives_identical_masks(method, which, llama_dir, qwen_dir):
    path = llama_dir if which == "llama" else qwen_dir
    full = load_model(path, device="cpu").model
    skeleton = load_model(path, device="cpu", onload=True).model
    windows = _windows()
    config = PruneConfig(method, 0.5, "row")
    expected = local_masks(full, windows, config, batch_size=4, keep_weights=True)
    onloaded = local_masks(skeleton, windows, config, batch_size=4, keep_weights=True)
    assert _same(expected.masks, onloaded.masks)
    assert _same(expected.weights, onloaded.weights)
    if method == "sparsegpt":
        assert all(w is not None for w in onloaded.weights)
    # The setting on a whole model: a skeleton read from the folder it was loaded from.
    flagged = local_masks(full, windows, PruneConfig(method, 0.5, "row", onload=True),
                          batch_size=4, keep_weights=True)
    assert _same(expected.masks, flagged.masks)
    assert _same(expected.weights, flagged.weights)
    # Nothing stays materialized, the whole model is not mutated.
    assert onloader_of(skeleton).materialized_layers() == []
    assert _same(expected.masks, local_masks(full, windows, config, batch_size=4).masks)


def test_bfloat16_and_nm_and_layer_plan(llama_dir):
    """The cast to the model's dtype and the other recipe options go through unchanged."""
    windows = _windows(4, 16, seed=3)
    full = load_model(llama_dir, device="cpu", dtype="bfloat16").model
    skeleton = load_model(llama_dir, device="cpu", dtype="bfloat16", onload=True).model
    assert next(ModelAdapter(full).layers[0].parameters()).dtype == torch.bfloat16
    for config in (PruneConfig("wanda", nm="2:4"),
                   PruneConfig("wanda", 0.5, "layer", layer_sparsity="0.3,0.6,0.5,0.6")):
        assert _same(local_masks(full, windows, config).masks,
                     local_masks(skeleton, windows, config).masks)


def test_only_the_current_layer_is_ever_materialized(llama_dir):
    loaded = load_model(llama_dir, device="cpu", onload=True)
    skeleton = loaded.model
    onloader = onloader_of(skeleton)
    adapter = ModelAdapter(skeleton)
    assert loaded.info["onload"] is True
    assert onloader.materialized_layers() == []
    # Outside the decoder layers: real tensors (the embeddings, the tied head, norms).
    assert skeleton.get_input_embeddings().weight.device.type == "cpu"
    assert all(p.device.type == "meta" for p in adapter.layers.parameters())
    seen: list[tuple[int, list[int]]] = []
    inner = layer_prune_fn(PruneConfig("sparsegpt"))

    def spy(index, layer, stats):
        seen.append((index, onloader.materialized_layers()))
        assert layer is adapter.layers[index]
        return inner(index, layer, stats)

    walk(skeleton, _windows(), spy, hessian=True, batch_size=4)
    assert seen == [(i, [i]) for i in range(len(adapter))]
    assert onloader.materialized_layers() == []
    real = sum(t.numel() for t in skeleton.parameters() if t.device.type != "meta")
    full = load_model(llama_dir, device="cpu").model
    assert real < sum(p.numel() for p in full.parameters())


def test_iterative_site_steps_on_a_skeleton(llama_dir):
    """The layer-per-round site functions give the same masks on a skeleton."""
    from fedcompress.methods.fedprllm.federated import (
        advance_to_layer,
        resync_inputs,
        site_layer_masks,
    )

    windows = _windows(4, 16, seed=5)
    prune = PruneConfig("wanda")
    runs = []
    for model in (load_model(llama_dir, device="cpu").model,
                  load_model(llama_dir, device="cpu", onload=True).model):
        hidden = kwargs = previous = None
        masks = []
        for layer in range(len(ModelAdapter(model))):
            inputs = advance_to_layer(model, windows, layer, hidden, previous, kwargs, 4)
            previous = site_layer_masks(model, inputs, prune, 4)
            hidden, kwargs = inputs.hidden, inputs.layer_kwargs
            masks.append(previous)
        resynced, _ = resync_inputs(model, windows, 3, dict(enumerate(masks)), 4)
        runs.append((masks, resynced))
    assert _same(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])


def test_bad_inputs_are_refused_with_clear_errors(tmp_path, llama_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OnloadError, match=r"'nobody-xyz/not-cached'.*not in the local hub"):
        load_model("nobody-xyz/not-cached", onload=True)
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text(build_tiny_model("llama").config.to_json_string())
    with pytest.raises(OnloadError, match=r"no-weights holds none.*safetensors"):
        load_model(str(empty), onload=True)
    # A model built in memory has no folder to read its layers from.
    with pytest.raises(OnloadError, match="not a local folder"):
        local_masks(build_tiny_model("llama"), _windows(), PruneConfig("wanda", onload=True))
    with pytest.raises(ValueError, match="gradient method"):
        PruneConfig("gradient", onload=True)
    skeleton = load_model(llama_dir, device="cpu", onload=True).model
    with pytest.raises(ValueError, match="gradient method needs the whole model"):
        local_masks(skeleton, _windows(), PruneConfig("gradient"))
    # A folder whose tensors do not carry the model's names.
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    from safetensors.torch import load_file, save_file

    src = load_file(f"{llama_dir}/model.safetensors")
    save_file({k.replace("layers.", "blocks."): v for k, v in src.items()},
              str(renamed / "model.safetensors"))
    import shutil
    from pathlib import Path

    for file in Path(llama_dir).iterdir():
        if not file.name.endswith(".safetensors"):
            shutil.copy(file, renamed / file.name)
    broken = load_model(str(renamed), device="cpu", onload=True).model
    with pytest.raises(OnloadError, match=r"no tensor 'model\.layers\.0\..*state_dict"):
        local_masks(broken, _windows(), PruneConfig("wanda"))


def test_fedprllm_setting_reaches_the_pruning_config():
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig

    assert FedPrLLMConfig().prune.onload is False
    assert FedPrLLMConfig.from_dict({"onload": True}).prune.onload is True
    with pytest.raises(ValueError, match="onload"):
        FedPrLLMConfig.from_dict({"onload": True, "method": "gradient"})


def test_large_tensors_are_copied_by_blocks(llama_dir, monkeypatch):
    """Tensors above the block size (the embeddings of a real model) are read in row blocks,
    to the same values."""
    from fedcompress.models import LayerOnloader

    # bfloat16: cast copies (float32 tensors outside the layers are kept mapped instead).
    full = load_model(llama_dir, device="cpu", dtype="bfloat16").model
    monkeypatch.setattr(LayerOnloader, "CHUNK_BYTES", 1000)  # every matrix: several blocks
    skeleton = load_model(llama_dir, device="cpu", dtype="bfloat16", onload=True).model
    assert torch.equal(skeleton.get_input_embeddings().weight, full.get_input_embeddings().weight)
    adapter, reference = ModelAdapter(skeleton), ModelAdapter(full)
    with adapter.onloaded(2) as layer:
        for (name, p), (_, q) in zip(layer.named_parameters(),
                                     reference.layers[2].named_parameters()):
            assert torch.equal(p, q), name
    config = PruneConfig("wanda")
    assert _same(local_masks(full, _windows(), config).masks,
                 local_masks(skeleton, _windows(), config).masks)


@pytest.mark.parametrize("mode", ["oneshot", "iterative"])
def test_sites_prune_on_a_skeleton_with_the_same_vote(llama_dir, mode):
    """--onload at the sites (the ClientApp's cached model is a skeleton): the FedPrLLM vote of
    4 in-process sites equals the vote of sites holding the whole model."""
    from conftest import InProcessFederation
    from flwr.app import ArrayRecord, ConfigRecord

    from clients.common import cached_model
    from fedcompress.methods.fedprllm.federated import FedPrLLMConfig
    from strategies.fedprllm import make_strategy

    class Federation(InProcessFederation):
        app = "clients.app"

    counts = {}
    for onload in (False, True):
        config = FedPrLLMConfig(model=llama_dir, clients=4, samples_per_client=2, seqlen=16,
                                batch_size=2, mode=mode, onload=onload)
        strategy = make_strategy(config, load_model(llama_dir, device="cpu").model)
        grid = Federation(4)
        for rnd in range(1, strategy.num_rounds + 1):
            replies = grid.send_and_receive(strategy.configure_train(rnd, ArrayRecord(),
                                                                     ConfigRecord(), grid))
            strategy.aggregate_train(rnd, replies)
        assert not strategy.outcome.rejected
        aggregators = ([strategy.aggregator] if mode == "oneshot"
                       else [strategy.layer_aggregators[i] for i in sorted(
                           strategy.layer_aggregators)])
        counts[onload] = [{k: v.clone() for k, v in a.counts().items()} for a in aggregators]
    site_model, _ = cached_model(llama_dir, "float32", True)
    assert any(p.is_meta for p in site_model.parameters())  # the sites held a skeleton
    for plain, onloaded in zip(counts[False], counts[True], strict=True):
        assert plain.keys() == onloaded.keys()
        assert all(torch.equal(plain[k], onloaded[k]) for k in plain)


@pytest.mark.parametrize("scale", [False, True])
def test_server_prunes_a_skeleton_layer_by_layer_as_the_whole_model(llama_dir, scale):
    """MaskAggregator.prune of an onloaded skeleton (one decoder layer read, pruned, handed on
    and freed at a time) gives the same pruned weights and fractions as pruning a whole copy."""
    from fedcompress.masks.codec import mask_key
    from fedcompress.methods.fedprllm.config import ServerConfig
    from fedcompress.methods.fedprllm.federated import MaskAggregator, encode_masks

    full = load_model(llama_dir, device="cpu").model
    skeleton = load_model(llama_dir, device="cpu", onload=True).model
    config = PruneConfig("wanda", 0.5, "row")
    payloads = [encode_masks(local_masks(full, _windows(2, seed=s), config, batch_size=2).masks)
                for s in range(3)]
    server = ServerConfig("row", scale, "magnitude", 0)
    whole, onloaded = MaskAggregator(full, 3), MaskAggregator(skeleton, 3)
    for payload in payloads:
        whole.add_packed(payload)
        onloaded.add_packed(payload)
    expected = whole.prune(full, server, 0.5)  # the whole model, pruned in place
    seen: dict[int, dict[str, torch.Tensor]] = {}
    got = onloaded.prune(skeleton, server, 0.5, each_layer=lambda i, layer: seen.__setitem__(
        i, {k: v.clone() for k, v in layer.state_dict().items()}))
    assert got == expected
    adapter = ModelAdapter(full)
    assert sorted(seen) == list(range(len(adapter)))
    for index, state in seen.items():
        reference = adapter.layers[index].state_dict()
        assert state.keys() == reference.keys()
        assert all(torch.equal(state[k], reference[k]) for k in state), index
    assert all(p.is_meta for p in ModelAdapter(skeleton).layers.parameters())  # all freed
    assert mask_key(0, "self_attn.q_proj") in got
    with pytest.raises(ValueError, match="expected the aggregator's own model"):
        MaskAggregator(skeleton, 3).prune(load_model(llama_dir, device="cpu", onload=True).model,
                                          server, 0.5)
