"""Attacks of a malicious server on a site's DP statistics (FedPrLLM statistics mode with
``--dp-epsilon``): every request beyond the site's own policy, and every attempt to change the
mechanism or to get more releases than the run announced, is refused before anything is
released, and the site's ledger shows no release for it."""

from __future__ import annotations

import pytest
from conftest import build_tiny_model

from fedcompress.methods.fedprllm import dp as dpm
from fedcompress.privacy.ledger import Ledger
from fedcompress.privacy.policy import PolicyError, SitePolicy

LAYERS = 2


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("llama", n_layers=LAYERS)


def request(**kw):
    base = dict(epsilon=8.0, delta=1e-5, placement="distributed", unit="window", clip=5.0,
                normalize="none", clip_quantile=0.95, public_windows=8, public_text="wiki",
                releases=LAYERS,
                sites=5, threshold=4, windows=4, seqlen=16)
    base.update(kw)
    return dpm.DpRequest(**base)


def policy(tmp_path, **kw):
    return SitePolicy(state_dir=str(tmp_path), **kw)


def plan_for(model, pol, req):
    """The site's plan; with ``normalize="public"``, unit scales stand for the public ones (the
    tiny model has no tokenizer for public text)."""
    import torch

    from fedcompress.methods.fedprllm.stats import layer_in_features
    from fedcompress.privacy.dp_stats import PublicCalibration

    calib = dpm.public_calibration(model, None, dpm.DpRequest(**{**req.__dict__,
                                                                 "normalize": "none"}),
                                   hessian=False)
    if req.normalize == "public":
        calib = PublicCalibration(calib.bounds, [
            {k: torch.ones(layer_in_features(model, i)[k], dtype=torch.float64) for k in b}
            for i, b in enumerate(calib.bounds)])
    dims = dpm.block_dims(model, calib.bounds, hessian=False)
    return dpm.site_plan(pol, req, LAYERS, calib, dims)


def test_an_honest_request_is_planned(model, tmp_path):
    plan = plan_for(model, policy(tmp_path), request())
    assert plan is not None and plan.mechanism == "skellam" and plan.releases == LAYERS
    assert plan.epsilon_after(LAYERS) <= 8.0


@pytest.mark.parametrize("asked,match", [
    (dict(epsilon=9.0), "max-epsilon"),
    (dict(epsilon=0.0), "allow-no-dp"),
    (dict(delta=1e-3), "max-delta"),
    (dict(placement="central"), "dp-placements"),
    (dict(threshold=2), "floor"),
    (dict(releases=LAYERS - 1), "releases"),
    (dict(unit="token"), "window"),
    # bounds or scales from a file the server names could come from the site's own data
    (dict(public_text="/srv/site/private/calibration.jsonl"), "bundled public corpus"),
    (dict(public_text="wikitext2"), "bundled public corpus"),
])
def test_a_request_beyond_the_sites_policy_is_refused(model, tmp_path, asked, match):
    with pytest.raises(PolicyError, match=match):
        plan_for(model, policy(tmp_path), request(**asked))


def test_a_private_file_as_public_text_is_refused_before_it_is_read(tiny_dir, tmp_path,
                                                                   monkeypatch):
    """The server names the site's own calibration file as the run's public text: the site's
    settings refuse it (a bundled corpus only), and the bounds' code never opens it."""
    from fedcompress.config import SettingsError
    from fedcompress.data import corpora
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig
    from fedcompress.privacy import dp_stats as dps

    private = tmp_path / "private.jsonl"
    private.write_text('{"text": "the site\'s own text"}\n')
    opened = []
    monkeypatch.setattr(corpora, "load_corpus", lambda *a, **k: opened.append(a) or [])
    with pytest.raises(SettingsError, match="dp_public_text"):
        FedPrLLMConfig.from_dict({"model": tiny_dir, "aggregate": "stats", "dp_epsilon": 8.0,
                                  "dp_public_text": str(private)})
    with pytest.raises(ValueError, match="bundled corpus"):
        dps.public_windows(None, 16, 2, corpus=str(private))
    assert not opened


def _files(tmp_path):
    public = tmp_path / "public" / "glossary.txt"
    private = tmp_path / "private" / "calibration.jsonl"
    for path, text in ((public, "a glossary the federation published\n"),
                       (private, '{"text": "the site\'s own contracts"}\n')):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return public, private


def _watch_reads(monkeypatch):
    """Every path the site hashes or loads as text."""
    from fedcompress.data import corpora
    from fedcompress.privacy import dp_calibration as dpc  # file_digest's home

    seen: list[str] = []
    digest, load = dpc.file_digest, corpora.load_corpus
    monkeypatch.setattr(dpc, "file_digest", lambda p: seen.append(str(p)) or digest(p))
    monkeypatch.setattr(corpora, "load_corpus", lambda n, *a: seen.append(str(n)) or load(n, *a))
    return seen


def test_a_pinned_digest_of_a_file_the_site_does_not_hold_as_public_is_refused(model, tmp_path,
                                                                             monkeypatch):
    """The server pins the digest of the site's own calibration file (it knows or guesses its
    content, and would learn through the bounds whether it is there): the site looks for the
    digest among the files its operator listed as public only, and refuses; its private file is
    never opened."""
    from fedcompress.privacy.dp_stats import file_digest

    public, private = _files(tmp_path)
    digest = file_digest(private)
    seen = _watch_reads(monkeypatch)
    pol = policy(tmp_path, dp_public_files=(str(public),))
    with pytest.raises(PolicyError, match="dp-public-files"):
        plan_for(model, pol, request(public_text=digest))
    assert str(private) not in seen and seen == [str(public)]
    # the listed file itself is planned with
    assert plan_for(model, pol, request(public_text=file_digest(public))) is not None


def test_a_path_the_server_sends_is_never_read_by_a_deployed_site(tiny_dir, tmp_path,
                                                                  monkeypatch):
    """The server's message names the site's private file as its ``dp_public_file`` (and pins
    its digest): a deployed site reads public text only from its own ``dp-public-files``, so it
    refuses before any release, and neither hashes nor loads the file."""
    from conftest import build_tiny_tokenizer

    from fedcompress.methods.fedprllm.config import FedPrLLMConfig
    from fedcompress.models import load_model
    from fedcompress.privacy.dp_stats import file_digest
    from fedcompress.pruning.walker import capture_layer_inputs

    public, private = _files(tmp_path)
    digest = file_digest(private)
    tiny = load_model(tiny_dir, device="cpu").model
    config = FedPrLLMConfig(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16,
                            aggregate="stats", dp_epsilon=8.0, dp_placement="central",
                            dp_public_windows=4, dp_public_text=digest,
                            dp_public_file=str(private))
    seen = _watch_reads(monkeypatch)
    import torch

    inputs = capture_layer_inputs(tiny, torch.randint(3, 120, (2, 16)), 2)
    for listed in ((), (str(public),)):
        pol = policy(tmp_path / f"site{len(listed)}", dp_placements=("central",),
                     dp_public_files=listed)
        ledger = Ledger(tmp_path / f"site{len(listed)}", pol.lifetime_epsilon)
        with pytest.raises(PolicyError, match="dp-public-files"):
            dpm.site_step(pol, ledger, 1, config, tiny, build_tiny_tokenizer(), inputs, 0)
        assert ledger.read()["releases"] == []
    assert str(private) not in seen


def test_a_site_copy_that_differs_from_the_pinned_text_is_refused(model, tmp_path):
    """The server pins one version of the public file, the site holds another (edited, or
    swapped for the server's benefit): not the same text, so not the same mechanism; refused,
    naming the digest of the site's copy."""
    from fedcompress.privacy.dp_stats import file_digest

    public, _ = _files(tmp_path)
    pinned = file_digest(public)
    public.write_text("a glossary the federation published, then edited at this site\n")
    with pytest.raises(PolicyError, match=f"{pinned}.*glossary.txt: {file_digest(public)}"):
        plan_for(model, policy(tmp_path, dp_public_files=(str(public),)),
                 request(public_text=pinned))


def test_no_dp_only_where_the_policy_allows_it(model, tmp_path):
    assert plan_for(model, policy(tmp_path, allow_no_dp=True), request(epsilon=0.0)) is None
    with pytest.raises(PolicyError, match="allow-no-dp"):
        plan_for(model, policy(tmp_path), request(epsilon=0.0))


def _ledger(tmp_path):
    return Ledger(tmp_path / "state", 32.0)


def _dp_releases(ledger):
    return [r for r in ledger.read()["releases"] if r["kind"] == "dp-stats"]


@pytest.mark.parametrize("change", [
    dict(clip=1.0),          # a smaller clip than announced (the bounds' digest differs)
    dict(epsilon=6.0),       # another budget mid-run (another sigma)
    dict(placement="central"),
    dict(releases=LAYERS + 3),  # more releases announced after the first
    dict(normalize="public"),   # normalized inputs after raw ones (another clipping)
])
def test_the_mechanism_cannot_change_mid_run(model, tmp_path, change):
    pol = policy(tmp_path, dp_placements=("central", "distributed"))
    ledger = _ledger(tmp_path)
    first = plan_for(model, pol, request())
    dpm.record_release(ledger, 7, first, 0)
    second = plan_for(model, pol, request(**change))
    with pytest.raises(PolicyError, match="fixed its DP statistics mechanism"):
        dpm.record_release(ledger, 7, second, 1)
    assert [r["layer"] for r in _dp_releases(ledger)] == [0]


def test_no_more_releases_than_announced(model, tmp_path):
    pol = policy(tmp_path)
    ledger = _ledger(tmp_path)
    plan = plan_for(model, pol, request())
    for layer in range(LAYERS):
        grant = dpm.record_release(ledger, 7, plan, layer)
    assert grant.run_epsilon == pytest.approx(plan.epsilon_after(LAYERS))
    # the server asks for layer 0 again (or any further release): refused, nothing recorded
    with pytest.raises(PolicyError, match="announced 2 DP statistics releases"):
        dpm.record_release(ledger, 7, plan, 0)
    assert len(_dp_releases(ledger)) == LAYERS
    run = ledger.read()["runs"]["7"]
    assert run["epsilon"] == pytest.approx(plan.epsilon_after(LAYERS)) and run["epsilon"] <= 8


def test_a_dp_stats_run_cannot_also_spend_on_text_or_dp_sgd(model, tmp_path):
    from fedcompress.privacy.ledger import DpSgdMechanism

    pol = policy(tmp_path)
    ledger = _ledger(tmp_path)
    dpm.record_release(ledger, 7, plan_for(model, pol, request()), 0)
    with pytest.raises(PolicyError, match="one mechanism per run"):
        ledger.text("7", "fedprllm", "text", 1.0, 8.0)
    with pytest.raises(PolicyError, match="one mechanism per run"):
        ledger.dp_sgd("7", "fedprllm", "train", DpSgdMechanism(1.0, 0.1, 1e-5, "rdp", 8.0), 1)


def test_the_lifetime_budget_bounds_every_run(model, tmp_path):
    pol = policy(tmp_path)
    ledger = Ledger(tmp_path / "state", 10.0)
    plan = plan_for(model, pol, request())
    for layer in range(LAYERS):
        dpm.record_release(ledger, 1, plan, layer)
    with pytest.raises(PolicyError, match="lifetime"):
        dpm.record_release(ledger, 2, plan, 0)


def test_in_process_run_refused_before_any_release(tmp_path, tiny_dir):
    import torch

    from fedcompress.methods.fedprllm.config import FedPrLLMConfig
    from fedcompress.methods.fedprllm.stats import DpSite, stats_prune
    from fedcompress.models import load_model

    tiny = load_model(tiny_dir, device="cpu").model
    config = FedPrLLMConfig(model=tiny_dir, clients=2, samples_per_client=2, seqlen=16,
                            batch_size=2, aggregate="stats", dp_epsilon=8.0,
                            dp_placement="central", dp_clip=5.0, dp_normalize="none",
                            dp_prior="none")
    policies = [SitePolicy(state_dir=str(tmp_path / "a"), dp_placements=("central",)),
                SitePolicy(state_dir=str(tmp_path / "b"), max_epsilon=4.0,
                           dp_placements=("central",))]
    sites = [DpSite(pol, Ledger(pol.state_dir, 32.0)) for pol in policies]
    windows = [torch.randint(3, 120, (2, 16)) for _ in range(2)]
    with pytest.raises(PolicyError, match="max-epsilon"):
        stats_prune(tiny, windows, config, dp_sites=sites)
    assert all(not _dp_releases(site.ledger) for site in sites)
