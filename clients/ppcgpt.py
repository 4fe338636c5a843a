"""PPC-GPT's ClientApp handlers: perturb private text (round 1); rebuild, evaluate and retrain the
server's compressed model on private labelled data (round 2).

The one ClientApp of the FAB (``clients/app.py``) calls these for the message types the method
declares (``fedcompress.methods.ppcgpt.METHOD.actions``):

* ``query.perturb``: this node's questions and choices, perturbed by the exponential mechanism
  (``eps`` per word), as a JSON list in a ``ConfigRecord``; the privacy budget spent in a
  ``MetricRecord``, with what the site's ledger says (``ledger_*``). Labels never leave the
  node. The site's policy bounds ``eps`` per word (``max-epsilon``), refuses a seed the server
  knows, and records the release in its ledger before perturbing anything.
* ``train.retrain``: the server sends the removal plan and the LoRA adapter; the node rebuilds
  the compressed model from its own copy of the base model, measures its accuracy on its private
  test data, retrains the adapter on its private labelled data and measures again.

The base model is loaded once per process (cached) and never mutated.
"""

from __future__ import annotations

import json
import logging
import time

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from clients.common import cached_model
from fedcompress.methods.ppcgpt import (
    PPCGPTConfig,
    client_data,
    client_retrain,
    client_text,
    rebuild_model,
)
from fedcompress.privacy.site import ledger as site_ledger
from fedcompress.privacy.site import policy as site_policy

logger = logging.getLogger(__name__)


def _setup(message: Message, context: Context):
    config = PPCGPTConfig.from_dict(dict(message.content["config"]))
    partition = int(context.node_config.get("partition-id", -1))
    return config, partition, client_data(config, partition)


def perturb(message: Message, context: Context) -> Message:
    """Round 1: this node's perturbed questions and choices."""
    start = time.perf_counter()
    config, partition, data = _setup(message, context)
    policy = site_policy(context.node_config)
    examples, budget = client_text(config, data, policy, site_ledger(policy, context.run_id),
                                   str(context.run_id))
    text = json.dumps(examples, ensure_ascii=False)
    metrics = {k: float(v) for k, v in budget.items()}
    metrics.update({"partition": partition, "examples": len(examples),
                    "bytes_up": len(text.encode("utf-8")),
                    "seconds": time.perf_counter() - start})
    return Message(RecordDict({"text": ConfigRecord({"examples": text}),
                               "metrics": MetricRecord(metrics)}), reply_to=message)


def retrain(message: Message, context: Context) -> Message:
    """Round 2: rebuild the compressed model, accuracy before ("S") and after ("C") retraining."""
    config, partition, data = _setup(message, context)
    base, tokenizer = cached_model(config.model, config.dtype)
    removed = [int(i) for i in message.content["plan"]["removed"]]
    adapter = {k: a.numpy() for k, a in message.content["adapter"].items()}
    model = rebuild_model(base, removed, adapter, config.lora())
    result = client_retrain(model, tokenizer, data, config)
    metrics = {"partition": partition, "seconds": result["seconds"], "steps": result["steps"],
               "train_loss_first": result["train_loss_first"],
               "train_loss_last": result["train_loss_last"]}
    for side in ("server", "client"):
        metrics.update({f"{side}_{k}": float(v) for k, v in result[side].items()})
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=message)
