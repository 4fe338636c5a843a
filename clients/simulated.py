"""A simulated site's own behaviour: fault injection and Byzantine attack models.

A simulated site (a virtual site of the Simulation Engine, or a harness whose node config says
``site-mode="simulation"``) runs the very operations a deployed site's agent runs
(:func:`clients.operations.run_operation`); this module wraps them, and only them
(:func:`run`, called by the in-process ClientApp, :mod:`clients.local`, for a simulated site):

* **attack models** (FedPrLLM's ``attackers``/``attack``): the operation's mask pass is handed
  an attack (:data:`clients.fedprllm.SIMULATED_MASKS`, a hook that is unset everywhere else), so
  that an attacker's masks go through the same encoding, SecAgg+ masking and ledger as an honest
  site's (:func:`fedcompress.methods.fedprllm.attacks.attack_masks`);
* **faults** (FedPrLLM's ``faulty``/``fault``/``fault_layer``/``fault_seconds``): applied to the
  operation's reply, from the round of decoder layer ``fault_layer`` on, at the last ``faulty``
  partitions: an error, a truncated payload (what a broken transfer delivers), a late reply, or
  the death of the process (``kill``: no reply at all, as a crashed or OOM-killed process; under
  the Simulation Engine, its Ray actor).

The deployed site's code path never imports this module: its agent calls ``run_operation``
directly, and its policy refuses every such switch before any work
(:meth:`fedcompress.privacy.policy.SitePolicy.check_simulation_switches`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from flwr.app import Array, Message

logger = logging.getLogger(__name__)

#: the records of a reply that carry a site's payload (masks, masked SecAgg+ votes, statistics)
PAYLOADS = ("masks", "masked", "stats")


def run(op: Any, message: Message, context: Any) -> Message:
    """``op`` on ``message`` at a simulated site, with the attack and the fault its settings
    ask for (module docstring)."""
    from clients import fedprllm
    from clients.operations import run_operation

    config = _fedprllm_config(op, message)
    token = None
    if config is not None and config.attackers:
        token = fedprllm.SIMULATED_MASKS.set(_attack)
    try:
        reply = run_operation(op, message, context)
    finally:
        if token is not None:
            fedprllm.SIMULATED_MASKS.reset(token)
    if config is not None and config.faulty:
        reply = _fault(config, message, reply)
    return reply


def _fedprllm_config(op: Any, message: Message) -> Any:
    """The run's FedPrLLM settings, or None (another method, no settings, or settings the
    operation itself will refuse)."""
    if op.method != "fedprllm" or "config" not in message.content:
        return None
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig

    try:
        return FedPrLLMConfig.from_dict(dict(message.content["config"]))
    except Exception:  # the operation reports it, as at any site
        return None


def _attack(message: Message, context: Any, config: Any, partition: int, model: Any,
            windows: Any) -> list | None:
    """An attacker partition's masks under ``config.attack``; None at an honest partition."""
    from clients.fedprllm import _setup
    from fedcompress.methods.fedprllm.attacks import attack_masks, is_attacker

    if not is_attacker(partition, config.attackers):
        return None
    first = _setup(message, context, partition_of=0)[3] if config.attack == "collude" else None
    logger.warning("partition %d attacks (%s)", partition, config.attack)
    return attack_masks(config.attack, model, windows, config.prune, config.seed, partition,
                        config.batch_size, first)


def _fault(config: Any, message: Message, reply: Message) -> Message:
    """The reply as the settings' fault leaves it (module docstring)."""
    if reply.has_error() or "metrics" not in reply.content:
        return reply
    names = [name for name in PAYLOADS if name in reply.content]
    metrics = reply.content["metrics"]
    if not names or "partition" not in metrics:
        return reply
    partition = int(metrics["partition"])
    if "layer" in metrics:
        layer = int(metrics["layer"])
    elif "round" in message.content:
        layer = int(message.content["round"]["layer"])
    else:
        layer = 0
    if partition < config.clients - config.faulty or layer < config.fault_layer:
        return reply
    logger.warning("partition %d (layer %d): injected fault %s", partition, layer, config.fault)
    if config.fault == "kill":
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(1)  # no clean-up, no reply: what the OOM killer leaves
    if config.fault == "error":
        raise RuntimeError(f"injected fault: partition {partition} fails")
    if config.fault == "slow":
        time.sleep(config.fault_seconds)
        return reply
    arrays = reply.content[names[0]]
    first = sorted(arrays.keys())[0]
    arrays[first] = Array(arrays[first].numpy()[:-1])
    return reply
