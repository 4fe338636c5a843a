"""Personalized vs generic units of a model on one client's data (seed 004, Alg. 1 of Sec. III),
and the per-linear pruning ratios of its Eq. 4.

**Units.** The classified parts of the model (``granularity``): ``"sublayer"`` (default: the
attention and the MLP of each decoder block, i.e. its linear layers grouped by their first name
component, ``self_attn`` / ``mlp`` for LLaMA-like models), ``"linear"`` (every linear layer on
its own, the paper's "linear layer group" at its finest) or ``"layer"`` (a whole block).

**Alg. 1.** Line 2 ("learn the model on the dataset") is optional here (``adapt_steps``): a
few LoRA steps on the client's windows, merged into a COPY that serves the classification only
(the pruned model stays the shared one, so the sites' models share their global part). The
threshold is the client's loss with the model untouched. ``max_iter`` times: a
seeded random subset of ``k`` units (the paper's "Random Number") is switched off, the loss on
the client's data is measured, the model is restored; if the loss is ABOVE the threshold every
unit of the subset is *personalized*, if it is BELOW the threshold every unit of the subset not
already personalized is *generic* (equal: nothing). A unit first found generic and later
personalized ends personalized (Alg. 1 adds it to the personalized list unconditionally; its
generic entry only counts while it is not personalized). Units never drawn, or only drawn at
equal loss, are *others*.

*Where the paper contradicts itself:* Sec. III.B calls a unit personalized when
``L(D, W | w_s = 0) - L(D, W)`` (Eq. 2) is NEGATIVE, i.e. when removing it LOWERS the loss,
while Eq. 3 and Alg. 1 call it personalized when the loss with it removed is ABOVE the
threshold. We follow Alg. 1 (and Eq. 3): a unit whose removal hurts this client's loss is one
the client needs, which is also what Eq. 4 assumes when it prunes personalized units least.

**Switching a unit off** (``zero``): ``"weights"`` multiplies its weights by ``l_s = 0`` (the
paper's Eq. 1; biases stay), ``"skip"`` replaces each of its linear layers' outputs by zeros
(the paper's ``is_skip`` implementation; biases go too). For a bias-free attention or MLP both
remove the sublayer from the residual stream. The model is restored exactly after every draw
(the weights are copied back; the hooks removed), also on error.

**Eq. 4.** Each linear layer's ratio is ``p`` (generic), ``p/2`` (personalized) or
``(p + p/2)/2 = 3p/4`` (others), i.e. ``p`` times the class's factor (configurable); the factors
are then scaled by ONE constant so that the ratios' mean over the prunable weights is exactly
``p`` (:func:`~fedcompress.pruning.allocation.rescale`), which keeps Eq. 4's proportions; a plan
that cannot reach ``p`` (a ratio >= 1) is an error.

Losses are mean token cross-entropies of causal-LM windows, computed in float32.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from fedcompress.models import ModelAdapter, weight_matrix
from fedcompress.pruning.allocation import SparsityPlan, rescale
from fedcompress.pruning.local import token_nll

__all__ = [
    "CLASSES",
    "DEFAULT_FACTORS",
    "GRANULARITIES",
    "ZERO_MODES",
    "Classification",
    "ClassifyConfig",
    "classify_units",
    "mean_lm_loss",
    "personalized_plan",
    "switched_off",
    "units_of",
]

logger = logging.getLogger(__name__)

GRANULARITIES = ("sublayer", "linear", "layer")
ZERO_MODES = ("weights", "skip")
CLASSES = ("personalized", "generic", "others")
#: Eq. 4: the factor of ``p`` per class (generic p, personalized p/2, others (p + p/2)/2).
DEFAULT_FACTORS = {"generic": 1.0, "personalized": 0.5, "others": 0.75}


def units_of(model: nn.Module, granularity: str = "sublayer") -> dict[str, list[str]]:
    """The model's units in model order: ``unit name -> its linear layers`` (keys
    ``"<layer>.<linear name>"``). Unit names: ``"3.self_attn"`` (sublayer), ``"3.mlp.up_proj"``
    (linear), ``"3"`` (layer)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"unit granularity {granularity!r} is unknown: expected one of "
                         f"{', '.join(GRANULARITIES)}")
    units: dict[str, list[str]] = {}
    for i, layer in enumerate(ModelAdapter(model).layers):
        for name in ModelAdapter.linear_layers(layer):
            unit = {"sublayer": f"{i}.{name.split('.', 1)[0]}", "linear": f"{i}.{name}",
                    "layer": str(i)}[granularity]
            units.setdefault(unit, []).append(f"{i}.{name}")
    if not units:
        raise ValueError("the model has no linear layer to classify")
    return units


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    return {f"{i}.{name}": module for i, layer in enumerate(ModelAdapter(model).layers)
            for name, module in ModelAdapter.linear_layers(layer).items()}


@contextlib.contextmanager
def switched_off(model: nn.Module, linears: Sequence[str], zero: str = "weights"
                 ) -> Iterator[nn.Module]:
    """``model`` with the linear layers ``linears`` (keys ``"<layer>.<name>"``) switched off
    (module docstring), restored exactly on exit."""
    if zero not in ZERO_MODES:
        raise ValueError(f"zero={zero!r} is unknown: expected one of {', '.join(ZERO_MODES)}")
    modules = _linears(model)
    missing = [k for k in linears if k not in modules]
    if missing:
        raise ValueError(f"no linear layer {missing[:3]} in the model")
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = []
    try:
        with torch.no_grad():
            for key in linears:
                if zero == "weights":
                    w = weight_matrix(modules[key])
                    saved.append((w, w.detach().clone()))
                    w.zero_()
                else:
                    hooks.append(modules[key].register_forward_hook(
                        lambda _m, _i, out: torch.zeros_like(out)))
        yield model
    finally:
        with torch.no_grad():
            for w, copy in saved:
                w.copy_(copy)
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def mean_lm_loss(model: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> float:
    """Mean next-token cross-entropy (float32) of the causal LM ``model`` over ``windows``
    ``[n, seqlen]`` (every window has the same length, so the mean over windows is the mean
    over tokens)."""
    if windows.dim() != 2 or windows.shape[0] == 0 or windows.shape[1] < 2:
        raise ValueError(f"windows of shape {tuple(windows.shape)}: expected [n >= 1, "
                         "seqlen >= 2] token ids")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, windows.shape[0], batch_size):
            loss, n = token_nll(model, windows[start:start + batch_size].to(device))
            total += float(loss)
            count += n
    finally:
        model.train(was_training)
    return total / count


@dataclass(frozen=True)
class ClassifyConfig:
    """Alg. 1's settings (module docstring).

    Attributes:
        k: Units switched off per draw (the paper's "Random Number": 2, 4 or 8).
        max_iter: Draws.
        granularity: ``"sublayer"``, ``"linear"`` or ``"layer"``.
        zero: ``"weights"`` or ``"skip"``.
        seed: Seeds the draws (and the adaptation).
        batch_size: Windows per forward pass.
        adapt_steps: Alg. 1 line 2 ("learn the model on the dataset"): LoRA steps (r 8, AdamW,
            ``batch_size`` windows per step) on the client's windows before the draws; the
            threshold and the draws use the adapted model; 0: the model as given.
        adapt_lr: That adaptation's learning rate.
    """

    k: int = 4
    max_iter: int = 32
    granularity: str = "sublayer"
    zero: str = "weights"
    seed: int = 0
    batch_size: int = 4
    adapt_steps: int = 0
    adapt_lr: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("k", "max_iter", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: expected an int >= 1")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity={self.granularity!r} is invalid: expected one of "
                             f"{', '.join(GRANULARITIES)}")
        if self.zero not in ZERO_MODES:
            raise ValueError(f"zero={self.zero!r} is invalid: expected one of "
                             f"{', '.join(ZERO_MODES)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} is invalid: expected an int >= 0")
        steps = self.adapt_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"adapt_steps={steps!r} is invalid: expected an int >= 0")
        lr = self.adapt_lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
            raise ValueError(f"adapt_lr={lr!r} is invalid: expected a number > 0")


@dataclass
class Classification:
    """One client's classes: ``classes[unit]`` is ``"personalized"``, ``"generic"`` or
    ``"others"``; ``units`` maps each unit to its linear layers; ``draws`` lists every draw's
    units and loss; ``threshold`` is the untouched model's loss."""

    classes: dict[str, str]
    units: dict[str, list[str]]
    threshold: float
    draws: list[dict] = field(default_factory=list)
    adapt_losses: list[float] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {c: sum(1 for v in self.classes.values() if v == c) for c in CLASSES}

    def linear_classes(self) -> dict[str, str]:
        """The class of every linear layer (its unit's)."""
        return {linear: self.classes[unit] for unit, linears in self.units.items()
                for linear in linears}

    def to_dict(self) -> dict:
        return {"threshold": self.threshold, "classes": dict(self.classes),
                "counts": self.counts(), "draws": list(self.draws),
                "adapt_losses": list(self.adapt_losses)}


def adapted_copy(model: nn.Module, windows: torch.Tensor, steps: int, lr: float, seed: int,
                 batch_size: int = 4) -> tuple[nn.Module, list[float]]:
    """A copy of ``model`` after ``steps`` LoRA steps (r 8, alpha 16, AdamW at ``lr``, seeded)
    of the causal LM loss on ``windows``, the adapters merged into the weights; and the
    training losses. ``model`` is unchanged."""
    import copy

    from fedcompress.privacy.classifier import Encoded
    from fedcompress.privacy.finetune import FinetuneConfig, finetune

    n = windows.shape[0]
    size = min(batch_size, n)
    train = Encoded(tuple(tuple(int(t) for t in row) for row in windows.tolist()), (), 0)
    config = FinetuneConfig(mode="lora", epochs=steps * size / n, batch_size=size, lr=lr,
                            seed=seed)
    result = finetune(copy.deepcopy(model), train, config, pad=0, progress=False)
    merged = result.model.merge_and_unload()
    merged.eval()
    return merged, list(result.losses)


def classify_units(model: nn.Module, windows: torch.Tensor, config: ClassifyConfig,
                   progress: bool = False) -> Classification:
    """Alg. 1 on ``model`` and one client's ``windows`` (module docstring); ``model`` is left
    exactly as it was (with ``adapt_steps``, the draws run on an adapted copy)."""
    adapt_losses: list[float] = []
    if config.adapt_steps:
        model, adapt_losses = adapted_copy(model, windows, config.adapt_steps, config.adapt_lr,
                                           config.seed, config.batch_size)
        logger.info("adapted by %d LoRA steps: loss %.4f -> %.4f", config.adapt_steps,
                    adapt_losses[0], adapt_losses[-1])
    units = units_of(model, config.granularity)
    names = list(units)
    if config.k > len(names):
        raise ValueError(f"k={config.k} units per draw, but the model has only {len(names)} "
                         f"{config.granularity} units: expected k <= {len(names)}")
    threshold = mean_lm_loss(model, windows, config.batch_size)
    rng = np.random.default_rng(config.seed)
    personalized: set[str] = set()
    generic: set[str] = set()
    draws = []
    from tqdm.auto import tqdm

    for _ in tqdm(range(config.max_iter), desc="classifying units", disable=not progress,
                  leave=False):
        subset = [names[int(i)] for i in sorted(rng.choice(len(names), config.k,
                                                            replace=False))]
        with switched_off(model, [lin for u in subset for lin in units[u]], config.zero):
            loss = mean_lm_loss(model, windows, config.batch_size)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss {loss} with units {subset} switched off")
        if loss > threshold:
            personalized.update(subset)
        elif loss < threshold:
            generic.update(u for u in subset if u not in personalized)
        draws.append({"units": subset, "loss": loss})
    classes = {u: "personalized" if u in personalized else
               "generic" if u in generic else "others" for u in names}
    result = Classification(classes, units, threshold, draws, adapt_losses)
    logger.info("classified %d units: %s (threshold loss %.4f)", len(names), result.counts(),
                threshold)
    return result


def personalized_plan(classes: Mapping[str, str], sizes: Mapping[str, int], sparsity: float,
                      factors: Mapping[str, float] | None = None) -> SparsityPlan:
    """Eq. 4's per-linear ratios from each linear layer's class (``classes``: linear key ->
    class, every key of ``sizes``), rescaled to a mean of ``sparsity`` over the weights
    (module docstring)."""
    factors = dict(DEFAULT_FACTORS if factors is None else factors)
    unknown = sorted(set(factors) - set(CLASSES)) + sorted(set(CLASSES) - set(factors))
    if unknown:
        raise ValueError(f"class factors for {sorted(factors)}: expected exactly {CLASSES}")
    for name, value in factors.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"factor of {name}={value!r} is invalid: expected a number >= 0")
    keys = list(sizes)
    missing = [k for k in keys if k not in classes]
    if missing:
        raise ValueError(f"no class for linear layers {missing[:3]}")
    bad = sorted({classes[k] for k in keys} - set(CLASSES))
    if bad:
        raise ValueError(f"unknown classes {bad}: expected {CLASSES}")
    ratios = rescale([factors[classes[k]] * sparsity for k in keys], [sizes[k] for k in keys],
                     sparsity)
    return SparsityPlan(sparsity, linears=dict(zip(keys, ratios)))
