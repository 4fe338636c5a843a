"""PrunePrivyTune's server strategy: Flower's own FedAvg over the sites' DP-trained weights.

:class:`PrivyTuneFedAvg` is :class:`flwr.serverapp.strategy.FedAvg` with one change per hook:

* ``configure_train`` sends FedAvg's messages as ``train.dplora`` (the one ClientApp serves
  several methods, so message types carry the action name);
* ``aggregate_train`` validates each reply first (:func:`strategies.common.
  collect_valid_replies`: the same weight names and shapes as the global model, finite values,
  an example count, an epsilon spent within the target) and records every valid site's metrics
  (its epsilon after the round) in :attr:`outcome`; FedAvg then averages the valid replies,
  weighted by ``num-examples``.

Round 0 (:meth:`collect_cosines`) and the audit (:meth:`collect_attacks`) are queries.

**Site-level central DP** (``central_dp``, optional, on top of each site's record-level DP-SGD):
:func:`training_strategy` wraps a FedAvg in Flower's own
:class:`~flwr.serverapp.strategy.DifferentialPrivacyServerSideFixedClipping` (the server clips
each site's update to ``central_clip``) or :class:`~flwr.serverapp.strategy.
DifferentialPrivacyClientSideFixedClipping` (each site clips its own with Flower's
``fixedclipping_mod``), which add Gaussian noise of std ``central_noise * central_clip / sites``
to the average, and Flower's RDP accountant (no sampling amplification: every site takes part in
every round) reports the site-level (epsilon, delta) after every round. The wrapped FedAvg keeps
Flower's own ``aggregate_train`` (the accountant requires it) with equal site weights
(``site-weight``); replies are validated before the wrapper sees them, and a run under central
DP needs every site's valid reply in every round. The noise is secret (fresh OS entropy) unless
``central_noise_seed >= 0`` asks for reproducible noise, which voids the reported epsilon.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    FedAvgM,
    Strategy,
)
from flwr.supercore.privacy_accounting import (
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

from fedcompress.layers.redundancy import CosineMatrix
from fedcompress.methods.privytune import PrivyTuneConfig, removed_text
from fedcompress.privacy.accounting import noise_seed
from strategies.common import (
    STARTUP_KEYS,
    RecordsReplies,
    StrategyOutcome,
    settings_record,
)

__all__ = ["PrivyTuneFedAvg", "central_noise_seed", "training_strategy"]

logger = logging.getLogger(__name__)

#: Slack on a site's reported epsilon (the accountant's noise search stops within 0.01).
EPSILON_SLACK = 1e-6


class _DPLoRAMessagesMixin:
    """FedAvg's training messages sent as ``train.dplora`` (the one ClientApp serves several
    methods), their bytes counted in ``self.outcome``."""

    outcome: StrategyOutcome

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        messages = [Message(m.content, m.metadata.dst_node_id, "train.dplora",
                            group_id=m.metadata.group_id)
                    for m in super().configure_train(  # type: ignore[misc]
                        server_round, arrays, config, grid)]
        self.outcome.bytes_down += sum(sum(r.count_bytes() for r in m.content.values())
                                       for m in messages)
        return messages


class DPLoRAMessages(_DPLoRAMessagesMixin, FedAvg):
    """Flower's plain FedAvg with PrunePrivyTune's messages (the one inside a central-DP
    wrapper: Flower's accountant accepts nothing else)."""


class PrivyTuneFedAvg(RecordsReplies, _DPLoRAMessagesMixin, FedAvgM):
    """FedAvg over the sites' trainable weights (LoRA factors and head, or every weight).

    Flower's :class:`~flwr.serverapp.strategy.FedAvgM` with ``server_lr`` 1 and no momentum
    (the defaults) is exactly FedAvg (it leaves FedAvg's average untouched); ``server_lr``
    ``eta`` moves the global weights by ``eta`` times the average update (``server_momentum``:
    with heavy-ball momentum), which is post-processing of the sites' DP outputs.
    """

    def __init__(self, config: PrivyTuneConfig, shapes: dict[str, tuple[int, ...]],
                 removed: list[int], node_wait: float = 120.0):
        required = config.required_clients
        super().__init__(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=required,
                         min_evaluate_nodes=0, min_available_nodes=required,
                         server_learning_rate=config.server_lr,
                         server_momentum=config.server_momentum)
        self.config = config
        self.shapes = dict(shapes)
        self.removed = list(removed)
        self.node_wait = node_wait
        self.outcome = StrategyOutcome()

    def site_config(self) -> ConfigRecord:
        """The settings every message carries and the removal plan."""
        return settings_record(self.config, removed=removed_text(self.removed))

    # -- round 0 ---------------------------------------------------------------------------------
    def collect_cosines(self, grid: Grid, timeout: float, size: int) -> list[CosineMatrix]:
        """Every site's cosine matrix (validated: ``size x size`` (the base model's ``L + 1``
        states), finite, in [-1, 1] up to rounding)."""
        content = RecordDict({"config": self.site_config()})
        nodes = self._nodes(grid)
        self.outcome.bytes_down += len(nodes) * sum(r.count_bytes() for r in content.values())
        replies = grid.send_and_receive(
            [Message(content, node, "query.cosines") for node in nodes], timeout=timeout)

        def validate(reply: Message) -> CosineMatrix:
            matrix = reply.content["matrix"]["cosine"].numpy()
            metrics = dict(reply.content["metrics"])
            if matrix.shape != (size, size):
                raise ValueError(f"cosine matrix of shape {matrix.shape}: expected "
                                 f"{(size, size)}")
            if not np.isfinite(matrix).all() or np.abs(matrix).max() > 1 + 1e-4:
                raise ValueError("cosine matrix holds values outside [-1, 1]")
            n = int(metrics["n_examples"])
            if n < 1:
                raise ValueError(f"n_examples={n}: expected >= 1")
            return CosineMatrix(tuple(tuple(float(x) for x in row) for row in matrix), n,
                                int(metrics.get("n_tokens", 0)))

        return [m for _, m in self._keep("cosines", 0, replies, validate, what="matrix")]

    # -- rounds 1..R (Flower's FedAvg) -----------------------------------------------------------

    def _check_weights(self, record: ArrayRecord) -> None:
        names = set(record.keys())
        if names != set(self.shapes):
            raise ValueError(f"weights {sorted(names - set(self.shapes))[:3]} unexpected, "
                             f"{sorted(set(self.shapes) - names)[:3]} missing")
        for name, array in record.items():
            value = array.numpy()
            if tuple(value.shape) != self.shapes[name]:
                raise ValueError(f"{name}: shape {value.shape}, expected {self.shapes[name]}")
            if not np.isfinite(value).all():
                raise ValueError(f"{name}: non-finite values")

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return super().aggregate_train(server_round,
                                       self.valid_train_replies(server_round, replies))

    def valid_train_replies(self, server_round: int, replies: Iterable[Message]
                            ) -> list[Message]:
        """The replies whose weights, example count and epsilon are valid (the others are
        recorded with their reason); each valid site's metrics recorded with its bytes up."""
        target = self.config.epsilon

        def validate(reply: Message) -> None:
            self._check_weights(reply.content["arrays"])
            metrics = dict(reply.content["metrics"])
            n = metrics["num-examples"]
            if not float(n).is_integer() or n < 1:
                raise ValueError(f"num-examples={n}: expected a positive integer")
            if self.config.private:
                spent = float(metrics["epsilon_spent"])
                if not math.isfinite(spent) or not 0 <= spent <= target + 0.01 + EPSILON_SLACK:
                    raise ValueError(f"epsilon_spent={spent}: expected within the target "
                                     f"{target}")
            if self.config.central and metrics.get("site-weight") != 1:
                raise ValueError(f"site-weight={metrics.get('site-weight')!r}: expected 1 "
                                 "(central DP averages the sites with equal weights)")

        valid = self._keep("train", server_round, replies, validate, what="weights")
        bytes_up = sum(sum(r.count_bytes() for r in reply.content.values())
                       for reply, _ in valid)
        self.outcome.client_metrics[-len(valid):] = [
            {**m, "bytes_up": bytes_up // max(len(valid), 1)}
            for m in self.outcome.client_metrics[-len(valid):]]
        for reply, _ in valid:
            # recorded above; a site's start-up split is not FedAvg's to average, and differs in
            # keys between a site with a warm worker and one without (FedAvg wants equal keys)
            metrics = reply.content["metrics"]
            for key in STARTUP_KEYS:
                if key in metrics:
                    del metrics[key]
        return [reply for reply, _ in valid]

    # -- audit -----------------------------------------------------------------------------------
    def collect_attacks(self, grid: Grid, arrays: ArrayRecord, timeout: float) -> list[dict]:
        """Every site's extraction-attack scores on the final global weights."""
        content = RecordDict({"config": self.site_config(), "arrays": arrays})
        nodes = self._nodes(grid)
        replies = grid.send_and_receive(
            [Message(content, node, "query.attack") for node in nodes], timeout=timeout)

        def validate(reply: Message) -> None:
            metrics = dict(reply.content["metrics"])
            for key in ("membership_gap", "auc", "bert_f1_members"):
                if not math.isfinite(float(metrics[key])):
                    raise ValueError(f"{key}={metrics[key]} is not finite")

        self._keep("attack", self.config.rounds + 1, replies, validate, what="scores")
        return self.stage_metrics("attack")


# -- site-level central DP (Flower's wrappers and accountant) -----------------------------------


def central_noise_seed(seed: int, server_round: int) -> int:
    """The seed of round ``server_round``'s central DP noise for a reproducible run
    (``central_noise_seed >= 0``); -1 draws a fresh secret seed from the OS's entropy."""
    return noise_seed(None if seed < 0 else seed, server_round) % 2**32


class _AccountedFedAvg(DPLoRAMessages):
    """The FedAvg inside a central-DP wrapper: Flower's own ``aggregate_train`` (its accountant
    refuses any other) over equal site weights."""

    def __init__(self, outcome: StrategyOutcome, sites: int):
        super().__init__(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=sites,
                         min_evaluate_nodes=0, min_available_nodes=sites,
                         weighted_by_key="site-weight")
        self.outcome = outcome


class _ValidatedCentralDP:
    """Mixin over a Flower DP wrapper: replies validated by the PrivyTune strategy first (every
    site must pass: the accountant counts all of them, so fewer valid replies end the run with
    :class:`~strategies.common.NotEnoughClientsError`), the privacy spent recorded per round."""

    validator: PrivyTuneFedAvg
    central_spent: list[dict]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        # every site required (the config's min_clients = clients under central DP)
        valid = self.validator.valid_train_replies(server_round, replies)
        # Flower draws the noise from NumPy's global generator: seeded per round from fresh OS
        # entropy (never recorded) or, for a reproducible research run, from the configured
        # central_noise_seed; the caller's generator state is restored.
        state = np.random.get_state()
        np.random.seed(central_noise_seed(self.validator.config.central_noise_seed,
                                          server_round))
        try:
            result = super().aggregate_train(server_round, valid)  # type: ignore[misc]
        finally:
            np.random.set_state(state)
        spent = self.privacy_spent()  # type: ignore[attr-defined]
        self.central_spent.append({"round": server_round, "epsilon": spent.epsilon,
                                   "delta": spent.delta, "releases": spent.num_releases,
                                   "accounting": spent.accounting_method})
        return result


class ServerSideCentralDP(_ValidatedCentralDP, DifferentialPrivacyServerSideFixedClipping):
    """Flower's server-side fixed-clipping wrapper, replies validated first."""


class ClientSideCentralDP(_ValidatedCentralDP, DifferentialPrivacyClientSideFixedClipping):
    """Flower's client-side fixed-clipping wrapper (the sites run ``fixedclipping_mod``),
    replies validated first."""


def training_strategy(strategy: PrivyTuneFedAvg) -> Strategy:
    """The strategy that runs rounds 1..R: ``strategy`` itself, or (``central_dp`` set) a FedAvg
    over equal site weights inside Flower's DP wrapper with Flower's RDP accountant at
    ``dp_delta``, validated by ``strategy``. Its ``central_spent`` lists the site-level
    (epsilon, delta) after each round."""
    config = strategy.config
    if not config.central:
        return strategy
    accountant = RdpAccountant(PrivacyConfig(
        target_delta=config.dp_delta, population_size=config.clients,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.NO_AMPLIFICATION))
    wrapper = {"server": ServerSideCentralDP, "client": ClientSideCentralDP}[config.central_dp]
    dp = wrapper(_AccountedFedAvg(strategy.outcome, config.clients), config.central_noise,
                 config.central_clip, config.clients, accountant=accountant)
    dp.validator = strategy
    dp.central_spent = []
    return dp
