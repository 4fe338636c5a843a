"""A site's operations: every method's actions of the registry (:class:`Operation`,
:func:`operations`) and :func:`run_operation`, the one path each of them takes at a site: the
site's policy first, then the handler from the site's installed code, the ledger, the start-up
split, and an error reply that names settings and bounds but no private value
(:func:`error_reply`).

The site agent (:mod:`clients.site_agent`) runs them for a deployed site, the in-process
ClientApp (:mod:`clients.local`) for a simulated site (through :mod:`clients.simulated`) or one
in ``site-mode="development"``; ``clients.site_agent`` re-exports these names (their import
path before this module).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from clients import startup

#: the site agent's logger, whose records these were before the split (a site's log is unchanged)
logger = logging.getLogger("fedcompress.site_agent")


@dataclass(frozen=True)
class Operation:
    """One site operation: a method's action and its handler in the site's installed code."""

    method: str
    action: str
    module: str
    function: str
    clear: str = ""  # what it releases in the clear (the method's clear_releases)


def operations() -> dict[str, Operation]:
    """Every site operation of the registry, by message type."""
    from fedcompress.methods import methods

    return {action: Operation(m.name, action, m.client_module, function,
                              m.clear_releases.get(action, ""))
            for m in methods().values() for action, function in m.actions.items()}


def error_reply(message: Any, reason: str) -> Any:
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode

    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                   reply_to=message)


def run_operation(op: Operation, message: Any, context: Any) -> Any:
    """``op`` on ``message`` at the site whose node config and state ``context`` holds: the
    site's policy first (:func:`fedcompress.privacy.site.admit`), then the handler; a release
    that is not DP is recorded in the ledger, every reply with metrics carries what the ledger
    says and this process's start-up split. A refusal names the value, the bound and the key;
    any other error of a deployed site names the action and the error's class only
    (:func:`fedcompress.privacy.site.public_error`; in simulation it propagates)."""
    import importlib

    started = startup.message_started()
    with startup.timed(startup.IMPORT):
        handler = getattr(importlib.import_module(op.module), op.function)
        from fedcompress.privacy import site
        from fedcompress.privacy.ledger import LedgerError
        from fedcompress.privacy.policy import PolicyError
    simulated = site.is_simulated(context.node_config)
    try:
        config = message.content["config"] if "config" in message.content else None
        policy = site.admit(context.node_config, config, op.action, op.clear)
        with site.admitted(context.node_config, policy):  # read once per message
            reply = handler(message, context)
        if not reply.has_error() and "metrics" in reply.content:
            metrics = reply.content["metrics"]
            if "ledger_dp" not in metrics:  # a DP release records itself before it happens
                for key, value in site.record_release(policy, context.run_id, op.method,
                                                      op.action).items():
                    metrics[key] = value
            for key, value in startup.message_metrics(started).items():
                metrics[key] = value
    except PolicyError as err:
        logger.warning("%s refused by this site's policy: %s", op.action, err)
        return error_reply(message, f"refused by the site's policy: {err}")
    except LedgerError as err:
        logger.error("%s refused: %s", op.action, err)
        return error_reply(message, "refused by the site's policy: " + (
            str(err) if simulated else "its privacy ledger refuses every release (damaged, "
            "truncated or rolled back); the site's log names the file"))
    except Exception as err:
        if simulated:  # the server runs the sites: its error, as the runtime reports it
            raise
        # a deployed site says what failed, not why: an exception's text may quote the site's
        # data (a record's field, a path); the site's own log has it
        logger.exception("%s failed at this site", op.action)
        return error_reply(message, site.public_error(op.action, err))
    return reply
