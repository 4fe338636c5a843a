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
from fedcompress.pruning.allocation import SparsityPlan, bounded_rescale, rescale
from fedcompress.pruning.local import token_nll

__all__ = [
    "CLASSES",
    "DEFAULT_FACTORS",
    "DEFAULT_RATIO_BOUND",
    "GRANULARITIES",
    "RULES",
    "ZERO_MODES",
    "Classification",
    "ClassifyConfig",
    "PlanSummary",
    "classify_units",
    "mean_lm_loss",
    "personalized_plan",
    "plan_summary",
    "reclassify",
    "switched_off",
    "units_of",
]

logger = logging.getLogger(__name__)

GRANULARITIES = ("sublayer", "linear", "layer")
ZERO_MODES = ("weights", "skip")
#: Class rules: Alg. 1's threshold (the untouched loss) or a quantile of the draws' losses.
RULES = ("paper", "relative")
#: Default bound on every unit's ratio around the global p (personalized plans; 1: no bound):
#: the best of 0.05, 0.1 and 0.2 in simulations/results/bench-personalized-guard (the smaller,
#: the closer personalized came to uniform FedPrLLM).
DEFAULT_RATIO_BOUND = 0.05
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
        rule: The threshold a draw's loss is compared with: ``"paper"`` (Alg. 1: the untouched
            model's loss) or ``"relative"`` (the ``quantile`` of the draws' own losses; module
            docstring).
        quantile: The relative rule's quantile (0.5: the median draw).
    """

    k: int = 4
    max_iter: int = 32
    granularity: str = "sublayer"
    zero: str = "weights"
    seed: int = 0
    batch_size: int = 4
    adapt_steps: int = 0
    adapt_lr: float = 1e-3
    rule: str = "paper"
    quantile: float = 0.5

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
        if self.rule not in RULES:
            raise ValueError(f"rule={self.rule!r} is invalid: expected one of {', '.join(RULES)}")
        q = self.quantile
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q < 1:
            raise ValueError(f"quantile={q!r} is invalid: expected a number in (0, 1)")


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
    rule: str = "paper"
    base_loss: float | None = None  # the untouched model's loss (the paper's threshold)

    def counts(self) -> dict[str, int]:
        return {c: sum(1 for v in self.classes.values() if v == c) for c in CLASSES}

    def linear_classes(self) -> dict[str, str]:
        """The class of every linear layer (its unit's)."""
        return {linear: self.classes[unit] for unit, linears in self.units.items()
                for linear in linears}

    def to_dict(self) -> dict:
        return {"rule": self.rule, "threshold": self.threshold, "base_loss": self.base_loss,
                "classes": dict(self.classes), "counts": self.counts(),
                "draws": list(self.draws), "adapt_losses": list(self.adapt_losses)}


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
    base_loss = mean_lm_loss(model, windows, config.batch_size)
    rng = np.random.default_rng(config.seed)
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
        draws.append({"units": subset, "loss": loss})
    result = reclassify(units, draws, base_loss, config.rule, config.quantile)
    result.adapt_losses = adapt_losses
    logger.info("classified %d units (%s rule): %s (threshold loss %.4f, untouched %.4f)",
                len(names), config.rule, result.counts(), result.threshold, base_loss)
    return result


def reclassify(units: Mapping[str, list[str]], draws: Sequence[Mapping], base_loss: float,
               rule: str = "paper", quantile: float = 0.5) -> Classification:
    """Alg. 1's classes from its draws (``{"units", "loss"}`` in draw order) under ``rule``:
    the threshold is ``base_loss`` (the untouched model's loss: the paper) or the ``quantile``
    of the draws' losses (``"relative"``). A draw ABOVE the threshold makes its units
    personalized, BELOW makes those not already personalized generic; personalized wins
    (module docstring). The draws do not depend on the rule: one set of draws serves both.

    Why a relative rule: on a pretrained LM nearly every draw of ``k`` units switched off
    raises the loss above the untouched model's, so the paper's rule finds almost every drawn
    unit personalized and none generic (measured: ``docs/personalize.md``), and Eq. 4 then
    spreads ``p`` over the few units left. The median draw splits the drawn units into the
    half whose removal hurts this site most and the half it hurts least."""
    if rule not in RULES:
        raise ValueError(f"rule={rule!r} is invalid: expected one of {', '.join(RULES)}")
    if rule == "relative" and not draws:
        raise ValueError("the relative rule needs at least one draw")
    losses = np.array([float(d["loss"]) for d in draws], dtype=np.float64)
    threshold = (float(np.quantile(losses, quantile)) if rule == "relative"
                 else float(base_loss))
    personalized: set[str] = set()
    generic: set[str] = set()
    for draw, loss in zip(draws, losses):
        if loss > threshold:
            personalized.update(draw["units"])
        elif loss < threshold:
            generic.update(u for u in draw["units"] if u not in personalized)
    classes = {u: "personalized" if u in personalized else
               "generic" if u in generic else "others" for u in units}
    return Classification(classes, {u: list(v) for u, v in units.items()}, threshold,
                          [dict(d) for d in draws], [], rule, float(base_loss))


def personalized_plan(classes: Mapping[str, str], sizes: Mapping[str, int], sparsity: float,
                      factors: Mapping[str, float] | None = None,
                      bound: float | None = None) -> SparsityPlan:
    """Eq. 4's per-linear ratios from each linear layer's class (``classes``: linear key ->
    class, every key of ``sizes``), rescaled to a mean of ``sparsity`` over the weights
    (module docstring); with ``bound`` (< 1), no ratio strays more than ``bound`` from
    ``sparsity`` (:func:`~fedcompress.pruning.allocation.bounded_rescale`: the same plan when
    Eq. 4's ratios already lie inside it). :func:`plan_summary` says whether it bit."""
    keys, raw, weights = _plan_inputs(classes, sizes, sparsity, factors)
    if bound is None or bound >= 1:
        ratios = rescale(raw, weights, sparsity)
    else:
        ratios = bounded_rescale(raw, weights, sparsity, bound).ratios
    return SparsityPlan(sparsity, linears=dict(zip(keys, ratios)))


def _plan_inputs(classes: Mapping[str, str], sizes: Mapping[str, int], sparsity: float,
                 factors: Mapping[str, float] | None
                 ) -> tuple[list[str], list[float], list[int]]:
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
    return keys, [factors[classes[k]] * sparsity for k in keys], [sizes[k] for k in keys]


@dataclass(frozen=True)
class PlanSummary:
    """What a personalized plan does to the units (for reports): per class, the units and
    their ratio range; the weighted spread of the ratios; Eq. 4's unbounded ratios where the
    bound bit (``None`` when Eq. 4 alone cannot reach ``p``: some ratio >= 1)."""

    sparsity: float
    bound: float | None
    counts: dict[str, int]
    class_ratios: dict[str, list[float]]  # class -> [min, max] over its linear layers
    min_ratio: float
    max_ratio: float
    spread: float  # weighted standard deviation of the ratios around p
    bound_bit: bool
    clipped: dict[str, list[str]]  # "low" / "high" -> linear keys the bound clipped
    eq4_max: float | None  # the largest ratio of Eq. 4 without the bound

    def to_dict(self) -> dict:
        return {"sparsity": self.sparsity, "bound": self.bound, "counts": dict(self.counts),
                "class_ratios": dict(self.class_ratios), "min_ratio": self.min_ratio,
                "max_ratio": self.max_ratio, "spread": self.spread,
                "bound_bit": self.bound_bit, "clipped": dict(self.clipped),
                "eq4_max": self.eq4_max}

    def line(self) -> str:
        """One line for logs and tables."""
        ranges = ", ".join(f"{n} {c} linears at {lo:.3f}" + (f"-{hi:.3f}" if hi > lo else "")
                           for c, n in self.counts.items() if n
                           for lo, hi in [self.class_ratios[c]])
        bit = (f"; the bound {self.bound:g} bit ({len(self.clipped['low'])} linears raised, "
               f"{len(self.clipped['high'])} lowered; Eq. 4 alone: max "
               + (f"{self.eq4_max:.3f})" if self.eq4_max is not None else "out of reach)")
               if self.bound_bit else "")
        return (f"ratios {self.min_ratio:.3f}-{self.max_ratio:.3f} around p={self.sparsity:g} "
                f"(spread {self.spread:.3f}): {ranges}{bit}")


def plan_summary(classes: Mapping[str, str], sizes: Mapping[str, int], sparsity: float,
                 factors: Mapping[str, float] | None = None,
                 bound: float | None = None) -> PlanSummary:
    """:class:`PlanSummary` of :func:`personalized_plan` with the same arguments (``classes``
    and ``sizes`` keyed by linear layer)."""
    keys, raw, weights = _plan_inputs(classes, sizes, sparsity, factors)
    bounded = bound is not None and bound < 1
    if bounded:
        result = bounded_rescale(raw, weights, sparsity, float(bound))  # type: ignore[arg-type]
        ratios, low, high = result.ratios, result.clipped_low, result.clipped_high
    else:
        ratios, low, high = rescale(raw, weights, sparsity), [], []
    try:
        eq4_max: float | None = max(rescale(raw, weights, sparsity))
    except ValueError:
        eq4_max = None
    n = np.asarray(weights, dtype=np.float64)
    r = np.asarray(ratios, dtype=np.float64)
    spread = float(np.sqrt(np.dot((r - sparsity) ** 2, n) / n.sum()))
    class_ratios = {}
    counts = {}
    for cls in CLASSES:
        mine = [ratio for k, ratio in zip(keys, ratios) if classes[k] == cls]
        counts[cls] = len(mine)
        class_ratios[cls] = [min(mine), max(mine)] if mine else []
    return PlanSummary(sparsity, float(bound) if bounded else None, counts, class_ratios,
                       float(r.min()), float(r.max()), spread, bool(low or high),
                       {"low": [keys[i] for i in low], "high": [keys[i] for i in high]},
                       eq4_max)
