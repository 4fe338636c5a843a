"""The bench's federation: FedPrLLM cells of ``fedcompress bench`` run through the ServerApp's own
federated part (:func:`server.fedprllm.federate`: the strategies of ``strategies/fedprllm/``,
which ``fedcompress prune`` and ``flwr run`` run) on an in-process grid
(:class:`server.inprocess.InProcessGrid`) whose sites run the one ClientApp's handlers
(``clients/local.py``) one after another in the bench's process, without Ray.

The bench (:class:`fedcompress.bench.sweep.BenchRunner`, which imports no Flower) is given an
:class:`InProcessFederation` by its composition root (``fedcompress bench``,
``fedcompress/cli.py``) and calls :meth:`InProcessFederation.run` once per group of cells
that share their sites' replies: the server variants of one one-shot vote (its masks serve every
comparison group, scaling, tie-break and defence), the comparison groups of one FedSpaLLM run
(its releases serve every group), or one iterative or statistics-mode cell (its rounds depend on
the server). Each cell's result is then :meth:`BenchRun.result`: the strategy prunes a copy of
the global model for the cell's server variant (:meth:`~strategies.fedprllm.FedPrLLM.prune`),
and the model is evaluated with what the rounds measured, in the fields the bench's records
have always had. The ServerApp's report of each run (the sites' replies, rejections and
ledgers) is written to the folder the bench names (``OUT/runs/<id>``).

One-shot client masks, and OWL's outlier ratios, are kept across runs (:class:`MaskReplies`,
given to the grid as its reply cache): an honest site's reply is the same for the same client
settings, so a resumed sweep and every later vote on those settings reuse it, while a simulated
attacker's reply is always computed (its ClientApp's attack, ``clients/simulated.py``).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict

from fedcompress.methods.fedprllm.config import FedPrLLMConfig
from fedcompress.methods.fedprllm.experiment import Experiment
from fedcompress.report import RunReport
from server.fedprllm import Federated, federate, result_name
from server.inprocess import InProcessGrid

logger = logging.getLogger(__name__)

#: Run ids of this process's bench runs (a site's Context and simulated ledger are per run).
_RUN_IDS = itertools.count(1)

#: The round timeout of a bench run (its sites answer in this process: no reply is late).
TIMEOUT = 7 * 24 * 3600.0


class InProcessFederation:
    """What the bench runs its FedPrLLM cells through (module docstring). ``threads``: torch's
    threads while a site's ClientApp runs (None: the bench process's; 1: a Ray actor's of the
    Simulation Engine, for the same floats as ``fedcompress prune``)."""

    def __init__(self, threads: int | None = None):
        self.threads = threads

    def run(self, exp: Experiment, configs: list[FedPrLLMConfig], out: Path,
            cache: Path | None = None, spill: Path | None = None) -> BenchRun:
        """One federated run of the sites of ``configs`` (cells that differ only in their server
        variant), with ``exp``'s global model and evaluation data; the ServerApp's report in
        ``out``; one-shot client masks kept in ``cache``; FedSpaLLM's sum held in ``spill``."""
        config = run_config(configs)
        replies = MaskReplies(cache, config.attackers) if cache and _cacheable(config) else None
        grid = InProcessGrid(config.clients, cache=replies, threads=self.threads)
        grid.new_run(next(_RUN_IDS))
        clock = RoundClock(grid)
        with RunReport(out, "prune", config.to_dict(), seeds={"seed": config.seed}) as report:
            federated = federate(grid, config, exp, report, TIMEOUT, spill=spill, observe=clock)
        if grid.cached_replies:
            logger.info("%d site replies from the cache %s", grid.cached_replies, cache)
        return BenchRun(exp, config, federated, clock)


def run_config(configs: list[FedPrLLMConfig]) -> FedPrLLMConfig:
    """The settings of a group's run: its first cell's, with the server variant of a cell whose
    defence compares the sites if any (the strategy then keeps every site's masks); refused
    simulated attackers are left out as the old in-process vote left them out (``min_clients``:
    the honest sites, unless set); a fault that kills a site's process is refused (it would kill
    the bench)."""
    config = next((c for c in configs if c.server.rejects), configs[0])
    if config.faulty and config.fault == "kill":
        raise ValueError("fault='kill' ends a site's process: in the bench, the sites share its "
                         "process; run it with `fedcompress prune` (the Simulation Engine)")
    if config.attackers and not config.min_clients:
        config = config.replace(min_clients=config.clients - config.attackers)
    return config


def _cacheable(config: FedPrLLMConfig) -> bool:
    """Whether the sites' replies are the same for the same client settings, whatever the
    server does (one-shot votes in the clear)."""
    return (config.mode == "oneshot" and config.aggregate == "votes" and not config.secagg
            and not config.faulty)


class RoundClock:
    """The server's seconds in each round's aggregation (the strategy's ``aggregate_train``,
    less the seconds the grid's sites computed meanwhile: the replies of a streaming round are
    computed as the strategy pulls them)."""

    def __init__(self, grid: InProcessGrid):
        self.grid = grid
        self.seconds: dict[int, float] = {}

    def __call__(self, strategy: Any) -> None:
        aggregate = strategy.aggregate_train

        def timed(server_round: int, replies):
            start, sites = time.perf_counter(), self.grid.client_seconds
            try:
                return aggregate(server_round, replies)
            finally:
                self.seconds[server_round] = (time.perf_counter() - start
                                              - (self.grid.client_seconds - sites))

        strategy.aggregate_train = timed


class BenchRun:
    """A finished run of a bench group: each cell's evaluated result (:meth:`result`) from the
    one strategy's vote, summed statistics or releases."""

    def __init__(self, exp: Experiment, config: FedPrLLMConfig, federated: Federated,
                 clock: RoundClock):
        self.exp, self.config, self.federated, self.clock = exp, config, federated, clock
        self.strategy = federated.strategy
        self.metrics = list(self.strategy.outcome.client_metrics)
        self.count_seconds = sum(clock.seconds.values())
        self.kernel_load_seconds = 0.0
        if self.votes_in_one_round:  # counted once for every server variant, timed apart
            from fedcompress.masks.aggregate import load_kernels

            aggregator = self.strategy.aggregator
            start = time.perf_counter()
            load_kernels(aggregator.max_clients)
            self.kernel_load_seconds = time.perf_counter() - start
            aggregator.cache_counts = True
            start = time.perf_counter()
            aggregator.counts()
            self.count_seconds += time.perf_counter() - start

    @property
    def votes_in_one_round(self) -> bool:
        return self.config.aggregate == "votes" and self.config.mode == "oneshot"

    def counts(self) -> tuple[dict[str, Any], int] | None:
        """A one-shot vote's counts and its number of sites (None: no such vote)."""
        if not self.votes_in_one_round or not hasattr(self.strategy, "aggregator"):
            return None
        aggregator = self.strategy.aggregator
        return aggregator.counts(), aggregator.clients

    def result(self, config: FedPrLLMConfig) -> dict[str, Any]:
        """The cell of server variant ``config.server``: the global model pruned by the
        strategy and evaluated, with the run's measured cost."""
        model = self.exp.fresh_copy()
        start = time.perf_counter()
        self.strategy.prune(model, config.server)
        aggregate = time.perf_counter() - start
        fields = {k: v for k, v in self.federated.comm.items() if k not in ("clients", "wire")}
        if self.config.aggregate == "stats":
            fields.update(self._stats())
        elif self.config.aggregate == "fedspallm":
            fields.update(self._fedspallm(), aggregate_seconds=aggregate)
        elif self.config.mode == "iterative":
            fields.update(self._iterative())
        else:
            fields.update(self._oneshot(), aggregate_seconds=aggregate)
            rejection = getattr(self.strategy.aggregator, "rejection", None)
            if rejection is not None:
                fields["defence_outcome"] = rejection.to_dict()
        return self.exp.evaluate(result_name(self.config, config.server), model, **fields)

    def close(self) -> None:
        """Let the strategy's vote (every site's masks, or the sum on disk) go."""
        self.strategy = self.federated.strategy = None  # type: ignore[assignment]

    # -- the fields of each kind of run (the bench's records, as before this module) --------
    def _per_site(self) -> tuple[list[float], list[int]]:
        return ([float(m.get("seconds", 0.0)) for m in self.metrics],
                [int(m.get("bytes_up", 0)) for m in self.metrics])

    def _oneshot(self) -> dict[str, Any]:
        seconds, sizes = self._per_site()
        fields: dict[str, Any] = {
            "rounds": 1, "count_seconds": self.count_seconds,
            "kernel_load_seconds": self.kernel_load_seconds,
            "client_seconds_mean": float(np.mean(seconds)) if seconds else None,
            "bytes_up_per_client": float(np.mean(sizes)), "bytes_up_total": int(sum(sizes))}
        if self.config.wire != "packed":
            fields.update(wire_bytes_up=sizes,
                          reference_seconds=self.federated.reference_seconds)
        if self.config.attackers:
            fields["attack_outcome"] = self._attack_outcome()
        return fields

    def _attack_outcome(self) -> dict[str, Any]:
        """The simulated attackers and those of them the server's payload check refused."""
        from server.inprocess import FIRST_NODE

        refused = [{"site": int(r["node"]) - FIRST_NODE, "reason": r["reason"]}
                   for r in self.strategy.outcome.rejected
                   if int(r["node"]) - FIRST_NODE < self.config.attackers]
        return {"kind": self.config.attack, "sites": self.config.attackers,
                "refused_by_check": refused}

    def _by_round(self) -> dict[int, list[dict[str, Any]]]:
        rounds: dict[int, list[dict[str, Any]]] = {}
        for m in self.metrics:
            rounds.setdefault(int(m["round"]), []).append(m)
        return dict(sorted(rounds.items()))

    def _iterative(self) -> dict[str, Any]:
        rounds = self._by_round()
        layer_up = [int(np.mean([int(m.get("bytes_up", 0)) for m in ms])) for ms in
                    rounds.values()]
        layer_down = [0] + layer_up[:-1]  # each round but the first: the previous global mask
        seconds, _ = self._per_site()
        return {"rounds": len(rounds), "iterative_seconds": self.federated.comm[
                    "federated_seconds"],
                "bytes_up_per_client": sum(layer_up),
                "bytes_up_total": sum(layer_up) * self.config.clients,
                "bytes_down_masks_per_client": sum(layer_down),
                "client_seconds_mean": float(sum(seconds)) / self.config.clients,
                "layer_bytes_up_per_client": layer_up,
                "layer_bytes_down_per_client": layer_down,
                "layer_client_seconds_mean": [float(np.mean([m["seconds"] for m in ms]))
                                              for ms in rounds.values()],
                "layer_server_seconds": [self.clock.seconds.get(r, 0.0) for r in rounds]}

    def _stats(self) -> dict[str, Any]:
        seconds, _ = self._per_site()
        up = int(self.federated.comm["bytes_up_per_client"])
        cost = getattr(self.strategy, "layer_cost", {})
        return {"prune_seconds": self.federated.comm["federated_seconds"],
                "bytes_up_per_client": up, "bytes_up_total": up * self.config.clients,
                "client_seconds_mean": float(sum(seconds)) / self.config.clients,
                "server_seconds": float(sum(c["server_seconds"] for c in cost.values()))}

    def _fedspallm(self) -> dict[str, Any]:
        seconds, sizes = self._per_site()
        return {"rounds": 1, "client_seconds_mean": float(np.mean(seconds)),
                "bytes_up_per_client": int(np.mean(sizes)), "bytes_up_total": int(sum(sizes)),
                "layers_per_site": [len(layers) for layers in self.strategy.assignment]}


class MaskReplies:
    """The honest sites' one-shot replies kept on disk (the grid's reply cache): ``train.masks``
    as ``client-NNNN.npz`` (the payload, bit-packed in the default wire format: the bench's
    mask cache since its first version) and ``client-NNNN.json`` (the reply's metrics), OWL's
    ``query.outliers`` as ``outliers-NNNN.npy``, per partition ``NNNN``, in ``folder`` (one
    per client setting). A cache written before the replies were kept whole has a
    ``meta.json``: its site seconds and outlier ratios are read from there. A simulated attacker
    (a partition below ``attackers``) always computes its reply."""

    def __init__(self, folder: Path, attackers: int = 0):
        self.folder = Path(folder)
        self.attackers = attackers
        meta = self.folder / "meta.json"
        self.meta: dict[str, Any] = json.loads(meta.read_text()) if meta.exists() else {}

    def _site(self, message: Message, context: Context) -> int | None:
        partition = int(context.node_config["partition-id"])
        action = message.metadata.message_type
        if action == "query.outliers" or (action == "train.masks"
                                          and partition >= self.attackers):
            return partition
        return None

    def get(self, message: Message, context: Context) -> Message | None:
        site = self._site(message, context)
        if site is None:
            return None
        if message.metadata.message_type == "query.outliers":
            return self._outliers(message, site)
        path = self.folder / f"client-{site:04d}.npz"
        if not path.exists():
            return None
        with np.load(path) as data:
            payload = {k: data[k] for k in data.files}
        info = self.folder / f"client-{site:04d}.json"
        if info.exists():
            metrics = json.loads(info.read_text())
        else:  # a cache of the bench's own mask pass: its seconds in meta.json
            seconds = self.meta.get("client_seconds") or []
            metrics = {"seconds": float(seconds[site]) if site < len(seconds) else 0.0,
                       "partition": site,
                       "bytes_up": sum(int(a.nbytes) for a in payload.values())}
        return Message(RecordDict({
            "masks": ArrayRecord({k: Array(v) for k, v in payload.items()}),
            "metrics": MetricRecord({**metrics, "cached": 1})}), reply_to=message)

    def _outliers(self, message: Message, site: int) -> Message | None:
        path = self.folder / f"outliers-{site:04d}.npy"
        stored = self.meta.get("sites_outlier_ratios") or []
        if path.exists():
            ratios = np.load(path)
        elif site < len(stored):
            ratios = np.asarray(stored[site], dtype=np.float64)
        else:
            return None
        return Message(RecordDict({
            "outliers": ArrayRecord({"ratios": Array(ratios)}),
            "metrics": MetricRecord({"seconds": 0.0, "partition": site, "cached": 1})}),
            reply_to=message)

    def put(self, message: Message, context: Context, reply: Message) -> None:
        site = self._site(message, context)
        if site is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        if message.metadata.message_type == "query.outliers":
            _atomic(self.folder / f"outliers-{site:04d}.npy",
                    lambda f: np.save(f, reply.content["outliers"]["ratios"].numpy()))
            return
        metrics = {k: v for k, v in dict(reply.content["metrics"]).items()
                   if k in ("seconds", "windows", "partition", "bytes_up")}
        _atomic(self.folder / f"client-{site:04d}.npz", lambda f: np.savez(f, **{
            k: a.numpy() for k, a in reply.content["masks"].items()}))
        _atomic(self.folder / f"client-{site:04d}.json",
                lambda f: f.write(json.dumps(metrics).encode()))


def _atomic(path: Path, write) -> None:
    """``write(file)`` to a temporary file renamed to ``path`` (an interrupted write leaves no
    half file)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
    tmp.replace(path)
