"""The recipe scripts of ``simulations/``: the anchor's reading of saved models and the timing
run's arithmetic, end to end on the tiny model (a stage's apps in this process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import load_tool

from fedcompress.quant.compressed_tensors import pack_int32


@pytest.mark.parametrize("bits", [4, 8])
def test_the_anchor_unpacks_what_compressed_tensors_packs(bits):
    anchor = load_tool("recipe_anchor", "simulations")
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    values = torch.randint(low, high + 1, (5, 24), generator=torch.Generator().manual_seed(0),
                           dtype=torch.int8)
    assert torch.equal(anchor.unpack_int32(pack_int32(values, bits), bits, 24), values)


def test_the_anchor_compares_a_model_with_itself_as_identical(tiny_dir):
    anchor = load_tool("recipe_anchor", "simulations")
    same = anchor.compare_folders(Path(tiny_dir), Path(tiny_dir), 32)
    assert same["masks_identical"] == same["kept_values_identical"] == 1.0
    assert same["kept_median_relative_difference"] == 0.0
    assert same["integers_identical"] is None and same["layers"] > 0


def test_stage_times_need_both_runs():
    timing = load_tool("recipe_time", "simulations")
    report = {"results": [
        {"name": "fedprllm-stats-layer", "federated_seconds": 6.0, "startup_seconds": 1.0,
         "perplexity": 10.0},
        {"name": "centralized", "prune_seconds": 4.0, "perplexity": 9.5}]}
    row = timing.stage_times("sparsity", report)
    assert (row["ratio"], row["federated_seconds"], row["centralized_seconds"]) == (1.5, 6, 4)
    with pytest.raises(ValueError, match="expected a federated and a centralized result"):
        timing.stage_times("sparsity", {"results": report["results"][:1]})


def test_recipe_time_end_to_end(tiny_dir, tmp_path, monkeypatch):
    """One recipe through ``fedcompress.compress`` (its stages' apps in this process): a
    result per recipe with both times and their ratio, the stages beside it."""
    from conftest import InProcessFederation

    import fedcompress.api as api
    from fedcompress.methods import get_method
    from server.fedprllm import run

    def in_process(cpus_per_site: float = 1.0, ray_address: str = ""):
        def stage(settings: dict) -> dict:
            class Federation(InProcessFederation):
                app = "clients.app"

            full = {**api.method_defaults(get_method("fedprllm")), **settings}
            full = {k: v for k, v in full.items() if k not in ("cpus_per_client", "ray_address")}
            run(Federation(full["clients"]), full)
            return json.loads((Path(full["out"]) / "report.json").read_text())
        return stage

    monkeypatch.setattr(api, "stage_runner", in_process)
    timing = load_tool("recipe_time", "simulations")
    out = tmp_path / "out"
    assert timing.main(["--out", str(out), "--recipes", "sparsegpt50", "--model", tiny_dir,
                        "--clients", "2", "--samples-per-client", "1", "--seqlen", "16",
                        "--eval-windows", "1", "--eval-seqlen", "16", "--batch-size", "1"]) == 0
    report = json.loads((out / "report.json").read_text())
    (result,) = report["results"]
    assert result["name"] == "sparsegpt50" and result["stages"] == 1
    assert result["ratio"] == pytest.approx(result["federated_seconds"]
                                            / result["centralized_seconds"])
    assert [s["stage"] for s in report["stages"]["sparsegpt50"]] == ["sparsity"]
    assert report["reproduce"].startswith("python simulations/recipe_time.py --out")


def test_the_rounding_spread_orders_and_shares():
    """Order 0 is partition order, the others seeded permutations of the same sites; a mask
    share counts equal zero patterns; a spread is the highest over the lowest, less one."""
    spread = load_tool("rounding_spread", "simulations")
    orders = spread.site_orders(5, 3, seed=0)
    assert orders[0] == [0, 1, 2, 3, 4] and orders == spread.site_orders(5, 3, seed=0)
    assert all(sorted(o) == [0, 1, 2, 3, 4] for o in orders) and orders[1] != orders[2]
    a = {"l": torch.tensor([[True, False], [False, False]])}
    b = {"l": torch.tensor([[True, True], [False, False]])}
    assert spread.same_mask_share(a, a) == 1.0 and spread.same_mask_share(a, b) == 0.75
    with pytest.raises(ValueError, match="different linear layers"):
        spread.same_mask_share(a, {"m": a["l"]})
    assert spread.spread([2.0, 2.5, 3.0]) == {"mean": 2.5, "lowest": 2.0, "highest": 3.0,
                                              "spread": 0.5}
    with pytest.raises(SystemExit):
        spread.parse_args(["--orders", "1"])


def test_the_rounding_spread_chains_a_recipes_passes(tiny_dir):
    """Each pass compresses the model the pass before it made (statistics mode, the tiny
    model): GPTQ's pass sees SparseGPT's pruned model and leaves at most 2^4 values per row and
    group; the model given is not changed."""
    from fedcompress.methods.fedprllm.federated import FedPrLLMConfig, federation_windows
    from fedcompress.methods.fedprllm.stats import stats_prune
    from fedcompress.models import load_model
    from fedcompress.recipe import load_recipe
    from fedcompress.recipe.plan import stage_settings

    spread = load_tool("rounding_spread", "simulations")
    anchor = load_tool("recipe_anchor", "simulations")
    assert spread.parse_args(["--recipes", "sparsegpt50-w4a16"]).recipes == ["sparsegpt50-w4a16"]
    loaded = load_model(tiny_dir, device="cpu", dtype="float32")
    federation = dict(model=tiny_dir, clients=2, samples_per_client=1, seqlen=16, seed=0)
    windows = federation_windows(loaded.tokenizer, FedPrLLMConfig(**federation))[0]
    configs = [FedPrLLMConfig(**federation, **settings) for settings in stage_settings(
        load_recipe(anchor.recipe_text("sparsegpt50-w4a16", 16)),
        {"aggregate": "stats", "quant_scale_dtype": "float32"})]
    assert [c.prune.quant is None for c in configs] == [True, False]
    seen: list[torch.Tensor] = []

    def federated(model, config):
        seen.append(model.model.layers[0].mlp.down_proj.weight.detach().clone())
        run = stats_prune(model, windows, config)
        return run.masks, run.weights

    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    out = spread.chained(loaded.model, configs, federated)
    assert all(torch.equal(v, loaded.model.state_dict()[k]) for k, v in before.items())
    assert torch.equal(seen[0], before["model.layers.0.mlp.down_proj.weight"])
    assert (seen[1] == 0).float().mean() == pytest.approx(0.5, abs=0.02)  # pass 2 sees pass 1's
    weight = out.model.layers[0].mlp.down_proj.weight.detach()
    assert not torch.equal(weight, seen[1])
    groups = weight.reshape(weight.shape[0], -1, 16)
    assert max(len(torch.unique(g)) for row in groups for g in row) <= 16
