"""Model helpers shared by evaluation, layer importance and distillation: the device a model
takes its inputs on, evaluation mode as a context, the default device, offline hub access."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Config attributes that carry a model's context length, in the order they are checked
# (the same order lm-eval uses, so both evaluators agree on a model's limit).

# Environment variables that make huggingface_hub / datasets / transformers stay offline.
_OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


def model_input_device(model: torch.nn.Module) -> torch.device:
    """Device the model expects its ``input_ids`` on (that of its input embeddings)."""
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    if isinstance(emb, torch.nn.Module):
        for p in emb.parameters():
            return p.device
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def resolve_device(model: torch.nn.Module, device: str | torch.device | None) -> torch.device:
    """Return the device for the inputs, checking it against where the model lives.

    The model is never moved (that would mutate it): ``device=None`` means "where the model's
    input embeddings are". A model dispatched over several devices by accelerate
    (``hf_device_map``) accepts inputs on the device passed explicitly.
    """
    model_dev = model_input_device(model)
    if device is None:
        return model_dev
    dev = torch.device(device)
    if getattr(model, "hf_device_map", None):
        return dev
    if dev.type != model_dev.type or (
        dev.index is not None and model_dev.index is not None and dev.index != model_dev.index
    ):
        raise ValueError(
            f"device={str(dev)!r} but the model is on {str(model_dev)!r}; move the model first "
            f"(model.to({str(dev)!r})) or pass device=None to evaluate where it is"
        )
    return model_dev


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Put ``model`` in eval mode for the duration of the block, then restore every module's flag.

    Restoring module by module (not with one ``model.train()``) keeps mixed states intact, e.g. a
    model in training mode with a frozen, eval-mode submodule.
    """
    flags = [(m, m.training) for m in model.modules()]
    if any(training for _, training in flags):
        logger.debug("model is in training mode; switching to eval mode for evaluation")
    model.eval()
    try:
        yield model
    finally:
        for module, training in flags:
            module.training = training


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Force huggingface_hub, datasets and transformers offline inside the block.

    Setting the environment variables alone is not enough once those libraries are imported
    (they read them at import time), so the module-level constants are patched as well. Both are
    restored on exit.
    """
    saved_env = {k: os.environ.get(k) for k in _OFFLINE_ENV}
    os.environ.update(_OFFLINE_ENV)
    patched: list[tuple[Any, str, Any]] = []

    def patch(module_name: str, attr: str, value: Any) -> None:
        import importlib

        try:
            module = importlib.import_module(module_name)
        except ImportError:  # pragma: no cover - the libraries are hard dependencies
            return
        if hasattr(module, attr):
            patched.append((module, attr, getattr(module, attr)))
            setattr(module, attr, value)

    try:
        patch("huggingface_hub.constants", "HF_HUB_OFFLINE", True)
        patch("huggingface_hub.constants", "HF_HUB_DISABLE_TELEMETRY", True)
        patch("datasets.config", "HF_HUB_OFFLINE", True)
        patch("datasets.config", "HF_DATASETS_OFFLINE", True)
        patch("datasets.config", "HF_UPDATE_DOWNLOAD_COUNTS", False)
        yield
    finally:
        for module, attr, value in reversed(patched):
            setattr(module, attr, value)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
