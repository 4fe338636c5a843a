"""Statistics mode with differential privacy, end to end in one process (no Ray): the run
completes under both placements, the masks have the target sparsity, every site's ledger
records each layer's release and the run's epsilon, and the report states epsilon, delta and
the placement."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_tokenizer

from fedcompress.methods.fedprllm.config import FedPrLLMConfig
from fedcompress.methods.fedprllm.stats import DpSite, stats_prune
from fedcompress.models import ModelAdapter, load_model
from fedcompress.privacy.ledger import Ledger
from fedcompress.privacy.policy import SitePolicy

SITES, WINDOWS, SEQ = 4, 4, 16


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, device="cpu").model


def site_windows(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 120, (WINDOWS, SEQ), generator=gen) for _ in range(SITES)]


def dp_sites(tmp_path, **policy):
    out = []
    for i in range(SITES):
        folder = tmp_path / f"site-{i}"
        pol = SitePolicy(state_dir=str(folder), dp_placements=("central", "distributed"),
                         **policy)
        out.append(DpSite(pol, Ledger(folder, pol.lifetime_epsilon)))
    return out


def config_for(tiny_dir, **kw):
    base = dict(model=tiny_dir, clients=SITES, samples_per_client=WINDOWS, seqlen=SEQ,
                batch_size=2, aggregate="stats", dp_epsilon=8.0, dp_public_windows=8)
    base.update(kw)
    return FedPrLLMConfig(**base)


@pytest.mark.parametrize("method,placement", [("wanda", "central"),
                                              ("sparsegpt", "distributed")])
def test_dp_stats_run(tiny, tiny_dir, tmp_path, method, placement):
    config = config_for(tiny_dir, method=method, dp_placement=placement,
                        secagg=placement == "distributed")
    sites = dp_sites(tmp_path)
    run = stats_prune(tiny, site_windows(), config, tokenizer=build_tiny_tokenizer(),
                      dp_sites=sites, run_id="r1")
    n_layers = len(ModelAdapter(tiny))
    assert len(run.masks) == n_layers
    for masks in run.masks:
        for name, mask in masks.items():
            assert float(mask.float().mean()) == pytest.approx(0.5, abs=0.02), name
    dp = run.dp
    assert dp["dp"] and dp["placement"] == placement and dp["unit"] == "window"
    assert dp["epsilon"] == 8.0 and dp["delta"] == 1e-5
    assert dp["mechanism"] == ("gaussian" if placement == "central" else "skellam")
    assert 7.9 <= dp["epsilon_spent"] <= 8.0
    assert dp["site_epsilon"] == [pytest.approx(dp["epsilon_spent"])] * SITES
    json.dumps(dp)  # the report's content
    for site in sites:
        data = site.ledger.read()
        releases = [r for r in data["releases"] if r["kind"] == "dp-stats"]
        assert [r["layer"] for r in releases] == list(range(n_layers))
        assert all(r["placement"] == placement and r["unit"] == "window" for r in releases)
        eps = [r["epsilon"] for r in releases]
        assert eps == sorted(eps) and eps[-1] == pytest.approx(dp["epsilon_spent"])
        assert data["runs"]["r1"]["epsilon"] == pytest.approx(dp["epsilon_spent"])
        assert data["runs"]["r1"]["delta"] == 1e-5
    # the same run again is refused by every ledger: its releases are spent
    from fedcompress.privacy.policy import PolicyError

    with pytest.raises(PolicyError, match="releases"):
        stats_prune(tiny, site_windows(), config, tokenizer=build_tiny_tokenizer(),
                    dp_sites=sites, run_id="r1")


def test_dp_with_little_noise_keeps_most_of_the_non_dp_masks(tiny, tiny_dir):
    plain = stats_prune(tiny, site_windows(), config_for(tiny_dir, dp_epsilon=0.0))
    loose = stats_prune(tiny, site_windows(), config_for(tiny_dir, dp_epsilon=1e4,
                                                         dp_delta=0.1, dp_placement="central"),
                        tokenizer=build_tiny_tokenizer(), dp_seed=1)
    agree = [float((a == b).float().mean()) for pa, pb in zip(plain.masks, loose.masks)
             for a, b in zip(pa.values(), pb.values())]
    assert sum(agree) / len(agree) > 0.9
    assert plain.dp == {"dp": False}


def test_site_step_records_before_it_releases_and_agrees_with_the_server(tiny, tiny_dir,
                                                                         tmp_path):
    from fedcompress.methods.fedprllm import dp as dpm
    from fedcompress.pruning.walker import capture_layer_inputs

    config = config_for(tiny_dir, dp_placement="central")
    pol = SitePolicy(state_dir=str(tmp_path), dp_placements=("central",))
    ledger = Ledger(tmp_path, pol.lifetime_epsilon)
    inputs = capture_layer_inputs(tiny, site_windows()[0], 2)
    step = dpm.site_step(pol, ledger, 3, config, tiny, build_tiny_tokenizer(), inputs, 0)
    server = dpm.server_plan(config, tiny, build_tiny_tokenizer())
    assert step.plan.ledger_mechanism() == server.ledger_mechanism()
    assert step.metrics["ledger_dp"] == 1 and step.metrics["dp_epsilon"] == 8.0
    assert step.metrics["ledger_run_epsilon"] == pytest.approx(server.epsilon_after(1))
    assert [r["layer"] for r in ledger.read()["releases"]] == [0]
    assert all(st.tokens == WINDOWS * SEQ for st in step.clipped.stats.values())
    # a site whose policy allows no central placement refuses before recording anything
    from fedcompress.privacy.policy import PolicyError

    strict = SitePolicy(state_dir=str(tmp_path / "strict"))
    other = Ledger(tmp_path / "strict", 32.0)
    with pytest.raises(PolicyError, match="dp-placements"):
        dpm.site_step(strict, other, 3, config, tiny, build_tiny_tokenizer(), inputs, 0)
    assert other.read()["releases"] == []
