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


@pytest.mark.parametrize("content", ["{not json\n", '{"format": "other"}\n', "", "[]\n"])
def test_corrupted_ledger_is_an_error_never_a_reset(tmp_path, content):
    ledger = Ledger(tmp_path, 32.0)
    ledger.text("1", "ppcgpt", "query.perturb", 3.0, 8.0)
    (tmp_path / "ledger.jsonl").write_text(content)
    for reader in (ledger, Ledger(tmp_path, 32.0)):  # the same process, and a new one
        with pytest.raises(LedgerError, match="refusing to release anything"):
            reader.text("1", "ppcgpt", "query.perturb", 3.0, 8.0)
    assert (tmp_path / "ledger.jsonl").read_text() == content  # left for the operator


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
    for name in ("ledger.jsonl", "ledger.head"):
        assert (tmp_path / "state" / name).stat().st_mode & 0o777 == 0o600
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
                 "lifetime epsilon spent", "of 32", "journal intact: 3 releases"):
        assert text in result.output, result.output
    as_json = CliRunner().invoke(app, ["ledger", "--state-dir", str(tmp_path), "--json"])
    assert json.loads(as_json.output)["runs"]["9"]["epsilon"] == 3.0
    (tmp_path / "ledger.jsonl").write_text("{broken\n")
    monkeypatch.setattr(sys, "argv", ["fedcompress", "ledger", "--state-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2 and "not a journal line" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["fedcompress", "ledger", "--state-dir",
                                      str(tmp_path / "none")])
    with pytest.raises(SystemExit):
        main()
    assert "no ledger.jsonl there" in capsys.readouterr().err


# -- the journal: truncation, rollback, edits, deletion, a dead writer -------------------------


def _spent_ledger(path, anchor=None) -> Ledger:
    ledger = Ledger(path, 32.0, anchor=anchor)
    for run in range(4):
        ledger.text(str(run), "ppcgpt", "query.perturb", 2.0, 8.0)
    return ledger


def _lines(path) -> list[bytes]:
    return (path / "ledger.jsonl").read_bytes().splitlines(keepends=True)


def test_a_truncated_journal_is_refused_by_the_process_and_by_a_new_one(tmp_path):
    ledger = _spent_ledger(tmp_path)
    (tmp_path / "ledger.jsonl").write_bytes(b"".join(_lines(tmp_path)[:-2]))  # 2 releases gone
    with pytest.raises(LedgerError, match="shrank"):
        ledger.text("9", "ppcgpt", "query.perturb", 2.0, 8.0)
    with pytest.raises(LedgerError, match="ends at release 2 but its head .* records release 4"):
        Ledger(tmp_path, 32.0).text("9", "ppcgpt", "query.perturb", 2.0, 8.0)
    with pytest.raises(LedgerError, match="truncated or rolled back"):
        Ledger(tmp_path, 32.0).read()


def test_a_rolled_back_state_folder_is_refused_while_the_agent_runs_and_by_the_anchor(
        tmp_path):
    """An older copy of the whole state folder (journal and head) restored over it: consistent
    in itself, so only what the agent read already, or an anchor kept elsewhere, can tell."""
    state, anchor = tmp_path / "state", tmp_path / "elsewhere" / "ledger.anchor"
    anchor.parent.mkdir()
    ledger = Ledger(state, 32.0, anchor=anchor)
    ledger.text("1", "ppcgpt", "query.perturb", 8.0, 8.0)
    backup = {p.name: p.read_bytes() for p in state.iterdir() if p.is_file()}
    ledger.text("2", "ppcgpt", "query.perturb", 8.0, 8.0)
    ledger.text("3", "ppcgpt", "query.perturb", 8.0, 8.0)
    for name, content in backup.items():  # the rollback: 16 of epsilon "unspent"
        (state / name).write_bytes(content)
    with pytest.raises(LedgerError, match="shrank"):  # the running agent
        ledger.text("4", "ppcgpt", "query.perturb", 8.0, 8.0)
    with pytest.raises(LedgerError, match=r"its anchor .* records release 3: truncated or "
                                          "rolled back"):  # a restarted one
        Ledger(state, 32.0, anchor=anchor).text("4", "ppcgpt", "query.perturb", 8.0, 8.0)
    # the same rollback without an anchor is not detected by a new process (documented)
    assert Ledger(state, 32.0).read()["seq"] == 1


@pytest.mark.parametrize("attack", ["edit", "delete-line", "insert", "swap"])
def test_an_edited_journal_breaks_the_chain(tmp_path, attack):
    _spent_ledger(tmp_path)
    lines = _lines(tmp_path)
    if attack == "edit":  # run 1's epsilon set back to 0
        lines[2] = lines[2].replace(b'"epsilon":2.0', b'"epsilon":0.0')
    elif attack == "delete-line":
        del lines[2]
    elif attack == "insert":
        lines.insert(2, lines[1])
    else:
        lines[1], lines[2] = lines[2], lines[1]
    (tmp_path / "ledger.jsonl").write_bytes(b"".join(lines))
    with pytest.raises(LedgerError, match="hash chain is broken|does not follow|differs"):
        Ledger(tmp_path, 32.0).text("9", "ppcgpt", "query.perturb", 2.0, 8.0)


def test_a_deleted_journal_or_head_is_refused(tmp_path):
    _spent_ledger(tmp_path)
    (tmp_path / "ledger.head").unlink()
    with pytest.raises(LedgerError, match="its head .* is missing while the journal holds 4"):
        Ledger(tmp_path, 32.0).not_dp("9", "fedprllm", "train.masks")
    _spent_ledger(tmp_path / "b")
    (tmp_path / "b" / "ledger.jsonl").unlink()
    with pytest.raises(LedgerError, match="the journal is missing while its head"):
        Ledger(tmp_path / "b", 32.0).not_dp("9", "fedprllm", "train.masks")
    ledger = _spent_ledger(tmp_path / "c")
    (tmp_path / "c" / "ledger.jsonl").unlink()
    (tmp_path / "c" / "ledger.head").unlink()
    with pytest.raises(LedgerError, match="the journal this process read is gone"):
        ledger.not_dp("9", "fedprllm", "train.masks")


def test_another_journal_with_its_own_head_is_refused_by_the_anchor(tmp_path):
    anchor = tmp_path / "anchor"
    _spent_ledger(tmp_path / "state", anchor=anchor)
    for name in ("ledger.jsonl", "ledger.head"):
        (tmp_path / "state" / name).unlink()
    Ledger(tmp_path / "fresh", 32.0).not_dp("1", "fedprllm", "train.masks")
    for name in ("ledger.jsonl", "ledger.head"):  # a fresh, consistent journal put in place
        (tmp_path / "state" / name).write_bytes((tmp_path / "fresh" / name).read_bytes())
    with pytest.raises(LedgerError, match="its anchor .* belongs to another journal"):
        Ledger(tmp_path / "state", 32.0, anchor=anchor).read()


def test_a_writer_that_died_mid_append_or_before_its_head(tmp_path):
    ledger = _spent_ledger(tmp_path)
    head = (tmp_path / "ledger.head").read_bytes()
    ledger.text("4", "ppcgpt", "query.perturb", 2.0, 8.0)
    (tmp_path / "ledger.head").write_bytes(head)  # died after its append, before its head
    with open(tmp_path / "ledger.jsonl", "ab") as f:  # and the next one died mid-append
        f.write(b'{"prev":"00","release":{"kind":"not-dp"')
    grant = Ledger(tmp_path, 32.0).text("5", "ppcgpt", "query.perturb", 2.0, 8.0)
    assert grant.lifetime_epsilon == 12.0  # five runs at 2 and this one: the torn line cut off
    data = Ledger(tmp_path, 32.0).read()
    assert data["seq"] == 6 and json.loads((tmp_path / "ledger.head").read_text())["seq"] == 6


def test_recording_appends_one_line_whatever_the_ledgers_size(tmp_path):
    ledger = Ledger(tmp_path, 1e9)
    sizes = []
    for i in range(300):
        before = (tmp_path / "ledger.jsonl").stat().st_size if i else 0
        ledger.not_dp(f"run-{i % 7}", "fedprllm", "train.masks")
        sizes.append((tmp_path / "ledger.jsonl").stat().st_size - before)
    assert max(sizes[10:]) - min(sizes[10:]) < 40  # the run's counters grow by a few digits
    assert len(Ledger(tmp_path, 1e9).read()["releases"]) == 300


def test_an_older_whole_file_ledger_is_imported_once(tmp_path):
    legacy = {"format": "fedcompress-ledger/1",
              "runs": {"1": {"method": "ppcgpt", "started": "2026-01-01T00:00:00",
                             "epsilon": 6.0, "delta": 0.0, "steps": 0, "text_epsilon": 6.0,
                             "releases": 2}},
              "releases": [{"run": "1", "kind": "exponential-mechanism", "epsilon": 3.0}] * 2}
    (tmp_path / "ledger.json").write_text(json.dumps(legacy))
    assert Ledger(tmp_path, 32.0).read()["runs"]["1"]["epsilon"] == 6.0  # reading imports nothing
    from typer.testing import CliRunner

    from fedcompress.cli import app

    shown = CliRunner().invoke(app, ["ledger", "--state-dir", str(tmp_path)],
                               env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "an older ledger.json, imported" in shown.output
    grant = Ledger(tmp_path, 32.0).text("1", "ppcgpt", "query.perturb", 2.0, 8.0)
    assert grant.run_epsilon == 8.0 and grant.lifetime_epsilon == 8.0
    assert not (tmp_path / "ledger.json").exists() and (tmp_path / "ledger.v1.json").exists()
    data = Ledger(tmp_path, 32.0).read()
    assert [r["kind"] for r in data["releases"]] == ["exponential-mechanism"] * 2 + [
        "import", "exponential-mechanism"]


# -- one release per input: differencing across runs, one-shot against per-layer ----------------


def test_a_second_run_on_the_same_input_is_refused(tmp_path):
    """Three SecAgg+ votes in fresh runs over the pairs {0,1}, {1,2}, {0,2} give every site's
    vote by differencing: each site answers the first run on an input only."""
    ledger = Ledger(tmp_path, 32.0)
    ledger.input_release("1", "fedprllm", "train.secagg_masks", "k" * 64, -1, 1)
    with pytest.raises(PolicyError, match=r"in 1 run\(s\), its bound \(node config "
                                          r"runs-per-input=1\)"):
        ledger.input_release("2", "fedprllm", "train.secagg_masks", "k" * 64, -1, 1)
    ledger.input_release("2", "fedprllm", "train.secagg_masks", "other" * 8, -1, 1)  # new input
    allowing = Ledger(tmp_path / "b", 32.0)  # a site that allows two runs per input
    for run in ("1", "2"):
        allowing.input_release(run, "fedprllm", "train.masks", "k" * 64, -1, 2)
    with pytest.raises(PolicyError, match="runs-per-input=2"):
        allowing.input_release("3", "fedprllm", "train.masks", "k" * 64, -1, 2)
    assert Ledger(tmp_path, 32.0).read()["inputs"]["k" * 64]["runs"] == ["1"]


@pytest.mark.parametrize("first, second", [(-1, 0), (0, -1), (3, 3), (-1, -1)])
def test_one_shot_and_per_layer_releases_of_one_input_in_one_run_are_refused(tmp_path, first,
                                                                              second):
    """A one-shot vote and the iterative layer-0 vote share their first layer's input; a
    layer twice in one run is a double request (clear masks after a secure vote included:
    the input is the same whichever way it leaves)."""
    ledger = Ledger(tmp_path, 32.0)
    ledger.input_release("1", "fedprllm", "train.secagg_masks", "k" * 64, first, 5)
    with pytest.raises(PolicyError, match="already released"):
        ledger.input_release("1", "fedprllm", "train.masks", "k" * 64, second, 5)
    if -1 not in (first, second):  # another layer of the run is still answered
        ledger.input_release("1", "fedprllm", "train.layer_mask", "k" * 64, 7, 5)
    data = Ledger(tmp_path, 32.0).read()
    assert [r["kind"] for r in data["releases"]].count("input") in (1, 2)


def test_the_lifetime_delta_is_bounded(tmp_path):
    """A new run id per round keeps the lifetime epsilon bounded; the deltas add up too."""
    ledger = Ledger(tmp_path, 1e6, lifetime_delta=2.5e-5)
    for run in ("1", "2"):
        ledger.dp_sgd(run, "privytune", "train.dplora", mechanism(), STEPS)
    with pytest.raises(PolicyError, match=r"lifetime delta to 3e-05, above its bound "
                                          r"lifetime-delta=2.5e-05"):
        ledger.dp_sgd("3", "privytune", "train.dplora", mechanism(), STEPS)
    assert ledger.dp_sgd("2", "privytune", "train.dplora", mechanism(), STEPS)  # same run


def test_releases_that_are_not_dp_are_bounded_per_run(tmp_path):
    """Scores, accuracies, cosines: a server asking again and again gets the site's bound."""
    ledger = Ledger(tmp_path, 32.0)
    for _ in range(3):
        ledger.not_dp("1", "privytune", "query.cosines", limit=3)
    with pytest.raises(PolicyError, match="made 3 releases that are not DP.*"
                                          "non-dp-releases-per-run=3"):
        ledger.not_dp("1", "privytune", "query.cosines", limit=3)
    ledger.not_dp("2", "privytune", "query.cosines", limit=3)  # another run
    assert Ledger(tmp_path, 32.0).read()["runs"]["1"]["not_dp"] == 3
