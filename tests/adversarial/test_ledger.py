"""Attacks on a site's privacy ledger (fedcompress.privacy.ledger): it keeps the budget across a
restart, across runs and concurrent writers, and a damaged file never resets it."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

import pytest

from fedcompress.privacy.accounting import noise_multiplier
from fedcompress.privacy.ledger import NOT_DP, DpSgdMechanism, Ledger, LedgerError
from fedcompress.privacy.policy import PolicyError

Q, DELTA, STEPS = 0.05, 1e-5, 20


def mechanism(target: float = 8.0, rounds: int = 3) -> DpSgdMechanism:
    sigma = noise_multiplier(target, DELTA, Q, STEPS * rounds)
    return DpSgdMechanism(sigma=sigma, sample_rate=Q, delta=DELTA, accountant="rdp",
                          target_epsilon=target)


def test_extra_rounds_refused(tmp_path):
    ledger, fixed = Ledger(tmp_path, 32.0), mechanism()
    grants = [ledger.dp_sgd("1", "privytune", "train.dplora", fixed, STEPS) for _ in range(3)]
    assert 0 < grants[0].run_epsilon < grants[1].run_epsilon < grants[2].run_epsilon <= 8.0
    with pytest.raises(PolicyError, match="the run's budget is spent"):
        ledger.dp_sgd("1", "privytune", "train.dplora", fixed, STEPS)  # round 4 of 3
    assert ledger.read()["runs"]["1"]["steps"] == 3 * STEPS  # the refusal recorded nothing


def test_text_then_dp_sgd_in_one_run_stays_within_its_target(tmp_path):
    """A server that sends a text release (eps 8 per word, max-epsilon 8) and then DP-SGD rounds
    (target 8) in ONE run: together they must not exceed the run's target (they reached 16)."""
    ledger = Ledger(tmp_path, 32.0)
    ledger.text("1", "ppcgpt", "query.perturb", 4.0, max_epsilon=8.0)
    fixed = mechanism()
    with pytest.raises(PolicyError, match=r"above the run's target 8 .*the run's budget is spent"):
        for _ in range(3):
            ledger.dp_sgd("1", "privytune", "train.dplora", fixed, STEPS)
    assert ledger.read()["runs"]["1"]["epsilon"] <= 8.0 + 1e-6


def test_mechanism_fixed_at_the_first_round(tmp_path):
    ledger = Ledger(tmp_path, 32.0)
    ledger.dp_sgd("1", "privytune", "train.dplora", mechanism(rounds=3), STEPS)
    # the server announces 9 rounds from round 2 on (a smaller sigma) or another q / delta
    for other in (mechanism(rounds=9),
                  DpSgdMechanism(**{**mechanism().to_dict(), "sample_rate": 0.5}),
                  DpSgdMechanism(**{**mechanism().to_dict(), "delta": 1e-3}),
                  DpSgdMechanism(**{**mechanism().to_dict(), "target_epsilon": 4.0})):
        with pytest.raises(PolicyError, match="cannot change sigma, q, delta"):
            ledger.dp_sgd("1", "privytune", "train.dplora", other, STEPS)


def test_new_run_id_per_round_keeps_the_lifetime_budget(tmp_path):
    ledger, fixed = Ledger(tmp_path, 20.0), mechanism()
    spent = []
    with pytest.raises(PolicyError, match="above its budget lifetime-epsilon=20"):
        for run in range(100):  # a fresh run id each round resets only the per-run budget
            spent.append(ledger.dp_sgd(str(run), "privytune", "train.dplora", fixed,
                                       3 * STEPS).lifetime_epsilon)
    assert spent and spent[-1] <= 20.0 and len(spent) == 2
    assert ledger.lifetime_spent() == pytest.approx(spent[-1])


def test_restart_keeps_the_budget(tmp_path):
    fixed = mechanism()
    code = ("import sys, json; from fedcompress.privacy.ledger import Ledger, DpSgdMechanism; "
            "m = DpSgdMechanism(**json.loads(sys.argv[2])); "
            "g = Ledger(sys.argv[1], 32.0).dp_sgd('1', 'privytune', 'train.dplora', m, "
            "int(sys.argv[3])); "
            "print(g.run_epsilon)")
    for _ in range(3):  # three site processes, one round each
        subprocess.run([sys.executable, "-c", code, str(tmp_path), json.dumps(fixed.to_dict()),
                        str(STEPS)], check=True, capture_output=True)
    again = subprocess.run([sys.executable, "-c", code, str(tmp_path),
                            json.dumps(fixed.to_dict()), str(STEPS)], capture_output=True,
                           text=True)
    assert again.returncode != 0 and "the run's budget is spent" in again.stderr
    assert Ledger(tmp_path, 32.0).read()["runs"]["1"]["steps"] == 3 * STEPS


def _spend(path: str, i: int) -> float:
    return Ledger(path, 1000.0).text(str(i % 3), "ppcgpt", "query.perturb", 0.5, 8.0).run_epsilon


def test_concurrent_writers_lose_nothing(tmp_path):
    with ProcessPoolExecutor(4) as pool:
        list(pool.map(_spend, [str(tmp_path)] * 24, range(24)))
    data = Ledger(tmp_path, 1000.0).read()
    assert len(data["releases"]) == 24
    assert sorted(r["epsilon"] for r in data["runs"].values()) == [4.0, 4.0, 4.0]
    assert not list(tmp_path.glob(".ledger-*"))  # no temporary file left


@pytest.mark.parametrize("content", ["{not json", '{"format": "other"}', "", "[]"])
def test_corrupted_ledger_is_an_error_never_a_reset(tmp_path, content):
    ledger = Ledger(tmp_path, 32.0)
    ledger.text("1", "ppcgpt", "query.perturb", 3.0, 8.0)
    (tmp_path / "ledger.json").write_text(content)
    with pytest.raises(LedgerError, match="refusing to release anything"):
        ledger.text("1", "ppcgpt", "query.perturb", 3.0, 8.0)
    assert (tmp_path / "ledger.json").read_text() == content  # left for the operator


def test_text_and_not_dp_releases(tmp_path):
    ledger = Ledger(tmp_path, 32.0)
    assert ledger.text("1", "ppcgpt", "query.perturb", 3.0, 8.0).run_epsilon == 3.0
    assert ledger.text("1", "ppcgpt", "query.perturb", 3.0, 8.0).run_epsilon == 6.0
    with pytest.raises(PolicyError, match="max-epsilon=8"):  # the same text asked again
        ledger.text("1", "ppcgpt", "query.perturb", 3.0, 8.0)
    grant = ledger.not_dp("2", "fedprllm", "train.masks")
    assert grant.run_epsilon == 0.0 and grant.lifetime_epsilon == 6.0
    assert ledger.read()["releases"][-1]["epsilon"] == NOT_DP
    # a run id reused by another method: its releases compose with the run's
    assert ledger.text("2", "ppcgpt", "query.perturb", 1.0, 8.0).run_epsilon == 1.0
    assert ledger.read()["runs"]["2"]["method"] == "fedprllm+ppcgpt"


def test_ledger_file_is_private(tmp_path):
    Ledger(tmp_path / "state", 32.0).not_dp("1", "fedprllm", "train.masks")
    assert (tmp_path / "state" / "ledger.json").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700


def test_fedcompress_ledger_prints_a_sites_ledger(tmp_path, monkeypatch, capsys):
    from typer.testing import CliRunner

    from fedcompress.cli import app, main

    ledger = Ledger(tmp_path, 32.0)
    ledger.dp_sgd("7", "privytune", "train.dplora", mechanism(), STEPS)
    ledger.not_dp("8", "fedprllm", "train.masks")
    ledger.text("9", "ppcgpt", "query.perturb", 3.0, 8.0)
    result = CliRunner().invoke(app, ["ledger", "--state-dir", str(tmp_path)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for text in ("privytune", "fedprllm", "ppcgpt", "none (not DP)", "1 dp-sgd",
                 "lifetime epsilon spent", "of 32"):
        assert text in result.output, result.output
    as_json = CliRunner().invoke(app, ["ledger", "--state-dir", str(tmp_path), "--json"])
    assert json.loads(as_json.output)["runs"]["9"]["epsilon"] == 3.0
    (tmp_path / "ledger.json").write_text("{broken")
    monkeypatch.setattr(sys, "argv", ["fedcompress", "ledger", "--state-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2 and "cannot be read" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["fedcompress", "ledger", "--state-dir",
                                      str(tmp_path / "none")])
    with pytest.raises(SystemExit):
        main()
    assert "no ledger.json there" in capsys.readouterr().err
