"""FedPrLLM (federated pruning by mask voting) as plain functions, no Flower.

The Flower layers (``clients/fedprllm.py``, ``strategies/fedprllm/``, ``server/fedprllm.py``)
call these; so do the in-process baselines and the benchmarks, so every path shares one
implementation:

* :func:`client_windows`: the calibration windows of every client (a seeded pool of
  ``clients x samples_per_client`` windows, split iid or by Dirichlet(alpha));
* :func:`encode_masks` / :func:`check_payload` / :func:`decode_masks`: one client's masks to
  and from the wire (bit-packed), with validation of names, shapes, dtype and sparsity;
* :class:`MaskAggregator`: vote counts of the packed masks, one linear layer at a time, then
  the global masks by top-k within the server's comparison group, with the documented
  tie-break, and optional weight scaling.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from fedcompress.masks.aggregate import apply_global_mask, count_words, global_mask, payload_words
from fedcompress.masks.codec import (
    MaskDecodeError,
    check_packed,
    decode_mask,
    encode_mask,
    key_mismatch,
    mask_key,
    packed_nbytes,
)
from fedcompress.masks.robust import (
    Rejection,
    hamming_to_majority,
    reject_outliers,
    trimmed_counts,
)
from fedcompress.masks.stats import flatten_masks
from fedcompress.methods.fedprllm.config import PARTITIONS, FedPrLLMConfig, ServerConfig
from fedcompress.models import ModelAdapter, onloader_of, weight_matrix
from fedcompress.pruning.allocation import SparsityPlan

logger = logging.getLogger(__name__)

REFERENCE_WINDOWS = 8  # public windows behind the compressed format's reference norms


def expected_shapes(model: nn.Module, layers: Iterable[int] | None = None) -> dict[str, tuple]:
    """Wire key -> ``[out, in]`` shape of every prunable linear layer (of ``layers``)."""
    adapter = ModelAdapter(model)
    indices = range(len(adapter)) if layers is None else layers
    return {mask_key(i, name): tuple(weight_matrix(m).shape)
            for i in indices for name, m in ModelAdapter.linear_layers(adapter.layers[i]).items()}


# ------------------------------------------------------------------------------------------
# Client data
# ------------------------------------------------------------------------------------------

def check_federation(clients: int, samples_per_client: int, seqlen: int) -> None:
    """Clear errors before any work for impossible federations."""
    if not isinstance(clients, int) or clients <= 0:
        raise ValueError(f"number of clients {clients!r} must be a positive integer")
    if not isinstance(samples_per_client, int) or samples_per_client <= 0:
        raise ValueError(f"samples per client {samples_per_client!r} must be a positive integer")
    if not isinstance(seqlen, int) or seqlen < 2:
        raise ValueError(f"seqlen {seqlen!r} must be an integer >= 2")


def client_windows(tokens: torch.Tensor, clients: int, samples_per_client: int, seqlen: int,
                   partition: str = "iid", alpha: float = 1.0, seed: int = 0,
                   total_windows: int | None = None) -> list[torch.Tensor]:
    """Every client's calibration windows.

    A pool of ``total_windows`` (default ``clients * samples_per_client``) windows of ``seqlen``
    tokens is drawn at seeded random offsets of ``tokens`` (Wanda's sampling), then split among
    the clients: ``iid`` gives each client ``samples_per_client`` windows; ``dirichlet`` draws
    client sizes from Dirichlet(alpha) (at least one window each). The centralized baseline uses
    the union of the pool.
    """
    from fedcompress.data.calibration import sample_windows

    check_federation(clients, samples_per_client, seqlen)
    total = total_windows or clients * samples_per_client
    if clients > total:
        raise ValueError(f"more clients ({clients}) than calibration windows ({total})")
    pool = sample_windows(tokens, total, seqlen, np.random.default_rng(seed))
    return split_windows(pool, clients, partition, alpha, seed)


def split_windows(pool: torch.Tensor, clients: int, partition: str = "iid", alpha: float = 1.0,
                  seed: int = 0, labels: list[str] | None = None) -> list[torch.Tensor]:
    """Split a pool of windows among ``clients``: ``iid`` (equal shares of a seeded
    permutation) or ``dirichlet`` (quantity skew by Dirichlet(alpha); with ``labels``, e.g. the
    source corpus of each window, label skew: each label's windows shared by a fresh
    Dirichlet(alpha)). Each client's windows keep their pool order."""
    from fedcompress.data.partition import dirichlet_partition, iid_partition

    if clients > len(pool):
        raise ValueError(f"more clients ({clients}) than calibration windows ({len(pool)})")
    if partition == "iid":
        parts = iid_partition(len(pool), clients, seed)
    elif partition == "dirichlet":
        parts = dirichlet_partition(len(pool), clients, alpha, seed, labels=labels)
    else:
        raise ValueError(f"unknown partition {partition!r}: expected one of "
                         f"{', '.join(PARTITIONS)}")
    return [pool[torch.as_tensor(np.sort(p), dtype=torch.long)] for p in parts]


def _source_windows(tokenizer, config: FedPrLLMConfig, names: list[str],
                    cache: str | Path | None) -> list[torch.Tensor]:
    """Site ``i``'s windows from the ``i``-th text (the ``sources`` partition)."""
    from fedcompress.data.calibration import mixed_calibration_windows
    from fedcompress.data.corpora import load_corpus

    if len(names) != config.clients:
        raise ValueError(f"partition sources: {len(names)} text(s) for clients="
                         f"{config.clients}: expected one text per site, joined by '+'")
    if len(set(names)) != len(names):
        raise ValueError(f"partition sources: the texts {names} name a text twice")
    sources = {n: load_corpus(n, config.calib_split) for n in names}
    pool, labels = mixed_calibration_windows(tokenizer, sources, config.samples_per_client,
                                             config.seqlen, config.seed, cache)
    return [pool[torch.tensor([j for j, label in enumerate(labels) if label == n])]
            for n in names]


def federation_windows(tokenizer, config: FedPrLLMConfig, calib_text: str | None = None,
                       cache: str | Path | None = None
                       ) -> tuple[list[torch.Tensor], list[list[str]] | None]:
    """Every client's windows for ``config`` (``calib_text`` overrides ``config.calib_text``);
    ``cache``: a folder of tokenized corpora (a site's: the same windows, without tokenizing its
    data again at every message; :func:`~fedcompress.data.calibration.tokenize_corpus`).

    ``partition = "sources"``: one text per site (``+`` joins ``clients`` texts; site ``i``
    reads its ``samples_per_client`` windows from the ``i``-th, seeded as every source is).
    One corpus: :func:`client_windows`. Several corpora joined by ``+`` (e.g.
    ``wiki+shakespeare+code``): the pool has an equal share of windows from each (the first
    sources take the remainder), each source sampled with its own seeded generator
    (:func:`~fedcompress.data.calibration.mixed_calibration_windows`), and a ``dirichlet``
    partition skews the clients' mixtures of sources (label skew over source corpora). Returns
    the windows and, for several corpora, each client's list of source names.
    """
    from fedcompress.data.calibration import mixed_calibration_windows, tokenize_corpus
    from fedcompress.data.corpora import load_corpus

    names = [n for n in (calib_text or config.calib_text).split("+") if n]
    if config.partition == "sources":
        return _source_windows(tokenizer, config, names, cache), [[n] for n in names]
    if len(names) <= 1:
        tokens = tokenize_corpus(tokenizer, load_corpus(names[0] if names else "",
                                                        config.calib_split), cache)
        return client_windows(tokens, config.clients, config.samples_per_client, config.seqlen,
                              config.partition, config.alpha, config.seed), None
    if len(set(names)) != len(names):
        raise ValueError(f"calibration corpora {names} name a corpus twice")
    check_federation(config.clients, config.samples_per_client, config.seqlen)
    total = config.clients * config.samples_per_client
    if total < len(names):
        raise ValueError(f"{total} calibration windows cannot cover {len(names)} corpora")
    per_source = {n: total // len(names) + (i < total % len(names)) for i, n in enumerate(names)}
    sources = {n: load_corpus(n, config.calib_split) for n in names}
    pool, labels = mixed_calibration_windows(tokenizer, sources, per_source, config.seqlen,
                                             config.seed, cache)
    parts = split_windows(pool, config.clients, config.partition, config.alpha, config.seed,
                          labels=labels)
    # Recover each client's sources: split_windows keeps the order, so split the labels alike.
    index = torch.arange(len(pool)).unsqueeze(1)
    label_parts = [[labels[int(i)] for i in part[:, 0]] for part in split_windows(
        index, config.clients, config.partition, config.alpha, config.seed, labels=labels)]
    return parts, label_parts


# ------------------------------------------------------------------------------------------
# Wire format
# ------------------------------------------------------------------------------------------

class InvalidMaskError(ValueError):
    """A client's masks are unusable (missing/extra layer, shape, dtype, sparsity)."""


def encode_masks(masks: list[dict[str, torch.Tensor]], first_layer: int = 0
                 ) -> dict[str, np.ndarray]:
    """Per-layer masks (from the walker) to ``{wire key: bit-packed uint8 array}``."""
    return {key: encode_mask(mask) for key, mask in flatten_masks(masks, first_layer).items()}


def _ratio_at(sparsity: float | SparsityPlan, key: str) -> float:
    """The target ratio of wire key ``key``: a float for every layer, or a plan's."""
    return sparsity.at_key(key) if isinstance(sparsity, SparsityPlan) else sparsity


def check_payload(payload: dict[str, np.ndarray], shapes: dict[str, tuple],
                  target_sparsity: float | SparsityPlan, tolerance: float = 0.05
                  ) -> dict[str, np.ndarray]:
    """Validate one client's bit-packed payload against the expected keys and shapes, without
    unpacking it: every mask must be present, bit-packed for its shape, and have a sparsity
    within ``tolerance`` of its target (``target_sparsity``: one ratio, or a per-layer plan);
    otherwise :class:`InvalidMaskError` says why. Returns the payload restricted to ``shapes``'
    keys, in their order."""
    mismatch = key_mismatch(shapes, payload)
    if mismatch:
        raise InvalidMaskError(mismatch)
    for key, shape in shapes.items():
        try:
            pruned = check_packed(payload[key], shape, key)
        except MaskDecodeError as err:
            raise InvalidMaskError(str(err)) from err
        sparsity = pruned / max(int(np.prod(shape)), 1)
        target = _ratio_at(target_sparsity, key)
        if abs(sparsity - target) > tolerance:
            raise InvalidMaskError(f"{key}: sparsity {sparsity:.3f}, requested "
                                   f"{target:.3f} (tolerance {tolerance})")
    return {key: payload[key] for key in shapes}


def decode_masks(payload: dict[str, np.ndarray], shapes: dict[str, tuple],
                 target_sparsity: float | SparsityPlan, tolerance: float = 0.05
                 ) -> dict[str, torch.Tensor]:
    """:func:`check_payload`, then unpack every mask to a bool tensor."""
    checked = check_payload(payload, shapes, target_sparsity, tolerance)
    return {key: decode_mask(checked[key], shapes[key], key) for key in shapes}


def public_reference_wire(model: nn.Module, tokenizer, config: FedPrLLMConfig
                          ) -> dict[str, np.ndarray] | None:
    """What the server broadcasts for the compressed wire format: per-input-column activation
    norms of every linear layer measured on PUBLIC text (``REFERENCE_WINDOWS`` windows of the
    validation split of ``config.wire_reference``, forwarded through the locally pruned layers
    as the clients' pass does), as float16 (:func:`~fedcompress.masks.reference.reference_to_wire`).
    ``{}`` for ``wire_reference="none"`` (magnitude reference, nothing to send); ``None`` for the
    bit-packed format."""
    if config.wire != "compressed":
        return None
    if config.wire_reference == "none":
        return {}
    from fedcompress.data.calibration import sample_windows, tokenize_corpus
    from fedcompress.data.corpora import load_corpus
    from fedcompress.masks.reference import reference_to_wire
    from fedcompress.pruning.local import column_norms

    tokens = tokenize_corpus(tokenizer, load_corpus(config.wire_reference, "validation"))
    windows = sample_windows(tokens, REFERENCE_WINDOWS, config.seqlen,
                             np.random.default_rng(config.seed))
    return reference_to_wire(flatten_masks(column_norms(model, windows, config.prune,
                                                        config.batch_size)))


def _reference(reference_wire: dict[str, np.ndarray] | None, keys) -> dict | None:
    from fedcompress.masks.reference import reference_from_wire

    if not reference_wire:
        return None
    missing = sorted(set(keys) - set(reference_wire))
    if missing:
        raise InvalidMaskError(f"no reference norms for {missing[:3]}")
    return reference_from_wire({k: reference_wire[k] for k in keys})


def encode_wire(masks: dict[str, torch.Tensor], model: nn.Module, config: FedPrLLMConfig,
                reference_wire: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """One client's ``{wire key: mask}`` in the run's wire format."""
    if config.wire == "packed":
        return {key: encode_mask(mask) for key, mask in masks.items()}
    from fedcompress.masks.compress import encode_masks_ctx
    from fedcompress.masks.reference import linear_weights

    weights = linear_weights(model, sorted({int(k.split(".")[1]) for k in masks}))
    return encode_masks_ctx(masks, {k: weights[k] for k in masks},
                            _reference(reference_wire, masks))


def decode_wire(payload: dict[str, np.ndarray], shapes: dict[str, tuple], model: nn.Module,
                config: FedPrLLMConfig, reference_wire: dict[str, np.ndarray] | None = None
                ) -> dict[str, np.ndarray]:
    """One client's payload in the run's wire format -> validated bit-packed masks
    (:func:`check_payload`: names, shapes, sparsity); :class:`InvalidMaskError` says why not."""
    if config.wire == "compressed":
        from fedcompress.masks.compress import decode_masks_ctx
        from fedcompress.masks.reference import linear_weights

        weights = linear_weights(model, sorted({int(k.split(".")[1]) for k in shapes}))
        try:
            masks = decode_masks_ctx(payload, {k: weights[k] for k in shapes},
                                     _reference(reference_wire, shapes))
        except MaskDecodeError as err:
            raise InvalidMaskError(str(err)) from err
        payload = {key: encode_mask(mask) for key, mask in masks.items()}
    return check_payload(payload, shapes, config.prune.plan, config.mask_tolerance)


def payload_nbytes(shapes: dict[str, tuple]) -> int:
    return sum(packed_nbytes(shape) for shape in shapes.values())


# ------------------------------------------------------------------------------------------
# Aggregation
# ------------------------------------------------------------------------------------------

@dataclass
class MaskAggregator:
    """Streaming FedPrLLM aggregation for a set of linear layers of the global model.

    ``add_packed`` keeps one client's validated bit-packed payload (1 bit per weight: the
    message as received, never unpacked, not copied: a read-only word view of it,
    :func:`~fedcompress.masks.aggregate.payload_words`); the vote counts of a linear layer are
    computed from the clients' words when that layer's global mask is needed
    (:func:`~fedcompress.masks.aggregate.count_words`), one layer at a time per worker thread,
    so the extra memory is ``workers`` layers' counts, not the model's
    (``cache_counts=True`` keeps them, for benchmarks that evaluate many server variants).
    ``workers`` (default: torch's thread count) layers are aggregated in parallel threads (the
    compiled kernels release the GIL). ``streaming=True`` counts each payload as it arrives and
    keeps only the running counts: the server's memory no longer grows with the number of
    sites.
    """

    model: nn.Module
    max_clients: int
    layers: list[int] | None = None
    cache_counts: bool = False
    workers: int = 0
    #: Count each payload as it arrives instead of keeping it: the server then holds the
    #: running vote counts (:func:`count_dtype` of ``max_clients`` per weight) and the payload
    #: being counted, whatever the number of sites. No payload is kept, so the defences that
    #: compare sites (Hamming), :meth:`subset` and :meth:`with_sites` are not available.
    streaming: bool = False

    def __post_init__(self):
        if self.max_clients < 1:
            raise ValueError(f"max_clients must be at least 1, got {self.max_clients}")
        self.shapes = expected_shapes(self.model, self.layers)
        self._nbytes = {k: (int(np.prod(s)) + 7) // 8 for k, s in self.shapes.items()}
        # per layer, each client's payload as read-only uint64 words (views, not copies);
        # streaming: only the payloads not yet counted
        self.payloads: dict[str, list[np.ndarray]] = {k: [] for k in self.shapes}
        self._counts: dict[str, torch.Tensor] = {}
        self._running: dict[str, np.ndarray] = {}  # streaming: counts of the payloads so far
        self.clients = 0
        #: The Hamming defence's last decision (None: no defence applied).
        self.rejection: Rejection | None = None

    def add_packed(self, payload: dict[str, np.ndarray]) -> None:
        """One client's payload, already validated by :func:`check_payload`."""
        if set(payload) != set(self.shapes):
            raise InvalidMaskError("mask names do not match the aggregated layers")
        if self.clients >= self.max_clients:
            raise ValueError(f"more than the announced {self.max_clients} clients")
        for key, packed in payload.items():
            if packed.shape != (self._nbytes[key],):
                raise InvalidMaskError(f"{key}: payload of shape {packed.shape}, expected "
                                       f"({self._nbytes[key]},)")
        if self.streaming:
            self._count_now(payload)
            return
        for key, packed in payload.items():
            self.payloads[key].append(payload_words(packed, self._nbytes[key]))
        self._counts.clear()
        self.clients += 1

    def _count_now(self, payload: dict[str, np.ndarray]) -> None:
        """Streaming: add one payload's bits (the codec's MSB-first packing) to the running
        counts, one layer at a time; the payload is not kept."""
        from fedcompress.masks.aggregate import count_dtype

        dtype = count_dtype(self.max_clients).itemsize
        for key, packed in payload.items():
            numel = int(np.prod(self.shapes[key]))
            if key not in self._running:
                self._running[key] = np.zeros(numel, dtype=f"u{dtype}" if dtype == 1
                                              else f"i{dtype}")
            np.add(self._running[key], np.unpackbits(packed, count=numel),
                   out=self._running[key], casting="unsafe")
        self.clients += 1

    def _need_payloads(self, what: str) -> None:
        if self.streaming:
            raise ValueError(f"{what} needs every site's payload; a streaming aggregator keeps "
                             "only the running vote counts")

    def add(self, masks: dict[str, torch.Tensor]) -> None:
        """One client's bool masks (in-process callers): packed, checked, then added."""
        if set(masks) != set(self.shapes):
            raise InvalidMaskError("mask names do not match the aggregated layers")
        packed = {}
        for key, mask in masks.items():
            if tuple(mask.shape) != tuple(self.shapes[key]):
                raise InvalidMaskError(f"{key}: mask of shape {tuple(mask.shape)}, expected "
                                       f"{tuple(self.shapes[key])}")
            packed[key] = encode_mask(mask)
        self.add_packed(packed)

    def layer_counts(self, key: str) -> torch.Tensor:
        """Vote counts ``sum_i M_i`` of one linear layer."""
        if key in self._counts:
            return self._counts[key]
        if self.clients == 0:
            raise ValueError("no client masks were aggregated")
        shape = self.shapes[key]
        if self.streaming:
            return torch.from_numpy(self._running[key]).reshape(shape)
        counts = count_words(self.payloads[key], int(np.prod(shape))).reshape(shape)
        if self.cache_counts:
            self._counts[key] = counts
        return counts

    def counts(self) -> dict[str, torch.Tensor]:
        """Every layer's vote counts (:meth:`layer_counts`), counted by the worker threads."""
        keys = list(self.shapes)
        return dict(zip(keys, self._map(self.layer_counts, keys)))

    @classmethod
    def from_counts(cls, model: nn.Module, counts: Mapping[str, torch.Tensor], clients: int,
                    layers: list[int] | None = None) -> MaskAggregator:
        """An aggregator that holds only the vote counts of ``clients`` sites (secure
        aggregation: no site's mask exists at the server); each layer's counts in
        :func:`~fedcompress.masks.aggregate.count_dtype` of ``clients``, checked against the
        layer's shape and range."""
        from fedcompress.masks.aggregate import count_dtype

        agg = cls(model, max(clients, 1), layers, cache_counts=True)
        if set(counts) != set(agg.shapes):
            raise InvalidMaskError("vote counts do not name the aggregated layers")
        for key, c in counts.items():
            c = torch.as_tensor(c)
            if tuple(c.shape) != tuple(agg.shapes[key]):
                raise InvalidMaskError(f"{key}: counts of shape {tuple(c.shape)}, expected "
                                       f"{tuple(agg.shapes[key])}")
            if c.numel() and (int(c.min()) < 0 or int(c.max()) > clients):
                raise InvalidMaskError(f"{key}: counts outside [0, {clients}]")
            agg._counts[key] = c.to(count_dtype(clients))
        agg.clients = clients
        return agg

    def _with_payloads(self, payloads: dict[str, list[np.ndarray]]) -> MaskAggregator:
        other = MaskAggregator(self.model, self.max_clients, self.layers, self.cache_counts,
                               self.workers)
        other.payloads = payloads
        other.clients = len(next(iter(payloads.values()))) if payloads else 0
        return other

    def subset(self, keep: Sequence[int]) -> MaskAggregator:
        """An aggregator of the sites ``keep`` (indices in the order they were added), sharing
        their payload views (no copy)."""
        self._need_payloads("a subset of sites")
        keep = list(keep)
        if not keep or any(not 0 <= i < self.clients for i in keep):
            raise ValueError(f"sites {keep[:4]}: expected some of 0..{self.clients - 1}")
        return self._with_payloads({k: [v[i] for i in keep] for k, v in self.payloads.items()})

    def with_sites(self, replaced: Mapping[int, dict[str, np.ndarray]]) -> MaskAggregator:
        """An aggregator where site ``i``'s payload is ``replaced[i]`` (checked bit-packed
        payloads, e.g. a simulated attacker's), the others shared."""
        self._need_payloads("replacing a site's payload")
        payloads = {k: list(v) for k, v in self.payloads.items()}
        for i, payload in replaced.items():
            if not 0 <= i < self.clients or set(payload) != set(self.shapes):
                raise InvalidMaskError(f"site {i}: expected a payload for every layer of one "
                                       f"of sites 0..{self.clients - 1}")
            for key, packed in payload.items():
                payloads[key][i] = payload_words(packed, self._nbytes[key])
        return self._with_payloads(payloads)

    def defended(self, server: ServerConfig) -> tuple[MaskAggregator, Rejection | None]:
        """Under the Hamming defence (:mod:`fedcompress.masks.robust`), the aggregator of the
        sites it keeps and its decision (every site's distance to the majority mask of THESE
        layers); else this aggregator and None."""
        if not server.rejects:
            return self, None
        self._need_payloads("the Hamming defence")
        distances = hamming_to_majority(self.payloads, self.counts(), self.clients)
        rejection = reject_outliers(distances, server.reject_z)
        if rejection.rejected:
            logger.warning("hamming defence: rejected sites %s (distances %s, threshold %.4f)",
                           list(rejection.rejected),
                           [round(rejection.distances[i], 4) for i in rejection.rejected],
                           rejection.threshold)
        if not rejection.rejected:
            return self, rejection
        keep = [i for i in range(self.clients) if i not in set(rejection.rejected)]
        return self.subset(keep), rejection

    def _weight(self, key: str, model: nn.Module | None = None) -> torch.Tensor:
        _, layer, name = key.split(".", 2)
        adapter = ModelAdapter(model if model is not None else self.model)
        return weight_matrix(ModelAdapter.linear_layers(adapter.layers[int(layer)])[name])

    def _weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every aggregated layer's weight matrix in ``model``, through one adapter (building
        one per layer walked the whole model each time: Python time the workers share)."""
        layers = ModelAdapter(model).layers
        linears: dict[int, dict[str, nn.Module]] = {}
        out = {}
        for key in self.shapes:
            _, layer, name = key.split(".", 2)
            if int(layer) not in linears:
                linears[int(layer)] = ModelAdapter.linear_layers(layers[int(layer)])
            out[key] = weight_matrix(linears[int(layer)][name])
        return out

    def global_mask(self, key: str, server: ServerConfig, sparsity: float | SparsityPlan,
                    nm: tuple[int, int] | None = None,
                    counts: torch.Tensor | None = None,
                    weight: torch.Tensor | None = None) -> torch.Tensor:
        """The global mask of linear layer ``key``: the highest counts in each group, at the
        layer's ratio (``sparsity``: one ratio, or a per-layer plan); ties by the global
        model's weight (``weight``: that weight matrix, when the caller has it)."""
        counts = self.layer_counts(key) if counts is None else counts
        if server.trims:
            counts = trimmed_counts(counts, self.clients, server.trims)
        weight = self._weight(key) if weight is None else weight
        return global_mask(counts, _ratio_at(sparsity, key), server.group, server.tie_break,
                           weight.detach().cpu(), server.seed, nm)

    def _map(self, fn, keys):
        workers = self.workers or torch.get_num_threads()
        if workers <= 1 or len(keys) <= 1:
            return [fn(k) for k in keys]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(fn, keys))

    def global_masks(self, server: ServerConfig, sparsity: float | SparsityPlan,
                     nm: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """Every layer's global mask (after the server's defence, :meth:`defended`)."""
        agg, self.rejection = self.defended(server)
        keys = list(agg.shapes)
        return dict(zip(keys, agg._map(lambda k: agg.global_mask(k, server, sparsity, nm),
                                       keys)))

    @torch.no_grad()
    def prune(self, model: nn.Module, server: ServerConfig, sparsity: float | SparsityPlan,
              nm: tuple[int, int] | None = None,
              each_layer: Callable[[int, nn.Module], None] | None = None) -> dict[str, float]:
        """Prune ``model`` (a copy of the global model) in place, one linear layer at a time
        per worker (no mask or count of another layer is kept); return each layer's pruned
        fraction. The server's defence first decides which sites count (:meth:`defended`; the
        decision is kept in ``rejection``).

        ``model`` may be an onloaded skeleton (:func:`~fedcompress.models.onload.onload_model`):
        then each decoder layer is read, pruned (ties by its own dense weights when ``model``
        is this aggregator's model, the same global weights), handed to ``each_layer(index,
        layer)`` (e.g. to save it) and freed, so the server holds one decoder layer, not the
        model: the same masks and pruned weights as pruning the whole model."""
        agg, self.rejection = self.defended(server)
        if agg is not self:
            return agg.prune(model, server.replace_defence("trim" if server.trims else "none"),
                             sparsity, nm, each_layer)
        if onloader_of(model) is not None:
            return self._prune_onloaded(model, server, sparsity, nm, each_layer)
        globals_, targets = self._weights(self.model), self._weights(model)
        fractions = self._map(lambda k: self._prune_one(k, server, sparsity, nm, globals_[k],
                                                        targets[k]), list(self.shapes))
        if each_layer is not None:
            for index, layer in enumerate(ModelAdapter(model).layers):
                each_layer(index, layer)
        return dict(zip(self.shapes, fractions))

    def _prune_one(self, key: str, server: ServerConfig, sparsity: float | SparsityPlan,
                   nm: tuple[int, int] | None, dense: torch.Tensor, target: torch.Tensor
                   ) -> float:
        """Linear layer ``key``'s global mask (ties by ``dense``, computed before ``target`` is
        touched: the two may be one tensor) applied to ``target``; its pruned fraction."""
        counts = self.layer_counts(key)
        mask = self.global_mask(key, server, sparsity, nm, counts, dense)
        apply_global_mask(target, mask, counts, self.clients, server.scale)
        # numpy's count, not torch's bool sum: the latter took 4 of 8 s for 64 clients.
        return int(np.count_nonzero(mask.numpy())) / mask.numel()

    def _prune_onloaded(self, model: nn.Module, server: ServerConfig,
                        sparsity: float | SparsityPlan, nm: tuple[int, int] | None,
                        each_layer: Callable[[int, nn.Module], None] | None
                        ) -> dict[str, float]:
        """:meth:`prune` of an onloaded skeleton, one decoder layer at a time."""
        shared = model is self.model
        if not shared and onloader_of(self.model) is not None:
            raise ValueError("pruning an onloaded skeleton: expected the aggregator's own model "
                             "(ties by its dense weights, read with each layer) or a whole "
                             "global model, not another skeleton")
        by_layer: dict[int, list[str]] = {}
        for key in self.shapes:
            by_layer.setdefault(int(key.split(".", 2)[1]), []).append(key)
        adapter = ModelAdapter(model)
        fractions: dict[str, float] = {}
        for index in range(len(adapter)):
            keys = by_layer.get(index, [])
            if not keys and each_layer is None:
                continue
            with adapter.onloaded(index) as layer:
                linears = ModelAdapter.linear_layers(layer)
                targets = {k: weight_matrix(linears[k.split(".", 2)[2]]) for k in keys}
                globals_ = targets if shared else {k: self._weight(k) for k in keys}
                fractions.update(zip(keys, self._map(
                    lambda k, g=globals_, t=targets: self._prune_one(k, server, sparsity, nm,
                                                                     g[k], t[k]), keys)))
                if each_layer is not None:
                    each_layer(index, layer)
        return {k: fractions[k] for k in self.shapes}


def masks_by_layer(flat: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """``{wire key: mask}`` to ``{layer index: {linear name: mask}}``."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, mask in flat.items():
        _, layer, name = key.split(".", 2)
        out.setdefault(int(layer), {})[name] = mask
    return out


# ------------------------------------------------------------------------------------------
# Federated OWL: per-layer sparsity from the sites' outlier ratios
# ------------------------------------------------------------------------------------------

def owl_plan_from_sites(sites: list[list[float]], config: FedPrLLMConfig, model: nn.Module
                        ) -> SparsityPlan:
    """The server's OWL plan: the mean over sites of each layer's outlier ratio (every site
    counts once; the mean of the sites' shares, not the share on the union of their windows,
    which no site's data reveals), then OWL's rule at ``config.sparsity`` and
    ``config.owl_lambda`` (:func:`~fedcompress.pruning.local.owl_plan`)."""
    from fedcompress.pruning.local import owl_plan

    if not sites:
        raise ValueError("no site sent outlier ratios")
    if len({len(s) for s in sites}) != 1:
        raise ValueError(f"sites sent {sorted({len(s) for s in sites})} outlier ratios: "
                         "expected one per decoder layer from every site")
    mean = [float(np.mean(np.asarray(column, dtype=np.float64))) for column in zip(*sites)]
    return owl_plan(mean, config.sparsity, config.owl_lambda, model)


def with_site_plan(config: FedPrLLMConfig, model: nn.Module, windows: list[torch.Tensor]
                   ) -> tuple[FedPrLLMConfig, list[list[float]] | None]:
    """In one process (benchmarks), what a run's round 0 decides: under
    ``sparsity_profile=owl`` (no fixed plan) every site's outlier ratios on its windows and the
    config carrying the server's plan (:func:`owl_plan_from_sites`); else ``config``."""
    from fedcompress.pruning.local import outlier_ratios

    if config.sparsity_profile != "owl" or config.layer_sparsity:
        return config, None
    sites = [outlier_ratios(model, w, config.owl_m, config.batch_size) for w in windows]
    plan = owl_plan_from_sites(sites, config, model)
    return config.replace(layer_sparsity=plan.to_text()), sites


# ------------------------------------------------------------------------------------------
# Iterative mode: one decoder layer per round
# ------------------------------------------------------------------------------------------

def advance_to_layer(model: nn.Module, windows: torch.Tensor, layer: int,
                     prev_hidden: torch.Tensor | None,
                     prev_global: dict[str, torch.Tensor] | None,
                     layer_kwargs: list[dict] | None = None, batch_size: int = 8,
                     prev_weights: dict[str, torch.Tensor] | None = None):
    """A site's inputs of decoder layer ``layer`` in a layer-per-round run.

    ``prev_hidden`` are the inputs of layer ``layer - 1`` that the site kept from the previous
    round; they are forwarded through that layer pruned with the server's global mask
    ``prev_global`` (and, statistics mode with SparseGPT, its updated weights
    ``prev_weights``). Layer 0 embeds the windows. Returns a
    :class:`~fedcompress.pruning.walker.LayerInputs` (with the layers' keyword arguments).
    """
    from fedcompress.pruning.walker import LayerInputs, capture_layer_inputs, forward_layer

    adapter = ModelAdapter(model)
    if not 0 <= layer < len(adapter):
        raise ValueError(f"layer {layer} out of range: the model has {len(adapter)} layers")
    if layer == 0 or layer_kwargs is None:
        captured = capture_layer_inputs(model, windows if layer == 0 else windows[:1], batch_size)
        layer_kwargs = captured.layer_kwargs
    if layer == 0:
        return captured
    if prev_hidden is None or prev_global is None:
        raise ValueError(f"round for layer {layer} needs the inputs of layer {layer - 1} and "
                         "its global mask")
    with adapter.onloaded(layer - 1) as source:  # read and freed here for an onloaded model
        return forward_layer(source, LayerInputs(prev_hidden, layer_kwargs, layer - 1),
                             batch_size, prev_global, prev_weights,
                             in_place=adapter.onloader is not None)


def iterative_client_step(model: nn.Module, windows: torch.Tensor, layer: int,
                          prev_hidden: torch.Tensor | None,
                          prev_global: dict[str, torch.Tensor] | None, prune,
                          layer_kwargs: list[dict] | None = None, batch_size: int = 8
                          ) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[dict]]:
    """One client's round of iterative FedPrLLM: its inputs of ``layer``
    (:func:`advance_to_layer`), then its local masks of ``layer``. Returns ``(masks of layer,
    inputs of layer to keep, layer_kwargs)``."""
    inputs = advance_to_layer(model, windows, layer, prev_hidden, prev_global, layer_kwargs,
                              batch_size)
    return site_layer_masks(model, inputs, prune, batch_size), inputs.hidden, inputs.layer_kwargs


def site_layer_stats(model: nn.Module, inputs, needs_hessian: bool, batch_size: int = 8):
    """A site's statistics of the layer its ``inputs`` enter (the calibration walker's)."""
    from fedcompress.pruning.walker import collect_stats

    with ModelAdapter(model).onloaded(inputs.layer) as layer:
        return collect_stats(layer, inputs, hessian=needs_hessian, batch_size=batch_size)


def site_layer_masks(model: nn.Module, inputs, prune, batch_size: int = 8
                     ) -> dict[str, torch.Tensor]:
    """A site's local masks of the layer its ``inputs`` enter."""
    from fedcompress.pruning.local import layer_prune_fn
    from fedcompress.pruning.walker import collect_stats

    with ModelAdapter(model).onloaded(inputs.layer) as layer:
        stats = collect_stats(layer, inputs, hessian=prune.needs_hessian, batch_size=batch_size)
        masks, _ = layer_prune_fn(prune)(inputs.layer, layer, stats)
    return masks


def resync_inputs(model: nn.Module, windows: torch.Tensor, layer: int,
                  global_masks: Mapping[int, dict[str, torch.Tensor]], batch_size: int = 8,
                  global_weights: Mapping[int, dict[str, torch.Tensor]] | None = None
                  ) -> tuple[torch.Tensor | None, list[dict]]:
    """What a site that missed rounds (or whose state was lost) needs for the round of decoder
    layer ``layer``: the inputs of layer ``layer - 1`` (None for layer 0), recomputed from its
    windows through layers ``0 .. layer - 2`` pruned with their global masks (and updated
    weights, statistics mode with SparseGPT), and the layers' keyword arguments: the same
    operations, in the same order, as the rounds it missed, so its next reply is the one it
    would have sent."""
    from fedcompress.pruning.walker import capture_layer_inputs, forward_layer

    missing = [i for i in range(max(layer - 1, 0)) if i not in global_masks]
    if missing:
        raise ValueError(f"resync for layer {layer}: no global masks of layers {missing[:4]}")
    captured = capture_layer_inputs(model, windows, batch_size)
    if layer == 0:
        return None, captured.layer_kwargs
    adapter = ModelAdapter(model)
    inputs = captured
    for i in range(layer - 1):
        weights = global_weights.get(i) if global_weights else None
        with adapter.onloaded(i) as source:
            inputs = forward_layer(source, inputs, batch_size, global_masks[i], weights,
                                   in_place=adapter.onloader is not None)
    return inputs.hidden, captured.layer_kwargs
