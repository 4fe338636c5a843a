"""The settings piece of chain-of-thought distillation and client retraining with LoRA (on the
:class:`fedcompress.config.Settings` base; PPC-GPT's settings class composes it, and its flat
names are ``fedcompress ppcgpt``'s options)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedcompress.config import Settings, setting
from fedcompress.distill.train import LoraSettings

__all__ = ["CoTDistillSettings"]


@dataclass(frozen=True)
class CoTDistillSettings(Settings):
    """LoRA training of the pruned model: CoT distillation on the server (``L_label +
    L_rationale``) and retraining at each client (the label loss)."""

    label: ClassVar[str] = "CoT distillation and retraining"

    rationales: bool = setting(True, "Use rationales (BI and loss).")
    server_retrain: bool = setting(True, "CoT distillation on the server.")
    server_epochs: float = setting(2.0, "Distillation epochs.", gt=0.0)
    server_steps: int = setting(0, "Distillation steps (> 0: instead of epochs).", ge=0)
    client_epochs: float = setting(2.0, "Client retraining epochs.", gt=0.0)
    client_steps: int = setting(0, "Client retraining steps (> 0: instead of epochs).", ge=0)
    lr: float = setting(3e-4, "LoRA learning rate.", gt=0.0)
    batch_size: int = setting(4, "Training batch size.", ge=1)
    grad_accum: int = setting(2, "Gradient accumulation steps.", ge=1)
    lora_r: int = setting(8, "LoRA rank.", ge=1)
    lora_alpha: float = setting(32.0, "LoRA alpha.", gt=0.0)
    lora_dropout: float = setting(0.1, "LoRA dropout, in [0, 1).", ge=0.0, lt=1.0)
    max_length: int = setting(192, "Tokens per training example.", ge=1)

    def lora(self) -> LoraSettings:
        return LoraSettings(r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout)
