"""PrunePrivyTune's ClientApp handlers (a site): its cosine matrix, DP-LoRA rounds, the audit.

The one ClientApp of the FAB (``clients/app.py``) calls these for the message types the method
declares (``fedcompress.methods.privytune.METHOD.actions``):

* ``query.cosines``: the ``(L+1) x (L+1)`` pairwise cosine matrix of the base model's hidden
  states on this site's texts (an ``ArrayRecord`` ``matrix``) and how many texts it covers.
* ``train.dplora``: the server's global trainable weights (``arrays``) and the settings with the
  removal plan (``config``); the site trains them on its data with DP-SGD for one round and
  returns its weights, its example count (``num-examples``, FedAvg's weight) and the epsilon its
  own ledger has spent in this run (``epsilon_spent``, ``ledger_*``). The site's policy bounds
  epsilon and delta, refuses DP off, a known noise seed, and rounds beyond the run's budget;
  its Poisson sampling and noise come from OS entropy (:func:`fedcompress.methods.privytune.
  site_train`).
  Under client-side central DP (``central_dp="client"``) the reply passes through Flower's
  ``fixedclipping_mod``: the site's update (its weights minus the global ones) is clipped to
  the norm the server's DP wrapper sent.
* ``query.attack``: the final global weights; the site runs the extraction attack with its
  training texts as members and its held-out texts as non-members; only the scores leave.

The base model is loaded once per process (cached) and never mutated.
"""

from __future__ import annotations

import logging

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp.mod import fixedclipping_mod
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from clients.common import cached_model
from fedcompress.methods import privytune as ppt
from fedcompress.models import resolve_model_spec
from fedcompress.privacy.site import ledger as site_ledger
from fedcompress.privacy.site import policy as site_policy

logger = logging.getLogger(__name__)


def _setup(message: Message, context: Context):
    settings = dict(message.content["config"])
    removed = ppt.parse_removed(str(settings.pop("removed", "none")))
    settings.pop("server-round", None)
    settings.pop(KEY_CLIPPING_NORM, None)  # Flower's client-side DP wrapper, for its mod
    config = ppt.PrivyTuneConfig.from_dict(settings)
    partition = int(context.node_config.get("partition-id", -1))
    return config, partition, ppt.site_data(config, partition), removed


def _model(config, data, removed, arrays: ArrayRecord | None):
    base, tokenizer = cached_model(config.model, config.dtype)
    path = resolve_model_spec(config.model)[1]
    model = ppt.initial_model(config, base, path, tokenizer, data.label_names, removed)
    if arrays is not None:
        ppt.load_trainable(model, {k: a.numpy() for k, a in arrays.items()})
    return model, tokenizer


def cosines(message: Message, context: Context) -> Message:
    """Round 0: this site's pairwise cosine matrix."""
    config, partition, data, _ = _setup(message, context)
    base, tokenizer = cached_model(config.model, config.dtype)
    matrix = ppt.site_cosines(config, base, tokenizer, data)
    return Message(RecordDict({
        "matrix": ArrayRecord({"cosine": Array(np.asarray(matrix.matrix, dtype=np.float64))}),
        "metrics": MetricRecord({"partition": partition, "n_examples": matrix.n_examples,
                                 "n_tokens": matrix.n_tokens,
                                 "seconds": float(matrix.info["seconds"])})}),
        reply_to=message)


def train(message: Message, context: Context) -> Message:
    """One DP-LoRA round on this site's data (its update clipped by Flower's
    ``fixedclipping_mod`` under client-side central DP)."""
    if message.content["config"].get("central_dp") == "client":
        if KEY_CLIPPING_NORM not in message.content["config"]:
            raise ValueError(f"central_dp='client' but the message carries no "
                             f"{KEY_CLIPPING_NORM!r}: the server must wrap its strategy in "
                             "DifferentialPrivacyClientSideFixedClipping")
        return fixedclipping_mod(message, context, _train)
    return _train(message, context)


def _train(message: Message, context: Context) -> Message:
    config, partition, data, removed = _setup(message, context)
    server_round = int(message.content["config"]["server-round"])
    model, tokenizer = _model(config, data, removed, message.content["arrays"])
    encoded = ppt.encode(config, tokenizer, data.train_texts, data.train_labels,
                         data.label_names, not ppt.is_encoder(model))
    policy = site_policy(context.node_config)
    metrics = ppt.site_train(config, model, encoded, ppt.pad_id(tokenizer), server_round,
                             partition, policy, site_ledger(policy, context.run_id),
                             str(context.run_id))
    arrays = ArrayRecord({k: Array(v) for k, v in ppt.trainable_arrays(model).items()})
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(
        {"partition": partition, "round": server_round, **metrics})}), reply_to=message)


def attack(message: Message, context: Context) -> Message:
    """The extraction audit of the final global model on this site's data."""
    config, partition, data, removed = _setup(message, context)
    model, tokenizer = _model(config, data, removed, message.content["arrays"])
    result = ppt.site_attack(config, model, tokenizer, data)
    return Message(RecordDict({"metrics": MetricRecord(
        {"partition": partition, **ppt.attack_metrics(result)})}), reply_to=message)
