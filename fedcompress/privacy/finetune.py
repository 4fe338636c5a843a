"""(DP-)fine-tuning of a classifier or of a causal LM on private text: LoRA ("W + LR") or every
weight ("Train"), with or without DP-SGD (PrunePrivyTune Sec. 4.2, Alg. 2).

**Objectives.** A classifier of :mod:`fedcompress.privacy.classifier` on labelled data: the
cross-entropy of its class logits. A causal LM on text (:func:`~fedcompress.privacy.classifier.
encode_lm`, no labels): each example's mean token cross-entropy, averaged over the batch (so
under DP one example is one sequence, whatever its length).

**Modes.** ``"lora"``: ``peft`` LoRA adapters on the linear layers inside the model's layers (the
names of :class:`~fedcompress.models.adapter.ModelAdapter`), plus, for an encoder, its new
classification head (trained in full: it starts random); the rest frozen. ``"full"``: every
parameter trained (the paper's "Train": re-training the pruned model).

**DP-SGD** (``epsilon`` set). Per-example gradients by opacus' hooks
(:class:`opacus.GradSampleModule`), each example's gradient over all trainable parameters
clipped to L2 norm ``max_grad_norm`` (flat clipping), summed, Gaussian noise of std
``sigma * max_grad_norm`` added, divided by the expected batch size (opacus'
:class:`~opacus.optimizers.DPOptimizer`). Batches are Poisson samples: each example enters each
step independently with probability ``q = batch_size / n`` (a step whose sample is empty still
adds noise, as the analysis assumes). The noise multiplier ``sigma`` for ``(epsilon, delta)`` over
the planned steps is computed ONCE before training (:func:`fedcompress.privacy.accounting.
noise_multiplier`); the epsilon spent is the accountant's for the steps taken. Alg. 2 of the
paper clips the *batch* gradient of L and R separately; that bounds no single example's influence
and is not DP, so we follow DP-SGD (Abadi et al. 2016) as Sec. 3.2.1 describes it.

**Without DP**, batches are consecutive chunks of seeded permutations of the data (one per epoch)
of exactly ``batch_size`` examples, and the same number of steps is taken as under DP, so the two
runs see the same expected number of examples.

**Optimiser.** AdamW (``lr``, no weight decay on the LoRA factors by default) on the trainable
parameters, constant learning rate. Loss: cross-entropy of the class logits in ``CALC_DTYPE``.

**Seeds.** LoRA initialisation, the encoder head, dropout and the batches without DP
(permutations) derive from ``seed``; the caller's RNG state is restored afterwards. The DP noise
and the DP batches (Poisson samples) do NOT: by default both are drawn from fresh secret seeds
(OS entropy, never recorded), because anyone who knows the noise can subtract it and the
guarantee is gone, and anyone who knows which examples each step sampled loses the
amplification by subsampling (a claimed epsilon 8 becomes about 32 for the worst example);
``noise_seed`` makes both reproducible
for research (:func:`fedcompress.privacy.accounting.noise_seed`), and the result's notes then say
that the epsilon does not hold against whoever knows that seed. With ``noise_seed`` set (or
without DP), same inputs and config give the same losses and weights on the CPU.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fedcompress.eval.common import model_input_device
from fedcompress.models import ModelAdapter
from fedcompress.privacy.accounting import (
    ACCOUNTANTS,
    Budget,
    check_budget,
    epsilon_spent,
    noise_multiplier,
    noise_seed,
)
from fedcompress.privacy.classifier import (
    Encoded,
    LabelTokenClassifier,
    is_encoder,
    lm_loss,
    logits_of,
    pad_batch,
)
from fedcompress.privacy.settings import MODES

__all__ = [
    "MODES",
    "FinetuneConfig",
    "FinetuneResult",
    "NonFiniteLossError",
    "finetune",
    "prepare_trainable",
    "train_prepared",
]

logger = logging.getLogger(__name__)



class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite (the step is named)."""


@dataclass(frozen=True)
class FinetuneConfig:
    """How to fine-tune (module docstring).

    Attributes:
        mode: ``"lora"`` or ``"full"``.
        epochs: Passes over the data (may be fractional): ``steps = ceil(epochs * n / batch)``.
        batch_size: Examples per step (under DP: the expected size of the Poisson sample).
        lr: AdamW learning rate.
        lora_r, lora_alpha, lora_dropout: LoRA's rank, scale numerator and dropout.
        epsilon: Target epsilon of DP-SGD; None trains without DP.
        delta: Target delta (used only with ``epsilon``).
        max_grad_norm: Per-example clipping norm ``C`` (DP only).
        accountant: ``"rdp"`` or ``"prv"``.
        seed: Seeds everything random (module docstring).
        physical_batch_size: Most examples per forward/backward pass (0: the whole batch). A
            larger (logical) batch is processed in chunks and takes ONE optimiser step: under DP
            each chunk's per-example gradients are clipped and summed (opacus'
            ``signal_skip_step``, as its ``BatchMemoryManager`` does) and the noise is added
            once; without DP the chunks' gradients are accumulated. Memory then grows with this
            size, not the batch: DP per-example gradients cost ``trainable x chunk x 4`` bytes.
        noise_seed: Seed of the DP noise and of the DP Poisson sampling: None (default)
            fresh secret ones; an int >= 0 reproducible draws, mixed with ``seed`` (so a
            federated site's rounds differ; research only: the epsilon does not hold against
            whoever knows it).
    """

    mode: str = "lora"
    epochs: float = 1.0
    batch_size: int = 16
    lr: float = 1e-3
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    epsilon: float | None = None
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    accountant: str = "rdp"
    seed: int = 0
    physical_batch_size: int = 0
    noise_seed: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is invalid: expected one of {MODES}")
        if not _positive(self.epochs):
            raise ValueError(f"epochs={self.epochs!r} is invalid: expected a number > 0")
        for name in ("batch_size", "lora_r", "lora_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: expected an int >= 1")
        physical = self.physical_batch_size
        if isinstance(physical, bool) or not isinstance(physical, int) or physical < 0:
            raise ValueError(f"physical_batch_size={physical!r} is invalid: expected an int "
                             ">= 0 (0: the whole batch)")
        if not _positive(self.lr):
            raise ValueError(f"lr={self.lr!r} is invalid: expected a number > 0")
        if not (isinstance(self.lora_dropout, (int, float)) and 0 <= self.lora_dropout < 1):
            raise ValueError(f"lora_dropout={self.lora_dropout!r} is invalid: expected [0, 1)")
        if self.epsilon is not None:
            check_budget(self.epsilon, self.delta)
            if not _positive(self.max_grad_norm):
                raise ValueError(f"max_grad_norm={self.max_grad_norm!r} is invalid: expected a "
                                 "number > 0")
        if self.noise_seed is not None:
            noise_seed(self.noise_seed)  # validates
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant={self.accountant!r} is invalid: expected one of "
                             f"{ACCOUNTANTS}")

    @property
    def private(self) -> bool:
        return self.epsilon is not None

    def steps_for(self, n: int) -> int:
        """Optimiser steps for ``n`` training examples."""
        return max(1, math.ceil(self.epochs * n / self.batch_size))


def _positive(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value) and value > 0)


@dataclass
class FinetuneResult:
    """What a fine-tuning run did.

    Attributes:
        model: The trained classifier (LoRA: still a ``PeftModel``, unmerged).
        losses: Mean training loss per step (NaN for an empty Poisson sample).
        steps: Steps taken.
        trainable: Trainable parameters.
        seconds: Wall time of the training loop.
        budget: The DP budget (None without DP).
        notes: What had to be adapted (e.g. a parameter opacus cannot handle), for the report.
    """

    model: nn.Module
    losses: list[float]
    steps: int
    trainable: int
    seconds: float
    budget: Budget | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / max(self.steps, 1)

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "trainable": self.trainable, "seconds": self.seconds,
                "seconds_per_step": self.seconds_per_step, "losses": list(self.losses),
                "budget": self.budget.to_dict() if self.budget else None,
                "notes": list(self.notes)}


def _lora_targets(model: nn.Module) -> list[str]:
    """Names (relative to a layer) of the linear layers inside the model's layers."""
    base = model.lm if isinstance(model, LabelTokenClassifier) else model
    layers = ModelAdapter(base).layers
    names = sorted({name.rsplit(".", 1)[-1] for name in ModelAdapter.linear_layers(layers[0])})
    if not names:
        raise ValueError(f"{type(base).__name__}: no linear layer inside its layers for LoRA")
    return names


def prepare_trainable(model: nn.Module, config: FinetuneConfig) -> tuple[nn.Module, list[str]]:
    """The model with the parameters of ``config.mode`` trainable (LoRA: wrapped by ``peft``);
    and notes on what was adapted."""
    notes: list[str] = []
    if config.mode == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return model, notes
    from peft import LoraConfig, get_peft_model

    encoder = is_encoder(model)
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha,
                      lora_dropout=config.lora_dropout, target_modules=_lora_targets(model),
                      modules_to_save=["classifier"] if encoder else None, bias="none")
    if isinstance(model, LabelTokenClassifier):
        model.lm = get_peft_model(model.lm, lora)
        return model, notes
    return get_peft_model(model, lora), notes


def _batches(n: int, config: FinetuneConfig, steps: int, generator: torch.Generator
             ) -> Iterator[list[int]]:
    """Index lists, one per step: Poisson samples under DP, else permutation chunks."""
    if config.private:
        q = min(1.0, config.batch_size / n)
        for _ in range(steps):
            yield torch.nonzero(torch.rand(n, generator=generator) < q).flatten().tolist()
        return
    stream: list[int] = []
    for _ in range(steps):
        while len(stream) < config.batch_size:
            stream += torch.randperm(n, generator=generator).tolist()
        yield stream[:config.batch_size]
        stream = stream[config.batch_size:]


def finetune(model: nn.Module, train: Encoded, config: FinetuneConfig, pad: int,
             progress: bool = True, on_step: Callable[[int, float], None] | None = None
             ) -> FinetuneResult:
    """Fine-tune ``model`` (a classifier of :mod:`fedcompress.privacy.classifier`, or a causal
    LM on :func:`~fedcompress.privacy.classifier.encode_lm` data) on ``train``.

    The model is modified in place (and, in LoRA mode, wrapped: use the result's ``model``). The
    trainable parameters are chosen (:func:`prepare_trainable`, seeded), then
    :func:`train_prepared` runs; under DP its noise multiplier is set for ``(epsilon, delta)``
    over this run's steps.

    Raises:
        ValueError: an empty split; a model opacus cannot wrap (named, with opacus' reason).
        BudgetError: a budget no noise multiplier reaches for these steps.
        NonFiniteLossError: a NaN/inf loss.
    """
    if len(train) == 0:
        raise ValueError("the training split is empty: expected at least one example")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model, notes = prepare_trainable(model, config)
    result = train_prepared(model, train, config, pad, progress=progress, on_step=on_step)
    result.notes[:0] = notes
    return result


def train_prepared(model: nn.Module, train: Encoded, config: FinetuneConfig, pad: int,
                   sigma: float | None = None, progress: bool = True,
                   on_step: Callable[[int, float], None] | None = None) -> FinetuneResult:
    """The training loop on a model whose trainable parameters are already chosen (e.g. a
    federated site continuing the global adapter): ``config.steps_for(n)`` steps.

    Under DP, ``sigma`` is the noise multiplier (a federated site passes the one of its whole
    planned run); None computes it for ``(epsilon, delta)`` over these steps. The returned
    budget's ``spent`` is for these steps alone.
    """
    n = len(train)
    if n == 0:
        raise ValueError("the training split is empty: expected at least one example")
    steps = config.steps_for(n)
    device = model_input_device(model)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameter: expected prepare_trainable first")
    trainable = sum(p.numel() for p in params)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(params, lr=config.lr,
                                                             weight_decay=0.0)
        runner: nn.Module = model
        sample_rate = min(1.0, config.batch_size / n)
        if config.private:
            if sigma is None:
                sigma = noise_multiplier(config.epsilon, config.delta, sample_rate, steps,
                                         config.accountant)
            noise = torch.Generator(device=device).manual_seed(
                noise_seed(config.noise_seed, config.seed))
            runner, optimizer = _make_private(model, optimizer, sigma, config, noise)
        # DP's Poisson sampling is secret too (module docstring); a salt apart from the noise's
        generator = torch.Generator().manual_seed(
            noise_seed(config.noise_seed, config.seed, 1) if config.private else config.seed)
        losses: list[float] = []
        runner.train()
        start = time.perf_counter()
        try:
            for step, batch in enumerate(tqdm(
                    _batches(n, config, steps, generator), total=steps, unit="step",
                    desc=f"fine-tune ({config.mode}{', DP' if config.private else ''})",
                    disable=not progress)):
                loss = _step(runner, optimizer, train, batch, pad, device,
                             config.physical_batch_size)
                if not math.isfinite(loss) and batch:
                    raise NonFiniteLossError(f"training loss is {loss} at step {step}: "
                                             "lower lr")
                losses.append(loss)
                if on_step is not None:
                    on_step(step, loss)
        finally:
            runner.eval()
            if config.private:
                _unwrap(runner)
        seconds = time.perf_counter() - start
    budget = None
    if config.private:
        budget = Budget(epsilon=float(config.epsilon), delta=config.delta, sigma=float(sigma),
                        sample_rate=sample_rate, planned_steps=steps, steps=steps,
                        spent=epsilon_spent(sigma, sample_rate, steps, config.delta,
                                            config.accountant),
                        accountant=config.accountant, max_grad_norm=config.max_grad_norm)
    finite = [x for x in losses if math.isfinite(x)]
    logger.info("fine-tuned (%s%s) %d params for %d steps in %.1fs: loss %.4f -> %.4f%s",
                config.mode, ", DP" if config.private else "", trainable, steps, seconds,
                finite[0] if finite else float("nan"), finite[-1] if finite else float("nan"),
                f", epsilon spent {budget.spent:.3f}" if budget else "")
    notes = []
    if config.private and config.noise_seed is not None:
        notes.append(f"DP noise and sampling reproducible from noise_seed={config.noise_seed}: "
                     "the epsilon "
                     "does NOT hold against anyone who knows that seed (research only)")
    return FinetuneResult(model, losses, steps, trainable, seconds, budget, notes)


def _make_private(model: nn.Module, optimizer: torch.optim.Optimizer, sigma: float,
                  config: FinetuneConfig, noise: torch.Generator | None = None
                  ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Wrap for DP-SGD: opacus' GradSampleModule (hooks) and DPOptimizer (flat clipping; its
    Gaussian noise drawn from ``noise``, seeded apart from the batches)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    try:
        runner = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=True)
    except Exception as err:  # noqa: BLE001 - opacus raises several types; name the model
        raise ValueError(f"opacus cannot wrap {type(model).__name__} for per-example gradients "
                         f"({err}); expected layers opacus supports") from err
    dp_optimizer = DPOptimizer(optimizer, noise_multiplier=sigma,
                               max_grad_norm=config.max_grad_norm,
                               expected_batch_size=config.batch_size, loss_reduction="mean",
                               generator=noise)
    return runner, dp_optimizer


def _unwrap(runner: nn.Module) -> None:
    """Remove opacus' hooks so the trained model is a plain module again."""
    remove = getattr(runner, "_close", None)
    if callable(remove):
        remove()


def _step(runner: nn.Module, optimizer: torch.optim.Optimizer, train: Encoded, batch: list[int],
          pad: int, device: torch.device, physical: int = 0) -> float:
    with warnings.catch_warnings():
        # opacus' hooks on modules whose inputs need no gradient (frozen layers below LoRA)
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        return _step_inner(runner, optimizer, train, batch, pad, device, physical)


def _step_inner(runner: nn.Module, optimizer: torch.optim.Optimizer, train: Encoded,
                batch: list[int], pad: int, device: torch.device, physical: int = 0) -> float:
    """One optimiser step on ``batch``, in chunks of at most ``physical`` examples (0: one
    chunk); returns the batch's mean loss."""
    optimizer.zero_grad(set_to_none=True)
    if not batch:  # an empty Poisson sample: the step is noise alone
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        optimizer.step()
        return float("nan")
    size = physical or len(batch)
    chunks = [batch[i:i + size] for i in range(0, len(batch), size)]
    private = hasattr(optimizer, "signal_skip_step")
    total = 0.0
    for k, chunk in enumerate(chunks):
        last = k == len(chunks) - 1
        input_ids, attention = pad_batch([train.ids[i] for i in chunk], pad)
        input_ids, attention = input_ids.to(device), attention.to(device)
        if train.language_modelling:
            loss = lm_loss(runner, input_ids, attention).mean()
        else:
            labels = torch.tensor([train.labels[i] for i in chunk], device=device)
            loss = F.cross_entropy(logits_of(runner, input_ids, attention), labels)
        total += float(loss.detach()) * len(chunk)
        if private:
            # per-example gradients: opacus undoes the chunk's mean; each chunk is clipped and
            # summed, the noise and the update come with the last one
            loss.backward()
            optimizer.signal_skip_step(do_skip=not last)  # type: ignore[attr-defined]
            optimizer.step()
            if not last:
                optimizer.zero_grad(set_to_none=True)  # keeps the summed clipped gradients
        else:
            (loss * (len(chunk) / len(batch))).backward()
    if not private:
        optimizer.step()
    return total / len(batch)
