"""FedPrLLM's votes summed by SecAgg+ (:class:`_SecureVote`: keys, shares, masked votes, the
consistency round, unmasking), mixed into the one-shot (:class:`SecureFedPrLLM`) and the
iterative (:class:`SecureIterativeFedPrLLM`) strategies."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedcompress.methods.fedprllm.config import FedPrLLMConfig
from fedcompress.methods.fedprllm.federated import MaskAggregator
from strategies.common import (
    NotEnoughClientsError,
    StrategyOutcome,
    collect_valid_replies,
    reply_metrics,
    require_valid,
)
from strategies.fedprllm.iterative import IterativeFedPrLLM
from strategies.fedprllm.oneshot import FedPrLLM

logger = logging.getLogger(__name__)


class _SecureVote:
    """SecAgg+ of one vote (:mod:`fedcompress.privacy.secagg`): five exchanges (keys, shares,
    masked votes, the consistency round when the sites are authenticated, unmasking); the
    server ends with the vote counts of the linear layers in ``shapes`` and no site's mask. A
    site lost before its shares is not in the vote (nobody masks with it); one lost before its
    masked votes is left out of the sum (its pairwise masks undone from the others' shares);
    one lost later still counts; fewer than ``max(threshold, required clients)`` at any stage
    end the run clearly. The sites check everything a guarantee depends on themselves. Mixed
    into a FedPrLLM strategy (its config, nodes, outcome)."""

    config: FedPrLLMConfig
    model: torch.nn.Module
    outcome: StrategyOutcome
    site_nodes: dict[int, list[int]]

    def _init_secure(self) -> None:
        #: per stage, summed over the votes: seconds, bytes down and up, valid replies
        self.secagg: dict[str, dict[str, float]] = {}

    def _exchange(self, grid: Grid, stage: str, action: str, contents: dict[int, RecordDict],
                  timeout: float, validate, server_round: int) -> dict[int, Any]:
        start = time.monotonic()
        down = sum(sum(r.count_bytes() for r in c.values()) for c in contents.values())
        replies = list(grid.send_and_receive(
            [Message(c, node, action, group_id=str(server_round))
             for node, c in contents.items()], timeout=timeout))
        valid, rejected = collect_valid_replies(replies, validate, stage=f"secagg-{stage}",
                                                server_round=server_round,
                                                what=f"SecAgg {stage} reply",
                                                asked=list(contents), timeout=timeout)
        self.outcome.add_rejected(rejected)
        up = sum(sum(r.count_bytes() for r in reply.content.values()) for reply, _ in valid)
        self.outcome.bytes_down += down
        total = self.secagg.setdefault(stage, {"seconds": 0.0, "bytes_down": 0, "bytes_up": 0,
                                               "valid": 0})
        for key, value in (("seconds", time.monotonic() - start), ("bytes_down", down),
                           ("bytes_up", up), ("valid", len(valid))):
            total[key] += value
        for reply, _ in valid:
            if "metrics" in reply.content:
                self.outcome.client_metrics.append({"round": server_round, "stage": stage,
                                                    "node": reply.metadata.src_node_id,
                                                    **reply_metrics(reply)})
        return {reply.metadata.src_node_id: value for reply, value in valid}

    def _secure_counts(self, grid: Grid, nodes: list[int], shapes: dict[str, tuple],
                       mask_content, timeout: float, server_round: int, layer: int = -1
                       ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The vote counts of ``shapes``' layers over ``nodes`` (``mask_content(node)``: the
        request of a site's masked votes); and the nodes whose votes count."""
        keys = sorted(shapes)
        numel = sum(int(np.prod(shapes[k])) for k in keys)
        total, sites = self._secure_sum(grid, nodes, numel, 0, mask_content, timeout,
                                        server_round, layer)
        counts, offset = {}, 0
        for key in keys:
            size = int(np.prod(shapes[key]))
            counts[key] = torch.from_numpy(total[offset:offset + size].reshape(shapes[key]))
            offset += size
        return counts, sites

    def _secure_sum(self, grid: Grid, nodes: list[int], numel: int, bits: int,
                    mask_content, timeout: float, server_round: int, layer: int = -1
                    ) -> tuple[np.ndarray, list[int]]:
        """The sum (int64, ``numel``) of the sites' vectors over ``nodes`` in ``bits``-bit
        lanes (0: wide enough for 0/1 votes; 64: fixed-point statistics), each site's request
        ``mask_content(node)``, for decoder layer ``layer`` (-1: every layer); and the nodes
        whose vectors count. Five exchanges: keys, shares, masked vectors, the consistency
        round (authenticated sites only) and the unmasking shares."""
        from fedcompress.privacy.secagg import (
            Advert,
            SecAggConfig,
            SecAggError,
            SecAggServer,
            pack_blobs,
            pack_ints,
            unpack_blobs,
            unpack_ints,
        )

        nodes = sorted(nodes)
        index = {node: i for i, node in enumerate(nodes)}
        threshold = self.config.threshold_for(len(nodes))
        agg_config = SecAggConfig(tuple(range(len(nodes))), threshold, numel, bits,
                                  neighbours=self.config.neighbours_for(len(nodes)))
        server = SecAggServer(agg_config)
        need = max(threshold, self.config.required_clients)

        def enough(stage: str, got: int) -> None:
            require_valid(got, need, f"SecAgg {stage}", server_round, self.outcome.reasons(
                f"secagg-{stage}"))

        def unset(value: bytes) -> bytes:
            return b"" if value == b"-" else value

        def advert_of(reply: Message) -> tuple[Advert, bool, bytes]:
            rec = reply.content["secagg"]
            return (Advert(bytes(rec["c"]), bytes(rec["s"]), unset(bytes(rec["signature"])),
                           unset(bytes(rec["signer"]))), bool(rec["authenticated"]),
                    bytes(rec["vote"]))

        base = {"sites": len(nodes), "threshold": threshold, "numel": numel,
                "bits": agg_config.bits, "layer": layer, "neighbours": agg_config.neighbours}
        keyed = self._exchange(grid, "keys", "query.secagg_keys", {
            n: RecordDict({"secagg": ConfigRecord({**base, "index": index[n]})}) for n in nodes},
            timeout, advert_of, server_round)
        enough("keys", len(keyed))
        votes = {vote for _, _, vote in keyed.values()}
        if len(votes) != 1:
            raise NotEnoughClientsError(f"round {server_round}: the sites derived "
                                        f"{len(votes)} different SecAgg vote ids")
        server.vote_id = votes.pop()
        authenticated = all(auth for _, auth, _ in keyed.values())
        server.public = {index[n]: advert for n, (advert, _, _) in keyed.items()}
        listed = sorted(server.public)
        adverts = [Advert(*server.public[i]) for i in listed]
        advert = ConfigRecord({"nodes": pack_ints(listed), "layer": layer,
                               "c": pack_blobs([a.c for a in adverts]),
                               "s": pack_blobs([a.s for a in adverts]),
                               "signature": pack_blobs([a.signature or b"-" for a in adverts]),
                               "signer": pack_blobs([a.signer or b"-" for a in adverts])})

        def pairs(ids: str, blobs: str):
            """A reply's ``{site index: bytes}`` from its packed ids and byte strings."""
            def read(reply: Message) -> dict[int, bytes]:
                record = reply.content["secagg"]
                return dict(zip(unpack_ints(record[ids]), unpack_blobs(record[blobs]),
                                strict=True))
            return read

        shares = self._exchange(grid, "share", "query.secagg_share",
                                {n: RecordDict({"secagg": advert}) for n in keyed},
                                timeout, pairs("dst", "blob"), server_round)
        enough("share", len(shares))
        inbox = server.relay({index[n]: s for n, s in shares.items()})

        def masked_of(reply: Message) -> np.ndarray:
            words = reply.content["masked"]["words"].numpy()
            if words.dtype != np.uint64 or words.shape != (agg_config.n_words,):
                raise ValueError(f"masked votes of {words.dtype} {words.shape}: expected "
                                 f"({agg_config.n_words},) uint64")
            return words

        def request(n: int) -> RecordDict:
            mine = inbox.get(index[n], {})
            return RecordDict({**mask_content(n), "secagg": ConfigRecord({
                "layer": layer, "src": pack_ints(sorted(mine)),
                "blob": pack_blobs([mine[s] for s in sorted(mine)])})})

        masked = self._exchange(grid, "masked", "train.secagg_masks",
                                {n: request(n) for n in shares}, timeout, masked_of,
                                server_round)
        enough("masked", len(masked))
        survivors = sorted(index[n] for n in masked)
        ask = {"layer": layer, "survivors": pack_ints(survivors)}
        asked = list(masked)
        if authenticated:  # the consistency round: every survivor signs the survivor set
            signed = self._exchange(
                grid, "confirm", "query.secagg_confirm",
                {n: RecordDict({"secagg": ConfigRecord(ask)}) for n in masked}, timeout,
                lambda r: bytes(r.content["secagg"]["signature"]), server_round)
            enough("confirm", len(signed))
            signers = sorted(signed)
            ask.update(signers=pack_ints([index[n] for n in signers]),
                       signatures=pack_blobs([signed[n] for n in signers]))
            asked = signers
        unmask = self._exchange(grid, "unmask", "query.secagg_unmask",
                                {n: RecordDict({"secagg": ConfigRecord(ask)}) for n in asked},
                                timeout, pairs("of", "share"), server_round)
        start = time.monotonic()
        try:
            total = server.aggregate({index[n]: w for n, w in masked.items()},
                                     {index[n]: s for n, s in unmask.items()})
        except SecAggError as err:
            raise NotEnoughClientsError(f"SecAgg unmasking failed: {err}") from err
        summary = self.secagg.setdefault("sum", {"seconds": 0.0, "votes": 0, "dropped": 0})
        summary["seconds"] += time.monotonic() - start
        summary["votes"] += 1
        summary["dropped"] += len(set(listed) - set(survivors))
        summary.update({"sites": len(masked), "threshold": threshold,
                        "neighbours": agg_config.neighbours,
                        "authenticated": authenticated,
                        "consistency_round": authenticated,
                        "bits_per_weight_up": 64 / agg_config.lanes})
        summary["bytes_up_per_site"] = summary.get("bytes_up_per_site", 0) \
            + agg_config.upload_bytes
        if not authenticated:
            logger.warning("SecAgg+ without authenticated sites (simulation): the keys are "
                           "unsigned and there is no consistency round, so only an "
                           "honest-but-curious server is covered")
        return total, sorted(masked)


class SecureFedPrLLM(_SecureVote, FedPrLLM):
    """One-shot FedPrLLM whose vote is summed by SecAgg+ (:class:`_SecureVote`)."""

    def __init__(self, config: FedPrLLMConfig, model: torch.nn.Module, node_wait: float = 120.0,
                 reference_wire: dict | None = None):
        super().__init__(config, model, node_wait, reference_wire)
        self._init_secure()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 1,
              timeout: float = 3600, **_ignored) -> None:
        content = self._content(1)
        counts, sites = self._secure_counts(grid, self._nodes(grid), self.shapes,
                                            lambda _node: content, timeout, 1)
        self.aggregator = MaskAggregator.from_counts(self.model, counts, len(sites))
        self.site_nodes[1] = sites


class SecureIterativeFedPrLLM(_SecureVote, IterativeFedPrLLM):
    """Iterative FedPrLLM whose every layer's vote is summed by SecAgg+ (fresh keys and seeds
    per layer: four exchanges per decoder layer); resync and checkpoints as in the plain
    iterative mode."""

    def __init__(self, config: FedPrLLMConfig, model: torch.nn.Module, node_wait: float = 120.0,
                 reference_wire: dict | None = None, checkpoint: Path | None = None):
        super().__init__(config, model, node_wait, reference_wire, checkpoint)
        self._init_secure()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 1,
              timeout: float = 3600, **_ignored) -> None:
        for server_round in range(1, self.num_rounds + 1):
            layer = self._layer(server_round)
            contents = self._layer_contents(server_round, self._nodes(grid))
            counts, sites = self._secure_counts(
                grid, list(contents), MaskAggregator(self.model, 1, [layer]).shapes,
                contents.__getitem__, timeout, layer + 1, layer)
            self.site_nodes[layer + 1] = sites
            self._finish_layer(layer, MaskAggregator.from_counts(self.model, counts, len(sites),
                                                                 [layer]))
            logger.info("layer %d: secure vote of %d sites", layer, len(sites))
