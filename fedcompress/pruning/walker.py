"""The calibration walker: one sequential, layer-by-layer pass over a model's decoder layers.

The pass follows Wanda and SparseGPT: the calibration windows are embedded once, then for each
decoder layer in turn

1. the inputs of its linear layers are captured by forward hooks into running statistics
   (:class:`LayerStats`), from the layer's current (already pruned upstream) inputs;
2. a caller-supplied function turns the statistics into prune masks (and, for SparseGPT, updated
   weights) for that layer's linear layers;
3. the masks are applied to a *copy* of the layer, and the samples are forwarded through the
   pruned copy to become the inputs of the next layer.

The model itself is never mutated, so one dense model loaded per process can serve many clients.

Sequential onloading: the model may be an onloaded skeleton
(:func:`~fedcompress.models.loading.load_model` with ``onload=True``): its decoder layers live
on the meta device and each is read from the safetensors files only while the walker works on it
(:meth:`~fedcompress.models.adapter.ModelAdapter.onloaded`), then freed, so memory holds one
layer, the activations, the embeddings and the head, never the whole model. The same steps run
either way, so the masks (and SparseGPT's weights) are identical.
The steps are exposed separately (:func:`capture_layer_inputs`, :func:`collect_stats`,
:func:`forward_layer`) because the iterative federated mode runs one layer per round and keeps the
activations between rounds; :func:`walk` composes them for the one-shot pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterator, Mapping

import torch
from torch import nn

from fedcompress.models import CALC_DTYPE, HESSIAN_DTYPE, ModelAdapter, weight_matrix
from fedcompress.quant.solver import QuantResult

logger = logging.getLogger(__name__)


class _StopForward(Exception):
    """Raised by a hook to stop a forward pass once the wanted inputs are captured."""


@dataclass
class LayerInputs:
    """Hidden states entering a decoder layer, for every calibration window.

    ``hidden`` is ``[n_windows, seqlen, hidden_size]`` in the model's dtype. ``layer_kwargs[i]``
    are the keyword arguments the model passes to decoder layer ``i`` (attention mask, rotary
    position embeddings, ...), captured with batch size 1; they broadcast over any batch.
    """

    hidden: torch.Tensor
    layer_kwargs: list[dict]
    layer: int = 0  # index of the decoder layer these hidden states enter


def _batches(n: int, batch_size: int) -> Iterator[slice]:
    for start in range(0, n, batch_size):
        yield slice(start, min(start + batch_size, n))


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, windows: torch.Tensor,
                         batch_size: int = 8) -> LayerInputs:
    """Embed the windows ``[n, seqlen]`` and capture what enters decoder layer 0.

    Also records the per-layer keyword arguments (one batch-1 forward with a pre-hook on every
    layer) so each layer can later be called on its own. That forward passes the hidden states
    through every layer unchanged (the model computes the keyword arguments before its layers:
    rotary embeddings, one attention mask per layer type), so no layer's weights are read: the
    layers of an onloaded skeleton stay on the meta device.
    """
    if windows.dim() != 2 or windows.dtype != torch.long:
        raise ValueError(f"calibration windows must be a LongTensor [n, seqlen], got "
                         f"{tuple(windows.shape)} {windows.dtype}")
    adapter = ModelAdapter(model)
    device = next(p.device for p in model.parameters() if p.device.type != "meta")
    windows = windows.to(device)

    captured: list[torch.Tensor] = []
    kwargs_per_layer: list[dict | None] = [None] * len(adapter)

    def grab_hidden(_module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        captured.append(hidden.detach())
        raise _StopForward

    def make_kwarg_hook(index: int):
        def hook(_module, args, kwargs):
            kept = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "past_key_values",
                                                                 "past_key_value", "use_cache")}
            kwargs_per_layer[index] = kept
            if index == len(adapter) - 1:
                raise _StopForward
        return hook

    def passthrough(hidden_states=None, *args, **kwargs):
        return hidden_states if hidden_states is not None else kwargs["hidden_states"]

    handles = [layer.register_forward_pre_hook(make_kwarg_hook(i), with_kwargs=True)
               for i, layer in enumerate(adapter.layers)]
    for layer in adapter.layers:
        layer.forward = passthrough  # an instance attribute: removed below
    try:
        try:
            model(windows[:1], use_cache=False)
        except _StopForward:
            pass
    finally:
        for handle in handles:
            handle.remove()
        for layer in adapter.layers:
            del layer.forward
    handle = adapter.layers[0].register_forward_pre_hook(grab_hidden, with_kwargs=True)
    try:
        for rows in _batches(len(windows), batch_size):
            try:
                model(windows[rows], use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
    if any(k is None for k in kwargs_per_layer):
        raise RuntimeError("could not capture the inputs of every decoder layer")
    return LayerInputs(torch.cat(captured), kwargs_per_layer, 0)  # type: ignore[arg-type]


class LayerStats:
    """Summable statistics of the inputs of one linear layer.

    The state is a set of SUMS over the tokens seen, so that statistics gathered on disjoint
    windows (several sites, several batches) add up exactly to those of their union
    (:meth:`merge`; the statistics mode of federated pruning sends them):

    * ``sq_sum[j] = sum_t x_tj^2`` in float64 (every float32 square is exact in float64, so
      the sum of any grouping of the same tokens agrees to about 1e-16 relative: after the cast
      to float32 the union's Wanda norms are identical however the tokens were split);
    * ``hessian_sum = sum_t 2 x_t x_t^T`` in float64
      (:data:`~fedcompress.models.common.HESSIAN_DTYPE`; with ``hessian=True``), SparseGPT's Hessian
      before the division by the token count: the products of float32 inputs are exact in float64,
      so any grouping of the same tokens agrees to ~1e-16 relative;
    * ``tokens``: how many tokens were added.

    ``sq_norm`` (Wanda's ``scaler_row``: the mean over tokens of ``x_j^2``) is derived in
    float32, ``hessian`` (``2/N X^T X``, so its scale does not depend on the number of windows)
    in float64.
    """

    def __init__(self, in_features: int, device: torch.device | None = None,
                 hessian: bool = False):
        self.tokens = 0
        self.sq_sum = torch.zeros(in_features, dtype=torch.float64, device=device)
        self.hessian_sum = (torch.zeros(in_features, in_features, dtype=HESSIAN_DTYPE,
                                        device=device) if hessian else None)

    @property
    def in_features(self) -> int:
        return int(self.sq_sum.shape[0])

    def add(self, x: torch.Tensor) -> None:
        self.add_sums(*input_sums(x, self.hessian_sum is not None))

    def add_sums(self, tokens: int, sq_sum: torch.Tensor,
                 hessian_sum: torch.Tensor | None) -> None:
        """Add the sums of :func:`input_sums` (computed once for linears fed the same input)."""
        self.sq_sum.add_(sq_sum)
        if self.hessian_sum is not None:
            if hessian_sum is None:
                raise ValueError("these statistics hold a Hessian: the sums must include one")
            self.hessian_sum.add_(hessian_sum)
        self.tokens += tokens

    def merge(self, other: LayerStats) -> LayerStats:
        """Add ``other``'s sums (statistics of other tokens) to these, in place."""
        if other.in_features != self.in_features:
            raise ValueError(f"statistics of {other.in_features} input features cannot be "
                             f"added to statistics of {self.in_features}")
        if (other.hessian_sum is None) != (self.hessian_sum is None):
            raise ValueError("statistics with and without a Hessian cannot be added")
        self.sq_sum.add_(other.sq_sum.to(self.sq_sum.device))
        if self.hessian_sum is not None and other.hessian_sum is not None:
            self.hessian_sum.add_(other.hessian_sum.to(self.hessian_sum.device))
        self.tokens += other.tokens
        return self

    def _require_tokens(self) -> None:
        if self.tokens <= 0:
            raise ValueError("no tokens were added to these statistics")

    @property
    def sq_norm(self) -> torch.Tensor:
        """Mean over tokens of ``x_j^2`` (float32)."""
        self._require_tokens()
        return (self.sq_sum / self.tokens).to(CALC_DTYPE)

    @property
    def hessian(self) -> torch.Tensor | None:
        """``2/N X^T X`` (:data:`~fedcompress.models.common.HESSIAN_DTYPE`), or None without one."""
        if self.hessian_sum is None:
            return None
        self._require_tokens()
        return self.hessian_sum / self.tokens


def input_sums(x: torch.Tensor, hessian: bool
               ) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """``(tokens, sum_t x_tj^2 (float64), sum_t 2 x_t x_t^T (HESSIAN_DTYPE) or None)`` of a
    batch of a linear layer's inputs (float32 values, as the model computes them)."""
    x = x.reshape(-1, x.shape[-1]).to(CALC_DTYPE)
    wide = x.to(torch.float64)
    sq = wide.pow(2).sum(0)
    hess = None
    if hessian:
        xh = wide if HESSIAN_DTYPE == torch.float64 else x.to(HESSIAN_DTYPE)
        hess = torch.mm(xh.T, xh).mul_(2.0)
    return int(x.shape[0]), sq, hess


def observed_input_owners(linears: Mapping[str, nn.Module], run: Callable[[], object],
                          what: str = "") -> dict[str, str]:
    """:func:`input_owners` of the input tensor each of ``linears`` reads during ``run()``
    (a forward pass), seen by forward pre-hooks removed afterwards; a linear that reads nothing
    is an error naming it (``what``: the layer, for the message)."""
    seen: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_pre_hook(
        lambda _m, args, name=name: seen.setdefault(name, args[0]))
        for name, m in linears.items()]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    missing = sorted(set(linears) - set(seen))
    if missing:
        raise RuntimeError(f"{what}linear layers {missing} saw no input")
    return input_owners(seen)


def input_owners(seen: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{linear name: owner}`` from the input tensor each linear layer was called with
    (``seen``, e.g. gathered by forward pre-hooks): linears fed the very same tensor object
    (q/k/v, gate/up) share one owner, the first of them in sorted order; the others own
    themselves."""
    owners: dict[str, str] = {}
    firsts: list[str] = []
    for name in sorted(seen):
        owner = next((o for o in firsts if seen[o] is seen[name]), None)
        if owner is None:
            firsts.append(name)
            owner = name
        owners[name] = owner
    return owners


def _call_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def collect_stats(layer: nn.Module, inputs: LayerInputs, hessian: bool = False,
                  batch_size: int = 8) -> dict[str, LayerStats]:
    """Forward the inputs through ``layer`` and gather the statistics of each linear layer."""
    linears = ModelAdapter.linear_layers(layer)
    device = inputs.hidden.device
    stats = {name: LayerStats(weight_matrix(m).shape[1], device, hessian)
             for name, m in linears.items()}
    # Linears fed the same tensor object (q/k/v, gate/up) share one computation of the sums;
    # the strong reference keeps that tensor's memory from being reused by another input.
    last: list = [None, None]

    def hook(_m, args, name):
        x = args[0]
        if last[0] is not x:
            last[0], last[1] = x, input_sums(x, hessian)
        stats[name].add_sums(*last[1])

    handles = [m.register_forward_pre_hook(lambda _m, args, name=name: hook(_m, args, name))
               for name, m in linears.items()]
    try:
        kwargs = inputs.layer_kwargs[inputs.layer]
        for rows in _batches(len(inputs.hidden), batch_size):
            _call_layer(layer, inputs.hidden[rows], kwargs)
            last[0] = last[1] = None
    finally:
        for handle in handles:
            handle.remove()
    return stats


def _checked_linears(layer: nn.Module, masks: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
    linears = ModelAdapter.linear_layers(layer)
    unknown = set(masks) - set(linears)
    if unknown:
        raise KeyError(f"masks for unknown linear layers {sorted(unknown)}; the layer has "
                       f"{sorted(linears)}")
    for name, mask in masks.items():
        shape = weight_matrix(linears[name]).shape
        if mask.shape != shape:
            raise ValueError(f"mask of {name} has shape {tuple(mask.shape)}, the weight "
                             f"{tuple(shape)}")
    return linears


def prune_layer_in_place(layer: nn.Module, masks: dict[str, torch.Tensor],
                         weights: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Write the updated weights (if given) into ``layer`` and zero its pruned weights: only
    for a private copy, such as an onloaded layer about to be freed (:func:`forward_layer`
    otherwise passes :func:`pruned_parameters` and leaves the layer untouched)."""
    linears = _checked_linears(layer, masks)
    with torch.no_grad():
        for name, mask in masks.items():
            w = weight_matrix(linears[name])
            if weights is not None and name in weights:
                w.copy_(weights[name].to(w.dtype))
            w.masked_fill_(mask.to(w.device), 0)
    return layer


def pruned_parameters(layer: nn.Module, masks: dict[str, torch.Tensor],
                      weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``{parameter name: pruned weight}`` of ``layer``'s masked linears, new tensors (the
    layer is untouched), for :func:`torch.func.functional_call`."""
    linears = _checked_linears(layer, masks)
    params: dict[str, torch.Tensor] = {}
    for name, mask in masks.items():
        module = linears[name]
        w = weight_matrix(module)
        source = weights[name].to(w.dtype) if weights is not None and name in weights else w
        # where(), not masked_fill(): the same values (+0.0 where pruned) in one pass, about
        # twice as fast (masked_fill copies, then fills)
        pruned = torch.where(mask.to(w.device), 0.0, source.detach())
        # weight_matrix is a transposed view for Conv1D: give the parameter its own layout.
        params[f"{name}.weight"] = pruned if w is module.weight else pruned.T
    return params


@torch.no_grad()
def forward_layer(layer: nn.Module, inputs: LayerInputs, batch_size: int = 8,
                  masks: dict[str, torch.Tensor] | None = None,
                  weights: dict[str, torch.Tensor] | None = None,
                  in_place: bool = False) -> LayerInputs:
    """The inputs of the next layer: ``inputs`` forwarded through ``layer``, or with ``masks``
    (and SparseGPT's updated ``weights``) through the pruned layer, without copying the layer
    (the pruned weights are passed by :func:`torch.func.functional_call`); ``in_place``: prune
    ``layer`` itself first (only for a private copy, such as an onloaded layer about to be
    freed)."""
    kwargs = inputs.layer_kwargs[inputs.layer]
    params = None
    if masks is not None and in_place:
        prune_layer_in_place(layer, masks, weights)
    elif masks is not None:
        params = pruned_parameters(layer, masks, weights)
    outs = torch.empty_like(inputs.hidden)
    for rows in _batches(len(inputs.hidden), batch_size):
        if params is None:
            outs[rows] = _call_layer(layer, inputs.hidden[rows], kwargs)
        else:
            out = torch.func.functional_call(layer, params, (inputs.hidden[rows],), kwargs)
            outs[rows] = out[0] if isinstance(out, tuple) else out
    return LayerInputs(outs, inputs.layer_kwargs, inputs.layer + 1)


#: ``(layer_index, layer, stats) -> (prune masks, updated weights or None)`` for one layer.
LayerPruneFn = Callable[[int, nn.Module, dict[str, LayerStats]],
                        tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]]


@dataclass
class WalkResult:
    """Prune masks (True = pruned) per decoder layer and linear layer name; ``weights``: the
    updated weights (with ``keep_weights``); ``quant``: with a quantizing prune function (one
    with a ``quantized`` attribute, :class:`~fedcompress.pruning.local.LayerPruner`), per
    decoder layer the :class:`~fedcompress.quant.solver.QuantResult` of each linear layer (the
    integers, scales and zero points a saved model needs), else empty."""

    masks: list[dict[str, torch.Tensor]] = field(default_factory=list)
    weights: list[dict[str, torch.Tensor] | None] = field(default_factory=list)
    quant: list[dict[str, QuantResult] | None] = field(default_factory=list)


def unpruned_masks(layer: nn.Module) -> dict[str, torch.Tensor]:
    """All-False prune masks (nothing pruned) of every linear layer of ``layer``."""
    return {name: torch.zeros(weight_matrix(m).shape, dtype=torch.bool)
            for name, m in ModelAdapter.linear_layers(layer).items()}


def walk(model: nn.Module, windows: torch.Tensor, prune_fn: LayerPruneFn,
         hessian: bool = False, batch_size: int = 8, keep_weights: bool = False,
         progress: bool = False, dense: Collection[int] = ()) -> WalkResult:
    """One sequential pass: per layer, statistics -> ``prune_fn`` -> forward through the pruned
    layer. Returns every layer's masks (and SparseGPT's updated weights if ``keep_weights``).

    ``dense``: layers left as they are (e.g. ratio 0 in a per-layer plan, or the layers a
    FedSpaLLM site was not assigned): no statistics and no ``prune_fn`` call, all-False masks
    and no weights; the windows are forwarded through those before the last pruned layer, and
    not through those after it (nothing reads them). Without ``dense`` the pass is the same,
    operation for operation, as one that names none."""
    from tqdm.auto import tqdm

    adapter = ModelAdapter(model)
    n_layers = len(adapter)
    dense = frozenset(int(i) for i in dense)
    outside = sorted(i for i in dense if not 0 <= i < n_layers)
    if outside:
        raise ValueError(f"dense layers {outside}: the model has layers 0..{n_layers - 1}")
    last = max((i for i in range(n_layers) if i not in dense), default=-1)
    inputs = capture_layer_inputs(model, windows, batch_size) if last >= 0 else None
    result = WalkResult()
    onloading = adapter.onloader is not None
    quantized = getattr(prune_fn, "quantized", None)
    for index in tqdm(range(n_layers), desc="pruning layers", disable=not progress,
                      leave=False):
        # An onloaded layer is read here and freed at the end of the block.
        with adapter.onloaded(index) as layer:
            if index in dense:
                masks, weights = unpruned_masks(layer), None
                if index < last:
                    assert inputs is not None
                    inputs = forward_layer(layer, inputs, batch_size)
            else:
                assert inputs is not None
                stats = collect_stats(layer, inputs, hessian=hessian, batch_size=batch_size)
                masks, weights = prune_fn(index, layer, stats)
                inputs = forward_layer(layer, inputs, batch_size, masks, weights,
                                       in_place=onloading)
                del stats
        result.masks.append({k: v.cpu() for k, v in masks.items()})
        result.weights.append({k: v.cpu() for k, v in weights.items()}
                              if keep_weights and weights else None)
        if quantized is not None:
            layer_quant = quantized.pop(index, None)
            result.quant.append({k: v.to("cpu") for k, v in layer_quant.items()}
                                if layer_quant is not None else None)
    return result
