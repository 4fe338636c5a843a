"""The one ClientApp of the fedcompress FAB: every method's actions, dispatched by message type.

Each method of the registry (:mod:`fedcompress.methods`) names its actions (``train.masks``,
``query.perturb``, ...) and the handler of each in its ClientApp module (``clients/<method>.py``);
the registry is read at a process's first message (:func:`local_app`: it imports every method's
settings module, and torch), and a handler's module when a message of its method first arrives.

A SuperNode whose ``--node-config`` names a warm site worker (``site-worker="/path/to.sock"``,
:mod:`clients.site_worker`) keeps this process thin: :data:`app` sends each message to that
worker, which runs it through :func:`local_app` as this process would have, and imports
neither torch nor transformers here. Without the key, :data:`app` runs :func:`local_app` itself.

Every reply with a ``metrics`` record also carries this process's start-up split
(:mod:`clients.startup`): the seconds of imports and of loading not reported yet, and the
handler's compute. Flower 1.42 starts a process per message at a SuperNode, so there each reply
carries its own message's start-up.

Every message passes the site's policy first (:mod:`fedcompress.privacy.site`: simulation-only
switches outside simulation, the model, the corpora), and every reply with ``metrics`` carries
what the site's privacy ledger says (``ledger_run_epsilon``, ``ledger_lifetime_epsilon``,
``ledger_lifetime_budget``, ``ledger_dp``: 0 for a release that is not DP, which is recorded
here). A refusal (:class:`~fedcompress.privacy.policy.PolicyError`, or a ledger that cannot be
read) is an error reply whose reason names the value, the bound and the node-config key; the
server's report lists it among the rejected replies.
"""

from __future__ import annotations

from clients import startup  # first: the imports below are timed

with startup.timed(startup.IMPORT):
    import functools
    import logging

    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp

    from clients import site_agent, site_worker

logger = logging.getLogger(__name__)


def _operation(op: site_agent.Operation):
    def handle(message: Message, context: Context) -> Message:
        return site_agent.run_operation(op, message, context)

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
            register(name)(_operation(site_agent.Operation(
                method.name, action, method.client_module, function,
                method.clear_releases.get(action, ""))))
    return client_app


@functools.cache
def local_app() -> ClientApp:
    """This process's ClientApp of every method's actions, built at its first message (the
    registry imports every method's settings module, and torch: timed as imports)."""
    with startup.timed(startup.IMPORT):
        return build_client_app()


class SiteClientApp(ClientApp):
    """The FAB's ClientApp: each message goes to this site's warm worker when its SuperNode
    names one (``site-worker`` node config), else to :func:`local_app` in this process."""

    def __call__(self, message: Message, context: Context) -> Message:
        agent = context.node_config.get(site_agent.NODE_CONFIG_KEY)
        if agent:  # the site's agent holds its data, keys and state: only the message crosses
            return site_agent.relay(str(agent), message)
        path = context.node_config.get(site_worker.NODE_CONFIG_KEY)
        if path:
            return site_worker.forward(str(path), message, context)
        return local_app()(message, context)


app = SiteClientApp()
