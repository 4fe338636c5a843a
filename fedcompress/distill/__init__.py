"""PPC-GPT's chain-of-thought distillation and client-side retraining (plain torch + peft; no
Flower import).

* :mod:`~fedcompress.distill.data`: samples -> label-task and rationale-task examples (task
  prefixes, loss on target tokens only, padding, length checks).
* :mod:`~fedcompress.distill.train`: LoRA training on ``L_label + lambda * L_rationale``
  (:func:`~fedcompress.distill.train.distill`, server side) or on ``L_label`` alone
  (:func:`~fedcompress.distill.train.retrain_client`, client side).
* :mod:`~fedcompress.distill.evaluate`: multiple-choice accuracy in the training prompt format
  (through :func:`fedcompress.eval.zero_shot`), usable as a training hook.
"""

from fedcompress.distill.data import (
    IGNORE_INDEX,
    LABEL_TASK,
    RATIONALE_TASK,
    TASKS,
    DistillData,
    DistillDataError,
    EmptyDataError,
    EncodedExample,
    LabelError,
    MissingRationaleError,
    PromptFormat,
    Sample,
    SequenceTooLongError,
    build_examples,
    collate,
    encode_example,
    normalize_samples,
    pad_token_id,
)
from fedcompress.distill.evaluate import EvalFn, accuracy_hook, mc_records, task_accuracy
from fedcompress.distill.train import (
    DistillResult,
    LoraSettings,
    NonFiniteLossError,
    TrainConfig,
    TrainMetrics,
    add_lora,
    distill,
    load_adapter,
    lora_target_modules,
    multitask_loss,
    retrain_client,
    target_ce_sum,
    task_loss,
    train_lora,
)

__all__ = [
    "IGNORE_INDEX",
    "LABEL_TASK",
    "RATIONALE_TASK",
    "TASKS",
    "DistillData",
    "DistillDataError",
    "DistillResult",
    "EmptyDataError",
    "EncodedExample",
    "EvalFn",
    "LabelError",
    "LoraSettings",
    "MissingRationaleError",
    "NonFiniteLossError",
    "PromptFormat",
    "Sample",
    "SequenceTooLongError",
    "TrainConfig",
    "TrainMetrics",
    "accuracy_hook",
    "add_lora",
    "build_examples",
    "collate",
    "distill",
    "encode_example",
    "load_adapter",
    "lora_target_modules",
    "mc_records",
    "multitask_loss",
    "normalize_samples",
    "pad_token_id",
    "retrain_client",
    "target_ce_sum",
    "task_accuracy",
    "task_loss",
    "train_lora",
]
