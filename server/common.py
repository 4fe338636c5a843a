"""What every fedcompress ServerApp shares."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedcompress.methods import Method, settings_from_run_config
from fedcompress.models import LoadedModel, model_size, save_dtype, save_model, source_dtype
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
    view = SiteLedgers()
    with RunReport(out, method.command, config, seeds={"seed": parts[0].seed}) as report:
        try:
            body(ObservedGrid(grid, view), *parts, report)
        finally:
            view.add_to(report)
    return report


#: Reply metrics a site's privacy ledger fills in (``fedcompress.privacy.site.ledger_metrics``).
_LEDGER_KEYS = ("ledger_run_epsilon", "ledger_lifetime_epsilon", "ledger_lifetime_budget",
                "ledger_dp", "site_policy_enforced", "secrets_reproducible")
_REFUSED = "refused by the site's policy"


class SiteLedgers:
    """What the sites' own ledgers said in their replies (never the server's computation), and
    the sites' policy refusals."""

    def __init__(self) -> None:
        self.sites: dict[int, dict] = {}
        self.refusals: list[dict] = []

    def see(self, reply) -> None:
        node = int(reply.metadata.src_node_id)
        if reply.has_error():
            if _REFUSED in reply.error.reason:
                self.refusals.append({"node": node, "action": reply.metadata.message_type,
                                      "reason": reply.error.reason})
            return
        if "metrics" not in reply.content:
            return
        metrics = reply.content["metrics"]
        seen = {k: metrics[k] for k in _LEDGER_KEYS if k in metrics}
        if not seen:
            return
        entry = self.sites.setdefault(node, {"node": node, "replies": 0, "dp_releases": 0})
        entry["replies"] += 1
        entry["dp_releases"] += int(seen.get("ledger_dp", 0))
        for key in ("ledger_run_epsilon", "ledger_lifetime_epsilon"):  # the ledger only grows
            if key in seen:
                entry[key] = max(float(seen[key]), float(entry.get(key, 0.0)))
        for key in ("ledger_lifetime_budget", "site_policy_enforced", "secrets_reproducible"):
            if key in seen:
                entry[key] = seen[key]

    def add_to(self, report: RunReport) -> None:
        """The report's ``site_ledgers`` / ``site_refusals`` and a section of both."""
        if not self.sites and not self.refusals:
            return
        rows = sorted(self.sites.values(), key=lambda r: r["node"])
        report.extra["site_ledgers"] = rows
        report.extra["site_refusals"] = self.refusals

        def cell(row: dict, key: str) -> str:
            return f"{row[key]:.4g}" if key in row else "-"

        table = markdown_table(
            ["site (node)", "replies", "DP releases", "run epsilon", "lifetime epsilon",
             "lifetime budget", "policy", "secret draws"],
            [[str(r["node"]), str(r["replies"]), str(r["dp_releases"]),
              cell(r, "ledger_run_epsilon") if r["dp_releases"] else "none: not DP",
              cell(r, "ledger_lifetime_epsilon"), cell(r, "ledger_lifetime_budget"),
              "enforced" if r.get("site_policy_enforced") else "simulation (not enforced)",
              "no: research seed, guarantee does NOT hold" if r.get("secrets_reproducible")
              else "yes"] for r in rows])
        text = (table + "\n\nWhat each site's own privacy ledger said in its last replies "
                "(its accountant over all of this run's steps at the mechanism it fixed at the "
                "run's first round; lifetime: the sum over every run at that site), not what "
                "the server computed.")
        if self.refusals:
            text += "\n\nRefused by a site's policy:\n\n" + "\n".join(
                f"- node {r['node']} ({r['action']}): {r['reason']}" for r in self.refusals)
        report.sections.append(("Site privacy ledgers", text))


class ObservedGrid:
    """A Grid whose replies :class:`SiteLedgers` sees on their way to the strategy (every other
    attribute is the Grid's own)."""

    def __init__(self, grid: Grid, view: SiteLedgers) -> None:
        self._grid = grid
        self._view = view

    def __getattr__(self, name: str):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *args, **kwargs):
        replies = list(self._grid.send_and_receive(messages, *args, **kwargs))
        for reply in replies:
            self._view.see(reply)
        return replies

    def pull_messages(self, *args, **kwargs):
        replies = list(self._grid.pull_messages(*args, **kwargs))
        for reply in replies:
            self._view.see(reply)
        return replies


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
        "\n\nMean (min-max) over the replies, seconds. A SuperNode (Flower 1.42) starts a process "
        "per message, so each reply carries its own start-up; under the Simulation Engine a "
        "process serves many messages and its first reply carries the imports and loading. "
        "Flower runtime: from the process's start to the ClientApp (deployed sites only). Site "
        "worker: a site whose SuperNode hands its messages to a warm worker, the exchange "
        "with it (code check, serde, socket, waiting for its lock); '-': no worker."))


def save_run_model(report: RunReport, model, folder: Path, tokenizer, loaded: LoadedModel,
                   dense, setting: str, run_dtype: str, quantized=None) -> None:
    """Save a run's compressed ``model`` in ``folder`` in its smallest faithful dtype
    (:func:`~fedcompress.models.saving.save_dtype` of the run's ``save_dtype`` setting, its
    ``dtype`` and the input model ``loaded``) and report its size next to the ``dense`` input
    model's (:meth:`~fedcompress.report.RunReport.add_model_size`). ``quantized``: ``(layers,
    quant_config)``, the solver's :class:`~fedcompress.quant.compressed_tensors.PackedLinear` by
    linear layer name and its recipe: the model is saved as a compressed-tensors
    ``pack-quantized`` folder (:func:`~fedcompress.quant.compressed_tensors.save_quantized`)
    in its scales' dtype (:func:`quantized_save_dtype`)."""
    if quantized is None:
        saved = save_model(model, folder, tokenizer, save_dtype(setting, run_dtype, loaded))
    else:
        from fedcompress.quant.compressed_tensors import save_quantized

        layers, quant_config = quantized
        saved = save_quantized(model, folder, layers, quant_config, tokenizer,
                               quantized_save_dtype(setting, quant_config))
    report.add_model_size(model_size(saved, dense, source_dtype(loaded)))


def quantized_save_dtype(setting: str, quant_config):
    """The dtype a quantized model is saved in: its scales' (``auto``), so that the runtime's
    ``(q - zero_point) * scale``, computed in the scales' saved dtype, gives the weights the
    run evaluated (exactly in a float32 load); another named dtype is refused (call this
    before any work)."""
    from fedcompress.models.common import parse_dtype

    if setting not in ("auto", quant_config.scale_dtype):
        raise ValueError(f"save_dtype {setting!r} with quantization scales in "
                         f"{quant_config.scale_dtype}: expected auto or "
                         f"{quant_config.scale_dtype} (the runtime dequantizes in the scales' "
                         "saved dtype; another one would change the weights the run "
                         "evaluated: set the scale dtype instead)")
    return parse_dtype(quant_config.scale_dtype)
