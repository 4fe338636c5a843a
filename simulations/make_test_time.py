"""The README's two commands as a new user runs them: a fresh clone, make install, make test.

    python simulations/make_test_time.py --out simulations/results/make-test

Clones this repository at its HEAD (``--source``, default: the checkout the script is in) into
a temporary folder, runs ``make install`` and then ``make test`` there (the same target CI runs
through ``.ci/run``), and records each command's wall time, its exit status and pytest's summary
(passed, failed, skipped), with the load average before and after. A timing measurement: run
it on an idle machine, alone. pip's cache is the user's (a warm cache makes ``make install``
fast; the time says which) unless ``--no-pip-cache``, which sets ``PIP_NO_CACHE_DIR=1`` for
every command, so ``make install`` downloads every package as on a new machine. Writes
``report.json``, ``report.md`` and ``config.toml`` to ``--out``; the clone is removed at the
end unless ``--keep``.

``--targets install,demo,test`` times ``make demo`` too (the README's first command; after
``make install`` it is the demo's job alone) and copies the demo's ``report.json`` and
``report.md`` into ``--out``/demo, so the README can quote what the demo printed and how long
it took, from this result. ``--targets install,test,deploy-test`` times ``make deploy-test``
too, after the two (the deployment in real containers: the image of the clone, built with
Docker's layer cache of this machine, then tests/test_containers.py; root and a running Docker
engine needed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from fedcompress.report import RunReport, markdown_table

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def pytest_summary(output: str) -> dict[str, int]:
    """Counts of pytest's last summary line (``1585 passed, 1 skipped in ...``)."""
    lines = [line for line in output.splitlines() if " in " in line and "passed" in line]
    counts: dict[str, int] = {}
    for number, word in SUMMARY.findall(lines[-1] if lines else ""):
        counts[word.rstrip("s") if word.startswith("error") else word] = int(number)
    return counts


#: At most this many characters of pytest's failure sections are kept in the report.
FAILURES_LIMIT = 20000
_SECTION = re.compile(r"^=+ (FAILURES|ERRORS) =+$", re.M)
_SECTION_END = re.compile(r"^=+ (warnings summary|short test summary info)|^=+ \d+ (passed|failed)",
                          re.M)


def failure_sections(output: str, limit: int = FAILURES_LIMIT) -> str:
    """pytest's FAILURES and ERRORS sections (each failed test's traceback and message), which
    the log's tail, behind the warnings summary, does not reach; at most ``limit`` characters,
    the first ones (empty when pytest printed none)."""
    start = _SECTION.search(output)
    if start is None:
        return ""
    end = _SECTION_END.search(output, start.end())
    text = output[start.start():end.start() if end else len(output)]
    return text if len(text) <= limit else text[:limit] + "\n[... cut]"


_DURATIONS = re.compile(r"^=+ slowest \d+ durations =+$", re.M)
_DURATION = re.compile(r"^(\d+\.\d+)s (call|setup|teardown)\s+(\S+)$", re.M)


def slowest_durations(output: str) -> list[dict]:
    """pytest's ``--durations`` section: ``[{"seconds", "when", "test"}]``, slowest first."""
    start = _DURATIONS.search(output)
    if start is None:
        return []
    return [{"seconds": float(s), "when": when, "test": test}
            for s, when, test in _DURATION.findall(output[start.end():].split("\n=", 1)[0])]


def timed(report: RunReport, name: str, argv: list[str], cwd: Path, log: Path,
          no_pip_cache: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if no_pip_cache:
        env["PIP_NO_CACHE_DIR"] = "1"
    start = time.perf_counter()
    with report.phase(name), log.open("w") as out:
        code = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                              env=env).returncode
    seconds = time.perf_counter() - start
    record = {"name": name, "command": " ".join(argv), "exit_status": code, "seconds": seconds,
              "load_average_after": list(os.getloadavg())}
    if name in ("make test", "make deploy-test"):
        output = log.read_text(errors="replace")
        record.update(pytest_summary(output))
        slowest = slowest_durations(output)
        if slowest:
            report.extra.setdefault("slowest", {})[name] = slowest
    report.add_result(record)
    return record


def keep_demo(run: Path, dest: Path) -> dict:
    """Copy the demo's report (JSON and Markdown) from the clone into the result; return what
    the README quotes of it (its results, phases and command), kept in this result's own
    report under ``demo``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("report.json", "report.md"):
        shutil.copyfile(run / name, dest / name)
    demo = json.loads((run / "report.json").read_text())
    return {key: demo.get(key) for key in ("command_line", "status", "results", "timings")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", default=str(ROOT), help="repository to clone (its HEAD)")
    parser.add_argument("--out", default="simulations/results/make-test")
    parser.add_argument("--keep", action="store_true", help="keep the clone (path in the report)")
    parser.add_argument("--targets", default="install,test",
                        help="make targets, in order (default install,test; deploy-test: the "
                             "containers too; demo: the README's first command)")
    parser.add_argument("--no-pip-cache", action="store_true",
                        help="set PIP_NO_CACHE_DIR=1 for every command: make install downloads "
                             "every package, as on a new machine")
    opts = parser.parse_args()
    targets = [t.strip() for t in opts.targets.split(",") if t.strip()]
    known = ("install", "demo", "test", "deploy-test")
    if not targets or any(t not in known for t in targets):
        parser.error(f"--targets {opts.targets!r}: expected a comma-separated list of {known}")
    work = Path(tempfile.mkdtemp(prefix="fedcompress-clone-"))
    clone = work / "fedcompress"
    with RunReport.for_script(__file__, opts) as report:
        try:
            subprocess.run(["git", "clone", "--quiet", opts.source, str(clone)], check=True)
            head = subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"],
                                  capture_output=True, text=True, check=True).stdout.strip()
            report.extra["clone_commit"] = head
            records = []
            for name in (f"make {t}" for t in targets):
                records.append(timed(report, name, name.split(), clone, work / f"{name[5:]}.log",
                                     opts.no_pip_cache))
                if records[-1]["exit_status"] != 0:
                    output = (work / f"{name[5:]}.log").read_text(errors="replace")
                    tail = output[-3000:]
                    report.extra["failure_tail"] = tail
                    report.extra["failures"] = failure_sections(output)
                    raise SystemExit(f"{name} failed (exit {records[-1]['exit_status']}):\n{tail}")
                if name == "make demo":
                    report.extra["demo"] = keep_demo(clone / "runs" / "demo",
                                                     Path(opts.out) / "demo")
                    report.write()
            rows = [[r["name"], f"{r['seconds'] / 60:.1f}", str(r["exit_status"]),
                     f"{r['load_average_after'][0]:.2f}"] for r in records]
            said = [f"`{r['name']}`: pytest reported {r.get('passed', 0)} passed, "
                    f"{r.get('failed', 0)} failed, {r.get('skipped', 0)} skipped"
                    for r in records if "passed" in r or "failed" in r]
            report.sections.append(("A new user's commands", markdown_table(
                ["command", "minutes", "exit", "load (1 min) after"], rows) + (
                f"\n\nIn a fresh clone of {head}: " + "; ".join(said) + ".")))
        finally:
            if opts.keep:
                report.extra["clone"] = str(clone)
            else:
                shutil.rmtree(work, ignore_errors=True)
    report.print_table()


if __name__ == "__main__":
    main()
