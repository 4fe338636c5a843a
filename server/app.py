"""The one ServerApp of the fedcompress FAB: runs the method the run config names.

``flwr run . --run-config 'method="ppcgpt" ppcgpt.clients=8'``: the ``method`` key picks a
method of the registry (:mod:`fedcompress.methods`), its ``<method>.*`` keys are its settings;
its ServerApp module (``server/<method>.py``) is imported only then.
"""

from __future__ import annotations

import importlib

# Imported here, at module level, on purpose. `flwr run` (simulation runtime) imports this module
# in its ServerApp thread while its main thread imports the ClientApp module, which imports
# transformers. transformers replaces itself in sys.modules (a lazy module) at the end of its
# import, and a thread that meets it half-imported is handed the stale module object: a
# `from transformers import AutoConfig` there fails with ImportError (Flower exit code 607).
# An `import transformers` statement waits for the import to complete, so after this line every
# `from transformers import ...` in this thread (e.g. in fedcompress.models) sees the real module.
import transformers  # noqa: F401
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedcompress.methods import settings_from_run_config

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    method, settings = settings_from_run_config(dict(context.run_config))
    importlib.import_module(method.server_module).run(grid, settings)
