"""What every fedcompress ServerApp shares."""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp


def make_server_app(run: Callable[[Grid, dict], object], settings: dict | None = None
                    ) -> ServerApp:
    """A ServerApp running ``run(grid, settings)``: the given settings (the CLI), or the Flower
    run config (``flwr run . --run-config ...``)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run(grid, settings if settings is not None else dict(context.run_config))

    return app
