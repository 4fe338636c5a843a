"""Published numbers, generated from the committed results (``simulations/results/*/report.json``).

Every measured number in ``README.md`` and ``docs/*.md`` is either

* a **span** ``<!--n:KEY-->TEXT<!--/n-->``, whose TEXT this tool writes from the value that
  ``docs/numbers.toml`` names for KEY (a result folder, a path into its ``report.json``, a
  format), or
* inside a **generated result page** (``docs/results/<name>.md``, which includes the result's own
  ``report.md``: the tables a run wrote).

``python tools/published.py --write`` rewrites every span and the result pages;
``python tools/published.py --check`` (run by ``tests/test_published.py``, so by ``make test``)
fails
when

* a span's text differs from its value, or names a key the table does not define;
* a span's result has no command to reproduce it, no commit, was made from a tree with
  uncommitted changes (``+dirty``), or is older than the code it describes (a commit after the
  result's touched one of the paths the result ``depends`` on);
* a result page is missing or differs from what the results give;
* a page holds a measured-looking number (a decimal with a unit, a ratio such as ``1.22x``, a
  perplexity-like ``48.17``) outside a span, a code block or a result page;
* a **figure set** (``[figure.NAME]`` in ``docs/numbers.toml``: the plots of
  ``fedcompress report --compare RUNS --figures docs/img/NAME``) differs, byte for byte, from
  what the committed results draw now, or one of its runs may not be cited.

Results that are dirty or stale stay in the repository, marked as such on their page and in the
results index; no span may cite them.

The path syntax of a value: dotted keys into ``report.json``, ``[3]`` for a list index and
``[name=wanda-stats]`` for the element of a list whose ``name`` (or any other field) equals the
text. A value may instead be an ``expr``: a Python arithmetic expression over ``v("path")``
(and ``v("path", "other-result")``), for ratios and differences.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "simulations" / "results"
TABLE = ROOT / "docs" / "numbers.toml"
RESULT_PAGES = ROOT / "docs" / "results"
FIGURES = ROOT / "docs" / "img"
FIX = "run python tools/published.py --write"
SPAN = re.compile(r"<!--n:([A-Za-z0-9_.-]+)-->(.*?)<!--/n-->", re.S)

# A measured-looking number: with a unit or a ratio sign, or a decimal with two or more places
# (perplexities, seconds). Round configuration values ("50%", "16 sites", "4 windows") are
# settings, not measurements; a decimal percentage or ratio is a measurement.
MEASURED = re.compile(
    r"(?<![\w.^/-])(?<!Flower\s)(?<!flwr\s)(?<!Python )(?<!python )(?<!torch )(?<!version )("
    r"\d+\.\d+\s?(?:%|x\b|×|s\b|ms\b|min\b|h\b|kB|MB|MiB|GB|GiB|GB/s|bits?\b)"
    r"|\d+(?:\.\d+)?x(?=[\s,;:.)])"
    r"|\d+\.\d{2,}(?![\d.])"
    r"|\d+\s?(?:ms|s|min|h|MiB|GiB|kB|MB|GB)\b"
    r")"
)


QUOTED = re.compile(r"simulations/results/([A-Za-z0-9][A-Za-z0-9._-]*)")


def under(path: str, paths: list[str]) -> bool:
    """Whether ``path`` is one of ``paths`` or lies in one of them (folders)."""
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in paths)


class NumbersError(Exception):
    """A span, a result or a page that does not agree with the committed results."""


@dataclass(frozen=True)
class Result:
    """One committed result folder and what its report says about its origin."""

    name: str
    report: dict[str, Any]

    @property
    def commit(self) -> str:
        return str(self.report.get("versions", {}).get("git_commit", ""))

    @property
    def dirty(self) -> bool:
        return self.commit.endswith("+dirty")

    @property
    def imported(self) -> list[str]:
        """The source files the run's process imported (recorded by newer reports)."""
        return [str(p) for p in self.report.get("imported", [])]

    @property
    def untracked(self) -> list[str]:
        """Untracked source files when the run started (recorded by newer reports)."""
        return [str(p) for p in self.report.get("untracked", [])]

    def quoted(self) -> list[str]:
        """Other results this one was made from: the result folders its command or config
        names (``simulations/results/NAME``), but for its own output folder (``--out``)."""
        commands = [re.sub(r"--out[= ]\S+", "", str(self.report.get(key) or ""))
                    for key in ("command_line", "reproduce")]
        config = {k: v for k, v in (self.report.get("config") or {}).items()
                  if k not in ("out", "out_dir", "output")}
        text = json.dumps([*commands, config])
        return sorted({m for m in QUOTED.findall(text) if m != self.name})

    @property
    def reproduce(self) -> str:
        return str(self.report.get("reproduce") or self.report.get("command_line") or "")

    @property
    def load(self) -> str:
        machine = self.report.get("machine", {})
        start, end = machine.get("load_average_start"), machine.get("load_average_end")
        if not start:
            return "not recorded"
        text = f"{start[0]:.2f}"
        return text + (f" -> {end[0]:.2f}" if end else "")


def load_result(name: str, results: Path = RESULTS) -> Result:
    path = results / name / "report.json"
    if not path.is_file():
        raise NumbersError(f"result {name!r}: {path} does not exist")
    return Result(name, json.loads(path.read_text()))


def all_results() -> list[Result]:
    return [load_result(p.parent.name) for p in sorted(RESULTS.glob("*/report.json"))]


_STEP = re.compile(r"([^.\[\]']+)|\[(\d+)\]|\['([^']*)'\]|\[([^=\]']+)=([^\]]+)\]")


def lookup(data: Any, path: str, where: str) -> Any:
    """The value at ``path`` (``a.b[2].c``, ``results[name=x].y``, ``summary['qwen2.5-0.5b']``)."""
    pos, node = 0, data
    while pos < len(path):
        if path[pos] == ".":
            pos += 1
            continue
        m = _STEP.match(path, pos)
        if not m:
            raise NumbersError(f"{where}: cannot parse {path!r} at {path[pos:]!r}")
        key, index, quoted, field, want = m.groups()
        try:
            if key is not None or quoted is not None:
                node = node[key if key is not None else quoted]
            elif index is not None:
                node = node[int(index)]
            else:
                hits = [e for e in node if isinstance(e, dict) and str(e.get(field)) == want]
                if len(hits) != 1:
                    raise NumbersError(
                        f"{where}: [{field}={want}] matches {len(hits)} elements of the list"
                        f" at {path[:pos]!r}, expected exactly one"
                    )
                node = hits[0]
        except (KeyError, IndexError, TypeError) as exc:
            raise NumbersError(
                f"{where}: {path!r} not found at {path[: m.end()]!r} ({exc!r})"
            ) from None
        pos = m.end()
    return node


def fmt(value: Any, spec: str, where: str) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        raise NumbersError(f"{where}: value is {value}, not a finite number")
    try:
        return spec.format(value)
    except (ValueError, TypeError) as exc:
        raise NumbersError(f"{where}: format {spec!r} does not apply to {value!r}: {exc}") from None


class Numbers:
    """The table of named numbers (``docs/numbers.toml``) and the results they come from."""

    def __init__(self, table: Path = TABLE, results: Path = RESULTS,
                 history: bool = True) -> None:
        #: whether a result's staleness is judged (it needs the git history since the result's
        #: commit, which a shallow clone lacks: see :func:`shallow_clone`)
        self.history = history
        self._problems: dict[str, list[str]] = {}  # result_problems, once per result
        self.results_dir = results
        raw = tomllib.loads(table.read_text())
        self.results_meta: dict[str, dict[str, Any]] = raw.pop("result", {})
        self.figures: dict[str, dict[str, Any]] = raw.pop("figure", {})
        self.keys: dict[str, dict[str, Any]] = raw
        self._results: dict[str, Result] = {}

    def result(self, name: str) -> Result:
        if name not in self._results:
            self._results[name] = load_result(name, self.results_dir)
        return self._results[name]

    def value(self, key: str) -> tuple[str, list[str]]:
        """The formatted text of ``key`` and the results it reads."""
        if key not in self.keys:
            raise NumbersError(f"span key {key!r} is not defined in docs/numbers.toml")
        spec = self.keys[key]
        where = f"number {key!r}"
        default = spec.get("result")
        used: list[str] = []

        def v(path: str, result: str | None = None) -> Any:
            name = result or default
            if not name:
                raise NumbersError(f"{where}: no result named (key 'result')")
            used.append(name)
            return lookup(self.result(name).report, path, f"{where} ({name})")

        if "expr" in spec:
            names = {"v": v, "abs": abs, "min": min, "max": max}
            value = eval(spec["expr"], {"__builtins__": {}}, names)  # noqa: S307
        elif "value" in spec:
            value = v(spec["value"])
        else:
            raise NumbersError(f"{where}: needs 'value' (a path) or 'expr'")
        return fmt(value, spec.get("format", "{}"), where), sorted(set(used))

    def result_problems(self, name: str, _seen: tuple[str, ...] = ()) -> list[str]:
        """Why a span may not cite result ``name`` (empty when it may): no command or commit,
        a dirty tree (tracked changes, or untracked files in what it depends on), nothing
        declared, a later commit touching what it depends on (the declared paths and every
        source file its run imported), or another result it was made from that may not be
        cited either."""
        if not _seen and name in self._problems:
            return list(self._problems[name])
        res = self.result(name)
        problems = []
        if not res.reproduce:
            problems.append(f"result {name!r} records no command (reproduce/command_line)")
        if not res.commit:
            problems.append(f"result {name!r} records no commit (versions.git_commit)")
        elif res.dirty:
            problems.append(f"result {name!r} was made from a dirty tree ({res.commit})")
        meta = self.results_meta.get(name)
        if meta is None or not meta.get("depends"):
            problems.append(
                f"result {name!r} declares no 'depends' in docs/numbers.toml, so whether later code"
                " changed it is unchecked"
            )
            return problems
        untracked = self.untracked_in(name)
        if untracked:
            problems.append(f"result {name!r} was made with untracked files in what it depends "
                            f"on ({', '.join(untracked[:5])}): a dirty tree")
        stale = self.history and stale_since(res, self.depends(name),
                                             meta.get("unaffected", []))
        if stale:
            problems.append(f"result {name!r} is older than the code it describes: {stale}")
        for other in res.quoted():
            if other in _seen or not (self.results_dir / other / "report.json").is_file():
                continue
            if self.result_problems(other, (*_seen, name)):
                problems.append(f"result {name!r} was made from result {other!r}, which may "
                                "not be cited")
        if not _seen:
            self._problems[name] = list(problems)
        return problems

    def depends(self, name: str) -> list[str]:
        """What result ``name`` depends on: the paths ``docs/numbers.toml`` declares and the
        source files its run recorded as imported."""
        meta = self.results_meta.get(name) or {}
        declared = list(meta.get("depends", []))
        return declared + [p for p in self.result(name).imported if not under(p, declared)]

    def untracked_in(self, name: str) -> list[str]:
        """The untracked files at result ``name``'s start that lie in what it depends on."""
        return [p for p in self.result(name).untracked if under(p, self.depends(name))]

    def state(self, name: str) -> str:
        """``current``, ``dirty``, ``stale``, ``no commit``, ``no command`` or ``unchecked``."""
        res = self.result(name)
        if not res.commit:
            return "no commit"
        if res.dirty:
            return "dirty"
        if not res.reproduce:
            return "no command"
        meta = self.results_meta.get(name)
        if meta is None or not meta.get("depends"):
            return "unchecked"
        if self.untracked_in(name):
            return "dirty"
        return "stale" if self.result_problems(name) else "current"


def git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        why = (SHALLOW_NOTE if shallow_clone() else
               "the check needs the repository's history: a clone, not an export")
        raise NumbersError(f"git {' '.join(args)} failed: {out.stderr.strip()} ({why})")
    return out.stdout.strip()


SHALLOW_NOTE = (
    "this is a shallow clone (git clone --depth): whether a result is older than the code it "
    "depends on needs the history since the result's commit, so staleness is not checked here; "
    "`git fetch --unshallow` fetches it"
)


def shallow_clone() -> bool:
    """Whether this checkout is a shallow clone (its history cut short)."""
    out = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT,
                         capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip() == "true"


def stale_since(res: Result, depends: list[str], unaffected: list[str] = ()) -> str:  # type: ignore[assignment]
    """The first commit after the result's that touched one of ``depends`` ('' if none).

    ``unaffected``: ``"<short hash>: why"`` entries, later commits checked not to change what the
    result measures (a move of code, a comment); they do not make it stale."""
    if not depends or not res.commit or res.dirty:
        return ""
    skip = [u.split(":", 1)[0].strip() for u in unaffected]
    changed = [
        line
        for line in git("log", "--format=%H %s", f"{res.commit}..HEAD", "--", *depends).splitlines()
        if line and not any(line.startswith(h) for h in skip)
    ]
    if not changed:
        return ""
    first = changed[-1]
    return f"commit {first[:10]} {first[41:100]!r}"


# ---- pages --------------------------------------------------------------------------------------

def pages() -> list[Path]:
    found = [ROOT / "README.md"]
    for p in sorted((ROOT / "docs").rglob("*.md")):
        if "_build" in p.parts or p.parent == RESULT_PAGES:
            continue
        found.append(p)
    return found


def write_spans(numbers: Numbers, text: str, where: str) -> tuple[str, list[str]]:
    """``text`` with every span's value refreshed, and the problems found."""
    problems: list[str] = []

    def repl(m: re.Match[str]) -> str:
        key = m.group(1)
        try:
            value, used = numbers.value(key)
        except NumbersError as exc:
            problems.append(f"{where}: {exc}")
            return m.group(0)
        for name in used:
            problems.extend(f"{where}: span {key!r}: {p}" for p in numbers.result_problems(name))
        return f"<!--n:{key}-->{value}<!--/n-->"

    return SPAN.sub(repl, text), problems


def strip_unmeasured(text: str) -> str:
    """``text`` without spans, code (fenced and inline), links' targets and HTML comments."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    text = SPAN.sub("", text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return text


#: Integers with thousands separators (``1,982``), counts of a test run (``1982 passed``) and
#: spelled-out comparisons (``twice as fast``, ``three times slower``): measured-looking too.
SEPARATED = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+)(?![\d,]*\.\d)")
COUNTED = re.compile(r"(?<![\w.,])(\d+(?:,\d{3})* (?:passed|failed|skipped|errors?)\b)")
SPELLED = re.compile(
    r"\b((?:twice|thrice|half|(?:two|three|four|five|six|seven|eight|nine|ten) times)"
    r" (?:as (?:fast|slow|long|large|small|much|many)\b|faster|slower|longer|shorter|more"
    r"|fewer|less|larger|smaller|bigger|the (?:time|cost|bytes|memory|wall time|perplexity)))",
    re.I,
)

#: Times and sizes with their unit in words (``17 minutes``, ``2.5 CPU seconds``) and figures
#: spelled out before one (``about two hours``, ``within five percent``): measured-looking too.
_SPELLED_NUMBER = (r"(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen"
                   r"|fourteen|fifteen|sixteen|seventeen|eighteen|nineteen|twenty|thirty|forty"
                   r"|fifty|sixty|seventy|eighty|ninety|a hundred|a thousand)")
_UNIT_WORD = (r"(?:(?:CPU |core-)?seconds?|minutes?|hours?|days?|bytes|kilobytes|megabytes"
              r"|gigabytes|percent)")
WORDED = re.compile(
    rf"(?<![\w.,/-])((?:\d+(?:\.\d+)?|{_SPELLED_NUMBER}(?:[- ]{_SPELLED_NUMBER})?)"
    rf"\s{_UNIT_WORD})\b",
    re.I,
)
#: Times and sizes in words that are fixed settings, not measurements (each checked where it
#: stands): Ray's fixed wait for its local node, the ServerApp's wait for the SuperNodes, the
#: bytes of a float32, the bytes per weight of the server's memory-mapped sums (their format).
SETTINGS_IN_WORDS = frozenset({"30 seconds", "2 minutes", "4 bytes", "ten bytes"})

#: Numbers with separators that are settings or data sizes, not measurements (a short list;
#: each is checked where it stands): ledger sizes of a cost study, the sanitizer's vocabulary,
#: 16 x 64 pooled windows, two source datasets' sizes.
NOT_MEASURED = frozenset({"1,000", "10,000", "20,000", "1,024", "57,466", "50,000"})


def typed_numbers(text: str) -> list[str]:
    """The measured-looking numbers of ``text`` outside spans, code, link targets and comments,
    in order of appearance."""
    plain = strip_unmeasured(text)
    found = [(m.start(1), m.group(1)) for m in MEASURED.finditer(plain)]
    found += [(m.start(1), m.group(1)) for m in SEPARATED.finditer(plain)
              if m.group(1) not in NOT_MEASURED]
    found += [(m.start(1), m.group(1)) for rx in (COUNTED, SPELLED) for m in rx.finditer(plain)]
    found += [(m.start(1), m.group(1)) for m in WORDED.finditer(plain)
              if m.group(1) not in SETTINGS_IN_WORDS]
    seen: dict[int, str] = {}
    for start, number in sorted(found, key=lambda f: (f[0], -len(f[1]))):
        if not any(start < s + len(n) and s <= start for s, n in seen.items()):
            seen[start] = number
    return list(seen.values())


def result_page(res: Result, numbers: Numbers) -> str:
    problems = numbers.result_problems(res.name)
    rel = f"../../simulations/results/{res.name}"
    lines = [f"# {res.name}", ""]
    if problems:
        lines += ["```{warning}", "Not citable: " + "; ".join(problems) + ".", "```", ""]
    lines += [
        f"- Reproduce: `{res.reproduce or 'not recorded'}`",
        f"- Commit: `{res.commit or 'not recorded'}`",
        f"- Load average (1 min) at start -> end: {res.load}",
        f"- Files: `simulations/results/{res.name}/` (`report.json`, `report.md`)",
        "",
    ]
    if (RESULTS / res.name / "report.md").is_file():
        lines += [f"```{{include}} {rel}/report.md", ":relative-images:", ":heading-offset: 1",
                  "```", ""]
    return "\n".join(lines)


def results_index(results: list[Result], numbers: Numbers) -> str:
    lines = [
        "# Results",
        "",
        "Every committed result of `simulations/results/`, generated by `python tools/published.py"
        " --write` from its `report.json`. States: **current**: made from a committed tree,"
        " and no later commit touched the code it depends on (as `docs/numbers.toml` declares);"
        " **stale**: a later commit touched that code, so it must be re-run before it is cited;"
        " **dirty**: made from a tree with uncommitted changes; **unchecked**: made from a"
        " committed tree, but what it depends on is not declared, so it may be older than the"
        " code. Only current results are cited by the other pages; the others stay as a record"
        " of what was measured, at their commit.",
        "",
        "| result | state | commit | load (1 min) | reproduce |",
        "|---|---|---|---|---|",
    ]
    for res in results:
        state = numbers.state(res.name)
        lines.append(
            f"| [{res.name}]({res.name}.md) | {state} | `{res.commit or '-'}` | {res.load} |"
            f" `{res.reproduce or '-'}` |"
        )
    older = sorted(
        p.name for p in RESULTS.iterdir() if p.is_dir() and not (p / "report.json").exists()
    )
    if older:
        lines += [
            "",
            "Folders without a `report.json` (written before every run recorded its command,"
            " commit and machine; not citable, kept as a record): "
            + ", ".join(f"`{name}`" for name in older) + ".",
        ]
    lines += ["", "```{toctree}", ":hidden:", ""] + [r.name for r in results] + ["```", ""]
    return "\n".join(lines)


def generated_pages(numbers: Numbers) -> dict[Path, str]:
    results = all_results()
    out = {RESULT_PAGES / "index.md": results_index(results, numbers)}
    for res in results:
        out[RESULT_PAGES / f"{res.name}.md"] = result_page(res, numbers)
    return out


def draw_figures(numbers: Numbers, name: str, folder: Path) -> list[str]:
    """Draw figure set ``name`` into ``folder`` as ``fedcompress report --compare`` does;
    return the problems of its runs (empty when every one may be cited)."""
    import tempfile

    from fedcompress.report_html import ReportError, render_compare

    spec = numbers.figures[name]
    runs = spec.get("runs")
    if not runs or not isinstance(runs, list):
        return [f"figure set {name!r}: needs 'runs', a non-empty list of result folders under "
                f"simulations/results, got {runs!r}"]
    problems = []
    for run in runs:
        try:
            problems.extend(f"figure set {name!r}: {p}" for p in numbers.result_problems(run))
        except NumbersError as exc:
            problems.append(f"figure set {name!r}: run {run!r}: {exc}")
    if problems:
        return problems
    with tempfile.TemporaryDirectory(prefix="fedcompress-figures-") as tmp:
        # the folders as the command line names them: the page's run labels are their names
        try:
            render_compare([numbers.results_dir / r for r in runs], Path(tmp) / "figures")
        except ReportError as exc:
            return [f"figure set {name!r}: {exc}"]
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.png"):
            old.unlink()
        drawn = sorted((Path(tmp) / "figures").glob("*.png"))
        for new in drawn:
            (folder / new.name).write_bytes(new.read_bytes())
    if not drawn:
        problems.append(f"figure set {name!r}: its runs draw no plot (no strategy has results "
                        "at two sparsities or more across them)")
    return problems


def check_figures(numbers: Numbers, write: bool, figures: Path = FIGURES) -> list[str]:
    """Each figure set drawn again from its results and compared with ``docs/img/NAME``."""
    import tempfile

    problems: list[str] = []
    for name in numbers.figures:
        target = figures / name
        if write:
            problems.extend(draw_figures(numbers, name, target))
            continue
        with tempfile.TemporaryDirectory(prefix="fedcompress-figures-") as tmp:
            problems.extend(draw_figures(numbers, name, Path(tmp)))
            drawn = {p.name: p.read_bytes() for p in Path(tmp).glob("*.png")}
        present = {p.name: p.read_bytes() for p in target.glob("*.png")} if target.is_dir() else {}
        for file in sorted(drawn.keys() | present.keys()):
            if drawn.get(file) != present.get(file):
                what = ("missing" if file not in present else "not drawn from its runs any more"
                        if file not in drawn else "differs from what its runs draw")
                problems.append(f"docs/img/{name}/{file}: {what} ({FIX})")
    # a folder of docs/img whose set is gone: its plots no longer come from any result
    orphans = [d for d in figures.iterdir() if d.is_dir() and d.name not in numbers.figures
               and any(d.glob("*.png"))] if figures.is_dir() else []
    for folder in sorted(orphans):
        if write:
            for old in folder.glob("*.png"):
                old.unlink()
            if not any(folder.iterdir()):
                folder.rmdir()
        else:
            problems.append(f"docs/img/{folder.name}/: no [figure.{folder.name}] in "
                            f"docs/numbers.toml any more ({FIX})")
    return problems


def run(write: bool, history: bool = True) -> list[str]:
    """Check (or with ``write`` refresh) every span, result page and figure set; the problems
    found. ``history=False`` (a shallow clone) checks every value but no result's staleness,
    and so not the result pages, which state it."""
    if write and not history:
        raise NumbersError("--write needs the history (the result pages state staleness): "
                           + SHALLOW_NOTE)
    numbers = Numbers(history=history)
    problems: list[str] = []
    for page in pages():
        where = str(page.relative_to(ROOT))
        text = page.read_text()
        new, found = write_spans(numbers, text, where)
        problems.extend(found)
        for number in typed_numbers(new):
            problems.append(f"{where}: {number!r} looks measured but is not a generated span")
        if new != text:
            if write:
                page.write_text(new)
            else:
                problems.append(f"{where}: spans differ from their results ({FIX})")
    problems.extend(check_figures(numbers, write))
    if not history:
        return problems
    expected = generated_pages(numbers)
    present = set(RESULT_PAGES.glob("*.md")) if RESULT_PAGES.is_dir() else set()
    for path, text in expected.items():
        if path.is_file() and path.read_text() == text:
            continue
        if write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        else:
            problems.append(f"{path.relative_to(ROOT)}: differs from the results ({FIX})")
    for path in present - set(expected):
        if write:
            path.unlink()
        else:
            problems.append(f"{path.relative_to(ROOT)}: no such result any more")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true",
                      help="rewrite spans, result pages and figure sets")
    mode.add_argument("--check", action="store_true", help="fail on any difference (the test)")
    args = parser.parse_args(argv)
    history = not shallow_clone()
    if not history:
        if args.write:
            parser.error(f"--write: {SHALLOW_NOTE}")
        print(f"note: {SHALLOW_NOTE}", file=sys.stderr)
    problems = run(write=args.write, history=history)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s)", file=sys.stderr)
        return 1
    n = sum(len(SPAN.findall(p.read_text())) for p in pages())
    print(f"{n} generated numbers in {len(pages())} pages; {len(all_results())} result pages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
