"""The one ClientApp of the fedcompress FAB: every method's actions, dispatched by message type.

Each method of the registry (:mod:`fedcompress.methods`) names its actions (``train.masks``,
``query.perturb``, ...) and the handler of each in its ClientApp module (``clients/<method>.py``);
that module is imported when a message of the method first arrives, not before.

Every reply with a ``metrics`` record also carries this process's start-up split
(:mod:`clients.startup`): the seconds of imports and of loading not reported yet, and the
handler's compute. Flower 1.41 starts a process per message at a SuperNode, so there each reply
carries its own message's start-up.
"""

from __future__ import annotations

from clients import startup  # first: the imports below are timed

with startup.timed(startup.IMPORT):
    import importlib

    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp

    from fedcompress.methods import methods


def _handler(module: str, function: str):
    def handle(message: Message, context: Context) -> Message:
        started = startup.message_started()
        with startup.timed(startup.IMPORT):
            handler = getattr(importlib.import_module(module), function)
        reply = handler(message, context)
        if not reply.has_error() and "metrics" in reply.content:
            metrics = reply.content["metrics"]
            for key, value in startup.message_metrics(started).items():
                metrics[key] = value
        return reply

    handle.__name__ = function
    return handle


def build_client_app() -> ClientApp:
    """A ClientApp serving the actions of every registered method."""
    client_app = ClientApp()
    for method in methods().values():
        for action, function in method.actions.items():
            kind, _, name = action.partition(".")
            register = {"train": client_app.train, "evaluate": client_app.evaluate,
                        "query": client_app.query}[kind]
            register(name)(_handler(method.client_module, function))
    return client_app


with startup.timed(startup.IMPORT):  # the registry imports every method's settings module
    app = build_client_app()
