"""The in-process ClientApp: every method's actions registered on one Flower ClientApp, each run
through :func:`clients.operations.run_operation` (wrapped, at a simulated site, in the
simulation's faults and attacks, :func:`clients.simulated.run`).

:mod:`clients.app` runs it for a simulated site or one in ``site-mode="development"``
(:func:`local_app`), and re-exports its names (their import path before this module); the site
agent imports it when it warms up (:func:`clients.site_socket.warm_up`). The registry is read at
a process's first message (:func:`local_app`: it imports every method's settings module, and
torch), and a handler's module when a message of its method first arrives. Its imports are
timed by its importer (:mod:`clients.app` imports it within its own timed block: a block here
would count them twice).
"""

from __future__ import annotations

import functools

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients import startup
from clients.operations import Operation, run_operation


def _operation(op: Operation):
    def handle(message: Message, context: Context) -> Message:
        if is_simulated(context):  # the same operation, wrapped in the simulation's faults
            from clients import simulated  # and attacks (never at a deployed site)

            return simulated.run(op, message, context)
        return run_operation(op, message, context)

    handle.__name__ = op.function
    return handle


def build_client_app() -> ClientApp:
    """A ClientApp serving the actions of every registered method."""
    from fedcompress.methods import methods

    client_app = ClientApp()
    for method in methods().values():
        for action, function in method.actions.items():
            kind, _, name = action.partition(".")
            register = {"train": client_app.train, "evaluate": client_app.evaluate,
                        "query": client_app.query}[kind]
            register(name)(_operation(Operation(
                method.name, action, method.client_module, function,
                method.clear_releases.get(action, ""))))
    return client_app


@functools.cache
def local_app() -> ClientApp:
    """This process's ClientApp of every method's actions, built at its first message (the
    registry imports every method's settings module, and torch: timed as imports)."""
    with startup.timed(startup.IMPORT):
        return build_client_app()


def is_simulated(context: Context) -> bool:
    """Whether the site of ``context`` is simulated (its node config,
    :func:`fedcompress.privacy.site.is_simulated`)."""
    from fedcompress.privacy import site

    return site.is_simulated(context.node_config)
