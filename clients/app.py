"""The one ClientApp of the fedcompress FAB: every method's actions, dispatched by message type.

Each method of the registry (:mod:`fedcompress.methods`) names its actions (``train.masks``,
``query.perturb``, ...) and the handler of each in its ClientApp module (``clients/<method>.py``);
that module is imported when a message of the method first arrives, not before.
"""

from __future__ import annotations

import importlib

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedcompress.methods import methods


def _handler(module: str, function: str):
    def handle(message: Message, context: Context) -> Message:
        return getattr(importlib.import_module(module), function)(message, context)

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


app = build_client_app()
