"""The site policy (fedcompress.privacy.policy): defaults, the TOML file, node-config overrides,
checks, simulation derived from the site's own runtime."""

from __future__ import annotations

import pytest

from fedcompress.privacy.policy import PolicyError, SitePolicy, in_simulation_engine, site_policy


def test_private_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDCOMPRESS_STATE", str(tmp_path))
    policy = site_policy({"partition-id": 3})
    assert (policy.max_epsilon, policy.lifetime_epsilon, policy.max_delta) == (8.0, 32.0, 1e-5)
    assert not policy.allow_no_dp and not policy.reproducible_secrets
    assert not policy.simulation  # this test process is no Ray actor
    assert policy.state_dir == str(tmp_path / "site-3")
    assert "smollm2-135m" in policy.models and not any("/" in m for m in policy.models)
    assert "wiki" in policy.corpora and "strategyqa" in policy.corpora
    assert policy.guarantee_note == ""


def test_file_and_overrides(tmp_path):
    file = tmp_path / "policy.toml"
    file.write_text('max-epsilon = 4.0\nlifetime-epsilon = 10\nmodels = ["smollm2-135m", '
                    f'"{tmp_path}"]\ncorpora = "wiki,code"\nallow-no-dp = true\n')
    policy = site_policy({"policy": str(file), "max-epsilon": "2", "state-dir": str(tmp_path)})
    assert policy.max_epsilon == 2.0 and policy.lifetime_epsilon == 10.0
    assert policy.allow_no_dp and policy.corpora == ("wiki", "code")
    assert policy.check_model(str(tmp_path / ".." / tmp_path.name)) is not None
    assert policy.state_dir == str(tmp_path)


@pytest.mark.parametrize("text, message", [
    ("max-epsilom = 3\n", "unknown key 'max-epsilom'"),
    ("max-epsilon = [\n", "not valid TOML"),
    ("max-epsilon = 'x'\n", "max-epsilon='x' is invalid"),
    ("max-epsilon = 40\n", "exceeds lifetime-epsilon"),
    ("max-delta = 2\n", "max-delta=2.0 is invalid"),
    ("allow-no-dp = 'maybe'\n", "allow-no-dp='maybe' is invalid"),
])
def test_bad_file(tmp_path, text, message):
    file = tmp_path / "policy.toml"
    file.write_text(text)
    with pytest.raises(PolicyError, match=message):
        site_policy({"policy": str(file), "state-dir": str(tmp_path)})


def test_missing_file_and_misspelt_key(tmp_path):
    with pytest.raises(PolicyError, match="cannot read the policy file"):
        site_policy({"policy": str(tmp_path / "nope.toml")})
    with pytest.raises(PolicyError, match="did you mean 'max-epsilon'"):
        site_policy({"max-epsilion": 2.0, "state-dir": str(tmp_path)})
    with pytest.raises(PolicyError, match="site-mode='sim' is invalid"):
        site_policy({"site-mode": "sim", "state-dir": str(tmp_path)})
    site_policy({"partition-id": 0, "data-path": "x", "site-agent": "y", "other": 1,
                 "state-dir": str(tmp_path)})  # other keys are not the policy's


def test_checks():
    policy = SitePolicy(state_dir="/x")
    assert policy.check_epsilon(8.0) == 8.0
    for bad, message in ((8.5, "exceeds this site's bound max-epsilon=8"),
                         (0, "without differential privacy"), (None, "allow-no-dp=false"),
                         (float("nan"), "invalid"), (-1.0, "invalid")):
        with pytest.raises(PolicyError, match=message):
            policy.check_epsilon(bad)
    assert SitePolicy(allow_no_dp=True).check_epsilon(0) is None
    assert policy.check_delta(1e-5) == 1e-5
    with pytest.raises(PolicyError, match="max-delta=1e-05"):
        policy.check_delta(1e-3)
    # one colluder by default: more than (n + 1) / 2, and more than half
    assert [policy.min_secagg_threshold(n) for n in (1, 2, 3, 4, 5, 16)] == [2, 2, 3, 3, 4, 9]
    trusting = SitePolicy(secagg_max_colluders=0)
    assert [trusting.min_secagg_threshold(n) for n in (1, 2, 3, 4, 5, 16)] == [2, 2, 2, 3, 3, 9]
    with pytest.raises(PolicyError, match="sites=0"):
        policy.min_secagg_threshold(0)
    with pytest.raises(PolicyError, match="node config models"):
        policy.check_model("HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(PolicyError, match="node config models"):
        policy.check_model("/tmp")
    with pytest.raises(PolicyError, match="node config corpora"):
        policy.check_corpus("c4")
    assert policy.check_corpus("wiki") == "wiki"


def test_simulation_switches():
    deployed = SitePolicy(state_dir="/x")
    deployed.check_simulation_switches({"fault": "none", "faulty": 0, "attack": "none",
                                        "attackers": 0, "fault_seconds": 30.0})
    for key, value in (("fault", "kill"), ("faulty", 1), ("attack", "inverted"),
                       ("attackers", 2), ("fault-layer", 3)):
        with pytest.raises(PolicyError, match="simulation-only switch"):
            deployed.check_simulation_switches({key: value})
    SitePolicy(state_dir="/x", simulation=True).check_simulation_switches({"fault": "kill"})


def test_simulation_is_the_sites_own(tmp_path):
    assert not in_simulation_engine()
    assert site_policy({"site-mode": "simulation"}).simulation
    assert not site_policy({"site-mode": "deployment", "state-dir": str(tmp_path)}).simulation
    # without state-dir, a simulated site's ledger lives in a temporary folder
    assert "fedcompress-sim-state" in site_policy({"site-mode": "simulation"}).state_dir


def test_reproducible_secrets_note():
    assert "does NOT hold" in SitePolicy(reproducible_secrets=True).guarantee_note


def test_public_files_are_the_sites_own(tmp_path):
    """``dp-public-files``: the files this site's operator holds as public, from its node
    config; a digest none of them has is refused, naming each listed file's digest."""
    import hashlib

    public = tmp_path / "glossary.txt"
    public.write_text("a public glossary of the domain\n")
    policy = site_policy({"dp-public-files": f"{public}, {tmp_path / 'gone.txt'}",
                          "state-dir": str(tmp_path)})
    assert policy.dp_public_files == (str(public), str(tmp_path / "gone.txt"))
    digest = "sha256:" + hashlib.sha256(public.read_bytes()).hexdigest()
    assert policy.public_file(digest) == str(public)
    with pytest.raises(PolicyError, match=f"dp-public-files.*{digest}.*gone.txt: unreadable"):
        policy.public_file("sha256:" + "0" * 64)
    assert site_policy({"state-dir": str(tmp_path)}).dp_public_files == ()
