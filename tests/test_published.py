"""Published numbers cannot drift from their results (tools/published.py).

The first test is the check itself on the repository: every span in README.md and docs/ equals
the value its committed result gives, cites only current results (a command, a commit, a clean
tree, no later change to the code it depends on), no page holds a measured-looking number outside
a span, and the generated result pages are up to date. The others check the checker."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    path = ROOT / "tools" / "published.py"
    spec = importlib.util.spec_from_file_location("fedcompress_published", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


pub = _tool()

#: A shallow clone has no history to tell a stale result by: its values are still checked, and
#: the tests that need the history say why they do not run.
SHALLOW = pub.shallow_clone()
needs_history = pytest.mark.skipif(SHALLOW, reason=pub.SHALLOW_NOTE)


def test_published_numbers_equal_their_results():
    """Every span equals its result's value and every figure set its results' plots (in any
    clone); with the history, no cited result is stale and the result pages are current."""
    problems = pub.run(write=False, history=not SHALLOW)
    more = f"\n... {len(problems)} in all" if len(problems) > 40 else ""
    assert not problems, "\n".join(problems[:40]) + more


def test_a_shallow_clone_checks_the_values_and_says_why_not_the_staleness(tmp_path):
    """`published.py --check` in a clone of depth 1: the values are checked (exit 0 here), and
    it says that staleness needs the history and how to fetch it; --write is refused."""
    import subprocess

    clone = tmp_path / "shallow"
    subprocess.run(["git", "clone", "--quiet", "--depth", "1", f"file://{ROOT}", str(clone)],
                   check=True, capture_output=True)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip() == head
    check = subprocess.run([sys.executable, "tools/published.py", "--check"], cwd=clone,
                           capture_output=True, text=True, timeout=600)
    assert "shallow clone" in check.stderr and "git fetch --unshallow" in check.stderr
    assert check.returncode == 0, check.stderr[-3000:]
    write = subprocess.run([sys.executable, "tools/published.py", "--write"], cwd=clone,
                           capture_output=True, text=True, timeout=600)
    assert write.returncode == 2 and "shallow clone" in write.stderr


def test_readme_is_short_and_cites_generated_numbers():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert len(pub.SPAN.findall(text)) >= 5


def _results(tmp_path, reports):
    for name, report in reports.items():
        (tmp_path / "results" / name).mkdir(parents=True)
        (tmp_path / "results" / name / "report.json").write_text(json.dumps(report))
    return tmp_path / "results"


def _report(commit="abc1234", **extra):
    report = {"reproduce": "python simulations/x.py --out simulations/results/x",
              "versions": {"git_commit": commit},
              "results": [{"name": "a", "perplexity": 48.16942},
                          {"name": "b", "perplexity": 47.9235}],
              "summary": {"qwen2.5-0.5b": {"ratio": 0.3634}}}
    report.update(extra)
    return report


def _numbers(tmp_path, table, reports):
    results = _results(tmp_path, reports)
    (tmp_path / "numbers.toml").write_text(table)
    return pub.Numbers(tmp_path / "numbers.toml", results)


TABLE = '''
[result.x]
depends = ["tools/published.py"]
unaffected = ["HEADCOMMIT: checked"]

["x.a"]
result = "x"
value = "results[name=a].perplexity"
format = "{:.2f}"

["x.ratio"]
result = "x"
value = "summary['qwen2.5-0.5b'].ratio"
format = "{:.3f}x"

["x.diff"]
result = "x"
expr = """v("results[name=a].perplexity") - v("results[1].perplexity")"""
format = "{:.3f}"
'''


def test_values_by_name_index_quoted_key_and_expression(tmp_path, monkeypatch):
    monkeypatch.setattr(pub, "stale_since", lambda *a, **k: "")
    numbers = _numbers(tmp_path, TABLE, {"x": _report()})
    assert numbers.value("x.a") == ("48.17", ["x"])
    assert numbers.value("x.ratio")[0] == "0.363x"
    assert numbers.value("x.diff")[0] == "0.246"
    page = "ppl <!--n:x.a-->50.00<!--/n--> and <!--n:x.ratio-->?<!--/n-->"
    text, problems = pub.write_spans(numbers, page, "p")
    assert text == "ppl <!--n:x.a-->48.17<!--/n--> and <!--n:x.ratio-->0.363x<!--/n-->"
    assert problems == []


def test_unknown_key_and_missing_path_are_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(pub, "stale_since", lambda *a, **k: "")
    bad = '\n["x.bad"]\nresult = "x"\nvalue = "results[name=zz].perplexity"\n'
    numbers = _numbers(tmp_path, TABLE + bad, {"x": _report()})
    page = "<!--n:x.nope-->1<!--/n--> <!--n:x.bad-->1<!--/n-->"
    _, problems = pub.write_spans(numbers, page, "p")
    assert any("'x.nope' is not defined" in p for p in problems)
    assert any("[name=zz] matches 0 elements" in p for p in problems)


def test_a_dirty_or_commandless_or_undeclared_result_cannot_be_cited(tmp_path, monkeypatch):
    monkeypatch.setattr(pub, "stale_since", lambda *a, **k: "")
    table = TABLE + '\n["y.a"]\nresult = "y"\nvalue = "results[name=a].perplexity"\n'
    dirty = _numbers(tmp_path / "d", TABLE, {"x": _report(commit="abc1234+dirty")})
    _, problems = pub.write_spans(dirty, "<!--n:x.a-->48.17<!--/n-->", "p")
    assert any("dirty tree (abc1234+dirty)" in p for p in problems)
    no_command = _report()
    del no_command["reproduce"]
    numbers = _numbers(tmp_path / "c", table, {"x": no_command, "y": _report()})
    page = "<!--n:x.a-->48.17<!--/n--> <!--n:y.a-->48.169<!--/n-->"
    _, problems = pub.write_spans(numbers, page, "p")
    assert any("records no command" in p for p in problems)
    assert any("'y' declares no 'depends'" in p for p in problems)
    assert numbers.state("y") == "unchecked"


def test_untracked_code_in_what_a_result_depends_on_makes_it_dirty(tmp_path, monkeypatch):
    """An untracked file recorded at the run's start counts when it lies in a declared path or
    among the files the run imported; elsewhere (a draft page) it does not."""
    monkeypatch.setattr(pub, "stale_since", lambda *a, **k: "")
    reports = {"x": _report(untracked=["tools/published_draft.py", "docs/draft.md"],
                            imported=["fedcompress/new.py"]),
               "y": _report(untracked=["docs/draft.md"]),
               "z": _report(untracked=["fedcompress/new.py"], imported=["fedcompress/new.py"])}
    table = TABLE.replace('depends = ["tools/published.py"]', 'depends = ["tools"]')
    table += '\n[result.y]\ndepends = ["tools"]\n[result.z]\ndepends = ["tools"]\n'
    numbers = _numbers(tmp_path, table, reports)
    assert any("untracked files in what it depends on (tools/published_draft.py)" in p
               for p in numbers.result_problems("x"))
    assert numbers.state("x") == "dirty"
    assert numbers.result_problems("y") == [] and numbers.state("y") == "current"
    assert numbers.state("z") == "dirty"  # untracked and imported
    assert numbers.depends("x") == ["tools", "fedcompress/new.py"]


def test_a_result_made_from_a_result_that_may_not_be_cited_may_not_be_cited(tmp_path,
                                                                              monkeypatch):
    """A current result whose command reads another result (simulations/results/NAME) is only
    as citable as that one: a page may not quote a stale result through a current one."""
    monkeypatch.setattr(pub, "stale_since",
                        lambda res, depends, unaffected=(): "commit abc" if res.name == "old"
                        else "")
    reports = {"old": _report(),
               "new": _report(reproduce="python simulations/q.py --llmc-report "
                                        "simulations/results/old/report.json"),
               "self": _report(reproduce="python x.py --out simulations/results/self")}
    table = TABLE + "".join(f'\n[result.{n}]\ndepends = ["tools"]\n' for n in reports)
    numbers = _numbers(tmp_path, table, reports)
    assert any("older than the code" in p for p in numbers.result_problems("old"))
    assert numbers.result_problems("new") == [
        "result 'new' was made from result 'old', which may not be cited"]
    assert numbers.state("new") == "stale"
    assert numbers.result_problems("self") == []  # its own folder is not another result


@needs_history
def test_imported_files_count_like_declared_ones():
    """A commit touching a file the run imported makes the result stale, as a declared path
    would."""
    path = "tests/test_published.py"
    last = pub.git("log", "-1", "--format=%H", "--", path)
    before = pub.git("rev-parse", "--short", f"{last}~1")
    old = pub.Result("old", {"versions": {"git_commit": before}, "imported": [path]})
    numbers = pub.Numbers()
    numbers._results["old"] = old
    numbers.results_meta["old"] = {"depends": ["docs/nothing-here.md"]}
    assert numbers.depends("old") == ["docs/nothing-here.md", path]
    assert any(f"commit {last[:10]}" in p for p in numbers.result_problems("old"))


@needs_history
def test_a_result_older_than_its_code_is_stale():
    """Against this repository's history: a result made just before the last commit that changed
    this file is stale for it, unless every later change is listed as unaffected; one made at
    HEAD is not."""
    path = "tests/test_published.py"
    last = pub.git("log", "-1", "--format=%H", "--", path)
    assert last, f"{path} has no commit in this clone's history"
    before = pub.git("rev-parse", "--short", f"{last}~1")
    old = pub.Result("old", {"versions": {"git_commit": before}})
    assert pub.stale_since(old, [path]).startswith(f"commit {last[:10]}")
    later = pub.git("log", "--format=%H", f"{before}..HEAD", "--", path).split()
    assert pub.stale_since(old, [path], [f"{h[:10]}: checked" for h in later]) == ""
    head = pub.Result("new", {"versions": {"git_commit": pub.git("rev-parse", "--short", "HEAD")}})
    assert pub.stale_since(head, [path]) == ""


@pytest.mark.parametrize("text, found", [
    ("perplexity 48.17 against", ["48.17"]),
    ("a ratio of 1.22x here", ["1.22x"]),
    ("took 474 s and 2.5 s", ["474 s", "2.5 s"]),
    ("13.3 MB per site", ["13.3 MB"]),
    ("0.02% of the clean vote", ["0.02%"]),
    ("Wanda 50%, 16 sites x 4 windows of 256 tokens", []),
    ("Flower 1.42 and python 3.11, flwr==1.42.0", []),
    ("in code `48.17` or <!--n:k-->48.17<!--/n-->", []),
    ("```\n48.17 s\n```\n", []),
    ("[link](results/x-1.22x.md)", []),
    ("make test: 1,982 passed, 4 skipped", ["1,982 passed", "4 skipped"]),
    ("a ledger of 10,000 releases and 12,345 bytes", ["12,345"]),
    ("it ran twice as fast, three times slower", ["twice as fast", "three times slower"]),
    ("the same vote twice; the Hessian's diagonal is twice the square sums", []),
    ("3,000 of 1,024", ["3,000"]),
    ("took 17 minutes, 2.5 CPU seconds and about two hours", ["17 minutes", "2.5 CPU seconds",
                                                              "two hours"]),
    ("within five percent, twenty-one seconds, 12 megabytes", ["five percent",
                                                               "twenty-one seconds",
                                                               "12 megabytes"]),
    ("Ray waits a fixed 30 seconds; 4 bytes a float; one site, two rounds", []),
])
def test_measured_looking_numbers_are_found_outside_spans_and_code(text, found):
    assert pub.typed_numbers(text) == found


def test_a_figure_set_is_what_its_results_draw_byte_for_byte(tmp_path, monkeypatch):
    """``[figure.NAME]``: ``--write`` draws ``fedcompress report --compare``'s plots of its runs
    into docs/img/NAME; the check fails when a file differs, is missing or is left over, and
    when a run may not be cited."""
    monkeypatch.setattr(pub, "stale_since", lambda *a, **k: "")

    def bench(sparsity, central):
        return _report(command="bench", results=[
            {"name": "dense", "kind": "dense", "model": "m", "perplexity": 20.0},
            {"name": "centralized", "method": "wanda", "model": "m", "sparsity": sparsity,
             "perplexity": central}])

    table = TABLE + """
[result.y]
depends = ["tools/published.py"]

[figure.peers]
runs = ["x", "y"]
"""
    numbers = _numbers(tmp_path, table, {"x": bench(0.5, 40.0), "y": bench(0.7, 90.0)})
    img = tmp_path / "img"
    (img / "peers").mkdir(parents=True)
    (img / "peers" / "old.png").write_bytes(b"left over")
    assert pub.check_figures(numbers, write=True, figures=img) == []
    assert sorted(p.name for p in (img / "peers").iterdir()) == ["perplexity-m-wanda.png"]
    assert pub.check_figures(numbers, write=False, figures=img) == []
    # the same bytes as the command line's --figures
    from fedcompress.report_html import render_compare

    render_compare([numbers.results_dir / "x", numbers.results_dir / "y"], tmp_path / "cli")
    assert ((tmp_path / "cli" / "perplexity-m-wanda.png").read_bytes()
            == (img / "peers" / "perplexity-m-wanda.png").read_bytes())
    (img / "peers" / "perplexity-m-wanda.png").write_bytes(b"edited by hand")
    (img / "peers" / "extra.png").write_bytes(b"?")
    problems = pub.check_figures(numbers, write=False, figures=img)
    assert any("perplexity-m-wanda.png: differs from what its runs draw" in p for p in problems)
    assert any("extra.png: not drawn from its runs any more" in p for p in problems)
    # a set removed from the table leaves no plots behind
    (img / "gone").mkdir()
    (img / "gone" / "perplexity-m-wanda.png").write_bytes(b"?")
    assert any("docs/img/gone/: no [figure.gone]" in p
               for p in pub.check_figures(numbers, write=False, figures=img))
    pub.check_figures(numbers, write=True, figures=img)
    assert not (img / "gone").exists()
    # a misspelt run, and a set that draws nothing, are named
    typo = _numbers(tmp_path / "t", table.replace('"y"]', '"z"]'), {"x": bench(0.5, 40.0),
                                                                    "y": bench(0.7, 90.0)})
    assert any("figure set 'peers': run 'z'" in p
               for p in pub.check_figures(typo, write=False, figures=img))
    flat = _numbers(tmp_path / "f", table, {"x": bench(0.5, 40.0), "y": bench(0.5, 41.0)})
    assert any("draw no plot" in p for p in pub.check_figures(flat, write=False, figures=img))
    # a dirty run may not be drawn either
    dirty = _numbers(tmp_path / "d", table, {"x": bench(0.5, 40.0),
                                             "y": _report(commit="abc1234+dirty", command="bench")})
    assert any("figure set 'peers': result 'y' was made from a dirty tree" in p
               for p in pub.check_figures(dirty, write=True, figures=tmp_path / "img2"))
