"""The one ClientApp of the fedcompress FAB: every method's actions, dispatched by message type.

Each method of the registry (:mod:`fedcompress.methods`) names its actions (``train.masks``,
``query.perturb``, ...) and the handler of each in its ClientApp module (``clients/<method>.py``);
the registry is read at a process's first message (:func:`local_app`, of :mod:`clients.local`,
re-exported here: it imports every method's settings module, and torch), and a handler's module
when a message of its method first arrives.

A deployed site's SuperNode names its site agent (``site-agent="/path/to.sock"``,
:mod:`clients.site_agent`): :data:`app` relays each message to the agent, which alone holds the
site's data, keys, policy and ledger and runs the operation from the site's own installed code;
this process (the server's code) imports neither torch nor transformers. (The warm site worker
that ran this ClientApp at the SuperNode's uid, ``site-worker``, is retired: a node config
naming it is refused.) Without ``site-agent``, :data:`app` runs :func:`local_app` itself,
which only a simulated site or one in ``site-mode="development"`` may do: a deployed site
without an agent refuses every message.

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
    import logging

    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp

    from clients import site_agent

    # the in-process ClientApp, a module of its own (the site agent's warm-up imports it);
    # re-exported here, where it was first defined
    from clients.local import (  # noqa: F401 (this module's public names)
        build_client_app,
        is_simulated,
        local_app,
    )
    from clients.operations import error_reply

logger = logging.getLogger(__name__)


class SiteClientApp(ClientApp):
    """The FAB's ClientApp: each message goes to this site's agent (``site-agent`` node config)
    when its SuperNode names one; else, in simulation or at a site in
    ``site-mode="development"``, to :func:`local_app` in this process. A deployed site
    without an agent is refused: its SuperNode would run the operations, and so hold the site's
    data, keys and ledger, in the process that runs the server's code.

    That refusal is the honest FAB's, a guard against a site set up wrongly; a server's own FAB
    would skip it, which is why the deployment gives the SuperNode's ClientApp nothing to take
    (``docker/compose.yml``: its container mounts only the agent's socket)."""

    def __call__(self, message: Message, context: Context) -> Message:
        agent = context.node_config.get(site_agent.NODE_CONFIG_KEY)
        if agent:  # the site's agent holds its data, keys and state: only the message crosses
            return site_agent.relay(str(agent), message)
        if "site-worker" in context.node_config:
            logger.error("refused %s: the node config names the retired site worker",
                         message.metadata.message_type)
            return error_reply(message, (
                "refused by the site: this SuperNode's node config names a site worker "
                "(site-worker), which fedcompress no longer has; start `fedcompress site-agent "
                f"--config FILE` and name its socket as {site_agent.NODE_CONFIG_KEY}=\"PATH\""))
        mode = str(context.node_config.get("site-mode", "") or "")
        if mode != "development" and not is_simulated(context):
            logger.error("refused %s: no site agent (node config %s)",
                         message.metadata.message_type, site_agent.NODE_CONFIG_KEY)
            return error_reply(message, (
                f"refused by the site: this SuperNode's node config names no site agent "
                f"({site_agent.NODE_CONFIG_KEY}=\"PATH\" of `fedcompress site-agent`'s "
                "socket), and a deployed site runs the server's code only beside its agent; "
                "site-mode=\"development\" runs the operations in the SuperNode's ClientApp "
                "process instead (a test bench, never a site with private data)"))
        return local_app()(message, context)


app = SiteClientApp()
