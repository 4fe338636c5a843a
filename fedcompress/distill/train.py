"""LoRA training for PPC-GPT: server-side CoT distillation and client-side retraining.

**Objective** (paper Sec. 3.5). Server side, on the synthetic set (Eq. 8-10)::

    L = L_label + lambda * L_rationale        (lambda = rationale_weight, 1 in the paper)

client side, on the client's private labelled data, the label loss alone (Eq. 11). Each task
loss is the cross-entropy of the task's target tokens given the prompt
(:mod:`fedcompress.distill.data`), averaged over the task's target tokens of the (effective)
batch, computed from logits cast to ``CALC_DTYPE`` (float32) whatever the model's dtype.

**Batches.** A micro-batch is ``batch_size`` samples; for each of them the label example and the
rationale example are both used (one forward/backward pass per task, each padded on its own), so
both losses see the same inputs ``x``. ``grad_accum`` micro-batches make one optimizer step.
The per-token normalisation is over the whole effective batch: every micro-batch's summed
cross-entropy is divided by the task's target-token count of all ``grad_accum`` micro-batches,
so the accumulated gradient is exactly that of the token mean over the effective batch (the
same as one big batch).

**Order and seeds.** Samples are drawn from a stream of permutations (one per epoch) of a
``torch.Generator`` seeded with ``seed``; micro-batches are consecutive chunks of that stream
(crossing epoch boundaries). LoRA initialisation and dropout use the global torch RNG, which is
seeded with ``seed`` inside :func:`torch.random.fork_rng`: the caller's RNG state is restored
afterwards. Same model, data and config: the same losses and adapter, bit for bit on the CPU.

**Optimisation.** AdamW on the LoRA parameters only (the base weights are frozen by ``peft``),
linear schedule with ``warmup_steps`` of linear warm-up then linear decay to 0 at the last step
(:func:`transformers.get_linear_schedule_with_warmup`), optional gradient clipping. A non-finite
loss or gradient norm stops training with :class:`NonFiniteLossError`, which names the step.

**LoRA.** ``peft`` LoRA on the model's linear layers inside its decoder layers (names from
:class:`~fedcompress.models.adapter.ModelAdapter`; not the embeddings or the LM head),
rank/alpha/dropout configurable (paper, LLaMa2: r=8, alpha=32, dropout=0.1). ``get_peft_model``
injects the LoRA modules into the given model in place; with ``merge=True`` they are merged into the
base weights at the end (``merge_and_unload``). A model that already is a ``PeftModel`` (e.g. a
client that received the server's adapter) keeps training its active adapter.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fedcompress.distill.data import (
    IGNORE_INDEX,
    LABEL_TASK,
    OVERFLOW,
    RATIONALE_TASK,
    DistillData,
    EmptyDataError,
    PromptFormat,
    build_examples,
    collate,
    pad_token_id,
)
from fedcompress.distill.evaluate import EvalFn
from fedcompress.eval.common import model_input_device
from fedcompress.models import CALC_DTYPE, ModelAdapter, model_context_length, save_model

__all__ = [
    "CALC_DTYPE",
    "DistillResult",
    "LoraSettings",
    "NonFiniteLossError",
    "TrainConfig",
    "TrainMetrics",
    "add_lora",
    "distill",
    "load_adapter",
    "lora_target_modules",
    "multitask_loss",
    "retrain_client",
    "target_ce_sum",
    "task_loss",
    "train_lora",
]

logger = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss (or the gradient norm) became NaN or infinite; ``step`` is 1-based."""

    def __init__(self, message: str, step: int, task: str | None = None,
                 micro_batch: int | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.task = task
        self.micro_batch = micro_batch


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters.

    Attributes:
        r: Rank.
        alpha: Scaling numerator (the update is scaled by ``alpha / r``).
        dropout: Dropout on the LoRA input.
        target_modules: Module names for ``peft`` (leaf names such as ``("q_proj", "v_proj")``
            or one regex string). ``None``: every linear layer inside the decoder layers
            (:func:`lora_target_modules`).
    """

    r: int = 8
    alpha: float = 32.0
    dropout: float = 0.1
    target_modules: tuple[str, ...] | str | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.r) or self.r < 1:
            raise ValueError(f"LoRA r={self.r!r} is invalid: expected an int >= 1")
        if not _is_number(self.alpha) or self.alpha <= 0:
            raise ValueError(f"LoRA alpha={self.alpha!r} is invalid: expected a number > 0")
        if not _is_number(self.dropout) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout={self.dropout!r} is invalid: expected 0 <= p < 1")
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.target_modules is not None and len(self.target_modules) == 0:
            raise ValueError("target_modules is empty: give module names or None for every "
                             "linear layer of the decoder layers")


@dataclass(frozen=True)
class TrainConfig:
    """Settings of :func:`distill`, :func:`retrain_client` and :func:`train_lora`.

    Attributes:
        lr: Peak learning rate (paper: 5e-5).
        max_steps: Optimizer steps; ``None``: ``ceil(epochs * samples / (batch_size *
            grad_accum))``.
        epochs: Passes over the samples when ``max_steps`` is ``None``.
        batch_size: Samples per micro-batch (each contributes one example per task).
        grad_accum: Micro-batches per optimizer step (effective batch ``batch_size *
            grad_accum``; paper: 32).
        warmup_steps: Steps of linear warm-up before the linear decay.
        weight_decay: AdamW weight decay.
        max_grad_norm: Gradient clipping norm (``None``: no clipping).
        rationale_weight: ``lambda`` in ``L_label + lambda * L_rationale`` (paper: 1); 0 trains
            on labels only. Ignored by :func:`retrain_client` (label loss only).
        seed: Seed of the sample order, LoRA initialisation and dropout.
        lora: LoRA settings.
        max_length: Longest prompt + target in tokens (paper: 64 question + 128 target).
        overflow: ``"error"`` or ``"truncate"`` (see :mod:`fedcompress.distill.data`).
        log_every: Log the losses every this many steps.
        eval_every: Run the evaluation hook every this many steps (it also runs before the
            first step and after the last); ``None``: before and after only.
        merge: Merge the adapter into the base weights at the end (``merge_and_unload``).
        progress: Show a progress bar.
    """

    lr: float = 5e-5
    max_steps: int | None = None
    epochs: float = 1.0
    batch_size: int = 8
    grad_accum: int = 4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    rationale_weight: float = 1.0
    seed: int = 0
    lora: LoraSettings = field(default_factory=LoraSettings)
    max_length: int = 256
    overflow: str = "error"
    log_every: int = 10
    eval_every: int | None = None
    merge: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if not _is_number(self.lr) or self.lr <= 0:
            raise ValueError(f"lr={self.lr!r} is invalid: expected a finite number > 0")
        if self.max_steps is not None and (not _is_int(self.max_steps) or self.max_steps < 1):
            raise ValueError(f"max_steps={self.max_steps!r} is invalid: expected an int >= 1 "
                             "or None")
        if not _is_number(self.epochs) or self.epochs <= 0:
            raise ValueError(f"epochs={self.epochs!r} is invalid: expected a number > 0")
        for name in ("batch_size", "grad_accum", "log_every", "max_length"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: expected an int >= 1")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps!r} is invalid: expected an "
                             "int >= 0")
        if not _is_number(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay!r} is invalid: expected >= 0")
        if self.max_grad_norm is not None and (not _is_number(self.max_grad_norm)
                                               or self.max_grad_norm <= 0):
            raise ValueError(f"max_grad_norm={self.max_grad_norm!r} is invalid: expected a "
                             "number > 0 or None")
        if not _is_number(self.rationale_weight) or self.rationale_weight < 0:
            raise ValueError(f"rationale_weight={self.rationale_weight!r} is invalid: expected "
                             "a finite number >= 0")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} is invalid: expected an int >= 0")
        if self.eval_every is not None and (not _is_int(self.eval_every) or self.eval_every < 1):
            raise ValueError(f"eval_every={self.eval_every!r} is invalid: expected an int >= 1 "
                             "or None")
        if self.overflow not in OVERFLOW:
            raise ValueError(f"overflow={self.overflow!r} is invalid: expected one of "
                             f"{OVERFLOW}")
        if not isinstance(self.lora, LoraSettings):
            raise ValueError(f"lora must be a LoraSettings, got {type(self.lora).__name__}")

    def steps_for(self, n_samples: int) -> int:
        """Optimizer steps for ``n_samples`` samples."""
        if self.max_steps is not None:
            return self.max_steps
        return max(1, math.ceil(self.epochs * n_samples / (self.batch_size * self.grad_accum)))

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        if isinstance(self.lora.target_modules, tuple):
            values["lora"]["target_modules"] = list(self.lora.target_modules)
        return values


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


def _to(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def target_ce_sum(model: nn.Module, batch: Mapping[str, torch.Tensor]
                  ) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy (float32) of the target tokens of ``batch`` and their count.

    Position ``t`` predicts ``input_ids[t + 1]``; only positions whose next label is not
    :data:`~fedcompress.distill.data.IGNORE_INDEX` count. The logits of those positions are
    cast to ``CALC_DTYPE`` before the log-softmax.
    """
    batch = _to(batch, model_input_device(model))
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                use_cache=False)
    logits = out.logits[:, :-1]
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE_INDEX
    n = int(keep.sum())
    if n == 0:
        raise EmptyDataError("the batch has no target token")
    ce = F.cross_entropy(logits[keep].to(CALC_DTYPE), labels[keep], reduction="sum")
    return ce, n


def task_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy (float32) over the target tokens of ``batch``."""
    ce, n = target_ce_sum(model, batch)
    return ce / n


def multitask_loss(model: nn.Module, batches: Mapping[str, Mapping[str, torch.Tensor]],
                   rationale_weight: float = 1.0) -> dict[str, torch.Tensor]:
    """``{"loss": L_label + lambda * L_rationale, "label": L_label, "rationale": ...}``.

    ``batches`` maps ``"label"`` (and optionally ``"rationale"``) to a collated batch; each
    task's loss is its token mean (:func:`task_loss`).
    """
    weights = {LABEL_TASK: 1.0, RATIONALE_TASK: float(rationale_weight)}
    unknown = set(batches) - set(weights)
    if unknown:
        raise ValueError(f"unknown task(s) {sorted(unknown)}: expected {sorted(weights)}")
    if not batches:
        raise EmptyDataError("no task batch given")
    parts = {task: task_loss(model, batch) for task, batch in batches.items()}
    parts["loss"] = sum(weights[t] * parts[t] for t in batches)  # type: ignore[assignment]
    return parts


# --------------------------------------------------------------------------------------------
# LoRA
# --------------------------------------------------------------------------------------------


def _is_peft(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """Drop the FutureWarning peft triggers through a property transformers 5 deprecated."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        yield


def lora_target_modules(model: nn.Module) -> str:
    """A ``peft`` regex matching exactly the linear layers inside the decoder layers.

    E.g. ``model\\.layers\\.\\d+\\.(mlp\\.down_proj|...|self_attn\\.v_proj)`` for LLaMA:
    the embeddings and the LM head are not adapted.
    """
    adapter = ModelAdapter(model)
    names = sorted({name for layer in adapter.layers
                    for name in ModelAdapter.linear_layers(layer)})
    if not names:
        raise ValueError(f"{type(model).__name__} has no linear layer in its decoder layers")
    return (re.escape(adapter.layers_path) + r"\.\d+\.("
            + "|".join(re.escape(n) for n in names) + ")")


def add_lora(model: nn.Module, lora: LoraSettings | None = None) -> nn.Module:
    """Wrap ``model`` with fresh LoRA adapters (in place), or reuse a ``PeftModel``'s adapter.

    The LoRA initialisation draws from the global torch RNG (seed it, as :func:`train_lora`
    does). A ``PeftModel`` is returned as is, with its active adapter's LoRA parameters made
    trainable (an adapter loaded with ``is_trainable=False`` is frozen).
    """
    from peft import LoraConfig, get_peft_model

    lora = lora or LoraSettings()
    if _is_peft(model):
        active = model.active_adapter
        n = 0
        for name, param in model.named_parameters():
            if "lora_" in name and f".{active}." in name + ".":
                param.requires_grad_(True)
                n += param.numel()
        logger.info("model already has LoRA adapter %r: training it (%d parameters)", active, n)
        return model
    target = lora.target_modules
    if target is None:
        target = lora_target_modules(model)
    elif not isinstance(target, str):
        target = list(target)
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=target, bias="none", task_type="CAUSAL_LM",
                        fan_in_fan_out=model.config.model_type == "gpt2")
    with _quiet_peft():
        return get_peft_model(model, config)


def load_adapter(model: nn.Module, path: str | Path, trainable: bool = False) -> nn.Module:
    """Load a saved adapter onto ``model`` (``PeftModel.from_pretrained``)."""
    from peft import PeftModel

    with _quiet_peft():
        return PeftModel.from_pretrained(model, str(path), is_trainable=trainable)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


@dataclass
class TrainMetrics:
    """What one training run did.

    Attributes:
        steps: Optimizer steps.
        micro_batches: Micro-batches (forward passes per task).
        samples_seen: Samples drawn (with repetition across epochs).
        epochs: ``samples_seen / samples``.
        weights: Task -> weight in the loss (``label`` 1, ``rationale`` lambda).
        loss: Total loss of every step (``sum_task weight * task loss``), before its update.
        task_loss: Task -> loss of every step (token mean over the effective batch).
        lr: Learning rate of every step.
        grad_norm: Gradient norm of every step (before clipping).
        target_tokens: Task -> target tokens trained on.
        evals: Results of the evaluation hook: ``{"step": k, "seconds": s, **metrics}``.
        train_seconds, eval_seconds, wall_seconds: Wall time training, evaluating, in all.
        trainable_params, total_params: Parameter counts of the trained model.
        data: Statistics of the training data (:attr:`DistillData.stats`).
        config: The configuration.
    """

    steps: int = 0
    micro_batches: int = 0
    samples_seen: int = 0
    epochs: float = 0.0
    weights: dict[str, float] = field(default_factory=dict)
    loss: list[float] = field(default_factory=list)
    task_loss: dict[str, list[float]] = field(default_factory=dict)
    lr: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    target_tokens: dict[str, int] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    wall_seconds: float = 0.0
    trainable_params: int = 0
    total_params: int = 0
    data: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DistillResult:
    """A trained model and its metrics.

    Attributes:
        model: The ``PeftModel`` (base model + adapter), or, with ``merged``, the base model
            with the adapter merged into its weights.
        metrics: :class:`TrainMetrics`.
        merged: Whether the adapter was merged.
    """

    model: nn.Module
    metrics: TrainMetrics
    merged: bool = False

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The LoRA tensors (``peft.get_peft_model_state_dict``), e.g. to send to clients."""
        if self.merged:
            raise ValueError("the adapter was merged into the model: there is no adapter state")
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}

    def save(self, path: str | Path, tokenizer: Any = None) -> Path:
        """``save_pretrained`` the adapter (or the merged model), the tokenizer if given, and
        ``train_metrics.json``.

        An adapter alone is reloaded with :func:`load_adapter` onto the SAME base model: for a
        pruned model that is the pruned model (save it before distilling, or merge to get one
        self-contained model directory).
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.merged:  # a whole model: the one model writer, in the model's own dtype
            save_model(self.model, path, tokenizer)
        else:  # the adapter alone (peft's format)
            self.model.save_pretrained(path)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
        (path / "train_metrics.json").write_text(
            json.dumps(self.metrics.to_dict(), indent=2, default=str), encoding="utf-8")
        return path


def _index_stream(n: int, generator: torch.Generator) -> Iterator[int]:
    while True:
        yield from torch.randperm(n, generator=generator).tolist()


def _rng_devices(device: torch.device) -> list[int]:
    if device.type == "cuda":
        return [device.index if device.index is not None else torch.cuda.current_device()]
    return []


def _run_eval(eval_fn: EvalFn, model: nn.Module, step: int, metrics: TrainMetrics) -> None:
    start = time.perf_counter()
    values = dict(eval_fn(model))
    seconds = time.perf_counter() - start
    metrics.eval_seconds += seconds
    metrics.evals.append({"step": step, "seconds": seconds, **values})
    logger.info("eval at step %d: %s", step,
                ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in values.items()))


def _accumulate_gradients(model: nn.Module, data: DistillData, groups: list[list[int]],
                          weights: dict[str, float], pad_id: int, step: int, steps: int,
                          lr: float) -> tuple[dict[str, float], dict[str, int]]:
    """Forward/backward every task of every micro-batch of one optimizer step.

    Each micro-batch's summed cross-entropy is divided by the task's target-token count over
    ALL ``groups``, so the gradients add up to those of ``sum_task weight * token-mean loss`` of
    the effective batch. Returns the summed cross-entropy and the target-token count per task.
    """
    counts = {t: sum(data.examples[t][i].target_tokens for g in groups for i in g)
              for t in weights}
    sums = {t: 0.0 for t in weights}
    for micro, group in enumerate(groups):
        for task, weight in weights.items():
            ce, _ = target_ce_sum(model, collate([data.examples[task][i] for i in group], pad_id))
            if not torch.isfinite(ce):
                raise NonFiniteLossError(
                    f"non-finite {task} loss ({float(ce.detach())}) at step {step}/{steps} "
                    f"(micro-batch {micro + 1}/{len(groups)}); lower lr (now {lr:g}) or check "
                    "the model and data", step=step, task=task, micro_batch=micro + 1)
            (ce * (weight / counts[task])).backward()
            sums[task] += float(ce.detach())
    return sums, counts


def train_lora(model: nn.Module, data: DistillData, config: TrainConfig, pad_id: int = 0,
               eval_fn: EvalFn | None = None) -> DistillResult:
    """Train LoRA adapters of ``model`` on encoded data (see the module docstring).

    Every task in ``data`` is trained: ``label`` with weight 1, ``rationale`` with
    ``config.rationale_weight`` (skipped when 0).

    Args:
        model: A causal LM of a supported architecture, or a ``PeftModel``. LoRA modules are
            injected in place; the base weights are frozen and stay unchanged unless
            ``config.merge``. Trained where it lives; its training flags are restored after.
        data: :func:`~fedcompress.distill.data.build_examples` output.
        config: :class:`TrainConfig`.
        pad_id: Token id used for padding (masked out; its value does not matter).
        eval_fn: Optional hook ``model -> {name: number}`` run before the first step, every
            ``config.eval_every`` steps and after the last (e.g.
            :func:`fedcompress.distill.evaluate.accuracy_hook`).

    Returns:
        :class:`DistillResult`.

    Raises:
        EmptyDataError: no samples or no task to train.
        ValueError: a sequence longer than the model's context.
        NonFiniteLossError: a NaN/inf loss or gradient norm (names the step).
    """
    from transformers import get_linear_schedule_with_warmup

    wall_start = time.perf_counter()
    if len(data) == 0:
        raise EmptyDataError("no samples to train on")
    weights = _task_weights(data, config)
    context = model_context_length(model)
    if context is not None and data.longest > context:
        raise ValueError(f"the longest example has {data.longest} tokens, more than the model's "
                         f"context of {context}: lower max_length")
    device = model_input_device(model)
    n = len(data)
    steps = config.steps_for(n)
    metrics = TrainMetrics(weights=dict(weights), task_loss={t: [] for t in weights},
                           target_tokens={t: 0 for t in weights}, data=dict(data.stats),
                           config=config.to_dict())
    metrics.data["format"] = data.format.to_dict()

    with torch.random.fork_rng(devices=_rng_devices(device)):
        torch.manual_seed(config.seed)
        model = add_lora(model, config.lora)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameter after adding LoRA")
        metrics.trainable_params = sum(p.numel() for p in params)
        metrics.total_params = sum(p.numel() for p in model.parameters())
        logger.info("LoRA training: %d samples, tasks %s, %d steps of %d x %d samples, lr %g, "
                    "%d trainable of %d parameters", n, weights, steps, config.batch_size,
                    config.grad_accum, config.lr, metrics.trainable_params, metrics.total_params)
        optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        scheduler = get_linear_schedule_with_warmup(optimizer, config.warmup_steps, steps)
        order = _index_stream(n, torch.Generator().manual_seed(config.seed))
        flags = [(m, m.training) for m in model.modules()]

        if eval_fn is not None:
            _run_eval(eval_fn, model, 0, metrics)
        try:
            bar = tqdm(range(1, steps + 1), desc="distill", unit="step",
                       disable=not config.progress)
            for step in bar:
                train_start = time.perf_counter()
                model.train()
                groups = [[next(order) for _ in range(config.batch_size)]
                          for _ in range(config.grad_accum)]
                sums, counts = _accumulate_gradients(model, data, groups, weights, pad_id,
                                                     step, steps, config.lr)
                metrics.micro_batches += len(groups)
                max_norm = config.max_grad_norm if config.max_grad_norm is not None else math.inf
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
                if not math.isfinite(grad_norm):
                    raise NonFiniteLossError(
                        f"non-finite gradient norm ({grad_norm}) at step {step}/{steps}; lower "
                        f"lr (now {config.lr:g})", step=step)
                metrics.lr.append(float(scheduler.get_last_lr()[0]))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)

                losses, total = _record_step(metrics, step, weights, sums, counts, grad_norm,
                                             config.batch_size * config.grad_accum)
                metrics.train_seconds += time.perf_counter() - train_start
                bar.set_postfix(loss=f"{total:.4f}")
                if step % config.log_every == 0 or step == steps:
                    logger.info("step %d/%d loss %.4f (%s) lr %.3g grad_norm %.3g", step, steps,
                                total, ", ".join(f"{t} {v:.4f}" for t, v in losses.items()),
                                metrics.lr[-1], grad_norm)
                if eval_fn is not None and (
                        step == steps or (config.eval_every and step % config.eval_every == 0)):
                    _run_eval(eval_fn, model, step, metrics)
        finally:
            for module, training in flags:
                module.training = training
            optimizer.zero_grad(set_to_none=True)

    metrics.epochs = metrics.samples_seen / n
    merged = False
    if config.merge:
        model = model.merge_and_unload()
        merged = True
    metrics.wall_seconds = time.perf_counter() - wall_start
    logger.info("LoRA training done: %d steps in %.1fs (train %.1fs, eval %.1fs), loss %.4f -> "
                "%.4f", metrics.steps, metrics.wall_seconds, metrics.train_seconds,
                metrics.eval_seconds, metrics.loss[0], metrics.loss[-1])
    return DistillResult(model, metrics, merged)


def _task_weights(data: Any, config: TrainConfig) -> dict[str, float]:
    """Loss weight of each task present in ``data`` (label 1, rationale ``rationale_weight``;
    tasks of weight 0 are left out); an error when none is left."""
    weights = {LABEL_TASK: 1.0, RATIONALE_TASK: float(config.rationale_weight)}
    weights = {t: weights[t] for t in data.tasks if weights[t] > 0}
    if not weights:
        raise EmptyDataError(f"no task to train: data has {data.tasks}, rationale_weight="
                             f"{config.rationale_weight}")
    return weights


def _record_step(metrics: TrainMetrics, step: int, weights: dict[str, float],
                 sums: dict[str, float], counts: dict[str, int], grad_norm: float,
                 samples: int) -> tuple[dict[str, float], float]:
    """Add one optimizer step to ``metrics``: each task's token-mean loss, their weighted
    total, the gradient norm and the counts; returns (losses, total)."""
    losses = {t: sums[t] / counts[t] for t in weights}
    total = sum(weights[t] * losses[t] for t in weights)
    metrics.steps = step
    metrics.samples_seen += samples
    metrics.loss.append(total)
    metrics.grad_norm.append(grad_norm)
    for t in weights:
        metrics.task_loss[t].append(losses[t])
        metrics.target_tokens[t] += counts[t]
    return losses, total


def distill(model: nn.Module, tokenizer: Any, samples: Iterable[Any],
            config: TrainConfig | None = None, fmt: PromptFormat | None = None,
            eval_fn: EvalFn | None = None) -> DistillResult:
    """Server-side CoT distillation: LoRA on ``L_label + lambda * L_rationale`` (Eq. 8).

    ``samples`` are synthetic samples with rationales (:class:`fedcompress.synth.SyntheticSample`
    or records with ``question``, ``choices``, ``label``, ``rationale``). With
    ``config.rationale_weight == 0`` only labels are used (rationales may be missing).
    """
    config = config or TrainConfig()
    tasks = (LABEL_TASK, RATIONALE_TASK) if config.rationale_weight > 0 else (LABEL_TASK,)
    data = build_examples(samples, tokenizer, tasks=tasks, fmt=fmt,
                          max_length=config.max_length, overflow=config.overflow)
    return train_lora(model, data, config, pad_id=pad_token_id(tokenizer), eval_fn=eval_fn)


def retrain_client(model: nn.Module, tokenizer: Any, records: Iterable[Any],
                   config: TrainConfig | None = None, fmt: PromptFormat | None = None,
                   eval_fn: EvalFn | None = None) -> DistillResult:
    """Client-side retraining on private labelled data: the label loss only (Eq. 11).

    ``records`` need ``question``, ``choices``, ``label`` (any rationale is ignored;
    ``config.rationale_weight`` is ignored). ``model`` is the pruned model the server sent, or
    a ``PeftModel`` carrying the server's adapter (which is then trained further).
    """
    config = config or TrainConfig()
    data = build_examples(records, tokenizer, tasks=(LABEL_TASK,), fmt=fmt,
                          max_length=config.max_length, overflow=config.overflow)
    return train_lora(model, data, config, pad_id=pad_token_id(tokenizer), eval_fn=eval_fn)
