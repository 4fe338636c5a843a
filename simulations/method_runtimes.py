"""Wall time of one method run through each entry point, side by side in one run.

    python simulations/method_runtimes.py --out simulations/results/method-runtimes

PPC-GPT on a tiny 3-layer llama (built here, saved to a temporary folder) with a scripted
OpenAI-compatible LLM_syn on loopback (the test suite's stub: ``tests/conftest.py``), 2 clients,
the settings of ``tests/test_flwr_run.py``; each entry point runs ``--repeats`` times,
alternating:

* ``fedcompress ppcgpt`` (the CLI: Flower's Simulation Engine in-process, Ray actors);
* ``flwr run .`` (Flower's runtime: a local SuperLink started by ``flwr run``, the FAB built
  from ``pyproject.toml``, a ServerApp process, ClientApp processes), with a private
  ``FLWR_HOME``; the SuperLink and everything it started are stopped by PID after each run.

Both runs must give the same result (the same accuracies and removal plan). Writes
``report.json``, ``report.md`` and ``config.toml`` to ``--out`` (:class:`RunReport`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the scripted LLM_syn and the tiny model builders

from conftest import (  # noqa: E402
    _OpenAIStub,
    build_tiny_model,
    build_tiny_tokenizer,
    ppcgpt_tiny_settings,
    yes_no_generator,
)

from fedcompress.report import RunReport, markdown_table  # noqa: E402

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(home: Path) -> dict:
    env = dict(os.environ)
    env.update({"PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "FLWR_HOME": str(home),
                "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
                "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port()),
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_TELEMETRY_ENABLED": "0",
                "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"})
    return env


def _stop_superlink(home: Path) -> None:
    """SIGTERM the local SuperLink of ``home`` and its session (then SIGKILL what is left)."""
    import psutil

    procs = [p for p in psutil.process_iter(["pid", "cmdline"])
             if any(str(home) in part for part in (p.info["cmdline"] or []))]
    sessions = {_sid(p.pid) for p in procs} - {None, os.getsid(0)}
    group = [p for p in psutil.process_iter(["pid"])
             if p.pid != os.getpid() and _sid(p.pid) in sessions]
    for proc in group:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(group, timeout=15)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except ProcessLookupError:
        return None


def run_cli(settings: dict, out: Path) -> tuple[float, dict]:
    import tomli_w

    config = out.with_suffix(".toml")
    config.write_text(tomli_w.dumps({**settings, "out": str(out)}))
    start = time.perf_counter()
    subprocess.run([str(BIN / "fedcompress"), "ppcgpt", "--config", str(config),
                    "--log-level", "WARNING"], check=True, cwd=REPO, capture_output=True)
    return time.perf_counter() - start, json.loads((out / "report.json").read_text())


def run_flwr(settings: dict, out: Path, home: Path) -> tuple[float, dict]:
    home.mkdir(parents=True)
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n')
    run_config = 'method="ppcgpt" ' + " ".join(
        f"ppcgpt.{k.replace('_', '-')}={json.dumps(v)}"
        for k, v in {**settings, "out": str(out)}.items())
    start = time.perf_counter()
    try:
        subprocess.run([str(BIN / "flwr"), "run", ".", "--federation-config",
                        f"num-supernodes={settings['clients']} client-resources-num-cpus=1",
                        "--run-config", run_config, "--stream"], check=True, cwd=REPO,
                       env=_env(home), capture_output=True, timeout=900)
        seconds = time.perf_counter() - start
    finally:
        _stop_superlink(home)
    return seconds, json.loads((out / "report.json").read_text())


def _decided(report: dict) -> list:
    if report.get("status") != "ok":
        raise RuntimeError(f"run {report['config'].get('out')} ended {report.get('status')}")
    return [report["compression"]["plan"],
            [(r["name"], r.get("acc_server"), r["acc_client"]) for r in report["results"]]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("simulations/results/method-runtimes"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    command = f"python simulations/method_runtimes.py --out {args.out} --repeats {args.repeats}"
    rows: dict[str, list[float]] = {"fedcompress ppcgpt": [], "flwr run .": []}
    config = {"repeats": args.repeats, "method": "ppcgpt",
              "settings": {**ppcgpt_tiny_settings("tiny 3-layer llama", "scripted stub", ""),
                           "out": "(per run)"}}
    with RunReport(args.out, "method-runtimes", config) as report, \
            tempfile.TemporaryDirectory() as tmp, _OpenAIStub(yes_no_generator) as stub:
        report.command_line = report.reproduce = command
        tmp = Path(tmp)
        model_dir = tmp / "tiny-llama"
        build_tiny_model("llama", n_layers=3).save_pretrained(model_dir)
        build_tiny_tokenizer().save_pretrained(model_dir)
        settings = ppcgpt_tiny_settings(model_dir, stub.url, "")
        settings.pop("out")
        decided = []
        for i in range(args.repeats):
            for entry in rows:
                if entry == "flwr run .":
                    seconds, run_report = run_flwr(settings, tmp / f"flwr-{i}", tmp / f"home-{i}")
                else:
                    seconds, run_report = run_cli(settings, tmp / f"cli-{i}")
                rows[entry].append(seconds)
                decided.append(_decided(run_report))
                report.add_result({"name": entry, "repeat": i, "seconds": seconds})
            print(f"repeat {i}: cli {rows['fedcompress ppcgpt'][-1]:.1f} s, "
                  f"flwr run {rows['flwr run .'][-1]:.1f} s", flush=True)
        same = all(d == decided[0] for d in decided)
        medians = {k: statistics.median(v) for k, v in rows.items()}
        report.extra.update({"median_seconds": medians, "same_result": same,
                             "cpus": os.cpu_count()})
        table = markdown_table(["entry point", "median s", "runs (s)", "/ CLI"], [
            [k, f"{medians[k]:.1f}", ", ".join(f"{s:.1f}" for s in v),
             f"{medians[k] / medians['fedcompress ppcgpt']:.2f}x"] for k, v in rows.items()])
        report.sections.append((
            "PPC-GPT wall time by entry point (tiny model, 2 clients, scripted LLM_syn)",
            "Whole command, from start to the report written (model load, Ray or Flower "
            "start-up, both rounds, the dense baseline); alternating runs on this machine "
            f"({os.cpu_count()} CPUs). Same removal plan and accuracies in every run: "
            f"{same}.\n\n{table}"))
    print(report.markdown())


if __name__ == "__main__":
    main()
