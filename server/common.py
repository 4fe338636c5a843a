"""What every fedcompress ServerApp shares."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedcompress.methods import Method, settings_from_run_config
from fedcompress.report import RunReport, default_out, markdown_table


def run_with_report(method: Method, grid: Grid, settings: dict,
                    body: Callable[..., None]) -> RunReport:
    """A method's ServerApp run: its flat settings parsed (one object per settings class, the
    server's last), the output folder (default ``runs/<command>-TIME``), and
    ``body(grid, *settings_objects, report)`` inside a :class:`RunReport` (finished ``ok``, or
    ``failed`` with every result so far on disk)."""
    parts = list(method.parse(settings))
    server = parts[-1]
    out = Path(server.out) if server.out else default_out(method.command)
    parts[-1] = server.replace(out=str(out))
    config: dict = {}
    for part in parts:
        config.update(part.to_dict())
    with RunReport(out, method.command, config, seeds={"seed": parts[0].seed}) as report:
        body(grid, *parts, report)
    return report


def make_server_app(method: Method, run: Callable[[Grid, dict], object],
                    settings: dict | None = None) -> ServerApp:
    """A ServerApp running ``run(grid, settings)`` for ``method``: the given settings (the CLI),
    or the Flower run config's (``flwr run . --run-config 'method="..." <method>.<key>=...'``),
    which must name this method."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        if settings is not None:
            run(grid, settings)
            return
        chosen, from_config = settings_from_run_config(dict(context.run_config))
        if chosen is not method:
            raise ValueError(f"this ServerApp runs method {method.name!r}, the run config "
                             f"names {chosen.name!r}")
        run(grid, from_config)

    return app


#: The start-up split's columns (``clients/startup.py``), in the order of a message's life.
_STARTUP_COLUMNS = (("startup_runtime_seconds", "Flower runtime s"),
                    ("startup_import_seconds", "import s"), ("startup_load_seconds", "load s"),
                    ("client_startup_seconds", "import + load s"),
                    ("compute_seconds", "compute s"),
                    ("startup_worker_seconds", "site worker s"))


def startup_section(records: list[dict]) -> tuple[str, str] | None:
    """A report section of the sites' start-up per message (``records``: a strategy outcome's
    ``startup_split()``): per stage, the mean (min-max) of each column; None without records."""
    if not records:
        return None
    rows = []
    for stage in dict.fromkeys(r.get("stage", "") for r in records):
        mine = [r for r in records if r.get("stage", "") == stage]
        cells = []
        for key, _ in _STARTUP_COLUMNS:
            values = [float(r[key]) for r in mine if key in r]
            cells.append(f"{sum(values) / len(values):.2f} ({min(values):.2f}-{max(values):.2f})"
                         if values else "-")
        rows.append([stage, str(len(mine)), *cells])
    text = markdown_table(["stage", "replies", *(title for _, title in _STARTUP_COLUMNS)], rows)
    return ("Site start-up per message", text + (
        "\n\nMean (min-max) over the replies, seconds. A SuperNode (Flower 1.41) starts a process "
        "per message, so each reply carries its own start-up; under the Simulation Engine a "
        "process serves many messages and its first reply carries the imports and loading. "
        "Flower runtime: from the process's start to the ClientApp (deployed sites only). Site "
        "worker: a site whose SuperNode hands its messages to a warm worker, the exchange "
        "with it (code check, serde, socket, waiting for its lock); '-': no worker."))
