"""FedPrLLM server strategies: collect client prune masks, validate them, vote.

:class:`FedPrLLM` (one-shot: one round, every layer) and :class:`IterativeFedPrLLM` (one round
per decoder layer; the global mask of each layer is broadcast with the next round's request)
are Flower :class:`~flwr.serverapp.strategy.Strategy` subclasses; the math lives in
:mod:`fedcompress.methods.fedprllm.federated` and :mod:`fedcompress.masks.aggregate`.

A reply that is an error, or whose masks fail validation (names, shapes, dtype, sparsity), is
logged with its reason and left out of the vote (:func:`strategies.common.collect_valid_replies`);
the round fails with :class:`NotEnoughClientsError` when fewer than ``config.required_clients``
valid masks remain. What a run gathered is in :attr:`FedPrLLM.outcome`.

The strategies, by module (each importing only those listed before it):

* :mod:`strategies.fedprllm.oneshot`: :class:`FedPrLLM`, the one-shot vote, which the others
  extend;
* :mod:`strategies.fedprllm.iterative`: :class:`IterativeFedPrLLM`, one round per decoder
  layer (resync, checkpoints, resume);
* :mod:`strategies.fedprllm.secure`: the vote summed by SecAgg+ (:class:`SecureFedPrLLM`,
  :class:`SecureIterativeFedPrLLM`);
* :mod:`strategies.fedprllm.stats`: the statistics mode, plain and summed by SecAgg+
  (:class:`StatsFedPrLLM`, :class:`SecureStatsFedPrLLM`);
* :mod:`strategies.fedprllm.fedspallm`: the peer system FedSpaLLM (:class:`FedSpaLLMStrategy`:
  the sites' pruned weights, l0-averaged);

and :func:`make_strategy` here, which picks one from the config.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from fedcompress.methods.fedprllm.config import FedPrLLMConfig
from strategies.common import NotEnoughClientsError
from strategies.fedprllm.fedspallm import FedSpaLLMStrategy
from strategies.fedprllm.iterative import IterativeFedPrLLM
from strategies.fedprllm.oneshot import FedPrLLM
from strategies.fedprllm.secure import SecureFedPrLLM, SecureIterativeFedPrLLM
from strategies.fedprllm.stats import SecureStatsFedPrLLM, StatsFedPrLLM

__all__ = ["FedPrLLM", "FedSpaLLMStrategy", "IterativeFedPrLLM", "NotEnoughClientsError",
           "SecureFedPrLLM", "SecureIterativeFedPrLLM", "SecureStatsFedPrLLM", "StatsFedPrLLM",
           "make_strategy"]

logger = logging.getLogger(__name__)


def make_strategy(config: FedPrLLMConfig, model: torch.nn.Module,
                  reference_wire: dict | None = None, checkpoint: Path | None = None,
                  tokenizer=None, spill: Path | None = None) -> FedPrLLM:
    """The strategy of ``config``; ``tokenizer``: for the public clip windows of DP
    statistics (``--dp-epsilon`` with the default ``--dp-clip``); ``spill``: a folder for
    FedSpaLLM's sum (:class:`~fedcompress.methods.fedspallm.L0Sum`, memory-mapped there)."""
    if config.aggregate == "fedspallm":
        return FedSpaLLMStrategy(config, model, spill=spill)
    if config.aggregate == "stats":
        if not config.secagg:
            logger.warning("statistics mode without --secagg: the server sees each site's "
                           "per-layer input statistics (column square sums%s) in the clear; "
                           "with --secagg it sees only their sum",
                           ", and the Hessian X^T X of its activations"
                           if config.prune.needs_hessian else "")
        return (SecureStatsFedPrLLM if config.secagg else StatsFedPrLLM)(
            config, model, reference_wire=reference_wire, checkpoint=checkpoint,
            tokenizer=tokenizer)
    if config.secagg and config.mode == "iterative":
        return SecureIterativeFedPrLLM(config, model, reference_wire=reference_wire,
                                       checkpoint=checkpoint)
    if config.secagg:
        return SecureFedPrLLM(config, model, reference_wire=reference_wire)
    if config.mode == "iterative":
        return IterativeFedPrLLM(config, model, reference_wire=reference_wire,
                                 checkpoint=checkpoint)
    return FedPrLLM(config, model, reference_wire=reference_wire)
