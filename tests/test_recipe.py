"""Recipes in llm-compressor's format: read strictly, run stage by stage over a federation."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import InProcessFederation

from fedcompress.config import SettingsError
from fedcompress.recipe import (
    FedPrLLMVoteModifier,
    GPTQModifier,
    QuantizationModifier,
    RecipeError,
    SparseGPTModifier,
    WandaPruningModifier,
    load_recipe,
    passes,
    recipe_from_dict,
    recipe_of,
    run_recipe,
    stage_settings,
)
from fedcompress.recipe.targets import check_recipe, model_modules

SPARSEGPT = """
sparsity_stage:
  sparsity_modifiers:
    SparseGPTModifier:
      sparsity: 0.5
      mask_structure: "0:0"
      targets: [Linear]
      ignore: ["re:.*lm_head"]
"""
GPTQ = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      scheme: W4A16
      targets: Linear
      ignore: [lm_head]
"""
BOTH = SPARSEGPT + GPTQ


def test_the_three_recipes_as_runs():
    """SparseGPT 50%, GPTQ W4A16 and both in two stages: each stage a statistics-mode run of
    its modifiers' settings, llm-compressor's defaults where the recipe is silent."""
    (prune,) = stage_settings(load_recipe(SPARSEGPT), {})
    assert prune == {"aggregate": "stats", "method": "sparsegpt", "sparsity": 0.5, "nm": "none",
                     "local_group": "layer", "sparsity_profile": "uniform", "quant": "none",
                     "sparsegpt_block_size": 128, "sparsegpt_dampening": 0.01}
    (quant,) = stage_settings(load_recipe(GPTQ), {"clients": 4})
    assert quant == {"clients": 4, "aggregate": "stats", "method": "none", "sparsity": 0.0,
                     "quant": "w4a16", "quant_method": "gptq", "quant_group_size": 128,
                     "quant_symmetric": True, "quant_block_size": 128, "quant_dampening": 0.01,
                     "quant_actorder": "static"}
    both = stage_settings(load_recipe(BOTH), {"clients": 4})
    assert both == [{"clients": 4, **prune}, quant]
    assert [s.name for s in load_recipe(BOTH).stages] == ["sparsity", "quant"]


def test_a_recipe_reads_alike_from_a_file_a_string_json_a_mapping_and_modifiers(tmp_path):
    recipe = load_recipe(BOTH)
    (tmp_path / "r.yaml").write_text(BOTH)
    (tmp_path / "r.json").write_text(json.dumps(yaml.safe_load(BOTH)))
    assert load_recipe(tmp_path / "r.yaml") == recipe
    assert load_recipe(str(tmp_path / "r.json")) == recipe
    assert load_recipe(yaml.safe_load(BOTH)) == recipe
    assert load_recipe(recipe.to_dict()) == recipe  # what a run writes reads back the same
    one = load_recipe([SparseGPTModifier(sparsity=0.5, ignore=("lm_head",)),
                       GPTQModifier(ignore=("lm_head",))])
    assert [m.NAME for m in one.stages[0].modifiers] == ["SparseGPTModifier", "GPTQModifier"]
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")


def test_config_groups_equal_their_preset():
    groups = """
q_stage:
  q_modifiers:
    GPTQModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group,
                    group_size: 128, observer: minmax}
"""
    assert stage_settings(load_recipe(groups), {}) == stage_settings(load_recipe(GPTQ), {})
    channel = groups.replace("strategy: group,\n                    group_size: 128",
                             "strategy: channel").replace("num_bits: 4", "num_bits: 8")
    (run,) = stage_settings(load_recipe(channel), {})
    assert (run["quant"], run["quant_group_size"]) == ("w8a16", 0)
    rtn = GPTQ.replace("GPTQModifier", "QuantizationModifier").replace("W4A16", "W4A16_ASYM")
    (run,) = stage_settings(load_recipe(rtn), {})
    assert (run["quant_method"], run["quant_symmetric"]) == ("rtn", False)


def test_owl_n_m_ria_and_the_vote_modifier():
    owl = load_recipe({"p_stage": {"p_modifiers": {"WandaPruningModifier": {
        "sparsity": 0.6, "sparsity_profile": "owl", "owl_m": 7, "owl_lmbda": 0.05}}}})
    (run,) = stage_settings(owl, {})
    assert (run["method"], run["local_group"], run["sparsity_profile"], run["owl_m"],
            run["owl_lambda"]) == ("wanda", "row", "owl", 7.0, 0.05)
    nm = load_recipe({"p_stage": {"p_modifiers": {
        "RIAPruningModifier": {"sparsity": 0.5, "mask_structure": "2:4"},
        "FedPrLLMVoteModifier": {"comparison": "row", "scale": True}}}})
    (run,) = stage_settings(nm, {"aggregate": "votes"})
    assert (run["method"], run["nm"], run["group"], run["scale"], run["mode"]) == (
        "ria", "2:4", "row", True, "oneshot")


@pytest.mark.parametrize("recipe, message", [
    ({"s_stage": {"m_modifiers": {"ConstantPruningModifier": {}}}}, "ConstantPruningModifier"),
    ({"s_stage": {"m_modifiers": {"SparseGPTModifier": {"sparsity": 0.5, "lr": 1}}}}, "lr"),
    ({"s_stage": {"m_modifiers": {"SparseGPTModifier": {
        "sparsity": 0.5, "preserve_sparsity_mask": True}}}}, "preserve_sparsity_mask"),
    ({"s_stage": {"m_modifiers": {"SparseGPTModifier": {"sparsity": 0.5, "block_size": 0}}}},
     "block_size"),
    ({"s_stage": {"m_modifiers": {"SparseGPTModifier": {"sparsity": 0.5,
                                                        "dampening_frac": 1.5}}}},
     "dampening_frac"),
    ({"s_stage": {"m_modifiers": {"WandaPruningModifier": {"sparsity": [0.4, 0.6]}}}},
     "list of per-layer"),
    ({"s_stage": {"m_modifiers": {"WandaPruningModifier": {
        "sparsity": 0.7, "mask_structure": "2:4"}}}}, "expected 0.5"),
    ({"s_stage": {"m_modifiers": {"WandaPruningModifier": {"sparsity": 0.5, "owl_m": 5}}}},
     "owl_m"),
    ({"s_stage": {"m_modifiers": {"WandaPruningModifier": {}}}}, "sparsity"),
    ({"s_stage": {"m_modifiers": {"WandaPruningModifier": {
        "sparsity": 0.5, "targets": ["re:.*mlp.*"]}}}}, "expected Linear"),
    ({"s_stage": {"m_modifiers": {"WandaPruningModifier": {
        "sparsity": 0.5, "start": 2}}}}, "start"),
    ({"q_stage": {"m_modifiers": {"GPTQModifier": {"scheme": "W8A8"}}}}, "W8A8"),
    ({"q_stage": {"m_modifiers": {"GPTQModifier": {}}}}, "exactly one of scheme"),
    ({"q_stage": {"m_modifiers": {"GPTQModifier": {"scheme": "W4A16", "config_groups": {}}}}},
     "exactly one of scheme"),
    ({"q_stage": {"m_modifiers": {"GPTQModifier": {"config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group",
                                           "group_size": 128},
        "input_activations": {"num_bits": 8}}}}}}}, "input_activations"),
    ({"q_stage": {"m_modifiers": {"GPTQModifier": {"config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "tensor"}}}}}}},
     "strategy"),
    ({"q_stage": {"m_modifiers": {"GPTQModifier": {"config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                                           "group_size": 32}}}}}}}, "type"),
    ({"q_stage": {"m_modifiers": {"GPTQModifier": {"scheme": "W4A16",
                                                   "actorder": "group"}}}}, "g_idx"),
    ({"q_stage": {"m_modifiers": {"GPTQModifier": {"scheme": "W4A16",
                                                   "kv_cache_scheme": {"num_bits": 8}}}}},
     "kv_cache_scheme"),
    ({"s_stage": {"a_modifiers": {"WandaPruningModifier": {"sparsity": 0.5}},
                  "b_modifiers": {"SparseGPTModifier": {"sparsity": 0.5}}}}, "one per stage"),
    ({"q_stage": {"m_modifiers": {"GPTQModifier": {"scheme": "W4A16"}}},
      "s_stage": {"m_modifiers": {"WandaPruningModifier": {"sparsity": 0.5}}}},
     "follows the quantizing stage"),
    ({"args": {"sparsity": 0.5}, "s_stage": {}}, "recipe variables"),
    ({"s_stage": {"run_type": "train"}}, "one shot"),
    ({"sparsity_modifiers": {}}, "_stage"),
    ({"s_stage": {"sparsity": {}}}, "_modifiers"),
    ({}, "no modifier"),
    ({"s_stage": {"m_modifiers": {"FedPrLLMVoteModifier": {"comparison": "row"},
                                  "WandaPruningModifier": {"sparsity": 0.5}}}},
     "aggregate votes"),
])
def test_what_fedcompress_does_not_implement_is_refused_by_name(recipe, message):
    with pytest.raises(RecipeError, match=message):
        stage_settings(load_recipe(recipe), {})


def test_a_setting_the_recipe_owns_is_refused_beside_it():
    with pytest.raises(RecipeError, match="--sparsity"):
        stage_settings(load_recipe(SPARSEGPT), {"sparsity": 0.6, "clients": 4})


def test_targets_and_ignore_against_the_model(tiny):
    """The decoder layers' linear layers and nothing else: GPTQ must ignore lm_head (as
    llm-compressor would quantize it), and ignoring a decoder layer's linear is refused."""
    modules, linears = model_modules(tiny.model)
    assert len(linears) == 7 * 3 and all(n.startswith("model.layers.") for n in linears)
    from fedcompress.recipe.targets import check_targets

    for m in load_recipe(BOTH).modifiers:
        check_targets(m, modules, linears, m.NAME)
    with pytest.raises(RecipeError, match="lm_head"):
        check_targets(GPTQModifier(), modules, linears, "GPTQModifier")
    with pytest.raises(RecipeError, match="leave out 3"):
        check_targets(GPTQModifier(ignore=("lm_head", "re:.*down_proj")), modules, linears, "q")
    check_targets(WandaPruningModifier(ignore=("re:.*lm_head",)), modules, linears, "w")


@pytest.mark.parametrize("ignore, exact", [((), False), (("lm_head",), True)])
def test_a_pruning_recipe_llmcompressor_would_apply_to_lm_head_is_refused(tiny, ignore, exact):
    """llm-compressor 0.14's pruning modifiers match ``ignore`` against ``lm_head.`` (a
    targeted linear layer's own name, with a trailing dot): ``ignore: [lm_head]`` leaves
    lm_head (and the embeddings tied to it) pruned there. fedcompress, which prunes the decoder
    layers only, would make another model: refused, naming the regular expression that
    llm-compressor's own recipes use."""
    from fedcompress.recipe.targets import check_targets, pruned_by_llmcompressor

    modules, linears = model_modules(tiny.model)
    modifier = SparseGPTModifier(sparsity=0.5, ignore=ignore)
    assert pruned_by_llmcompressor(modifier, modules) == {*linears, "lm_head"}
    message = r"would also prune lm_head.*re:\.\*lm_head" + (".*trailing dot" if exact else "")
    with pytest.raises(RecipeError, match=message):
        check_targets(modifier, modules, linears, "s")
    kept_out = SparseGPTModifier(sparsity=0.5, ignore=("re:.*lm_head",))
    assert pruned_by_llmcompressor(kept_out, modules) == set(linears)
    # a decoder layer targeted as a whole: its linear layers inside it, by their own names
    layers = SparseGPTModifier(sparsity=0.5, targets=("re:model.layers.\\d+$",))
    assert pruned_by_llmcompressor(layers, modules) == set(linears)


def test_prune_settings_are_shorthands_for_recipes():
    """``fedcompress prune``'s compression settings as the recipe they stand for (one with
    no llm-compressor form, e.g. magnitude pruning, has none)."""
    votes = recipe_of({})
    assert [type(m) for m in votes.modifiers] == [WandaPruningModifier, FedPrLLMVoteModifier]
    assert stage_settings(votes, {"aggregate": "votes"})[0]["group"] == "layer"
    stats = recipe_of({"aggregate": "stats", "method": "sparsegpt", "local_group": "layer",
                       "quant": "w4a16", "quant_group_size": 64})
    assert [type(m) for m in stats.modifiers] == [SparseGPTModifier, GPTQModifier]
    (run,) = stage_settings(stats, {"pipeline": "joint"})  # prune --quant: one joint pass
    assert (run["method"], run["quant"], run["quant_group_size"]) == ("sparsegpt", "w4a16", 64)
    rtn = recipe_of({"aggregate": "stats", "method": "none", "sparsity": 0, "quant": "w8a16",
                     "quant_method": "rtn"})
    assert [type(m) for m in rtn.modifiers] == [QuantizationModifier]
    assert recipe_of({"method": "magnitude"}) is None
    assert recipe_of({"method": "sparsegpt"}) is None  # row comparison: not SparseGPT's own


def test_quantization_alone_keeps_a_pruned_weight_at_zero(monkeypatch):
    """GPTQ of a model pruned before (a later stage) sweeps with its zeros as a fixed mask
    (no error pushed into them, as llm-compressor's GPTQ); a dense weight is swept as before,
    with no mask; the step itself prunes nothing (an empty mask)."""
    from fedcompress.pruning import local
    from fedcompress.pruning.walker import LayerStats
    from fedcompress.quant import QuantConfig

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    dense = torch.randn(16, 32, generator=g)
    pruned = dense * (torch.rand(16, 32, generator=g) > 0.5)
    assert local.preserved_zeros(dense) is None
    assert torch.equal(local.preserved_zeros(pruned), pruned == 0)
    seen = []
    real = local.gptq_quantize
    monkeypatch.setattr(local, "gptq_quantize", lambda *a, **k: seen.append(k["mask"])
                        or real(*a, **k))
    pruner = local.layer_prune_fn(local.PruneConfig(
        "none", 0.0, quant=QuantConfig("w4a16", group_size=16, preserve_zeros=True)))
    pruner.quantized = {0: {}}
    stats = {"w": LayerStats(32, hessian=True)}
    stats["w"].add(x)
    for weight in (dense, pruned):
        mask, kept = pruner._quantize(0, "w", weight, stats, 0.0)
        assert not mask.any()
        assert bool((kept[weight == 0] == 0).all())
    assert seen[0] is None and torch.equal(seen[1], pruned == 0)
    plain = local.layer_prune_fn(local.PruneConfig(  # fedcompress prune's default: no rule
        "none", 0.0, quant=QuantConfig("w4a16", group_size=16)))
    plain.quantized = {0: {}}
    plain._quantize(0, "w", pruned, stats, 0.0)
    assert seen[2] is None


def test_one_text_per_site(tiny):
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig
    from fedcompress.methods.fedprllm.federated import federation_windows

    config = FedPrLLMConfig(model="unused", clients=2, samples_per_client=3, seqlen=16,
                            calib_text="wiki+shakespeare", partition="sources")
    windows, sources = federation_windows(tiny.tokenizer, config)
    assert sources == [["wiki"], ["shakespeare"]] and [len(w) for w in windows] == [3, 3]
    alone = FedPrLLMConfig(model="unused", clients=1, samples_per_client=3, seqlen=16,
                           calib_text="shakespeare", partition="sources")
    assert torch.equal(federation_windows(tiny.tokenizer, alone)[0][0], windows[1])
    with pytest.raises(ValueError, match="one text per site"):
        federation_windows(tiny.tokenizer, FedPrLLMConfig(
            model="unused", clients=3, calib_text="wiki+shakespeare", partition="sources"))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from fedcompress.models import load_model

    return load_model(tiny_dir, device="cpu")


def _in_process_stage(settings: dict) -> dict:
    """A stage's FedPrLLM run with the ClientApp's handlers in this process (no Ray)."""
    from pathlib import Path

    from fedcompress.api import method_defaults
    from fedcompress.methods import get_method
    from server.fedprllm import run

    class Federation(InProcessFederation):
        app = "clients.app"

    full = {k: v for k, v in method_defaults(get_method("fedprllm")).items()
            if k not in ("cpus_per_client", "ray_address")}
    full.update(settings)
    run(Federation(full["clients"]), full)
    return json.loads((Path(full["out"]) / "report.json").read_text())


def test_two_stage_recipe_over_a_federation(tiny_dir, tmp_path):
    """SparseGPT 50% then GPTQ W4A16 (group 16): the second stage starts from the first's
    model and keeps its zeros (asked beside the recipe); the output folder is
    llm-compressor's (compressed-tensors, the recipe beside it) and the report holds both
    stages' results."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    recipe = load_recipe(SPARSEGPT + GPTQ.replace("scheme: W4A16", """config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 16}
"""))
    beside = dict(model=tiny_dir, clients=2, samples_per_client=2, seqlen=16, batch_size=2,
                  eval_seqlen=16, eval_windows=2, device="cpu", baselines="centralized",
                  quant_preserve_zeros=True)  # beside the recipe: keep the first stage's zeros
    check_recipe(recipe, tiny_dir)
    run = run_recipe(recipe, beside, _in_process_stage, tmp_path / "out")
    report = run.report
    assert report["status"] == "ok" and [s["stage"] for s in report["stages"]] == [
        "sparsity", "quant"]
    names = [(r["stage"], r["name"]) for r in report["results"]]
    assert names == [("sparsity", "fedprllm-stats-layer"), ("sparsity", "centralized"),
                     ("quant", "fedprllm-stats-row+w4a16-gptq"), ("quant", "centralized")]
    assert abs(report["results"][0]["sparsity"] - 0.5) < 1e-3
    assert 0.5 - 1e-3 < report["results"][2]["sparsity"] < 0.6  # zeros kept, a few rounded
    config = json.loads((run.model_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert load_recipe(run.model_dir / "recipe.yaml") == recipe
    assert (run.out / "config.toml").exists() and "fedcompress compress --config" in \
        report["reproduce"]
    pruned = AutoModelForCausalLM.from_pretrained(str(run.out / "stages/1-sparsity/model"))
    model = AutoModelForCausalLM.from_pretrained(
        str(run.model_dir), quantization_config=CompressedTensorsConfig(dequantize=True))
    for name in ("self_attn.q_proj", "mlp.up_proj", "mlp.down_proj"):
        before = pruned.get_submodule(f"model.layers.1.{name}").weight
        after = model.get_submodule(f"model.layers.1.{name}").weight
        assert abs(float((before == 0).float().mean()) - 0.5) < 0.02
        assert bool((after[before == 0] == 0).all()), name


def test_compress_command(tmp_path):
    """``fedcompress compress``: --recipe and FedPrLLM's options less the ones a recipe owns;
    a bad recipe fails before anything runs, naming its field."""
    from typer.testing import CliRunner

    from fedcompress.cli import app

    runner = CliRunner()
    shown = runner.invoke(app, ["compress", "--help"], terminal_width=200)
    assert shown.exit_code == 0
    assert "--recipe" in shown.output and "--aggregate" in shown.output
    assert "--sparsity " not in shown.output and "--quant-group-size" not in shown.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(SPARSEGPT.replace("mask_structure", "mask_structur"))
    failed = runner.invoke(app, ["compress", "--recipe", str(bad), "--out", str(tmp_path / "o")])
    assert isinstance(failed.exception, RecipeError) and "mask_structur" in str(failed.exception)
    assert not (tmp_path / "o").exists()
    owned = runner.invoke(app, ["compress", "--recipe", str(bad), "--sparsity", "0.5"])
    assert owned.exit_code == 2 and "No such option" in owned.output


def test_sparsegpts_block_size_and_dampening_are_settings_of_the_run():
    """A recipe's SparseGPT block size and dampening reach the run; in one stage with GPTQ
    (one joint sweep) they must be GPTQ's, and a rule other than SparseGPT refuses them."""
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig

    recipe = load_recipe({"s_stage": {"m_modifiers": {"SparseGPTModifier": {
        "sparsity": 0.5, "block_size": 64, "dampening_frac": 0.05}}}})
    (run,) = stage_settings(recipe, {})
    assert (run["sparsegpt_block_size"], run["sparsegpt_dampening"]) == (64, 0.05)
    prune = FedPrLLMConfig.from_dict(run).prune
    assert (prune.sparsegpt_block_size, prune.sparsegpt_dampening) == (64, 0.05)
    with pytest.raises(SettingsError, match="sparsegpt_block_size=64.*quant_block_size=128"):
        FedPrLLMConfig.from_dict({**run, "quant": "w4a16"})
    with pytest.raises(SettingsError, match="sparsegpt_dampening=0.05.*method wanda"):
        FedPrLLMConfig(method="wanda", sparsegpt_dampening=0.05)


ONE_STAGE = """
compress_stage:
  compress_modifiers:
    SparseGPTModifier:
      sparsity: 0.5
      mask_structure: "0:0"
      ignore: ["re:.*lm_head"]
    GPTQModifier:
      scheme: W4A16
      targets: Linear
      ignore: [lm_head]
"""


def test_a_stage_with_pruning_and_quantization_runs_as_llmcompressors_default():
    """``pipeline independent`` (the default, llm-compressor's ``oneshot`` default): a stage's
    pruning and quantization modifiers are two passes, the same runs as the two-stage recipe;
    ``joint``: one pass (SparseGPT and GPTQ in one sweep); llm-compressor's ``sequential`` is
    refused by name, as is any other value."""
    recipe = load_recipe(ONE_STAGE)
    two = stage_settings(recipe, {"clients": 4})
    assert two == stage_settings(load_recipe(BOTH), {"clients": 4})
    assert [p.name for p in passes(recipe)] == ["compress-pruning",
                                                "compress-quantization"]
    assert stage_settings(recipe, {"pipeline": "independent", "clients": 4}) == two
    (joint,) = stage_settings(recipe, {"pipeline": "joint", "clients": 4})
    assert joint == {**two[0], **{k: v for k, v in two[1].items()
                                  if k not in ("method", "sparsity")}}
    assert (joint["method"], joint["quant"]) == ("sparsegpt", "w4a16")
    assert passes(load_recipe(BOTH), "independent") == load_recipe(BOTH).stages
    with pytest.raises(RecipeError, match="pipeline 'sequential'.*not implemented"):
        stage_settings(recipe, {"pipeline": "sequential"})
    with pytest.raises(RecipeError, match="pipeline 'basic': expected one of independent, joint"):
        passes(recipe, "basic")
    votes = recipe_from_dict({"s_stage": {"m_modifiers": {"WandaPruningModifier": {"sparsity": 0.5},
                                          "FedPrLLMVoteModifier": {"comparison": "row"},
                                          "QuantizationModifier": {"scheme": "W8A16",
                                                                   "ignore": ["lm_head"]}}}})
    first, second = passes(votes)
    assert [m.NAME for m in first.modifiers] == ["WandaPruningModifier", "FedPrLLMVoteModifier"]
    assert [m.NAME for m in second.modifiers] == ["QuantizationModifier"]


def test_prune_flwr_run_and_the_bench_carry_out_a_one_pass_recipe(tmp_path):
    """The ``recipe`` setting (``prune --recipe``, ``fedprllm.recipe`` in a run config, a bench
    study's ``recipe``): its one pass sets the pruning and quantization settings; a recipe of
    several passes is ``compress``'s; a setting the recipe owns, set beside it to another value
    than its default or the recipe's, is refused; the report's config (expanded, the recipe
    kept) parses again to the same settings."""
    from fedcompress.methods import get_method, settings_from_run_config

    method = get_method("fedprllm")
    sparse = tmp_path / "sparse.yaml"
    sparse.write_text(SPARSEGPT)
    config, _, server = method.parse({"recipe": str(sparse), "aggregate": "stats"})
    assert (config.method, config.sparsity, config.local_group, server.recipe) == (
        "sparsegpt", 0.5, "layer", str(sparse))
    again = method.parse({**config.to_dict(), **server.to_dict()})
    assert again[0] == config
    with pytest.raises(RecipeError, match=r"sparsity: set by the recipe .*sparse.yaml"):
        method.parse({"recipe": str(sparse), "aggregate": "stats", "sparsity": 0.6})
    with pytest.raises(RecipeError, match=r"sparsity: set by the recipe"):  # a command line's
        method.parse({"recipe": str(sparse), "aggregate": "stats", "sparsity": "0.6"})
    assert method.parse({"recipe": str(sparse), "aggregate": "stats", "sparsity": "0.5",
                         "method": "sparsegpt"})[0] == config
    both = tmp_path / "both.yaml"
    both.write_text(BOTH)
    with pytest.raises(RecipeError, match=r"2 passes \(sparsity, quant\).*fedcompress compress"):
        method.parse({"recipe": str(both)})
    one = tmp_path / "one.yaml"
    one.write_text(ONE_STAGE)
    with pytest.raises(RecipeError, match=r"2 passes \(compress-pruning, compress-quantization"):
        method.parse({"recipe": str(one), "aggregate": "stats"})
    joint, _, _ = method.parse({"recipe": str(one), "aggregate": "stats", "pipeline": "joint"})
    assert (joint.method, joint.quant, joint.quant_method) == ("sparsegpt", "w4a16", "gptq")
    chosen, flat = settings_from_run_config({**{f"fedprllm.{k}": v for k, v in
                                                method.run_config_defaults().items()},
                                             "method": "fedprllm",
                                             "fedprllm.recipe": str(sparse),
                                             "fedprllm.aggregate": "stats"})
    assert chosen is method and method.parse(flat)[0] == config
    with pytest.raises(RecipeError, match="FedPrLLMVoteModifier sets FedPrLLM's vote"):
        votes = tmp_path / "votes.yaml"
        votes.write_text(yaml.safe_dump({"s_stage": {"m_modifiers": {
            "WandaPruningModifier": {"sparsity": 0.5}, "FedPrLLMVoteModifier": {}}}}))
        method.parse({"recipe": str(votes), "aggregate": "stats"})


def test_prune_with_a_recipe_equals_prune_with_its_settings(tiny_dir, tmp_path):
    """A one-pass recipe through the FedPrLLM apps gives the model its settings give."""
    from safetensors.torch import load_file

    sparse = tmp_path / "sparse.yaml"
    sparse.write_text(SPARSEGPT)
    common = dict(model=tiny_dir, clients=2, samples_per_client=2, seqlen=16, batch_size=2,
                  eval_seqlen=16, eval_windows=2, device="cpu", baselines="none",
                  aggregate="stats")
    by_recipe = _in_process_stage({**common, "recipe": str(sparse),
                                   "out": str(tmp_path / "recipe")})
    by_flags = _in_process_stage({**common, "method": "sparsegpt", "sparsity": 0.5,
                                  "local_group": "layer", "out": str(tmp_path / "flags")})
    assert by_recipe["config"]["recipe"] == str(sparse)
    assert by_recipe["results"][0]["perplexity"] == by_flags["results"][0]["perplexity"]
    a = load_file(str(tmp_path / "recipe/model/model.safetensors"))
    b = load_file(str(tmp_path / "flags/model/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
