"""What every fedcompress ServerApp shares."""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedcompress.methods import Method, settings_from_run_config


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
