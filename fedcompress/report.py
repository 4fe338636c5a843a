"""Run reports: ``report.json`` (machine-readable), ``report.md`` (a readable table),
``config.toml``.

Every command writes its output folder through :class:`RunReport`. Results are written to disk
as soon as each one is added, so an interrupted or failing run never loses finished results.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import importlib.metadata
import json
import logging
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import tomli_w

logger = logging.getLogger(__name__)

_VERSIONED = ("fedcompress", "torch", "transformers", "flwr", "lm_eval", "peft", "opacus",
              "numpy", "datasets")


def versions() -> dict[str, str]:
    """Versions of Python, the platform, the key packages and the git commit of the source."""
    found = {"python": platform.python_version(), "platform": platform.platform()}
    for name in _VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    state = tree_state(Path(__file__).resolve().parent.parent)
    if state:
        found["git_commit"] = state
    return found


def tree_state(source: Path) -> str:
    """The source tree's commit (short hash), ``+dirty`` when a tracked file differs from it
    outside :data:`OUTPUT_FOLDERS` (re-running a committed result replaces its own files there:
    that is no change of the code it measures); "" outside a git checkout."""
    try:
        commit = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(
            ["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no", "--",
             ":(top)", *(f":(top,exclude){folder}" for folder in OUTPUT_FOLDERS)],
            capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    if commit.returncode != 0:
        return ""
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


#: Folders of the source tree whose untracked files are outputs, not code a run may measure.
OUTPUT_FOLDERS = ("simulations/results/", "runs/", "docs/_build/", "docs/api/")


def untracked_files(source: Path) -> list[str]:
    """Files of the source tree that git does not track and does not ignore, outside the output
    folders (:data:`OUTPUT_FOLDERS`): code a run may have imported or read that no commit
    holds. ``tools/published.py`` counts a result as made from a dirty tree when one of them
    lies in what the result depends on."""
    out = subprocess.run(["git", "-C", str(source), "ls-files", "--others", "--exclude-standard"],
                         capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        return []
    return sorted(path for path in out.stdout.splitlines()
                  if path and not path.startswith(OUTPUT_FOLDERS))


def imported_source_files(source: Path | None = None) -> list[str]:
    """The files of the source tree this process has imported (modules in ``sys.modules``, and
    the script run as ``__main__``), relative to the tree: what a run's numbers depend on, as far
    as this process knows. ``tools/published.py`` makes a result stale when a later commit
    touches one of them (besides what ``docs/numbers.toml`` declares)."""
    root = (source or Path(__file__).resolve().parent.parent).resolve()
    found: set[str] = set()
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if not name or not os.path.isabs(name):  # e.g. torch's generated modules: no file
            continue
        resolved = _resolved(name)
        if resolved is None or not resolved.is_relative_to(root):
            continue
        rel = resolved.relative_to(root)
        if rel.parts and rel.parts[0] not in (".venv", "build") and rel.suffix == ".py" \
                and (root / rel).is_file():
            found.add(rel.as_posix())
    return sorted(found)


@functools.lru_cache(maxsize=None)
def _resolved(name: str) -> Path | None:
    """A module file's real path, resolved once per process (a process that writes several
    reports holds thousands of modules: resolving them all each time cost 0.3 CPU s)."""
    try:
        return Path(name).resolve()
    except (OSError, RuntimeError):
        return None


#: CPU instruction-set extensions whose presence changes which float kernels run.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni",
             "avx512_fp16", "amx_tile", "amx_bf16", "neon", "asimd", "sve")


def machine() -> dict[str, Any]:
    """What explains float differences between machines for the same config: the CPU model,
    its instruction-set extensions (:data:`ISA_FLAGS`), the kernel level torch dispatches to
    (``cpu_capability``), torch's intra- and inter-op threads in this process (a Ray actor
    runs one), and whether MKL / oneDNN are in use."""
    import torch

    found: dict[str, Any] = {"machine": platform.machine(), "cpu_count": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and "cpu_model" not in found:
            found["cpu_model"] = value.strip()
        elif key in ("flags", "Features") and "isa" not in found:
            flags = set(value.split())
            found["isa"] = [f for f in ISA_FLAGS if f in flags]
    found.setdefault("cpu_model", platform.processor() or "unknown")
    try:
        found["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        pass
    with contextlib.suppress(OSError, AttributeError):  # what else ran: timings need it
        found["load_average_start"] = [round(x, 2) for x in os.getloadavg()]
    found.update({"torch_threads": torch.get_num_threads(),
                  "torch_interop_threads": torch.get_num_interop_threads(),
                  "mkl": torch.backends.mkl.is_available(),
                  "mkldnn": torch.backends.mkldnn.is_available()})
    return found


#: The texts :func:`_jsonable` writes for the floats JSON has no number for.
NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def nonfinite_restored(value: Any) -> Any:
    """``value`` read back from a report, its non-finite floats (stored as the texts of
    :data:`NONFINITE`) floats again."""
    if isinstance(value, str):
        return NONFINITE.get(value, value)
    if isinstance(value, dict):
        return {k: nonfinite_restored(v) for k, v in value.items()}
    if isinstance(value, list):
        return [nonfinite_restored(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf/nan
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return value.item()
    return value


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _loads(found: dict[str, Any]) -> str:
    """The load averages a report recorded, at its start and (once finished) its end."""
    text = f"{' / '.join(map(str, found['load_average_start']))} at the start"
    if "load_average_end" in found:
        text += f", {' / '.join(map(str, found['load_average_end']))} at the end"
    return text


def format_cell(value: Any) -> str:
    """A value as report.md's tables show it: floats to four significant digits (tiny ones
    in e-notation), None as ``-``."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    if value is None:
        return "-"
    return str(value)


def results_table(results: list[dict], columns: list[str] | None = None) -> tuple[list[str],
                                                                                   list[list[str]]]:
    """Scalar columns (in first-seen order) and formatted rows of a list of result records."""
    if columns is None:
        columns = []
        for record in results:
            for key, value in record.items():
                if key not in columns and not isinstance(value, (dict, list)):
                    columns.append(key)
    rows = [[format_cell(record.get(col)) for col in columns] for record in results]
    return columns, rows


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def default_out(command: str) -> Path:
    """The output folder of a run given none: ``runs/<command>-<local time>``."""
    return Path("runs") / f"{command}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


class RunReport:
    """Collects one run's config, seeds, timings and results; writes them under ``out_dir``."""

    def __init__(self, out_dir: str | Path, command: str, config: dict[str, Any],
                 seeds: dict[str, int] | None = None, argv: list[str] | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.command = command
        self.config = config
        self.seeds = dict(seeds or {})
        argv = list(sys.argv if argv is None else argv)
        # Under `flwr run` argv is flwr-serverapp's, with the run's secret access token.
        argv = ["***" if i and argv[i - 1] == "--token" else a for i, a in enumerate(argv)]
        self.command_line = shlex.join(["fedcompress", *argv[1:]]) if argv else command
        self.reproduce = f"fedcompress {command} --config {self.out_dir / 'config.toml'}"
        self.started = _dt.datetime.now(_dt.timezone.utc)
        self.timings: dict[str, float] = {}
        self.results: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        self.sections: list[tuple[str, str]] = []  # (title, markdown) shown before the results
        self.markdown_results = True  # False: results only in report.json (large sweeps)
        self.status = "running"
        self.exit_status = "ok"  # what `with report:` finishes with when its block succeeds
        self.versions = versions()
        self.machine = machine()
        self.imported: list[str] = []  # the source files this process imported (at finish)
        try:  # untracked source files at the start (code no commit holds)
            self.untracked = untracked_files(Path(__file__).resolve().parent.parent)
        except (OSError, subprocess.SubprocessError):
            self.untracked = []
        atomic_write(self.out_dir / "config.toml",
                      tomli_w.dumps({k: v for k, v in _jsonable(config).items() if v is not None}))
        self.write()

    @classmethod
    def for_script(cls, script: str | Path, opts: Any, name: str | None = None,
                   seeds: dict[str, int] | None = None, config: dict[str, Any] | None = None
                   ) -> RunReport:
        """The report of a script in ``simulations/`` run with argparse options ``opts`` (which
        need an ``out``): its command line and reproduce line are ``python <script> --opt value
        ...`` with every option spelled out (flags only when set), so the report's command
        reproduces it whatever the defaults become."""
        options = vars(opts)
        script = Path(script)
        with contextlib.suppress(ValueError):  # __file__: shown relative to the source tree
            script = script.resolve().relative_to(Path(__file__).resolve().parent.parent)
        parts = ["python", script.as_posix()]
        for key, value in options.items():
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                parts += [flag] if value else []
            elif isinstance(value, (list, tuple)):
                parts += [flag, *map(str, value)] if value else []
            elif value is not None:
                parts += [flag, str(value)]
        report = cls(options["out"], name or script.stem.replace("_", "-"),
                     config if config is not None else options, seeds=seeds)
        report.command_line = report.reproduce = shlex.join(parts)
        report.write()
        return report

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the run (added up if the phase repeats)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start
            self.write()

    def add_result(self, record: dict[str, Any]) -> None:
        """Append a result record (needs a ``name``) and write the report at once."""
        if "name" not in record:
            raise ValueError(f"a result record needs a 'name': {record}")
        self.results.append(dict(record))
        self.write()

    def add_model_size(self, size: dict[str, Any]) -> None:
        """Record the saved model's size next to the dense model's
        (:func:`~fedcompress.models.saving.model_size`): ``model_size`` in report.json and a
        "Saved model" table in report.md."""
        self.extra["model_size"] = dict(size)
        mib = 1 << 20
        table = markdown_table(
            ["saved (MiB)", "weights (MiB)", "dense (MiB)", "weights / dense", "dtype",
             "dense dtype", "format"],
            [[f"{size['saved_bytes'] / mib:.2f}", f"{size['weights_bytes'] / mib:.2f}",
              f"{size['dense_bytes'] / mib:.2f}", f"{size['ratio']:.3f}", str(size["dtype"]),
              str(size["dense_dtype"]), str(size["format"])]])
        text = (f"{table}\n\n`{size['path']}`: every file written (weights, config, tokenizer) "
                "and its safetensors weights, next to the dense input model's parameter bytes "
                "in its own dtype. Zeros of an unstructured mask are stored like any weight: "
                "a pruned model keeps the dense model's size in the same dtype (and its "
                "inference cost in today's runtimes); a smaller dtype, weight quantization and "
                "removed layers shrink it.")
        self.sections = [s for s in self.sections if s[0] != "Saved model"]
        self.sections.append(("Saved model", text))
        self.write()

    def to_dict(self) -> dict[str, Any]:
        return _jsonable({
            "command": self.command,
            "command_line": self.command_line,
            "reproduce": self.reproduce,
            "status": self.status,
            "started": self.started.isoformat(),
            "config": self.config,
            "seeds": self.seeds,
            "versions": self.versions,
            "machine": self.machine,
            "timings": self.timings,
            "results": self.results,
            **({"untracked": self.untracked} if self.untracked else {}),
            **({"imported": self.imported} if self.imported else {}),
            **self.extra,
        })

    def result_groups(self) -> dict[tuple[str, ...], list[dict]]:
        """Results grouped by their set of scalar fields (one table per kind of record)."""
        groups: dict[tuple[str, ...], list[dict]] = {}
        for record in self.results:
            key = tuple(k for k, v in record.items() if not isinstance(v, (dict, list)))
            groups.setdefault(key, []).append(record)
        return groups

    def markdown(self) -> str:
        tables = [markdown_table(*results_table(records, list(key)))
                  for key, records in self.result_groups().items()]
        parts = [
            f"# fedcompress {self.command}",
            "",
            f"Status: **{self.status}**, started {self.started.isoformat(timespec='seconds')}.",
            "",
            *([f"Load average (1, 5, 15 min): {_loads(self.machine)}.", ""]
              if "load_average_start" in self.machine else []),
            "Command line:",
            "",
            f"    {self.command_line}",
            "",
            f"Reproduce: `{self.reproduce}`",
            "",
            *[f"## {title}\n\n{text}\n" for title, text in self.sections],
            *(["## Results", "", "\n\n".join(tables) if tables else "(no results)", ""]
              if self.markdown_results else []),
            "## Timings (s)",
            "",
            markdown_table(["phase", "seconds"],
                           [[k, f"{v:.2f}"] for k, v in self.timings.items()]),
            "",
            "## Config",
            "",
            markdown_table(["key", "value"], [[k, format_cell(v)] for k, v in self.config.items()]),
            "",
            "## Versions",
            "",
            markdown_table(["package", "version"], [[k, v] for k, v in self.versions.items()]),
            "",
        ]
        return "\n".join(parts)

    def write(self) -> None:
        atomic_write(self.out_dir / "report.json", json.dumps(self.to_dict(), indent=2) + "\n")
        atomic_write(self.out_dir / "report.md", self.markdown())

    def __enter__(self) -> RunReport:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Finish the report: :attr:`exit_status` (``ok`` unless the block set another, e.g.
        ``incomplete``), or ``failed`` when the block raised (the exception goes on; every result
        added so far is already on disk)."""
        self.finish(self.exit_status if exc_type is None else "failed")

    def finish(self, status: str = "ok") -> None:
        self.status = status
        with contextlib.suppress(OSError, AttributeError):
            self.machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        self.imported = imported_source_files()
        self.write()
        logger.info("report written to %s", self.out_dir / "report.json")

    def print_table(self, console=None, title: str | None = None) -> None:
        """Print the results as rich tables: one per kind of record (same set of fields)."""
        from rich.console import Console
        from rich.table import Table

        console = console or Console(width=None if sys.stdout.isatty() else 160)
        for key, records in self.result_groups().items():
            columns, rows = results_table(records, list(key))
            table = Table(title=title or f"fedcompress {self.command}")
            for col in columns:
                table.add_column(col, justify="left" if col in ("name", "dataset") else "right")
            for row in rows:
                table.add_row(*row)
            console.print(table)
        console.print(f"report: {self.out_dir / 'report.json'}  |  {self.out_dir / 'report.md'}")
