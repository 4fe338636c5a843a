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
    from fedcompress.methods.fedprllm.dp import describe, server_plan

    text = describe(server_plan(config, tiny, build_tiny_tokenizer()))
    assert "epsilon 8" in text and "delta 1e-05" in text and placement in text
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
    # a deployed site does not say how many windows the server's clip bound cut (not noised)
    assert "dp_clipped_windows" not in step.metrics
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


def _public_file(folder, name="glossary.txt"):
    """A public text of the federation's domain, as a file one party keeps where it likes."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("\n\n".join(f"Clause {i}: the lessee pays {i * 7} units of rent by day "
                                f"{i % 28 + 1}, and the lessor repairs the roof."
                                for i in range(80)))
    return path


def test_a_pinned_public_file_gives_the_site_and_the_server_one_calibration(tiny, tiny_dir,
                                                                          tmp_path):
    """``dp_public_text = "sha256:..."``: the site reads its own copy (its ``dp-public-files``),
    the server its ``dp_public_file``; byte for byte the same text, so the same bounds, scales
    and mechanism, which are not wiki's; a run of statistics mode completes with it."""
    from fedcompress.methods.fedprllm import dp as dpm
    from fedcompress.privacy.dp_stats import file_digest
    from fedcompress.pruning.walker import capture_layer_inputs

    site_copy = _public_file(tmp_path / "site")
    server_copy = _public_file(tmp_path / "server", "copy.txt")
    digest = file_digest(site_copy)
    config = config_for(tiny_dir, dp_placement="central", dp_public_text=digest,
                        dp_public_file=str(server_copy))
    pol = SitePolicy(state_dir=str(tmp_path / "state"), dp_placements=("central",),
                     dp_public_files=(str(site_copy),))
    ledger = Ledger(tmp_path / "state", pol.lifetime_epsilon)
    inputs = capture_layer_inputs(tiny, site_windows()[0], 2)
    tok = build_tiny_tokenizer()
    step = dpm.site_step(pol, ledger, 3, config, tiny, tok, inputs, 0)
    server = dpm.server_plan(config, tiny, tok)
    assert step.plan.ledger_mechanism() == server.ledger_mechanism()
    assert step.plan.bounds == server.bounds and server.clip.startswith("public-sha256:")
    request = dpm.DpRequest.from_config(config, len(ModelAdapter(tiny)), SITES)
    wiki = dpm.public_calibration(tiny, tok, dpm.DpRequest(**{**request.__dict__,
                                                              "public_text": "wiki"}), False, 2)
    assert wiki.bounds != list(server.bounds)
    # in simulation (the server runs the sites) a site may use the server's copy
    simulated = SitePolicy(state_dir=str(tmp_path / "sim"), simulation=True)
    assert str(server_copy) in dpm.public_files(simulated, request, config)
    run = stats_prune(tiny, site_windows(), config, tokenizer=tok, dp_seed=1)
    assert run.dp["clip"] == server.clip


@pytest.mark.parametrize("settings,match", [
    (dict(dp_public_text="sha256:" + "A" * 64), "64 lowercase hex digits"),
    (dict(dp_public_text="/srv/public.txt"), "bundled corpus"),
    (dict(dp_public_file="/srv/public.txt"), "unless dp_public_text is a file's digest"),
])
def test_public_text_settings_are_checked(tiny_dir, settings, match):
    from fedcompress.config import SettingsError

    with pytest.raises(SettingsError, match=match):
        config_for(tiny_dir, **settings)


# -- through the Flower strategy and ClientApp, in process (no Ray) --------------------------


def _dp_ledger_releases(federation, node):
    from pathlib import Path

    folder = Path(federation.contexts[node].node_config["state-dir"])
    files = list(folder.rglob("ledger.jsonl"))
    assert len(files) == 1, files
    data = Ledger(files[0].parent, 32.0).read()
    return [r for r in data["releases"] if r["kind"] == "dp-stats"]


def test_flower_central_dp_with_deployed_sites(tiny_dir, tmp_path):
    from conftest import InProcessFederation
    from flwr.app import ArrayRecord, ConfigRecord

    from strategies.fedprllm import make_strategy

    class Deployed(InProcessFederation):
        app = "clients.app"
        # central placement: the server is trusted with the un-noised statistics, which
        # leave in the clear (the site allows both: dp-placements, require-secagg)
        site_config = {"site-mode": "deployment", "dp-placements": "central",
                       "require-secagg": False, "models": tiny_dir}

    config = config_for(tiny_dir, dp_placement="central")
    loaded = load_model(tiny_dir, device="cpu")
    strategy = make_strategy(config, loaded.model, tokenizer=loaded.tokenizer)
    assert strategy.dp_plan is not None and strategy.dp_plan.placement == "central"
    federation = Deployed(SITES)
    for rnd in range(1, strategy.num_rounds + 1):
        replies = federation.send_and_receive(strategy.configure_train(rnd, ArrayRecord(),
                                                                       ConfigRecord(),
                                                                       federation))
        strategy.aggregate_train(rnd, replies)
    assert not strategy.outcome.rejected
    for masks in strategy.global_masks.values():
        for mask in masks.values():
            assert float(mask.float().mean()) == pytest.approx(0.5, abs=0.02)
    metrics = [m for m in strategy.outcome.client_metrics if m.get("stage") == "stats"]
    assert metrics and all(m["ledger_dp"] == 1 and m["dp_epsilon"] == 8.0 for m in metrics)
    assert all(m["site_policy_enforced"] == 1 for m in metrics)
    spent = strategy.dp_plan.epsilon_after(strategy.num_rounds)
    for node in federation.get_node_ids():
        releases = _dp_ledger_releases(federation, node)
        assert [r["layer"] for r in releases] == list(range(strategy.num_rounds))
        assert releases[-1]["epsilon"] == pytest.approx(spent)


def test_flower_distributed_dp_under_secagg(tiny_dir):
    from conftest import InProcessFederation
    from flwr.app import ArrayRecord

    from strategies.fedprllm import SecureStatsFedPrLLM, make_strategy

    class Simulated(InProcessFederation):
        app = "clients.app"

    config = config_for(tiny_dir, method="sparsegpt", dp_placement="distributed", secagg=True)
    loaded = load_model(tiny_dir, device="cpu")
    strategy = make_strategy(config, loaded.model, tokenizer=loaded.tokenizer)
    assert isinstance(strategy, SecureStatsFedPrLLM)
    assert strategy.dp_plan.mechanism == "skellam"
    federation = Simulated(SITES)
    strategy.start(federation, ArrayRecord())
    assert not strategy.outcome.rejected
    for masks in strategy.global_masks.values():
        for mask in masks.values():
            assert float(mask.float().mean()) == pytest.approx(0.5, abs=0.02)
    for node in federation.get_node_ids():
        releases = _dp_ledger_releases(federation, node)
        assert [r["layer"] for r in releases] == list(range(strategy.num_rounds))
        assert all(r["placement"] == "distributed" for r in releases)


def test_server_app_report_states_epsilon_delta_and_placement(tiny_dir, tmp_path):
    from conftest import InProcessFederation

    from server.fedprllm import run

    class Simulated(InProcessFederation):
        app = "clients.app"

    out = tmp_path / "run"
    settings = dict(model=tiny_dir, clients=SITES, samples_per_client=WINDOWS, seqlen=SEQ,
                    batch_size=2, eval_seqlen=16, eval_windows=2, out=str(out), device="cpu",
                    aggregate="stats", baselines="none", dp_epsilon=4.0, dp_delta=1e-6,
                    dp_placement="central", dp_public_windows=8)
    run(Simulated(SITES), settings)
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok", report.get("error")
    dp = report["dp"]
    assert dp["epsilon"] == 4.0 and dp["delta"] == 1e-6 and dp["placement"] == "central"
    assert dp["epsilon_spent"] <= 4.0
    assert dp["site_epsilon"] == [pytest.approx(dp["epsilon_spent"])] * SITES
    assert "central" in report["dp_noise"] and "epsilon 4" in report["dp_noise"]
    from fedcompress.report_answer import privacy

    sentences = " ".join(privacy(report)[0])  # the report page's "privacy spent"
    assert "DP noise: statistics of each site clipped per calibration window" in sentences
    assert "no differential-privacy guarantee" not in sentences


def _public_windows_run(tiny, tiny_dir, corpus="wiki", **kw):
    """Statistics mode without DP on the public windows alone (one site): pruning on public
    text (``corpus``'s validation split) through the same walker."""
    from fedcompress.privacy.dp_stats import public_windows

    public = public_windows(build_tiny_tokenizer(), SEQ, 8, corpus=corpus)
    return stats_prune(tiny, [public], config_for(tiny_dir, dp_epsilon=0.0, clients=1, **kw))


@pytest.mark.parametrize("text", ["wiki", "code"])
def test_a_drowned_release_with_the_public_prior_prunes_as_public_text(tiny, tiny_dir, text):
    """dp_prior="public": where the noise drowns the release (a tiny epsilon), the server's
    SparseGPT prunes each layer as on public text's own Hessian through its pruned prefix:
    the same masks, and the same updated weights up to the level's rounding; with
    ``dp_public_text="code"``, as on the code corpus' public windows (not wiki's)."""
    reference = _public_windows_run(tiny, tiny_dir, text, method="sparsegpt")
    if text != "wiki":
        wiki = _public_windows_run(tiny, tiny_dir, method="sparsegpt")
        assert any(not torch.equal(wiki.masks[i][n], m)
                   for i, masks in enumerate(reference.masks) for n, m in masks.items())
    drowned = stats_prune(tiny, site_windows(), config_for(
        tiny_dir, method="sparsegpt", dp_epsilon=0.05, dp_placement="central",
        dp_prior="public", dp_public_text=text), tokenizer=build_tiny_tokenizer(), dp_seed=3)
    flat = stats_prune(tiny, site_windows(), config_for(
        tiny_dir, method="sparsegpt", dp_epsilon=0.05, dp_placement="central",
        dp_prior="shrink", dp_public_text=text), tokenizer=build_tiny_tokenizer(), dp_seed=3)
    for layer, masks in enumerate(reference.masks):
        for name, mask in masks.items():
            assert torch.equal(drowned.masks[layer][name], mask), (layer, name)
            assert torch.allclose(drowned.weights[layer][name], reference.weights[layer][name],
                                  rtol=1e-4, atol=1e-6), (layer, name)
    # the flat prior has no correlations: not public text's pruning
    assert any(not torch.equal(flat.masks[i][n], m) or
               not torch.allclose(flat.weights[i][n], reference.weights[i][n], atol=1e-6)
               for i, masks in enumerate(reference.masks) for n, m in masks.items())


def test_flower_server_shrinks_toward_public_text_through_its_pruned_model(tiny, tiny_dir,
                                                                           monkeypatch):
    """The strategy's public prior: a drowned central release prunes as public text (its
    noise seeded here, for the comparison: a run draws it from the OS)."""
    import numpy as np
    from conftest import InProcessFederation
    from flwr.app import ArrayRecord

    from fedcompress.privacy import dp_stats
    from strategies.fedprllm import make_strategy

    class Simulated(InProcessFederation):
        app = "clients.app"

    monkeypatch.setattr(dp_stats, "secret_rng", lambda seed=None: np.random.default_rng(3))
    reference = _public_windows_run(tiny, tiny_dir, method="sparsegpt")
    config = config_for(tiny_dir, method="sparsegpt", dp_epsilon=0.05,
                        dp_placement="central", dp_prior="public")
    loaded = load_model(tiny_dir, device="cpu")
    strategy = make_strategy(config, loaded.model, tokenizer=loaded.tokenizer)
    assert strategy.public_prior is not None
    strategy.start(Simulated(SITES), ArrayRecord())
    assert not strategy.outcome.rejected
    for layer, masks in enumerate(reference.masks):
        for name, mask in masks.items():
            assert torch.equal(strategy.global_masks[layer][name], mask), (layer, name)


def test_the_public_prior_resyncs_a_layer_asked_out_of_order(tiny, tiny_dir):
    """PublicPrior: layer 2 asked first (a resumed server) gives the statistics it gives after
    layers 0 and 1 in order."""
    from fedcompress.methods.fedprllm.dp import PublicPrior

    run = _public_windows_run(tiny, tiny_dir, method="sparsegpt")
    masks, weights = dict(enumerate(run.masks)), dict(enumerate(run.weights))
    in_order = PublicPrior(tiny, build_tiny_tokenizer(), SEQ, 8, batch_size=2)
    for layer in range(3):
        ordered = in_order.layer_stats(layer, masks, weights, hessian=True)
    resumed = PublicPrior(tiny, build_tiny_tokenizer(), SEQ, 8, batch_size=2)
    direct = resumed.layer_stats(2, masks, weights, hessian=True)
    assert sorted(direct) == sorted(ordered)
    for name, st in ordered.items():
        assert torch.equal(direct[name].hessian_sum, st.hessian_sum), name
    with pytest.raises(ValueError, match="tokenizer"):
        PublicPrior(tiny, None, SEQ, 8)
