"""Local pruning: one client's (or the centralized server's) masks from its calibration windows.

:class:`PruneConfig` names a local pruning recipe, optionally with weight quantization
(:class:`~fedcompress.quant.config.QuantConfig`); :func:`layer_prune_fn` turns it into the
per-layer function the calibration walker calls; :func:`local_masks` runs the whole pass.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

import torch
from torch import nn

from fedcompress.models import CALC_DTYPE, ModelAdapter, weight_matrix
from fedcompress.pruning.allocation import SparsityPlan, outlier_ratio
from fedcompress.pruning.scores import (
    SPARSEGPT_BLOCKSIZE,
    SPARSEGPT_PERCDAMP,
    magnitude_scores,
    ria_scores,
    sparsegpt_prune,
    taylor_scores,
    wanda_scores,
)
from fedcompress.pruning.walker import LayerStats, WalkResult, walk
from fedcompress.quant.config import QuantConfig
from fedcompress.quant.solver import (
    QuantResult,
    gptq_quantize,
    rtn_quantize,
    sparsegpt_quantize,
)
from fedcompress.solver.select import check_group, check_sparsity, parse_nm, select_prune_mask

METHODS = ("magnitude", "wanda", "ria", "sparsegpt", "gradient")
#: Local methods whose statistics are sums over tokens, so that statistics mode prunes with them
#: exactly (magnitude needs no data; the gradient method needs the whole model's backward pass).
STATS_METHODS = ("wanda", "ria", "sparsegpt")
#: The method of a recipe that only quantizes (:attr:`PruneConfig.quant` required).
NO_PRUNING = "none"
#: Methods whose scores come from the whole model at once (no calibration walk of the layers):
#: magnitude needs no data; gradient one backward pass of the dense model over the windows.
WHOLE_MODEL_METHODS = ("magnitude", "gradient")


@dataclass(frozen=True)
class PruneConfig:
    """A local pruning recipe.

    ``method``: ``magnitude`` (``|W|``), ``wanda`` (``|W| * ||X_j||``), ``ria`` (relative
    importance times ``||X_j||^0.5``, :func:`~fedcompress.pruning.scores.ria_scores`: the same
    statistics as Wanda), ``sparsegpt`` (OBS with weight update) or ``gradient`` (first-order
    Taylor ``|W * dL/dW|``, the gradient of the mean token loss of the windows through the DENSE
    model, :func:`weight_gradients`).
    ``group`` is the *local* comparison group (``layer``/``row``/``column``); ``nm`` an N:M
    pattern like ``"2:4"`` (then ``sparsity`` is implied: N/M). ``layer_sparsity`` is a
    per-layer / per-linear plan (:meth:`~fedcompress.pruning.allocation.SparsityPlan.to_text`;
    empty: ``sparsity`` everywhere); N:M fixes the ratio of every layer, so it takes no plan.
    ``onload``: sequential onloading (:func:`local_masks` walks a skeleton that reads one decoder
    layer at a time from the model's safetensors files; the same masks with a fraction of the
    memory); the ``gradient`` method needs the whole model and refuses it.
    ``sparsegpt_block_size`` and ``sparsegpt_dampening``: SparseGPT's columns per block (a
    block's mask is chosen over the block) and the fraction of the Hessian's mean diagonal added
    to its diagonal (with GPTQ, the one sweep takes the quantization's, which must be equal).

    ``quant``: quantize every linear layer of the decoder layers too, in the same pass
    (:func:`layer_prune_fn`): GPTQ or round-to-nearest of the kept weights (pruned weights stay
    exactly 0); the next layer's inputs come from the quantized layer. ``method="none"``
    (:data:`NO_PRUNING`, with ``sparsity=0``): quantization alone. ``sparsegpt`` with GPTQ prunes
    and quantizes jointly in one OBS sweep; ``magnitude``/``wanda``/``ria`` select the mask first,
    then GPTQ compensates the pruned and the quantized weights with a fixed mask.
    """

    method: str = "wanda"
    sparsity: float = 0.5
    group: str = "row"
    nm: str | None = None
    layer_sparsity: str = ""
    onload: bool = False
    quant: QuantConfig | None = None
    sparsegpt_block_size: int = SPARSEGPT_BLOCKSIZE
    sparsegpt_dampening: float = SPARSEGPT_PERCDAMP

    def __post_init__(self):
        if self.method not in METHODS and self.method != NO_PRUNING:
            raise ValueError(f"unknown pruning method {self.method!r}: expected one of "
                             f"{', '.join(METHODS)}, or {NO_PRUNING} with quantization")
        if self.quant is not None and not isinstance(self.quant, QuantConfig):
            raise ValueError(f"quant={self.quant!r}: expected a QuantConfig or None")
        if self.method == NO_PRUNING:
            if self.quant is None:
                raise ValueError("pruning method none prunes nothing: expected a quantization "
                                 "recipe (quant) with it")
            if self.sparsity != 0 or self.nm_pattern is not None or self.layer_sparsity:
                raise ValueError(f"pruning method none with sparsity {self.sparsity}, N:M "
                                 f"{self.nm}, plan {self.layer_sparsity!r}: expected sparsity "
                                 "0, no N:M and no per-layer plan")
        if self.quant is not None and self.method == "gradient":
            raise ValueError("quantization with the gradient method: expected none, magnitude, "
                             "wanda or sparsegpt (the quantization runs in the sequential pass "
                             "over the layers, the gradient scores need the whole model)")
        check_group(self.group)
        if isinstance(self.sparsegpt_block_size, bool) or not isinstance(
                self.sparsegpt_block_size, int) or self.sparsegpt_block_size < 1:
            raise ValueError(f"sparsegpt_block_size={self.sparsegpt_block_size!r}: expected an "
                             "integer >= 1")
        if not (isinstance(self.sparsegpt_dampening, (int, float))
                and 0 < self.sparsegpt_dampening < 1):
            raise ValueError(f"sparsegpt_dampening={self.sparsegpt_dampening!r}: expected a "
                             "number in (0, 1)")
        if (self.method == "sparsegpt" and self.quant is not None and self.quant.method == "gptq"
                and (self.sparsegpt_block_size, self.sparsegpt_dampening)
                != (self.quant.block_size, self.quant.dampening)):
            raise ValueError(f"sparsegpt_block_size {self.sparsegpt_block_size} and "
                             f"sparsegpt_dampening {self.sparsegpt_dampening} with GPTQ's "
                             f"{self.quant.block_size} and {self.quant.dampening}: SparseGPT "
                             "with GPTQ is one sweep, with one block size and one dampening: "
                             "expected the same")
        if self.nm_pattern is None:
            check_sparsity(self.sparsity)
        elif self.layer_sparsity:
            raise ValueError(f"a per-layer sparsity plan with N:M {self.nm}: N:M fixes every "
                             "layer's ratio at N/M; expected one or the other")
        self.plan  # noqa: B018 - validates the plan
        if self.onload and self.method == "gradient":
            raise ValueError("onloading reads one decoder layer at a time; the gradient method "
                             "needs a backward pass through the whole model: expected "
                             "magnitude, wanda, ria or sparsegpt with onload")

    @cached_property
    def plan(self) -> SparsityPlan:
        """The target ratio of every linear layer (uniform unless ``layer_sparsity``)."""
        return SparsityPlan.from_text(self.layer_sparsity, self.target_sparsity)

    @property
    def nm_pattern(self) -> tuple[int, int] | None:
        return parse_nm(self.nm)

    @property
    def target_sparsity(self) -> float:
        nm = self.nm_pattern
        return nm[0] / nm[1] if nm else self.sparsity

    @property
    def needs_hessian(self) -> bool:
        return self.method == "sparsegpt" or bool(self.quant and self.quant.needs_hessian)

    @property
    def needs_walk(self) -> bool:
        """Whether the masks (and quantized weights) come from the sequential pass over the
        layers: every recipe but magnitude, gradient and data-free RTN (with method none or
        magnitude)."""
        if self.quant is not None and self.quant.method != "rtn":
            return True
        return self.method not in (*WHOLE_MODEL_METHODS, NO_PRUNING)

    def to_dict(self) -> dict:
        return asdict(self)

    def check_widths(self, model: nn.Module) -> None:
        """With quantization: refuse a model one of whose quantized layers' input width the
        group size does not divide (:meth:`QuantConfig.check_width`), before any work."""
        if self.quant is None:
            return
        for index, layer in enumerate(ModelAdapter(model).layers):
            for name, module in ModelAdapter.linear_layers(layer).items():
                self.quant.check_width(f"layer {index} {name}", weight_matrix(module).shape[1])


class LayerPruner:
    """The walker's per-layer function of a recipe (:func:`layer_prune_fn`):
    ``(index, layer, stats) -> (masks, weights or None)``. With quantization it also records
    each linear layer's :class:`~fedcompress.quant.solver.QuantResult` in :attr:`quantized`
    (``{layer index: {linear name: result}}``; the walker moves them into
    :attr:`~fedcompress.pruning.walker.WalkResult.quant`), and ``weights`` are the dequantized
    float32 weights (masks all False where nothing is pruned)."""

    def __init__(self, config: PruneConfig,
                 gradients: list[dict[str, torch.Tensor]] | None = None):
        if config.method == "gradient" and gradients is None:
            raise ValueError("the gradient method scores weights by |W * dL/dW|: expected the "
                             "gradients of the calibration loss (weight_gradients)")
        self.config = config
        self.gradients = gradients
        self.nm = config.nm_pattern
        self.plan = config.plan
        self.quantized: dict[int, dict[str, QuantResult]] = {}

    def __call__(self, index: int, layer: nn.Module, stats: dict[str, LayerStats]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        config, nm = self.config, self.nm
        masks: dict[str, torch.Tensor] = {}
        weights: dict[str, torch.Tensor] = {}
        linears = ModelAdapter.linear_layers(layer)
        if config.quant is not None:
            for name, module in linears.items():
                config.quant.check_width(f"layer {index} {name}", weight_matrix(module).shape[1])
            self.quantized[index] = {}
        for name, module in linears.items():
            w = weight_matrix(module)
            ratio = self.plan.at(index, name)
            if config.quant is not None:
                masks[name], weights[name] = self._quantize(index, name, w, stats, ratio)
                continue
            if config.method == "sparsegpt":
                masks[name], weights[name] = sparsegpt_prune(
                    w, stats[name].hessian, ratio, config.group, nm,
                    config.sparsegpt_block_size, config.sparsegpt_dampening, name=name)
                continue
            masks[name] = select_prune_mask(self._scores(index, name, w, stats), ratio,
                                            config.group, nm)
        return masks, (weights or None)

    def _scores(self, index: int, name: str, w: torch.Tensor,
                stats: dict[str, LayerStats]) -> torch.Tensor:
        if self.config.method == "magnitude":
            return magnitude_scores(w)
        if self.config.method == "gradient":
            assert self.gradients is not None
            return taylor_scores(w, self.gradients[index][name])
        if self.config.method == "ria":
            return ria_scores(w, stats[name].sq_norm)
        return wanda_scores(w, stats[name].sq_norm)

    def _quantize(self, index: int, name: str, w: torch.Tensor, stats: dict[str, LayerStats],
                  ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prune mask, dequantized float32 weight)`` of one linear layer; records its
        :class:`~fedcompress.quant.solver.QuantResult`. The scales are the dense weight's, in
        the recipe's scale dtype (the dtype they are saved in, whatever the model runs in)."""
        config, quant = self.config, self.config.quant
        assert quant is not None
        label = f"layer {index} {name}"
        sd = quant.torch_scale_dtype
        gptq = quant.method == "gptq"
        hessian = stats[name].hessian if gptq or config.method == "sparsegpt" else None
        if (gptq or config.method == "sparsegpt") and hessian is None:
            raise ValueError(f"{label}: {quant.method} with {config.method} needs the inputs' "
                             "Hessian: expected statistics gathered with hessian=True")
        if config.method == NO_PRUNING:
            # this step prunes nothing (an empty mask); a weight pruned before keeps its zeros
            mask = torch.zeros(w.shape, dtype=torch.bool, device=w.device)
            zeros = preserved_zeros(w) if quant.preserve_zeros else None
            result = (gptq_quantize(w, hessian, quant, scale_dtype=sd, mask=zeros, name=label)
                      if gptq else rtn_quantize(w, quant, scale_dtype=sd, mask=zeros,
                                                name=label))
        elif config.method == "sparsegpt" and gptq:
            mask, result = sparsegpt_quantize(w, hessian, quant, ratio, config.group, self.nm,
                                              scale_dtype=sd, name=label)
        elif config.method == "sparsegpt":
            mask, updated = sparsegpt_prune(w, hessian, ratio, config.group, self.nm,
                                            config.sparsegpt_block_size,
                                            config.sparsegpt_dampening, name=label)
            result = rtn_quantize(updated, quant, scale_dtype=sd, mask=mask, dense=w,
                                  name=label)
        else:
            mask = select_prune_mask(self._scores(index, name, w, stats), ratio, config.group,
                                     self.nm)
            result = (gptq_quantize(w, hessian, quant, scale_dtype=sd, mask=mask,
                                    name=label) if gptq
                      else rtn_quantize(w, quant, scale_dtype=sd, mask=mask, name=label))
        self.quantized[index][name] = result
        return mask, result.weight


#: With ``preserve_zeros``, quantization alone keeps a weight's zeros when at least this share
#: of it is 0 (a model pruned before): the ``SPARSITY_THRESHOLD`` of earlier llm-compressor
#: releases' GPTQ (0.14 keeps none).
PRESERVE_ZEROS_SPARSITY = 0.05


def preserved_zeros(w: torch.Tensor) -> torch.Tensor | None:
    """With ``QuantConfig.preserve_zeros``: the fixed mask quantization alone keeps at 0
    (True = stays 0): where ``w`` is 0 (within ``torch.isclose``'s 1e-8) when at least
    :data:`PRESERVE_ZEROS_SPARSITY` of ``w`` is exactly 0, else None (a dense weight: the sweep
    as before), as earlier llm-compressor releases' GPTQ kept a pruned model's zeros (no error
    pushed into them). A zero's own error is 0, so the sweep is otherwise unchanged."""
    if int(torch.count_nonzero(w == 0)) < PRESERVE_ZEROS_SPARSITY * w.numel():
        return None
    return w.abs() <= 1e-8


def layer_prune_fn(config: PruneConfig,
                   gradients: list[dict[str, torch.Tensor]] | None = None) -> LayerPruner:
    """The walker's per-layer function for a recipe (:class:`LayerPruner`): masks (+
    SparseGPT's updated weights, or the quantized weights). ``gradients`` (one dict per decoder
    layer, :func:`weight_gradients`): required by the ``gradient`` method, ignored by the
    others."""
    return LayerPruner(config, gradients)


def local_masks(model: nn.Module, windows: torch.Tensor, config: PruneConfig,
                batch_size: int = 8, keep_weights: bool = False,
                progress: bool = False) -> WalkResult:
    """Prune masks of every linear layer of every decoder layer, from one sequential pass.

    With ``config.onload`` the pass walks an onloaded skeleton (``model`` itself if it is one,
    else one read from the safetensors folder ``model`` was loaded from,
    :func:`~fedcompress.models.onload.onload_skeleton`): one decoder layer in memory at a time.

    With ``config.quant``: :attr:`~fedcompress.pruning.walker.WalkResult.quant` holds every
    linear layer's :class:`~fedcompress.quant.solver.QuantResult` (integers, scales, zero
    points, ``g_idx``), whose :attr:`~fedcompress.quant.solver.QuantResult.weight` is, bit for
    bit, the dequantized weight the pass forwarded through (and, with ``keep_weights``, the one
    in :attr:`~fedcompress.pruning.walker.WalkResult.weights`). Every quantized layer's width is
    checked against the group size before any work.

    A decoder layer the plan leaves dense (:meth:`~fedcompress.pruning.allocation.SparsityPlan.
    dense_layers`, without quantization) is only forwarded: all-False masks, no weights.
    """
    from fedcompress.models import onload_skeleton, onloader_of

    config.plan.check_layers(len(ModelAdapter(model)))
    config.check_widths(model)
    if config.onload:
        model = onload_skeleton(model)
    elif onloader_of(model) is not None and config.method == "gradient":
        raise ValueError("the gradient method needs the whole model: this one is an onloaded "
                         "skeleton (load it without onload)")
    if not config.needs_walk:
        # No layer-by-layer activations: magnitude and RTN need none, gradient one backward pass.
        adapter = ModelAdapter(model)
        grads = (weight_gradients(model, windows, batch_size) if config.method == "gradient"
                 else None)
        fn = layer_prune_fn(config, grads)
        result = WalkResult()
        for index in range(len(adapter)):
            with adapter.onloaded(index) as layer:
                masks, weights = fn(index, layer, {})
            result.masks.append({k: v.cpu() for k, v in masks.items()})
            result.weights.append({k: v.cpu() for k, v in weights.items()}
                                  if keep_weights and weights else None)
            if config.quant is not None:
                result.quant.append({k: v.to("cpu")
                                     for k, v in fn.quantized.pop(index).items()})
        return result
    # A layer the plan leaves dense costs only its forward (none past the last pruned layer):
    # its masks are all False and its weights its own, as pruning it at ratio 0 would give but
    # for SparseGPT's zeroing of input columns the windows never reach. Quantization has work
    # to do on every layer, so nothing is skipped with it.
    dense = config.plan.dense_layers(len(ModelAdapter(model))) if config.quant is None else ()
    return walk(model, windows, layer_prune_fn(config), hessian=config.needs_hessian,
                batch_size=batch_size, keep_weights=keep_weights, progress=progress,
                dense=dense)


def token_nll(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The summed next-token cross-entropy (float32, differentiable) of windows ``ids``
    ``[n, seqlen]`` under the causal LM ``model``, and the number of predicted tokens."""
    logits = model(input_ids=ids).logits[:, :-1].to(CALC_DTYPE)
    target = ids[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             target.reshape(-1), reduction="sum")
    return loss, target.numel()


def weight_gradients(model: nn.Module, windows: torch.Tensor, batch_size: int = 8
                     ) -> list[dict[str, torch.Tensor]]:
    """The gradient of the mean token loss over ``windows`` with respect to every prunable
    weight (one dict per decoder layer, keyed like the masks), summed in float32 over batches
    (each batch's gradient is in the model's dtype). Only those weights require gradients during
    the pass (the embeddings and head do not; flags restored after); the model is unchanged and
    runs in eval mode (no dropout)."""
    if windows.dim() != 2 or windows.shape[0] == 0 or windows.shape[1] < 2:
        raise ValueError(f"windows of shape {tuple(windows.shape)}: expected [n >= 1, "
                         "seqlen >= 2] token ids")
    adapter = ModelAdapter(model)
    targets = [{name: module.weight for name, module in ModelAdapter.linear_layers(layer).items()}
               for layer in adapter.layers]
    flags = {p: p.requires_grad for p in model.parameters()}
    sums = [{name: torch.zeros(w.shape, dtype=CALC_DTYPE) for name, w in layer.items()}
            for layer in targets]
    tokens = windows.shape[0] * (windows.shape[1] - 1)
    device = next(model.parameters()).device
    was_training = model.training
    try:
        model.eval()
        for p in flags:
            p.requires_grad_(False)
        for layer in targets:
            for w in layer.values():
                w.requires_grad_(True)
                w.grad = None
        with torch.enable_grad():
            for start in range(0, windows.shape[0], batch_size):
                loss, _ = token_nll(model, windows[start:start + batch_size].to(device))
                (loss / tokens).backward()
                for layer, acc in zip(targets, sums):
                    for name, w in layer.items():
                        assert w.grad is not None
                        acc[name] += w.grad.detach().to(CALC_DTYPE).cpu()
                        w.grad = None
    finally:
        model.train(was_training)
        for p, flag in flags.items():
            p.requires_grad_(flag)
            p.grad = None
    return sums


def outlier_ratios(model: nn.Module, windows: torch.Tensor, m: float, batch_size: int = 8,
                   progress: bool = False) -> list[float]:
    """OWL's outlier ratio of every decoder layer (:func:`~fedcompress.pruning.allocation.
    outlier_ratio` of its linear layers' Wanda scores, float32) from one pass of the
    calibration walker over ``windows`` through the DENSE model, as OWL measures them (the
    ratios decide the pruning, so they are taken before any)."""
    ratios: list[float] = []

    def record(_index, layer, stats):
        scores = [wanda_scores(weight_matrix(module), stats[name].sq_norm)
                  for name, module in ModelAdapter.linear_layers(layer).items()]
        ratios.append(outlier_ratio(scores, m))
        return {}, None

    walk(model, windows, record, batch_size=batch_size, progress=progress)
    return ratios


def layer_sizes(model: nn.Module) -> dict[str, int]:
    """Prunable weights of every linear layer, keyed ``"<layer>.<linear name>"``."""
    return {f"{i}.{name}": weight_matrix(module).numel()
            for i, layer in enumerate(ModelAdapter(model).layers)
            for name, module in ModelAdapter.linear_layers(layer).items()}


def check_global_ratio(plan: SparsityPlan, model: nn.Module, tolerance: float = 1e-6) -> float:
    """The plan's mean ratio over ``model``'s prunable weights, which must equal its default
    (the global sparsity) within ``tolerance``; else an error naming both."""
    plan.check_layers(len(ModelAdapter(model)))
    ratio = plan.global_ratio(layer_sizes(model))
    if abs(ratio - plan.default) > tolerance:
        raise ValueError(f"the per-layer sparsity plan prunes {ratio:.6f} of the weights, the "
                         f"global sparsity is {plan.default}: expected plans whose weighted "
                         "mean is the global sparsity")
    return ratio


def owl_plan(outliers: list[float], sparsity: float, lam: float, model: nn.Module
             ) -> SparsityPlan:
    """OWL's per-layer plan for ``model`` from its layers' outlier ratios (averaged over sites
    in a federated run), renormalized over the layers' sizes to ``sparsity``."""
    from fedcompress.pruning.allocation import owl_ratios

    sizes = layer_sizes(model)
    per_layer = [0] * len(ModelAdapter(model))
    for key, n in sizes.items():
        per_layer[int(key.split(".", 1)[0])] += n
    if len(outliers) != len(per_layer):
        raise ValueError(f"{len(outliers)} outlier ratios for a model of {len(per_layer)} "
                         "decoder layers")
    return SparsityPlan(sparsity, tuple(owl_ratios(outliers, sparsity, lam, per_layer)))


def column_norms(model: nn.Module, windows: torch.Tensor, prune: PruneConfig | None = None,
                 batch_size: int = 8, progress: bool = False) -> list[dict[str, torch.Tensor]]:
    """Per-input-column activation norms (float32, RMS over tokens) of every linear layer of
    every decoder layer (one dict per layer, like :attr:`WalkResult.masks`), from one pass of
    the calibration walker over ``windows`` (e.g. PUBLIC text: the reference of the compressed
    mask format).

    ``prune`` forwards each layer's samples through the layer pruned by that recipe, as the
    clients' pass does; None: the dense model.
    """
    norms: list[dict[str, torch.Tensor]] = []
    prune_fn = layer_prune_fn(prune) if prune is not None else None

    def record(index, layer, stats):
        norms.append({name: st.sq_norm.sqrt().to(CALC_DTYPE).cpu()
                      for name, st in stats.items()})
        return prune_fn(index, layer, stats) if prune_fn else ({}, None)

    walk(model, windows, record, hessian=bool(prune is not None and prune.needs_hessian),
         batch_size=batch_size, progress=progress)
    return norms


@torch.no_grad()
def apply_masks(model: nn.Module, masks: list[dict[str, torch.Tensor]],
                weights: list[dict[str, torch.Tensor] | None] | None = None) -> nn.Module:
    """Prune ``model`` in place: copy updated weights (if any), then zero the masked weights."""
    adapter = ModelAdapter(model)
    if len(masks) != len(adapter):
        raise ValueError(f"masks for {len(masks)} layers, the model has {len(adapter)}")
    for index in range(len(adapter)):
        apply_layer_masks(model, index, masks[index],
                          None if weights is None else weights[index])
    return model


@torch.no_grad()
def apply_layer_masks(model: nn.Module, index: int, masks: dict[str, torch.Tensor],
                      weights: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Prune decoder layer ``index`` of ``model`` in place (:func:`apply_masks` for one layer:
    a caller can hold one layer's masks and weights at a time)."""
    adapter = ModelAdapter(model)
    if not 0 <= index < len(adapter):
        raise ValueError(f"decoder layer {index}: expected 0..{len(adapter) - 1}")
    linears = ModelAdapter.linear_layers(adapter.layers[index])
    for name, mask in masks.items():
        if name not in linears:
            raise KeyError(f"layer {index} has no linear layer {name!r}")
        w = weight_matrix(linears[name])
        if mask.shape != w.shape:
            raise ValueError(f"mask of layer {index} {name} has shape {tuple(mask.shape)}, "
                             f"the weight {tuple(w.shape)}")
        if weights is not None and name in weights:
            w.copy_(weights[name].to(w.dtype))
        w.masked_fill_(mask.to(w.device), 0)
    return model


def sparsity_report(model: nn.Module) -> dict:
    """Fraction of zero weights per decoder layer (over its linear layers) and overall."""
    adapter = ModelAdapter(model)
    per_layer = []
    zeros = total = 0
    for layer in adapter.layers:
        z = t = 0
        for module in ModelAdapter.linear_layers(layer).values():
            w = weight_matrix(module)
            z += int((w == 0).sum())
            t += w.numel()
        per_layer.append(z / t)
        zeros += z
        total += t
    return {"overall": zeros / total, "per_layer": per_layer}
